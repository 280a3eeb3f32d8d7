"""Profile an engine's iterations with the torch profiler (the scheduler's /start_profile).

Runs a warm-up request, then profiles --num-steps forward iterations of one batch (all of its
iterations if it ends sooner), waits for the ranks to write their files, and prints each
rank's op tables (device time, then host time) and its timeline summary (device busy
and idle time, CUDA calls per iteration: trace_summary.py); the traces stay in --output-dir.

    python benchmark/profile_engine.py --model-path bench_models/deepseek-v3-mtp --batch-size 1 \\
        -- --disable-cuda-graph --speculative-algorithm NEXTN
    python benchmark/profile_engine.py --config benchmark/configs/llama-3.1-8b.json \\
        --draft-config benchmark/configs/llama-3.1-8b-eagle.json -- --speculative-algorithm EAGLE

Flags after `--` go to the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import add_model_source_args, model_source_flags, synthetic_prompts
from trace_summary import load_events, summarize

import sglang as sgl
from sglang.srt.server_args import prepare_server_args


def wait_for_profiles(out_dir: str, timeout_s: float = 600.0) -> None:
    """Until the ranks' files are complete: a table (.txt) is there and no file is still
    being written (`<stem>.partial.<suffix>`, renamed when complete)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = os.listdir(out_dir)
        if any(n.endswith(".txt") for n in names) and not any(".partial." in n for n in names):
            return
        time.sleep(0.5)
    raise TimeoutError(f"no complete profile in {out_dir} after {timeout_s} s")


def main() -> None:
    argv = sys.argv[1:]
    engine_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source_args(parser)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-steps", type=int, default=20, help="forward iterations to profile")
    parser.add_argument("--output-dir", default=None, help="default: a new temporary directory")
    parser.add_argument("--rows", type=int, default=30, help="rows of each table to print")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    server_args = prepare_server_args([*model_source_flags(parser, args), *engine_argv])
    out_dir = args.output_dir or tempfile.mkdtemp(prefix="profile-")
    prompts = synthetic_prompts(args.batch_size, args.input_len)
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    with sgl.Engine(**vars(server_args)) as engine:
        engine.generate(input_ids=prompts, sampling_params=params)  # warm-up (kernel compilation)
        engine.start_profile(output_dir=out_dir, num_steps=args.num_steps)
        engine.generate(input_ids=prompts, sampling_params=params)
        with contextlib.suppress(RuntimeError):  # the profiler stopped by itself after --num-steps
            engine.stop_profile()
        wait_for_profiles(out_dir)  # the ranks write them on threads that the engine's shutdown ends
    for path in sorted(glob.glob(os.path.join(out_dir, "*.txt"))):
        print(f"==== {path}")
        with open(path) as f:
            tables = f.read().split("sorted by ")[1:]
        for table in tables:
            print("sorted by " + "\n".join(table.splitlines()[: args.rows + 4]))
    for path in sorted(glob.glob(os.path.join(out_dir, "*.trace.json.gz"))):
        print(f"==== timeline of {path}")
        print(json.dumps(summarize(load_events(path), args.num_steps), indent=1))


if __name__ == "__main__":
    main()
