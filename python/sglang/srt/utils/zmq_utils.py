"""ZMQ contexts that can never hang the process.

A context that is garbage-collected while one of its sockets is still open (for example one
polled by a thread) blocks forever in term(). So every component uses the process-wide shared
context, which lives as long as the process, and LINGER is 0 on every socket, so closing a
socket drops unsent messages instead of waiting for a peer that has gone.
"""

from __future__ import annotations

import zmq
import zmq.asyncio


def shared_context(io_threads: int = 1) -> zmq.Context:
    """The shared context (io_threads applies when it is first created in this process)."""
    ctx: zmq.Context = zmq.Context.instance(io_threads)
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx


def shared_async_context(io_threads: int = 1) -> zmq.asyncio.Context:
    ctx: zmq.asyncio.Context = zmq.asyncio.Context.instance(io_threads)
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx
