"""ZeRO-3 on the data-parallel axis with FSDP2 (``fully_shard``).

Each transformer block becomes its own FSDP unit so that only one block's full parameters
exist at a time: they are all-gathered just before the block runs and freed right after
(``reshard_after_forward=True``), gathered again for its backward, and its gradients are
reduce-scattered as soon as they are produced. Parameters, gradients and optimizer state are
then all ``DTensor`` shards (dim 0 over the data axis): 16Ψ/N bytes per rank for fp32 Adam.

Two units skip the regather (without a pipeline): the outer unit (embeddings, norm, head), whose
backward starts right after its forward — FSDP2's own default for a root — and the last block,
whose backward follows its forward with only the head in between. Freeing and regathering them
costs an all-gather each per step; keeping them costs one block's full parameters while the
head and the loss run (the step's peak if that is where the logits peak), nothing after.

On gloo every unit gathers and reduce-scatters point to point (``point_to_point.py``) through
FSDP2's custom-communication hooks, as ZeRO 1-2 do: the same bytes, without gloo's copies.

Under gradient accumulation FSDP2 does all of that on every micro-batch: ``m`` times the
gathers and reduce-scatters of one step. :class:`Zero3Options` ``keep_gathered`` trades memory
for those bytes (:func:`accumulate_gathered`): the units stay gathered and their gradients
unsharded through the step's micro-batches, and only the last one's backward reduce-scatters
the sum and frees the gathered weights — one gather and one reduce-scatter a step, for the
stage's whole parameters (compute dtype) and whole gradients (reduce dtype) held meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Zero3Options:
    """The ZeRO-3 engine's options (the ``fsdp`` group of :class:`~lightning_3d.options.Plan`)."""

    keep_gathered: bool = False
    """Under gradient accumulation (Lightning's ``accumulate_grad_batches`` > 1, no pipeline),
    keep every unit's gathered weights and its unsharded gradients from the step's first
    micro-batch to its last, and reduce-scatter once, on the last (option
    ``zero3_keep_gathered``). Saves ``2m - 1`` gathers and ``m - 1`` reduce-scatters of ``m``
    micro-batches, for the whole stage's weights in the compute dtype and gradients in the
    reduce dtype on every rank during the step (the planner counts both). No effect without
    accumulation; refused with a pipeline (torch's stages drive FSDP2 there) and with
    ``offload_params`` (the weights would stay on the device)."""

    def problems(self) -> list[str]:
        """What is wrong with these values, in the option names users give (empty: nothing)."""
        if not isinstance(self.keep_gathered, bool):
            return [f"zero3_keep_gathered={self.keep_gathered!r} must be True or False"]
        return []


def accumulate_gathered(module: nn.Module, last: bool) -> None:
    """Set ``module``'s FSDP2 units for one micro-batch of an accumulated step under
    ``keep_gathered``: no resharding after forward; before the ``last`` micro-batch no gradient
    reduction and no resharding after backward either, so the next micro-batch finds the
    weights gathered and adds to the unsharded gradients. The last one's backward reduces and
    reshards as usual; :func:`end_accumulation` then restores the forward resharding."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_reshard_after_forward(False, recurse=False)
            unit.set_requires_gradient_sync(last, recurse=False)
            unit.set_reshard_after_backward(last, recurse=False)


def end_accumulation(module: nn.Module) -> None:
    """:func:`apply_zero3`'s resharding after forward again (no pipeline): every block but the
    last reshards, the outer units and the last block stay gathered until their backward."""
    from torch.distributed.fsdp import FSDPModule

    blocks = [b for b in find_blocks(module) if isinstance(b, FSDPModule)]
    for block in blocks[:-1]:
        block.set_reshard_after_forward(True, recurse=False)
    # A unit inside a block (its experts: parallel/expert_fsdp.py) always reshards.
    for block in blocks:
        for inner in block.modules():
            if inner is not block and isinstance(inner, FSDPModule):
                inner.set_reshard_after_forward(True, recurse=False)


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the elements of every ``nn.ModuleList`` it contains, but
    not of one inside a block (LongCat-Flash's layers hold lists of their own): a block is one
    unit, and FSDP2 cannot shard a module inside one it has sharded already."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()  # the modules of the blocks found so far
    for child in module.modules():
        if isinstance(child, nn.ModuleList) and id(child) not in inside:
            found = [m for m in child if any(p.requires_grad for p in m.parameters())]
            blocks.extend(found)
            inside.update(id(sub) for m in found for sub in m.modules())
    return blocks


def apply_zero3(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    roots: Optional[list[nn.Module]] = None,
    scatter: str = "auto",
    **fsdp_kwargs,
) -> list[nn.Module]:
    """Shard ``module`` with FSDP2, one unit per block plus outer units for the rest.

    ``module`` is typically a ``LightningModule``: its own ``forward`` may never run (Lightning
    calls ``training_step``), so the outer units are its direct children, whose forwards do run
    — or, under a pipeline, ``roots``: the stage modules the schedule calls. ``scatter``: how
    the units gather and reduce-scatter (:func:`~lightning_3d.parallel.point_to_point.
    use_point_to_point`; ``"auto"``: point to point on gloo). Returns the modules that became
    FSDP units.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from lightning_3d.parallel.point_to_point import (
        GatherInPlace,
        ScatterToOwners,
        use_point_to_point,
    )

    point_to_point = use_point_to_point(dp_mesh.get_group(), scatter)

    # Under a pipeline every stage runs several micro-batch forwards before their backwards:
    # there every unit reshards after each forward.
    keep = roots is None
    units: list[nn.Module] = []
    blocks = find_blocks(module)
    for index, block in enumerate(blocks):
        last = keep and index == len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=not last, **fsdp_kwargs)
        units.append(block)
    for child in roots if roots is not None else module.children():
        has_params = any(True for _ in child.parameters())
        if has_params and not isinstance(child, FSDPModule):
            # The outer unit holds what no block owns (embeddings, final norm, head). ``None``:
            # FSDP2 keeps the root gathered from forward to backward, resharding the others.
            fully_shard(
                child, mesh=dp_mesh, reshard_after_forward=None if keep else True, **fsdp_kwargs
            )
            units.append(child)
    if point_to_point:
        for unit in units:
            unit.set_custom_all_gather(GatherInPlace())
            unit.set_custom_reduce_scatter(ScatterToOwners())
    return units


def keep_head_gathered(module: nn.Module, stages: Optional[list[nn.Module]]) -> bool:
    """With the chunked loss (``loss_chunks`` > 1) under a pipeline: the last stage's outer unit
    (final norm and head) is not resharded after the stage's forward. That stage ends at the
    norm and the pipeline's loss runs the head afterwards, outside any forward FSDP2 hooks: it
    must find the gathered weight, not the shard. The gradient the loss computes lands in the
    gathered parameter's ``.grad`` and is reduce-scattered with the unit's others at the end of
    the step, as torch's pipeline stages drive FSDP2 anyway. Cost: the last stage's outer unit
    (the head, ``V x D`` in the compute dtype) stays gathered from the step's first forward,
    where a later forward resharded it before; no gather is added. The step's peak is unchanged:
    torch's stages keep every unit gathered from its backward to the step's end (the planner's
    ``pipeline_held_bytes`` counts the stage's whole weights there, the head among them). The
    alternative, a gather around each loss call, would add one all-gather of the head per
    micro-batch. Returns whether a unit was changed."""
    from torch.distributed.fsdp import FSDPModule

    chunked = any(getattr(m, "loss_chunks", 1) > 1 for m in module.modules())
    changed = False
    for stage in stages or []:
        if chunked and getattr(stage, "is_last", False) and isinstance(stage, FSDPModule):
            stage.set_reshard_after_forward(False, recurse=False)
            changed = True
    return changed


def fsdp_policies(precision: str, offload_params: bool, device_type: str) -> dict:
    """FSDP2 keyword arguments for ``apply_zero3`` under a Lightning ``precision`` setting.

    Mixed precision: parameters are gathered in the compute dtype (half the all-gather bytes)
    and gradients reduce-scattered in fp32; the sharded fp32 parameters are the master weights
    the optimizer steps. ``offload_params``: the sharded parameters (and gradients) live in CPU
    memory (pinned, on an accelerator) and are copied to the device per block; the offloaded
    optimizer then steps them in place. (On a CPU device this changes where nothing lives, but
    runs the same FSDP2 code path.)"""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    policies: dict = {}
    compute = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    if compute is not None:
        policies["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute, reduce_dtype=torch.float32
        )
    if offload_params:
        policies["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type != "cpu")
    return policies
