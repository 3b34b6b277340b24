"""How a checkpoint file's tensor names are matched to a module's.

A plain model's file (``"tok_emb.weight"``) and a ``LightningModule``'s checkpoint
(``"model.tok_emb.weight"``) differ by a prefix (:func:`map_names`); a model with LoRA adapters
calls its base ``q_proj.base_layer.weight`` and holds adapters no whole-model file has
(:func:`matched_view`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lightning_3d.checkpoint.checks import LIGHTNING, shared_prefix


def _renamed(names: Sequence[str], strip: str, add: str) -> list[str]:
    return [add + name[len(strip) :] for name in names]


def map_names(
    ckpt_names: Sequence[str], module_names: Sequence[str], kind: str, prefix: str | None = None
) -> dict[str, str]:
    """Checkpoint name → module name.

    ``prefix`` says where the plain model's names sit inside ``module`` (``"model."`` for LitGPT,
    ``""`` for the plain model itself); the checkpoint's names are taken as plain names, after
    stripping a Lightning checkpoint's shared attribute prefix. ``None`` picks, among "as is",
    "strip the checkpoint's shared prefix" and "add the module's shared prefix" (and both), the
    renaming that matches the most module names (ties: as is).
    """
    ckpt_prefix, module_prefix = shared_prefix(ckpt_names), shared_prefix(module_names)
    if prefix is not None:
        strip = ckpt_prefix if kind == LIGHTNING else ""
        return dict(zip(ckpt_names, _renamed(ckpt_names, strip, prefix)))
    wanted = set(module_names)
    candidates = [("", ""), (ckpt_prefix, module_prefix), ("", module_prefix), (ckpt_prefix, "")]
    best = max(candidates, key=lambda c: len(wanted.intersection(_renamed(ckpt_names, *c))))
    return dict(zip(ckpt_names, _renamed(ckpt_names, *best)))


def matched_view(own: list[str], stored: list[str], source: Path) -> dict[str, str]:
    """What a file's tensors are matched against: name -> the module's name for it. A model with
    LoRA adapters takes a whole model's file as its base (``q_proj.weight`` into
    ``q_proj.base_layer.weight``; the adapters keep their init) and an adapters-only file as its
    adapters; an adapters-only file into a model without adapters is refused, naming both ways
    to use it."""
    from lightning_3d.adapters.lora import base_view, is_adapter_name

    adapted = [name for name in own if is_adapter_name(name)]
    only_adapters = bool(stored) and all(is_adapter_name(name) for name in stored)
    if only_adapters and not adapted:
        raise ValueError(
            f"{source} holds only LoRA adapters ({len(stored)} tensors, no base weights): "
            "fine-tune with the same adapter (adapter=lora, its r and targets) to continue "
            f"from them, or merge them into the base first (python -m lightning_3d.adapters "
            f"{source} DIR --merged)"
        )
    return {name: name for name in adapted} if only_adapters else base_view(own)


def without_stored_ties(
    view: dict[str, str], stored: Sequence[str], partners: dict[str, list[str]]
) -> dict[str, str]:
    """``view`` (name -> module name) less the names a file holds only under a tied partner's
    name (an HF file stores a tied head once, as the embedding); ``stored``: the file's names,
    already matched to ``view``'s; ``partners``: module name -> its ties' module names."""
    held = {view[name] for name in stored if name in view}
    return {
        name: own
        for name, own in view.items()
        if own in held or not any(p in held for p in partners.get(own, ()))
    }
