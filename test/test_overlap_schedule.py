"""Overlap scheduling: the next step is queued before this step's tokens reach the host, and
nothing a user sees changes (in-process scheduler, tiny random Llama, CPU, float32)."""

from __future__ import annotations

import pytest

from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.tp_worker import LaunchedStep
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.inprocess_scheduler import start_scheduler

PROMPTS = [[5, 17, 42, 99, 7], [8, 9, 10], [100, 101, 102, 103], [5, 17, 42, 60]]


def _scheduler(path: str, overlap: bool, **kw) -> Scheduler:
    kw = {"max_total_tokens": 512, **kw}
    args = ServerArgs(model_path=path, device="cpu", dtype="float32", disable_overlap_schedule=not overlap, **kw)
    return start_scheduler(args)


def _eagle(head: str) -> dict:
    return dict(
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=head,
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
    )


@pytest.fixture(scope="module")
def perfect_pair(perfect_llama_pair) -> tuple[str, dict]:
    """A target and an EAGLE head that reproduces it: every draft is accepted (cycles of 4
    tokens), but the target's attention output is zero, so wrong KV would go unnoticed."""
    target, head = perfect_llama_pair
    return target, _eagle(head)


@pytest.fixture(scope="module")
def random_pair(tiny_llama_dir, tiny_llama_eagle_head_dir) -> tuple[str, dict]:
    """A random head for the tiny Llama: few drafts accepted, every token depends on the KV."""
    return tiny_llama_dir, _eagle(tiny_llama_eagle_head_dir)


@pytest.fixture(params=["perfect_pair", "random_pair"])
def spec_pair(request) -> tuple[str, dict]:
    return request.getfixturevalue(request.param)


def _run(scheduler: Scheduler, params: list[SamplingParams], abort_after: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Final output ids per request; abort_after[rid] = iteration at which rid is aborted."""
    for i, p in enumerate(params):
        scheduler.handle_message(TokenizedGenerateReqInput(f"r{i}", None, PROMPTS[i % len(PROMPTS)], p))
    finished = scheduler.send_to_detokenizer.finished
    for it in range(500):
        for rid, at in (abort_after or {}).items():
            if it == at:
                scheduler.handle_message(AbortReq(rid))
        scheduler.run_iteration()
        if len(finished) == len(params) and not (scheduler.running or scheduler.waiting or scheduler.in_flight):
            return dict(finished)
    raise AssertionError("requests did not finish")


def _assert_all_kv_free(scheduler: Scheduler) -> None:
    assert scheduler.free_kv_tokens() == scheduler.allocator.size
    assert scheduler.req_to_token_pool.available_size() == scheduler.max_running_requests


def test_next_step_is_queued_before_the_tokens_of_this_one_are_read(tiny_llama_dir, monkeypatch):
    scheduler = _scheduler(tiny_llama_dir, overlap=True)
    events: list[str] = []
    launch, resolve = scheduler.worker.launch, LaunchedStep.resolve

    def traced_launch(batch):
        step = launch(batch)
        step.number = sum(e.startswith("launch") for e in events)
        events.append(f"launch {step.number} {batch.mode.name} futures={len(batch.future_dst)}")
        return step

    def traced_resolve(step):
        events.append(f"resolve {step.number}")
        return resolve(step)

    monkeypatch.setattr(scheduler.worker, "launch", traced_launch)
    monkeypatch.setattr(LaunchedStep, "resolve", traced_resolve)
    out = _run(scheduler, [SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)])
    assert len(out["r0"]) == 6
    # Prefill (samples token 1), then decode steps 1..5, the last queued before token 5 arrives
    # and dropped: it is never launched because token 6 ends the request by length.
    assert events == [
        "launch 0 EXTEND futures=0",
        "resolve 0",  # no other work: the prefill's token is needed to decode
        "launch 1 DECODE futures=0",
        "launch 2 DECODE futures=1",
        "resolve 1",
        "launch 3 DECODE futures=1",
        "resolve 2",
        "launch 4 DECODE futures=1",
        "resolve 3",
        "launch 5 DECODE futures=1",
        "resolve 4",
        "resolve 5",
    ]
    _assert_all_kv_free(scheduler)


def _mixed_params(stop_token: int) -> list[SamplingParams]:
    greedy = dict(temperature=0.0, ignore_eos=True)
    return [
        SamplingParams(max_new_tokens=9, stop_token_ids=[stop_token], **greedy),  # stops early
        SamplingParams(max_new_tokens=1, **greedy),
        SamplingParams(max_new_tokens=7, temperature=0.9, top_p=0.9, sampling_seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=5, **greedy),
        SamplingParams(max_new_tokens=8, frequency_penalty=0.5, **greedy),  # reads its output: no overlap
    ]


def test_outputs_match_sequential_scheduling(tiny_llama_dir):
    sequential = _scheduler(tiny_llama_dir, overlap=False)
    plain = _run(sequential, [SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)])["r0"]
    stop_token = next(t for j, t in enumerate(plain) if j >= 2 and t not in plain[:j])
    expected = _run(sequential, _mixed_params(stop_token))
    assert expected["r0"] == plain[: plain.index(stop_token) + 1]
    overlapped = _scheduler(tiny_llama_dir, overlap=True)
    assert _run(overlapped, _mixed_params(stop_token)) == expected
    _assert_all_kv_free(overlapped)


@pytest.mark.parametrize("engine_args", [{"chunked_prefill_size": 4}, {"max_total_tokens": 40, "max_running_requests": 4}])
def test_chunked_prefill_and_retraction_match_sequential(tiny_llama_dir, engine_args):
    params = [SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True) for _ in range(4)]
    expected = _run(_scheduler(tiny_llama_dir, overlap=False, **engine_args), params)
    overlapped = _scheduler(tiny_llama_dir, overlap=True, **engine_args)
    assert _run(overlapped, params) == expected
    _assert_all_kv_free(overlapped)


def test_abort_while_a_step_is_in_flight(tiny_llama_dir):
    params = [SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True) for _ in range(2)]
    expected = _run(_scheduler(tiny_llama_dir, overlap=False), params)
    overlapped = _scheduler(tiny_llama_dir, overlap=True)
    out = _run(overlapped, params, abort_after={"r1": 4})
    assert out["r0"] == expected["r0"]
    assert out["r1"] == expected["r1"][: len(out["r1"])] and len(out["r1"]) < 12
    _assert_all_kv_free(overlapped)


def test_decode_feeds_the_tokens_in_flight_from_the_device():
    """Tokens in flight come from the step's sampled ids: as a view when every row is the step's
    same row, else gathered row by row (other order, fewer rows, some tokens on the host)."""
    import torch

    from sglang.srt.batch.schedule_batch import FutureTokens, Req, ScheduleBatch

    def reqs(in_flight: list[bool]) -> list[Req]:
        out = []
        for i, flying in enumerate(in_flight):
            req = Req(f"r{i}", [1, 2], SamplingParams(max_new_tokens=8), output_ids=[50 + i])
            req.req_pool_idx, req.kv_len, req.in_flight = i, 3 if flying else 2, int(flying)
            out.append(req)
        return out

    def input_ids(batch: ScheduleBatch) -> torch.Tensor:
        batch.out_cache_loc = torch.arange(1, len(batch.reqs) + 1)
        return batch.to_forward_batch("cpu").input_ids

    sampled = torch.tensor([7, 8, 9])
    same_rows = input_ids(ScheduleBatch.for_decode(reqs([True, True]), FutureTokens(sampled, {"r0": 0, "r1": 1})))
    assert same_rows.tolist() == [7, 8] and same_rows.data_ptr() == sampled.data_ptr()
    swapped = input_ids(ScheduleBatch.for_decode(reqs([True, True]), FutureTokens(sampled, {"r0": 2, "r1": 0})))
    assert swapped.tolist() == [9, 7] and swapped.data_ptr() != sampled.data_ptr()
    mixed = input_ids(ScheduleBatch.for_decode(reqs([False, True]), FutureTokens(sampled, {"r1": 1})))
    assert mixed.tolist() == [50, 8]
    assert sampled.tolist() == [7, 8, 9]


# ---------------------------------------------------------------------- speculative cycles
def test_next_cycle_is_queued_before_the_tokens_of_this_one_are_read(perfect_pair, monkeypatch):
    from sglang.srt.speculative.eagle_worker import LaunchedCycle

    target, spec = perfect_pair
    scheduler = _scheduler(target, overlap=True, **spec)
    events: list[str] = []
    launch, resolve = scheduler.worker.launch, LaunchedCycle.resolve

    def traced_launch(batch, *plan_and_tier):
        step = launch(batch, *plan_and_tier)
        events.append(f"launch {batch.mode.name}")
        return step

    def traced_resolve(step):
        events.append("resolve")
        return resolve(step)

    monkeypatch.setattr(scheduler.worker, "launch", traced_launch)
    monkeypatch.setattr(LaunchedCycle, "resolve", traced_resolve)
    out = _run(scheduler, [SamplingParams(max_new_tokens=13, temperature=0.0, ignore_eos=True)])
    assert len(out["r0"]) == 13
    # Prefill: 1 token (read at once); cycles of 4 tokens bring 5, 9 and 13. Each cycle is
    # queued before the previous one is read, and nothing is queued after the one that may end
    # the request (9 tokens so far + up to 4 in flight >= 13).
    assert events == ["launch EXTEND", "launch DECODE", "launch DECODE", "resolve", "launch DECODE", "resolve", "resolve"]
    _assert_all_kv_free(scheduler)


def test_speculative_outputs_match_sequential_scheduling(spec_pair):
    target, spec = spec_pair
    sequential = _scheduler(target, overlap=False, **spec)
    plain = _run(sequential, [SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)])["r0"]
    stop_token = next(t for j, t in enumerate(plain) if j >= 2 and t not in plain[:j])
    expected = _run(sequential, _mixed_params(stop_token))
    assert expected["r0"] == plain[: plain.index(stop_token) + 1]
    overlapped = _scheduler(target, overlap=True, **spec)
    assert _run(overlapped, _mixed_params(stop_token)) == expected
    _assert_all_kv_free(overlapped)


@pytest.mark.parametrize("engine_args", [{"chunked_prefill_size": 4}, {"max_total_tokens": 64, "max_running_requests": 4}])
def test_speculative_chunked_prefill_and_retraction_match_sequential(spec_pair, engine_args):
    target, spec = spec_pair
    params = [SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True) for _ in range(4)]
    expected = _run(_scheduler(target, overlap=False, **spec, **engine_args), params)
    overlapped = _scheduler(target, overlap=True, **spec, **engine_args)
    assert _run(overlapped, params) == expected
    _assert_all_kv_free(overlapped)


def test_speculative_abort_while_a_cycle_is_in_flight(spec_pair):
    target, spec = spec_pair
    params = [SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True) for _ in range(2)]
    expected = _run(_scheduler(target, overlap=False, **spec), params)
    overlapped = _scheduler(target, overlap=True, **spec)
    out = _run(overlapped, params, abort_after={"r1": 3})
    assert out["r0"] == expected["r0"]
    assert out["r1"] == expected["r1"][: len(out["r1"])] and len(out["r1"]) < 24
    _assert_all_kv_free(overlapped)
