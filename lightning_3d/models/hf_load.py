"""A pretrained ``transformers`` directory read straight into each rank's shards.

``from_pretrained`` builds the whole model on every rank (a 7 B model is 28 GB of fp32 host
memory per rank before anything is sharded). Here the model is built on ``meta`` instead
(:func:`build_on_meta`: no memory; the buffers it computes rather than stores, rotary
frequencies and embedding scales, are computed by ``transformers``' own init), and a
:class:`PretrainedWeights` record on it tells :func:`~lightning_3d.parallel.materialize.materialize`
where each tensor's values are. After the recipe has split, sharded and placed the model, each
rank reads from the safetensors files only the slice of each tensor it holds (the file is
memory-mapped; a slice of rows is one read), in the parameter's own dtype, so its peak host
memory is its own shard plus one tensor. A tied weight is read once. Where a rank's part is not
one box of the full tensor (fused projections regrouped for tensor parallelism, FSDP2 shards
of tensor-parallel weights) the full tensor is read and cut locally.

The files must name the model's own tensors: a family whose files ``transformers`` converts on
load (mixtures of experts saved one expert at a time) is loaded by ``from_pretrained``
instead (:func:`names_match`), in full on every rank.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_3d.parallel.materialize import local_part, local_region
from lightning_3d.parallel.tensor import FUSED_ROWS_ATTR, local_tensor, regroup_fused_rows


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory (the index's, when it has one)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    return sorted(directory.glob("*.safetensors"))


def read_headers(directory: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """``{tensor name: (file, shape, dtype)}`` from the files' headers only; ``ValueError``
    naming the file for one that is not readable safetensors (truncated, damaged, missing)."""
    from safetensors import safe_open

    files = weight_files(directory)
    if not files:
        raise ValueError(f"model directory {str(directory)!r} has no *.safetensors weights")
    out: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    out[key] = (file, tuple(piece.get_shape()), piece.get_dtype())
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(
                f"weights file {str(file)!r} cannot be read ({type(err).__name__}: "
                f"{str(err).strip().splitlines()[0] if str(err).strip() else 'damaged'}): "
                "it is truncated or not a safetensors file; copy the model directory again"
            ) from None
    return out


def tied_partners(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter name's other names (a tied weight), from the whole model."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n: [o for o in group if o != n] for group in names.values() for n in group}


def _stored(model: nn.Module) -> dict[str, torch.Tensor]:
    """What the files must hold: parameters (each tie once) and persistent buffers."""
    out = dict(model.named_parameters())
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{name}" if module_name else name] = buffer
    return out


def names_match(model: nn.Module, headers: dict[str, Any]) -> bool:
    """Whether every tensor the model stores is in the files under its own name (or a tie's)."""
    partners = tied_partners(model)
    return all(
        n in headers or any(p in headers for p in partners.get(n, ())) for n in _stored(model)
    )


class PretrainedWeights:
    """Where each tensor of a model built on ``meta`` comes from: a record for
    :func:`~lightning_3d.parallel.materialize.materialize` (its ``planned`` / ``check`` /
    ``fill`` protocol), set as the model's ``deferred_init``. Built from the whole model (names
    and ties); the model may then be split, sharded and placed before :meth:`fill` runs."""

    def __init__(
        self,
        directory: Path,
        model: nn.Module,
        headers: dict[str, tuple[Path, tuple[int, ...], str]],
        keys: Optional[dict[str, str]] = None,
        open_file: Optional[Callable[[Path], Any]] = None,
    ) -> None:
        """``keys``: model name -> stored name, when the caller has matched them (a checkpoint
        file under other names, covering part of the model); by default every tensor the model
        stores is matched by name (or a tie's) and a missing one is refused. ``open_file``: a
        context manager giving a handle with ``get_slice`` / ``get_tensor`` (safetensors')."""
        self.directory = Path(directory)
        self.headers = headers
        self.open_file = open_file or _open_safetensors
        if keys is not None:
            self.keys = dict(keys)
            self.check(model)
            return
        partners = tied_partners(model)
        self.keys: dict[str, str] = {}  # model name -> file key
        for name in _stored(model):
            key = (
                name
                if name in headers
                else next((p for p in partners.get(name, ()) if p in headers), None)
            )
            if key is not None:
                self.keys[name] = key
                self.keys.update({p: key for p in partners.get(name, ())})
        missing = sorted(n for n in _stored(model) if n not in self.keys)
        if missing:
            raise ValueError(
                f"model directory {str(self.directory)!r}: its weights lack {missing[:6]}"
                f"{' ...' if len(missing) > 6 else ''} ({len(missing)} of {len(_stored(model))} tensors)"
            )
        self.check(model)

    def planned(self) -> list[str]:
        return list(self.keys)

    def check(self, owner: nn.Module) -> None:
        """``ValueError`` naming every tensor whose shape in the files differs from the model's
        (a ``config.json`` that does not describe these weights)."""
        wrong = []
        for name, tensor in _stored(owner).items():
            key = self.keys.get(name)
            if key is not None and self.headers[key][1] != tuple(tensor.shape):
                wrong.append(
                    f"{key} {list(self.headers[key][1])} (config.json gives {list(tensor.shape)})"
                )
        if wrong:
            raise ValueError(
                f"model directory {str(self.directory)!r}: weights differ in shape from its "
                f"config.json: {'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}"
            )

    def fill(self, owner: nn.Module) -> int:
        """Copy this rank's part of every tensor ``owner`` still holds from the files."""
        fused = {
            id(p): getattr(m, FUSED_ROWS_ATTR)
            for m in owner.modules()
            if hasattr(m, FUSED_ROWS_ATTR)
            for p in m.parameters(recurse=False)
        }
        filled = 0
        with ExitStack() as stack:
            handles: dict[Path, Any] = {}
            for name, tensor in _stored(owner).items():
                key = self.keys.get(name)
                if key is None:
                    continue
                file = self.headers[key][0]
                if file not in handles:
                    handles[file] = stack.enter_context(self.open_file(file))
                local = local_tensor(tensor)
                part = _read_part(handles[file], key, tensor, fused.get(id(tensor)))
                if part is None:
                    continue  # this rank holds none of it (a short last FSDP2 shard)
                if local.device.type != "cpu" and part.dtype != local.dtype:
                    part = part.to(local.dtype)  # cast on the host: fewer bytes cross to the device
                local.copy_(part)
                filled += 1
        return filled


def _open_safetensors(file: Path) -> Any:
    from safetensors import safe_open

    return safe_open(str(file), "pt")


def _read_part(
    handle: Any, key: str, tensor: torch.Tensor, fused: Optional[tuple]
) -> Optional[torch.Tensor]:
    """This rank's part of ``key``: a slice read where it is one box of the full tensor, else the
    full tensor read and cut (regrouped first for a fused projection)."""
    region = None if fused is not None else local_region(tensor)
    if region is not None:
        if any(s.stop <= s.start for s in region):
            return None
        return handle.get_slice(key)[region]
    full = handle.get_tensor(key)
    return local_part(regroup_fused_rows(full, *fused) if fused is not None else full, tensor)


def build_on_meta(transformers: Any, config: Any, attn_implementation: Optional[str]) -> nn.Module:
    """The causal LM of ``config`` with its parameters (and stored buffers) on ``meta`` and the
    buffers it computes at construction computed, by ``transformers``' own init of each module
    that holds one."""
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
        model.tie_weights()  # from_config leaves a tied head its own tensor on meta
    compute_buffers(model)
    return model


def compute_buffers(model: nn.Module) -> int:
    """Give the buffers ``model`` (a ``transformers`` model) computes at construction and does
    not store (rotary frequencies, embedding scales) their values on the CPU where they are on
    ``meta``, by ``transformers``' own init of each module holding one; returns how many."""
    done = 0
    with torch.device("cpu"):  # also inside a caller's meta context (the launcher's checks)
        for module in model.modules():
            computed = [
                n
                for n, b in module._buffers.items()
                if b is not None and b.is_meta and n in module._non_persistent_buffers_set
            ]
            for name in computed:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            if computed:
                model._init_weights(module)
            done += len(computed)
    return done
