"""Our Llama/Qwen2 forward vs Hugging Face transformers on tiny random checkpoints (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader import get_model
from sglang.test.model_harness import ModelHarness

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 39)), [3], [11, 12, 13, 200, 201, 202, 250, 8, 9, 10, 1]]
MODEL_FIXTURES = ["tiny_llama_dir", "tiny_llama3_tied_dir", "tiny_qwen2_dir"]


@pytest.fixture(scope="module", params=MODEL_FIXTURES)
def models(request):
    path = request.getfixturevalue(request.param)
    config = ModelConfig(path, dtype="float32", device="cpu")
    ours = get_model(config, "auto", "cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ModelHarness(ours, config), hf


@torch.no_grad()
def hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_prefill_logits_match_hf(models, chunk_size):
    harness, hf = models
    ours = harness.run_prefill(PROMPTS, chunk_size=chunk_size)
    for prompt, logits in zip(PROMPTS, ours):
        ref = hf_logits(hf, prompt)
        assert logits.shape == ref.shape
        assert ref.abs().max() > 0.1  # the comparison is not between near-zero tensors
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_greedy_matches_hf_generate(models, chunk_size):
    harness, hf = models
    new_tokens = 8
    ours = harness.greedy_generate(PROMPTS, new_tokens, chunk_size=chunk_size)
    for prompt, tokens in zip(PROMPTS, ours):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=0)
        ref = out[0, len(prompt) :].tolist()
        assert len(ref) >= 1
        assert tokens[: len(ref)] == ref  # HF stops early only at eos, which we then produced too


def test_decode_logits_match_hf(models):
    """Each decode step's logits equal HF's logits at that position of the full sequence."""
    harness, hf = models
    prompts = PROMPTS[:2]
    reqs = harness.start_requests(prompts)
    try:
        harness.forward_extend(reqs, [len(p) for p in prompts])
        for step, token in enumerate([77, 78, 79]):
            for r in reqs:
                r.tokens.append(token + step)
            out = harness.forward_decode(reqs)
            for r, logits in zip(reqs, out.next_token_logits):
                torch.testing.assert_close(logits, hf_logits(hf, r.tokens)[-1], atol=1e-4, rtol=1e-4)
    finally:
        harness.finish_requests(reqs)
