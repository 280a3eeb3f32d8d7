"""Attention backends and the factory the model runner uses to pick one by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base import AttentionBackend


def create_attention_backend(name: str) -> AttentionBackend:
    """The backend for `--attention-backend name`; fails early when its kernels are unavailable."""
    if name == "torch_native":
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return TorchNativeAttnBackend()
    if name == "triton":
        try:
            import triton  # noqa: F401  (ships with CUDA builds of torch)
        except ImportError as e:
            raise RuntimeError("--attention-backend triton needs the triton package; use torch_native") from e
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend()
    if name == "flashinfer":
        try:
            import flashinfer  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                "--attention-backend flashinfer: the flashinfer package is not importable; use --attention-backend triton instead"
            ) from e
        raise RuntimeError("--attention-backend flashinfer is not implemented; use --attention-backend triton")
    raise ValueError(f"unknown attention backend {name!r}; choose torch_native or triton")
