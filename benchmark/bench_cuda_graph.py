"""CUDA graphs on one GPU: greedy tokens with and without graphs, and decode speed.

    python benchmark/bench_cuda_graph.py                   # both parts, about 4-5 minutes on an H200
    python benchmark/bench_cuda_graph.py --skip-timing     # correctness only
    python benchmark/bench_cuda_graph.py --skip-correctness --result-file /tmp/graphs.jsonl

Correctness: tiny random Llama and DeepSeek-V3 checkpoints (float32 and bfloat16) run the
same greedy requests through an engine with graphs and one with --disable-cuda-graph; the
tokens must be identical. The request groups have 1, 4 and 5 requests, so decode replays
exact-size graphs (1, 4) and a padded one (5 -> 8).

Timing: decode ms per token step (bench_decode's method: the prefill cancels out) at batch
1 and 32 for Llama-3.1-8B- and DeepSeek-V2-Lite-shaped dummy models, graphs on and off.
Exits 1 when any token differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import bench, dummy_model_dir

import sglang as sgl
from sglang.test.tiny_deepseek import make_tiny_deepseek_v3
from sglang.test.tiny_models import make_tiny_llama

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
GRAPH_ARGS = {"cuda_graph_max_bs": 32}  # 1, 2, 4, 8, 16, 24, 32: enough for the runs below
NEW_TOKENS = 32
# Request groups sent one after another: exact graphs (1, 4) and a padded one (5 -> 8).
GROUPS = [
    [[10 + (7 * j) % 150 for j in range(17)]],
    [[20 + (i * 13 + j * 5) % 180 for j in range(5 + 9 * i)] for i in range(4)],
    [[12 + (i * 11 + j * 3) % 190 for j in range(3 + 7 * i)] for i in range(5)],
]


def greedy_tokens(model_path: str, dtype: str, engine_args: dict) -> list[list[int]]:
    """The greedy tokens of GROUPS' requests, group after group, through an engine of engine_args."""
    engine = sgl.Engine(model_path=model_path, dtype=dtype, random_seed=0, log_level="warning", **engine_args)
    try:
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        return [o["output_ids"] for group in GROUPS for o in engine.generate(input_ids=group, sampling_params=params)]
    finally:
        engine.shutdown()


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_correctness(models: dict[str, Callable[[str], str]]) -> bool:
    ok = True
    for name, make in models.items():
        path = make(tempfile.mkdtemp(prefix=f"graph-{name}-"))
        for dtype in ("float32", "bfloat16"):
            start = time.perf_counter()
            eager = greedy_tokens(path, dtype, {"disable_cuda_graph": True})
            graph = greedy_tokens(path, dtype, GRAPH_ARGS)
            bad = [i for i, (e, g) in enumerate(zip(eager, graph)) if e != g]
            ok &= not bad
            status = "IDENTICAL" if not bad else f"DIFFERENT in requests {bad}"
            print(
                f"[correctness] {name:12s} {dtype:9s} {len(eager)} requests x {NEW_TOKENS} tokens: "
                f"{status} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
            for i in bad:
                print(
                    f"    request {i}: first difference at token {first_difference(eager[i], graph[i])}\n"
                    f"      eager {eager[i]}\n      graph {graph[i]}",
                    flush=True,
                )
    return ok


def time_decode(config: str, batch_sizes: list[int], repeats: int, result_file: str | None) -> dict:
    path = dummy_model_dir(os.path.join(CONFIG_DIR, config))
    rows: dict[str, dict[int, float]] = {}
    for label, extra in (("eager", {"disable_cuda_graph": True}), ("graphs", GRAPH_ARGS)):
        start = time.perf_counter()
        engine = sgl.Engine(model_path=path, load_format="dummy", log_level="warning", **extra)
        started = time.perf_counter() - start
        try:
            rows[label] = {}
            for bs in batch_sizes:
                row = bench(engine, bs, input_len=128, out_len=64, repeats=repeats)
                row.update(model=config, cuda_graph=label == "graphs", engine_start_s=round(started, 1))
                rows[label][bs] = row["ms_per_token_step"]
                if result_file:
                    with open(result_file, "a") as f:
                        f.write(json.dumps(row) + "\n")
        finally:
            engine.shutdown()
        print(f"[timing] {config}: {label} engine started in {started:.0f} s", flush=True)
    for bs in batch_sizes:
        eager, graph = rows["eager"][bs], rows["graphs"][bs]
        print(
            f"[timing] {config:24s} batch {bs:3d}: eager {eager:7.2f} ms/step, graphs {graph:7.2f} ms/step "
            f"({eager / graph:.2f}x), {bs / graph * 1e3:8.0f} tok/s with graphs",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--result-file", help="append one JSON line per (model, graphs, batch size)")
    args = parser.parse_args()
    start = time.perf_counter()
    ok = True
    if not args.skip_correctness:
        ok = check_correctness(
            {
                "tiny-llama": make_tiny_llama,
                "tiny-dsv3": lambda d: make_tiny_deepseek_v3(d, with_mtp=False),
            }
        )
    if not args.skip_timing:
        for config in ("llama-3.1-8b.json", "deepseek-v2-lite.json"):
            time_decode(config, args.batch_sizes, args.repeats, args.result_file)
    print(
        f"[done] {'all greedy tokens identical' if ok else 'TOKENS DIFFER'}; {time.perf_counter() - start:.0f} s in all",
        flush=True,
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
