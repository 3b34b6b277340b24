"""Where ZeRO-Offload's split puts each byte of model state, counted from the tensors.

Under ``precision="bf16-true"`` with an offload device at ZeRO 0-2 the flat-bucket engine keeps
the bf16 weights on the device and the fp32 masters and their gradients in host memory
(``parallel/zero.py``, ``master_device="cpu"``); :class:`~lightning_3d.offload.OffloadedAdam`
keeps Adam's moments in its store (RAM, or the drive under ``"nvme"``) and steps the host masters
in place. On a machine without an accelerator "device" and "host" are the same RAM, so the bytes
are counted by role, not by ``tensor.device``: what the engine's buckets and the module hold is
the device's, what the engine keeps for the optimizer and the store hold is the host's (or the
drive's). :func:`split_formula` is what the split should cost, for the bench and the tests.

Not imported by ``lightning_3d.offload``: only the bench and the tests count.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_3d.parallel.masters import storage_counter


def split_state_bytes(
    module: nn.Module, optimizer: torch.optim.Optimizer, engine: Optional[Any]
) -> dict[str, int]:
    """Model-state bytes of this rank by where they live, each storage counted once:

    ``device_params`` (the module's weights: the flat buckets), ``device_grads`` (gradient
    buffers the engine keeps on the device between steps, and any ``.grad`` of the module's
    parameters), ``device_staging_peak`` (the most gradient staging the engine held at once during
    a backward: a few buckets, freed as they land), ``host_masters`` and ``host_grads`` (fp32
    masters and their gradient accumulators in host memory), ``host_landing`` (the pinned
    buffers parts of buckets land through), ``store`` (the offloaded optimizer's
    state: moments, and masters where it keeps its own) and ``store_on_drive`` (1 under
    ``"nvme"``, where the store is a file)."""
    count = storage_counter()

    buckets = engine.buckets if engine is not None else []
    hosted = [b for b in buckets if engine.master_device is not None and b.master is not None]
    host_masters = count([b.master for b in hosted])
    host_grads = count([b.shard_grad for b in hosted])
    params = list(module.parameters())
    device_params = count(params)
    kept = [t for b in buckets if b not in hosted for t in (b.grad, b.shard_grad)]
    device_grads = count(kept + [p.grad for p in params])
    store = getattr(optimizer, "offloaded_state_bytes", None)
    if store is None:  # not offloaded: the optimizer's own state
        values = [v for s in optimizer.state.values() for v in s.values()]
        store = count([v for v in values if isinstance(v, Tensor)])
    return {
        "device_params": device_params,
        "device_grads": device_grads,
        "device_staging_peak": engine.staging_peak_bytes if engine is not None else 0,
        "host_masters": host_masters,
        "host_grads": host_grads,
        "host_landing": engine.landing_bytes if engine is not None else 0,
        "store": int(store),
        "store_on_drive": int(getattr(optimizer, "device", "cpu") == "nvme"),
    }


def split_formula(num_params: int, stage: int, data: int) -> dict[str, float]:
    """ZeRO-Offload's split per rank for ``num_params`` (Ψ) at ZeRO ``stage`` over ``data``
    ranks: bf16 weights on the device (2Ψ), fp32 masters (4Ψ) and their fp32 gradient
    accumulators (4Ψ) in host memory, Adam's two fp32 moments (8Ψ) in the store; the host parts
    whole at stage 0 and divided by ``data`` from stage 1. Gradient staging is bounded by the
    bucket size, not by Ψ, so it is not in the formula."""
    share = 1 if stage == 0 else data
    return {
        "device_params": 2.0 * num_params,
        "host_masters": 4.0 * num_params / share,
        "host_grads": 4.0 * num_params / share,
        "store": 8.0 * num_params / share,
    }
