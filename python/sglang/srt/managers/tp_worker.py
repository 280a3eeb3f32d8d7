"""Runs a scheduled batch through the model and samples: the non-speculative worker.

A worker turns a ScheduleBatch into new tokens per request. It allocates the KV slots its
forwards write (through ReqKVManager) and reports how many KV positions each request gained,
so that speculative workers can plug in behind the same call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.sampler import SampleOutput, Sampler, SamplingBatchInfo
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.req_kv import ReqKVManager
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.transfer import to_host, upload


@dataclass
class GenerationResult:
    # New tokens per request (empty for a request whose prompt is still being chunked).
    next_token_ids: list[list[int]]
    # KV positions written per request by this step (the scheduler adds them to kv_len).
    kv_written: list[int]
    # Per request, per new token: (logprob, token id) and top logprobs, when asked for.
    logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    top_logprobs: list[list[list[tuple[float, int]]]] = field(default_factory=list)
    # Draft tokens accepted this step per request (speculative workers only).
    accepted_draft_tokens: Optional[list[int]] = None


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig, gpu_id: int, tp_rank: int):
        self.runner = ModelRunner(model_config, server_args, gpu_id, tp_rank, server_args.tp_size)
        self.device = self.runner.device
        self.sampler = Sampler(server_args.enable_nan_detection)
        self.generators: dict[str, torch.Generator] = {}
        self.kv: Optional[ReqKVManager] = None  # set by the scheduler once the cache exists

    # Tokens each running request may need in one decode step (the scheduler keeps them free).
    def decode_kv_need_per_req(self) -> int:
        return 1

    def add_request(self, req: Req) -> None:
        seed = req.sampling_params.sampling_seed
        if seed is not None:
            self.generators[req.rid] = torch.Generator(device=self.device).manual_seed(seed)

    def remove_request(self, req: Req) -> None:
        self.generators.pop(req.rid, None)

    def forward_batch_generation(self, batch: ScheduleBatch) -> GenerationResult:
        if batch.mode == ForwardMode.DECODE:
            batch.out_cache_loc = self.kv.assign(batch.reqs, [1] * len(batch.reqs))
        output = self.runner.forward(batch.to_forward_batch(self.device))
        if batch.mode == ForwardMode.IDLE:
            return GenerationResult([], [])
        # Requests whose whole sequence now has KV get a token; a chunked prefill does not.
        ready = [i for i, r in enumerate(batch.reqs) if r.kv_len + batch.extend_lens[i] == r.seq_len]
        result = GenerationResult([[] for _ in batch.reqs], list(batch.extend_lens))
        if ready:
            self.sample_rows(batch.reqs, ready, output, result)
        return result

    def sample_rows(
        self, reqs: list[Req], rows: list[int], output: LogitsProcessorOutput, result: GenerationResult
    ) -> SampleOutput:
        """Sample one token for reqs[i] from logits row i, for i in rows (ascending), into
        result. The sampled values reach the host through one read."""
        chosen = [reqs[i] for i in rows]
        logits = output.next_token_logits
        if len(rows) < logits.shape[0]:  # else rows are all rows, in order
            logits = logits[upload([rows], self.device)[0]]
        out = self.sample(chosen, logits)
        want_logprobs = any(r.return_logprob for r in reqs)
        extra = (out.logprobs, *(out.top_logprobs or ())) if want_logprobs else ()
        ids, *extra_lists = to_host(out.next_token_ids, *extra)
        if want_logprobs:
            result.logprobs = [[] for _ in reqs]
            result.top_logprobs = [[] for _ in reqs]
            lp, tops = extra_lists[0], extra_lists[1:]  # tops: [values, ids] or []
            for j, i in enumerate(rows):
                result.logprobs[i].append((lp[j], ids[j]))
                if tops and reqs[i].top_logprobs_num:
                    k = reqs[i].top_logprobs_num
                    result.top_logprobs[i].append(list(zip(tops[0][j][:k], tops[1][j][:k])))
        for j, i in enumerate(rows):
            result.next_token_ids[i] = [ids[j]]
        return out

    def sample(self, reqs: list[Req], logits: torch.Tensor) -> SampleOutput:
        info = SamplingBatchInfo.from_requests(
            [r.sampling_params for r in reqs],
            [(r.origin_input_ids, r.output_ids) for r in reqs],
            [self.generators.get(r.rid) for r in reqs],
            logits.shape[-1],
            self.device,
        )
        want_logprob = any(r.return_logprob for r in reqs)
        top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        return self.sampler(logits, info, want_logprob, top_n)
