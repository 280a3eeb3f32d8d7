"""Running Triton kernel tests: compiled on CUDA, or under Triton's CPU interpreter.

TRITON_INTERPRET is read when each @triton.jit function (triton.language's own included) is
decorated, and triton is usually imported before a test module (by transformers), so on CPU the
kernel tests rerun in a fresh process that sets it from the start (rerun_under_interpreter); in
this process they are skipped (kernel_test).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from sglang.srt.batch.forward_batch_info import ForwardBatch
    from sglang.test.attention_batches import AttnShape

ON_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
NEEDS_SUBPROCESS = not ON_CUDA and not INTERPRETED
DEVICE = "cuda" if ON_CUDA else "cpu"
# Kernel vs reference tolerance; CUDA fp32 dots run in TF32.
KERNEL_TOL = {torch.float32: 1e-2 if ON_CUDA else 1e-4, torch.bfloat16: 3e-2}
kernel_test = pytest.mark.skipif(NEEDS_SUBPROCESS, reason="runs in the TRITON_INTERPRET=1 subprocess")


def rerun_under_interpreter(path: str, *pytest_args: str, timeout: int = 1800) -> None:
    """Run the tests of `path` again in a fresh TRITON_INTERPRET=1 process; fail with its output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", path, *pytest_args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]


_patched = False


def patch_interpreter_for_numpy2() -> None:
    """Under TRITON_INTERPRET=1 only, once per process: Triton 3.6's interpreter turns scalar
    tensors (numpy shape (1,)) into loop bounds with int(array), which NumPy >= 2.4 rejects;
    use .item() instead. test/conftest.py calls it; processes spawned by a test (which run no
    conftest) call it themselves before running kernels."""
    global _patched
    if _patched or os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched
    _patched = True


def compare_attention_with_torch_native(
    shape: AttnShape, ext_lens: list[int], prefix_lens: list[int], dtype: torch.dtype, tree: bool = False, seed: int = 0
) -> ForwardBatch:
    """The Triton attention backend's output on a random batch equals the torch-native
    backend's within KERNEL_TOL; returns the batch (its metadata from the Triton backend)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.test.attention_batches import make_attention_batch

    fb, q, k, v = make_attention_batch(shape, ext_lens, prefix_lens, dtype, DEVICE, tree, seed)
    layer = shape.layer()
    outs = []
    for backend in (TorchNativeAttnBackend(), TritonAttnBackend()):
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, layer, fb).float())
    ref, got = outs
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=KERNEL_TOL[dtype], rtol=KERNEL_TOL[dtype])
    return fb
