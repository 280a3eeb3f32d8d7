"""Triton paged-attention kernels over the KV pool (MHA/GQA and MLA).

Every kernel reads KV slots through a flattened index array (`kv_indices`, one slot per
cached token, request i owning `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`) and reads every
length from device tensors, so no launch needs a host sync.
"""

from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention
from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention
from sglang.srt.layers.attention.triton_ops.common import build_kv_indices

__all__ = ["build_kv_indices", "decode_attention", "extend_attention"]
