"""MLA decode attention (576 / 512 channels, 16 heads, one latent KV head): stage-1 tiles timed
as in a decode step's CUDA graph.

    python benchmark/kernels/bench_mla_decode.py [--replays 20]

For each batch size and context length, every tile of TILES runs back to back inside one
captured graph (--calls per graph), so the figure is device time per call including the
graph's launch gaps, not host launch cost. Each tile's output is checked against the default
tile's. One JSON line per (case, tile), then the best tile per case.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))  # run from a checkout without installing

from graph_timing import capture, median_replay_ms

from sglang.srt.kernels.attention.common import HeadDimTiling
from sglang.srt.kernels.attention.decode import (
    DecodeTile,
    decode_attention,
    default_tile,
    num_kv_splits,
)

HEADS, LK, LV = 16, 576, 512
TILES = [DecodeTile(32, 4), DecodeTile(32, 8), DecodeTile(16, 4), DecodeTile(16, 4, 1), DecodeTile(64, 8), DecodeTile(64, 8, 1)]
CASES = [(1, 192), (1, 1024), (1, 4096), (4, 192), (32, 192), (32, 1024)]  # (batch size, context tokens)


def make_case(bs: int, ctx: int, device: str = "cuda"):
    gen = torch.Generator(device="cpu").manual_seed(bs * 7919 + ctx)
    slots = bs * ctx
    kv = torch.randn(slots, 1, LK, generator=gen).to(device, torch.bfloat16)
    q = torch.randn(bs, HEADS, LK, generator=gen).to(device, torch.bfloat16)
    seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=device)
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(seq_lens, 0)
    kv_indices = torch.randperm(slots, generator=gen).to(device)  # scattered pages, as a pool's
    return q, kv, kv[..., :LV], kv_indptr, kv_indices, num_kv_splits(seq_lens)


def time_us(run, calls: int, replays: int) -> float:
    """Median over replays of one graph of `calls` back-to-back runs, per call."""
    run()  # compile outside the capture
    graph = capture(lambda: [run() for _ in range(calls)])
    return median_replay_ms(graph, replays) * 1000 / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_mla_decode: CUDA is required", file=sys.stderr)
        return 2
    default = default_tile(HeadDimTiling.of(LK, LV))
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  default tile {default}")
    for bs, ctx in CASES:
        q, k, v, indptr, indices, splits = make_case(bs, ctx)
        out = torch.empty(bs, HEADS, LV, dtype=torch.bfloat16, device="cuda")
        decode_attention(q, k, v, out, indptr, indices, splits, LK**-0.5)
        want = out.clone()
        results = {}
        for tile in TILES:
            run = functools.partial(decode_attention, q, k, v, out, indptr, indices, splits, LK**-0.5, tile)
            us = time_us(run, args.calls, args.replays)
            err = (out.float() - want.float()).abs().max().item()
            results[tile] = us
            print(json.dumps({"bs": bs, "ctx": ctx, "tile": str(tile), "us": round(us, 2), "max_err": err}), flush=True)
        best = min(results, key=results.get)
        print(f"# bs {bs} ctx {ctx}: default {results.get(default, float('nan')):.2f} us, best {best} {results[best]:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
