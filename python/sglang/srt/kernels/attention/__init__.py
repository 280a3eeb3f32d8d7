"""Triton paged-attention kernels over the KV pool (MHA/GQA and MLA).

Every kernel reads KV slots through a flattened index array (`kv_indices`, one slot per
cached token, request i owning `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`) and reads every
length from device tensors, so no launch needs a host sync.
"""
