"""A/B server flags: the same workload against servers that differ only in some flags, in
alternating rounds, and a markdown table per flag set (a "variant").

    python benchmark/flag_ab.py --model-path M --variant plain= --variant mixed=--enable-mixed-chunk \\
        --rounds 3 --dataset-name random --random-input-len 384 --random-output-len 64 --num-prompts 48 \\
        --max-concurrency 8 --request-rate 4 --seed 1 -- --chunked-prefill-size 128 --device cpu

--variant NAME=FLAGS names one variant's extra server flags (split as a shell would; `NAME=`
for none). Flags after `--` go to every server, before the variant's, so a variant's value of
a common flag wins. Other flags before `--` describe the workload and are
python -m sglang.bench_serving's.

--engine NAME=DIR serves that variant from the `sglang` package under DIR instead of this
checkout's: the previous engine side by side with this one, e.g. after
`mkdir /tmp/before && git archive COMMIT python | tar -x -C /tmp/before`,
`--variant before= --engine before=/tmp/before/python --variant after=`. Figures an older
server does not report show as "-".

Each round launches one server per variant in turn, runs the workload --warmup-passes times
unrecorded (kernels compile, allocators grow), then once recorded, and stops the server; the
cache is flushed before each pass. Round 1 runs the variants in the given order, round 2 in
the reverse order, and so on, so a slow drift of the machine falls on every variant alike.
A fresh server per round rather than one kept alive per variant: only one server holds the
device at a time (a GPU server takes most of the GPU's memory for its KV pool), none idles
beside the one measured, and the differences between launches (memory placement, thread
start-up) fall into the round-to-round range instead of into one variant's single launch,
where they would read as an effect of its flags.

Per variant the table shows the round of median output throughput (the lower middle one of an
even count) with the range of all rounds beside it, and that round's mean TTFT, median and p99
ITL, median TPOT, and from the server: the "Prefill batch." lines of its log and the
`mixed_prefill_batches` of /get_server_info during the recorded pass (both include
bench_serving's one unmeasured warm-up request), and the stalled-iteration fraction of that
pass: among the iterations with running requests, those without a decode step (from the
server's counts, summed over DP ranks). --output-file writes every round's metrics as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_sweep import count_prefill_batches, internal_states, median_pass, split_server_argv, throughput_text

from sglang.bench_serving import get_parser as bench_parser
from sglang.bench_serving import run_benchmark
from sglang.test.server_utils import kill_server, popen_launch_server


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]  # server flags after the common ones
    python_dir: Optional[str] = None  # the directory of the sglang package that serves it (None: this one)


def parse_variant(text: str) -> Variant:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS, got {text!r}")
    return Variant(name, tuple(shlex.split(flags)))


def round_order(variants: list[Variant], rounds: int) -> list[list[Variant]]:
    """The variants in the given order in even rounds (0-based), reversed in odd ones."""
    return [variants if r % 2 == 0 else variants[::-1] for r in range(rounds)]


def server_counts(base_url: str) -> dict[str, Optional[int]]:
    """Counters since launch, summed over DP ranks: prefill batches that carried running
    requests' decode steps, iterations with running requests, and those without a decode step
    (None where the server does not report one)."""
    states = internal_states(base_url)
    keys = ("mixed_prefill_batches", "running_iterations", "stalled_iterations")
    return {key: sum(s[key] for s in states) if all(key in s for s in states) else None for key in keys}


def with_engines(variants: list[Variant], engines: list[tuple[str, str]]) -> list[Variant]:
    """The variants, each named by an --engine NAME=DIR served from DIR."""
    dirs = dict(engines)
    unknown = sorted(set(dirs) - {v.name for v in variants})
    if unknown:
        raise ValueError(f"--engine names no variant: {unknown}")
    return [Variant(v.name, v.flags, dirs.get(v.name)) for v in variants]


def parse_engine(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not os.path.isdir(os.path.join(path, "sglang")):
        raise argparse.ArgumentTypeError(f"expected NAME=DIR with DIR/sglang a package, got {text!r}")
    return name, path


def run_round(
    args: argparse.Namespace, bench_args: argparse.Namespace, server_argv: list[str], variant: Variant
) -> dict[str, Any]:
    """One server with the variant's flags: the unrecorded passes, then the recorded one's metrics
    with the server's figures for it."""
    server = popen_launch_server(
        args.model_path, [*server_argv, *variant.flags], timeout=args.launch_timeout, python_dir=variant.python_dir
    )
    try:
        run_args = argparse.Namespace(**{**vars(bench_args), "base_url": server.base_url, "flush_cache": True})
        for _ in range(args.warmup_passes):
            run_benchmark(run_args)
        prefills_before, counts_before = count_prefill_batches(server.log_path), server_counts(server.base_url)
        metrics = run_benchmark(run_args)
        if metrics["completed"] < metrics["num_prompts"]:
            raise RuntimeError(
                f"{variant.name}: {metrics['num_prompts'] - metrics['completed']} requests failed: {metrics['errors']}"
            )
        metrics["prefill_batches"] = count_prefill_batches(server.log_path) - prefills_before
        counts = {key: None if n is None else n - (counts_before[key] or 0) for key, n in server_counts(server.base_url).items()}
        metrics["mixed_prefill_batches"] = counts["mixed_prefill_batches"]
        running, stalled = counts["running_iterations"], counts["stalled_iterations"]
        metrics["stalled_iteration_fraction"] = (
            None if running is None or stalled is None else stalled / running if running else 0.0
        )
        return metrics
    finally:
        kill_server(server)


def table(rows: list[tuple[Variant, dict[str, Any]]]) -> str:
    """Markdown, one row per variant from its median pass (median_pass's dict)."""
    lines = [
        "| variant | server flags | output tok/s (range) | mean TTFT ms | median ITL ms | p99 ITL ms | median TPOT ms "
        "| prefill batches | mixed prefill batches | stalled fraction |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, m in rows:
        flags = f"`{shlex.join(variant.flags)}`" if variant.flags else "-"
        lines.append(
            f"| {variant.name} | {flags} | {throughput_text(m)} | {m['mean_ttft_ms']:.1f} | "
            f"{_ms(m, 'median_itl_ms')} | {_ms(m, 'p99_itl_ms')} | {_ms(m, 'median_tpot_ms')} | {m['prefill_batches']} | "
            f"{_or_dash(m['mixed_prefill_batches'], 'd')} | {_or_dash(m['stalled_iteration_fraction'], '.2f')} |"
        )
    return "\n".join(lines)


def _or_dash(value: Optional[float], spec: str) -> str:
    """A server figure, or - where the server does not report it (an older engine)."""
    return "-" if value is None else format(value, spec)


def _ms(m: dict[str, Any], key: str) -> str:
    """A latency of the pass, or - where it has none (one output token: no gaps between tokens)."""
    return f"{m[key]:.2f}" if key in m else "-"


def main(argv: Optional[list[str]] = None) -> str:
    argv, server_argv = split_server_argv(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument(
        "--variant", type=parse_variant, action="append", required=True, help="NAME=FLAGS, once per variant (at least two)"
    )
    p.add_argument("--engine", type=parse_engine, action="append", default=[], help="NAME=DIR: variant NAME runs DIR/sglang")
    p.add_argument("--rounds", type=int, default=3, help="recorded passes per variant, alternating the variants' order")
    p.add_argument("--warmup-passes", type=int, default=1, help="unrecorded runs of the workload on each server first")
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--output-file", help="write the variants' rounds and median passes here as JSON")
    args, bench_argv = p.parse_known_args(argv)
    variants: list[Variant] = args.variant
    if len(variants) < 2 or len({v.name for v in variants}) < len(variants):
        p.error(f"need at least two variants of distinct names, got {[v.name for v in variants]}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        variants = with_engines(variants, args.engine)
    except ValueError as e:
        p.error(str(e))
    bench_args = bench_parser().parse_args(bench_argv)
    passes: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    for round_index, order in enumerate(round_order(variants, args.rounds)):
        for variant in order:
            passes[variant.name].append({**run_round(args, bench_args, server_argv, variant), "round": round_index})
    rows = [(v, median_pass(passes[v.name])) for v in variants]
    result = table(rows)
    print(result, flush=True)
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(
                {
                    "server_flags": server_argv,
                    "variants": [
                        {
                            "name": v.name,
                            "flags": list(v.flags),
                            "python_dir": v.python_dir,
                            "median": m,
                            "rounds": passes[v.name],
                        }
                        for v, m in rows
                    ],
                },
                f,
                indent=1,
            )
    return result


if __name__ == "__main__":
    main()
