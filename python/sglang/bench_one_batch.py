"""Latency of one static batch: prefill, then decode steps, on the model runner alone (no server,
no scheduler, no tokenizer), as SGLang's `python -m sglang.bench_one_batch`.

    python -m sglang.bench_one_batch --model-path M --batch-size 1 32 --input-len 256 --output-len 32

Every (batch size, input length, output length) combination runs after one warm-up: prompts
of random token ids are prefilled in one EXTEND forward, then output_len - 1 DECODE forwards
feed back the greedy tokens. Any other flag is a server flag (e.g. --dtype, --load-format
dummy, --attention-backend); a single rank only (--tp-size 1).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from typing import Optional

import torch

from sglang.srt.batch.req_kv import ReqKVManager
from sglang.srt.batch.schedule_batch import Req, ScheduleBatch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, prepare_server_args


def load_runner(server_args: ServerArgs) -> ModelRunner:
    if server_args.tp_size != 1 or server_args.dp_size != 1:
        raise SystemExit("bench_one_batch runs one rank: use --tp-size 1 --dp-size 1")
    config = ModelConfig(
        server_args.model_path,
        context_length=server_args.context_length,
        dtype=server_args.dtype,
        device=server_args.device,
        trust_remote_code=server_args.trust_remote_code,
    )
    return ModelRunner(config, server_args, gpu_id=0)


class OneBatch:
    """Runs prefill + decode for one batch of requests and times each forward."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.kv = ReqKVManager(runner.req_to_token_pool, runner.token_allocator, None)

    def _sync(self) -> None:
        if self.runner.device.startswith("cuda"):
            torch.cuda.synchronize()

    def _timed(self, batch: ScheduleBatch) -> tuple[list[int], float]:
        """Greedy next token per request of `batch`, and the forward's seconds."""
        self._sync()
        start = time.perf_counter()
        logits = self.runner.forward(batch.to_forward_batch(self.runner.device)).next_token_logits
        tokens = logits.argmax(-1).tolist()  # copies to the host: the forward has finished
        return tokens, time.perf_counter() - start

    def run(self, batch_size: int, input_len: int, output_len: int, seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        vocab = self.runner.model_config.vocab_size
        reqs = [
            Req(f"bench-{i}", torch.randint(0, vocab, (input_len,), generator=gen).tolist(), SamplingParams())
            for i in range(batch_size)
        ]
        try:
            for r in reqs:
                self.kv.claim(r)
                r.extend_len = input_len
            batch = ScheduleBatch.for_extend(reqs, self.kv.assign(reqs, [input_len] * batch_size))
            tokens, prefill = self._timed(batch)
            decodes = []
            for _ in range(output_len - 1):
                for r, t in zip(reqs, tokens):
                    r.kv_len = r.seq_len
                    r.output_ids.append(t)
                batch = ScheduleBatch.for_decode(reqs)
                batch.out_cache_loc = self.kv.assign(reqs, [1] * batch_size)
                tokens, seconds = self._timed(batch)
                decodes.append(seconds)
            for r in reqs:
                r.kv_len = r.seq_len
        finally:
            for r in reqs:
                self.kv.release(r)
        return summarize(batch_size, input_len, output_len, prefill, decodes)


def summarize(batch_size: int, input_len: int, output_len: int, prefill: float, decodes: list[float]) -> dict:
    total = prefill + sum(decodes)
    row = {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency": prefill,
        "prefill_throughput": batch_size * input_len / prefill,
        "total_latency": total,
        "overall_throughput": batch_size * (input_len + output_len) / total,
    }
    if decodes:
        median = statistics.median(decodes)
        row.update(median_decode_latency=median, median_decode_throughput=batch_size / median)
    return row


def print_row(row: dict) -> None:
    print(f"Prefill. latency: {row['prefill_latency']:.5f} s, throughput: {row['prefill_throughput']:9.2f} token/s")
    if "median_decode_latency" in row:
        print(
            f"Decode.  median latency: {row['median_decode_latency']:.5f} s, "
            f"median throughput: {row['median_decode_throughput']:9.2f} token/s"
        )
    print(f"Total. latency: {row['total_latency']:.3f} s, throughput: {row['overall_throughput']:9.2f} token/s", flush=True)


def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, nargs="+", default=[1024])
    parser.add_argument("--output-len", type=int, nargs="+", default=[16])
    parser.add_argument("--run-name", default="default")
    parser.add_argument("--result-filename", help="append one JSON line per combination")
    parser.add_argument("--seed", type=int, default=0)
    args, server_argv = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    server_args = prepare_server_args(server_argv)
    runner = load_runner(server_args)
    bench = OneBatch(runner)
    bench.run(max(args.batch_size), min(args.input_len), min(2, min(args.output_len)), args.seed)  # warm-up
    rows = []
    for bs, il, ol in itertools.product(args.batch_size, args.input_len, args.output_len):
        if bs > runner.max_running_requests or bs * (il + ol) > runner.token_allocator.size:
            print(f"skipping batch {bs} x ({il} + {ol}) tokens: does not fit the KV cache", flush=True)
            continue
        row = bench.run(bs, il, ol, args.seed)
        row.update(run_name=args.run_name, model=server_args.model_path, dtype=str(runner.dtype))
        print(f"Benchmark: batch size {bs}, input len {il}, output len {ol}")
        print_row(row)
        rows.append(row)
        if args.result_filename:
            with open(args.result_filename, "a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


if __name__ == "__main__":
    main()
