from sglang.srt.model_loader.loader import get_model

__all__ = ["get_model"]
