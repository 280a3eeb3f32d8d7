"""Host time of one eager launch: a torch op, bare Triton kernels of few and many arguments,
and our wrappers of Triton kernels (their Python and their launches), on a small DeepSeek's
prefill-sized tensors (276 tokens, hidden 256, 8 + 1 experts).

    python benchmark/kernels/bench_launch.py [--calls 1000] [--repeats 5]
    python benchmark/kernels/bench_launch.py --stub-launch   # any machine: the wrappers' Python alone

An eager forward (a prefill, or any forward outside a CUDA graph) of a small model is a chain
of such launches, so their host cost, not the kernels, sets its time. Each figure is the median
over --repeats of (host seconds for --calls back-to-back calls) / --calls; the device finishes
each repeat before the next starts. --stub-launch replaces Triton's launcher with a no-op
(CPU tensors), leaving what our wrappers cost before the launch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))  # run from a checkout without installing

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from sglang.srt.kernels.elementwise import fused_add_rms_norm
from sglang.srt.kernels.moe.grouped_gemm import fused_moe
from sglang.srt.kernels.moe.routing import router_logits, select_experts_triton
from sglang.srt.kernels.moe.routing_config import RoutingConfig

# The small trained DeepSeek's routing (benchmark/configs/deepseek-v3-small-mtp.json).
ROUTING = RoutingConfig(
    top_k=2,
    num_experts=8,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    num_expert_group=4,
    topk_group=2,
    renormalize=True,
    routed_scaling_factor=2.5,
    num_shared_experts=1,
)


@triton.jit
def _touch4_kernel(a, b, c, d):
    tl.store(d, tl.load(a) + tl.load(b) + tl.load(c))


@triton.jit
def _touch20_kernel(a, b, c, d, e, f, g, h, i, j, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9):
    total = tl.load(a) + tl.load(b) + tl.load(c) + tl.load(d) + tl.load(e) + tl.load(f) + tl.load(g) + tl.load(h)
    tl.store(j, total + tl.load(i) + n0 + n1 + n2 + n3 + n4 + n5 + n6 + n7 + n8 + n9)


def host_us_per_call(fn: Callable[[], object], calls: int, repeats: int, sync: Callable[[], None]) -> float:
    for _ in range(50):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return statistics.median(samples)


def cases(tokens: int, hidden: int, device: str) -> dict[str, Callable[[], object]]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    residual, weight, out = torch.randn_like(x), torch.ones(hidden, device=device, dtype=dtype), torch.empty_like(x)
    ptrs = [torch.zeros(1, device=device) for _ in range(10)]
    experts, inter = ROUTING.num_experts + ROUTING.num_shared_experts, 192
    gate = torch.randn(ROUTING.num_experts, hidden, device=device)
    logits = torch.randn(tokens, ROUTING.num_experts, device=device)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype)
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype)
    ids = torch.randint(0, experts, (tokens, ROUTING.slots), device=device)
    weights = torch.ones(ids.shape, device=device)
    return {
        "torch.add (out=)": lambda: torch.add(x, residual, out=out),
        "Triton, 4 pointer args": lambda: _touch4_kernel[(1,)](*ptrs[:4]),
        "Triton, 10 pointer + 10 int args": lambda: _touch20_kernel[(1,)](*ptrs, *range(1, 11)),
        "fused_add_rms_norm (1 kernel)": lambda: fused_add_rms_norm(x, residual, weight, 1e-6),
        "router_logits (1 kernel)": lambda: router_logits(x, gate),
        "select_experts_triton (1 kernel)": lambda: select_experts_triton(logits, ROUTING, torch.zeros_like(gate[:, 0])),
        "fused_moe (4 kernels)": lambda: fused_moe(x, w13, w2, weights, ids),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=276, help="rows of the norm's input")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--stub-launch", action="store_true", help="no launches, CPU tensors: the wrappers' Python alone")
    args = p.parse_args()
    if args.stub_launch:
        JITFunction.run = lambda self, *a, **k: None
    elif not torch.cuda.is_available():
        raise SystemExit("bench_launch.py needs CUDA without --stub-launch")
    device = "cpu" if args.stub_launch else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    print(f"{'call':<40} host us per call{' (launches stubbed)' if args.stub_launch else ''}")
    for name, fn in cases(args.tokens, args.hidden, device).items():
        print(f"{name:<40} {host_us_per_call(fn, args.calls, args.repeats, sync):8.1f}", flush=True)


if __name__ == "__main__":
    main()
