"""Load pretrained weights (safetensors or a Lightning ``.ckpt``) into a module before training.

Single process, plain tensors: call it on the freshly built module, before ``trainer.fit``;
the strategy shards the loaded weights afterwards like any others. Names are adapted between
a plain model and the ``LightningModule`` wrapping it (``"tok_emb.weight"`` in a safetensors
export ↔ ``"model.tok_emb.weight"`` in :class:`~lightning_3d.models.LitGPT`).

Example::

    lit = LitGPT(n_layer=7, n_embd=768, n_head=12)
    load_pretrained(lit, "gpt.safetensors")           # names gain "model."
    load_pretrained(GPT(config), "last.ckpt")         # names lose "model."
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_3d.checkpoint.checks import (
    PathLike,
    check_against,
    read_tensors,
)
from lightning_3d.checkpoint.names import map_names, matched_view


def _refuse_unloadable(module: nn.Module) -> None:
    """Plain materialized tensors only: a meta tensor would silently ignore the copy, and a
    sharded (DTensor) one means the strategy has already set the module up."""
    for name, tensor in module.state_dict().items():
        if isinstance(tensor, DTensor):
            raise ValueError(
                f"{name} is already sharded (DTensor): call load_pretrained before trainer.fit"
            )
        if isinstance(tensor, Tensor) and tensor.is_meta:
            raise ValueError(
                f"{name} is on the meta device: materialize the module (to_empty + init) first"
            )


@torch.no_grad()
def load_pretrained(
    module: nn.Module, path: PathLike, prefix: str | None = None, strict: bool = True
) -> list[str]:
    """Copy the weights of a safetensors file or a Lightning checkpoint into ``module`` in place.

    Args:
        module: a ``LightningModule`` or plain ``nn.Module``, built and not yet sharded.
        path: ``.safetensors`` (plain-model names) or a consolidated Lightning ``.ckpt``.
        prefix: where the plain model's names sit in ``module`` (``"model."`` for LitGPT);
            ``None``: adapted automatically (see :func:`map_names`).
        strict: every module tensor must be in the file and nothing else; with ``False`` only
            the names in common are loaded (shapes must still agree).

    Returns:
        The module names loaded, in the module's order.

    Raises ``FileNotFoundError``/``ValueError`` naming the file and every missing, unexpected
    or mis-shaped name, before ``module`` is modified. The file is read weights-only.

    Example::

        >>> loaded = load_pretrained(LitGPT(), "gpt.safetensors")  # doctest: +SKIP
        >>> loaded[0]
        'model.tok_emb.weight'
    """
    owner = _deferred_owner(module)
    if owner is not None:  # built on meta, its weights read later: read them from this file
        return _defer_to_file(module, owner, Path(path))
    _refuse_unloadable(module)
    # A .ckpt: only the weights are read, not the optimizer state.
    kind, tensors = read_tensors(path, mmap=True)
    own = module.state_dict()
    view = matched_view(list(own), list(tensors), Path(path))
    names = map_names(list(tensors), list(view), kind, prefix)
    check_against(
        {name: tuple(own[view[name]].shape) for name in view},
        {names[name]: tuple(tensor.shape) for name, tensor in tensors.items()},
        strict=strict,
        source=str(Path(path)),
    )
    state = {view[names[n]]: t for n, t in tensors.items() if names[n] in view}
    state = {name: _as_stored(own[name], value) for name, value in state.items()}
    module.load_state_dict(state, strict=strict and len(view) == len(own))
    return [name for name in own if name in state]


def _as_stored(target: Tensor, value: Tensor) -> Tensor:
    """``value`` as ``target`` stores it: an NF4 base (QLoRA) is quantized from bf16, as when
    the model was built."""
    if type(target).__name__ == "NF4Tensor":
        return value.to(torch.bfloat16)
    return value


def _deferred_owner(module: nn.Module) -> nn.Module | None:
    """The submodule on ``meta`` whose weights a record will read later (``HFCausalLM(path=DIR)``)."""
    return next(
        (m for m in module.modules() if getattr(m, "deferred_init", None) is not None), None
    )


def _defer_to_file(module: nn.Module, owner: nn.Module, path: Path) -> list[str]:
    """Point ``owner``'s record at ``path`` for the tensors the file holds: each rank still
    reads only its own slices when the strategy materialises the model."""
    from lightning_3d.checkpoint.file_record import file_record

    record, names = file_record(owner, path)
    current = owner.deferred_init
    if hasattr(current, "base") and hasattr(current, "adapters"):  # adapters on a model on meta
        from lightning_3d.adapters.lora import is_adapter_name

        if all(is_adapter_name(name) for name in names):
            current.adapters = record
        else:
            current.base = record
    else:
        owner.deferred_init = record
    inner = next(name for name, m in module.named_modules() if m is owner)
    return [f"{inner}.{name}" if inner else name for name in names]
