"""Triton kernels and their host-side launch wrappers (tile configs, measured tables).

Modules here import only torch, triton and sglang.srt.utils; the layers above choose
between a kernel and its plain-PyTorch reference. Importing this package imports no triton.
"""
