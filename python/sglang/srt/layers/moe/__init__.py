"""Mixture-of-experts layers: routing (topk) and expert computation (fused_moe)."""
