"""The decode GEMV (kernels/gemv.py) against F.linear, its gated form against the GEMM +
SiluAndMul it replaces, the dispatch table, and a tiny Llama run with every GEMV, the gated MLP
and the rope + KV-store kernel forced on against the plain layers.

Compiled on CUDA (fp32, bf16); on CPU under Triton's interpreter (float32, small shapes, in a
subprocess, see sglang.test.triton_harness). Without triton the module is skipped.
"""

from __future__ import annotations

from typing import Optional
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.kernels import gemv as gemv_module
from sglang.srt.kernels.gemv import MAX_ALL_ROWS, GemvConfig, gemv, pick_config
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.linear import stack_rows
from sglang.srt.model_loader import get_model
from sglang.test.model_harness import ModelHarness
from sglang.test.tiny_models import make_tiny_llama
from sglang.test.triton_harness import DEVICE, NEEDS_SUBPROCESS, ON_CUDA, kernel_test, rerun_under_interpreter

DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

# The three kinds of program (FMAs for one row, FMAs for every row, tensor cores), unpipelined
# and pipelined (the FMA paths load x differently in each), and tiles wider than some of the
# shapes below.
CONFIGS = [
    GemvConfig(16, 32),
    GemvConfig(8, 64, num_stages=2),
    GemvConfig(16, 32, all_rows=True),
    GemvConfig(8, 64, num_stages=2, all_rows=True),
    GemvConfig(16, 32, use_dot=True),
    GemvConfig(32, 16, num_stages=3, use_dot=True),
]
if ON_CUDA:
    CONFIGS += [
        GemvConfig(8, 512),
        GemvConfig(4, 512, all_rows=True),
        GemvConfig(16, 256, num_stages=3, use_dot=True),
        GemvConfig(8, 512, pdl=True),
        GemvConfig(4, 512, all_rows=True, pdl=True),
        GemvConfig(16, 256, num_stages=3, use_dot=True, pdl=True),
    ]
# (N, K): N and K multiples of no tile, one row, and even tiles.
SHAPES = [(37, 50), (1, 24), (64, 128)]
if ON_CUDA:
    SHAPES += [(6144, 4096), (576, 1536)]
# Rows of x: none, one, a few (padded to 4 by all_rows), more than one 16-row tile, more than
# one 32-row tile (tensor cores only: the interpreter runs an FMA program per row).
ROWS = [0, 1, 3, 17, 40]


def _max_rows(config: GemvConfig) -> int:
    return MAX_ALL_ROWS if config.all_rows else 40 if config.use_dot else 17


CASES = [(config, rows) for config in CONFIGS for rows in ROWS if rows <= _max_rows(config)]


def _case_id(case) -> str:
    return f"{case[0]}-rows{case[1]}"


@pytest.mark.skipif(not NEEDS_SUBPROCESS, reason="already compiled or interpreted in this process")
def test_gemv_under_triton_interpreter():
    rerun_under_interpreter(__file__, timeout=900)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _check(got: torch.Tensor, ref: torch.Tensor, tol: Optional[float] = None) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype and got.is_contiguous()
    tol = tol or TOL[torch.bfloat16 if torch.bfloat16 in (got.dtype, ref.dtype) else torch.float32]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gemv_matches_linear(case, shape, dtype):
    config, rows = case
    n, k = shape
    x = _randn(rows, k, dtype=dtype, seed=rows)
    weight = _randn(n, k, dtype=dtype, seed=n, scale=k**-0.5)
    bias = _randn(n, dtype=dtype, seed=k)
    for b in (None, bias):
        _check(gemv(x, weight, b, config), F.linear(x, weight, b))
    # float32 output: F.linear's result in x's dtype, then float32 (the kernel rounds as it does;
    # both roundings of a bf16 sum may differ by one bf16 step, so x's dtype's tolerance).
    _check(gemv(x, weight, bias, config, out_dtype=torch.float32), F.linear(x, weight, bias).float(), TOL[dtype])


@kernel_test
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_gemv_takes_views_and_leading_dims(config):
    """x: a column slice of a wider tensor, [2, 3, K] ([2, 2, K] for all_rows); weight and bias:
    row views of stack_rows."""
    dtype, k = DTYPES[-1], 40
    x = _randn(2, 2 if config.all_rows else 3, k + 8, dtype=dtype, seed=1)[..., 8:]
    layers = [torch.nn.Linear(k, n, bias=b) for n, b in ((24, True), (9, False))]
    weight, bias = stack_rows(layers)
    weight, bias = weight.to(DEVICE, dtype), bias.to(DEVICE, dtype)
    part_w, part_b = weight[24:], bias[24:]  # the second layer's rows: a view at a row offset, zero bias
    _check(gemv(x, part_w, part_b, config), F.linear(x, part_w, part_b))
    _check(gemv(x, weight, bias, config), F.linear(x, weight, bias))


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gated_gemv_matches_linear_then_silu_and_mul(case, dtype):
    config, rows = case
    inter, k = (1536, 576) if ON_CUDA else (45, 40)
    x = _randn(rows, k, dtype=dtype, seed=rows, scale=2.0)
    weight = _randn(2 * inter, k, dtype=dtype, seed=inter, scale=k**-0.5)
    bias = _randn(2 * inter, dtype=dtype, seed=k)
    act = SiluAndMul()  # its Triton kernel on CUDA, its plain path when interpreted
    for b in (None, bias):
        ref = act(F.linear(x, weight, b)) if ON_CUDA else act.forward_native(F.linear(x, weight, b))
        _check(gemv(x, weight, b, config, gated=True), ref)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need CUDA")
def test_gemv_replays_in_cuda_graph():
    """Captured (no host reads), a replay follows the static input's new values, bit for bit,
    through a chain RMSNorm -> GEMV -> GEMV where each reads the previous output (under PDL the
    GEMVs start before their producer ends and must wait for its writes)."""
    from sglang.srt.kernels.elementwise import rms_norm

    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    norm = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    w1 = torch.randn(2 * 4096, 4096, device="cuda", dtype=torch.bfloat16) * 4096**-0.5
    w2 = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 4096**-0.5
    configs = [c for c in CONFIGS if c.block_k >= 256]
    chain = lambda config: gemv(gemv(rms_norm(x, norm, 1e-5), w1, None, config, gated=True), w2, None, config)
    for config in configs:  # compile outside the capture
        chain(config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [chain(config) for config in configs]
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    ref = F.linear(SiluAndMul()(F.linear(rms_norm(x, norm, 1e-5), w1)), w2)
    for out, config in zip(outs, configs):
        assert torch.equal(out, chain(config)), config
        _check(out, ref)


def test_all_rows_tile_refuses_more_rows_than_it_holds():
    x = torch.zeros(MAX_ALL_ROWS + 1, 8, device=DEVICE)
    with pytest.raises(AssertionError, match="at most"):
        gemv(x, torch.zeros(4, 8, device=DEVICE), None, GemvConfig(4, 8, all_rows=True))


def test_pick_config_reads_the_table():
    """Rows up to each entry's bound take its config (None: cuBLAS); other shapes, gated-ness,
    more rows and non-16-bit dtypes take cuBLAS."""
    fma, dot = GemvConfig(8, 512), GemvConfig(16, 256, use_dot=True)
    table = {(6144, 4096, False): ((1, fma), (4, None), (16, dot))}
    weight = torch.empty(6144, 4096, dtype=torch.bfloat16)
    with mock.patch.object(gemv_module, "_device_table", return_value=table):
        assert [pick_config(r, weight) for r in (0, 1, 2, 4, 5, 16, 17)] == [fma, fma, None, None, dot, dot, None]
        assert pick_config(1, weight, gated=True) is None
        assert pick_config(1, weight.half()) == fma
        assert pick_config(1, weight.float()) is None
        assert pick_config(1, torch.empty(4096, 4096, dtype=torch.bfloat16)) is None


# ---------------------------------------------------------------------- through a model


def _forced(config: GemvConfig):
    """Every linear layer, the gated MLP and the LM head on the GEMV with `config`, and the rope +
    KV-store kernel in attention, whatever the device."""
    return (
        mock.patch("sglang.srt.layers.linear._gemv_config", lambda x, weight, gated: config),
        mock.patch("sglang.srt.layers.radix_attention.rope_stores_kv", lambda q: True),
    )


def _prefill_and_decode(harness: ModelHarness, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Logits of a prefill of every prompt, then of `steps` decode batches (fixed tokens)."""
    reqs = harness.start_requests(prompts)
    try:
        logits = [harness.forward_extend(reqs, [len(p) for p in prompts]).next_token_logits]
        for step in range(steps):
            for r in reqs:
                r.tokens.append(7 + step)
            logits.append(harness.forward_decode(reqs).next_token_logits)
        return logits
    finally:
        harness.finish_requests(reqs)


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory):
    """Tiny Llama with biases on q/k/v, o and the MLP, llama3 rope scaling, untied LM head."""
    path = make_tiny_llama(str(tmp_path_factory.mktemp("biased_llama")), attention_bias=True, mlp_bias=True)
    config = ModelConfig(path, dtype="float32", device=DEVICE)
    return get_model(config, "auto", DEVICE), config


@kernel_test
@pytest.mark.parametrize("config", [CONFIGS[0], next(c for c in CONFIGS if c.use_dot)], ids=str)
def test_model_with_fused_decode_kernels_matches_plain_layers(biased_llama, config):
    model, model_config = biased_llama
    prompts = [[5, 17, 42, 7, 99], [3], [11, 12, 13, 200, 201, 202]]
    ref = _prefill_and_decode(ModelHarness(model, model_config, DEVICE), prompts, steps=2)
    harness = ModelHarness(model, model_config, DEVICE)
    gemv_calls = mock.patch.object(gemv_module, "gemv", wraps=gemv)
    patches = _forced(config)
    with patches[0], patches[1], gemv_calls as spy:
        got = _prefill_and_decode(harness, prompts, steps=2)
    assert spy.call_count == 3 * (2 * 4 + 1)  # forwards x (layers x 4 GEMMs + LM head)
    assert sum(c.kwargs.get("gated", False) for c in spy.call_args_list) == 3 * 2
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == torch.float32 and r.abs().max() > 0.1
        _check(g, r)
