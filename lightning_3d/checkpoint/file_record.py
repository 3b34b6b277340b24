"""A checkpoint file as the weight record of a model built on ``meta``.

``HFCausalLM(path=DIR)`` is built on ``meta`` with a record of where each tensor is in the
directory's files; each rank reads its own slices once the strategy has split and sharded the
model. ``finetune.pretrained=FILE`` (a safetensors file or a Lightning ``.ckpt``, under the
model's own names or a ``LightningModule``'s) replaces that record, for the tensors the file
holds, with one reading the file the same way: the model still never exists whole on a rank.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

from torch import Tensor, nn

from lightning_3d.checkpoint.checks import (
    SAFETENSORS,
    check_against,
    detect_format,
    read_tensors,
)
from lightning_3d.checkpoint.names import map_names, matched_view, without_stored_ties
from lightning_3d.models.hf_load import PretrainedWeights, tied_partners


class _Held:
    """Tensors already mapped from a file, with a safetensors handle's two read methods."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self.tensors = tensors

    def get_slice(self, key: str) -> Tensor:
        return self.tensors[key]

    def get_tensor(self, key: str) -> Tensor:
        return self.tensors[key]


def _headers(path: Path) -> tuple[dict[str, tuple[Path, tuple[int, ...], str]], Optional[Any]]:
    """``{name: (file, shape, dtype)}`` and how to open the file (``None``: safetensors')."""
    if detect_format(path) == SAFETENSORS:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as handle:
            slices = {key: handle.get_slice(key) for key in handle.keys()}
            return {k: (path, tuple(s.get_shape()), s.get_dtype()) for k, s in slices.items()}, None
    _, tensors = read_tensors(path, mmap=True)  # a .ckpt: its weights only, read on first use
    held = _Held(tensors)
    headers = {k: (path, tuple(t.shape), str(t.dtype)) for k, t in tensors.items()}
    return headers, lambda _: nullcontext(held)


def file_record(owner: nn.Module, path: Path) -> tuple[PretrainedWeights, list[str]]:
    """The record reading ``path`` into ``owner`` (on ``meta``) and the names it fills.
    ``ValueError`` naming every missing, unexpected or mis-shaped tensor (a tied weight stored
    once counts for both names)."""
    headers, open_file = _headers(path)
    own = owner.state_dict(keep_vars=True)
    view = matched_view(list(own), list(headers), path)
    names = map_names(list(headers), list(view), detect_format(path))  # file -> view name
    keys = {view[names[key]]: key for key in headers if names[key] in view}
    partners = tied_partners(owner)
    for name, ties in partners.items():  # a tie stored under one name: read for both
        found = next((keys[p] for p in ties if p in keys), None)
        if name not in keys and found is not None:
            keys[name] = found
    stored = {names[key]: shape for key, (_, shape, _) in headers.items()}
    expected = without_stored_ties(view, list(stored), partners)
    check_against({n: tuple(own[m].shape) for n, m in expected.items()}, stored, source=str(path))
    return PretrainedWeights(path, owner, headers, keys=keys, open_file=open_file), list(keys)
