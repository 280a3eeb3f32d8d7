"""The seed's configuration (NEXTN under DP attention with CUDA graphs) with every rank on one
GPU (--gpu-id-step 0), its collectives through the IPC buffers. Run on the device machine:

    source .device/env.sh && python3 benchmark/gpu/validate_shared_gpu.py --out $OUT \
        --parallel tp2dp2 --checks exact perfect idle

Checks (each prints JSON lines and appends them to $OUT/shared_gpu.jsonl):
- exact: the tiny DeepSeek-V3 with MTP in float32, NEXTN chain (3/1/4) and tree (topk 4, 8
  draft tokens), eager and with CUDA graphs (`--modes prefill-graphs`: prefill graphs too, every
  rank replaying one bucket in each prefill iteration): 32 prompts of mixed lengths sent together and
  then staggered give the greedy tokens of the single-rank run without speculation;
  `--specs adaptive`: --speculative-adaptive over 1, 3 and 5 steps with the tier forced to
  change every few cycles (through 1 step and back), each tier with its own graphs;
- perfect: a draft that reproduces its target accepts steps + 1 tokens on every DP rank,
  with graphs (per-rank accept length from /get_server_info and from the log);
- idle: one request, so DP rank 1 has none for the whole run, yet replays its graphs;
- trained: the trained small DeepSeek with MTP ($MODELS/deepseek-v3-mtp, trained there when
  absent): per-rank accept length with graphs vs eager (within 0.02) and vs one rank (0.05),
  over --trained-prompts held-out prompts;
- load: benchmark/load_test.py, 300 mixed requests (streaming, 10% aborted, greedy and
  sampling) at concurrency 32, then the KV pool back to full on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import requests

from sglang.test.server_utils import kill_server, popen_launch_server
from sglang.test.spec_models import make_perfect_deepseek_v3
from sglang.test.tiny_deepseek import make_tiny_deepseek_v3

PARALLEL = {
    "tp2dp2": ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"],
    "tp4dp4": ["--tp-size", "4", "--dp-size", "4", "--enable-dp-attention"],
    "tp4dp2": ["--tp-size", "4", "--dp-size", "2", "--enable-dp-attention"],
}
SPECS = {
    "plain": [],
    "chain": [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
    ],
    "tree": [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "4",
        "--speculative-num-draft-tokens",
        "8",
    ],
    "adaptive": [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-adaptive",
        "--speculative-adaptive-steps",
        "1,3,5",
        "--speculative-num-steps",
        "3",
        "--speculative-adaptive-schedule",
        "3:2,1:2,5:3,1:3",
    ],
}
# The idle and trained checks know which DP rank each request reaches.
ROUND_ROBIN = ["--load-balance-method", "round_robin"]
SHARED = ["--gpu-id-step", "0", "--cuda-graph-max-bs", "16", "--mem-fraction-static", "0.2"]


def workload(vocab: int, n: int = 32, seed: int = 0) -> list[tuple[list[int], int]]:
    """n prompts of mixed lengths (1..120 tokens) with mixed output lengths (4..40)."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.choice([1, 5, 17, 40, 120]))], rng.randrange(4, 41)) for _ in range(n)]


def generate(url: str, items: list[tuple[list[int], int]], stagger_s: float = 0.0) -> list[list[int]]:
    """Greedy output ids of every item, sent concurrently (item i after i * stagger_s)."""

    def one(i: int) -> list[int]:
        time.sleep(i * stagger_s)
        ids, max_new = items[i]
        params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
        r = requests.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": params}, timeout=600)
        r.raise_for_status()
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(one, range(len(items))))


def first_difference(together: list, staggered: list, reference: list, items: list) -> Optional[dict]:
    """Where the first differing output leaves the reference (prompt index, token position)."""
    for label, outputs in (("together", together), ("staggered", staggered)):
        for i, (got, want) in enumerate(zip(outputs, reference)):
            if got != want:
                pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                return {
                    "run": label,
                    "prompt": i,
                    "prompt_len": len(items[i][0]),
                    "token": pos,
                    "got": got[pos : pos + 4],
                    "want": want[pos : pos + 4],
                }
    return None


def rank_states(url: str) -> list[dict]:
    states = requests.get(f"{url}/get_server_info", timeout=60).json()["internal_states"]
    keep = (
        "dp_rank",
        "avg_spec_accept_length",
        "cuda_graph_replays",
        "num_running_reqs",
        "available_kv_tokens",
        "max_total_num_tokens",
        "spec_tier_cycles",
        "cuda_graph_capture_mib",
    )
    return [{k: s.get(k) for k in keep if k in s} for s in states]


class Server:
    def __init__(self, model: str, flags: list[str]):
        self.flags = flags
        self.proc = popen_launch_server(model, ["--dtype", "float32", *flags], timeout=600)
        self.url = self.proc.base_url

    def log_accept_lines(self) -> list[str]:
        with open(self.proc.log_path, errors="replace") as f:
            return [line.strip()[-160:] for line in f if "accept len" in line][-6:]

    def close(self) -> None:
        kill_server(self.proc)


def emit(out: str, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with open(os.path.join(out, "shared_gpu.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def _log_path_of(message: str) -> Optional[str]:
    """The server log named in popen_launch_server's startup error."""
    found = re.search(r"\(log: ([^)]+)\)", message)
    return found.group(1) if found else None


def run_server(out: str, name: str, model: str, flags: list[str], body) -> None:
    start = time.time()
    server: Optional[Server] = None
    try:
        server = Server(model, flags)
        row = {"check": name, **body(server)}
    except Exception as e:  # keep validating the other configurations
        row = {"check": name, "ok": False, "error": f"{type(e).__name__}: {e}"[-1500:]}
        log = server.proc.log_path if server is not None else _log_path_of(str(e))
        if log:
            with open(log, errors="replace") as src, open(os.path.join(out, "failed_servers.log"), "a") as dst:
                dst.write(f"===== {name}\n{src.read()[-200_000:]}\n")
    finally:
        if server is not None:
            server.close()
    row["seconds"] = round(time.time() - start, 1)
    emit(out, row)


def exact_reference(out: str, tiny: str, items: list) -> list:
    """Greedy tokens of the single-rank run without speculation, eager."""
    reference: list = []

    def body(server: Server) -> dict:
        reference.extend(generate(server.url, items))
        return {"ok": True, "tokens": sum(map(len, reference))}

    run_server(
        out,
        "exact reference: 1 rank, no speculation, eager",
        tiny,
        ["--disable-cuda-graph", "--mem-fraction-static", "0.2"],
        body,
    )
    return reference


# --modes: the server flags of each ("graphs": decode graphs only; prefill graphs are on by default).
MODE_FLAGS = {"eager": ["--disable-cuda-graph"], "graphs": ["--disable-piecewise-cuda-graph"], "prefill-graphs": []}


def check_exact(out: str, parallel: str, tiny: str, items: list, reference: list, specs: list[str], modes: list[str]) -> None:
    for spec in specs:
        for mode in modes:
            flags = [*PARALLEL[parallel], *SHARED, *SPECS[spec], *MODE_FLAGS[mode]]

            def body(server: Server) -> dict:
                together = generate(server.url, items)
                staggered = generate(server.url, items, stagger_s=0.05)
                states = rank_states(server.url)
                return {
                    "ok": together == reference and staggered == reference,
                    "together_identical": together == reference,
                    "staggered_identical": staggered == reference,
                    "first_diff": first_difference(together, staggered, reference, items),
                    "ranks": states,
                }

            run_server(out, f"exact {parallel} {spec} {mode}", tiny, flags, body)


def check_perfect(out: str, parallel: str, perfect: str) -> None:
    items = workload(vocab=256, n=16, seed=1)

    def body(server: Server) -> dict:
        generate(server.url, items)
        states = rank_states(server.url)
        accepts = [s["avg_spec_accept_length"] for s in states]
        return {"ok": all(a == 4.0 for a in accepts), "accept_per_rank": accepts, "log": server.log_accept_lines()}

    flags = [*PARALLEL[parallel], *SHARED, *SPECS["chain"], "--decode-log-interval", "5"]  # a short run logs too
    run_server(out, f"perfect draft {parallel} chain graphs", perfect, flags, body)


def check_idle(out: str, parallel: str, tiny: str) -> None:
    def body(server: Server) -> dict:
        before = rank_states(server.url)  # the warm-up request went to DP rank 0
        generate(server.url, [([5, 6, 7], 40)])  # round robin: DP rank 1
        after = rank_states(server.url)
        replays = [a["cuda_graph_replays"] - b["cuda_graph_replays"] for a, b in zip(after, before)]
        idle = [i for i in range(len(after)) if i != 1]
        return {"ok": all(replays[i] > 0 for i in idle), "replays_during_run": replays, "ranks": after}

    flags = [*PARALLEL[parallel], *SHARED, *SPECS["chain"], *ROUND_ROBIN]
    run_server(out, f"idle ranks replay graphs {parallel} chain", tiny, flags, body)


def check_trained(out: str, parallel: str, models: str, modes: list[str], num_prompts: int) -> None:
    """Requests go one at a time, in order, so request i reaches DP rank (i + 1) % dp (round
    robin after the server's warm-up request): each DP rank's accept length is compared with
    the single-rank run's over the same requests (tokens after the first / verify steps)."""
    path = os.path.join(models, "deepseek-v3-mtp")
    if not os.path.isdir(path):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "sglang.tools.train_tiny_models",
                "--out",
                models,
                "--device",
                "cuda",
                "--minutes",
                "1.5",
                "--models",
                "deepseek",
            ],
            check=True,
            timeout=400,
        )
    with open(os.path.join(models, "heldout_prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f][:num_prompts]
    dp = int(PARALLEL[parallel][PARALLEL[parallel].index("--dp-size") + 1])
    runs: dict[str, dict] = {}

    def subset_accept(per_request: list[tuple[int, int]]) -> list[float]:
        """Accept length over the requests each DP rank of `parallel` gets."""
        by_rank = [per_request[(r - 1) % dp :: dp] for r in range(dp)]
        return [round(sum(t for t, _ in reqs) / max(1, sum(v for _, v in reqs)), 4) for reqs in by_rank]

    def run(label: str, flags: list[str]) -> None:
        def body(server: Server) -> dict:
            per_request = []
            for p in prompts:
                params = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
                r = requests.post(f"{server.url}/generate", json={"text": p, "sampling_params": params}, timeout=600)
                r.raise_for_status()
                meta = r.json()["meta_info"]
                per_request.append((meta["completion_tokens"] - 1, meta["spec_verify_ct"]))
            runs[label] = {
                "scheduler": [s["avg_spec_accept_length"] for s in rank_states(server.url)],
                "subset": subset_accept(per_request),
            }
            return {"ok": True, **runs[label]}

        run_server(out, f"trained {label}", path, flags, body)

    run("1 rank graphs", [*SPECS["chain"], "--cuda-graph-max-bs", "16"])
    for mode in modes:
        run(
            f"{parallel} {mode}",
            [*PARALLEL[parallel], *SHARED, *SPECS["chain"], *ROUND_ROBIN, *MODE_FLAGS[mode]],
        )
    single, eager, graphs = (runs.get(k) for k in ("1 rank graphs", f"{parallel} eager", f"{parallel} graphs"))
    if single and graphs:
        vs_single = max(abs(g - s) for g, s in zip(graphs["subset"], single["subset"]))
        row = {
            "check": f"trained accept {parallel}",
            "ok": vs_single <= 0.05,
            "vs_single_rank_max_diff": round(vs_single, 4),
            "graphs": graphs,
            "single_rank": single,
        }
        if eager:  # the scheduler's own figures per rank: the same requests in both modes
            graphs_vs_eager = max(abs(g - e) for g, e in zip(graphs["scheduler"], eager["scheduler"]))
            row.update(ok=row["ok"] and graphs_vs_eager <= 0.02, graphs_vs_eager_max_diff=round(graphs_vs_eager, 4), eager=eager)
        emit(out, row)


def check_load(out: str, parallel: str, tiny: str) -> None:
    def body(server: Server) -> dict:
        cmd = [
            sys.executable,
            "benchmark/load_test.py",
            "--base-url",
            server.url,
            "--num-requests",
            "300",
            "--concurrency",
            "32",
            "--abort-fraction",
            "0.1",
            "--max-tokens",
            "24",
            "--total-timeout",
            "500",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=560)
        summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-1500:]
        states = rank_states(server.url)
        full = all(s["available_kv_tokens"] == s["max_total_num_tokens"] for s in states)
        return {"ok": proc.returncode == 0 and full, "load_test": summary[-1500:], "kv_full": full, "ranks": states}

    run_server(out, f"load {parallel} chain graphs", tiny, [*PARALLEL[parallel], *SHARED, *SPECS["chain"]], body)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--parallel", nargs="+", choices=sorted(PARALLEL), default=["tp2dp2"])
    p.add_argument(
        "--checks", nargs="+", choices=("exact", "perfect", "idle", "trained", "load"), default=["exact", "perfect", "idle"]
    )
    p.add_argument("--specs", nargs="+", choices=sorted(SPECS), default=["chain", "tree"], help="exact: speculative settings")
    p.add_argument(
        "--modes",
        nargs="+",
        choices=sorted(MODE_FLAGS),
        default=["eager", "graphs"],
        help="exact and trained: eager, CUDA graphs (decode), prefill-graphs (decode and prefill)",
    )
    p.add_argument("--trained-prompts", type=int, default=32, help="trained: held-out prompts sent, one at a time")
    p.add_argument("--models", default=os.environ.get("MODELS", "/tmp/bench_models"))
    args = p.parse_args()
    tmp = tempfile.mkdtemp()
    tiny = make_tiny_deepseek_v3(os.path.join(tmp, "dsv3"))
    perfect = make_perfect_deepseek_v3(os.path.join(tmp, "perfect")) if "perfect" in args.checks else ""
    items = workload(vocab=256)
    reference = exact_reference(args.out, tiny, items) if "exact" in args.checks else []
    for parallel in args.parallel:
        if "exact" in args.checks:
            check_exact(args.out, parallel, tiny, items, reference, args.specs, args.modes)
        if "perfect" in args.checks:
            check_perfect(args.out, parallel, perfect)
        if "idle" in args.checks:
            check_idle(args.out, parallel, tiny)
        if "trained" in args.checks:
            check_trained(args.out, parallel, args.models, args.modes, args.trained_prompts)
        if "load" in args.checks:
            check_load(args.out, parallel, tiny)


if __name__ == "__main__":
    main()
