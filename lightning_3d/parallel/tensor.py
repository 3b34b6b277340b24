"""Tensor parallelism on the ``tp`` axis: apply a plan (module-name pattern -> DTensor style).

A plan is data: an ordered mapping from ``fnmatch`` patterns over the full module names of the
``LightningModule`` (``"model.blocks.*.attn.wq"``; ``*`` also crosses dots) to PyTorch parallel
styles. :func:`resolve_plan` expands it against the module's real names, refusing patterns that
match nothing, styles given a module type they cannot split and dimensions the tensor size does
not divide — before any collective runs — and :func:`apply_tensor_parallel` hands the result to
``parallelize_module``.

Besides ``nn.Linear`` and ``nn.Embedding``, the styles here split ``transformers``' ``Conv1D``
(GPT-2's projections: ``y = x @ W + b`` with ``W`` of shape (in, out), the transpose of
``nn.Linear``'s). ``transformers`` stays optional: a ``Conv1D`` is recognised only if its module
was already imported, which any model holding one has done.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from lightning_3d.parallel.tied import check_tied_styles, retie

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_3d.observe.telemetry import Telemetry

# Set on a module whose parameters' output features FusedColwiseParallel regrouped:
# (chunks, tp size) for nn.Linear, (chunks, tp size, -1) for Conv1D, whose output features are
# the last dim of both weight and bias — so the tuple unpacks straight into regroup_fused_rows.
# On the module, not the parameters: Module._apply swaps DTensor parameters for new objects.
FUSED_ROWS_ATTR = "_l3d_fused_rows"


# ---------------------------------------------------------------------------- layer kinds
def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` ``Conv1D``, without importing ``transformers``."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and isinstance(module, utils.Conv1D)


def layer_kind(module: nn.Module) -> str | None:
    """``"Linear"``, ``"Conv1D"`` or ``"Embedding"``: the layer types the split styles know."""
    if isinstance(module, nn.Linear):
        return "Linear"
    if isinstance(module, nn.Embedding):
        return "Embedding"
    return "Conv1D" if is_conv1d(module) else None


def layer_features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or Conv1D (``nx``, ``nf`` in ``transformers``' names)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]


def split_dim(module: nn.Module, style: ParallelStyle, pname: str) -> int | None:
    """The dim of ``module``'s parameter ``pname`` that ``style`` shards on the tensor axis, or
    ``None`` where it stays whole (a row-parallel bias, a style that splits no parameters).

    Column parallelism splits output features: dim 0 of a Linear's weight and bias, the last dim
    of a ``Conv1D``'s (``(in, out)`` weight, ``(out,)`` bias) and dim 1 of an embedding; row
    parallelism splits the input features of a weight: dim 1 of a Linear's, dim 0 of a
    ``Conv1D``'s and the vocabulary (dim 0) of an embedding. What the styles below place, read
    without placing anything (works on ``meta``)."""
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return None
    kind = layer_kind(module)
    param = getattr(module, pname, None)
    if kind is None or not isinstance(param, torch.Tensor):
        return None
    if isinstance(style, ColwiseParallel):
        return {"Linear": 0, "Embedding": 1, "Conv1D": param.dim() - 1}[kind]
    if pname != "weight":
        return None  # a row-parallel bias is added once, after the partial sums are combined
    return {"Linear": 1, "Embedding": 0, "Conv1D": 0}[kind]


# Torch's own ColwiseParallel / RowwiseParallel split these; the subclasses below declare theirs.
TORCH_LAYER_KINDS = ("Linear", "Embedding")


def _distribute(
    style: ColwiseParallel | RowwiseParallel, module: nn.Module, mesh: DeviceMesh, partition_fn
):
    """What torch's Colwise/RowwiseParallel._apply does, with our own ``partition_fn``."""
    return distribute_module(
        module,
        mesh,
        partition_fn,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


def _shard_params(
    module: nn.Module, mesh: DeviceMesh, placements: Mapping[str, Placement], src_rank
) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param.detach(), mesh, [placements[pname]], src_data_rank=src_rank)
        module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))


# -------------------------------------------------------------------------------- styles
class ColwiseConv1DParallel(ColwiseParallel):
    """``ColwiseParallel`` that also splits a ``Conv1D``: its output features are dim 1 of the
    weight (dim 0 of the bias), so each rank keeps a block of weight columns.

    Example: ``{"*.mlp.c_fc": ColwiseConv1DParallel()}`` on Hugging Face's GPT-2.
    """

    layer_kinds = ("Linear", "Embedding", "Conv1D")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return _distribute(self, module, device_mesh, self._partition_conv1d_fn)

    def _partition_conv1d_fn(self, name, module, device_mesh):
        _shard_params(
            module, device_mesh, {"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank
        )


class RowwiseConv1DParallel(RowwiseParallel):
    """``RowwiseParallel`` that also splits a ``Conv1D``: its input features are dim 0 of the
    weight; the bias is added once, after the partial sums are combined (replicated)."""

    layer_kinds = ("Linear", "Embedding", "Conv1D")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)  # what torch sets for nn.Linear
        return _distribute(self, module, device_mesh, self._partition_conv1d_fn)

    def _partition_conv1d_fn(self, name, module, device_mesh):
        _shard_params(
            module, device_mesh, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank
        )


class FusedColwiseParallel(ColwiseConv1DParallel):
    """Column parallelism for a fused projection (e.g. GPT-2's ``c_attn`` = [q; k; v]).

    Plain column sharding would hand rank 0 all of q and part of k. The output features are
    regrouped first so that rank r's contiguous block is [q_r; k_r; v_r]: the local output still
    splits into ``chunks`` equal parts, each holding this rank's heads. The regrouping is
    recorded on the module (``FUSED_ROWS_ATTR``) so full state dicts can undo it.
    """

    layer_kinds = ("Linear", "Conv1D")

    def __init__(self, chunks: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.chunks = chunks

    def _partition_linear_fn(self, name, module, device_mesh):
        self._regroup_and_shard(module, device_mesh, dim=0)

    def _partition_conv1d_fn(self, name, module, device_mesh):
        self._regroup_and_shard(module, device_mesh, dim=-1)

    def _regroup_and_shard(self, module: nn.Module, device_mesh: DeviceMesh, dim: int) -> None:
        tp = device_mesh.size()
        for pname, param in list(module.named_parameters(recurse=False)):
            rows = regroup_fused_rows(param.detach(), self.chunks, tp, dim)
            dist = distribute_tensor(rows, device_mesh, [Shard(dim % param.dim())])
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))
        setattr(module, FUSED_ROWS_ATTR, (self.chunks, tp) if dim == 0 else (self.chunks, tp, dim))


class LocalSizes(ParallelStyle):
    """Divide size attributes a module's forward reads (e.g. Hugging Face GPT-2 attention's
    ``split_size``, which splits the fused q/k/v output) by the tensor size, so they describe
    this rank's heads. Attributes the module lacks are skipped: a model that reads its local
    sizes from the projection outputs needs none.

    Example: ``{"*.attn": LocalSizes(("split_size", "num_heads", "embed_dim"))}``.
    """

    def __init__(self, attrs: Sequence[str]) -> None:
        super().__init__()
        self.attrs = tuple(attrs)

    def sizes(self, module: nn.Module) -> dict[str, int]:
        return {
            a: getattr(module, a) for a in self.attrs if isinstance(getattr(module, a, None), int)
        }

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for attr, size in self.sizes(module).items():
            setattr(module, attr, size // device_mesh.size())
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.attrs})"


class ReplicatedGradSum(ParallelStyle):
    """Replicated parameters of a module that sees only this rank's share of an activation: a
    per-head norm after a column-parallel projection (Qwen3's ``q_norm`` on its local heads).
    Its output needs no collective, but each rank's weight gradient covers its own heads only,
    so the gradients must be summed over ``tp`` (``transformers``' ``replicated_with_grad_allreduce``).

    The parameters become ``Replicate`` DTensors and the input a DTensor sharded on ``dim`` (the
    heads of a ``(B, T, H, D)`` tensor by default), so the weight gradients come out as partial
    sums that the ZeRO engines and FSDP2 reduce, as for sequence parallelism's norms; the output
    is local again.

    Example: ``{"*.self_attn.q_norm": ReplicatedGradSum()}``.
    """

    def __init__(self, dim: int = -2) -> None:
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            # Rank 0's values on every rank, as torch's own styles distribute them.
            _shard_params(
                mod, mesh, {n: Replicate() for n, _ in mod.named_parameters(recurse=False)}, 0
            )

        def shard_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            x, *rest = inputs
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(self.dim % x.dim())], run_check=False)
            return (x, *rest)

        def local_output(mod: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, replicate, shard_input, local_output)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim})"


class PrepareHiddenStates(PrepareModuleInput):
    """``PrepareModuleInput`` for the residual stream alone: the first positional input, or the
    keyword ``hidden_states``. Whatever else the caller passes (a cache, masks, position
    embeddings; positionally or not, however many) goes through untouched — Hugging Face
    decoders pass their blocks differing numbers of positional arguments."""

    def __init__(
        self,
        *,
        input_layout: Placement,
        desired_layout: Placement,
        use_local_output: bool = True,
        keyword: str = "hidden_states",
    ) -> None:
        super().__init__(
            input_layouts=(input_layout,),
            desired_input_layouts=(desired_layout,),
            input_kwarg_layouts={keyword: input_layout},
            desired_input_kwarg_layouts={keyword: desired_layout},
            use_local_output=use_local_output,
        )

    def _prepare_input_fn(self, inputs, device_mesh):
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if not inputs:  # the hidden states came as a keyword
            return inputs
        first = self._prepare_input_arg(
            inputs[0], device_mesh, self.input_layouts[0], self.desired_input_layouts[0]
        )
        return (first, *inputs[1:])


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor``, ``t`` itself otherwise.

    The project's one definition. Contract: the very tensor holding this rank's elements — no
    copy and no autograd edge (unlike ``DTensor.to_local()``, which under grad mode returns a
    differentiable view) — so callers may write into it in place (ZeRO buckets, checkpoint
    loads, offload) or compare its storage (activation accounting: a view of it would share
    the same storage, so either answers that question alike)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def plain_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s values: ``t`` itself, or each inner tensor of a
    wrapper subclass (a DTensor's local shard; torchao's ``NF4Tensor``: codes and scales), or
    bitsandbytes' 4-bit codes and the scales of its ``quant_state``."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    t = local_tensor(t)
    state = getattr(t, "quant_state", None)  # bitsandbytes' Params4bit: codes, then the scales
    if state is not None:
        nested = getattr(state, "state2", None)
        scales = [state.absmax, *([nested.absmax, state.offset] if nested is not None else [])]
        return [t.data, *(s for s in scales if isinstance(s, torch.Tensor))]
    if not is_traceable_wrapper_subclass(t):
        return [t]
    inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]]
    return [
        part for value in inner if isinstance(value, torch.Tensor) for part in plain_parts(value)
    ]


def by_device_and_dtype(
    tensors: Iterable[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """This rank's parts of ``tensors`` (:func:`local_tensor`) grouped by device and dtype, in
    order: the unit of one fused ``torch._foreach_*`` call."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        local = local_tensor(t)
        groups.setdefault((local.device, local.dtype), []).append(local)
    return groups


def regroup_fused_rows(
    t: torch.Tensor, chunks: int, tp: int, dim: int = 0, inverse: bool = False
) -> torch.Tensor:
    """Along ``dim`` (the output features: 0 for nn.Linear, -1 for Conv1D):
    [c0 | c1 | c2] with each chunk split in tp parts -> [c0_0 c1_0 c2_0 | c0_1 c1_1 c2_1 | ...]."""
    moved = t.movedim(dim, 0)
    rest = moved.shape[1:]
    if inverse:  # (tp, chunks, rows, ...) back to (chunks, tp, rows, ...)
        out = moved.reshape(tp, chunks, -1, *rest).transpose(0, 1).reshape(moved.shape)
    else:
        out = moved.reshape(chunks, tp, -1, *rest).transpose(0, 1).reshape(moved.shape)
    return out.movedim(0, dim).contiguous()


def name_matches(name: str, pattern: str) -> bool:
    """``fnmatch`` over a full module name; ``"*.norm"`` also matches a top-level ``norm``."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase("." + name, pattern)


# ----------------------------------------------------------------------------- resolution
def resolve_plan(
    module: nn.Module, plan: Mapping[str, ParallelStyle], tp: int, require_all: bool = True
) -> dict[str, ParallelStyle]:
    """Expand ``plan`` to concrete module names; ``ValueError`` for a pattern that matches nothing,
    a style given a module type it cannot split, or a dimension ``tp`` does not divide.

    Shapes and names only (works on ``meta``), so it runs before any collective. Torch's own
    ``ColwiseParallel`` / ``RowwiseParallel`` (what style names give) matched to a ``Conv1D``
    resolve to the subclasses here with the same settings; the plan itself is left as it is.
    ``require_all=False`` lets patterns match nothing (a pipeline stage lacks other stages' modules).
    """
    names = [name for name, _ in module.named_modules() if name]
    resolved: dict[str, ParallelStyle] = {}
    unmatched = []
    for pattern, style in plan.items():
        hits = [n for n in names if name_matches(n, pattern)]
        if not require_all:  # a pipeline stage: another stage's module left a weightless stand-in
            hits = [n for n in hits if _has_weights(module.get_submodule(n))]
        if not hits:
            unmatched.append(pattern)
        for name in hits:
            resolved.setdefault(name, style)  # the first pattern that names a module wins
    if unmatched and require_all:
        raise ValueError(
            f"tensor-parallel plan pattern(s) {unmatched} match no module of {type(module).__name__}"
        )
    resolved = {
        name: _for_layer(style, module.get_submodule(name)) for name, style in resolved.items()
    }
    unsupported = [
        p for name, style in resolved.items() if (p := _unsupported(module, name, style))
    ]
    if unsupported:
        raise ValueError(
            "tensor-parallel plan gives styles module types they cannot split: "
            + "; ".join(unsupported)
        )
    problems = [
        p for name, style in resolved.items() for p in _divisibility(module, name, style, tp)
    ]
    if problems:
        raise ValueError(f"tensor={tp} does not divide the model: " + "; ".join(problems))
    return resolved


def _has_weights(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _for_layer(style: ParallelStyle, module: nn.Module) -> ParallelStyle:
    """Torch's own Colwise/RowwiseParallel (what style names give) cannot split a ``Conv1D``:
    for one, the same settings in the subclass that can."""
    twin = {ColwiseParallel: ColwiseConv1DParallel, RowwiseParallel: RowwiseConv1DParallel}.get(
        type(style)
    )
    if twin is None or not is_conv1d(module):
        return style
    upgraded = twin.__new__(twin)
    upgraded.__dict__.update(vars(style))
    return upgraded


def _unsupported(root: nn.Module, name: str, style: ParallelStyle) -> str | None:
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return None  # norms, input preparation, size attributes: any module
    module = root.get_submodule(name)
    kinds = getattr(style, "layer_kinds", TORCH_LAYER_KINDS)
    if layer_kind(module) in kinds:
        return None
    cls = type(module)
    return f"{name} is a {cls.__module__}.{cls.__qualname__}, and {type(style).__name__} splits only {', '.join(kinds)}"


def _divisibility(root: nn.Module, name: str, style: ParallelStyle, tp: int) -> list[str]:
    module = root.get_submodule(name)
    if isinstance(style, LocalSizes):
        dims = style.sizes(module)
    elif isinstance(module, nn.Embedding) and isinstance(style, RowwiseParallel):
        dims = {"num_embeddings (vocabulary)": module.num_embeddings}
    elif isinstance(module, nn.Embedding) and isinstance(style, ColwiseParallel):
        dims = {"embedding_dim": module.embedding_dim}
    elif layer_kind(module) in ("Linear", "Conv1D") and isinstance(style, ColwiseParallel):
        return _colwise_problems(root, name, getattr(style, "chunks", 1), tp)
    elif layer_kind(module) in ("Linear", "Conv1D") and isinstance(style, RowwiseParallel):
        dims = {"in_features": layer_features(module)[0]}
    else:
        dims = {}
    return [
        f"{name}: {what} {size} is not divisible by tensor={tp}"
        for what, size in dims.items()
        if size % tp
    ]


def _colwise_problems(root: nn.Module, name: str, chunks: int, tp: int) -> list[str]:
    """Output features (per fused chunk) and, where the parent names its ``head_dim``, heads."""
    out = layer_features(root.get_submodule(name))[1]
    if out % chunks:
        return [f"{name}: out_features {out} do not split into {chunks} fused chunks"]
    dims = {"out_features": out // chunks}
    parent = root.get_submodule(name.rpartition(".")[0]) if "." in name else root
    head_dim = getattr(parent, "head_dim", None)
    if isinstance(head_dim, int) and head_dim and out % (head_dim * chunks) == 0:
        dims["heads"] = out // (head_dim * chunks)
    return [
        f"{name}: {what} {size} is not divisible by tensor={tp}"
        for what, size in dims.items()
        if size % tp
    ]


def apply_tensor_parallel(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    plan: Mapping[str, ParallelStyle],
    require_all: bool = True,
    ties: Sequence[tuple[str, ...]] = (),
    telemetry: Optional[Telemetry] = None,
) -> dict:
    """Rewrite ``module`` in place with ``plan`` on ``tp_mesh``; returns the resolved plan.

    ``ties``: the tied weights :func:`~lightning_3d.parallel.tied.find_tied` found while the
    model was whole, refused if the plan splits them differently and made one parameter again
    after. ``telemetry``: told a ``"logits"`` event per forward of the vocab-parallel head."""
    resolved = resolve_plan(module, plan, tp_mesh.size(), require_all)
    check_tied_styles(module, resolved, ties)
    parallelize_module(module, tp_mesh, resolved)
    # Each module got its own sharded copy: make them one again.
    retie(module, ties)
    if telemetry is not None:
        _publish_logits_sizes(module, resolved, telemetry)
    return resolved


def _publish_logits_sizes(module: nn.Module, resolved: dict, telemetry: Telemetry) -> None:
    """A ``"logits"`` event per forward of the vocab-parallel head (local and full bytes)."""

    def publish(head: nn.Module, inputs: object, output: object) -> None:
        if isinstance(output, DTensor):
            telemetry.publish(
                "logits",
                local_bytes=output.to_local().numel() * output.element_size(),
                dense_bytes=output.numel() * output.element_size(),
            )

    for name, style in resolved.items():
        # The loss-parallel head: its logits stay sharded over the vocabulary.
        if isinstance(style, ColwiseParallel) and not style.use_local_output:
            module.get_submodule(name).register_forward_hook(publish)
