"""Sweep speculative settings: one server per (steps, topk, draft tokens), one fixed workload each,
and a markdown table of accept length, throughput and the prefill batches the server ran.

    python benchmark/spec_sweep.py --model-path M --speculative-algorithm NEXTN \
        --configs 1,1,2 3,1,4 5,1,6 3,4,8 adaptive:1,3,5 --baseline \
        --dataset-name file --dataset-path prompts.jsonl --num-prompts 32 --max-concurrency 1 \
        -- --cuda-graph-max-bs 32

--configs takes steps,topk,draft_tokens triples and `adaptive:STEPS` (a server with
--speculative-adaptive over those tiers, e.g. adaptive:1,3,5; `adaptive` alone: the server's
default tiers); --baseline adds a run without speculation (the speed-up column is relative to
it); --concurrencies 1 32 runs the workload at each concurrency on the same server. The "vs
best fixed" column is a row's throughput over the best fixed configuration's at the same
concurrency, and "tier cycles" the decode cycles an adaptive server ran at each tier during
the recorded pass (all DP ranks). --recorded-passes N records the workload N times per
concurrency and reports the pass of median throughput, with the range of all N beside it: at
high concurrency one pass's throughput moves with how many prefill batches its arrivals made.
Other flags before `--` describe the workload and are python -m sglang.bench_serving's; flags
after `--` go to every server.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any, Optional, Union

import requests

from sglang.bench_serving import get_parser as bench_parser
from sglang.bench_serving import run_benchmark
from sglang.test.server_utils import kill_server, popen_launch_server


@dataclass(frozen=True)
class Adaptive:
    """--speculative-adaptive over these tiers (empty: the server's default tiers)."""

    tiers: tuple[int, ...] = ()


# (steps, topk, draft tokens), or adaptive tiers; None: no speculation.
Config = Optional[Union[tuple[int, int, int], Adaptive]]


def parse_config(text: str) -> Union[tuple[int, int, int], Adaptive]:
    if text == "adaptive" or text.startswith("adaptive:"):
        return Adaptive(tuple(int(x) for x in text.removeprefix("adaptive").removeprefix(":").split(",") if x))
    steps, topk, draft = (int(x) for x in text.split(","))
    return steps, topk, draft


def server_flags(args: argparse.Namespace, config: Config) -> list[str]:
    if config is None:
        return []
    flags = ["--speculative-algorithm", args.speculative_algorithm]
    if args.speculative_draft_model_path:
        flags += ["--speculative-draft-model-path", args.speculative_draft_model_path]
    if isinstance(config, Adaptive):
        tiers = ["--speculative-adaptive-steps", ",".join(map(str, config.tiers))] if config.tiers else []
        return flags + ["--speculative-adaptive", *tiers]
    steps, topk, draft = config
    return flags + [
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(draft),
    ]


def count_prefill_batches(server_log: str) -> int:
    """The scheduler's "Prefill batch." log lines so far (every prefill stops the decoding batch)."""
    with open(server_log, errors="replace") as f:
        return sum("Prefill batch." in line for line in f)


def internal_states(base_url: str) -> list[dict[str, Any]]:
    """Each DP rank's scheduler state, from /get_server_info (in DP-rank order)."""
    return requests.get(f"{base_url}/get_server_info", timeout=30).json()["internal_states"]


def tier_cycles(base_url: str) -> dict[int, int]:
    """Decode cycles per tier since startup, summed over the DP ranks (empty unless adaptive)."""
    total: dict[int, int] = {}
    for state in internal_states(base_url):
        for steps, cycles in state.get("spec_tier_cycles", {}).items():
            total[int(steps)] = total.get(int(steps), 0) + cycles
    return total


def print_tier_state(base_url: str) -> None:
    """An adaptive server's measured cycle time and accept length per tier, per DP rank (JSON lines)."""
    for rank, state in enumerate(internal_states(base_url)):
        keys = ("spec_tier_cycles", "spec_tier_accept_length", "spec_tier_cycle_us", "spec_position_accept_rate")
        print(json.dumps({"dp_rank": rank, **{k: state.get(k) for k in keys}}), flush=True)


def run_one(
    args: argparse.Namespace, bench_args: argparse.Namespace, server_argv: list[str], config: Config
) -> list[tuple[Config, dict[str, Any]]]:
    """One server with `config`; per concurrency the workload --warmup-passes times unrecorded (every
    kernel variant its batches need compiles outside the measurement), then --recorded-passes
    times recorded; the cache is flushed before each pass."""
    server = popen_launch_server(args.model_path, [*server_flags(args, config), *server_argv], timeout=args.launch_timeout)
    try:
        rows = []
        for concurrency in args.concurrencies or [bench_args.max_concurrency]:
            run_args = argparse.Namespace(
                **{**vars(bench_args), "base_url": server.base_url, "max_concurrency": concurrency, "flush_cache": True}
            )
            for _ in range(args.warmup_passes):
                run_benchmark(argparse.Namespace(**{**vars(run_args), "output_file": None}))
            rows.append((config, median_pass([recorded_pass(server, run_args) for _ in range(args.recorded_passes)])))
        if isinstance(config, Adaptive):
            print_tier_state(server.base_url)
        return rows
    finally:
        kill_server(server)


def recorded_pass(server, run_args: argparse.Namespace) -> dict[str, Any]:
    """One recorded run of the workload, with the prefill batches and tier cycles it caused."""
    prefills_before, tiers_before = count_prefill_batches(server.log_path), tier_cycles(server.base_url)
    metrics = run_benchmark(run_args)
    metrics["prefill_batches"] = count_prefill_batches(server.log_path) - prefills_before
    tiers = tier_cycles(server.base_url)
    metrics["tier_cycles"] = {s: n - tiers_before.get(s, 0) for s, n in tiers.items()}
    return metrics


def median_pass(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The pass of median output throughput (the lower middle one of an even count), with every
    pass's throughput under "pass_throughputs"."""
    ranked = sorted(passes, key=lambda m: m["output_throughput"])
    return {**ranked[(len(ranked) - 1) // 2], "pass_throughputs": [m["output_throughput"] for m in passes]}


def throughput_text(m: dict[str, Any]) -> str:
    """Output tok/s of a pass, with the range over every pass when median_pass chose it among several."""
    passes = m.get("pass_throughputs", [])
    spread = f" ({min(passes):.0f}-{max(passes):.0f})" if len(passes) > 1 else ""
    return f"{m['output_throughput']:.1f}{spread}"


def _ratio(value: float, base: Optional[float]) -> str:
    return f"{value / base:.2f}x" if base else "-"


def table(rows: list[tuple[Config, dict[str, Any]]]) -> str:
    """Markdown; speed-up is output throughput over the baseline's at the same concurrency, "vs
    best fixed" over the best fixed (steps, topk, draft tokens) configuration's."""
    baseline = {m["max_concurrency"]: m["output_throughput"] for c, m in rows if c is None}
    best_fixed: dict[Any, float] = {}
    for config, m in rows:
        if isinstance(config, tuple):
            best_fixed[m["max_concurrency"]] = max(best_fixed.get(m["max_concurrency"], 0.0), m["output_throughput"])
    lines = [
        "| steps | topk | draft tokens | concurrency | accept length | output tok/s | median TPOT (ms) | prefill batches "
        "| speed-up | vs best fixed | tier cycles |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, m in rows:
        if isinstance(config, Adaptive):
            steps, topk, draft = f"adaptive {','.join(map(str, config.tiers)) or 'default'}", 1, "steps + 1"
        else:
            steps, topk, draft = config or ("-", "-", "-")
        accept = f"{m['accept_length']:.2f}" if m["accept_length"] is not None else "-"
        concurrency = m["max_concurrency"]
        tiers = " ".join(f"{s}:{n}" for s, n in sorted(m.get("tier_cycles", {}).items())) or "-"
        lines.append(
            f"| {steps} | {topk} | {draft} | {concurrency or '-'} | {accept} | {throughput_text(m)} | "
            f"{m.get('median_tpot_ms', float('nan')):.2f} | {m.get('prefill_batches', '-')} | "
            f"{_ratio(m['output_throughput'], baseline.get(concurrency))} | "
            f"{_ratio(m['output_throughput'], best_fixed.get(concurrency)) if config is not None else '-'} | {tiers} |"
        )
    return "\n".join(lines)


def split_server_argv(argv: Optional[list[str]]) -> tuple[list[str], list[str]]:
    """(the flags before `--`, the server flags after it) of argv (default: sys.argv[1:])."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    return argv[:split], argv[split + 1 :]


def main(argv: Optional[list[str]] = None) -> str:
    argv, server_argv = split_server_argv(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--speculative-algorithm", choices=("EAGLE", "NEXTN"), required=True)
    p.add_argument("--speculative-draft-model-path")
    p.add_argument(
        "--configs", type=parse_config, nargs="+", required=True, help="steps,topk,draft_tokens ... and adaptive[:STEPS]"
    )
    p.add_argument("--baseline", action="store_true", help="also run without speculation")
    p.add_argument("--concurrencies", type=int, nargs="+", help="run the workload at each of these --max-concurrency")
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--warmup-passes", type=int, default=1, help="unrecorded runs of the workload before the recorded ones")
    p.add_argument("--recorded-passes", type=int, default=1, help="recorded runs per concurrency; the median one is reported")
    args, bench_argv = p.parse_known_args(argv)
    if args.recorded_passes < 1:
        p.error(f"--recorded-passes must be at least 1, got {args.recorded_passes}")
    bench_args = bench_parser().parse_args(bench_argv)
    configs: list[Config] = ([None] if args.baseline else []) + list(args.configs)
    rows = [row for config in configs for row in run_one(args, bench_args, server_argv, config)]
    result = table(rows)
    print(result, flush=True)
    return result


if __name__ == "__main__":
    main()
