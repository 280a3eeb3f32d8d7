"""Starts the scheduler side of a server and, under data parallelism, the controller that
dispatches requests to DP ranks.

Layouts (ranks on this node only; node n of N runs tp ranks [n*tp/N, (n+1)*tp/N)):
- dp 1: tp scheduler ranks, rank 0 receives from the TokenizerManager;
- dp N without DP attention: N independent replicas of tp ranks each;
- dp N with DP attention: one replica of tp ranks; DP rank d is ranks [d*attn_tp, (d+1)*attn_tp).
With dp > 1 the controller receives every request and sends it to one DP rank's entry rank.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

import zmq

from sglang.srt.managers.dp_load import LoadBalancer, new_request_tokens
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils.zmq_utils import shared_context

logger = logging.getLogger(__name__)


def scheduler_ranks_on_node(server_args: ServerArgs) -> list[tuple[int, int, int | None]]:
    """(gpu_id, tp_rank, dp_rank) of every scheduler process this node runs: the node's i-th
    process uses GPU base_gpu_id + i * gpu_id_step."""
    per_node = server_args.tp_size // server_args.nnodes
    first = server_args.node_rank * per_node
    tp_ranks = range(first, first + per_node)
    if server_args.dp_size == 1 or server_args.enable_dp_attention:
        local = [(r - first, r, None) for r in tp_ranks]
    else:
        local = [(d * per_node + r - first, r, d) for d in range(server_args.dp_size) for r in tp_ranks]
    base, step = server_args.base_gpu_id, server_args.gpu_id_step
    return [(base + i * step, tp_rank, dp_rank) for i, tp_rank, dp_rank in local]


def start_scheduler_side(server_args: ServerArgs, port_args: PortArgs, ctx, subprocesses) -> list[Connection]:
    """Start this node's scheduler processes (and the DP controller on node 0 when dp > 1).
    Returns one pipe per scheduler process; each reports a SchedulerReady."""
    from sglang.srt.managers.scheduler_process import run_scheduler_process

    if server_args.dp_size > 1 and server_args.node_rank == 0:
        proc = ctx.Process(target=run_data_parallel_controller_process, args=(server_args, port_args), name="dp-controller")
        proc.start()
        subprocesses.add(proc)
    readers = []
    for gpu_id, tp_rank, dp_rank in scheduler_ranks_on_node(server_args):
        reader, writer = ctx.Pipe(duplex=False)
        name = f"scheduler-tp{tp_rank}" + (f"-dp{dp_rank}" if dp_rank is not None else "")
        proc = ctx.Process(
            target=run_scheduler_process,
            args=(server_args, port_args, gpu_id, tp_rank, dp_rank, writer),
            name=name,
        )
        proc.start()
        writer.close()  # recv() then sees EOF if the child dies before reporting
        subprocesses.add(proc)
        readers.append(reader)
    return readers


class DataParallelController:
    """Dispatches each generate request to one DP rank (--load-balance-method, see dp_load.py);
    control messages go to every DP rank."""

    def __init__(self, server_args: ServerArgs, port_args: PortArgs):
        ctx = shared_context(2 + server_args.dp_size)
        self.recv_from_tokenizer = ctx.socket(zmq.PULL)
        self.recv_from_tokenizer.connect(port_args.scheduler_input_ipc_name)
        self.recv_load = ctx.socket(zmq.PULL)
        self.recv_load.bind(port_args.dp_load_ipc_name)
        self.workers = []
        for name in port_args.dp_input_ipc_names:
            sock = ctx.socket(zmq.PUSH)
            sock.bind(name)
            self.workers.append(sock)
        self.balancer = LoadBalancer(server_args.load_balance_method, len(self.workers))

    def dispatch(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            msg.dp_rank = self.balancer.choose(new_request_tokens(msg), msg.dp_rank)
            self.workers[msg.dp_rank].send_pyobj(msg)
        else:
            for sock in self.workers:
                sock.send_pyobj(msg)

    def take_load_reports(self) -> None:
        while True:
            try:
                self.balancer.on_report(self.recv_load.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return

    def event_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        poller.register(self.recv_load, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            self.take_load_reports()  # the freshest loads before each dispatch
            if self.recv_from_tokenizer in ready:
                self.dispatch(self.recv_from_tokenizer.recv_pyobj())


def run_data_parallel_controller_process(server_args: ServerArgs, port_args: PortArgs) -> None:
    from sglang.srt.utils.process import watch_parent

    watch_parent()
    DataParallelController(server_args, port_args).event_loop()
