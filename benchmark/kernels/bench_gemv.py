"""Decode GEMMs: cuBLAS (F.linear) vs the Triton GEMV of kernels/gemv.py, on CUDA.

    python benchmark/kernels/bench_gemv.py [--models llama8b llama8b_eagle v2lite smollm2] [--rows 1 4 8 16 32]

For each bf16 weight of the models' decode steps and each batch of M rows, every candidate
(cuBLAS and several kernel tiles) runs inside a CUDA graph of back-to-back calls, each on its
own copy of the weight (together over 4x the L2, so every call streams its weight from HBM as
in a real step); the median over replays per call is its time. The gated gate_up rows compare
GEMM + SiluAndMul against the gated kernel; LM heads write float32 logits on both sides.

Writes a JSON line per (shape, M, implementation) with us per call and TB/s (weight bytes /
time), to stdout or --jsonl, then prints a summary of the best per shape, the GEMM time per
decode step of each model, and last the table that takes the kernel where it beats cuBLAS by
`--margin`; --write-table stores it in kernels/tuned/gemv-<GPU>.json, which pick_config reads
(the shapes measured now replace their entries there; the others stay).
Kernels compile first in --jobs processes (the on-disk Triton cache then serves the timing process).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))  # run from a checkout without installing

from graph_timing import capture, median_replay_ms

from sglang.srt.kernels.elementwise import silu_and_mul
from sglang.srt.kernels.gemv import MAX_ALL_ROWS, GemvConfig, Table, gemv, table_from_json, table_to_json
from sglang.srt.kernels.tuned import load_table, write_table


@dataclass(frozen=True)
class Shape:
    layer: str
    n: int  # weight rows (gate_up: gate + up)
    k: int
    per_step: int  # calls in one decode step of the model
    gated: bool = False  # SiluAndMul of the product (gate_up)
    logits: bool = False  # float32 output (LM head)


# Per-rank weights at TP 1. V2-Lite: q_proj (16 x 192) stacked with kv_a (512 + 64) and o in
# its 27 layers, the dense MLP of its first layer (the shared experts of the 26 MoE layers run in
# the fused MoE, benchmark/kernels/bench_moe.py).
MODELS: dict[str, list[Shape]] = {
    "llama8b": [
        Shape("qkv", 6144, 4096, 32),
        Shape("o", 4096, 4096, 32),
        Shape("gate_up", 28672, 4096, 32, gated=True),
        Shape("down", 4096, 14336, 32),
        Shape("lm_head", 128256, 4096, 1, logits=True),
    ],
    "v2lite": [
        Shape("q_kv_a", 3648, 2048, 27),
        Shape("o", 2048, 2048, 27),
        Shape("gate_up", 21888, 2048, 1, gated=True),
        Shape("down", 2048, 10944, 1),
        Shape("lm_head", 102400, 2048, 1, logits=True),
    ],
    "smollm2": [
        Shape("qkv", 960, 576, 30),
        Shape("o", 576, 576, 30),
        Shape("gate_up", 3072, 576, 30, gated=True),
        Shape("down", 576, 1536, 30),
        Shape("lm_head", 49152, 576, 1, logits=True),
    ],
    # The EAGLE head of configs/llama-3.1-8b-eagle.json, per draft forward (its decoder layer has
    # Llama's shapes): fc over [embedding | target hidden], and the LM head over a 32k-token map.
    "llama8b_eagle": [
        Shape("fc", 4096, 8192, 1),
        Shape("lm_head_32k", 32768, 4096, 1, logits=True),
    ],
}

# FMA tiles (one row of x per program) for M <= FMA_MAX_ROWS; tensor-core tiles for every M.
# A program keeps one [BLOCK_N, BLOCK_K] step of W in flight (num_stages of them when
# pipelined): the tiles below span 2-16 KB per step and 0.5-16 programs per SM at 4096 rows.
FMA_CONFIGS = [
    GemvConfig(4, 1024),
    GemvConfig(8, 512),
    GemvConfig(8, 1024, num_warps=8),
    GemvConfig(4, 2048, num_warps=8),
    GemvConfig(2, 1024, num_warps=2),
    GemvConfig(4, 256, num_warps=2),
    GemvConfig(8, 512, num_stages=3),
    GemvConfig(4, 1024, num_stages=3),
]
FMA_MAX_ROWS = 4
# FMA tiles that hold every row of x (2..MAX_ALL_ROWS rows): their accumulator is rows x
# BLOCK_N x BLOCK_K floats, so these keep it near 64 registers a thread at 4 rows.
ALL_ROWS_CONFIGS = [
    GemvConfig(4, 512, all_rows=True),
    GemvConfig(2, 1024, all_rows=True),
    GemvConfig(4, 256, num_warps=2, all_rows=True),
    GemvConfig(8, 512, num_warps=8, all_rows=True),
    GemvConfig(4, 1024, num_warps=8, all_rows=True),
    GemvConfig(4, 512, num_stages=3, all_rows=True),
    GemvConfig(4, 512, all_rows=True, pdl=True),
]
DOT_CONFIGS = [
    GemvConfig(16, 128, num_stages=4, use_dot=True),
    GemvConfig(16, 256, num_stages=3, use_dot=True),
    GemvConfig(16, 512, num_stages=2, use_dot=True),
    GemvConfig(16, 512, num_stages=3, use_dot=True),
    GemvConfig(32, 128, num_stages=4, use_dot=True),
    GemvConfig(32, 256, num_stages=3, use_dot=True),
    GemvConfig(64, 128, num_stages=3, use_dot=True),
    # Wider W tiles for 8-64 rows, where x's tile is worth reusing across more of W.
    GemvConfig(64, 256, num_stages=3, use_dot=True),
    GemvConfig(32, 512, num_stages=2, use_dot=True),
    GemvConfig(64, 128, num_warps=8, num_stages=4, use_dot=True),
    GemvConfig(128, 128, num_warps=8, num_stages=3, use_dot=True),
]
# Under PDL each call of the graph's chain prefetches while the previous one runs. In a decode
# step the kernel before a GEMV is RMSNorm (which signals at once), the gate_up GEMV, or
# attention (which does not): these figures are the best case, to confirm end to end.
PDL_BASES = [
    GemvConfig(8, 512),
    GemvConfig(4, 1024),
    GemvConfig(8, 512, num_stages=3),
    GemvConfig(16, 256, num_stages=3, use_dot=True),
    GemvConfig(32, 128, num_stages=4, use_dot=True),
]
FMA_CONFIGS += [dataclasses.replace(c, pdl=True) for c in PDL_BASES if not c.use_dot]
DOT_CONFIGS += [dataclasses.replace(c, pdl=True) for c in PDL_BASES if c.use_dot]
L2_SPAN = 256 << 20  # bytes of weight copies per graph: over 4x an H200's 50 MB L2
MIN_CALLS = 8


def candidates(rows: int, pdl: bool = True) -> list[GemvConfig]:
    configs = (FMA_CONFIGS if rows <= FMA_MAX_ROWS else []) + DOT_CONFIGS
    if 1 < rows <= MAX_ALL_ROWS:  # at one row an all_rows tile is the plain FMA tile
        configs += ALL_ROWS_CONFIGS
    return [c for c in configs if pdl or not c.pdl]


def graph_time_us(step: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor], replays: int) -> float:
    """Median us per call of `step` over replays of a graph calling it once per weight copy."""
    calls = [weights[i % len(weights)] for i in range(max(MIN_CALLS, len(weights)))]
    graph = capture(lambda: [step(w) for w in calls])
    ms = median_replay_ms(graph, replays)
    del graph
    return ms * 1000 / len(calls)


def cublas_step(shape: Shape, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the layers run today: F.linear, then SiluAndMul's kernel or the float32 cast."""
    if shape.gated:
        return lambda w: silu_and_mul(F.linear(x, w))
    if shape.logits:
        return lambda w: F.linear(x, w).float()
    return lambda w: F.linear(x, w)


def gemv_step(shape: Shape, x: torch.Tensor, config: GemvConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    out_dtype = torch.float32 if shape.logits else None
    return lambda w: gemv(x, w, None, config, gated=shape.gated, out_dtype=out_dtype)


def implementations(shape: Shape, x: torch.Tensor, pdl: bool) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """cuBLAS first, then every kernel tile for x's rows."""
    impls = {"cublas": cublas_step(shape, x)}
    impls.update({str(c): gemv_step(shape, x, c) for c in candidates(x.shape[0], pdl)})
    return impls


def make_weights(shape: Shape, copies: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(shape.n + shape.k)
    return [
        (torch.randn(shape.n, shape.k, device="cuda", generator=gen) * shape.k**-0.5).to(torch.bfloat16) for _ in range(copies)
    ]


def make_input(shape: Shape, rows: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    return torch.randn(rows, shape.k, device="cuda", generator=gen).to(torch.bfloat16)


def precompile(shapes: list[Shape], rows_list: list[int], pdl: bool) -> None:
    """Run every implementation once (a worker process: fills Triton's on-disk kernel cache)."""
    for shape in shapes:
        weight = make_weights(shape, 1)[0]
        for rows in rows_list:
            for name, step in implementations(shape, make_input(shape, rows), pdl).items():
                try:
                    step(weight)
                except Exception as e:  # reported again when bench_shape runs it
                    print(f"# precompile {shape.n}x{shape.k} M={rows} {name}: {type(e).__name__}", file=sys.stderr)
        del weight
    torch.cuda.synchronize()


def precompile_in_parallel(shapes: list[Shape], rows_list: list[int], pdl: bool, jobs: int) -> None:
    """Triton compiles on the host one kernel at a time; `jobs` processes share the ~120 tiles."""
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=precompile, args=(shapes[i::jobs], rows_list, pdl)) for i in range(min(jobs, len(shapes)))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
        if w.exitcode:
            raise RuntimeError(f"a precompile worker failed (exit code {w.exitcode})")


def bench_shape(shape: Shape, rows_list: list[int], pdl: bool, replays: int, out: TextIO) -> dict[int, dict[str, float]]:
    """{rows: {implementation: us}} for one weight shape; writes a JSON line per measurement to out."""
    nbytes = shape.n * shape.k * 2
    weights = make_weights(shape, max(2, math.ceil(L2_SPAN / nbytes)))
    results: dict[int, dict[str, float]] = {}
    for rows in rows_list:
        impls = implementations(shape, make_input(shape, rows), pdl)
        ref = impls["cublas"](weights[0]).float()
        results[rows] = {}
        for name, step in impls.items():
            line = dict(layer=shape.layer, n=shape.n, k=shape.k, gated=shape.gated, rows=rows, impl=name)
            try:
                err = (step(weights[0]).float() - ref).abs().max().item()  # compiles outside the capture
                us = graph_time_us(step, weights, replays)
            except Exception as e:  # a tile that does not fit (shared memory, registers): skipped
                line.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
            else:
                ok = err <= 2e-2 * max(1.0, ref.abs().max().item())
                line.update(us=round(us, 2), tbps=round(nbytes / us / 1e6, 3), max_err=float(f"{err:.2e}"), ok=ok)
                if ok:
                    results[rows][name] = us
            print(json.dumps(line), file=out, flush=True)
    del weights
    torch.cuda.empty_cache()
    return results


def table_entries(results: dict[int, dict[str, float]], margin: float) -> list[tuple[int, Optional[GemvConfig]]]:
    """(max rows, config or None) by ascending rows: the best kernel tile where it beats cuBLAS
    by `margin`; runs of one choice merged, trailing cuBLAS dropped."""
    by_name = {str(c): c for c in FMA_CONFIGS + DOT_CONFIGS + ALL_ROWS_CONFIGS}
    entries: list[tuple[int, Optional[GemvConfig]]] = []
    for rows in sorted(results):
        times = results[rows]
        t_best, best = min(((t, name) for name, t in times.items() if name != "cublas"), default=(math.inf, ""))
        choice = by_name[best] if t_best < times["cublas"] * (1 - margin) else None
        if entries and entries[-1][1] == choice:
            entries[-1] = (rows, choice)
        else:
            entries.append((rows, choice))
    while entries and entries[-1][1] is None:
        entries.pop()
    return entries


def merge_tables(stored: Table, measured: dict[tuple[int, int, bool], list[tuple[int, Optional[GemvConfig]]]]) -> Table:
    """The stored table with each shape measured now replaced by its new entries (dropped where
    cuBLAS won at every row count); shapes not measured now keep theirs."""
    merged = dict(stored)
    for key, entries in measured.items():
        if entries:
            merged[key] = tuple(entries)
        else:
            merged.pop(key, None)
    return merged


def config_literal(config: Optional[GemvConfig]) -> str:
    if config is None:
        return "None"
    c = config
    return f"GemvConfig({c.block_n}, {c.block_k}, {c.num_warps}, {c.num_stages}, {c.use_dot}, {c.pdl}, {c.all_rows})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16, 32])
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--margin", type=float, default=0.02, help="how much faster than cuBLAS a tile must be")
    parser.add_argument("--jobs", type=int, default=8, help="processes compiling the kernels first (0: none)")
    parser.add_argument("--jsonl", help="write the JSON lines to this file instead of stdout")
    parser.add_argument("--no-pdl", action="store_true", help="leave out the PDL tiles (and from the table)")
    parser.add_argument(
        "--write-table",
        action="store_true",
        help="store the table where the kernel reads it (kernels/tuned/): the shapes measured now replace theirs, others stay",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gemv: CUDA is required", file=sys.stderr)
        return 2
    began = time.time()
    device = torch.cuda.get_device_name()
    print(f"# {device}  torch {torch.__version__}  bf16  rows {args.rows}  median of {args.replays} graph replays")
    shapes = list({(s.n, s.k, s.gated): s for model in args.models for s in MODELS[model]}.values())
    if args.jobs:
        precompile_in_parallel(shapes, args.rows, not args.no_pdl, args.jobs)
        print(f"# compiled in {time.time() - began:.0f} s", flush=True)
    with open(args.jsonl, "w") if args.jsonl else contextlib.nullcontext(sys.stdout) as out:
        measured = {(s.n, s.k, s.gated): bench_shape(s, args.rows, not args.no_pdl, args.replays, out) for s in shapes}

    print("\n# summary: best kernel tile vs cuBLAS (us per call, TB/s)")
    for model in args.models:
        for shape in MODELS[model]:
            nbytes = shape.n * shape.k * 2
            for rows, times in measured[(shape.n, shape.k, shape.gated)].items():
                t_best, best = min(((t, name) for name, t in times.items() if name != "cublas"), default=(math.inf, "-"))
                t_cublas = times["cublas"]
                print(
                    f"{model} {shape.layer}{'+silu' if shape.gated else ''} {shape.n}x{shape.k} M={rows}: "
                    f"cublas {t_cublas:.1f} ({nbytes / t_cublas / 1e6:.2f}), {best} {t_best:.1f} "
                    f"({nbytes / t_best / 1e6:.2f}) x{t_cublas / t_best:.2f}"
                )

    print("\n# GEMM (+ SiluAndMul, + logits cast) time per decode step (ms): cuBLAS vs the table below")
    table = {key: table_entries(results, args.margin) for key, results in measured.items()}
    for model in args.models:
        for rows in args.rows:
            base = chosen = 0.0
            for shape in MODELS[model]:
                times = measured[(shape.n, shape.k, shape.gated)][rows]
                config = next((c for r, c in table[(shape.n, shape.k, shape.gated)] if rows <= r), None)
                base += shape.per_step * times["cublas"]
                chosen += shape.per_step * (times["cublas"] if config is None else times[str(config)])
            print(f"{model:8s} M={rows:<2d} cublas {base / 1000:6.3f}  table {chosen / 1000:6.3f}")

    print(f"\n# the table (margin {args.margin:.0%}):")
    print(f'    "{device}": {{')
    for key, entries in sorted(table.items()):
        if entries:
            body = ", ".join(f"({rows}, {config_literal(config)})" for rows, config in entries)
            print(f"        {key}: ({body},),")
    print("    },")
    if args.write_table:
        stored = load_table("gemv", device)
        merged = merge_tables(table_from_json(stored) if stored else {}, table)
        path = write_table("gemv", device, table_to_json(merged))
        print(f"# table written to {path}: {len(table)} shapes measured now, {len(merged)} listed")
    print(f"# {time.time() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
