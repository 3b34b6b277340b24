"""Adapters on a model built on ``meta`` (``HFCausalLM(path=DIR)``, weights read later, each
rank its own slices): the base keeps its record of where its weights are, under the names
peft gives it (``q_proj.weight`` is now ``q_proj.base_layer.weight``), and the adapters get a
record of their own initial fills (peft's: A Kaiming-uniform, B zeros), replayed when the model
is materialised, from the random state at the time they were put in, so every rank of one seed
fills the same adapters and one process fills what a layout fills.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightning_3d.parallel.materialize import DeferredInit, ParamInit


def _kaiming(tensor: torch.Tensor, generator: Any) -> None:
    nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)  # peft's lora_A init


def _zeros(tensor: torch.Tensor, generator: Any) -> None:
    nn.init.zeros_(tensor)


class AdaptedRecord:
    """The model's weight record (renamed for the adapted modules) and the adapters' fills, as
    one record for :func:`~lightning_3d.parallel.materialize.materialize`."""

    def __init__(self, base: Any, adapters: DeferredInit) -> None:
        self.base, self.adapters = base, adapters

    def planned(self) -> list[str]:
        return [*self.base.planned(), *self.adapters.planned()]

    def check(self, owner: nn.Module) -> None:
        self.base.check(owner)
        self.adapters.check(owner)

    def fill(self, owner: nn.Module) -> int:
        return self.base.fill(owner) + self.adapters.fill(owner)


def defer_adapters(model: nn.Module, adapted: list[str]) -> None:
    """Give ``model`` (on ``meta``, its ``deferred_init`` a record with a ``keys`` map of model
    name -> stored name, as ``PretrainedWeights``) one record for base and adapters; ``adapted``:
    the adapted modules' names. ``ValueError`` for a record without names to move."""
    record = model.deferred_init
    keys = getattr(record, "keys", None)
    if not isinstance(keys, dict):
        raise ValueError(
            f"adapters on a model built on meta need its weights' record to name its "
            f"tensors; {type(record).__name__} does not: build the model eagerly "
            "(deferred_init=False)"
        )
    inits = []
    for name in adapted:
        for leaf in ("weight", "bias"):
            if f"{name}.{leaf}" in keys:  # the base weight moved into peft's base_layer
                keys[f"{name}.base_layer.{leaf}"] = keys.pop(f"{name}.{leaf}")
        layer = model.get_submodule(name)
        for key in layer.lora_A:
            a, b = f"{name}.lora_A.{key}.weight", f"{name}.lora_B.{key}.weight"
            inits.append(ParamInit(a, tuple(model.get_parameter(a).shape), _kaiming))
            inits.append(ParamInit(b, tuple(model.get_parameter(b).shape), _zeros))
    model.deferred_init = AdaptedRecord(record, DeferredInit.capture(inits))
