"""The DeepSeek decode-path kernels vs their plain-PyTorch references.

- The YaRN rotary table holds exactly the on-the-fly cos/sin of float(position) * inv_freq.
- Stacked projection rows (q and kv_a in one GEMM) are views their loaders fill in place.
- MLA's rope-and-pack step (one kernel on CUDA) writes what the rope module and two
  concatenations wrote, for DeepSeek's YaRN module and the plain one, both pair layouts.
- The router's float32 logits (one kernel for decode batches) equal x.float() @ W^T; with the
  residual add and RMSNorm folded into its launch, the norm's outputs are the norm kernel's.
- The fused MoE with the shared experts as extra always-selected experts (GEMV kernels,
  grouped GEMMs at two block sizes, the tile table's choice) equals the routed experts plus
  a separate shared MLP, with routed_scaling_factor on the routed weights only.
- MLA decode attention at the real widths (576 / 512, the finer split) equals the torch backend.
- On CUDA, a tiny DeepSeek-V3 with PDL launches and the fused router equals itself without them.

Kernels run compiled on CUDA, or under Triton's CPU interpreter in a subprocess (see
sglang.test.triton_harness); without triton the kernel tests are skipped.
"""

from __future__ import annotations

import copy
import dataclasses
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import triton  # noqa: F401  (a test dependency: never skipped when missing)

from sglang.srt.kernels.moe.routing_config import RoutingConfig
from sglang.srt.kernels.moe.tiles import GemmTile, MoeKernelConfig
from sglang.srt.layers.deepseek_rotary import mla_rope_pack
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.moe.fused_moe import moe_forward_native
from sglang.srt.layers.moe.topk import select_experts
from sglang.srt.layers.rotary_embedding import DeepseekScalingRotaryEmbedding, RotaryEmbedding, yarn_inv_freq
from sglang.test.attention_batches import AttnShape
from sglang.test.triton_harness import (
    DEVICE,
    NEEDS_SUBPROCESS,
    ON_CUDA,
    compare_attention_with_torch_native,
    kernel_test,
    rerun_under_interpreter,
)

DTYPES = [torch.bfloat16, torch.float32] if ON_CUDA else [torch.float32]
YARN = dict(scaling_factor=40.0, mscale=0.707, mscale_all_dim=0.5, beta_fast=32, beta_slow=1)


@pytest.mark.skipif(not NEEDS_SUBPROCESS, reason="already compiled or interpreted in this process")
def test_kernels_under_triton_interpreter():
    rerun_under_interpreter(__file__, timeout=900)


def test_yarn_table_is_the_on_the_fly_cos_sin():
    rope = DeepseekScalingRotaryEmbedding(64, 64, 128, 10000.0, False, **YARN)
    assert rope.cos_sin_cache.shape == (128 * 40, 64)
    positions = torch.tensor([0, 1, 77, 5119])
    freqs = positions[:, None] * yarn_inv_freq(64, 10000.0, 40.0, 128, 32, 1)[None, :]
    assert torch.equal(rope.cos_sin_cache[positions], torch.cat([freqs.cos(), freqs.sin()], dim=-1))


def test_stack_rows_is_one_gemm_over_the_layers_views():
    from sglang.srt.layers.linear import ReplicatedLinear, stack_rows

    q, kv = ReplicatedLinear(8, 5, bias=False), ReplicatedLinear(8, 3, bias=True)
    weight, bias = stack_rows([q, kv])
    for param, shape in ((q.weight, (5, 8)), (kv.weight, (3, 8)), (kv.bias, (3,))):
        param.weight_loader(param, torch.randn(shape))  # loaders write the stacked storage
    x = torch.randn(4, 8)
    torch.testing.assert_close(F.linear(x, weight, bias), torch.cat([q(x), kv(x)], dim=-1))
    assert torch.equal(bias[:5], torch.zeros(5))  # the bias-free layer's rows


def _rope_modules(neox: bool) -> list[RotaryEmbedding]:
    yarn = DeepseekScalingRotaryEmbedding(16, 16, 64, 10000.0, neox, **YARN)
    return [yarn, RotaryEmbedding(16, 16, 256, 10000.0, neox)]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 5])
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("broadcast", [False, True], ids=["positions", "one position for all"])
@pytest.mark.parametrize("norm", [False, True], ids=["raw latent", "latent normed in the kernel"])
def test_mla_rope_pack_matches_rope_and_cat(norm, broadcast, neox, num_tokens, dtype):
    """broadcast: the positions are one position expanded (stride 0), as a draft step's topk
    guesses of one request have them. norm: kv_a_layernorm applied to the latent first."""
    heads, nope, rot, latent_dim = 3, 8, 16, 24
    gen = torch.Generator().manual_seed(num_tokens)
    q = torch.randn(num_tokens, heads, nope + rot, generator=gen).to(dtype)
    kv = torch.randn(num_tokens, latent_dim + rot, generator=gen).to(dtype)
    latent = (torch.randn(num_tokens, latent_dim + 5, generator=gen) * 3).to(dtype)[:, :latent_dim]  # a column slice
    latent_norm = None
    if norm:
        latent_norm = RMSNorm(latent_dim, eps=1e-6)
        latent_norm.weight.data = torch.randn(latent_dim, generator=gen).to(dtype)
    want_latent = latent if latent_norm is None else latent_norm.forward_native(latent)
    positions = torch.randint(0, 256, (num_tokens,), generator=gen)
    if broadcast:
        positions = torch.randint(0, 256, (1, 1), generator=gen).expand(1, num_tokens).flatten()
    for rope in _rope_modules(neox):
        q_rot, k_rot = rope.forward_native(positions, q[..., nope:], kv[:, latent_dim:].unsqueeze(1))
        dev = lambda x: x.to(DEVICE)
        q_out = torch.full((num_tokens, heads, latent_dim + rot), 7.0, dtype=dtype, device=DEVICE)
        if ON_CUDA:
            dev_norm = None if latent_norm is None else copy.deepcopy(latent_norm).to(DEVICE)
            k_out = mla_rope_pack(
                rope.to(DEVICE),
                dev(positions),
                dev(q)[..., nope:],
                dev(kv)[:, latent_dim:],
                dev(latent),
                q_out,
                latent_norm=dev_norm,
            )
        else:
            k_out = _interpreted_pack(rope, positions, q[..., nope:], kv[:, latent_dim:], latent, q_out, latent_norm=latent_norm)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(q_out[..., latent_dim:].cpu(), q_rot, atol=tol, rtol=tol)
        assert torch.all(q_out[..., :latent_dim] == 7.0)  # the caller's channels are left alone
        torch.testing.assert_close(k_out.cpu(), torch.cat([want_latent, k_rot.squeeze(1)], dim=-1), atol=tol, rtol=tol)


def _interpreted_pack(rope, positions, q_pe, k_pe, latent, q_out, kv_store=None, latent_norm=None) -> torch.Tensor | None:
    """The Triton path on CPU tensors (mla_rope_pack dispatches on is_cuda)."""
    from sglang.srt.kernels.mla import mla_rope_pack_triton

    scale = rope.mscale if isinstance(rope, DeepseekScalingRotaryEmbedding) else 1.0
    norm = None if latent_norm is None else (latent_norm.weight, latent_norm.variance_epsilon)
    return mla_rope_pack_triton(
        positions, q_pe, k_pe, latent, q_out, rope.cos_sin_cache, scale, rope.is_neox_style, kv_store, norm
    )


@kernel_test
@pytest.mark.parametrize("pool_dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 5])
def test_mla_rope_pack_stores_k_into_the_pool_rows(num_tokens, pool_dtype):
    """kv_store: k goes to the pool rows loc (cast to the pool's dtype, as set_kv_buffer casts),
    q as without it; every other row is left alone; nothing is returned."""
    heads, nope, rot, latent_dim, slots = 3, 8, 16, 24, 12
    gen = torch.Generator().manual_seed(num_tokens)
    dtype = DTYPES[0]
    q = torch.randn(num_tokens, heads, nope + rot, generator=gen).to(DEVICE, dtype)
    k_pe = torch.randn(num_tokens, rot, generator=gen).to(DEVICE, dtype)
    latent = torch.randn(num_tokens, latent_dim, generator=gen).to(DEVICE, dtype)
    positions = torch.randint(0, 256, (num_tokens,), generator=gen).to(DEVICE)
    loc = torch.randperm(slots, generator=gen)[:num_tokens].to(DEVICE)
    for rope in _rope_modules(neox=False):
        rope = rope.to(DEVICE)
        q_ref = torch.full((num_tokens, heads, latent_dim + rot), 7.0, dtype=dtype, device=DEVICE)
        k_ref = _interpreted_pack(rope, positions, q[..., nope:], k_pe, latent, q_ref)
        for pack in (_interpreted_pack, mla_rope_pack):  # the kernel, and the plain path on CPU
            pool = torch.full((slots, 1, latent_dim + rot), -3.0, dtype=pool_dtype, device=DEVICE)
            q_out = torch.full_like(q_ref, 7.0)
            assert pack(rope, positions, q[..., nope:], k_pe, latent, q_out, (pool, loc)) is None
            want = torch.full_like(pool, -3.0)
            want[loc] = k_ref.to(pool_dtype).unsqueeze(1)
            tol = 1e-5 if pack is _interpreted_pack else 1e-4  # the plain path rounds elsewhere
            torch.testing.assert_close(q_out, q_ref, atol=tol, rtol=tol)
            torch.testing.assert_close(pool, want, atol=tol, rtol=tol)


@kernel_test
def test_deepseek_with_the_latent_stored_by_rope_matches_plain(tiny_deepseek_v3_no_mtp_dir):
    """A tiny DeepSeek-V3 whose rope kernel stores the latent into the pool (attention gets no
    k/v) gives the logits and greedy tokens of the plain path (rope, then the pool's store)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model
    from sglang.test.model_harness import ModelHarness

    config = ModelConfig(tiny_deepseek_v3_no_mtp_dir, dtype="float32", device=DEVICE)
    model = get_model(config, "auto", DEVICE)
    prompts = [[5, 17, 42, 7, 99], [3], [11, 12, 13, 200, 201, 202]]

    def run(rope_stores: bool) -> tuple[list[torch.Tensor], list[list[int]]]:
        with mock.patch("sglang.srt.layers.radix_attention.rope_stores_kv", lambda q: rope_stores):
            harness = ModelHarness(model, config, DEVICE)
            return harness.run_prefill(prompts), harness.greedy_generate(prompts, max_new_tokens=4)

    ref_logits, ref_tokens = run(rope_stores=False)
    stores = [0]

    def kernel_stores(rope, positions, q_pe, k_pe, latent, q_out, kv_store=None, latent_norm=None):
        assert kv_store is not None and latent_norm is not None  # the kernel norms the latent too
        stores[0] += 1
        return _interpreted_pack(rope, positions, q_pe, k_pe, latent, q_out, kv_store, latent_norm)

    with mock.patch("sglang.srt.layers.radix_attention.mla_rope_pack", kernel_stores):
        logits, tokens = run(rope_stores=True)
    assert stores[0] > 0 and tokens == ref_tokens
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@kernel_test
# 17 and 40 tokens: two and three token blocks for (8, 40); cuBLAS for (64, 2048) in float32.
@pytest.mark.parametrize("num_tokens", [0, 1, 3, 16, 17, 40])
@pytest.mark.parametrize("shape", [(8, 40), (64, 2048)] + ([(256, 7168)] if ON_CUDA else []))
def test_router_logits_match_float32_linear(shape, num_tokens):
    from sglang.srt.kernels.moe.routing import router_logits

    num_experts, hidden = shape
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    weight = torch.randn(num_experts, hidden, generator=gen).to(DEVICE)
    x = torch.randn(num_tokens, hidden + 3, generator=gen).to(DEVICE, DTYPES[0])[:, :hidden]  # a column slice
    got = router_logits(x, weight)
    ref = (x.double() @ weight.double().T).float()
    assert got.dtype == torch.float32 and got.shape == (num_tokens, num_experts)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got, F.linear(x.float(), weight), atol=1e-4, rtol=1e-5)


@kernel_test
# 5 tokens of 64 experts: past FUSED_NORM_MAX_PROGRAMS, the norm and the router in turn.
@pytest.mark.parametrize("num_tokens", [0, 1, 4, 5])
@pytest.mark.parametrize("shape", [(8, 40), (64, 2048)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_norm_router_logits_equal_the_norm_then_the_router(shape, num_tokens, dtype):
    from sglang.srt.kernels.elementwise import fused_add_rms_norm
    from sglang.srt.kernels.moe.routing import add_rms_norm_router_logits, router_logits

    num_experts, hidden = shape
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    router_weight = torch.randn(num_experts, hidden, generator=gen).to(DEVICE)
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    x = torch.randn(num_tokens, hidden + 3, generator=gen).to(DEVICE, dtype)[:, :hidden]  # a column slice
    residual = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    normed, s, logits = add_rms_norm_router_logits(x, residual, norm_weight, 1e-6, router_weight)
    want_normed, want_s = fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    assert torch.equal(s, want_s) and torch.equal(normed, want_normed)
    assert logits.dtype == torch.float32 and logits.shape == (num_tokens, num_experts)
    torch.testing.assert_close(logits, router_logits(want_normed, router_weight), atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not ON_CUDA, reason="PDL and the fused router run on CUDA only")
def test_deepseek_with_pdl_and_the_fused_router_matches_without(tiny_deepseek_v3_no_mtp_dir, monkeypatch):
    """A tiny DeepSeek-V3 on CUDA with its kernels launched early (PDL) and the MoE's add and
    norm in the router's launch gives the logits and greedy tokens of the same model with
    neither (SGLANG_DISABLE_PDL, then the norm and the router in turn)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.kernels import launch
    from sglang.srt.model_loader.loader import get_model
    from sglang.test.model_harness import ModelHarness

    config = ModelConfig(tiny_deepseek_v3_no_mtp_dir, dtype="float32", device=DEVICE)
    model = get_model(config, "auto", DEVICE)
    prompts = [[5, 17, 42, 7, 99], [3], [11, 12, 13, 200, 201, 202]]

    def run() -> tuple[list[torch.Tensor], list[list[int]]]:
        launch.signals_dependents.cache_clear()
        harness = ModelHarness(model, config, DEVICE)
        return harness.run_prefill(prompts), harness.greedy_generate(prompts, max_new_tokens=6)

    assert launch.signals_dependents(torch.device(DEVICE)) == (torch.cuda.get_device_capability()[0] >= 9)
    logits, tokens = run()
    monkeypatch.setenv("SGLANG_DISABLE_PDL", "1")
    monkeypatch.setattr("sglang.srt.kernels.moe.routing.router_fuses_add_norm", lambda *_: False)
    ref_logits, ref_tokens = run()
    assert not launch.signals_dependents(torch.device(DEVICE))
    launch.signals_dependents.cache_clear()
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# Tiles that do not divide the widths (hidden 40 / 2048, intermediate 24 / 1408); None: the
# tile table's choice.
MOE_CONFIGS = {
    "gemv": MoeKernelConfig(1, GemmTile(16, 32, 4, 2), GemmTile(8, 32, 2, 3)),
    "grouped16": MoeKernelConfig(16, GemmTile(16, 32, 4, 2), GemmTile(32, 16, 4, 2)),
    "grouped64": MoeKernelConfig(64, GemmTile(32, 32, 4, 3), GemmTile(32, 32, 4, 3)),
    "table": None,
}
# V2-Lite-like (softmax greedy, two shared experts) and V3-like (sigmoid noaux_tc with bias,
# renormalized, routed weights scaled by 2.5, one shared expert).
MOE_ROUTINGS = [
    RoutingConfig(3, 8, num_shared_experts=2),
    RoutingConfig(3, 8, "sigmoid", "noaux_tc", 4, 2, renormalize=True, routed_scaling_factor=2.5, num_shared_experts=1),
]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", MOE_CONFIGS)
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 17])
@pytest.mark.parametrize("routing", MOE_ROUTINGS, ids=lambda r: r.topk_method)
def test_fused_moe_with_shared_experts_matches_separate_mlp(routing, num_tokens, config, dtype):
    _check_fused_moe_with_shared(routing, num_tokens, MOE_CONFIGS[config], dtype, hidden=40, inter=24)


@pytest.mark.skipif(not ON_CUDA, reason="compiled kernels only (the interpreter is too slow at these widths)")
@pytest.mark.parametrize("config", MOE_CONFIGS)
@pytest.mark.parametrize("num_tokens", [1, 4, 32])
def test_fused_moe_at_v2_lite_widths(num_tokens, config):
    routing = RoutingConfig(6, 64, num_shared_experts=2)
    _check_fused_moe_with_shared(routing, num_tokens, MOE_CONFIGS[config], torch.bfloat16, hidden=2048, inter=1408)


def _check_fused_moe_with_shared(routing, num_tokens, config, dtype, hidden, inter):
    from sglang.srt.kernels.moe.grouped_gemm import fused_moe
    from sglang.srt.kernels.moe.routing import select_experts_triton

    num_experts, num_shared = routing.num_experts, routing.num_shared_experts
    gen = torch.Generator().manual_seed(num_tokens + num_shared)
    rand = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEVICE, dtype)
    x = rand(num_tokens, hidden)
    w13 = rand(num_experts + num_shared, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = rand(num_experts + num_shared, hidden, inter, scale=inter**-0.5)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE)
    bias = (torch.randn(num_experts, generator=gen) * 0.1).to(DEVICE) if routing.topk_method == "noaux_tc" else None

    # Reference: the routed experts, then one shared MLP of intermediate S * I whose channels
    # are the shared slots' (gate, up rows and down columns in slot order), added in dtype.
    routed = moe_forward_native(
        x, w13[:num_experts], w2[:num_experts], *select_experts(logits, dataclasses.replace(routing, num_shared_experts=0), bias)
    )
    gate = w13[num_experts:, :inter].reshape(-1, hidden)
    up = w13[num_experts:, inter:].reshape(-1, hidden)
    down = w2[num_experts:].permute(1, 0, 2).reshape(hidden, -1)
    ref = routed + F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    weights, ids = select_experts_triton(logits, routing, bias)
    assert ids.shape == (num_tokens, routing.top_k + num_shared)
    shared_ids = torch.arange(num_experts, num_experts + num_shared, device=DEVICE).expand(num_tokens, -1)
    assert torch.equal(ids[:, routing.top_k :], shared_ids)
    assert torch.all(weights[:, routing.top_k :] == 1.0)
    got = fused_moe(x, w13, w2, weights, ids, config)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    tol = 1e-4 if dtype == torch.float32 and not ON_CUDA else 1e-2 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    native = moe_forward_native(x, w13, w2, *select_experts(logits, routing, bias))  # the CPU path
    torch.testing.assert_close(native.float(), ref.float(), atol=tol, rtol=tol)


@kernel_test
def test_wide_mla_decode_matches_torch_native():
    """576 / 512 channels: 32-token blocks, two splits per 64-token unit (up to the 16 cap)."""
    fb = compare_attention_with_torch_native(AttnShape(16, 1, 576, 512, mla=True), [1] * 5, [0, 40, 130, 300, 700], DTYPES[0])
    assert fb.attn_backend.metadata.num_kv_splits.tolist() == [1, 1, 3, 5, 11]


@kernel_test
def test_every_benchmarked_mla_decode_tile_gives_the_default_tiles_output(monkeypatch):
    """The stage-1 tiles that benchmark/kernels/bench_mla_decode.py times attend alike (their
    block sizes change the split points, so the sums differ in rounding only)."""
    import importlib.util
    from pathlib import Path

    from sglang.srt.kernels.attention.decode import decode_attention

    kernels_dir = Path(__file__).resolve().parents[1] / "benchmark" / "kernels"
    monkeypatch.syspath_prepend(str(kernels_dir))  # the bench imports its folder's graph_timing
    spec = importlib.util.spec_from_file_location("bench_mla_decode", kernels_dir / "bench_mla_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    q, k, v, indptr, indices, splits = bench.make_case(2, 100, DEVICE)
    outputs = []
    for tile in [None, *bench.TILES]:
        out = torch.empty(2, bench.HEADS, bench.LV, dtype=torch.bfloat16, device=DEVICE)
        decode_attention(q, k, v, out, indptr, indices, splits, bench.LK**-0.5, tile)
        outputs.append(out.float())
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], atol=1e-2, rtol=1e-2)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 16])
def test_head_matmul_matches_bmm(num_tokens, dtype):
    """MLA's two absorbed projections at DeepSeek's widths: q_nope @ W_UK into q's latent
    channels (strided a, out a channel slice) and o_latent @ W_UV^T (b transposed)."""
    from sglang.srt.kernels.mla import head_matmul_triton

    heads, nope, rope, latent, v = 4, 128, 64, 512, 128
    gen = torch.Generator().manual_seed(num_tokens)
    rand = lambda *s: torch.randn(*s, generator=gen).to(DEVICE, dtype)
    kv_b = rand(heads, nope + v, latent) * latent**-0.5
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
    q_nope = rand(num_tokens, heads, nope + rope)[..., :nope]
    q_full = torch.full((num_tokens, heads, latent + rope), 7.0, dtype=dtype, device=DEVICE)
    head_matmul_triton(q_nope, w_uk, q_full[..., :latent])
    o_latent = rand(num_tokens, heads, latent)
    o = torch.empty((num_tokens, heads, v), dtype=dtype, device=DEVICE)
    head_matmul_triton(o_latent, w_uv.transpose(1, 2), o)
    tol = 1e-4 if dtype == torch.float32 and not ON_CUDA else 2e-2  # CUDA fp32 dots run in TF32
    ref_q = torch.bmm(q_nope.transpose(0, 1).float(), w_uk.float()).transpose(0, 1)
    torch.testing.assert_close(q_full[..., :latent].float(), ref_q, atol=tol, rtol=tol)
    assert torch.all(q_full[..., latent:] == 7.0)
    ref_o = torch.bmm(o_latent.transpose(0, 1).float(), w_uv.transpose(1, 2).float()).transpose(0, 1)
    torch.testing.assert_close(o.float(), ref_o, atol=tol, rtol=tol)
