"""--speculative-accept-check: at startup every DP rank runs a fixed greedy prompt set through
the plain path, then through the speculative path with CUDA graphs (when captured) and
eagerly, and the ranks compare: each speculative output must equal the plain one, and no rank's
accept length may fall more than ACCEPT_LENGTH_MARGIN below the best rank's in the same mode.

Invariants:
- every rank of the replica runs the same passes in the same order (each pass iterates until
  the replica is idle), so the collectives of the passes line up as in serving;
- the KV pool is flushed before each pass and after the check: no pass reuses KV that another
  pass wrote (the plain pass writes no draft KV), and serving starts from an empty pool.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)

ACCEPT_LENGTH_MARGIN = 0.5  # tokens per verify step a rank may trail the best rank by
MAX_NEW_TOKENS = 24
MAX_ITERATIONS = 10_000  # a pass that has not finished by then fails the check (on every rank alike)


def check_prompts(vocab_size: int) -> list[list[int]]:
    """Fixed token-id prompts (no tokenizer needed) of a few lengths, inside any vocabulary."""
    return [[(7 * i + 13 * j + 1) % vocab_size for j in range(length)] for i, length in enumerate((3, 9, 17, 30))]


@dataclass(frozen=True)
class PassResult:
    dp_rank: int
    mode: str  # "graphs" or "eager"
    accept_length: float
    outputs_match: bool

    def __str__(self) -> str:
        match = "match" if self.outputs_match else "DIFFER FROM"
        return f"DP{self.dp_rank} {self.mode}: accept length {self.accept_length:.2f}, outputs {match} the non-speculative path"


class AcceptCheckFailed(RuntimeError):
    pass


def judge(results: Sequence[PassResult], margin: float = ACCEPT_LENGTH_MARGIN) -> Optional[str]:
    """Why the check fails (None: it passes): a pass whose outputs differ, or a rank more than
    `margin` below the best rank of the same mode."""
    problems = [f"{r}" for r in results if not r.outputs_match]
    for mode in sorted({r.mode for r in results}):
        best = max(r.accept_length for r in results if r.mode == mode)
        problems += [
            f"DP{r.dp_rank} {mode}: accept length {r.accept_length:.2f} is more than {margin} below the best rank's {best:.2f}"
            for r in results
            if r.mode == mode and r.accept_length < best - margin
        ]
    return "; ".join(problems) or None


def run_accept_check(scheduler: Scheduler) -> list[PassResult]:
    """Run the check on this rank (every rank of the replica calls it); log every DP rank's
    results on the first rank and raise AcceptCheckFailed on every rank when they fail."""
    prompts = check_prompts(scheduler.model_config.vocab_size)
    with _plain_path(scheduler):
        reference = _run_pass(scheduler, prompts)
    modes = ["graphs", "eager"] if _graph_runners(scheduler) else ["eager"]
    mine = []
    for mode in modes:
        with _eager_only(scheduler, mode == "eager"):
            outputs = _run_pass(scheduler, prompts)
        accept_length = scheduler.avg_spec_accept_length() or 0.0
        mine.append(PassResult(scheduler.dp_rank or 0, mode, accept_length, outputs == reference))
    scheduler.reset_spec_stats()  # serving's statistics start at zero
    # One entry per DP rank: its attention-TP peers ran the same batches.
    results = [r for rank_results in scheduler.comm.gather_objects(mine)[:: scheduler.comm.attn_tp_size] for r in rank_results]
    if scheduler.tp_rank == 0:
        for r in results:
            logger.info("Speculative accept check: %s", r)
    problem = judge(results)
    if problem is not None:
        raise AcceptCheckFailed(f"--speculative-accept-check failed: {problem}")
    return results


def _run_pass(scheduler: Scheduler, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of the prompts, run until the whole replica is idle; the pool is flushed
    before and after and the statistics of speculation start from zero."""
    _flush(scheduler)
    scheduler.reset_spec_stats()
    rids = [f"accept-check-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts):
        params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
        scheduler.handle_message(TokenizedGenerateReqInput(rid, None, prompt, params))
    reqs = [r for r in scheduler.waiting if r.rid in rids]
    if len(reqs) != len(prompts):
        refused = [rid for rid in rids if rid not in {r.rid for r in reqs}]
        raise AcceptCheckFailed(f"--speculative-accept-check: the server refused its prompts {refused}")
    sender, scheduler.send_to_detokenizer = scheduler.send_to_detokenizer, None  # nobody waits for these outputs
    try:
        for _ in range(MAX_ITERATIONS):
            scheduler.run_iteration()
            if not scheduler.has_work() and scheduler.globally_idle:
                break
        else:
            raise AcceptCheckFailed(f"--speculative-accept-check: its prompts did not finish in {MAX_ITERATIONS} iterations")
    finally:
        scheduler.send_to_detokenizer = sender
    _flush(scheduler)
    return [list(r.output_ids) for r in reqs]


def _flush(scheduler: Scheduler) -> None:
    if not scheduler.flush_cache():
        raise AcceptCheckFailed("--speculative-accept-check: requests were still running after a pass")


@contextmanager
def _plain_path(scheduler: Scheduler) -> Iterator[None]:
    """The scheduler runs the target model alone (no drafts, no verification)."""
    spec_worker = scheduler.spec_worker
    scheduler.worker, scheduler.spec_worker = spec_worker.target, None
    try:
        yield
    finally:
        scheduler.worker = scheduler.spec_worker = spec_worker


def _graph_runners(scheduler: Scheduler) -> list:
    runners = [scheduler.runner, scheduler.spec_worker.draft_runner]
    return [r for r in runners if r.graph_runner is not None]


@contextmanager
def _eager_only(scheduler: Scheduler, eager: bool) -> Iterator[None]:
    """With `eager`, the target and draft runners run without their CUDA graphs."""
    runners = _graph_runners(scheduler) if eager else []
    saved = [r.graph_runner for r in runners]
    for r in runners:
        r.graph_runner = None
    try:
        yield
    finally:
        for r, graphs in zip(runners, saved):
            r.graph_runner = graphs
