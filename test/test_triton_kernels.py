"""Triton kernels vs their plain-PyTorch references on random inputs.

On CUDA the kernels run compiled (bf16/fp32); without CUDA they run under Triton's CPU
interpreter on small float32 shapes; without triton the module is skipped.
"""

from __future__ import annotations

import pytest
import torch
import triton

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.kernels.attention import extend
from sglang.srt.kernels.attention.common import PREFIX_BLOCK, build_kv_metadata
from sglang.srt.kernels.attention.decode import MAX_KV_SPLITS, MIN_TOKENS_PER_SPLIT, merge_kv_splits, num_kv_splits
from sglang.srt.kernels.moe.grouped_gemm import (
    MAX_PAIRS_ONE_PROGRAM,
    _align_by_expert_torch,
    align_by_expert,
    fused_moe,
    variant_key,
    variant_token_counts,
    warm_up_variants,
)
from sglang.srt.kernels.moe.routing import select_experts_triton
from sglang.srt.kernels.moe.routing_config import RoutingConfig
from sglang.srt.layers.attention.base import load_kv
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend, TritonAttnMetadata
from sglang.srt.layers.moe.fused_moe import moe_forward_native
from sglang.srt.layers.moe.topk import select_experts
from sglang.srt.model_executor.cuda_graph_runner import capture_batch_sizes, padded_batch_size
from sglang.test.attention_batches import AttnShape, make_attention_batch
from sglang.test.triton_harness import (
    DEVICE,
    KERNEL_TOL,
    NEEDS_SUBPROCESS,
    ON_CUDA,
    compare_attention_with_torch_native,
    kernel_test,
    rerun_under_interpreter,
)

DTYPES = [torch.bfloat16, torch.float32] if ON_CUDA else [torch.float32]


@pytest.mark.skipif(not NEEDS_SUBPROCESS, reason="already compiled or interpreted in this process")
def test_kernels_under_triton_interpreter():
    rerun_under_interpreter(__file__)


# MHA, GQA 4:1, MQA with a non-power-of-two head dim, MLA at tiny and real DeepSeek widths.
ATTN_SHAPES = [
    AttnShape(4, 4, 32, 32),
    AttnShape(8, 2, 64, 64),
    AttnShape(6, 1, 48, 48),
    AttnShape(4, 1, 48, 32, mla=True),
]
if ON_CUDA:
    ATTN_SHAPES += [AttnShape(32, 8, 128, 128), AttnShape(16, 1, 576, 512, True), AttnShape(128, 1, 576, 512, True)]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_decode_matches_torch_native(shape, dtype):
    # KV lengths 1, block-boundary-adjacent, and long enough for several KV splits.
    prefix_lens = [0, 63, 64, 200, 7]
    fb = compare_attention_with_torch_native(shape, [1] * len(prefix_lens), prefix_lens, dtype)
    assert fb.attn_backend.metadata.use_decode_kernel
    assert fb.attn_backend.metadata.num_kv_splits.tolist() == [1, 1, 2, 4, 1]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_extend_with_prefix_matches_torch_native(shape, dtype):
    # Fresh prefill, prefix + chunk across block sizes, a request with no new tokens.
    fb = compare_attention_with_torch_native(shape, [5, 17, 0, 70, 1], [0, 40, 3, 16, 9], dtype, seed=1)
    assert not fb.attn_backend.metadata.use_decode_kernel


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_verify_tree_mask_matches_torch_native(shape, dtype):
    # Trees of 4, 6 and 1 tokens over each request's last 6 columns (prefix ones included).
    fb = compare_attention_with_torch_native(shape, [4, 6, 1], [10, 0, 65], dtype, tree=True, seed=2)
    assert fb.custom_mask.numel() == 11 * 6


@kernel_test
@pytest.mark.parametrize("shape", ATTN_SHAPES[:4])
def test_tree_rows_across_tiles_match_torch_native(shape):
    """Query heads packed into the tile rows: a tree of 13 tokens (13 x group rows) spans
    several tiles, which split its tokens' heads between them."""
    compare_attention_with_torch_native(shape, [13, 2], [5, 70], DTYPES[0], tree=True, seed=3)


@kernel_test
@pytest.mark.parametrize("tree", [True, False])
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_short_queries_with_split_kv_match_torch_native(shape, tree, monkeypatch):
    """On a GPU of many SMs a short query's KV splits into runs of whole blocks (16 splits
    here: most of them empty for the 70- and 5-token contexts) that stage 2 merges; trees and
    causal extends of 4, 3 and 1 tokens."""
    merged = []

    def recording_merge(part_o, part_lse, out, signal_dependents=False):
        merged.append(part_o.shape[2])
        merge_kv_splits(part_o, part_lse, out, signal_dependents)

    monkeypatch.setattr(extend, "sm_count", lambda device: 4096)
    monkeypatch.setattr(extend, "merge_kv_splits", recording_merge)
    compare_attention_with_torch_native(shape, [4, 3, 1], [200, 2, 69], DTYPES[0], tree=tree, seed=4)
    short = 4 * (shape.num_heads // shape.num_kv_heads) <= extend.SHORT_QUERY_ROWS
    assert merged == ([MAX_KV_SPLITS] if short else [])


@pytest.mark.parametrize("sms", [8, 132, 4096])
def test_graph_batches_split_kv_as_eager(sms, monkeypatch):
    """A CUDA graph replays a batch padded to a captured size; its short queries take the KV
    splits of the unpadded eager batch, so both sum in the same order."""
    monkeypatch.setattr(extend, "sm_count", lambda device: sms)
    captured = capture_batch_sizes(None, 160, 4096)
    for bs in range(1, 161):
        padded = padded_batch_size(bs, captured, disable_padding=False)
        for tiles in (1, 2, 8):
            assert extend.short_query_kv_splits(bs, tiles, DEVICE) == extend.short_query_kv_splits(padded, tiles, DEVICE)
    assert extend.short_query_kv_splits(1, 1, DEVICE) == min(MAX_KV_SPLITS, sms)


@kernel_test
@pytest.mark.parametrize("splits", [2, 4])
def test_forced_kv_splits_match_one_split(splits):
    """kv_splits spreads a tree's KV over that many programs per tile; the merged output
    equals the single-program one."""
    shape = ATTN_SHAPES[1]
    fb, q, k, v = make_attention_batch(shape, [4, 2], [150, 40], DTYPES[0], DEVICE, tree=True, seed=5)
    backend = TritonAttnBackend()
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    layer = shape.layer()
    backend.forward(q, k, v, layer, fb)  # stores the new tokens' K/V in the pool
    k_cache, v_cache = load_kv(layer, fb)
    q3 = q.view(q.shape[0], shape.num_heads, shape.head_dim)
    outs = []
    for kv_splits in (1, splits):
        out = q3.new_empty(q3.shape[0], shape.num_heads, shape.v_head_dim)
        backend.extend(q3, k_cache, v_cache, out, layer.scaling, fb.custom_mask, kv_splits=kv_splits)
        outs.append(out.float())
    torch.testing.assert_close(outs[1], outs[0], atol=KERNEL_TOL[DTYPES[0]], rtol=KERNEL_TOL[DTYPES[0]])


@kernel_test
@pytest.mark.parametrize("shape", [ATTN_SHAPES[1], ATTN_SHAPES[3]])
def test_zero_row_batch(shape):
    fb, q, k, v = make_attention_batch(shape, [], [], DTYPES[0], DEVICE)
    backend = TritonAttnBackend()
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, shape.layer(), fb)
    assert out.shape == (0, shape.num_heads * shape.v_head_dim)


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)


def _gathered_slots(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([table[r, :n] for r, n in zip(rows.tolist(), seq_lens.tolist())] + [table.new_empty(0)])


@kernel_test
@pytest.mark.parametrize("bs", [0, 1, 7, 2 * PREFIX_BLOCK + 45])
@pytest.mark.parametrize("seq_dtype", [torch.int64, torch.int32])
def test_kv_metadata_matches_torch(bs, seq_dtype):
    """One launch gives the cumsum offsets, the gathered slots and num_kv_splits; the largest
    batch sums its earlier lengths over several PREFIX_BLOCK steps."""
    gen = torch.Generator().manual_seed(bs)
    width = MIN_TOKENS_PER_SPLIT * MAX_KV_SPLITS + 70  # one request's splits reach the cap
    seq_lens = torch.randint(0, 100, (bs,), generator=gen)
    seq_lens[bs // 2 :: 97] = 0
    seq_lens[bs // 3 :: 101] = width
    ext_lens = torch.minimum(torch.randint(0, 9, (bs,), generator=gen), seq_lens)
    table = torch.randint(0, 1 << 40, (bs + 3, width), generator=gen)
    rows = torch.randperm(bs + 3, generator=gen)[:bs]
    seq_lens, ext_lens, table, rows = (t.to(DEVICE) for t in (seq_lens.to(seq_dtype), ext_lens.to(seq_dtype), table, rows))
    new = lambda n, dtype=torch.int32: torch.full((n,), -1, dtype=dtype, device=DEVICE)
    kv_indptr, qo_indptr, splits = new(bs + 1), new(bs + 1), new(bs)
    kv_indices = new(int(seq_lens.sum()) + 5, torch.int64)
    build_kv_metadata(
        table,
        rows,
        seq_lens,
        kv_indptr,
        kv_indices,
        split_tokens=MIN_TOKENS_PER_SPLIT,
        max_splits=MAX_KV_SPLITS,
        num_kv_splits=splits,
        extend_seq_lens=ext_lens,
        qo_indptr=qo_indptr,
    )
    assert torch.equal(kv_indptr, _indptr(seq_lens))
    assert torch.equal(qo_indptr, _indptr(ext_lens))
    assert torch.equal(splits, num_kv_splits(seq_lens))
    total = int(seq_lens.sum())
    assert torch.equal(kv_indices[:total], _gathered_slots(table, rows, seq_lens))
    assert (kv_indices[total:] == -1).all()  # nothing written past the batch's slots


def _backend_metadata(fb: ForwardBatch, graph: bool) -> TritonAttnMetadata:
    """The Triton backend's metadata for fb, eager or as a captured forward builds it."""
    backend = TritonAttnBackend()
    if graph:
        backend.init_cuda_graph_state(fb.batch_size, fb.batch_size * fb.req_to_token_pool.req_to_token.shape[1], DEVICE)
        backend.init_forward_metadata_graph(fb, max(fb.extend_seq_lens_cpu, default=0))
    else:
        backend.init_forward_metadata(fb)
    return backend.metadata


@kernel_test
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize(
    "ext_lens, prefix_lens, tree",
    [
        ([1] * 5, [0, 63, 64, 200, 1100], False),  # decode
        ([1] * 300, list(range(0, 900, 3)), False),  # decode, more requests than PREFIX_BLOCK
        ([5, 17, 0, 70, 1], [0, 40, 3, 16, 9], False),  # extend
        ([4, 6, 1], [10, 0, 65], True),  # tree verify
    ],
)
def test_backend_metadata_matches_torch(ext_lens, prefix_lens, tree, graph):
    """The metadata of eager and captured forwards: the decode kernel's offsets, slots and
    splits, or the extend kernel's offsets and slots, as plain-PyTorch formulas give them."""
    fb, *_ = make_attention_batch(ATTN_SHAPES[0], ext_lens, prefix_lens, DTYPES[0], DEVICE, tree)
    meta = _backend_metadata(fb, graph)
    decode = not tree and all(e == 1 for e in ext_lens)
    assert meta.use_decode_kernel == decode
    assert torch.equal(meta.kv_indptr, _indptr(fb.seq_lens))
    total = sum(fb.seq_lens_cpu)
    assert torch.equal(
        meta.kv_indices[:total], _gathered_slots(fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens)
    )
    if decode:
        assert meta.qo_indptr is None and torch.equal(meta.num_kv_splits, num_kv_splits(fb.seq_lens))
    else:
        assert meta.num_kv_splits is None and torch.equal(meta.qo_indptr, _indptr(fb.extend_seq_lens))


@kernel_test
@pytest.mark.parametrize("graph", [False, True])
def test_backend_metadata_of_no_request(graph):
    meta = _backend_metadata(make_attention_batch(ATTN_SHAPES[0], [], [], DTYPES[0], DEVICE)[0], graph)
    assert meta.kv_indptr.tolist() == [0]
    assert meta.qo_indptr is None or meta.qo_indptr.tolist() == [0]
    assert meta.num_kv_splits is None or meta.num_kv_splits.numel() == 0


# (tokens, experts, top_k, hidden, intermediate): 0 rows, decode-sized, several blocks per
# expert, widths that are not multiples of the tiles, more experts than routed pairs.
MOE_SHAPES = [(0, 4, 2, 32, 48), (1, 8, 2, 32, 48), (5, 4, 1, 40, 24), (33, 6, 3, 64, 80), (3, 16, 2, 32, 32)]
if ON_CUDA:
    MOE_SHAPES += [(200, 64, 6, 1024, 352), (1, 256, 8, 2048, 256)]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_fused_moe_matches_native(shape, dtype):
    num_tokens, num_experts, top_k, hidden, inter = shape
    gen = torch.Generator().manual_seed(num_tokens * 7 + num_experts)
    rand = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEVICE, dtype)
    x = rand(num_tokens, hidden)
    w13, w2 = rand(num_experts, 2 * inter, hidden, scale=hidden**-0.5), rand(num_experts, hidden, inter, scale=inter**-0.5)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    ref = moe_forward_native(x, w13, w2, weights, ids)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=KERNEL_TOL[dtype], rtol=KERNEL_TOL[dtype])


# DeepSeek-V2-Lite (softmax greedy), V2 (group-limited, 20-expert groups), V3 (sigmoid noaux_tc
# with bias, renormalized and scaled), single-expert groups, and tiny test configs.
ROUTINGS = [
    RoutingConfig(6, 64),
    RoutingConfig(6, 160, topk_method="group_limited_greedy", num_expert_group=8, topk_group=3, routed_scaling_factor=16.0),
    RoutingConfig(8, 256, "sigmoid", "noaux_tc", 8, 4, renormalize=True, routed_scaling_factor=2.5),
    RoutingConfig(3, 20, "sigmoid", "noaux_tc", 4, 2, renormalize=True),
    RoutingConfig(2, 8, "sigmoid", "noaux_tc", 8, 3),
    RoutingConfig(2, 8, renormalize=True),
]


@kernel_test
@pytest.mark.parametrize("num_tokens", [0, 1, 37])
@pytest.mark.parametrize("cfg", ROUTINGS, ids=lambda c: f"{c.topk_method}-{c.num_experts}x{c.top_k}")
def test_triton_routing_matches_select_experts(cfg, num_tokens):
    gen = torch.Generator().manual_seed(cfg.num_experts + num_tokens)
    logits = torch.randn(num_tokens, cfg.num_experts, generator=gen).to(DEVICE, DTYPES[0])
    bias = (torch.randn(cfg.num_experts, generator=gen) * 0.1).to(DEVICE) if cfg.topk_method == "noaux_tc" else None
    ref_w, ref_ids = select_experts(logits, cfg, bias)
    got_w, got_ids = select_experts_triton(logits, cfg, bias)
    assert got_ids.shape == ref_ids.shape == (num_tokens, cfg.top_k) and got_ids.dtype == ref_ids.dtype
    # The same experts per row, in any order, with the same weights.
    ref_ids, ref_order = ref_ids.sort(dim=-1)
    got_ids, got_order = got_ids.sort(dim=-1)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w.gather(1, got_order), ref_w.gather(1, ref_order), atol=1e-5, rtol=1e-5)


def test_host_launch_sizes_match_triton():

    from sglang.srt.utils.int_math import cdiv, next_power_of_2

    assert [next_power_of_2(n) for n in range(5000)] == [triton.next_power_of_2(n) for n in range(5000)]
    assert [cdiv(a, b) for a in range(300) for b in (1, 3, 16, 64)] == [
        triton.cdiv(a, b) for a in range(300) for b in (1, 3, 16, 64)
    ]


@pytest.mark.parametrize("slots", [3, 8])
def test_moe_warm_up_meets_every_variant_once(slots):
    """One warm-up batch per kernel variant (alignment power of two x tile config): every batch
    size up to the budget shares its variant with one of them, and no two share one."""
    device = torch.device("cpu")
    max_tokens = 2 * MAX_PAIRS_ONE_PROGRAM // slots
    counts = variant_token_counts(slots, max_tokens, device)
    keys = [variant_key(t * slots, device) for t in counts]
    assert counts[0] == 1 and len(set(keys)) == len(keys)
    assert {variant_key(t * slots, device) for t in range(1, max_tokens + 1)} == set(keys)
    # The first batch past the one-program alignment takes the plain-PyTorch one.
    assert MAX_PAIRS_ONE_PROGRAM // slots + 1 in counts


@kernel_test
def test_moe_warm_up_runs_its_batches():
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(5, 16, 8, generator=gen).to(DEVICE)
    w2 = torch.randn(5, 8, 8, generator=gen).to(DEVICE)
    assert warm_up_variants(w13, w2, slots=3, max_tokens=40) == len(variant_token_counts(3, 40, w13.device))


@kernel_test
@pytest.mark.parametrize(
    "shape", [(1, 8, 2, 16), (1, 64, 6, 16), (37, 8, 3, 16), (170, 64, 6, 64), (128, 64, 8, 16), (5, 256, 8, 16)]
)
def test_one_program_alignment_matches_torch(shape):
    """The same sorted pair order and block experts as the plain-PyTorch alignment."""
    num_tokens, num_experts, top_k, block_m = shape
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    ids = torch.randn(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1)[1].to(DEVICE)
    pairs, blocks = align_by_expert(ids, num_experts, block_m)
    ref_pairs, ref_blocks = _align_by_expert_torch(ids.flatten(), num_experts, block_m, blocks.shape[0])
    assert torch.equal(pairs, ref_pairs) and torch.equal(blocks, ref_blocks)
