"""When each scheduler process last finished an iteration, for /health.

A scheduler stores time.monotonic() (CLOCK_MONOTONIC: one clock for every process of the
machine) in its own memory-mapped 8-byte file in the server's run directory after every
iteration; an idle scheduler still finishes one every 0.1 s (it polls its socket), so a stale
time means a scheduler that is stuck (a hung step, a stopped process). The HTTP process reads
the files; ranks on other nodes are seen through the node-0 ranks they block.
"""

from __future__ import annotations

import glob
import mmap
import os
import struct
import time

_PREFIX = "heartbeat-"
_FORMAT = "d"
_SIZE = struct.calcsize(_FORMAT)


class IterationHeartbeat:
    """The scheduler side: `beat()` after each iteration (one 8-byte store, no syscall)."""

    def __init__(self, run_dir: str, name: str):
        path = os.path.join(run_dir, _PREFIX + name)
        tmp = path + ".new"
        with open(tmp, "wb") as f:
            f.write(struct.pack(_FORMAT, time.monotonic()))
        os.replace(tmp, path)  # a reader never sees a short file
        self._file = open(path, "r+b")  # noqa: SIM115  (mapped for the process's lifetime)
        self._map = mmap.mmap(self._file.fileno(), _SIZE)

    def beat(self) -> None:
        struct.pack_into(_FORMAT, self._map, 0, time.monotonic())


def stalled_schedulers(run_dir: str, bound_s: float) -> list[tuple[str, float]]:
    """(name, seconds since its last finished iteration) of each scheduler on this node that
    has not finished one for more than bound_s."""
    now = time.monotonic()
    stalled = []
    for path in sorted(glob.glob(os.path.join(glob.escape(run_dir), _PREFIX + "*"))):
        if path.endswith(".new"):
            continue
        with open(path, "rb") as f:
            (last,) = struct.unpack(_FORMAT, f.read(_SIZE))
        if now - last > bound_s:
            stalled.append((os.path.basename(path)[len(_PREFIX) :], now - last))
    return stalled
