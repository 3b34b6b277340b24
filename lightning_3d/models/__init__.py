from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.models.lit_gpt import LitGPT

__all__ = ["GPT", "GPTConfig", "LitGPT"]
