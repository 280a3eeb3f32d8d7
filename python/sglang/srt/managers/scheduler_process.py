"""The scheduler process of one rank: logging, startup (with --speculative-accept-check, the
check), the readiness report to the launcher, then the event loop."""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from sglang.srt.managers.accept_check import run_accept_check
from sglang.srt.managers.io_struct import SchedulerReady
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils.triton_compile_log import TritonCompileLog

logger = logging.getLogger(__name__)


def create_scheduler(
    server_args: ServerArgs, port_args: PortArgs, gpu_id: int, tp_rank: int, dp_rank: Optional[int]
) -> Scheduler:
    """A scheduler ready to serve (with --speculative-accept-check: once the check passed)."""
    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, dp_rank)
    if server_args.speculative_accept_check:
        run_accept_check(scheduler)
    return scheduler


def configure_logger(server_args: ServerArgs, prefix: str = "") -> None:
    fmt = f"[%(asctime)s{prefix}] %(message)s"
    logging.basicConfig(level=server_args.log_level.upper(), format=fmt, datefmt="%Y-%m-%d %H:%M:%S", force=True)


def run_scheduler_process(
    server_args: ServerArgs,
    port_args: PortArgs,
    gpu_id: int,
    tp_rank: int,
    dp_rank: Optional[int],
    pipe_writer,
) -> None:
    if server_args.enable_dp_attention:
        dp_rank_label: Optional[int] = tp_rank // server_args.attn_tp_size
    else:
        dp_rank_label = dp_rank
    prefix = (f" DP{dp_rank_label}" if dp_rank_label is not None else "") + f" TP{tp_rank}"
    configure_logger(server_args, prefix)
    from sglang.srt.utils.process import watch_parent
    from sglang.srt.utils.progress import show_progress

    show_progress(tp_rank == 0 and not dp_rank)  # one rank reports the weight loading

    watch_parent()
    torch.manual_seed(server_args.random_seed)
    compile_log = TritonCompileLog()
    compile_log.install()
    try:
        scheduler = create_scheduler(server_args, port_args, gpu_id, tp_rank, dp_rank)
    except Exception as e:  # report the cause to the launcher instead of dying silently
        logger.exception("Scheduler failed to start")
        pipe_writer.send(SchedulerReady(dp_rank or 0, tp_rank, 0, 0, 0, error=f"{type(e).__name__}: {e}"))
        return
    pipe_writer.send(
        SchedulerReady(
            dp_rank or 0,
            tp_rank,
            scheduler.allocator.size,
            scheduler.max_req_input_len,
            scheduler.context_len,
        )
    )
    compile_log.start_serving()
    scheduler.start_watchdog()
    try:
        scheduler.event_loop()
    except Exception:
        logger.exception("Scheduler crashed")
        os._exit(1)
