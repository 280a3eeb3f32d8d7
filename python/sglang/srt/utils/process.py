"""Process-tree helpers: no subprocess of the server or the Engine may outlive it.

Invariants:
- every child calls `watch_parent()` first: it dies with its parent
  (PR_SET_PDEATHSIG on Linux, a polling thread elsewhere) and ignores SIGINT, so a Ctrl-C
  in a terminal reaches only the parent, which then ends the children in order;
- `kill_process_tree` ends the descendants first, then (optionally) the root.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import Optional

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Loaded at import, so that a fork's child can call prctl before exec without loading anything.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None


def _children_map() -> dict[int, list[int]]:
    """ppid -> child pids, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited while we were listing
        # The command name is in parentheses and may contain spaces: split after it.
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendant_pids(pid: int) -> list[int]:
    """All descendants of `pid`, parents before children."""
    if not os.path.isdir("/proc"):
        return []
    tree = _children_map()
    out: list[int] = []
    stack = list(tree.get(pid, []))
    while stack:
        child = stack.pop()
        out.append(child)
        stack.extend(tree.get(child, []))
    return out


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state != b"Z"  # a zombie is dead; only its parent's wait() is missing
    except OSError:
        return False


def kill_process_tree(pid: int, include_parent: bool = True, timeout: float = 5.0) -> None:
    """SIGTERM the descendants of `pid` (and `pid` itself if include_parent), then SIGKILL
    whatever is still alive after `timeout` seconds."""
    kill_process_trees([pid], include_parent, timeout)


def kill_process_trees(pids: list[int], include_parent: bool = True, timeout: float = 5.0) -> None:
    """kill_process_tree for several roots at once: every process gets its SIGTERM in one
    pass, so that ranks blocked in a collective die together instead of one by one (a
    survivor would report its peer's disappearance as a crash)."""
    victims = [v for pid in pids for v in descendant_pids(pid)]
    if include_parent:
        victims += [pid for pid in pids if pid != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(pid_alive(v) for v in victims):
            time.sleep(0.05)
        victims = [v for v in victims if pid_alive(v)]
        if not victims:
            break
    if include_parent and os.getpid() in pids:
        os.kill(os.getpid(), signal.SIGKILL)


def watch_parent(parent_pid: Optional[int] = None) -> None:
    """Make this child exit when its parent dies, and leave SIGINT to the parent."""
    if parent_pid is None:
        parent_pid = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _LIBC is not None and not set_parent_death_signal(signal.SIGKILL):
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    # Covers non-Linux systems, and a parent that died before prctl took effect.
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()


def set_parent_death_signal(sig: int) -> bool:
    """Linux: the kernel sends `sig` to this process when the thread that started it ends
    (kept across exec). False elsewhere or if prctl fails. Fit for a subprocess preexec_fn."""
    return _LIBC is not None and _LIBC.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def _watch_parent(parent_pid: int, interval: float = 1.0) -> None:
    while os.getppid() == parent_pid:
        time.sleep(interval)
    os._exit(1)
