"""What ``ThreeDStrategy`` does to the user's optimizers and Lightning's precision plugin.

A mixin: FSDP2 mixed-precision / CPU-offload policies under ZeRO-3, the 16-mixed loss scale and
overflow checks shared by every rank, clipping by the global norm over shards and pipeline
stages, and wrapping the (already ZeRO-sharded) optimizers in :class:`OffloadedAdam`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_3d.offload import OffloadedAdam
from lightning_3d.parallel.clip import clip_grad_norm_


class OptimizerWiring:
    """Mixin for ``ThreeDStrategy``; uses its ``precision_plugin``, ``optimizers``,
    ``root_device``, ``_offload``, ``_pp_group`` and ``_norm_duplicates``."""

    def _fsdp_policies(self) -> dict[str, Any]:
        """FSDP2 policies under ZeRO-3. Mixed precision: parameters are gathered in the compute
        dtype (half the all-gather bytes) and gradients reduce-scattered in fp32; the sharded
        fp32 parameters are the master weights the optimizer steps. ``offload_params``: the sharded
        parameters (and gradients) live in CPU memory (pinned, on an accelerator) and are copied
        to the device per block; the offloaded optimizer then steps them in place. (On a CPU
        device this changes where nothing lives, but runs the same FSDP2 code path.)"""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        policies: dict[str, Any] = {}
        compute = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(self.precision_plugin.precision))
        if compute is not None:
            policies["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        if self._offload["params"]:
            policies["offload_policy"] = CPUOffloadPolicy(pin_memory=self.root_device.type != "cpu")
        return policies

    def _scale_loss(self, loss: Tensor) -> Tensor:
        """The loss as backward should see it: scaled by the dynamic loss scale under 16-mixed."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler.scale(loss) if scaler is not None else loss

    def _share_overflow_checks(self) -> None:
        # 16-mixed: the grad scaler checks this rank's gradients for inf/nan before the step —
        # a ZeRO slice, a tensor shard, a pipeline stage. If any rank found one, every rank
        # must skip the step (and lower the scale), or the ranks' weights part ways.
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None or "unscale_" in vars(scaler):
            return
        unscale = scaler.unscale_

        def unscale_(optimizer: Optimizer) -> None:
            unscale(optimizer)
            for found in scaler._found_inf_per_device(optimizer).values():  # noqa: SLF001
                dist.all_reduce(found, op=dist.ReduceOp.MAX)

        scaler.unscale_ = unscale_

    def _use_global_norm_clipping(self) -> None:
        # Lightning clips through the precision plugin with torch's clip_grad_norm_, which
        # cannot mix plain tensors with DTensors of different placements (TP + ZeRO).
        plugin = self.precision_plugin

        # Pipeline stages own disjoint parameters: their squared norms add up over pp.
        pp_group = self._pp_group

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
            clip_grad_norm_(plugin.main_params(optimizer), clip_val, sum_over=pp_group,
                            skip_in_norm=self._norm_duplicates())

        plugin.clip_grad_by_norm = clip_grad_by_norm

    def _offload_optimizers(self) -> None:
        # After ZeRO has rewritten the optimizer to its shards: only this rank's shard of the
        # state moves to CPU / NVMe. The wrapper shares the param groups, so LR schedulers built
        # on the user's optimizer keep steering it.
        if self._offload["device"] == "none":
            return
        wrapped = []
        for optimizer in self.optimizers:
            offloaded = OffloadedAdam.from_optimizer(
                optimizer, self._offload["device"], self._offload["path"], self._offload["chunk_bytes"]
            )
            optimizer._opt_called = True  # its step is now the wrapper's: no "scheduler before step" warning
            wrapped.append(offloaded)
            engine = self.parallelized.engine_for(optimizer)
            if engine is not None:
                self.parallelized.bind(offloaded, engine)
        self.optimizers = wrapped
