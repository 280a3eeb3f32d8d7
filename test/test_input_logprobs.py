"""Prompt (input) logprobs: return_logprob with logprob_start_len gives meta_info's
input_token_logprobs / input_top_logprobs equal to transformers' log_softmax of the prompt on
the same tiny weights (float32, CPU): in one prefill, in chunks, after a cached prefix, with the
KV pool so small that requests are retracted, with NEXTN speculation, and with NEXTN under DP
attention. The HTTP side (/generate, /v1/completions echo) is in test_openai_api.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sglang as sgl
from sglang.test.prompt_logprobs import TOP_N, check_input_logprobs, reference_logprobs

PROMPTS = [
    [5, 17, 42, 99, 7, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [8, 9, 10],
    [100, 101, 102, 103, 104, 105, 106],
]


def generate(engine, prompts, start: int, max_new_tokens: int = 3) -> list[dict[str, Any]]:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    return engine.generate(
        input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=TOP_N, logprob_start_len=start
    )


@pytest.fixture(scope="module")
def llama_reference(tiny_llama_dir) -> list[torch.Tensor]:
    return reference_logprobs(tiny_llama_dir, PROMPTS)


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"chunked_prefill_size": 4}, {"max_total_tokens": 40, "chunked_prefill_size": 8}],
    ids=["one-prefill", "chunked", "retracting"],
)
def test_prompt_logprobs_match_transformers(tiny_llama_dir, llama_reference, engine_args):
    with sgl.Engine(model_path=tiny_llama_dir, device="cpu", log_level="warning", **engine_args) as engine:
        for start in (0, 2):
            for out, prompt, ref in zip(generate(engine, PROMPTS, start, max_new_tokens=12), PROMPTS, llama_reference):
                check_input_logprobs(out["meta_info"], prompt, ref, start)
                assert len(out["meta_info"]["output_token_logprobs"]) == 12


def test_cached_prefix_is_reused_up_to_the_start_only(tiny_llama_dir, llama_reference):
    prompt, ref = PROMPTS[0], llama_reference[0]
    with sgl.Engine(model_path=tiny_llama_dir, device="cpu", log_level="warning") as engine:
        generate(engine, [prompt], start=-1)  # the whole prompt in the prefix cache
        (out,) = generate(engine, [prompt], start=5)
        assert out["meta_info"]["cached_tokens"] == 5
        check_input_logprobs(out["meta_info"], prompt, ref, 5)
        (out,) = generate(engine, [prompt], start=-1)  # default: the last prompt token, no logprob
        assert out["meta_info"]["cached_tokens"] == len(prompt) - 1
        assert out["meta_info"]["input_token_logprobs"] == [(None, prompt[-1], None)]
        (out,) = generate(engine, [prompt], start=0, max_new_tokens=0)  # scoring a prompt: no output
        assert out["output_ids"] == [] and out["meta_info"]["cached_tokens"] == 0
        check_input_logprobs(out["meta_info"], prompt, ref, 0)
        with pytest.raises(ValueError, match="logprob_start_len"):
            generate(engine, [prompt], start=len(prompt))


@pytest.fixture(scope="module")
def deepseek_reference(tiny_deepseek_v3_dir) -> list[torch.Tensor]:
    return reference_logprobs(tiny_deepseek_v3_dir, PROMPTS)


NEXTN = {"speculative_algorithm": "NEXTN"}
# round_robin: the prompts go to both DP ranks.
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "load_balance_method": "round_robin"}


@pytest.mark.parametrize(
    "engine_args", [NEXTN, {**NEXTN, **DP_ATTENTION}, DP_ATTENTION], ids=["nextn", "nextn-dp-attention", "dp-attention"]
)
def test_deepseek_prompt_logprobs(tiny_deepseek_v3_dir, deepseek_reference, engine_args):
    """Under speculation the prefill runs through the target model: its logits give the prompt
    logprobs (the draft's prefill takes none). Under DP attention each rank's LM head computes
    its own requests' rows."""
    with sgl.Engine(
        model_path=tiny_deepseek_v3_dir, device="cpu", log_level="warning", chunked_prefill_size=4, **engine_args
    ) as engine:
        outs = generate(engine, PROMPTS, start=0, max_new_tokens=6)
        for out, prompt, ref in zip(outs, PROMPTS, deepseek_reference):
            meta = out["meta_info"]
            check_input_logprobs(meta, prompt, ref, 0)
            assert (meta.get("spec_verify_ct", 0) >= 1) == ("speculative_algorithm" in engine_args)
            # The output logprobs (verify steps' under speculation): greedy, each token is its position's top one.
            for (lp, token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
                assert top[0][1] == token and abs(top[0][0] - lp) < 1e-5
