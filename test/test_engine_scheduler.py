"""End-to-end scheduler behaviour through sglang.Engine on a tiny random Llama (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import sglang as sgl

PROMPTS = [
    [5, 17, 42, 99, 7, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [8, 9, 10],
    [100, 101, 102, 103, 104, 105, 106],
    [5, 17, 42, 99, 7, 3, 250, 11, 60, 61],  # shares a prefix with the first prompt
]
MAX_NEW = 12


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(MAX_NEW):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            outs.append(ids[len(prompt) :])
    return outs


def _greedy(engine, prompts=PROMPTS, **params):
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, **params}
    return engine.generate(input_ids=prompts, sampling_params=params)


def _assert_pool_full(engine):
    for state in engine.get_server_info()["internal_states"]:
        assert state["available_kv_tokens"] == state["max_total_num_tokens"]


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"chunked_prefill_size": 4},
        {"disable_radix_cache": True, "schedule_policy": "lpm"},
        {"max_running_requests": 2},
        {"max_total_tokens": 40, "chunked_prefill_size": 8},  # forces retraction / queueing
    ],
    ids=["default", "chunked", "no-radix-lpm", "max-running-2", "tiny-kv-pool"],
)
def test_greedy_matches_hf(tiny_llama_dir, hf_greedy, engine_args):
    with sgl.Engine(model_path=tiny_llama_dir, device="cpu", **engine_args) as engine:
        outs = _greedy(engine)
        assert [o["output_ids"] for o in outs] == hf_greedy
        for o, p in zip(outs, PROMPTS):
            assert o["meta_info"]["prompt_tokens"] == len(p)
            assert o["meta_info"]["completion_tokens"] == MAX_NEW
            assert o["meta_info"]["finish_reason"]["type"] == "length"
        _assert_pool_full(engine)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with sgl.Engine(model_path=tiny_llama_dir, device="cpu") as e:
        yield e


def test_prefix_cache_hit_gives_same_tokens(engine, hf_greedy):
    first = _greedy(engine, [PROMPTS[0]])[0]
    again = _greedy(engine, [PROMPTS[0]])[0]
    assert again["meta_info"]["cached_tokens"] == len(PROMPTS[0]) - 1
    assert again["output_ids"] == first["output_ids"] == hf_greedy[0]
    _assert_pool_full(engine)


def test_stop_token_ids_and_max_new_tokens_zero(engine, hf_greedy):
    stop_tok = hf_greedy[1][3]
    out = _greedy(engine, [PROMPTS[1]], stop_token_ids=[stop_tok])[0]
    cut = hf_greedy[1].index(stop_tok) + 1
    assert out["output_ids"] == hf_greedy[1][:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    out = _greedy(engine, [PROMPTS[1]], max_new_tokens=0)[0]
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_string_is_trimmed(engine, hf_greedy, tiny_llama_dir):
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    full = tok.decode(hf_greedy[2])
    stop = next(
        (full[i : i + 2] for i in range(2, len(full) - 2) if full[i : i + 2].strip() and full.find(full[i : i + 2]) == i),
        None,
    )
    assert stop is not None, full
    out = _greedy(engine, [PROMPTS[2]], stop=[stop])[0]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[: full.index(stop)]
    out = _greedy(engine, [PROMPTS[2]], stop=[stop], no_stop_trim=True)[0]
    assert out["text"].startswith(full[: full.index(stop) + len(stop)])


def test_seeded_sampling_is_reproducible(engine):
    params = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.9, "sampling_seed": 1234, "ignore_eos": True}
    a = engine.generate(input_ids=[PROMPTS[1]], sampling_params=params)[0]["output_ids"]
    b = engine.generate(input_ids=[PROMPTS[1], PROMPTS[2]], sampling_params=params)[0]["output_ids"]
    assert a == b


def test_logprobs_match_greedy_choice(engine):
    out = engine.generate(
        input_ids=[PROMPTS[1]],
        sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=3,
    )[0]
    lps = out["meta_info"]["output_token_logprobs"]
    tops = out["meta_info"]["output_top_logprobs"]
    assert [t for _, t, *_ in lps] == out["output_ids"]
    for (lp, tok, *_), top in zip(lps, tops):
        assert top[0][1] == tok and abs(top[0][0] - lp) < 1e-5 and lp <= 0
