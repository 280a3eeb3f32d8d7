"""The precision tl.dot multiplies in."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for inputs of `dtype`. float32 multiplies in full float32 (as
    torch does with TF32 off), so float32 runs match a float32 reference bit for bit in their
    argmax; Triton's own default for float32 is TF32 (10-bit mantissa), which flips near-ties.
    Half types ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"
