from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.models.lit_gpt import LitGPT

__all__ = ["GPT", "GPTConfig", "HFCausalLM", "LitGPT"]


def __getattr__(name: str):
    # HFCausalLM needs the optional ``transformers``: imported only when asked for.
    if name == "HFCausalLM":
        from lightning_3d.models.hf import HFCausalLM

        return HFCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
