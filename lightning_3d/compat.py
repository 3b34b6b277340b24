"""The torch APIs that changed name inside the supported range (torch 2.11 and newer), in one place.

Newer torch (2.13 here) renamed the single-tensor collectives: ``all_gather_into_tensor`` became
``all_gather_single`` and ``reduce_scatter_tensor`` became ``reduce_scatter_single`` (same
arguments, same work on the backend; the old names still exist there, deprecated with a
``FutureWarning``). torch 2.11, what GPU machines often carry, has only the old names. Each
function below calls the newest name the running torch has, looked up at call time (so a test
can take the new name away, and :func:`tools.bench.comm.count_collectives`'s wrappers
are the functions called).

The pipeline stage's static shapes (:func:`static_stage_shapes`) and its runtime shape
inference (:func:`rng_neutral_stage`), the ``Metadata`` that ``dcp.save`` returns
(:func:`dcp_saved_metadata`) and the private resolution of a functional collective's group
(:func:`functional_process_group`) changed too. Every other torch
name the package refers to resolves on torch 2.11.0 as on 2.13.0 (checked by resolving each one
on both); add a function here, not a version test at the call site, when that stops being true.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor


def _newest(*names: str) -> Any:
    """The first of ``names`` that ``torch.distributed`` has (newest name first)."""
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"this torch has none of torch.distributed.{{{', '.join(names)}}}")


def all_gather_single(
    output: Tensor, input: Tensor, group: Optional[Any] = None, async_op: bool = False
) -> Any:
    """Gather every rank's ``input`` (same size everywhere) into ``output``, rank by rank
    (``output`` holds ``group size × input.numel()`` elements). ``torch.distributed.all_gather_single``
    (2.13+) or ``all_gather_into_tensor`` (before)."""
    return _newest("all_gather_single", "all_gather_into_tensor")(
        output, input, group=group, async_op=async_op
    )


def reduce_scatter_single(
    output: Tensor,
    input: Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: Optional[Any] = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``input`` over the group and give rank ``r`` the ``r``-th of its equal parts in
    ``output``. ``torch.distributed.reduce_scatter_single`` (2.13+) or ``reduce_scatter_tensor``
    (before)."""
    fn = _newest("reduce_scatter_single", "reduce_scatter_tensor")
    return fn(output, input, op=op, group=group, async_op=async_op)


def functional_process_group(group: Any) -> dist.ProcessGroup:
    """The process group a functional collective's ``group`` argument (a group, its name, a 1-D
    mesh or ``(mesh, dim)``) stands for. torch 2.13 resolves it with ``_resolve_group`` (a group
    or its name), torch 2.11 only with ``_resolve_group_name``; both private, hence here."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    resolve = getattr(funcol, "_resolve_group", None) or funcol._resolve_group_name
    resolved = resolve(group)
    return c10d._resolve_process_group(resolved) if isinstance(resolved, str) else resolved


def static_stage_shapes(inputs: tuple[Tensor, ...], outputs: tuple[Tensor, ...]) -> dict[str, Any]:
    """``PipelineStage`` keyword arguments that give a stage all its shapes up front, so that it
    exchanges none with its neighbours (what a fake world, where nothing arrives, needs).
    torch 2.13 also takes the gradients' shapes (``input_grads`` / ``output_grads``; the same
    as the activations' here) and otherwise agrees on them by a vote over send/recv at the
    first step; torch 2.11 takes only ``input_args`` / ``output_args`` and derives the rest."""
    from torch.distributed.pipelining import PipelineStage

    shapes: dict[str, Any] = {"input_args": inputs, "output_args": outputs}
    if "input_grads" in inspect.signature(PipelineStage.__init__).parameters:
        shapes.update(input_grads=inputs, output_grads=outputs)
    return shapes


def dcp_saved_metadata(returned: Any, directory: Any) -> Any:
    """The complete ``Metadata`` of a checkpoint ``dcp.save`` just wrote to ``directory``, given
    what it returned. torch 2.13 returns it with ``storage_data`` (where each item's bytes lie);
    torch 2.11 returns it without (``None``), so it is read back from the directory's
    ``.metadata`` then, which the save has finished writing on every rank by the time it returns
    (the coordinator writes it before the save's last collective ends)."""
    if getattr(returned, "storage_data", None) is not None:
        return returned
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(directory)).read_metadata()


def rng_neutral_stage(stage_class: type) -> type:
    """``stage_class`` (a ``PipelineStage`` subclass) made to leave the random generators as it
    found them while it infers its shapes.

    torch 2.11 infers a stage's shapes at its first step by running the stage's module once on
    zeros, in training mode: its dropout draws from the CPU (or device) generator before the
    step's real forward does. That first step is the first of every run, so a run resumed from a
    checkpoint draws once more than the uninterrupted run did at that step, after its RNG states
    were restored: dropout masks, and then losses, differ (by ~4e-3 at the first resumed step of
    a 2-stage GPT). torch 2.13 agrees on shapes by send/recv alone and has no
    ``_shape_inference``; the class is returned unchanged there."""
    infer = getattr(stage_class, "_shape_inference", None)
    if infer is None:
        return stage_class

    def _shape_inference(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = torch.device(self.device)
        devices = [] if device.type == "cpu" else [device]
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            return infer(self, *args, **kwargs)

    return type(
        stage_class.__name__,
        (stage_class,),
        {"_shape_inference": _shape_inference, "__doc__": stage_class.__doc__},
    )
