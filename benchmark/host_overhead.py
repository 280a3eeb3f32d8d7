"""Host time per decode iteration of the scheduler (a plain step or a speculative cycle), in
this process.

B requests decode together; each `Scheduler.run_iteration` is timed, and so are the phases
inside it: scheduling (`get_next_batch`), the launch without the forward, the model
runner's forward call, the eager forward inside it (`model`: attention metadata and the
model), and processing the previous step (`process`). `host_us` is the iteration without
the eager forward: on CPU the model runs for real, and `host_us` is the scheduler's host
work; on CUDA with graphs nothing runs eagerly, so `host_us` is the whole decode step, waits
for the device included (in `process`).

    python benchmark/host_overhead.py --tiny --batch-sizes 1 32 -- --device cpu --dtype float32
    python benchmark/host_overhead.py --tiny --graph-standin --batch-sizes 1 32 -- --device cpu --dtype float32
    python benchmark/host_overhead.py --config benchmark/configs/smollm2-135m.json --batch-sizes 1 32 -- --cuda-graph-max-bs 32
    python benchmark/host_overhead.py --tiny --batch-sizes 32 --profile 25 -- --device cpu
    python benchmark/host_overhead.py --tiny --batch-sizes 32 --profile 40 --profile-sort cumtime -- --device cpu
    python benchmark/host_overhead.py --tiny-deepseek --graph-standin --batch-sizes 1 32 -- --device cpu \
        --dtype float32 --speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 \
        --speculative-num-draft-tokens 4

`--graph-standin` (CPU) takes the CUDA-graph path of the model runner (graph choice, static
inputs, replay, output copies) with stand-in graphs whose replay does nothing: what is left
is the host work of a graph step, as on CUDA, without the model. Under speculation every
sub-forward's graph is a stand-in (zero logits: every draft is accepted). Flags after `--`
are server flags (e.g. `--disable-overlap-schedule`). The scheduler's request socket is real (nothing
arrives on it); messages to the detokenizer are pickled as its socket would, not sent.

`--count-ops` adds, per iteration, the aten operations that can launch a kernel (views left
out) by where they run: the model's forwards, each speculative program's own work around its
forwards (`DraftLoop`, `VerifyProgram`, `DraftExtendProgram`, and `DecodeCycle`'s own work
around those three), and the rest (`host`). Without
`--graph-standin` the programs run eagerly: their counts are the kernels their CUDA graphs
hold. With it, a program's count is what its graph replay launches eagerly (static-input
copies), and with `host` that makes the iteration's eager launches on CUDA.

One JSON line per batch size; each figure is the median over --repeats runs of the mean per
iteration, in microseconds (`best_host_us`: the smallest run's, steadier on a shared
machine). The phase timers are included: about 7 us per iteration with the thread clock,
well under 1 us with the wall clock.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pickle
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Optional
from unittest import mock

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import dummy_model_dir, synthetic_prompts

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.cuda_graph_runner import CapturedMode, CudaGraphRunner, ModeKey
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import PortArgs, ServerArgs, prepare_server_args
from sglang.srt.speculative.draft_extend_program import DraftExtendProgram
from sglang.srt.speculative.draft_loop import DraftLoop
from sglang.srt.speculative.verify_program import VerifyProgram

SUB_PROGRAMS = (DraftLoop, VerifyProgram, DraftExtendProgram)

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "smollm2-135m.json")
PHASES = ("schedule", "launch", "forward", "model", "process")


class PicklingDetokenizer:
    """Stands in for the detokenizer socket: pays the pickling that send_pyobj does."""

    def send_pyobj(self, msg) -> None:
        pickle.dumps(msg, pickle.DEFAULT_PROTOCOL)


class PhaseTimer:
    """Accumulates the clock's seconds per phase of the wrapped callables. The profiler, when
    set, is paused inside the model's forward (its rows are then host work only)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self.profiler: Optional[cProfile.Profile] = None

    def wrap(self, phase: str, fn: Callable, profiled: bool = True) -> Callable:
        def timed(*args, **kwargs):
            profiler = None if profiled else self.profiler
            if profiler:
                profiler.disable()
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += self.clock() - start
                if profiler:
                    profiler.enable()

        return timed


# Aten ops that only make views (no kernel). Not OpOverload.is_view: that also marks `to`, `copy`
# and `pin_memory` (they may return their input), which copy when they do not.
_VIEW_OPS = {
    "view",
    "_unsafe_view",
    "slice",
    "select",
    "expand",
    "unsqueeze",
    "squeeze",
    "flatten",
    "unflatten",
    "unbind",
    "as_strided",
    "alias",
    "t",
    "transpose",
    "permute",
    "reshape",
    "detach",
    "split",
    "split_with_sizes",
    "narrow",
    "lift_fresh",
}


class OpCounter(TorchDispatchMode):
    """Counts kernel-launching aten operations (views left out) by the part of the iteration that
    issues them: the innermost of the model's forward and a program run by ModelRunner.run; else host."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.counts: dict[str, int] = defaultdict(int)

    def labelled(self, label_of: Callable, fn: Callable) -> Callable:
        """fn, counting what it issues under label_of(its arguments) (None: its caller's part)."""

        def call(*args, **kwargs):
            label = label_of(*args, **kwargs)
            if label:
                self.parts.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                if label:
                    self.parts.pop()

        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in _VIEW_OPS:
            self.counts[self.parts[-1] if self.parts else "host"] += 1
        return func(*args, **(kwargs or {}))


class NullGraph:
    """A CUDA graph's stand-in on CPU whose replay does nothing: the model never runs and the
    logits stay as they are (zero: every sampled token is 0), so a step costs its host work only."""

    def replay(self) -> None:
        pass


def standin_capture(graphs: CudaGraphRunner) -> None:
    """CudaGraphRunner.capture on CPU, with NullGraph graphs and zero outputs: one eager
    warm-up run per mode (its largest key) shapes that mode's output buffers."""
    runner = graphs.model_runner
    for mode_key in {key.mode_key for key in graphs.keys}:
        largest = max((k for k in graphs.keys if k.mode_key == mode_key), key=lambda k: k.num_tokens)
        mode = graphs.modes[mode_key]
        batch = graphs.inputs.padding_batch(largest, mode)
        if mode_key.program is not None:
            warm = mode_key.program(batch, runner.forward_eager)
        else:
            out = runner.forward_eager(batch)
            warm = tuple(t for t in (out.next_token_logits, out.hidden_states) if t is not None)
        graphs.ensure_outputs(largest, warm)
        for buffer, _ in graphs.outputs[mode_key]:
            buffer.zero_()
    graphs.graphs = {key: NullGraph() for key in graphs.keys}


def standin_graph_modes(runner: ModelRunner) -> dict[ModeKey, CapturedMode]:
    """ModelRunner._graph_modes as on CUDA, whatever the device: the modes it was given
    (without prefill graphs, which ServerArgs turns off on CPU)."""
    return runner.captured_modes(None)


def new_scheduler(server_args: ServerArgs, graph_standin: bool) -> Scheduler:
    if not graph_standin:
        return Scheduler(server_args, PortArgs.init_new(server_args), 0, 0, None)
    with (
        mock.patch.object(ModelRunner, "_graph_modes", standin_graph_modes),
        mock.patch.object(CudaGraphRunner, "capture", standin_capture),
    ):
        return Scheduler(server_args, PortArgs.init_new(server_args), 0, 0, None)


def make_scheduler(server_args: ServerArgs, graph_standin: bool, clock: Callable[[], float]) -> tuple[Scheduler, PhaseTimer]:
    """A scheduler whose phases are timed; its request socket is real (nothing arrives)."""
    scheduler = new_scheduler(server_args, graph_standin)
    scheduler.send_to_detokenizer = PicklingDetokenizer()
    timer = PhaseTimer(clock)
    runner = scheduler.runner
    runner.forward = timer.wrap("forward", runner.forward)
    runner.forward_eager = timer.wrap("model", runner.forward_eager, profiled=False)
    scheduler.get_next_batch = timer.wrap("schedule", scheduler.get_next_batch)
    scheduler.launch = timer.wrap("launch", scheduler.launch)
    scheduler.process = timer.wrap("process", scheduler.process)
    return scheduler, timer


def start_decoding(scheduler: Scheduler, batch_size: int, input_len: int, max_new: int, stream: bool, tag: str) -> None:
    """Submit the batch and iterate until every request decodes (prefill done, tokens flowing)."""
    for i, prompt in enumerate(synthetic_prompts(batch_size, input_len)):
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
        scheduler.handle_message(TokenizedGenerateReqInput(f"{tag}-{i}", None, prompt, params, stream=stream))
    while scheduler.waiting or scheduler.chunked_req or len(scheduler.running) < batch_size:
        scheduler.run_iteration()
    for _ in range(3):  # the prefill's tokens arrive; decode steps are in flight
        scheduler.run_iteration()


def drain(scheduler: Scheduler) -> None:
    """Finish every request (abort) so that the next batch size starts from an empty pool."""
    for req in list(scheduler.running):
        req.to_abort = True
    for _ in range(10):
        scheduler.run_iteration()
        if not (scheduler.running or scheduler.in_flight or scheduler.waiting):
            return
    raise RuntimeError("requests did not drain")


def timed_iterations(scheduler: Scheduler, timer: PhaseTimer, iterations: int) -> dict[str, float]:
    """Microseconds per iteration, in total and per phase (none of the requests may finish)."""
    running = len(scheduler.running)
    timer.seconds.clear()
    start = timer.clock()
    for _ in range(iterations):
        scheduler.run_iteration()
    total = timer.clock() - start
    assert len(scheduler.running) == running, "a request finished or was retracted while timed"
    row = {"us_per_iter": total}
    row.update({f"{p}_us": timer.seconds[p] for p in PHASES})
    row["host_us"] = total - timer.seconds["model"]
    row["launch_us"] -= timer.seconds["forward"]  # the launch without the forward call
    row["forward_us"] -= timer.seconds["model"]  # the forward call without the eager forward
    return {k: v / iterations * 1e6 for k, v in row.items()}


def count_ops(scheduler: Scheduler, iterations: int) -> dict[str, float]:
    """Kernel-launching ops per iteration by part (OpCounter)."""
    counter = OpCounter()
    runners = [scheduler.runner] + ([scheduler.spec_worker.draft_runner] if scheduler.spec_worker else [])
    program_name = lambda fb, program=None, **_: type(program).__name__ if program else None
    own_name = lambda program, *_, **__: type(program).__name__
    with contextlib.ExitStack() as patches:
        for cls in SUB_PROGRAMS:  # DecodeCycle calls them directly, not through ModelRunner.run
            patches.enter_context(mock.patch.object(cls, "__call__", counter.labelled(own_name, cls.__call__)))
        for r in runners:
            model = counter.labelled(lambda fb, **_: "model", r.forward_eager)
            patches.enter_context(mock.patch.object(r, "run", counter.labelled(program_name, r.run)))
            patches.enter_context(mock.patch.object(r, "forward_eager", model))
        with counter:
            for _ in range(iterations):
                scheduler.run_iteration()
    return {part: round(n / iterations, 1) for part, n in sorted(counter.counts.items())}


def bench(scheduler: Scheduler, timer: PhaseTimer, args: argparse.Namespace, batch_size: int) -> dict:
    steps = args.warmup + (args.repeats + args.count_ops) * args.iterations + 8
    max_new = steps * scheduler.worker.max_tokens_per_step()  # a speculative cycle emits several
    need = batch_size * (args.input_len + max_new)
    if need > scheduler.allocator.size:  # else requests are retracted while timed
        raise SystemExit(
            f"batch {batch_size} needs {need} KV slots, the pool has {scheduler.allocator.size}: lower --iterations or --repeats"
        )
    start_decoding(scheduler, batch_size, args.input_len, max_new, args.stream, f"bs{batch_size}")
    timed_iterations(scheduler, timer, args.warmup)
    profiler = timer.profiler = cProfile.Profile() if args.profile else None
    runs = []
    for _ in range(args.repeats):
        if profiler:
            profiler.enable()
        runs.append(timed_iterations(scheduler, timer, args.iterations))
        if profiler:
            profiler.disable()
    timer.profiler = None
    ops = count_ops(scheduler, args.iterations) if args.count_ops else None
    drain(scheduler)
    if profiler:
        order = {"tottime": "own time", "cumtime": "time with callees"}[args.profile_sort]
        print(f"---- cProfile without the forward, batch size {batch_size}, by {order}", file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats(args.profile_sort).print_stats(args.profile)
    row = {"batch_size": batch_size, "iterations": args.iterations, "repeats": args.repeats}
    row.update({k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]})
    row["best_host_us"] = round(min(r["host_us"] for r in runs), 1)
    if ops is not None:
        row["ops_per_iter"] = ops
    return row


def main() -> None:
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    engine_argv = sys.argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--tiny", action="store_true", help="a tiny random Llama (2 layers, 384-token vocabulary)")
    source.add_argument("--tiny-deepseek", action="store_true", help="a tiny random DeepSeek-V3 with its MTP layer (for NEXTN)")
    source.add_argument("--model-path", help="a real model")
    source.add_argument("--config", default=DEFAULT_CONFIG, help="HF config.json: random weights of that shape")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=200, help="timed decode iterations per run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--stream", action="store_true", help="streaming requests (every step is sent)")
    parser.add_argument("--profile", type=int, default=0, help="print this many cProfile rows (stderr)")
    parser.add_argument("--profile-sort", choices=("tottime", "cumtime"), default="tottime", help="order of the cProfile rows")
    parser.add_argument("--graph-standin", action="store_true", help="CPU: the CUDA-graph path, graphs that do nothing")
    parser.add_argument("--count-ops", action="store_true", help="kernel-launching ops per iteration, by part")
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default=None,
        help="wall: perf_counter; thread: this thread's CPU time, blind to other processes on a busy machine "
        "(default: thread on CPU, wall on CUDA)",
    )
    args = parser.parse_args(sys.argv[1:split])

    extra: list[str] = []
    if args.tiny:
        from sglang.test.tiny_models import make_tiny_llama

        model_path = make_tiny_llama(tempfile.mkdtemp(prefix="host-overhead-"), max_position_embeddings=1 << 14)
    elif args.tiny_deepseek:
        from sglang.test.tiny_deepseek import make_tiny_deepseek_v3

        model_path = make_tiny_deepseek_v3(tempfile.mkdtemp(prefix="host-overhead-"), max_position_embeddings=1 << 14)
    elif args.model_path:
        model_path = args.model_path
    else:
        model_path, extra = dummy_model_dir(args.config), ["--load-format", "dummy"]
    running = max(args.batch_sizes)
    server_args = prepare_server_args(["--model-path", model_path, *extra, *engine_argv])
    per_step = server_args.speculative_num_draft_tokens if server_args.speculative_algorithm else 1
    tokens = running * (args.input_len + (args.warmup + (args.repeats + args.count_ops) * args.iterations + 16) * per_step)
    extra += ["--max-running-requests", str(running), "--max-total-tokens", str(tokens)]
    server_args = prepare_server_args(["--model-path", model_path, *extra, *engine_argv])
    clock = args.clock or ("thread" if server_args.device == "cpu" else "wall")
    clock_fn = time.thread_time if clock == "thread" else time.perf_counter
    scheduler, timer = make_scheduler(server_args, args.graph_standin, clock_fn)
    for bs in args.batch_sizes:
        row = bench(scheduler, timer, args, bs)
        row.update(
            model="tiny" if args.tiny else "tiny-deepseek" if args.tiny_deepseek else args.model_path or args.config,
            device=scheduler.server_args.device,
            overlap=scheduler.overlap,
            cuda_graph="standin" if args.graph_standin else scheduler.runner.graph_runner is not None,
            stream=args.stream,
            clock=clock,
            engine_args=" ".join(engine_argv),
        )
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
