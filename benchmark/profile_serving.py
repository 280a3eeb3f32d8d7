"""Profile a server's iterations while it serves a workload (the scheduler's /start_profile).

    python benchmark/profile_serving.py --model-path M --delay 1.0 --num-steps 200 \\
        --dataset-name random --random-input-len 256 --random-output-len 256 --num-prompts 256 \\
        --max-concurrency 32 -- --speculative-algorithm NEXTN --speculative-num-steps 3

Launches one server, runs the workload once unrecorded (kernels compile), then again and,
--delay seconds into it, profiles --num-steps forward iterations (fewer when the workload ends
first). Prints the workload's
metrics, the iterations' timeline per rank (trace_summary.py: device busy and idle time, CUDA
calls per iteration) and the host ops that took the most time. Where benchmark/profile_engine.py
profiles one steady batch, this sees what serving adds: arrivals, prefills between decode
cycles, requests finishing at different steps, streaming. Other flags before `--` are python
-m sglang.bench_serving's; flags after `--` go to the server.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import threading
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_sweep import split_server_argv
from trace_summary import load_events, summarize

from sglang.bench_serving import get_parser as bench_parser
from sglang.bench_serving import run_benchmark
from sglang.test.server_utils import kill_server, popen_launch_server


def wait_for_traces(out_dir: str, timeout_s: float) -> list[str]:
    """The traces the ranks write after the profiler stops (each appears once complete)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        traces = sorted(glob.glob(os.path.join(out_dir, "*.trace.json.gz")))
        if traces and not glob.glob(os.path.join(out_dir, "*.partial.*")):
            return traces
        time.sleep(1.0)
    raise TimeoutError(f"no complete trace in {out_dir} after {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> None:
    argv, server_argv = split_server_argv(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--delay", type=float, default=1.0, help="seconds into the recorded workload before profiling")
    p.add_argument("--num-steps", type=int, default=200, help="forward iterations to profile")
    p.add_argument("--output-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--rows", type=int, default=25, help="rows of the host-time table to print")
    p.add_argument("--launch-timeout", type=float, default=900.0)
    args, bench_argv = p.parse_known_args(argv)
    bench_args = bench_parser().parse_args(bench_argv)
    out_dir = args.output_dir or tempfile.mkdtemp(prefix="profile-serving-")
    server = popen_launch_server(args.model_path, server_argv, timeout=args.launch_timeout)
    try:
        run_args = argparse.Namespace(**{**vars(bench_args), "base_url": server.base_url, "flush_cache": True})
        run_benchmark(argparse.Namespace(**{**vars(run_args), "output_file": None}))

        def start_profile() -> None:
            time.sleep(args.delay)
            body = {"output_dir": out_dir, "num_steps": args.num_steps, "activities": ["CPU", "GPU"]}
            print("start_profile:", requests.post(f"{server.base_url}/start_profile", json=body, timeout=60).text)

        starter = threading.Thread(target=start_profile)
        starter.start()
        run_benchmark(run_args)
        starter.join()
        # Stops a profile that the workload ended before --num-steps iterations ("not running" otherwise).
        print("stop_profile:", requests.post(f"{server.base_url}/stop_profile", timeout=60).text)
        traces = wait_for_traces(out_dir, timeout_s=300)
    finally:
        kill_server(server)
    for path in traces:
        print(f"==== timeline of {path}")
        print(json.dumps(summarize(load_events(path), args.num_steps), indent=1))
    for path in sorted(glob.glob(os.path.join(out_dir, "*.txt"))):
        with open(path) as f:
            host_table = f.read().split("sorted by self_cpu_time_total")[-1]
        print(f"==== host time of {path}\n" + "\n".join(host_table.splitlines()[: args.rows + 4]))


if __name__ == "__main__":
    main()
