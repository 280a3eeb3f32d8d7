"""Launch helpers shared by the Triton kernels: programmatic dependent launch (PDL), the SM
count that sizes split grids, and L2 prefetch of the weights a kernel streams next."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def signals_dependents(device: torch.device) -> bool:
    """Whether kernels on `device` take programmatic dependent launch (CUDA sm90+, compiled,
    not turned off by SGLANG_DISABLE_PDL=1): they let the next kernel launch early, and a
    PDL-launched kernel waits for the previous one's writes before reading them."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    disabled = os.environ.get("SGLANG_DISABLE_PDL") == "1"
    return (
        device.type == "cuda"
        and not interpreted
        and not disabled
        and torch.version.cuda is not None
        and (torch.cuda.get_device_capability(device)[0] >= 9)
    )


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (programs that run at once, one each); 1
    elsewhere (the interpreter runs programs one by one)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def pdl_launch(pdl: bool) -> dict:
    """A Triton launch's keyword arguments: launch_pdl where the kernel is PDL-launched."""
    return {"launch_pdl": True} if pdl else {}


def cache_line_elems(t: torch.Tensor) -> int:
    """Elements of t's dtype in one 128-byte cache line (the unit of prefetch_l2)."""
    return 128 // t.element_size()


@triton.jit
def prefetch_l2(ptrs):
    # One L2 prefetch per pointer; nothing waits for it, and it binds no value (a later load
    # still reads what other kernels wrote meanwhile).
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
