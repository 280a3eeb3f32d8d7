"""A Scheduler driven in this process (no sockets): requests are injected and final tokens kept."""

from __future__ import annotations

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_process import create_scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import PortArgs, ServerArgs


class DetokenizerStub:
    """Stands in for the detokenizer socket: keeps each request's final tokens (put together
    from the messages' new ids, which must arrive in order)."""

    def __init__(self) -> None:
        self.finished: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, dict] = {}
        self.partial: dict[str, list[int]] = {}

    def send_pyobj(self, msg) -> None:
        for rid, ids, offset, reason in zip(msg.rids, msg.output_ids, msg.output_offsets, msg.finished_reasons):
            so_far = self.partial.pop(rid, [])
            assert offset == len(so_far), (rid, offset, len(so_far))
            if reason is not None:
                self.finished[rid] = so_far + ids
                self.finish_reasons[rid] = reason
            else:
                self.partial[rid] = so_far + ids


def start_scheduler(server_args: ServerArgs, tp_rank: int = 0, port_args: PortArgs | None = None) -> Scheduler:
    scheduler = create_scheduler(server_args, port_args or PortArgs.init_new(server_args), 0, tp_rank, None)
    scheduler.recv_from_tokenizer = None
    scheduler.send_to_detokenizer = DetokenizerStub()
    return scheduler


def greedy(
    scheduler: Scheduler,
    prompts: list[list[int]],
    max_new: list[int],
    max_iterations: int = 10_000,
    return_logprob: bool = False,
    **sampling: float,
) -> list[list[int]]:
    """Greedy output ids of every prompt (all submitted at once), run to completion. Under DP
    attention every rank calls it (with its own prompts, possibly none) and iterates until
    all ranks are idle. `sampling`: further SamplingParams fields (penalties, temperature)."""
    for i, (prompt, n) in enumerate(zip(prompts, max_new)):
        params = SamplingParams(**{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **sampling})
        scheduler.handle_message(TokenizedGenerateReqInput(f"r{i}", None, prompt, params, return_logprob=return_logprob))
    finished = scheduler.send_to_detokenizer.finished
    for _ in range(max_iterations):
        scheduler.run_iteration()
        if all(f"r{i}" in finished for i in range(len(prompts))) and scheduler.globally_idle:
            return [finished.pop(f"r{i}") for i in range(len(prompts))]
    raise AssertionError("requests did not finish")
