"""DeepSeek-V2/V3 and the NextN (MTP) draft against references.

- The targets' logits and greedy tokens match transformers' own DeepseekV2/V3 (float32, CPU)
  for prompts of different lengths, whole and chunked prefill.
- Routing and the expert computation match transformers' router / experts modules; the MoE
  layer with its shared experts folded into the expert weights matches transformers' MoE
  module, on one rank and as the sum of two TP ranks' partial outputs.
- The NextN draft matches a reference built here from the raw checkpoint tensors (plain torch
  for the MTP head, HF's decoder layer for the layer in the middle), in chunked extend and
  decode, and when it shares the target's embedding and LM head.
- The export tool's draft equals the in-checkpoint draft.
- `--load-format dummy` builds and runs a DeepSeek-V2-Lite-shaped model and its NextN draft.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3Experts,
    DeepseekV3MoE,
    DeepseekV3RotaryEmbedding,
    DeepseekV3TopkRouter,
)

from sglang.srt.batch.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.kernels.moe.routing_config import RoutingConfig
from sglang.srt.layers.moe import fused_moe
from sglang.srt.layers.moe.fused_moe import moe_forward_native
from sglang.srt.layers.moe.topk import select_experts
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.model_loader.loader import get_model
from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2MoE
from sglang.test.model_harness import ModelHarness
from sglang.test.tiny_deepseek import make_tiny_deepseek_v2, make_tiny_deepseek_v3
from sglang.tools.export_nextn import main as export_main

NEXTN = ["DeepseekV3ForCausalLMNextN"]
PROMPT_LENS = (7, 12, 3)


@pytest.fixture(scope="module")
def v2(tmp_path_factory) -> str:
    return make_tiny_deepseek_v2(str(tmp_path_factory.mktemp("v2")))


@pytest.fixture(scope="module")
def v3_yarn(tmp_path_factory) -> str:
    return make_tiny_deepseek_v3(str(tmp_path_factory.mktemp("v3_yarn")), seed=1, yarn=True)


V3 = pytest.param("tiny_deepseek_v3_dir", id="v3")  # a checkpoint fixture as a parameter, under a short id


def _load(path: str, architectures=None, load_format: str = "auto", dtype: str = "float32", **overrides):
    mc = ModelConfig(path, dtype=dtype, device="cpu", architectures=architectures, model_override_args=overrides)
    return mc, get_model(mc, load_format, "cpu")


def _prompts(vocab_size: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lens]


# ---- targets vs transformers -------------------------------------------------------------


@pytest.mark.parametrize("name", ["v2", V3, "v3_yarn"])
def test_target_matches_transformers(name, request):
    path = request.getfixturevalue(name)
    mc, model = _load(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(mc.vocab_size)
    harness = ModelHarness(model, mc)
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0] for p in prompts]
    for chunk in (None, 5):
        for ref, out in zip(refs, harness.run_prefill(prompts, chunk_size=chunk)):
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)

    expected = []
    for p in prompts:  # HF greedy without eos stopping: argmax of a full recompute per step
        ids = list(p)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        expected.append(ids[len(p) :])
    for chunk in (None, 4):
        assert harness.greedy_generate(prompts, 6, chunk_size=chunk) == expected


# ---- routing and experts vs transformers's modules ------------------------------------------


def _dense(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.zeros(weights.shape[0], num_experts).scatter_(1, ids, weights.float())


@torch.no_grad()
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routing_matches_transformers(method):
    cfg = DeepseekV2Config(
        hidden_size=32,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method=method,
        routed_scaling_factor=1.5,
    )
    router = DeepseekV2TopkRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(9, 32)
    logits, ref_w, ref_ids = router(x)
    w, ids = select_experts(
        logits,
        RoutingConfig(
            top_k=3,
            num_experts=8,
            topk_method=method,
            num_expert_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        ),
    )
    torch.testing.assert_close(_dense(w, ids, 8), _dense(ref_w, ref_ids, 8))


@torch.no_grad()
def test_v3_routing_and_experts_match_transformers():
    cfg = DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        moe_intermediate_size=16,
    )
    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_()
    x = torch.randn(9, 32)
    logits, ref_w, ref_ids = router(x)
    routing = RoutingConfig(
        top_k=3,
        num_experts=8,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_expert_group=4,
        topk_group=2,
        renormalize=True,
        routed_scaling_factor=2.5,
    )
    w, ids = select_experts(logits, routing, router.e_score_correction_bias)
    torch.testing.assert_close(_dense(w, ids, 8), _dense(ref_w, ref_ids, 8))

    experts = DeepseekV3Experts(cfg)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    w13, w2 = experts.gate_up_proj.data, experts.down_proj.data
    torch.testing.assert_close(moe_forward_native(x, w13, w2, w, ids), experts(x, ref_ids, ref_w))
    empty = moe_forward_native(x[:0], w13, w2, w[:0], ids[:0])
    assert empty.shape == (0, 32)
    for cfg in (
        routing,
        RoutingConfig(top_k=3, num_experts=8, topk_method="group_limited_greedy", num_expert_group=4, topk_group=2),
    ):
        assert select_experts(logits[:0], cfg, router.e_score_correction_bias)[1].shape == (0, 3)


@torch.no_grad()
@pytest.mark.parametrize("tp_size", [1, 2])
def test_moe_with_shared_experts_matches_transformers(tp_size, monkeypatch):
    """Two shared experts (intermediate 2 x 16) in the expert slots after the 8 routed ones;
    V3 routing scales the routed weights only. Each rank holds its intermediate slice of
    every expert; the ranks' partial outputs sum to the whole layer."""
    cfg = DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        moe_intermediate_size=16,
        n_shared_experts=2,
    )
    hf = DeepseekV3MoE(cfg).eval()
    for param in hf.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(9, 32)
    ref = hf(x)
    inter, experts = cfg.moe_intermediate_size, hf.experts
    out = torch.zeros_like(x)
    for rank in range(tp_size):
        monkeypatch.setattr(fused_moe, "get_tp_size", lambda: tp_size)
        monkeypatch.setattr(fused_moe, "get_tp_rank", lambda: rank)
        moe = DeepseekV2MoE(cfg)
        assert moe.experts.w13_weight.shape == (10, 2 * inter // tp_size, 32)
        moe.gate.weight.copy_(hf.gate.weight)
        moe.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        for e in range(cfg.n_routed_experts):
            moe.experts.weight_loader("gate_proj", e, experts.gate_up_proj[e, :inter])
            moe.experts.weight_loader("up_proj", e, experts.gate_up_proj[e, inter:])
            moe.experts.weight_loader("down_proj", e, experts.down_proj[e])
        for shard in ("gate_proj", "up_proj", "down_proj"):
            moe.experts.weight_loader(shard, None, getattr(hf.shared_experts, shard).weight)
        out += moe.experts(x, moe.gate(x), moe.gate.e_score_correction_bias)  # this rank's partial sum
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert moe.experts(x[:0], moe.gate(x[:0]), moe.gate.e_score_correction_bias).shape == (0, 32)


# ---- NextN draft ----------------------------------------------------------------------------


def _hf_layer_state(mtp: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """The MTP layer's decoder-layer tensors in HF's module layout (experts stacked)."""
    head_only = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    state = {k: v for k, v in mtp.items() if not k.startswith(head_only) and ".experts." not in k}
    expert = lambda e, p: mtp[f"mlp.experts.{e}.{p}.weight"]
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in range(num_experts)]
    )
    state["mlp.experts.down_proj"] = torch.stack([expert(e, "down_proj") for e in range(num_experts)])
    return state


@torch.no_grad()
def _nextn_reference(path: str, ids: list[int], target_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, final-norm hidden) of the MTP layer over one whole sequence, from raw tensors."""
    config = DeepseekV3Config.from_pretrained(path)
    config._attn_implementation = "eager"
    prefix = f"model.layers.{config.num_hidden_layers}."
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        mtp = {k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    emb = mtp["embed_tokens.weight"][torch.tensor(ids)]
    h = torch.cat([rms(emb, mtp["enorm.weight"]), rms(target_hidden, mtp["hnorm.weight"])], dim=-1)
    h = h @ mtp["eh_proj.weight"].T
    layer = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers).eval()
    layer.load_state_dict(_hf_layer_state(mtp, config.n_routed_experts))
    positions = torch.arange(len(ids))[None]
    mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
    rope = DeepseekV3RotaryEmbedding(config)
    out = layer(h[None], attention_mask=mask, position_ids=positions, position_embeddings=rope(h[None], positions))
    hidden = rms(out[0], mtp["shared_head.norm.weight"])
    return hidden @ mtp["shared_head.head.weight"].T, hidden


def _draft_harness(model, mc: ModelConfig) -> ModelHarness:
    """The draft's own one-layer MLA pool (layer id 0)."""
    pool = MLATokenToKVPool(8 * 256, mc.dtype, mc.kv_lora_rank, mc.qk_rope_head_dim, 1, "cpu")
    return ModelHarness(model, mc, kv_pool=pool)


def _run_draft(harness: ModelHarness, seqs: list[list[int]], hiddens: list[torch.Tensor], chunk: int):
    """Chunked EXTEND of all but the last token of each sequence, then one DECODE step.

    Returns per sequence (logits, hidden) of every position, as the draft computed them."""
    reqs = harness.start_requests([s[:-1] for s in seqs])
    logits = [[] for _ in seqs]
    hidden = [[] for _ in seqs]

    def run(mode, active, lens):
        ids, positions, rows = [], [], []
        for i, n in zip(active, lens):
            r = reqs[i]
            ids += r.tokens[r.cached : r.cached + n]
            positions += range(r.cached, r.cached + n)
            rows.append(hiddens[i][r.cached : r.cached + n])
        fb = harness._batch(mode, [reqs[i] for i in active], ids, positions, lens, CaptureHiddenMode.FULL)
        fb.logits_indices = torch.arange(len(ids))
        fb.spec_info = SimpleNamespace(hidden_states=torch.cat(rows))
        out = harness._run(fb)
        for i, lg, hs in zip(active, out.next_token_logits.split(lens), out.hidden_states.split(lens)):
            logits[i].append(lg)
            hidden[i].append(hs)

    try:
        while any(r.cached < len(r.tokens) for r in reqs):
            active = [i for i, r in enumerate(reqs) if r.cached < len(r.tokens)]
            run(ForwardMode.EXTEND, active, [min(chunk, len(reqs[i].tokens) - reqs[i].cached) for i in active])
        for r, s in zip(reqs, seqs):
            r.tokens.append(s[-1])
        run(ForwardMode.DECODE, list(range(len(reqs))), [1] * len(reqs))
    finally:
        harness.finish_requests(reqs)
    return [(torch.cat(lg), torch.cat(hs)) for lg, hs in zip(logits, hidden)]


def _draft_inputs(mc: ModelConfig) -> tuple[list[list[int]], list[torch.Tensor]]:
    seqs = _prompts(mc.vocab_size, lens=(9, 5))
    gen = torch.Generator().manual_seed(3)
    return seqs, [torch.randn(len(s), mc.hidden_size, generator=gen) for s in seqs]


@pytest.mark.parametrize("name", [V3, "v3_yarn"])
def test_nextn_matches_reference(name, request):
    path = request.getfixturevalue(name)
    mc, draft = _load(path, architectures=NEXTN)
    seqs, hiddens = _draft_inputs(mc)
    for (logits, hidden), seq, h in zip(_run_draft(_draft_harness(draft, mc), seqs, hiddens, chunk=4), seqs, hiddens):
        ref_logits, ref_hidden = _nextn_reference(path, seq, h)
        torch.testing.assert_close(hidden, ref_hidden, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4)


def test_nextn_shares_target_embed_and_head(tiny_deepseek_v3_dir):
    mc, target = _load(tiny_deepseek_v3_dir)
    _, draft = _load(tiny_deepseek_v3_dir, architectures=NEXTN)
    seqs, hiddens = _draft_inputs(mc)
    before = _run_draft(_draft_harness(draft, mc), seqs, hiddens, chunk=16)
    draft.set_embed_and_head(*target.get_embed_and_head())
    assert draft.model.embed_tokens.weight is target.model.embed_tokens.weight
    assert draft.lm_head.weight is target.lm_head.weight
    after = _run_draft(_draft_harness(draft, mc), seqs, hiddens, chunk=16)
    for (lg0, hs0), (lg1, hs1) in zip(before, after):  # the checkpoint's copies equal the target's
        assert torch.equal(lg0, lg1) and torch.equal(hs0, hs1)


def test_export_round_trip(tiny_deepseek_v3_dir, tmp_path):
    out = str(tmp_path / "nextn")
    export_main(["--input", tiny_deepseek_v3_dir, "--output", out])
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == NEXTN and config["num_hidden_layers"] == 1
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    mc, in_ckpt = _load(tiny_deepseek_v3_dir, architectures=NEXTN)
    mc_exported, exported = _load(out)
    state, exported_state = in_ckpt.state_dict(), exported.state_dict()
    assert state.keys() == exported_state.keys()
    assert all(torch.equal(state[k], exported_state[k]) for k in state)
    seqs, hiddens = _draft_inputs(mc)
    for (lg0, hs0), (lg1, hs1) in zip(
        _run_draft(_draft_harness(in_ckpt, mc), seqs, hiddens, chunk=4),
        _run_draft(_draft_harness(exported, mc_exported), seqs, hiddens, chunk=4),
    ):
        assert torch.equal(lg0, lg1) and torch.equal(hs0, hs1)


def test_export_rejects_checkpoint_without_mtp(v2, tmp_path):
    with pytest.raises(ValueError, match="no MTP layer"):
        export_main(["--input", v2, "--output", str(tmp_path / "out")])


# ---- DeepSeek-V2-Lite shape with dummy weights -------------------------------------------------

# deepseek-ai/DeepSeek-V2-Lite config.json (fields the model reads).
V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "attention_bias": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "v_head_dim": 128,
    "vocab_size": 102400,
}


@pytest.fixture(scope="module")
def v2_lite(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("v2_lite")
    (path / "config.json").write_text(json.dumps(V2_LITE_CONFIG))
    return str(path)


def test_v2_lite_full_shape_on_meta_device(v2_lite):
    """All 27 layers built without memory: DeepSeek-V2-Lite has 15.7B parameters."""
    mc = ModelConfig(v2_lite, dtype="bfloat16", device="cpu")
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(mc.hf_config)
    total = sum(p.numel() for p in model.parameters())
    assert 15.6e9 < total < 15.8e9, total
    assert sum(hasattr(layer.mlp, "experts") for layer in model.model.layers) == 26


@pytest.mark.parametrize("architectures", [None, NEXTN])
def test_v2_lite_dummy_load_and_forward(v2_lite, architectures):
    """Two layers (one dense, one MoE) of the real shape, or its NextN draft, with dummy weights."""
    mc, model = _load(v2_lite, architectures=architectures, load_format="dummy", dtype="bfloat16", num_hidden_layers=2)
    prompts = _prompts(mc.vocab_size, lens=(4, 2))
    if architectures is None:
        harness = ModelHarness(model, mc, max_requests=2, max_context_len=8)
        outs = harness.run_prefill(prompts, chunk_size=3)
        assert [o.shape for o in outs] == [(4, mc.vocab_size), (2, mc.vocab_size)]
        assert all(torch.isfinite(o).all() for o in outs)
        return
    pool = MLATokenToKVPool(16, mc.dtype, mc.kv_lora_rank, mc.qk_rope_head_dim, 1, "cpu")
    harness = ModelHarness(model, mc, max_requests=2, max_context_len=8, kv_pool=pool)
    hiddens = [torch.randn(len(p), mc.hidden_size, dtype=torch.bfloat16) for p in prompts]
    for (logits, hidden), p in zip(_run_draft(harness, prompts, hiddens, chunk=2), prompts):
        assert logits.shape == (len(p), mc.vocab_size) and torch.isfinite(logits).all()
        assert hidden.shape == (len(p), mc.hidden_size)
