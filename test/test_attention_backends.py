"""--attention-backend name -> backend, and the start-up failures the flag promises."""

from __future__ import annotations

import pytest

from sglang.srt.layers.attention import create_attention_backend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend


def test_torch_native_by_name():
    assert isinstance(create_attention_backend("torch_native"), TorchNativeAttnBackend)


def test_triton_by_name():
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    assert isinstance(create_attention_backend("triton"), TritonAttnBackend)


def test_flashinfer_fails_naming_triton():
    with pytest.raises(RuntimeError, match="--attention-backend triton"):
        create_attention_backend("flashinfer")


def test_unknown_backend_rejected():
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("xformers")
