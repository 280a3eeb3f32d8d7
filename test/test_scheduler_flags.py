"""Scheduler flags that change when work happens, not what it produces (in-process scheduler,
tiny random Llama, CPU, float32):
- --num-continuous-decode-steps: requests arriving one by one while others decode are
  prefilled together after that many decode steps, with the same tokens;
- --stream-interval: a streaming request's tokens go out in chunks of that many (the first
  token at once), with the same tokens."""

from __future__ import annotations

import pytest

from sglang.srt.batch.forward_batch_info import ForwardMode
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.inprocess_scheduler import DetokenizerStub, start_scheduler

LATE_ARRIVALS = 6


def _staggered_run(path: str, steps: int) -> tuple[dict[str, list[int]], list[ForwardMode]]:
    """One long request decodes; one more arrives at each of the next iterations. Returns the
    final tokens per request and the mode of every batch launched."""
    args = ServerArgs(model_path=path, device="cpu", dtype="float32", num_continuous_decode_steps=steps)
    scheduler: Scheduler = start_scheduler(args)
    modes: list[ForwardMode] = []
    launch = scheduler.launch
    scheduler.launch = lambda batch, plan: (modes.append(batch.mode), launch(batch, plan))[1]

    def submit(i: int, max_new: int) -> None:
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
        scheduler.handle_message(TokenizedGenerateReqInput(f"r{i}", None, [5 + i, 17, 42, 99 - i], params))

    submit(0, 30)
    for _ in range(3):  # r0 is decoding
        scheduler.run_iteration()
    for i in range(1, 1 + LATE_ARRIVALS):
        submit(i, 6)
        scheduler.run_iteration()
    finished = scheduler.send_to_detokenizer.finished
    for _ in range(200):
        scheduler.run_iteration()
        if len(finished) == 1 + LATE_ARRIVALS and scheduler.globally_idle:
            return dict(finished), modes
    raise AssertionError("requests did not finish")


def test_late_arrivals_are_prefilled_together_with_the_same_tokens(tiny_llama_dir):
    every_step, every_step_modes = _staggered_run(tiny_llama_dir, 1)
    grouped, grouped_modes = _staggered_run(tiny_llama_dir, 4)
    assert grouped == every_step
    assert every_step_modes.count(ForwardMode.EXTEND) == 1 + LATE_ARRIVALS  # each arrival prefilled at once
    prefills = [i for i, mode in enumerate(grouped_modes) if mode == ForwardMode.EXTEND]
    assert 1 < len(prefills) < 1 + LATE_ARRIVALS
    for before, after in zip(prefills, prefills[1:]):
        assert after - before > 4  # 4 decode steps between two prefills while r0 decodes


def test_num_continuous_decode_steps_must_be_positive():
    with pytest.raises(ValueError, match="--num-continuous-decode-steps"):
        ServerArgs(model_path="m", device="cpu", num_continuous_decode_steps=0)


class ChunkRecorder(DetokenizerStub):
    """Also keeps the number of new ids of every message."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[int] = []

    def send_pyobj(self, msg) -> None:
        self.chunks += [len(ids) for ids in msg.output_ids]
        super().send_pyobj(msg)


def _streamed_chunks(path: str, interval: int) -> tuple[list[int], list[int]]:
    args = ServerArgs(model_path=path, device="cpu", dtype="float32", stream_interval=interval)
    scheduler = start_scheduler(args)
    scheduler.send_to_detokenizer = recorder = ChunkRecorder()
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    scheduler.handle_message(TokenizedGenerateReqInput("r0", None, [5, 17, 42], params, stream=True))
    for _ in range(40):
        scheduler.run_iteration()
        if "r0" in recorder.finished and scheduler.globally_idle:
            return recorder.finished["r0"], recorder.chunks
    raise AssertionError("the request did not finish")


def test_stream_interval_sends_the_same_tokens_in_fewer_chunks(tiny_llama_dir):
    tokens, chunks = _streamed_chunks(tiny_llama_dir, 1)
    assert chunks == [1] * 10
    assert _streamed_chunks(tiny_llama_dir, 4) == (tokens, [1, 4, 4, 1])  # the first at once, the rest at the finish


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="--stream-interval"):
        ServerArgs(model_path="m", device="cpu", stream_interval=0)
