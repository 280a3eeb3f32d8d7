"""Triton kernels of the IPC collectives (see ipc_collectives.py for the protocol).

Every kernel takes a table of the ranks' buffer addresses (int64, one per rank) and turns an
entry into a typed pointer on the device, so one compiled kernel serves any peer and a CUDA
graph captures it with fixed arguments. The collective's sequence number lives on the device
(`counter`), never on the host: a replayed graph and an eager call advance it alike.

Invariants:
- `counter` holds the number of collectives this rank has completed on this communicator;
  only `signal_and_wait` writes it, after the wait;
- collective e (1-based) uses data slot e % 2 of every rank;
- flags and the counter are int64 (no wrap-around in a server's life).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slot_base(table_ptr, rank, e, slot_elems, ELEM_PTR: tl.constexpr):
    """Rank `rank`'s data slot of collective e, as a pointer of type ELEM_PTR."""
    base = tl.load(table_ptr + rank).to(ELEM_PTR)
    return base + (e % 2) * slot_elems


@triton.jit
def copy_in_kernel(src_ptr, data_table_ptr, counter_ptr, n, slot_elems, rank, BLOCK: tl.constexpr):
    """src[:n] into this rank's data slot of the next collective."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(counter_ptr, volatile=True) + 1  # signal_and_wait has not counted it yet
    dst = _slot_base(data_table_ptr, rank, e, slot_elems, src_ptr.dtype)
    tl.store(dst + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@triton.jit
def signal_and_wait_kernel(flag_table_ptr, counter_ptr, rank, WORLD: tl.constexpr):
    """One program: write e = counter + 1 into flag[rank] of every rank (release: the data
    copied in before is visible to whoever sees it), spin until every rank's flag in this
    rank's buffer is >= e (acquire), then counter = e.

    A peer is at most one collective ahead (it cannot pass collective e + 1's wait before this
    rank signals e + 1), so ">=" is exact; a peer one ahead writes slot (e + 1) % 2, not the slot
    this rank still reads."""
    e = tl.load(counter_ptr, volatile=True) + 1
    for p in tl.static_range(WORLD):
        peer_flags = tl.load(flag_table_ptr + p).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(peer_flags + rank, e, sem="release", scope="sys")
    my_flags = tl.load(flag_table_ptr + rank).to(tl.pointer_type(tl.int64))
    for p in tl.static_range(WORLD):
        seen = tl.atomic_add(my_flags + p, 0, sem="acquire", scope="sys")
        while seen < e:
            seen = tl.atomic_add(my_flags + p, 0, sem="acquire", scope="sys")
    tl.store(counter_ptr, e)


@triton.jit
def reduce_out_kernel(data_table_ptr, counter_ptr, out_ptr, n, slot_elems, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """out[:n] = sum over ranks (in rank order, float32) of their slot: the same bits on every rank."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(counter_ptr, volatile=True)  # counted by signal_and_wait
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in tl.static_range(WORLD):
        src = _slot_base(data_table_ptr, p, e, slot_elems, out_ptr.dtype)
        acc += tl.load(src + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gather_out_kernel(data_table_ptr, counter_ptr, out_ptr, n, slot_elems, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """out[p * n : (p + 1) * n] = rank p's slot, for every rank p."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(counter_ptr, volatile=True)  # counted by signal_and_wait
    for p in tl.static_range(WORLD):
        src = _slot_base(data_table_ptr, p, e, slot_elems, out_ptr.dtype)
        tl.store(out_ptr + p * n + offs, tl.load(src + offs, mask=mask, cache_modifier=".cv"), mask=mask)
