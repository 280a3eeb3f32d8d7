"""ZMQ contexts whose sockets never block on close.

Invariant: LINGER is 0 on every socket, so closing a socket or garbage-collecting a context
drops unsent messages instead of waiting forever for a peer that has gone.
"""

from __future__ import annotations

import zmq
import zmq.asyncio


def new_context(io_threads: int = 1) -> zmq.Context:
    ctx = zmq.Context(io_threads)
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx


def new_async_context(io_threads: int = 1) -> zmq.asyncio.Context:
    ctx = zmq.asyncio.Context(io_threads)
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx
