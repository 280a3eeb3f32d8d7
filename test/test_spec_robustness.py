"""Speculative decoding on rare numbers and at the edge of the KV pool (in-process scheduler,
CPU, float32): a prefill with NaN logits under --enable-nan-detection, a tree walk whose
children cover the whole support, and a single request that outgrows the KV pool."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file, save_file

from sglang.srt.server_args import ServerArgs
from sglang.test.inprocess_scheduler import greedy, start_scheduler
from sglang.test.spec_models import make_eagle_head
from sglang.test.tiny_models import make_tiny_llama

CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
TREE = {"speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}
PROMPT = [3, 4, 5, 6]
CLEAN = [8, 9, 10]  # its continuation never meets the poisoned token


@pytest.fixture(scope="module")
def nan_llama_pair(tmp_path_factory) -> tuple[str, str, int]:
    """A tiny Llama whose embedding row of one token is NaN, a random EAGLE head (which shares
    that embedding), and the token: the fourth of PROMPT's greedy continuation, so a prompt
    holding it has NaN logits at prefill and PROMPT has NaN verify logits once it is emitted."""
    root = tmp_path_factory.mktemp("spec_nan")
    target = make_tiny_llama(str(root / "target"))
    plain = start_scheduler(ServerArgs(model_path=target, device="cpu", dtype="float32"))
    continuation, clean = greedy(plain, [PROMPT, CLEAN], [4, 12])
    poisoned = continuation[3]
    assert poisoned not in PROMPT + continuation[:3] + CLEAN + clean
    weights_file = os.path.join(target, "model.safetensors")
    weights = load_file(weights_file)
    weights["model.embed_tokens.weight"][poisoned] = float("nan")
    save_file(weights, weights_file, metadata={"format": "pt"})
    return target, make_eagle_head(target, str(root / "head")), poisoned


def _eagle_args(pair: tuple[str, str, int], **args) -> ServerArgs:
    target, head, _ = pair
    return ServerArgs(
        model_path=target,
        device="cpu",
        dtype="float32",
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=head,
        **args,
    )


NAN_ERROR = "NaN or inf in the model's logits"


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_prefill_ends_its_request_and_the_others_go_on(nan_llama_pair, spec, temperature):
    scheduler = start_scheduler(_eagle_args(nan_llama_pair, enable_nan_detection=True, **spec))
    ids = greedy(scheduler, [[3, nan_llama_pair[2], 4], CLEAN], [6, 6], temperature=temperature)
    reasons = scheduler.send_to_detokenizer.finish_reasons
    assert ids[0] == [] and reasons["r0"]["message"] == NAN_ERROR
    assert len(ids[1]) == 6 and reasons["r1"]["type"] == "length"
    # Still serving: a clean request alone gives the same greedy tokens.
    if temperature == 0.0:
        assert greedy(scheduler, [CLEAN], [6]) == [ids[1]]


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_nan_verify_logits_end_a_sampled_request(nan_llama_pair, spec):
    """top_p ~0 samples the greedy tokens on the sampling path: PROMPT emits the poisoned token,
    whose verify logits are NaN; the tree walk must not draw from them."""
    scheduler = start_scheduler(_eagle_args(nan_llama_pair, enable_nan_detection=True, **spec))
    ids = greedy(scheduler, [PROMPT, CLEAN], [12, 6], temperature=0.8, top_p=1e-6)
    reasons = scheduler.send_to_detokenizer.finish_reasons
    assert reasons["r0"]["message"] == NAN_ERROR and nan_llama_pair[2] not in ids[0][:3]
    assert len(ids[1]) == 6 and reasons["r1"]["type"] == "length"


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_a_lone_request_that_outgrows_the_kv_pool_ends_by_length(nan_llama_pair, spec):
    """Nothing is left to retract: the request ends with finish reason `length` once a cycle's
    slots no longer fit; a prompt too long for even one cycle is refused up front."""
    pool = 48
    scheduler = start_scheduler(_eagle_args(nan_llama_pair, max_total_tokens=pool, **spec))
    need = scheduler.worker.decode_kv_need_per_req()
    assert scheduler.max_req_input_len == pool - need
    prompt = CLEAN * 10  # 30 tokens
    ids = greedy(scheduler, [prompt], [100])[0]
    reason = scheduler.send_to_detokenizer.finish_reasons["r0"]
    assert reason == {"type": "length", "length": len(ids)} and 1 < len(ids) < 100
    assert len(prompt) + len(ids) > pool - need - scheduler.worker.max_tokens_per_step()
    # Still serving, with every slot back.
    assert greedy(scheduler, [CLEAN], [4]) == [greedy(scheduler, [CLEAN], [4])[0]]
    assert scheduler.free_kv_tokens() == scheduler.allocator.size
    too_long = greedy(scheduler, [CLEAN * 15], [4])[0]
    assert too_long == [] and scheduler.send_to_detokenizer.finish_reasons["r0"]["type"] == "abort"
