"""DeepSeek-V2-Lite's MoE layer on CUDA: the main-branch path, the fused one, and tile configs.

    python benchmark/kernels/bench_moe.py [--tokens 1 4 32] [--layers 8] [--reps 30]

One measurement is a CUDA graph of the MoE of `--layers` layers with their own weights (so
that each reads its experts from HBM, not L2, as in a real step), from the router logits
to the layer output; the median of `--reps` CUDA-event-timed replays, per layer, is "ms".
"tb_s" is the bytes of the distinct experts the batch selects (w13 + w2, shared experts
included) over that time. Paths:

- "main": main's MoE before the shared experts were folded in: routing over the routed
  experts, the grouped GEMMs at main's tiles, and a separate shared MLP (gate_up GEMM,
  SiLU-and-mul, down GEMM) whose output is added by one more kernel (main fused that add
  into its combine kernel, so this path is one small kernel slower than main was).
- "fold": shared experts folded in, main's grouped-GEMM tiles (the fold's own gain).
- "table": the fused path as served, with TILE_TABLE's choice.
- "sweep": the fused path at candidate configs, per GEMM (w13's tile with w2's fixed, then
  w2's with the best w13's): the GEMV kernels at every batch of up to 64 pairs; the grouped
  GEMMs with 16-row blocks swept at the first batch and re-timed with the winner after it,
  those with 64-row blocks swept past 64 pairs (and the GEMV winner once, for the crossover).

Every config's output is checked against "main" before it is timed. Prints one JSON line per
measurement, then the recommended TILE_TABLE rows (tiles.py) and the saving per step.
Triton compiles most of the 2 minutes; past --budget seconds the sweeps stop early.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))  # run from a checkout without installing

from graph_timing import capture, median_replay_ms

from sglang.srt.kernels.elementwise import silu_and_mul
from sglang.srt.kernels.moe.grouped_gemm import fused_moe
from sglang.srt.kernels.moe.routing import router_logits, select_experts_triton
from sglang.srt.kernels.moe.routing_config import RoutingConfig
from sglang.srt.kernels.moe.tiles import TILE_TABLE, GemmTile, MoeKernelConfig, kernel_config
from sglang.srt.kernels.tuned import write_table

# benchmark/configs/deepseek-v2-lite.json at TP 1.
HIDDEN, INTER, NUM_EXPERTS, TOP_K, NUM_SHARED, MOE_LAYERS = 2048, 1408, 64, 6, 2, 26
ROUTING = RoutingConfig(TOP_K, NUM_EXPERTS, num_shared_experts=NUM_SHARED)
ROUTED_ONLY = dataclasses.replace(ROUTING, num_shared_experts=0)
EXPERT_BYTES = 3 * INTER * HIDDEN * 2  # w13 + w2 of one expert, bf16
BEGAN = time.time()

# main's tiles (a72e01f): BLOCK_M 16 up to 64 pairs, else 64.
MAIN_SMALL = MoeKernelConfig(16, GemmTile(32, 64, 4, 4), GemmTile(32, 64, 4, 4))
MAIN_LARGE = MoeKernelConfig(64, GemmTile(64, 64, 4, 3), GemmTile(64, 64, 4, 3))

# Candidates (block_n, block_k, num_warps, num_stages) per family; w13's and w2's are swept in turn.
GEMV_W13 = [
    (8, 256, 4, 3),
    (16, 128, 4, 3),
    (16, 256, 4, 3),
    (16, 256, 4, 4),
    (16, 256, 4, 1),
    (32, 128, 4, 3),
    (32, 128, 8, 4),
    (16, 512, 8, 3),
]
GEMV_W2 = [
    (4, 256, 4, 3),
    (8, 128, 4, 3),
    (8, 256, 4, 3),
    (8, 256, 4, 5),
    (8, 256, 4, 1),
    (16, 128, 4, 4),
    (16, 256, 4, 4),
    (8, 512, 4, 4),
    (8, 512, 4, 6),
    (8, 512, 8, 4),
    (4, 512, 4, 4),
    (4, 512, 2, 4),
    (2, 512, 2, 4),
    (4, 1024, 4, 3),
]
GROUPED = [(32, 64, 4, 4), (64, 64, 4, 4), (32, 128, 4, 4), (16, 128, 4, 4)]


@dataclass
class Layer:
    gate: torch.Tensor  # router weight [E, H], float32
    w13: torch.Tensor  # [E + S, 2I, H]: routed experts, then the shared MLP's S parts
    w2: torch.Tensor  # [E + S, H, I]
    shared_gate_up: torch.Tensor  # main's separate shared MLP: the same channels, [2 * S * I, H]
    shared_down: torch.Tensor  # [H, S * I]


def make_layer(gen: torch.Generator) -> Layer:
    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    w13 = rand(NUM_EXPERTS + NUM_SHARED, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5)
    w2 = rand(NUM_EXPERTS + NUM_SHARED, HIDDEN, INTER, scale=INTER**-0.5)
    shared = w13[NUM_EXPERTS:]
    gate_up = torch.cat([shared[:, :INTER].reshape(-1, HIDDEN), shared[:, INTER:].reshape(-1, HIDDEN)])
    down = w2[NUM_EXPERTS:].permute(1, 0, 2).reshape(HIDDEN, -1).contiguous()
    gate = torch.randn(NUM_EXPERTS, HIDDEN, generator=gen, device="cuda")
    return Layer(gate, w13, w2, gate_up, down)


def main_layer(x: torch.Tensor, layer: Layer) -> torch.Tensor:
    weights, ids = select_experts_triton(router_logits(x, layer.gate), ROUTED_ONLY)
    config = MAIN_SMALL if ids.numel() <= 64 else MAIN_LARGE
    routed = fused_moe(x, layer.w13[:NUM_EXPERTS], layer.w2[:NUM_EXPERTS], weights, ids, config)
    return routed + F.linear(silu_and_mul(F.linear(x, layer.shared_gate_up)), layer.shared_down)


def fused_layer(config: MoeKernelConfig | None) -> Callable[[torch.Tensor, Layer], torch.Tensor]:
    def run(x: torch.Tensor, layer: Layer) -> torch.Tensor:
        weights, ids = select_experts_triton(router_logits(x, layer.gate), ROUTING)
        return fused_moe(x, layer.w13, layer.w2, weights, ids, config, shared_slots=NUM_SHARED)  # as FusedMoE calls it

    return run


def time_per_layer(step, x: torch.Tensor, layers: list[Layer], reps: int) -> tuple[float, list[torch.Tensor]]:
    """Median ms per layer of a CUDA graph running `step` over every layer; the eager outputs."""
    outs = [step(x, layer) for layer in layers]  # compiles the kernels outside the capture
    graph = capture(lambda: [step(x, layer) for layer in layers], warmups=3)
    return median_replay_ms(graph, reps) / len(layers), outs


def selected_bytes(x: torch.Tensor, layers: list[Layer]) -> float:
    """Mean bytes per layer of the distinct experts the batch selects (shared included)."""
    counts = [select_experts_triton(router_logits(x, layer.gate), ROUTING)[1].unique().numel() for layer in layers]
    return statistics.mean(counts) * EXPERT_BYTES


def tile(spec: tuple[int, int, int, int]) -> GemmTile:
    return GemmTile(*spec)


class Bench:
    """The measurements of one batch size; `deadline` (time.time()) ends the sweeps early."""

    def __init__(self, num_tokens: int, layers: list[Layer], reps: int, deadline: float):
        gen = torch.Generator(device="cuda").manual_seed(num_tokens)
        self.x = torch.randn(num_tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
        self.num_tokens, self.layers, self.reps, self.deadline = num_tokens, layers, reps, deadline
        self.bytes = selected_bytes(self.x, layers)
        self.ref: list[torch.Tensor] = []
        self.results: list[tuple[float, str, MoeKernelConfig]] = []

    def measure(self, path: str, step, config: MoeKernelConfig | None = None) -> float:
        ms, outs = time_per_layer(step, self.x, self.layers, self.reps)
        if not self.ref:
            self.ref = outs
        ok = all(torch.allclose(o.float(), r.float(), atol=5e-2, rtol=5e-2) for o, r in zip(outs, self.ref))
        line = {
            "tokens": self.num_tokens,
            "path": path,
            "ms": round(ms, 5),
            "tb_s": round(self.bytes / ms / 1e9, 3),
            "config": None if config is None else dataclasses.asdict(config),
            "matches_main": ok,
            "elapsed_s": round(time.time() - BEGAN, 1),
        }
        print(json.dumps(line), flush=True)
        if ok and config is not None:
            self.results.append((ms, path, config))
        return ms if ok else float("inf")

    def sweep(self, start: MoeKernelConfig, w13_specs, w2_specs) -> MoeKernelConfig:
        """w13's candidates with start's w2 tile, then w2's with the best w13 tile; the best config."""
        timed = {}
        for spec in w13_specs:
            config = dataclasses.replace(start, w13=tile(spec))
            if time.time() < self.deadline or not timed:
                timed[config] = self.measure("sweep", fused_layer(config), config)
        best = min(timed, key=timed.get)
        for spec in w2_specs:
            config = dataclasses.replace(best, w2=tile(spec))
            if config not in timed and time.time() < self.deadline:
                timed[config] = self.measure("sweep", fused_layer(config), config)
        return min(timed, key=timed.get)

    def best(self) -> tuple[float, str, MoeKernelConfig]:
        return min(self.results, key=lambda r: r[0])


def run_tokens(num_tokens: int, layers: list[Layer], reps: int, deadline: float, grouped16: MoeKernelConfig | None):
    """Summary of one batch size, and the best 16-row grouped config (swept here when not given)."""
    bench = Bench(num_tokens, layers, reps, deadline)
    main_ms = bench.measure("main", main_layer)
    num_pairs = num_tokens * ROUTING.slots
    main_config = MAIN_SMALL if num_tokens * TOP_K <= 64 else MAIN_LARGE
    bench.measure("fold", fused_layer(main_config), main_config)
    table_ms = bench.measure("table", fused_layer(None), kernel_config(num_pairs, bench.x.device))
    gemv_start = MoeKernelConfig(1, tile(GEMV_W13[2]), tile(GEMV_W2[2]))
    if num_pairs <= 64:
        bench.sweep(gemv_start, GEMV_W13, GEMV_W2)
    else:  # the GEMV kernels read an expert once per pair: one point for the crossover
        bench.measure("sweep", fused_layer(gemv_start), gemv_start)
    if grouped16 is None:
        grouped16 = bench.sweep(MAIN_SMALL, GROUPED, GROUPED)
    elif grouped16 != main_config:
        bench.measure("sweep", fused_layer(grouped16), grouped16)
    if num_pairs > 64:
        bench.sweep(MAIN_LARGE, GROUPED, GROUPED)
    best_ms, best_path, best_config = bench.best()
    summary = dict(
        tokens=num_tokens,
        pairs=num_pairs,
        main_ms=main_ms,
        table_ms=table_ms,
        best_ms=best_ms,
        best_path=best_path,
        best=best_config,
        tb_s=bench.bytes / best_ms / 1e9,
    )
    return summary, grouped16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--layers", type=int, default=8, help="distinct layers per graph (HBM, not L2)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--budget", type=float, default=90, help="seconds after which the sweeps stop early")
    parser.add_argument(
        "--write-table", action="store_true", help="store the best configs where the kernels read them (kernels/tuned/)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [make_layer(gen) for _ in range(args.layers)]
    summary, grouped16 = [], None
    for num_tokens in sorted(args.tokens):
        row, grouped16 = run_tokens(num_tokens, layers, args.reps, BEGAN + args.budget, grouped16)
        summary.append(row)

    print(f"\n# {time.time() - BEGAN:.0f} s. Per MoE layer (x {MOE_LAYERS} layers per V2-Lite step):")
    for s in summary:
        print(
            f"#   {s['tokens']:>3} tokens: main {s['main_ms']:.4f} ms, table {s['table_ms']:.4f} ms, best "
            f"{s['best_ms']:.4f} ms ({s['best_path']}, {s['tb_s']:.2f} TB/s); best saves "
            f"{(s['main_ms'] - s['best_ms']) * MOE_LAYERS:.3f} ms per step over main"
        )
    print("# Recommended TILE_TABLE rows for python/sglang/srt/kernels/moe/tiles.py (pair bounds are the")
    print("# measured batches' pairs; keep a final sys.maxsize row):")
    for s in summary:
        print(f"    ({s['pairs']}, {s['best']!r}),  # {s['tokens']} tokens")
    print(f"    (sys.maxsize, {TILE_TABLE[-1][1]!r}),")
    rec = {"recommend": [{"max_pairs": s["pairs"], "config": dataclasses.asdict(s["best"])} for s in summary]}
    print(json.dumps(rec))
    if args.write_table:
        print(f"# table written to {write_table('moe', torch.cuda.get_device_name(), rec['recommend'])}")


if __name__ == "__main__":
    main()
