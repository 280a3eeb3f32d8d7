"""Host time of one eager launch: a torch op, bare Triton kernels of few and many arguments,
and our fused add + RMSNorm (its Python wrapper and its Triton launch), on small tensors.

    python benchmark/kernels/bench_launch.py [--calls 1000] [--repeats 5]

An eager forward (a prefill, or any forward outside a CUDA graph) of a small model is a chain
of such launches, so their host cost, not the kernels, sets its time. Each figure is the median
over --repeats of (host seconds for --calls back-to-back calls) / --calls; the device finishes
each repeat before the next starts. Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))  # run from a checkout without installing

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sglang.srt.layers.fused_ops import fused_add_rms_norm  # noqa: E402


@triton.jit
def _touch4_kernel(a, b, c, d):
    tl.store(d, tl.load(a) + tl.load(b) + tl.load(c))


@triton.jit
def _touch20_kernel(a, b, c, d, e, f, g, h, i, j, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9):
    total = tl.load(a) + tl.load(b) + tl.load(c) + tl.load(d) + tl.load(e) + tl.load(f) + tl.load(g) + tl.load(h)
    tl.store(j, total + tl.load(i) + n0 + n1 + n2 + n3 + n4 + n5 + n6 + n7 + n8 + n9)


def host_us_per_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def cases(tokens: int, hidden: int) -> dict[str, Callable[[], object]]:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    residual, weight, out = torch.randn_like(x), torch.ones(hidden, device="cuda", dtype=torch.bfloat16), torch.empty_like(x)
    ptrs = [torch.zeros(1, device="cuda") for _ in range(10)]
    return {
        "torch.add (out=)": lambda: torch.add(x, residual, out=out),
        "Triton, 4 pointer args": lambda: _touch4_kernel[(1,)](*ptrs[:4]),
        "Triton, 10 pointer + 10 int args": lambda: _touch20_kernel[(1,)](*ptrs, *range(1, 11)),
        "fused_add_rms_norm (wrapper + Triton)": lambda: fused_add_rms_norm(x, residual, weight, 1e-6),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=276, help="rows of the norm's input")
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_launch.py needs CUDA")
    print(f"{'launch':<40} host us per call")
    for name, fn in cases(args.tokens, args.hidden).items():
        print(f"{name:<40} {host_us_per_call(fn, args.calls, args.repeats):8.1f}", flush=True)


if __name__ == "__main__":
    main()
