"""EAGLE / NextN speculative decoding through sglang.Engine (CPU, float32, tiny models).

- Greedy outputs, finish reasons, completion tokens and stop-string truncation equal the
  non-speculative run, for EAGLE on a tiny Llama with a random head and NEXTN on a tiny
  DeepSeek-V3 with a random MTP layer; chain (topk 1) and tree (topk 4); chunked prefill.
- A draft that reproduces the target exactly gives accept length steps + 1.
- Tree speculative sampling keeps the target distribution (chi-square test on a top-k-limited
  vocabulary, against the distribution computed from the target's own logits).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import sglang as sgl
from sglang.srt.server_args import ServerArgs
from sglang.test.chi_square import chi_square, fits
from sglang.test.spec_models import make_perfect_llama_pair
from sglang.test.spec_runs import greedy_with_accept_length

PROMPTS = [
    [5, 17, 42, 99, 7, 3, 150, 11, 12, 13, 14, 15, 16],
    [8, 9, 10],
    [100, 101, 102, 103, 104, 105, 106],
]
MAX_NEW = 14
CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
SHORT_CHAIN = {"speculative_num_steps": 1, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 2}
TREE = {"speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}


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


def _generate(engine, requests) -> list[dict]:
    return engine.generate(
        input_ids=[p for p, _ in requests],
        sampling_params=[{"temperature": 0, **params} for _, params in requests],
    )


def _run(model_dir: str, requests, **engine_args) -> list[dict]:
    with sgl.Engine(model_path=model_dir, device="cpu", **engine_args) as engine:
        outs = _generate(engine, requests)
        for state in engine.get_server_info()["internal_states"]:
            assert state["available_kv_tokens"] == state["max_total_num_tokens"]
    return outs


def _summary(outs: list[dict]) -> list[tuple]:
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"], o["meta_info"]["completion_tokens"]) for o in outs]


def _baseline(model_dir: str):
    """The non-speculative run: plain requests first, then those derived from their outputs."""
    with sgl.Engine(model_path=model_dir, device="cpu") as engine:
        first = _generate(engine, _requests(model_dir))
        requests = _requests(model_dir, [o["output_ids"] for o in first])
        return requests, _summary(_generate(engine, requests))


@pytest.fixture(scope="module")
def llama_baseline(tiny_llama_unsharded_eagle_pair):
    return _baseline(tiny_llama_unsharded_eagle_pair[0])


@pytest.fixture(scope="module")
def deepseek_baseline(tiny_deepseek_v3_dir):
    return _baseline(tiny_deepseek_v3_dir)


SPEC_CASES = [
    pytest.param(CHAIN, id="chain"),
    pytest.param({**TREE, "chunked_prefill_size": 4}, id="tree-chunked"),
]


@pytest.mark.parametrize("spec_args", SPEC_CASES)
def test_eagle_greedy_equals_plain(tiny_llama_unsharded_eagle_pair, llama_baseline, spec_args):
    target, head = tiny_llama_unsharded_eagle_pair
    requests, expected = llama_baseline
    outs = _run(target, requests, speculative_algorithm="EAGLE", speculative_draft_model_path=head, **spec_args)
    assert _summary(outs) == expected


@pytest.mark.parametrize("spec_args", SPEC_CASES)
def test_nextn_greedy_equals_plain(tiny_deepseek_v3_dir, deepseek_baseline, spec_args):
    requests, expected = deepseek_baseline
    outs = _run(tiny_deepseek_v3_dir, requests, speculative_algorithm="NEXTN", **spec_args)
    assert _summary(outs) == expected


def _hf_greedy(model_dir: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(prompt) :])
    return outs


def _greedy_with_accept_length(model_dir: str, **engine_args) -> tuple[list[list[int]], float]:
    return greedy_with_accept_length(model_dir, PROMPTS, MAX_NEW, **engine_args)


def test_perfect_eagle_head_accepts_every_draft(perfect_llama_pair):
    target, head = perfect_llama_pair
    ids, accept = _greedy_with_accept_length(target, speculative_algorithm="EAGLE", speculative_draft_model_path=head, **CHAIN)
    assert accept == CHAIN["speculative_num_steps"] + 1
    assert ids == _hf_greedy(target, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("chain", [CHAIN, SHORT_CHAIN], ids=["3-1-4", "1-1-2"])
def test_perfect_nextn_accepts_every_draft(perfect_deepseek_v3_dir, chain):
    """steps 1: no draft loop; the verify checks the draft extend's guess alone."""
    target = perfect_deepseek_v3_dir
    ids, accept = _greedy_with_accept_length(target, speculative_algorithm="NEXTN", **chain)
    assert accept == chain["speculative_num_steps"] + 1
    assert ids == _hf_greedy(target, PROMPTS, MAX_NEW)


PENALTIES = {"frequency_penalty": 0.6, "presence_penalty": 0.4, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def cycling_llama() -> tuple[str, str, list[list[int]]]:
    """A perfect pair (seed 3) whose penalty-free greedy map has short cycles, and prompts whose
    greedy continuation reaches one two fresh tokens later: a verify path then holds a token
    twice, which only the path's own penalties reject."""
    import tempfile

    target, head = make_perfect_llama_pair(tempfile.mkdtemp(prefix="cycling_llama"), seed=3)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        nxt = model(torch.arange(model.config.vocab_size).view(-1, 1)).logits[:, 0].argmax(dim=-1).tolist()
    cyclic = {t for t in range(len(nxt)) if nxt[t] == t or nxt[nxt[t]] == t}
    starts = [z for z in range(len(nxt)) if z not in cyclic and nxt[z] not in cyclic and nxt[nxt[z]] in cyclic]
    assert len(starts) >= 2
    return target, head, [[5, 17, z] for z in starts[:3]]


@pytest.mark.parametrize(
    "spec_args",
    [
        pytest.param({"speculative_num_steps": 5, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 6}, id="chain"),
        pytest.param(TREE, id="tree"),
        pytest.param({**CHAIN, "tp_size": 2, "dp_size": 2, "enable_dp_attention": True}, id="chain-dp-attention"),
    ],
)
def test_greedy_with_penalties_equals_plain(cycling_llama, spec_args):
    """The perfect draft proposes the penalty-free cycle; each tree node's penalties count the
    tokens on its own path, so the target rejects a repeat exactly where the plain run does."""
    target, head, prompts = cycling_llama
    requests = [(p, {"max_new_tokens": 16, "ignore_eos": True, **PENALTIES}) for p in prompts]
    expected = _summary(_run(target, requests))
    outs = _run(target, requests, speculative_algorithm="EAGLE", speculative_draft_model_path=head, **spec_args)
    assert _summary(outs) == expected


def test_tree_sampling_keeps_target_distribution(perfect_llama_pair):
    """The target of the perfect pair predicts from the current token alone, so the law of
    the k-th output token is a product of per-token next-token distributions q."""
    target, head = perfect_llama_pair
    num, top_k, temperature = 500, 3, 1.0
    prompt = [5, 17, 42]
    with sgl.Engine(
        model_path=target, device="cpu", speculative_algorithm="EAGLE", speculative_draft_model_path=head, **TREE
    ) as engine:
        outs = engine.generate(
            input_ids=[prompt] * num,
            sampling_params={"max_new_tokens": 3, "temperature": temperature, "top_k": top_k, "ignore_eos": True},
        )
        accept = engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"]
    assert accept > 1.5  # drafts are accepted (and rejected) along the way
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    with torch.no_grad():
        logits = model(torch.arange(vocab).view(-1, 1)).logits[:, 0] / temperature
    kth = logits.topk(top_k, dim=-1).values[:, -1:]
    q = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1).double()  # q[t] = law after t
    law = q[prompt[-1]]
    for k in range(1, 3):  # the first tokens produced by a verify step
        law = law @ q
        counts: dict[int, int] = {}
        for o in outs:
            counts[o["output_ids"][k]] = counts.get(o["output_ids"][k], 0) + 1
        assert fits(counts, law, num), (k, chi_square(counts, law, num))


def test_eagle_tree_under_tp2_equals_plain(tiny_llama_unsharded_eagle_pair, llama_baseline):
    target, head = tiny_llama_unsharded_eagle_pair
    requests, expected = llama_baseline
    outs = _run(target, requests, tp_size=2, speculative_algorithm="EAGLE", speculative_draft_model_path=head, **TREE)
    assert _summary(outs) == expected


def _spec_args(**kwargs) -> ServerArgs:
    return ServerArgs(model_path="m", device="cpu", **kwargs)


def test_speculative_defaults_and_validation():
    auto = _spec_args(speculative_algorithm="NEXTN")
    assert auto.speculative_draft_model_path == "m"
    assert (auto.speculative_num_steps, auto.speculative_eagle_topk, auto.speculative_num_draft_tokens) == (3, 1, 4)
    chain = _spec_args(speculative_algorithm="NEXTN", speculative_num_steps=5, speculative_num_draft_tokens=2)
    assert (chain.speculative_eagle_topk, chain.speculative_num_draft_tokens) == (1, 6)
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens"):
        _spec_args(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=4)
    with pytest.raises(ValueError, match=r"--speculative-num-draft-tokens must be in \[2, 7\]"):
        _spec_args(
            speculative_algorithm="NEXTN", speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=10
        )
    with pytest.raises(ValueError, match="--speculative-num-steps"):
        _spec_args(speculative_algorithm="NEXTN", speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    with pytest.raises(ValueError, match="--speculative-draft-model-path"):
        _spec_args(speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="not supported yet"):
        _spec_args(speculative_algorithm="EAGLE3", speculative_draft_model_path="d").check_launchable()


def test_nan_detection_flags_non_finite_verify_logits():
    from sglang.srt.speculative.eagle_utils import non_finite_requests

    logits = torch.zeros(2 * 3, 5)  # two requests, three tree nodes each
    logits[1 * 3 + 2, 4] = float("nan")
    assert non_finite_requests(logits, 2).tolist() == [False, True]
    logits[0, 0] = float("inf")
    assert non_finite_requests(logits, 2).tolist() == [True, True]
