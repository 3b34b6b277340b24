"""Activation checkpointing: transformer blocks recompute their activations in backward.

A checkpointed block keeps only what ``torch.utils.checkpoint`` needs to re-run it (its inputs,
plus, for ``selective``, the outputs of the expensive ops) and recomputes the rest when backward
reaches it. Policies (``policy``):

- ``none``: nothing is recomputed (also undoes an earlier call).
- ``full``: every block.
- ``every_n``: the blocks whose index within their ``nn.ModuleList`` is a multiple of
  ``every_n`` (0, n, 2n, ...; so ``every_n=1`` is ``full``). The index is the list position,
  which pipeline stages keep (non-owned blocks become parameter-free placeholders), so a block
  is checkpointed or not regardless of the pipeline layout.
- ``selective``: every block, but matmul and attention outputs are saved (see :data:`SAVED_OPS`)
  and only the cheap ops (norms, activations, elementwise, views) are recomputed.

Blocks are found by the rule the FSDP code uses (:func:`~lightning_3d.parallel.fsdp.find_blocks`:
the trainable elements of every ``nn.ModuleList``), except that a block nested inside another
block is left alone: checkpointing the outer one already covers it.

No wrapper module is inserted (unlike ``checkpoint_wrapper``): the block's *instance* ``forward``
is replaced, so parameter names, state-dict keys and the module tree stay as they were, and
hooks registered on the block (FSDP2's unshard/reshard, tensor-parallel input preparation) still
run around the checkpointed region. In the recipe this comes after tensor parallelism and before
FSDP2 ``fully_shard``, as torchtitan orders it.

With ``offload=True`` (option ``activation_offload``) every outermost block's forward, checkpointed
or not, runs inside :func:`~lightning_3d.parallel.activation_offload.offloaded_saves`: what it saves
for backward waits in host memory. Under ``full`` that is the block's inputs only (what checkpoint
keeps); under ``selective`` the inputs, while the op outputs it caches stay on the device (they
live in checkpoint's own cache, not behind autograd's hooks).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from lightning_3d.parallel import activations
from lightning_3d.parallel.activation_offload import offloaded_saves
from lightning_3d.parallel.fsdp import find_blocks
from lightning_3d.parallel.tensor import local_tensor

POLICIES = ("none", "full", "every_n", "selective")
DEFAULT_EVERY_N = 2  # "every_n": blocks 0, 2, 4, ... recompute (the plan's default too)
_POLICY_ATTR = "_activation_checkpointing"  # instance attribute: this block's policy
_INNER_ATTR = "_activation_checkpointing_inner"  # an instance forward that was there before
_OFFLOAD_ATTR = "_activation_offload"  # instance attribute: this block's saves go to the host


def _ops(namespace: Any, *names: str) -> frozenset:
    return frozenset(getattr(namespace, n) for n in names if hasattr(namespace, n))


# Ops whose outputs ``selective`` saves (compared by overload packet): the FLOP-heavy ones.
# nn.Linear reaches the dispatcher as mm / addmm; attention as one of the fused SDPA kernels,
# or, on the math path, as bmm. Under tensor parallelism a row-parallel linear's output is
# all-reduced (reduce-scattered with sequence parallelism): saving the reduced output spares
# backward that collective too.
SAVED_OPS = _ops(
    torch.ops.aten,
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
) | _ops(torch.ops._c10d_functional, "all_reduce", "reduce_scatter_tensor")


@dataclass(frozen=True)
class ActivationCheckpointOptions:
    """Activation checkpointing's options (the ``ac`` group of
    :class:`~lightning_3d.options.Plan`), checked by :func:`ac_options`."""

    policy: str = "none"
    """One of :data:`POLICIES`: which blocks recompute their activations in backward."""
    every_n: int = DEFAULT_EVERY_N
    """With ``"every_n"``: blocks 0, n, 2n, ... recompute."""
    offload: bool = False
    """Each block's saved activations (under ``full``: its checkpointed inputs) wait in host
    memory between forward and backward (option ``activation_offload``): device memory for
    activations drops to what the running block needs, for two copies per saved byte."""


def ac_options(policy: str, every_n: int = DEFAULT_EVERY_N, offload: bool = False) -> dict:
    """Validate the activation-checkpointing options; returns them as a dict.

    Example::

        ac_options("every_n", 2)  # {"policy": "every_n", "every_n": 2, "offload": False}
    """
    if not isinstance(offload, bool):
        raise ValueError(f"activation_offload={offload!r} must be True or False")
    if policy not in POLICIES:
        raise ValueError(
            f"unknown activation checkpointing policy {policy!r}; known: {list(POLICIES)}"
        )
    if not isinstance(every_n, int) or isinstance(every_n, bool) or every_n < 1:
        raise ValueError(f"every_n={every_n!r} must be a positive integer (policy={policy!r})")
    return {"policy": policy, "every_n": every_n, "offload": offload}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op.overloadpacket not in SAVED_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    # A saved op is not re-run in backward, so it must not draw random numbers: the random ops
    # after it would then draw different ones than in forward (attention dropout, for one).
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" in names:
        i = names.index("dropout_p")
        dropout_p = (
            kwargs["dropout_p"] if "dropout_p" in kwargs else args[i] if i < len(args) else 0.0
        )
        if dropout_p > 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


class _ReportCached(TorchDispatchMode):
    """Inside ``selective``'s caching mode: reports the outputs it keeps (the ops
    :func:`_selective_policy` saves) to the activation meters counting now."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _selective_policy(None, func, *args, **kwargs) is CheckpointPolicy.MUST_SAVE:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    activations.note_saved(t)
        return out


@contextlib.contextmanager
def _caching_and_reporting(caching: Any) -> Any:
    with caching, _ReportCached():  # the reporter innermost: it sees each op, then the cache does
        yield


def _selective_contexts() -> tuple[Any, Any]:
    forward, recompute = create_selective_checkpoint_contexts(_selective_policy)
    if activations.recording():  # only while a meter counts: no extra dispatch otherwise
        forward = _caching_and_reporting(forward)
    return forward, recompute


class _CheckpointedForward:
    """A block's instance ``forward``: ``nn.Module.__call__`` runs the block's hooks around it,
    and ``checkpoint`` re-runs the original forward (no hooks) in backward. An object holding
    the block, not a closure, so that deepcopy and pickle carry it over to the copy."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.block.__dict__
        inner = state.get(_INNER_ATTR) or functools.partial(type(self.block).forward, self.block)
        if not torch.is_grad_enabled():  # evaluation: there is no backward to save anything for
            return inner(*args, **kwargs)
        if not state.get(_OFFLOAD_ATTR):
            return self._forward(inner, *args, **kwargs)
        # Outside checkpoint: its saves of the block's inputs come here; its inner hooks win
        # inside the recomputed region, which keeps nothing.
        with offloaded_saves(self.block):
            return self._forward(inner, *args, **kwargs)

    def _forward(self, inner: Callable, *args: Any, **kwargs: Any) -> Any:
        state = self.block.__dict__
        if state[_POLICY_ATTR] is None:  # offloaded, not checkpointed
            return inner(*args, **kwargs)
        # use_reentrant=False: works with kwargs and with inputs that do not require grad, and
        # restores the RNG state so dropout draws the same masks when the block is recomputed.
        if state[_POLICY_ATTR] != "selective":
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        # Under torch.compile, dynamo traces selective checkpointing given as a partial of
        # create_selective_checkpoint_contexts (activation reporting is eager-only anyway).
        compiling = torch.compiler.is_compiling()
        context_fn = (
            functools.partial(create_selective_checkpoint_contexts, _selective_policy)
            if compiling
            else _selective_contexts
        )
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _set_block_policy(block: nn.Module, policy: str | None, offload: bool = False) -> None:
    """Checkpoint ``block`` with ``policy`` ("full"/"selective"; ``None``: not checkpointed) and
    offload its saves or not; neither undoes the wrapping."""
    state = block.__dict__
    if policy is None and not offload:
        if _POLICY_ATTR in state:
            del state[_POLICY_ATTR], state["forward"]
            state.pop(_OFFLOAD_ATTR, None)
            if _INNER_ATTR in state:  # put back the instance forward we found
                state["forward"] = state.pop(_INNER_ATTR)
        return
    if _POLICY_ATTR not in state:  # not yet wrapped: never wrap twice
        if "forward" in state:
            state[_INNER_ATTR] = state["forward"]
        state["forward"] = _CheckpointedForward(block)
    state[_POLICY_ATTR] = policy
    state[_OFFLOAD_ATTR] = offload


def _block_setting(block: nn.Module) -> tuple[str | None, bool]:
    """(policy, offload) as :func:`_set_block_policy` last set them."""
    return block.__dict__.get(_POLICY_ATTR), bool(block.__dict__.get(_OFFLOAD_ATTR))


def _block_table(module: nn.Module) -> list[tuple[str, int, nn.Module]]:
    """(name, index within its ModuleList, block) for each outermost block of ``module``."""
    blocks = {id(b) for b in find_blocks(module)}
    table: list[tuple[str, int, nn.Module]] = []
    for list_name, child in module.named_modules():
        if isinstance(child, nn.ModuleList):
            for key, block in child.named_children():
                if id(block) in blocks:
                    table.append((f"{list_name}.{key}" if list_name else key, int(key), block))
    names = [name for name, _, _ in table]
    return [row for row in table if not any(row[0].startswith(n + ".") for n in names)]


def transformer_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) for each outermost transformer block of ``module`` that activation
    checkpointing applies to: under a pipeline, the blocks this rank holds (placeholders have no
    parameters and are not blocks)."""
    return [(name, block) for name, _, block in _block_table(module)]


def is_checkpointed(block: nn.Module) -> bool:
    """Whether ``block`` recomputes its activations in backward (any policy but ``none``)."""
    return block.__dict__.get(_POLICY_ATTR) is not None


def is_offloaded(block: nn.Module) -> bool:
    """Whether ``block``'s saved activations wait in host memory (``activation_offload``)."""
    return bool(block.__dict__.get(_OFFLOAD_ATTR))


def apply_activation_checkpointing(
    module: nn.Module, policy: str, every_n: int = DEFAULT_EVERY_N, offload: bool = False
) -> list[str]:
    """Make ``module``'s transformer blocks recompute their activations in backward, in place.

    Returns the names of the checkpointed blocks. Applying again replaces the previous policy
    (``"none"`` removes it); a block is never wrapped twice. Parameter names are unchanged.
    ``offload``: every block's saves (checkpointed or not) wait in host memory
    (:mod:`~lightning_3d.parallel.activation_offload`).

    Example::

        apply_activation_checkpointing(gpt, "every_n", every_n=2)  # ["blocks.0", "blocks.2"]
    """
    ac_options(policy, every_n, offload)
    chosen: list[str] = []
    for name, index, block in _block_table(module):
        if policy == "none" or (policy == "every_n" and index % every_n != 0):
            _set_block_policy(block, None, offload)
        else:
            _set_block_policy(block, "selective" if policy == "selective" else "full", offload)
            chosen.append(name)
    return chosen


class _StorageRecorder(TorchDispatchMode):
    """Notes every tensor storage an op creates, and which block was running when it did."""

    def __init__(self) -> None:
        super().__init__()
        self.owners: list[str | None] = [None]  # stack of running blocks
        # ptr -> (weakref, bytes, owner)
        self.seen: dict[int, tuple[Callable, int, str | None]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = local_tensor(t).untyped_storage()
                ptr = storage.data_ptr()
                old = self.seen.get(ptr)
                if ptr and (old is None or old[0]() is None):  # first sighting (or memory reused)
                    self.seen[ptr] = (weakref.ref(storage), storage.nbytes(), self.owners[-1])
        return out

    def enter(self, name: str) -> Callable:
        """A forward pre-hook that marks block ``name`` as running."""

        def hook(module: nn.Module, args: Any) -> None:
            self.owners.append(name)

        return hook

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook: the block is done (returns None, so the output is kept)."""
        self.owners.pop()


def activation_bytes_per_block(
    model: nn.Module, batch: Any, policy: str, every_n: int = DEFAULT_EVERY_N
) -> dict[str, int]:
    """Bytes each block keeps alive for backward under ``policy``, measured on one forward.

    Runs ``model(batch)`` with ``policy`` applied (the model's own policy is restored after),
    records every storage created while each block runs, and counts those still alive when the
    forward returns: what autograd saved, what ``checkpoint`` keeps to re-run the block, and
    what ``selective`` caches. (A plain ``saved_tensors_hooks`` counter cannot see inside
    checkpointed blocks: checkpoint installs its own hooks, and the innermost hooks win.
    :class:`~lightning_3d.parallel.activations.ActivationMeter`, which the run summary uses, also
    counts ``selective``'s cache and gets the same bytes per block, attributing a tensor to the
    block that saves it rather than the one that creates it.) Parameters, buffers
    and the model's outputs are not counted; a storage belongs to the block that created it, so
    a block's output counts in that block. For plain (unsharded) modules.

    Example::

        activation_bytes_per_block(gpt, tokens, "full")  # {"blocks.0": 131072, ...}
    """
    ac_options(policy, every_n)
    table = _block_table(model)
    before = {name: _block_setting(block) for name, _, block in table}
    recorder = _StorageRecorder()
    handles = []
    for name, _, block in table:
        handles.append(block.register_forward_pre_hook(recorder.enter(name)))
        handles.append(block.register_forward_hook(recorder.leave))
    try:
        apply_activation_checkpointing(model, policy, every_n)
        with torch.enable_grad(), recorder:
            out = model(batch)
        gc.collect()
        skip = {
            local_tensor(t).untyped_storage().data_ptr()
            for t in (*model.parameters(), *model.buffers())
        }
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        skip |= {local_tensor(t).untyped_storage().data_ptr() for t in outputs}
        counts = {name: 0 for name, _, _ in table}
        for ptr, (ref, nbytes, owner) in recorder.seen.items():
            if owner is not None and ptr not in skip and ref() is not None:
                counts[owner] += nbytes
        del out
        return counts
    finally:
        for handle in handles:
            handle.remove()
        for name, _, block in table:
            _set_block_policy(block, *before[name])
