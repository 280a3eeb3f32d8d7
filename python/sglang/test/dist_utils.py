"""Run a function on N local processes joined by a gloo process group (CPU tests)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang.test.server_utils import find_free_port


def _entry(rank: int, world: int, port: int, done_dir: str, fn: Callable[..., None], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        Path(done_dir, str(rank)).touch()
        # Every rank done before any tears its groups down: gloo aborts the process (SIGABRT,
        # "terminate called without an active exception") when a peer leaves mid-teardown.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Call fn(rank, world, *args) on `world` spawned processes; raises if any of them fails.

    fn must be importable (a module-level function) and args picklable. A rank killed by a
    signal after every rank's fn returned (gloo's teardown on a loaded machine) is not a failure
    of fn; a Python exception or a signal before that is.
    """
    with tempfile.TemporaryDirectory() as done_dir:
        try:
            mp.spawn(_entry, args=(world, find_free_port(), done_dir, fn, args), nprocs=world)
        except mp.ProcessExitedException:
            if len(os.listdir(done_dir)) < world:
                raise
