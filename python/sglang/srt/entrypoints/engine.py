"""The offline Engine, and the process launch shared with the HTTP server.

Processes: this process runs the TokenizerManager; the scheduler side
(the scheduler ranks, with a DataParallelController in front of them when --dp-size > 1)
and the DetokenizerManager are spawned children that die with this process.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import inspect
import logging
import multiprocessing as mp
import shutil
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Optional, TypeVar, Union

from sglang.srt.managers.data_parallel_controller import start_scheduler_side
from sglang.srt.managers.io_struct import ProfileReq, SchedulerReady
from sglang.srt.managers.tokenizer_manager import GenerateReqInput, TokenizerManager, final_output, incremental_outputs
from sglang.srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)


class Subprocesses:
    """The children of one server/Engine: supervised while running, ended on shutdown."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir  # holds the ipc sockets; removed on shutdown
        self.procs: list[BaseProcess] = []
        self._stop_r, self._stop_w = mp.Pipe(duplex=False)
        self._monitor: Optional[threading.Thread] = None
        self._stopping = False

    def add(self, proc: BaseProcess) -> None:
        self.procs.append(proc)

    def start_monitor(self, on_death: Callable[[str], None]) -> None:
        """Call on_death(reason) once, from a thread, if any child exits before shutdown."""

        def watch() -> None:
            sentinels = {p.sentinel: p for p in self.procs}
            ready = wait(list(sentinels) + [self._stop_r])
            if self._stopping or self._stop_r in ready:
                return
            proc = sentinels[ready[0]]
            # The sentinel closes as the child dies, a moment before waitpid reports its status.
            deadline = time.monotonic() + 1.0
            while proc.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.01)
            on_death(f"Subprocess {proc.name} (pid {proc.pid}) {describe_exit(proc.exitcode)}")

        self._monitor = threading.Thread(target=watch, daemon=True, name="subprocess-monitor")
        self._monitor.start()

    def shutdown(self) -> None:
        from sglang.srt.utils.process import kill_process_trees

        if self._stopping:
            return
        self._stopping = True
        self._stop_w.send(None)
        kill_process_trees([proc.pid for proc in self.procs if proc.pid is not None])
        for proc in self.procs:
            proc.join(5)
        shutil.rmtree(self.run_dir, ignore_errors=True)


T = TypeVar("T")


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


async def _next_or_none(outputs: AsyncIterator[Any]) -> Any:
    """The next item of `outputs`, None at its end (outputs are never None)."""
    return await anext(outputs, None)


def describe_exit(exitcode: Optional[int]) -> str:
    """How a child ended: multiprocessing's exitcode is -N when signal N killed it."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"exited unexpectedly: killed by {name}"
    return f"exited unexpectedly with code {exitcode}"


def _launch_subprocesses(server_args: ServerArgs) -> tuple[TokenizerManager, dict[str, Any], Subprocesses]:
    """Start the detokenizer and the scheduler side, and wait until every scheduler is ready.
    Raises RuntimeError with the scheduler's error text if startup fails."""
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process

    server_args.check_launchable()
    port_args = PortArgs.init_new(server_args)
    # Bind our sockets before the children connect.
    tokenizer_manager = TokenizerManager(server_args, port_args)
    ctx = mp.get_context("spawn")
    subprocesses = Subprocesses(port_args.run_dir)
    try:
        detokenizer = ctx.Process(target=run_detokenizer_process, args=(server_args, port_args), name="detokenizer")
        detokenizer.start()
        subprocesses.add(detokenizer)
        readers = start_scheduler_side(server_args, port_args, ctx, subprocesses)
        infos = [_wait_ready(reader) for reader in readers]
    except BaseException:
        subprocesses.shutdown()
        tokenizer_manager.close()
        raise
    tokenizer_manager.set_scheduler_info(infos[0])
    scheduler_info = {
        "max_total_num_tokens": infos[0].max_total_num_tokens,
        "max_req_input_len": infos[0].max_req_input_len,
        "context_len": infos[0].context_len,
    }
    return tokenizer_manager, scheduler_info, subprocesses


def run_worker_node(server_args: ServerArgs) -> None:
    """--node-rank > 0: run this node's scheduler ranks (no HTTP, no tokenizer) until one of
    them exits or this process is told to stop; node 0 serves the requests."""

    server_args.check_launchable()
    port_args = PortArgs.init_new(server_args)
    subprocesses = Subprocesses(port_args.run_dir)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        readers = start_scheduler_side(server_args, port_args, mp.get_context("spawn"), subprocesses)
        for reader in readers:
            _wait_ready(reader)
        logger.info("Node %d: %d scheduler rank(s) ready; serving through node 0.", server_args.node_rank, len(readers))
        subprocesses.start_monitor(lambda reason: (logger.error("%s; stopping this node.", reason), stopped.set()))
        while not stopped.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        subprocesses.shutdown()


def _wait_ready(reader: Connection) -> SchedulerReady:
    try:
        ready = reader.recv()
    except EOFError:
        raise RuntimeError("A scheduler process exited during startup; see its log above") from None
    if ready.error is not None:
        raise RuntimeError(f"Scheduler (dp {ready.dp_rank}, tp {ready.tp_rank}) failed to start: {ready.error}")
    return ready


class Engine:
    """Offline inference on the same processes and code path as the HTTP server.

    Engine(model_path=..., **server_args); generate(...) returns SGLang-shaped dicts. Requests
    run on the Engine's own event loop in a daemon thread: generate() waits for them, and
    async_generate() awaits them from any caller's loop.
    """

    def __init__(self, **kwargs: Any):
        self.server_args = ServerArgs(**kwargs)
        logging.basicConfig(level=self.server_args.log_level.upper(), format="[%(asctime)s] %(message)s")
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="engine-loop")
        self._loop_thread.start()
        self._closed = False
        try:
            self.tokenizer_manager, self.scheduler_info, self._subprocesses = _launch_subprocesses(self.server_args)
        except BaseException:
            self._stop_loop()
            self.loop.close()
            raise
        self._subprocesses.start_monitor(self._on_subprocess_death)
        atexit.register(self.shutdown)

    def _on_subprocess_death(self, reason: str) -> None:
        logger.error("%s; the Engine can no longer generate.", reason)
        self.tokenizer_manager.mark_dead(reason)

    def _run(self, coro: Awaitable[T]) -> T:
        """Run `coro` on the Engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(_awaited(coro), self.loop).result()

    async def _await(self, coro: Awaitable[T]) -> T:
        """Run `coro` on the Engine's loop; await its result on the caller's loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_awaited(coro), self.loop))

    def generate(
        self,
        prompt: Union[str, list[str], None] = None,
        sampling_params: Union[dict[str, Any], list[dict[str, Any]], None] = None,
        input_ids: Union[list[int], list[list[int]], None] = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        stream: bool = False,
        logprob_start_len: int = -1,
    ) -> Union[dict[str, Any], list[dict[str, Any]], Iterator[dict[str, Any]]]:
        """One dict per prompt (a list for a list of prompts, or for n > 1 samples: prompt i's
        at i*n ..); an iterator of chunks when streaming (n > 1: each sample's chunks, marked
        with its "index"). Invalid requests raise ValueError."""
        outputs = self._outputs(prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, stream, logprob_start_len)
        if stream:
            return self._iterate(outputs)
        return self._run(final_output(outputs))

    async def async_generate(
        self, *args: Any, **kwargs: Any
    ) -> Union[dict[str, Any], list[dict[str, Any]], AsyncIterator[dict[str, Any]]]:
        """generate() from the caller's event loop, with generate()'s arguments: awaited, the
        output(s); when streaming, an async iterator of chunks (closing it early aborts the request)."""
        bound = inspect.signature(self.generate).bind(*args, **kwargs)
        bound.apply_defaults()
        outputs = self._outputs(**bound.arguments)
        if bound.arguments["stream"]:
            return self._aiterate(outputs)
        return await self._await(final_output(outputs))

    def _outputs(
        self, prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, stream, logprob_start_len
    ) -> AsyncIterator[Any]:
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            stream=stream,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len,
        )
        outputs = self.tokenizer_manager.generate_request(obj)
        if stream and self.server_args.stream_output:
            outputs = incremental_outputs(outputs)
        return outputs

    def _iterate(self, outputs: AsyncIterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        try:
            while (chunk := self._run(_next_or_none(outputs))) is not None:
                yield chunk
        finally:  # an abandoned stream aborts its request
            if not self._closed:
                self._run(outputs.aclose())

    async def _aiterate(self, outputs: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        try:
            while (chunk := await self._await(_next_or_none(outputs))) is not None:
                yield chunk
        finally:  # an abandoned stream aborts its request
            if not self._closed:
                await self._await(outputs.aclose())

    def get_server_info(self) -> dict[str, Any]:
        states = self._run(self.tokenizer_manager.get_internal_state())
        return {**dataclasses.asdict(self.server_args), **self.scheduler_info, "internal_states": states}

    def flush_cache(self) -> bool:
        return self._run(self.tokenizer_manager.flush_cache())

    def start_profile(
        self, output_dir: Optional[str] = None, num_steps: Optional[int] = None, activities: Optional[list[str]] = None
    ) -> None:
        """Torch profiler on every rank; traces are written on stop_profile (or after num_steps)."""
        self._profile(ProfileReq("start", output_dir, num_steps, activities))

    def stop_profile(self) -> None:
        self._profile(ProfileReq("stop"))

    def _profile(self, req: ProfileReq) -> None:
        ok, message = self._run(self.tokenizer_manager.profile(req))
        if not ok:
            raise RuntimeError(message)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self._subprocesses.shutdown()
        self._stop_loop()
        self.tokenizer_manager.close()
        self.loop.close()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
