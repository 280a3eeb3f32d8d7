"""Triton vs torch_native paged attention on one layer: median latency with CUDA events.

    python benchmark/kernels/bench_attention.py [--dtype bfloat16] [--iters 20]

Each case checks that both backends agree before timing them. Decode cases and short
queries (verify trees) also report the attention kernels' device time per call inside a CUDA
graph of 20 calls (the eager figures include the host's launch): decode with each request's
KV split as the metadata chooses (by context) and in one program per (request, KV head), with
the KV bytes read over the split time (effective HBM bandwidth); short queries with the KV in
one program per tile and split as the kernel chooses on this GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))  # run from a checkout without installing

from graph_timing import capture, median_replay_ms

from sglang.srt.kernels.attention.common import q_heads_view
from sglang.srt.kernels.attention.decode import decode_attention
from sglang.srt.kernels.attention.extend import is_short_query
from sglang.srt.layers.attention.base import AttentionBackend, load_kv
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.test.attention_batches import AttnShape, make_attention_batch

LLAMA_8B = AttnShape(32, 8, 128, 128)  # Llama-3.1-8B per layer, tp 1
DEEPSEEK_MLA = AttnShape(16, 1, 576, 512, mla=True)  # DeepSeek-V3 absorbed MLA, 16 heads per rank
SMOLLM2 = AttnShape(9, 3, 64, 64)  # SmolLM2-135M
SMALL_MLA = AttnShape(4, 1, 96, 64, mla=True)  # the small trained DeepSeek (benchmark/configs/deepseek-v3-small-mtp.json)
GRAPH_CALLS = 20


@dataclass(frozen=True)
class Case:
    name: str
    shape: AttnShape
    ext_lens: list[int]
    prefix_lens: list[int]
    tree: bool = False

    @property
    def is_decode(self) -> bool:
        return all(e == 1 for e in self.ext_lens) and not self.tree


def cases() -> list[Case]:
    out = []
    for label, shape in (("llama8b", LLAMA_8B), ("mla", DEEPSEEK_MLA)):
        out += [
            Case(f"{label} decode bs=1 ctx=1024", shape, [1], [1023]),
            Case(f"{label} decode bs=1 ctx=8192", shape, [1], [8191]),
            Case(f"{label} decode bs=32 ctx=256", shape, [1] * 32, [255] * 32),
            Case(f"{label} decode bs=32 ctx=1024", shape, [1] * 32, [1023] * 32),
            Case(f"{label} decode bs=32 ctx=4096", shape, [1] * 32, [4095] * 32),
            Case(f"{label} prefill 1x2048", shape, [2048], [0]),
            Case(f"{label} extend 4x256 on 1024 prefix", shape, [256] * 4, [1024] * 4),
            Case(f"{label} verify 32x8 tree on 1024 ctx", shape, [8] * 32, [1016] * 32, tree=True),
            Case(f"{label} verify 1x4 tree on 256 ctx", shape, [4], [252], tree=True),
        ]
    # A speculative cycle of the small models at batch 1: the verify, against a decode step.
    out += [
        Case("smollm2 decode bs=1 ctx=256", SMOLLM2, [1], [255]),
        Case("smollm2 verify 1x4 tree on 256 ctx", SMOLLM2, [4], [252], tree=True),
        Case("small-mla decode bs=1 ctx=256", SMALL_MLA, [1], [255]),
        Case("small-mla verify 1x4 tree on 256 ctx", SMALL_MLA, [4], [252], tree=True),
        Case("small-mla verify 32x4 tree on 256 ctx", SMALL_MLA, [4] * 32, [252] * 32, tree=True),
        Case("mla verify 32x4 tree on 1024 ctx", DEEPSEEK_MLA, [4] * 32, [1020] * 32, tree=True),
    ]
    return out


def graph_us(fn, replays: int) -> float:
    """Device microseconds per call of fn, from a CUDA graph of GRAPH_CALLS calls."""
    graph = capture(lambda: [fn() for _ in range(GRAPH_CALLS)])
    return median_replay_ms(graph, replays) * 1e3 / GRAPH_CALLS


def kernel_operands(fb, q: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q3, k_cache, v_cache, out): what the attention kernels take for this layer's batch."""
    k_cache, v_cache = load_kv(layer, fb)
    q3 = q_heads_view(q, layer.tp_q_head_num, layer.head_dim)
    return q3, k_cache, v_cache, q3.new_empty(q3.shape[0], layer.tp_q_head_num, layer.v_head_dim)


def short_query_graph_times(fb, q: torch.Tensor, layer, iters: int) -> str:
    """The extend kernel alone on the Triton backend's metadata: one program per tile against
    the kernel's own KV split."""
    backend = fb.attn_backend
    q3, k_cache, v_cache, out = kernel_operands(fb, q, layer)

    def call(kv_splits):
        return lambda: backend.extend(q3, k_cache, v_cache, out, layer.scaling, fb.custom_mask, kv_splits)

    one, split = graph_us(call(1), iters), graph_us(call(None), iters)
    return f"  graph: one program/tile {one:6.2f} us, split {split:6.2f} us"


def decode_graph_times(fb, q: torch.Tensor, layer, iters: int) -> tuple[float, float]:
    """The decode kernels alone on the Triton backend's metadata: (split by context, one
    program per request and KV head) in us per call."""
    meta = fb.attn_backend.metadata
    q3, k_cache, v_cache, out = kernel_operands(fb, q, layer)

    def call(splits: torch.Tensor):
        return lambda: decode_attention(q3, k_cache, v_cache, out, meta.kv_indptr, meta.kv_indices, splits, layer.scaling)

    one = torch.ones_like(meta.num_kv_splits)
    return graph_us(call(meta.num_kv_splits), iters), graph_us(call(one), iters)


def time_ms(fn, iters: int) -> float:
    """Median of `iters` CUDA-event timings after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_case(case: Case, dtype: torch.dtype, iters: int) -> str:
    fb, q, k, v = make_attention_batch(case.shape, case.ext_lens, case.prefix_lens, dtype, "cuda", case.tree)
    layer = case.shape.layer()

    def bind(backend: AttentionBackend):
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)  # once per forward, shared by all layers: not timed
        return lambda: backend.forward(q, k, v, layer, fb)

    native, triton_fn = bind(TorchNativeAttnBackend()), bind(TritonAttnBackend())
    err = (triton_fn().float() - native().float()).abs().max().item()
    graph_line = ""
    if case.is_decode:
        s = case.shape
        # MLA's V is a view of the latent already read as K.
        per_token = (s.head_dim if s.mla else s.num_kv_heads * (s.head_dim + s.v_head_dim)) * dtype.itemsize
        kv_bytes = sum(p + e for p, e in zip(case.prefix_lens, case.ext_lens)) * per_token
        split_us, one_us = decode_graph_times(fb, q, layer, iters)
        graph_line = (
            f"  graph: split {split_us:7.2f} us ({kv_bytes / split_us / 1e3:6.1f} GB/s), one program/tile {one_us:7.2f} us"
        )
    elif is_short_query(max(case.ext_lens), case.shape.num_heads // case.shape.num_kv_heads):
        graph_line = short_query_graph_times(fb, q, layer, iters)
    fb.attn_backend = None
    t_native, t_triton = time_ms(native, iters), time_ms(triton_fn, iters)
    line = (
        f"{case.name:<42} native {t_native:9.3f} ms  triton {t_triton:8.3f} ms  x{t_native / t_triton:6.1f}  max|diff| {err:.1e}"
    )
    return line + graph_line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention: CUDA is required (the Triton kernels are benchmarked compiled)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}  median of {args.iters}")
    for case in cases():
        print(run_case(case, dtype, args.iters), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
