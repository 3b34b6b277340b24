"""The optimizers a model can name, AdamW with low-precision states among them, and their bytes.

``build_optimizer(name, groups, lr, betas)`` makes one of :data:`OPTIMIZERS` for a model's
``configure_optimizers`` (``LitGPT`` and ``HFCausalLM`` take the name as ``optimizer=``; the
Hydra app as ``model.optimizer=``):

- ``adamw``: ``torch.optim.AdamW``, two fp32 moments: 8 bytes per parameter.
- ``adamw8bit``: torchao's ``AdamW8bit``: each moment as uint8 codes of a dynamic-tree map,
  one fp32 scale per block of 256 elements (2.03 bytes per parameter, 0.254x).
- ``adamw4bit``: torchao's ``AdamW4bit``: 4-bit codes, blocks of 128 (about 1.06 bytes, 0.13x).
- ``adamw8bit_bnb``: bitsandbytes' ``AdamW8bit`` (blockwise, 256; plain uint8 tensors).
- ``adamw_bf16sr``: torchao's ``_AdamW`` with ``bf16_stochastic_round=True``: bf16 parameters
  and bf16 moments (4 bytes of state per parameter, no fp32 master), each update computed in
  fp32 and rounded to bf16 stochastically (up or down with the odds of the remainder), so an
  update smaller than half a bf16 step still moves the weight on average instead of being
  rounded away. It is what replaces the fp32 master, so it needs bf16 parameters
  (``precision="bf16-true"``) that the optimizer steps itself: no ZeRO 0-2 fp32 masters
  (``zero_master_weights=False``, or ZeRO-3), no offload; refused elsewhere
  (:func:`optimizer_problems`, and :func:`build_optimizer` for parameters that are not bf16).
- ``sgd``: momentum SGD.

torchao quantizes a tensor of at least 4096 elements whose count its block size divides, in
blocks of its flattened elements; smaller tensors keep fp32 moments (bitsandbytes: at least
4096). Its step is a ``torch.compile``-d function (the first step of each shape compiles).

Under ZeRO 1-2 the optimizer steps each bucket's slice on this rank (a 1-D ``DTensor``), and
torchao quantizes the slice's local tensor in blocks: the ZeRO engine then aligns each
parameter's place in its bucket, and the slice size, to :func:`quantization_block`, so no block
holds two parameters or crosses a rank's boundary. A parameter that one process would quantize
(see above) then gets the very blocks, scales and codes it gets in one process; parameters one
process keeps in fp32 (norms, biases, sizes the block does not divide) are quantized in the
bucket, so exact parity with one process holds for models made only of quantizable tensors (see
``tests/test_low_bit_optim.py``). bitsandbytes reads raw pointers and cannot step a ``DTensor``:
refused under ZeRO 1-3 (:func:`optimizer_problems`). None of them composes with ``offload``
(its CPU Adam keeps its own fp32 moments).

Checkpoints: one process and ZeRO-0 save the states as they are (torchao's tensor subclasses
pickle with their codes, scales and map, and ``load_state_dict`` puts them back unchanged), so a
resumed run continues bit for bit. Under ZeRO 1-3 the checkpoint code gathers each parameter's
state across ranks with plain collectives, which a quantized state does not implement: refused
before launch (:func:`optimizer_problems`) and at save (:func:`refuse_sharded_quantized`).
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

OPTIMIZERS = ("adamw", "sgd", "adamw8bit", "adamw4bit", "adamw8bit_bnb", "adamw_bf16sr")
LOW_BIT = {"adamw8bit": "torchao", "adamw4bit": "torchao", "adamw8bit_bnb": "bitsandbytes"}
# Optimizers that step bf16 parameters with stochastic rounding, and the library each needs.
STOCHASTIC_ROUNDING = {"adamw_bf16sr": "torchao"}
# Elements per quantization block (torchao's defaults, bitsandbytes' blockwise size).
BLOCK_SIZE = {"adamw8bit": 256, "adamw4bit": 128, "adamw8bit_bnb": 256}


def optimizer_problems(
    name: Any,
    zero_stage: int = 0,
    offload: str = "none",
    checkpoints: bool = False,
    precision: Optional[str] = None,
    master_weights: bool = False,
) -> list[str]:
    """What stops optimizer ``name`` with this layout, in the option names users give (empty:
    nothing); the Hydra app prints them as one ``error:`` line before any rank starts.
    ``checkpoints``: the run saves checkpoints (their optimizer state is gathered per parameter,
    which quantized states sharded by ZeRO 1-3 cannot be yet); ``precision``: Lightning's, where
    known; ``master_weights``: the run's ``zero_master_weights``."""
    if name not in OPTIMIZERS:
        return [f"optimizer must be one of {list(OPTIMIZERS)}, got {name!r}"]
    problems = rounding_problems(name, zero_stage, offload, precision, master_weights)
    library = LOW_BIT.get(name)
    if library is not None and importlib.util.find_spec(library) is None:
        problems.append(f"optimizer={name!r} needs {library}, which is not installed")
    if library is not None and offload != "none":
        problems.append(
            f"optimizer={name!r} with offload={offload!r}: the offload engine steps its own "
            "fp32 Adam state on the host; choose optimizer='adamw' or offload='none'"
        )
    if library == "torchao" and zero_stage > 0 and checkpoints:
        problems.append(
            f"optimizer={name!r} with zero_stage={zero_stage} and checkpoints: quantized states "
            "split across ZeRO shards cannot be gathered per parameter; use zero_stage=0, "
            "optimizer='adamw', or no periodic checkpoints (checkpoint.every_n_steps=null)"
        )
    if name == "adamw8bit_bnb" and zero_stage > 0:
        problems.append(
            f"optimizer={name!r} with zero_stage={zero_stage}: bitsandbytes cannot step the "
            "sharded DTensor slices; use optimizer='adamw8bit' (torchao) or zero_stage=0"
        )
    return problems


def rounding_problems(
    name: str,
    zero_stage: int = 0,
    offload: str = "none",
    precision: Optional[str] = None,
    master_weights: bool = False,
) -> list[str]:
    """What stops a stochastic-rounding optimizer (:data:`STOCHASTIC_ROUNDING`): it must step
    the bf16 parameters themselves (see the module docstring); empty for any other ``name``."""
    library = STOCHASTIC_ROUNDING.get(name)
    if library is None:
        return []
    problems = []
    if importlib.util.find_spec(library) is None:
        problems.append(f"optimizer={name!r} needs {library}, which is not installed")
    if precision is not None and precision != "bf16-true":
        problems.append(
            f"optimizer={name!r} with precision={precision!r}: stochastic rounding steps bf16 "
            "parameters; use precision='bf16-true' or optimizer='adamw'"
        )
    if precision == "bf16-true" and zero_stage < 3 and master_weights and offload == "none":
        problems.append(
            f"optimizer={name!r} with zero_stage={zero_stage} and zero_master_weights=True: the "
            "ZeRO engine would step fp32 masters, which need no rounding; use "
            "zero_master_weights=False, zero_stage=3 or optimizer='adamw'"
        )
    if offload != "none":
        problems.append(
            f"optimizer={name!r} with offload={offload!r}: the offload engine steps its own "
            "fp32 Adam state on the host; choose offload='none'"
        )
    return problems


def build_optimizer(
    name: str, groups: Any, lr: float, betas: tuple[float, float]
) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``groups`` (param groups, each with its ``weight_decay``).

    Example::

        opt = build_optimizer("adamw8bit", model.parameters(), lr=3e-4, betas=(0.9, 0.95))
    """
    problems = optimizer_problems(name)
    if name in STOCHASTIC_ROUNDING:
        groups = list(groups)
        params = [
            p
            for g in groups
            for p in (g["params"] if isinstance(g, dict) else [g])
            if p.requires_grad
        ]
        other = sorted({str(p.dtype) for p in params if p.dtype != torch.bfloat16})
        if other:
            problems.append(
                f"optimizer={name!r} steps bf16 parameters with stochastic rounding; "
                f"{sum(p.dtype != torch.bfloat16 for p in params)} trained parameter(s) are "
                f"{', '.join(other)} (precision='bf16-true' makes them bf16)"
            )
    if problems:
        raise ValueError("; ".join(problems))
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    if name == "sgd":  # plain momentum SGD: unlike Adam, sensitive to the gradient's scale
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if name == "adamw8bit_bnb":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(groups, lr=lr, betas=betas)
    import torchao.optim

    if name == "adamw_bf16sr":  # weight_decay per group, as AdamW's
        return torchao.optim._AdamW(groups, lr=lr, betas=betas, bf16_stochastic_round=True)
    kind = torchao.optim.AdamW8bit if name == "adamw8bit" else torchao.optim.AdamW4bit
    return kind(groups, lr=lr, betas=betas, block_size=BLOCK_SIZE[name])


def quantization_block(optimizer: torch.optim.Optimizer) -> int:
    """Elements per quantization block of ``optimizer``'s states (1: not quantized); the ZeRO
    engine aligns parameters and slices to it."""
    block = getattr(optimizer, "block_size", None)  # torchao's low-bit optimizers carry it
    return block if isinstance(block, int) and block > 1 else 1


def state_bytes_by_dtype(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of ``optimizer``'s state on this rank, by the dtype they are stored in, counted from
    the tensors (a quantized state's codes, scales and code map; a ``DTensor``'s local part)."""
    counts: Counter = Counter()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                for tensor in _stored(value):
                    counts[str(tensor.dtype).removeprefix("torch.")] += (
                        tensor.numel() * tensor.element_size()
                    )
    return dict(counts)


def _stored(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s data (inside DTensors and quantized states)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [t for name in names for t in _stored(getattr(tensor, name))]


def refuse_sharded_quantized(optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` when ``optimizer`` holds quantized states split across ranks (ZeRO 1-3),
    which the checkpoint code cannot gather per parameter; said before any collective starts."""
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, DTensor):
                local = value.to_local()
                if is_traceable_wrapper_subclass(local):
                    raise ValueError(
                        f"{type(optimizer).__name__}'s {type(local).__name__} states are split "
                        "across ZeRO shards and cannot be saved per parameter; use zero_stage=0 "
                        "or optimizer='adamw' for runs that save checkpoints"
                    )


def quantized_state_classes() -> list[type]:
    """torchao's quantized optimizer-state classes, which a checkpoint loaded with
    ``weights_only=True`` may hold (imported here, only when a file names them)."""
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    return [OptimState8bit, OptimState4bit, OptimStateFp8]
