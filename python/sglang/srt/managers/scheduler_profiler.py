"""The torch profiler on a scheduler rank (SGLang's /start_profile and /stop_profile).

Each rank profiles itself and writes, after stop (on a thread of its own), `<time>-<rank>.trace.json.gz` (open it in
Perfetto or chrome://tracing) and `<time>-<rank>.txt`: the ops sorted by self time on the
device (with CUDA), then by self time on the host. The directory is the request's, else
$SGLANG_TORCH_PROFILER_DIR, else /tmp.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

from sglang.srt.managers.io_struct import ProfileReq

logger = logging.getLogger(__name__)

_ACTIVITIES = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA, "CUDA": ProfilerActivity.CUDA}
_TABLE_ROWS = 60


class SchedulerProfiler:
    def __init__(self, rank_name: str):
        self.rank_name = rank_name  # e.g. "DP0-TP1", part of the file names
        self.active: Optional[profile] = None
        self.output_dir = ""
        self.steps_left: Optional[int] = None

    def handle(self, req: ProfileReq) -> tuple[bool, str]:
        if req.action == "start":
            return self.start(req)
        if req.action == "stop":
            return self.stop()
        return False, f"unknown profile action {req.action!r} (start or stop)"

    def start(self, req: ProfileReq) -> tuple[bool, str]:
        if self.active is not None:
            return False, "the profiler is already running; stop it first"
        names = [a.upper() for a in (req.activities or ["CPU", "GPU"])]
        unknown = [a for a in names if a not in _ACTIVITIES]
        if unknown:
            return False, f"unknown profiler activities {unknown} (CPU, GPU)"
        if req.num_steps is not None and req.num_steps < 1:
            return False, f"num_steps must be >= 1, got {req.num_steps}"
        activities = {_ACTIVITIES[a] for a in names}
        if not torch.cuda.is_available():
            activities.discard(ProfilerActivity.CUDA)
            if not activities:
                return False, f"profiler activities {names} need a GPU; this server has none (use CPU)"
        self.output_dir = req.output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
        os.makedirs(self.output_dir, exist_ok=True)
        self.steps_left = req.num_steps
        self.active = profile(activities=sorted(activities, key=str), record_shapes=True)
        self.active.start()
        logger.info("Profiling started; traces go to %s", self.output_dir)
        return True, f"Profiling started; traces go to {self.output_dir}"

    def step(self) -> None:
        """Called after every forward iteration; stops once num_steps iterations ran."""
        if self.active is None or self.steps_left is None:
            return
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.stop()

    def stop(self) -> tuple[bool, str]:
        """Stops the profiler here (it must stop on the thread that started it) and writes the
        files on a thread of their own: for a long session the trace and the table take tens
        of seconds of CPU, which would otherwise stall every request (and /health)."""
        if self.active is None:
            return False, "the profiler is not running"
        prof, self.active = self.active, None
        prof.stop()
        stem = os.path.join(self.output_dir, f"{time.strftime('%Y%m%d-%H%M%S')}-{self.rank_name}")
        threading.Thread(target=_write_profile, args=(prof, stem), name="profile-writer").start()
        return True, f"Profile stopped; writing {stem}.trace.json.gz and {stem}.txt"


def _write_profile(prof: profile, stem: str) -> None:
    try:
        _write_complete(stem, ".trace.json.gz", prof.export_chrome_trace)
        averages = prof.key_averages()
        orders = (["self_cuda_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]
        tables = "".join(f"sorted by {o}\n{averages.table(sort_by=o, row_limit=_TABLE_ROWS)}\n" for o in orders)
        _write_complete(stem, ".txt", lambda path: Path(path).write_text(tables))
    except OSError as e:  # e.g. the directory was removed meanwhile: the scheduler goes on
        logger.error("Could not write the profile %s: %s", stem, e)
        return
    logger.info("Profile written to %s.trace.json.gz and %s.txt", stem, stem)


def _write_complete(stem: str, suffix: str, write: Callable[[str], object]) -> None:
    """write(path) into stem + ".partial" + suffix, then renamed to stem + suffix: the file
    appears under its name only once complete."""
    write(stem + ".partial" + suffix)
    os.replace(stem + ".partial" + suffix, stem + suffix)
