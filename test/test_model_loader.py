"""Model loading: sharded safetensors, pt, dummy weights, GGUF; model config and path resolution."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader import get_model
from sglang.srt.model_loader.loader import iterate_weights, resolve_load_format
from sglang.srt.models.registry import get_model_class
from sglang.srt.utils.hf_transformers_utils import get_tokenizer, resolve_model_path
from sglang.test.model_harness import ModelHarness

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33)), [3, 4]]


def _ours(path: str, load_format: str = "auto", seed: int = 42):
    config = ModelConfig(path, dtype="float32", device="cpu")
    return get_model(config, load_format, "cpu", seed=seed), config


def _assert_same_weights_as_hf(model, path: str) -> None:
    """Our stacked parameters equal the HF checkpoint's separate tensors."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    layer = model.model.layers[1]
    qkv = torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, qkv, rtol=0, atol=0)
    gate_up = torch.cat([hf[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, gate_up, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight, hf["lm_head.weight"], rtol=0, atol=0)


def test_sharded_safetensors_load(tiny_llama_dir):
    index = json.load(open(os.path.join(tiny_llama_dir, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    model, _ = _ours(tiny_llama_dir)
    assert not model.training
    _assert_same_weights_as_hf(model, tiny_llama_dir)


def test_tied_embeddings_share_one_tensor(tiny_llama3_tied_dir):
    model, _ = _ours(tiny_llama3_tied_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_pt_load(tiny_llama_dir, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_llama_dir, name), tmp_path)
    state = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).state_dict()
    torch.save(state, tmp_path / "pytorch_model.bin")
    model, _ = _ours(str(tmp_path))
    _assert_same_weights_as_hf(model, tiny_llama_dir)


def test_dummy_load_from_config_only(tiny_qwen2_dir, tmp_path):
    shutil.copy(os.path.join(tiny_qwen2_dir, "config.json"), tmp_path)
    a, config = _ours(str(tmp_path), "dummy", seed=1)
    b, _ = _ours(str(tmp_path), "dummy", seed=1)
    c, _ = _ours(str(tmp_path), "dummy", seed=2)
    assert type(a).__name__ == "Qwen2ForCausalLM"
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
        assert pa.abs().max() <= 1e-3 and pa.std() > 0
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    logits = ModelHarness(a, config).run_prefill(PROMPTS)
    assert all(torch.isfinite(x).all() for x in logits)


def test_model_config_fields_and_dtype(tiny_llama3_tied_dir):
    config = ModelConfig(tiny_llama3_tied_dir, context_length=128, dtype="bf16", device="cpu")
    assert config.dtype == torch.bfloat16 and config.context_len == 128
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert config.head_dim == 32 and config.hidden_size == 64 and config.vocab_size == 384
    assert config.architectures == ["LlamaForCausalLM"] and not config.is_mla
    assert ModelConfig(tiny_llama3_tied_dir, device="cuda").dtype == torch.bfloat16
    assert ModelConfig(tiny_llama3_tied_dir, device="cpu").dtype == torch.float32
    assert ModelConfig(tiny_llama3_tied_dir, dtype="half").dtype == torch.float16


def test_model_config_mla(tmp_path):
    DeepseekV3Config(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16).save_pretrained(tmp_path)
    config = ModelConfig(str(tmp_path))
    assert config.is_mla and config.kv_lora_rank == 32 and config.qk_rope_head_dim == 8
    assert config.qk_nope_head_dim == 16 and config.v_head_dim == 16 and config.head_dim == 24


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        get_model_class(["NoSuchForCausalLM"])


def test_tiny_tokenizer_round_trip_and_chat_template(tiny_llama_dir):
    tokenizer = get_tokenizer(tiny_llama_dir)
    config = ModelConfig(tiny_llama_dir)
    assert len(tokenizer) == config.vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config.hf_config.bos_token_id, config.hf_config.eos_token_id)
    text = "What is the capital of France?"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|bos|><|user|>hi<|eos|><|assistant|>"


def test_resolve_model_path(tmp_path):
    gguf_path = resolve_model_path("SmolLM2-135M-Instruct")
    assert gguf_path.endswith(".gguf") and os.path.isfile(gguf_path)
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == gguf_path
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="only local paths"):
        resolve_model_path("meta-llama/Llama-3.1-8B")


@pytest.fixture(scope="module")
def smollm2():
    """Our SmolLM2 and transformers' LlamaForCausalLM, both given the GGUF's dequantized weights (read once)."""
    config = ModelConfig("SmolLM2-135M-Instruct", dtype="float32", device="cpu")
    assert resolve_load_format(config.model_path, "auto") == "gguf"
    weights = dict(iterate_weights(config, "gguf"))
    ours = get_model(config, "dummy", "cpu")
    ours.load_weights(weights.items())
    hf = AutoModelForCausalLM.from_config(config.hf_config, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    return ModelHarness(ours, config, max_context_len=128), hf, get_tokenizer("SmolLM2-135M-Instruct")


@pytest.mark.timeout(60)
def test_gguf_smollm2_greedy_matches_hf(smollm2):
    harness, hf, tokenizer = smollm2
    questions = ["What is the capital of France?", "Say hello."]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in questions
    ]
    ours = harness.greedy_generate(prompts, max_new_tokens=6)
    for prompt, tokens in zip(prompts, ours):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :].tolist()
        assert tokens[: len(ref)] == ref
    assert "Paris" in tokenizer.decode(ours[0])
