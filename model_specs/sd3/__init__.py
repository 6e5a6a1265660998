"""SD3 / SD3.5 MMDiT (diffusers ``SD3Transformer2DModel``) as megatron-core layer specs."""
from model_specs.sd3.config import SD3Config, sd35_large, sd35_medium, tiny_config

__all__ = ["SD3Config", "sd35_large", "sd35_medium", "tiny_config"]
