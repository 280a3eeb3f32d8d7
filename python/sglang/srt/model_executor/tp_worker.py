"""Runs a scheduled batch through the model and samples: the non-speculative worker.

A worker turns a ScheduleBatch into new tokens per request. It allocates the KV slots its
forwards write (through ReqKVManager) and reports how many KV positions each request gained,
so that speculative workers can plug in behind the same call.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.batch.forward_batch_info import ForwardMode
from sglang.srt.batch.generation_result import GenerationResult
from sglang.srt.batch.req_kv import ReqKVManager
from sglang.srt.batch.schedule_batch import FutureTokens, Req, ScheduleBatch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.cuda_graph_runner import CapturedMode, ModeKey
from sglang.srt.model_executor.model_runner import PLAIN_GRAPH_MODES, ModelRunner, RunnerShapes, greedy_decode
from sglang.srt.sampling.sampler import SampleOutput, Sampler, SamplingBatchInfo
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.transfer import HostCopy, upload


@dataclass
class SampledRows:
    """One token sampled on the device for each of `rows` (ascending) of a batch, on its way
    to the host."""

    reqs: list[Req]
    rows: list[int]
    out: SampleOutput
    copy: HostCopy
    want_logprobs: bool

    def fill(self, result: GenerationResult) -> None:
        """Wait for the values and put them into result's rows."""
        ids, *extra = self.copy.lists()
        if self.want_logprobs:
            result.logprobs = [[] for _ in self.reqs]
            result.top_logprobs = [[] for _ in self.reqs]
            lp, tops = extra[0], extra[1:]  # tops: [values, ids] or []
            for j, i in enumerate(self.rows):
                result.logprobs[i].append((lp[j], ids[j]))
                if tops and self.reqs[i].top_logprobs_num:
                    k = self.reqs[i].top_logprobs_num
                    result.top_logprobs[i].append(list(zip(tops[0][j][:k], tops[1][j][:k])))
        for j, i in enumerate(self.rows):
            result.next_token_ids[i] = [ids[j]]


@dataclass
class InputLogprobs:
    """An extend step's prompt logprobs (ScheduleBatch.input_logprob_rows) on their way to the host."""

    batch: ScheduleBatch
    copy: HostCopy

    @classmethod
    def launch(cls, batch: ScheduleBatch, output: LogitsProcessorOutput) -> Optional[InputLogprobs]:
        if output.input_token_logprobs is None:
            return None
        return cls(batch, HostCopy(output.input_token_logprobs, *(output.input_top_logprobs or ())))

    def fill(self, result: GenerationResult) -> None:
        """Wait for the values and put each request's rows into result (in position order)."""
        logprobs, *tops = self.copy.lists()
        next_ids, row = self.batch.input_logprob_next_ids, 0
        result.input_logprobs, result.input_top_logprobs = [], []
        for req, n in zip(self.batch.reqs, self.batch.input_logprob_counts):
            rows, k = range(row, row + n), req.top_logprobs_num
            result.input_logprobs.append([(logprobs[j], next_ids[j]) for j in rows])
            result.input_top_logprobs.append([list(zip(tops[0][j][:k], tops[1][j][:k])) for j in rows] if k else [])
            row += n


@dataclass
class LaunchedStep:
    """A step queued on the device. Its KV positions are known at once; its tokens once
    `resolve()` has waited for them."""

    result: GenerationResult
    sampled: Optional[SampledRows] = None
    input_logprobs: Optional[InputLogprobs] = None
    kv_known_at_launch = True

    @property
    def sampled_rows(self) -> list[int]:
        return self.sampled.rows if self.sampled else []

    def future_tokens(self) -> Optional[FutureTokens]:
        """The sampled tokens, still on the device, for the next step to feed (None if none)."""
        if self.sampled is None:
            return None
        reqs = self.sampled.reqs
        return FutureTokens(self.sampled.out.next_token_ids, {reqs[i].rid: j for j, i in enumerate(self.sampled.rows)})

    def resolve(self) -> GenerationResult:
        if self.sampled is not None:
            self.sampled.fill(self.result)
        if self.input_logprobs is not None:
            self.input_logprobs.fill(self.result)
        return self.result


@dataclass
class _LastSampling:
    """What TpModelWorker.sampling_of returned for its last batch (none kept when penalties
    read the tokens so far)."""

    vocab_size: int
    reqs: list[Req]
    sampling: tuple[SamplingBatchInfo, bool, int]


def _same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


class TpModelWorker:
    def __init__(
        self,
        server_args: ServerArgs,
        model_config: ModelConfig,
        gpu_id: int,
        tp_rank: int,
        shapes: RunnerShapes = RunnerShapes(),
        graph_modes: Optional[dict[ModeKey, CapturedMode]] = None,
    ):
        """shapes and graph_modes: the runner's, beyond plain decoding (ModelRunner)."""
        # Greedy decode batches run forward and argmax as one program (PLAIN_GRAPH_MODES);
        # not under DP attention, where every DP rank replays the same graph whatever its
        # requests sample.
        self.greedy_decode_program = graph_modes is None and not server_args.enable_dp_attention
        if graph_modes is None and not self.greedy_decode_program:
            graph_modes = {key: mode for key, mode in PLAIN_GRAPH_MODES.items() if key.program is None}
        self.runner = ModelRunner(
            model_config, server_args, gpu_id, tp_rank, server_args.tp_size, shapes=shapes, graph_modes=graph_modes
        )
        self.device = self.runner.device
        self.sampler = Sampler(server_args.enable_nan_detection)
        self.generators: dict[str, torch.Generator] = {}
        self.kv: Optional[ReqKVManager] = None  # set by the scheduler once the cache exists
        self.last_sampling: Optional[_LastSampling] = None

    # Tokens each running request may need in one decode step (the scheduler keeps them free).
    def decode_kv_need_per_req(self) -> int:
        return 1

    def max_tokens_per_step(self) -> int:
        return 1

    def add_request(self, req: Req) -> None:
        seed = req.sampling_params.sampling_seed
        if seed is not None:
            self.generators[req.rid] = torch.Generator(device=self.device).manual_seed(seed)

    def remove_request(self, req: Req) -> None:
        self.generators.pop(req.rid, None)

    def launch(self, batch: ScheduleBatch) -> LaunchedStep:
        """Queue the forward and the sampling without waiting for the device."""
        if batch.mode == ForwardMode.DECODE:
            batch.kv_write = self.kv.assign_next_on_upload(batch.reqs)
            if self.greedy_decode_program and self.takes_argmax_only(batch.reqs):
                return self.launch_greedy_decode(batch)
        output = self.runner.forward(batch.to_forward_batch(self.device))
        if batch.mode == ForwardMode.IDLE:
            return LaunchedStep(GenerationResult([], []))
        # Requests whose whole sequence now has KV get a token (in decode: all); a chunked
        # prefill does not.
        if batch.mode == ForwardMode.DECODE:
            ready = list(range(len(batch.reqs)))
        else:
            ready = [i for i, r in enumerate(batch.reqs) if r.kv_len + batch.extend_lens[i] == r.full_len]
        step = LaunchedStep(GenerationResult([[] for _ in batch.reqs], list(batch.extend_lens)))
        step.input_logprobs = InputLogprobs.launch(batch, output)
        if ready:
            step.sampled = self.launch_sampling(batch.reqs, ready, output)
        return step

    def takes_argmax_only(self, reqs: list[Req]) -> bool:
        """Whether each request's token is the argmax of its logits and nothing else of them
        is read (no penalties, biases, logprobs, or NaN detection)."""
        if self.sampler.detect_nan:
            return False
        return all(r.sampling_params.is_greedy and not r.sampling_params.adjusts_logits and not r.return_logprob for r in reqs)

    def launch_greedy_decode(self, batch: ScheduleBatch) -> LaunchedStep:
        """A greedy decode batch's forward and argmax as one program (one graph replay)."""
        (tokens,) = self.runner.run_program(batch.to_forward_batch(self.device), greedy_decode)
        rows = list(range(len(batch.reqs)))
        step = LaunchedStep(GenerationResult([[] for _ in batch.reqs], list(batch.extend_lens)))
        step.sampled = SampledRows(batch.reqs, rows, SampleOutput(tokens), HostCopy(tokens), False)
        return step

    def sample_rows(
        self, reqs: list[Req], rows: list[int], output: LogitsProcessorOutput, result: GenerationResult
    ) -> SampleOutput:
        """Sample one token for reqs[i] from logits row i, for i in rows (ascending), into
        result (waiting for the values)."""
        sampled = self.launch_sampling(reqs, rows, output)
        sampled.fill(result)
        return sampled.out

    def launch_sampling(self, reqs: list[Req], rows: list[int], output: LogitsProcessorOutput) -> SampledRows:
        """Sample reqs[i] from logits row i, for i in rows; the values start their way to the host."""
        logits = output.next_token_logits
        if len(rows) < logits.shape[0]:  # else rows are all rows, in order
            logits = logits[upload([rows], self.device)[0]]
        out = self.sample([reqs[i] for i in rows], logits)
        want_logprobs = any(r.return_logprob for r in reqs)
        extra = (out.logprobs, *(out.top_logprobs or ())) if want_logprobs else ()
        return SampledRows(reqs, rows, out, HostCopy(out.next_token_ids, *extra), want_logprobs)

    def sample(self, reqs: list[Req], logits: torch.Tensor) -> SampleOutput:
        info, want_logprob, top_n = self.sampling_of(reqs, logits.shape[-1])
        return self.sampler(logits, info, want_logprob, top_n)

    def sampling_of(self, reqs: list[Req], vocab_size: int) -> tuple[SamplingBatchInfo, bool, int]:
        """The batch's sampling parameters, whether it wants logprobs, and its top-logprobs
        count. The same requests as the previous batch (decode, step after step) reuse them,
        unless penalties read the tokens so far."""
        cached = self.last_sampling
        if cached is not None and cached.vocab_size == vocab_size and _same_objects(cached.reqs, reqs):
            return cached.sampling
        info = SamplingBatchInfo.from_requests(
            [r.sampling_params for r in reqs],
            [(r.origin_input_ids, r.output_ids) for r in reqs],
            [self.generators.get(r.rid) for r in reqs],
            vocab_size,
            self.device,
        )
        want_logprob = any(r.return_logprob for r in reqs)
        top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        sampling = (info, want_logprob, top_n)
        self.last_sampling = None if info.output_counts is not None else _LastSampling(vocab_size, list(reqs), sampling)
        return sampling
