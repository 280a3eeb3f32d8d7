"""Mixture-of-experts kernels: routing (routing.py) and the expert GEMMs (grouped_gemm.py,
gemv.py), with their configurations (routing_config.py, tiles.py)."""
