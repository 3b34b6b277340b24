"""The adapters' share of a training step's forward and backward, timed by module hooks.

Every peft adapter submodule (``lora_dropout``, ``lora_A``, ``lora_B`` of each adapted
projection) gets a forward pre-hook and hook and a backward pre-hook and hook; the time between
each pair is the adapter's. The share is their sum over the timed steps against the steps' own
forward + backward time, measured in one process on the CPU (synchronous: each op has finished
when its hook runs; a GPU would need events). What it leaves out: peft's own scaling multiply
and the add of the adapter's output to the base's, outside the submodules; the weight gradient
of an ``lora_A`` whose input needs none (the first block's, behind a frozen embedding: its
backward hooks fire around the output's gradient only); and the optimizer step (the adapters'
alone under LoRA: Adam over Φ values).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from torch import nn

ADAPTER_MODULES = ("lora_dropout", "lora_A", "lora_B")


def _timed(modules: list[nn.Module], totals: dict[str, float]) -> list[Any]:
    """Hooks adding each module's forward and backward time to ``totals``; their handles."""
    started: dict[tuple[int, str], float] = {}
    handles = []

    def begin(kind: str):
        def hook(module, *_):
            started[(id(module), kind)] = time.perf_counter()

        return hook

    def end(kind: str):
        def hook(module, *_):
            totals[kind] += time.perf_counter() - started.pop((id(module), kind))

        return hook

    for module in modules:
        handles += [
            module.register_forward_pre_hook(begin("forward")),
            module.register_forward_hook(end("forward")),
            module.register_full_backward_pre_hook(begin("backward")),
            module.register_full_backward_hook(end("backward")),
        ]
    return handles


def adapter_share(module: nn.Module, batch: torch.Tensor, steps: int) -> dict[str, float]:
    """Forward + backward of ``module`` (a ``HFCausalLM`` with adapters) on ``batch`` (token
    ids), ``1 + steps`` times (the first not timed): the step time and the adapters' part of it.
    """
    adapters = [  # peft's names end "<part>.default": "...q_proj.lora_A.default"
        m
        for name, m in module.named_modules()
        if name.count(".") and name.split(".")[-2] in ADAPTER_MODULES
    ]
    if not adapters:
        raise ValueError(f"{type(module).__name__} holds no adapter modules {ADAPTER_MODULES}")
    totals = {"forward": 0.0, "backward": 0.0}
    module.train()
    step_s = 0.0
    for step in range(1 + steps):
        handles = _timed(adapters, totals) if step else []  # the first step is not timed
        start = time.perf_counter()
        logits = module(batch)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        with warnings.catch_warnings():  # the first block's lora_A: see the module docstring
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss.backward()
        if step:
            step_s += time.perf_counter() - start
        module.zero_grad(set_to_none=True)
        for handle in handles:
            handle.remove()
    adapters_s = totals["forward"] + totals["backward"]
    return {
        "step_s": step_s / steps,
        "adapters_s": adapters_s / steps,
        "adapters_forward_s": totals["forward"] / steps,
        "adapters_backward_s": totals["backward"] / steps,
        "adapters_share": adapters_s / step_s,
        "modules_timed": len(adapters),
    }
