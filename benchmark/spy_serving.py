"""Where each server process spends its CPU while serving: py-spy samples of the HTTP process
(FastAPI and the TokenizerManager), the scheduler of each rank and the detokenizer, taken
during a bench_serving workload.

    pip install py-spy
    python benchmark/spy_serving.py --model-path M --duration 8 --dataset-name random \\
        --random-input-len 256 --random-output-len 256 --num-prompts 512 --max-concurrency 32 \\
        -- --cuda-graph-max-bs 32

One server: the workload once unrecorded (kernels compile, allocators grow), then again while
`py-spy record --subprocesses --nonblocking` samples every process of the server for
--duration seconds, --delay seconds after the workload starts (so that the sampled window
holds steady decoding rather than the first prefills). Per process, named by its role, the
share of its samples spent in each source line (own time; a call into C counts on the line that
makes it) and in each function with its callees. py-spy counts a thread only while it runs:
a process waiting in a poll or a sleep gets few samples, one spinning on a device
synchronization gets them all (on the line that waits). `--raw-output` keeps py-spy's samples
(one stack per line, its count last). Flags after `--` go to the server; the other flags are
python -m sglang.bench_serving's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_sweep import split_server_argv

from sglang.bench_serving import get_parser as bench_parser
from sglang.bench_serving import run_benchmark
from sglang.test.server_utils import kill_server, popen_launch_server

# A subprocess's frame in py-spy's raw output: `process PID:"COMMAND LINE"` (the line may
# itself hold semicolons, the frame separator); a child's stack starts with its parents'.
_PROCESS_FRAME = re.compile(r'process (\d+):"([^"]*)";?')
# The functions each process of the server enters first, by role.
_ROLES = (("run_scheduler_process", "scheduler"), ("run_detokenizer_process", "detokenizer"))


@dataclass
class ProcessSamples:
    pid: int
    command: str
    samples: int = 0
    own: Counter = field(default_factory=Counter)  # "function (file:line)" -> samples with it on top
    within: Counter = field(default_factory=Counter)  # "function (file)" -> samples with it anywhere in the stack

    @property
    def role(self) -> str:
        """The process's part in the server, from the entry function its stacks pass through."""
        for function, role in _ROLES:
            if any(frame.startswith(function + " ") for frame in self.within):
                return role
        return "HTTP server" if "sglang" in self.command else "other"


def parse_raw(lines: Iterable[str]) -> dict[int, ProcessSamples]:
    """py-spy's raw (collapsed-stack) output, with --subprocesses, by process."""
    processes: dict[int, ProcessSamples] = {}
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        owners = list(_PROCESS_FRAME.finditer(stack))
        pid, command = (int(owners[-1].group(1)), owners[-1].group(2)) if owners else (0, "")
        frames = [f for f in stack[owners[-1].end() :].split(";") if f] if owners else stack.split(";")
        process = processes.setdefault(pid, ProcessSamples(pid, command))
        n = int(count)
        process.samples += n
        if frames:
            process.own[frames[-1]] += n
        for function in {re.sub(r":\d+\)$", ")", f) for f in frames}:
            process.within[function] += n
    return processes


# Functions with callees in at least this share of a process's samples are its entry chain
# (process start, event loop): left out of the table.
_ENTRY_CHAIN_SHARE = 0.98


def report(processes: dict[int, ProcessSamples], rows: int) -> str:
    """Per process (most samples first): its role, then the top source lines by own samples and
    the top functions with their callees (below the entry chain), each as a share of the
    process's samples."""
    out = []
    for p in sorted(processes.values(), key=lambda p: -p.samples):
        below_entry = Counter({f: n for f, n in p.within.items() if n < _ENTRY_CHAIN_SHARE * p.samples})
        out.append(f"== {p.role} (pid {p.pid}): {p.samples} samples")
        for title, counts in (("own time, by line", p.own), ("with callees, by function", below_entry)):
            out.append(f"-- {title}")
            out += [f"{100 * n / p.samples:6.1f}%  {name}" for name, n in counts.most_common(rows)]
    return "\n".join(out)


def record(py_spy: str, pid: int, duration: float, rate: int, raw_path: str) -> None:
    """Sample pid and its descendants for `duration` seconds into raw_path (py-spy's errors
    raise, with its output)."""
    cmd = [py_spy, "record", "--subprocesses", "--nonblocking", "--format", "raw", "--rate", str(rate)]
    cmd += ["--duration", str(max(1, round(duration))), "--pid", str(pid), "--output", raw_path]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60)
    if done.returncode != 0 or not os.path.exists(raw_path):
        raise RuntimeError(f"py-spy failed (rc {done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")


def main(argv: Optional[list[str]] = None) -> str:
    argv, server_argv = split_server_argv(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--duration", type=float, default=8.0, help="seconds of sampling")
    p.add_argument("--delay", type=float, default=3.0, help="seconds into the recorded workload before sampling starts")
    p.add_argument("--rate", type=int, default=250, help="samples per second")
    p.add_argument("--rows", type=int, default=25, help="rows of each table")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy", help="the py-spy executable")
    p.add_argument("--raw-output", help="keep py-spy's samples here")
    p.add_argument("--launch-timeout", type=float, default=900.0)
    args, bench_argv = p.parse_known_args(argv)
    if not shutil.which(args.py_spy) and not os.path.isfile(args.py_spy):
        p.error(f"--py-spy {args.py_spy!r} not found (pip install py-spy)")
    bench_args = bench_parser().parse_args(bench_argv)
    raw_path = args.raw_output
    if raw_path is None:
        fd, raw_path = tempfile.mkstemp(prefix="spy-", suffix=".txt")
        os.close(fd)
    server = popen_launch_server(args.model_path, server_argv, timeout=args.launch_timeout)
    try:
        run_args = argparse.Namespace(**{**vars(bench_args), "base_url": server.base_url})
        run_benchmark(run_args)  # warm-up
        load = threading.Thread(target=run_benchmark, args=(run_args,))
        load.start()
        load.join(args.delay)
        if not load.is_alive():
            raise RuntimeError(f"the workload ended within --delay {args.delay} s: raise --num-prompts")
        record(args.py_spy, server.pid, args.duration, args.rate, raw_path)
        if not load.is_alive():
            print(f"warning: the workload ended before the {args.duration} s of sampling did", file=sys.stderr)
        load.join()
    finally:
        kill_server(server)
    with open(raw_path) as f:
        result = report(parse_raw(f), args.rows)
    print(result, flush=True)
    return result


if __name__ == "__main__":
    main()
