"""How many streamed tokens per second the serving path above the scheduler carries.

The real HTTP server, TokenizerManager and detokenizer process, with a paced stand-in for
the scheduler (no model): every --step-ms it sends --tokens-per-step new tokens for each running request,
in one message, as the scheduler does after each decode step (one token) or speculative cycle
(the accepted drafts and the bonus token). `python -m sglang.bench_serving`
then streams requests through /generate at each --concurrency. A fast model's decode step
on a GPU takes well under a millisecond, so at high concurrency this path, not the GPU, can
set the throughput; this script measures it on any machine.

    python benchmark/bench_serving_pipeline.py --step-ms 0.6 --concurrency 1 32
    python benchmark/bench_serving_pipeline.py --step-ms 0.6 --concurrency 32 --num-prompts 512 -- --stream-output
    python benchmark/bench_serving_pipeline.py --step-ms 1.0 --tokens-per-step 3 --concurrency 32

Per concurrency: output tok/s (the ideal is concurrency x tokens per step / step), mean TTFT,
median TPOT, and the CPU microseconds per streamed token of the HTTP process (one event loop
does all of its work), of the detokenizer and of the client (bench_serving's event loop, which
reads every streamed chunk; with the fraction of the run it was busy). Flags after `--` go to the server. On a small machine the
client and every process share few cores: compare the CPU per token between versions, not
the throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import requests

from sglang.bench_serving import get_parser as bench_serving_parser
from sglang.bench_serving import run_benchmark
from sglang.srt.utils.process import descendant_pids
from sglang.test.server_utils import kill_server, popen_launch_server

MAX_TOTAL_TOKENS = 1 << 20


# ---------------------------------------------------------------------------- server side
def paced_scheduler(server_args, port_args, step_s: float, tokens_per_step: int, writer) -> None:
    """A scheduler process stand-in: tokens_per_step tokens per running request every step_s seconds."""
    import zmq

    from sglang.srt.managers import io_struct as io
    from sglang.srt.utils.process import watch_parent
    from sglang.srt.utils.zmq_utils import shared_context

    watch_parent()
    ctx = shared_context(1)
    recv = ctx.socket(zmq.PULL)
    recv.connect(port_args.scheduler_input_ipc_name)
    to_detokenizer = ctx.socket(zmq.PUSH)
    to_detokenizer.connect(port_args.detokenizer_ipc_name)
    to_tokenizer = ctx.socket(zmq.PUSH)
    to_tokenizer.connect(port_args.tokenizer_ipc_name)
    context_len = 1 << 16
    writer.send(io.SchedulerReady(0, 0, MAX_TOTAL_TOKENS, context_len - 1, context_len))
    writer.close()
    running: dict[str, tuple[io.TokenizedGenerateReqInput, list[int]]] = {}

    def handle(msg: Any) -> None:
        if isinstance(msg, io.TokenizedGenerateReqInput):
            running[msg.rid] = (msg, [])
        elif isinstance(msg, io.AbortReq):
            running.pop(msg.rid, None)
        elif isinstance(msg, io.FlushCacheReq):
            to_tokenizer.send_pyobj(io.FlushCacheReqOutput(True))
        elif isinstance(msg, io.GetInternalStateReq):
            state = {
                "dp_rank": 0,
                "avg_spec_accept_length": None,
                "max_total_num_tokens": MAX_TOTAL_TOKENS,
                "available_kv_tokens": MAX_TOTAL_TOKENS,
                "stand_in_pid": os.getpid(),
            }
            to_tokenizer.send_pyobj(io.GetInternalStateReqOutput(state))

    next_step = time.perf_counter()
    while True:
        if not running:  # idle: wait for a message; the first step comes one step after it
            recv.poll()
            next_step = time.perf_counter() + step_s
        while (remaining := next_step - time.perf_counter()) > 0:  # zmq polls in whole milliseconds
            if recv.poll(0):
                handle(recv.recv_pyobj())
            else:
                time.sleep(min(remaining, 1e-4))
        if running:
            to_detokenizer.send_pyobj(_step(running, tokens_per_step))
        next_step = max(next_step + step_s, time.perf_counter())  # no burst after a stall


def _step(running: dict, tokens_per_step: int) -> Any:
    """One step's message: up to tokens_per_step tokens for every running request; finished ones leave."""
    from sglang.srt.managers.io_struct import BatchTokenIDOut

    rids, new_ids, offsets, finished, prompt, completion = [], [], [], [], [], []
    for rid, (req, out) in list(running.items()):
        offset = len(out)
        for _ in range(min(tokens_per_step, req.sampling_params.max_new_tokens - offset)):
            out.append(300 + (len(out) * 7919 + len(rid)) % 1000)  # ordinary tokens, no EOS
        done = len(out) >= req.sampling_params.max_new_tokens
        rids.append(rid)
        offsets.append(offset)
        new_ids.append(out[offset:])
        finished.append({"type": "length", "length": len(out)} if done else None)
        prompt.append(len(req.input_ids))
        completion.append(len(out))
        if done:
            del running[rid]
    n = len(rids)
    return BatchTokenIDOut(
        rids=rids,
        output_ids=new_ids,
        output_offsets=offsets,
        finished_reasons=finished,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=[0] * n,
        skip_special_tokens=[True] * n,
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[False] * n,
        output_token_logprobs=[None] * n,
        output_top_logprobs=[None] * n,
        spec_verify_ct=[0] * n,
    )


def serve(step_s: float, tokens_per_step: int, server_flags: list[str]) -> None:
    """launch_server with the paced stand-in in place of the scheduler processes."""
    from sglang.srt.entrypoints import engine
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    def start_stand_in(server_args, port_args, ctx, subprocesses) -> list:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=paced_scheduler, args=(server_args, port_args, step_s, tokens_per_step, writer), name="paced-scheduler"
        )
        proc.start()
        writer.close()
        subprocesses.add(proc)
        return [reader]

    engine.start_scheduler_side = start_stand_in
    launch_server(prepare_server_args(server_flags))


# ---------------------------------------------------------------------------- client side
def cpu_seconds(pid: int) -> float:
    """CPU time of a live process's threads, to the nanosecond (Linux /proc/PID/task/*/schedstat;
    /proc/PID/stat counts in 10 ms ticks, too coarse for short runs)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return total / 1e9


def pipeline_cpu(server) -> tuple[float, float]:
    """CPU seconds so far of the HTTP process and of the server's other processes but the
    stand-in (the detokenizer; the resource tracker is idle)."""
    stand_in = requests.get(f"{server.base_url}/get_server_info", timeout=30).json()["internal_states"][0]["stand_in_pid"]
    others = sum(cpu_seconds(pid) for pid in descendant_pids(server.pid) if pid != stand_in)
    return cpu_seconds(server.pid), others


def measure(server, args: argparse.Namespace, concurrency: int, bench_flags: list[str]) -> dict[str, Any]:
    num_prompts = args.num_prompts if concurrency > 1 else max(1, args.num_prompts // 16)
    bench_args = bench_serving_parser().parse_args(
        [
            "--base-url",
            server.base_url,
            "--dataset-name",
            "random",
            "--num-prompts",
            str(num_prompts),
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
            "--random-range-ratio",
            "1",
            "--max-concurrency",
            str(concurrency),
            *bench_flags,
        ]
    )
    before = pipeline_cpu(server)
    metrics = run_benchmark(bench_args)
    after = pipeline_cpu(server)
    tokens = metrics["total_output_tokens"]
    return {
        "concurrency": concurrency,
        "step_ms": args.step_ms,
        "tokens_per_step": args.tokens_per_step,
        "ideal_tok_s": round(concurrency * args.tokens_per_step / args.step_ms * 1e3),
        "output_tok_s": round(metrics["output_throughput"]),
        "mean_ttft_ms": round(metrics["mean_ttft_ms"], 2),
        "median_tpot_ms": round(metrics["median_tpot_ms"], 3),
        "http_cpu_us_per_token": round((after[0] - before[0]) / tokens * 1e6, 1),
        "detokenizer_cpu_us_per_token": round((after[1] - before[1]) / tokens * 1e6, 1),
        "client_cpu_us_per_token": round(metrics["client_cpu_us_per_output_token"], 1),
        "client_cpu_fraction": round(metrics["client_cpu_fraction"], 2),
        "completed": metrics["completed"],
        "num_prompts": num_prompts,
    }


def main() -> None:
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=0.6, help="the stand-in's decode step")
    parser.add_argument(
        "--tokens-per-step",
        type=int,
        default=1,
        help="new tokens per request per step (a speculative cycle's accepted drafts + 1)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--num-prompts", type=int, default=256, help="per concurrency above 1 (1/16 of it at 1)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--model-path", default="SmolLM2-135M-Instruct", help="its tokenizer is the server's")
    parser.add_argument("--result-file", help="append one JSON line per concurrency")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process itself
    args, bench_flags = parser.parse_known_args(sys.argv[1:split])
    server_flags = sys.argv[split + 1 :]
    if args.serve:
        serve(args.step_ms / 1e3, args.tokens_per_step, server_flags)
        return
    if args.tokens_per_step < 1:
        parser.error(f"--tokens-per-step must be at least 1, got {args.tokens_per_step}")
    launcher = [
        os.path.abspath(__file__),
        "--serve",
        "--step-ms",
        str(args.step_ms),
        "--tokens-per-step",
        str(args.tokens_per_step),
        "--",
    ]
    server = popen_launch_server(args.model_path, ["--device", "cpu", *server_flags], launcher=launcher)
    try:
        for concurrency in args.concurrency:
            row = measure(server, args, concurrency, bench_flags)
            print(json.dumps(row), flush=True)
            if args.result_file:
                with open(args.result_file, "a") as f:
                    f.write(json.dumps(row) + "\n")
    finally:
        kill_server(server)


if __name__ == "__main__":
    main()
