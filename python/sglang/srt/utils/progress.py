"""Progress of startup work (weight loading) that one process of a server reports.

On a terminal it is a tqdm bar; when stderr is not a terminal (a log file, a pipe) it is a few
log lines instead: one at the start, one every LOG_EVERY_S while it runs, one at the end. Only
the process marked with `show_progress(True)` reports (the first scheduler rank), so ranks'
bars never interleave; the others run silently.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator, Sized
from typing import Optional, TypeVar

from tqdm import tqdm

logger = logging.getLogger(__name__)

LOG_EVERY_S = 30.0
T = TypeVar("T")

_shown = True


def show_progress(shown: bool) -> None:
    """Whether this process reports progress (a process-wide setting, made once at its start)."""
    global _shown
    _shown = shown


def progress(iterable: Iterable[T], desc: str, unit: str, total: Optional[int] = None) -> Iterator[T]:
    """Yield the items of `iterable`, reporting how many went by."""
    if not _shown:
        yield from iterable
        return
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    if sys.stderr.isatty():
        yield from tqdm(iterable, desc=desc, unit=unit, total=total)
        return
    of_total = f"/{total}" if total is not None else ""
    logger.info("%s: %s %ss", desc, total if total is not None else "some", unit)
    start = last_log = time.monotonic()
    count = 0
    for item in iterable:
        yield item
        count += 1
        now = time.monotonic()
        if now - last_log >= LOG_EVERY_S:
            logger.info("%s: %d%s %ss, %.0f s", desc, count, of_total, unit, now - start)
            last_log = now
    logger.info("%s: %d %ss in %.1f s", desc, count, unit, time.monotonic() - start)
