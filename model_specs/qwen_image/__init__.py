"""Qwen-Image MMDiT (diffusers ``QwenImageTransformer2DModel``) as megatron-core layer specs."""
from model_specs.qwen_image.config import QwenImageConfig, tiny_config

__all__ = ["QwenImageConfig", "tiny_config"]
