"""Log the Triton kernels a process compiles (or loads from Triton's on-disk cache) while it serves.

Each new specialization of a kernel (a new constexpr value, or an int argument that turns 1 or
a multiple of 16, or a pointer that turns 16-byte aligned) compiles on first use, and the batch
that met it waits: seconds for a large kernel. Startup (CUDA-graph capture, warm-up) compiles
most variants; any compile after it is logged as a warning, so that stalls in serving show up
in the log with the kernel and the argument types that caused them.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class TritonCompileLog:
    def __init__(self) -> None:
        self.serving = False
        self.count = 0
        self.seconds = 0.0
        self._started: dict[object, float] = {}

    def install(self) -> bool:
        """Hook Triton's JIT (False where Triton is missing)."""
        try:
            from triton import knobs
        except ImportError:
            return False
        knobs.runtime.jit_cache_hook = self._before_compile
        knobs.runtime.jit_post_compile_hook = self._after_compile
        return True

    def start_serving(self) -> None:
        logger.info("Triton compiled %d kernel variants during startup in %.1f s", self.count, self.seconds)
        self.serving = True

    def _before_compile(self, *, key, **_) -> bool:
        self._started[key] = time.perf_counter()
        return False  # False: go on and compile

    def _after_compile(self, *, key, fn, compile, **_) -> None:
        seconds = time.perf_counter() - self._started.pop(key, time.perf_counter())
        self.count += 1
        self.seconds += seconds
        if self.serving:
            logger.warning("Triton compiled %s while serving: %.2f s", _describe(fn, compile), seconds)


def _describe(fn, compile: dict) -> str:
    """kernel(constexpr=value, ..., aligned=[pointer and integer arguments specialized on 16])."""
    names = fn.jit_function.arg_names
    constants = [f"{names[path[0]]}={value}" for path, value in compile["constants"].items() if len(path) == 1]
    attrs = compile["configs"][0] if compile["configs"] else {}
    aligned = [names[path[0]] for path in attrs if len(path) == 1]
    return f"{fn.name}({', '.join(constants)}, aligned={aligned})"
