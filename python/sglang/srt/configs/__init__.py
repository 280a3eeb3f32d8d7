from sglang.srt.configs.model_config import ModelConfig

__all__ = ["ModelConfig"]
