"""The last program of a group hands off to the rest of one Triton launch.

A kernel whose second phase needs every program's first-phase result (the router's logits
before top-k, for instance) would take a second launch. Instead each program counts its
arrival on a device counter once its stores are done, and the program that arrives last
runs the second phase itself.

Invariants: every counter is 0 between launches (the last program resets it), so launches
on one stream may share the buffer without clearing it, also across CUDA-graph replays. The
second phase reads the other programs' stores with `.cg` loads (from L2, not a stale L1);
the arrival's release/acquire at GPU scope orders those stores before the reads. Results do
not depend on which program arrives last.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CAPACITY = 1 << 16  # counters per device; a launch uses one per group


@functools.cache
def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed int32 counters (allocated once; kept alive by the cache)."""
    return torch.zeros(CAPACITY, dtype=torch.int32, device=device)


@triton.jit
def arrive_last(counter_ptr, group_size):
    """Count this program's arrival at counter_ptr; True in the last of group_size programs,
    which also resets the counter."""
    tl.debug_barrier()  # every thread's stores before the one arrival
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == group_size - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last
