"""Counting activation memory: the bytes autograd saves for backward, from the tensors themselves.

:class:`ActivationMeter` counts what autograd saves (``saved_tensors_hooks``), each storage once,
minus parameters; a saved tensor stops counting when autograd frees it. It keeps the live total
and its peak (the pipeline runtime records these per schedule step) and, for the transformer
blocks it watches, the bytes first saved while each block's forward ran (``RunSummary`` reports
their mean on the first training step as ``activation_bytes_per_block``).

Several meters may count at once (the run summary's around a whole step, the pipeline's around
its schedule): every meter that is counting sees every save. Inside a checkpointed block
autograd's saves go to ``torch.utils.checkpoint``'s own hooks (the innermost hooks win), which
keep nothing but what recomputation needs; what checkpointing does keep is seen: a block's inputs
(saved outside its hooks) and, for the ``selective`` policy, the op outputs it caches, which
:mod:`lightning_3d.parallel.activation_checkpoint` reports through :func:`note_saved`.

Activation offload (:mod:`lightning_3d.parallel.activation_offload`) installs its hooks inside
each block, so its saves reach the meters through it: a tensor it copies to the host counts as
host bytes (``host_live``, ``host_peak``, ``block_host_bytes``), not as saved bytes, so that on a
CPU, where the host copy is a copy in the same memory, the meter still tells the two apart; a
tensor it keeps where it is counts as saved, as here.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# Context-local, like torch's own hook stacks: the meters counting now (their ``hooks()``
# context is open) and whether counting is paused.
_ACTIVE: ContextVar[tuple[ActivationMeter, ...]] = ContextVar(
    "lightning_3d_activation_meters", default=()
)
_PAUSED: ContextVar[bool] = ContextVar("lightning_3d_activation_meters_paused", default=False)


def recording() -> bool:
    """Whether some meter is counting now."""
    return bool(_ACTIVE.get()) and not _PAUSED.get()


@contextmanager
def paused(pause: bool = True) -> Iterator[None]:
    """Inside, no meter counts new saves (frees still count); ``paused(False)`` counts again
    inside a paused region. The pipeline runtime counts only inside its schedule's forward and
    backward chunks and its loss: not the extra forward a schedule's first step runs on each
    stage to infer shapes."""
    token = _PAUSED.set(pause)
    try:
        yield
    finally:
        _PAUSED.reset(token)


class ActivationMeter:
    """Bytes of activations saved for backward that are alive, and the most micro-batches whose
    forward ran but whose backward has not (in flight), during one measured step.

    Counts tensors autograd saves (``saved_tensors_hooks``), each storage once, minus the
    parameters' own storages (and views of them); a saved tensor stops counting when autograd
    frees it. Under ZeRO-3 the weights gathered for a block count too, unless the block is
    watched (:meth:`watch`): a watched block's parameters, as they are while its forward runs
    (gathered), are excluded. Under autocast, the low-precision copies of weights that autograd
    keeps count (they are new tensors held for backward).

    ``block_bytes``: for each watched block, the bytes of storages first saved while its forward
    ran (since :meth:`reset`): a block's input counts in it, its output in the next block (or
    nowhere, for the last one: the final norm saves it). Under a pipeline schedule this adds up
    every micro-batch of the step.

    Example::

        meter = ActivationMeter()
        unwatch = meter.watch([("blocks.0", gpt.blocks[0]), ("blocks.1", gpt.blocks[1])])
        meter.reset(gpt.parameters())
        with meter.hooks():
            loss = gpt(x).logsumexp(-1).mean()
        meter.peak, meter.block_bytes  # 1 234 567, {"blocks.0": 98816, "blocks.1": 98816}
        unwatch()
    """

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.in_flight = self.in_flight_peak = 0
        self.block_bytes: dict[str, int] = {}
        # Offloaded activations (activation_offload.py): bytes in host memory, alive and at most,
        # and per watched block as block_bytes counts saves.
        self.host_live = self.host_peak = 0
        self.block_host_bytes: dict[str, int] = {}
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self._param_storages: set[int] = set()
        # Watched blocks in forward, their parameter storages.
        self._running: list[tuple[str, set[int]]] = []

    def reset(self, params: Any = ()) -> None:
        self.peak, self.in_flight_peak, self.in_flight = self.live, 0, 0
        self.host_peak = self.host_live
        self.block_host_bytes = dict.fromkeys(self.block_bytes, 0)
        self._param_storages = {innermost(p).untyped_storage().data_ptr() for p in params}
        self.block_bytes = dict.fromkeys(self.block_bytes, 0)

    def forward_done(self) -> None:
        self.in_flight += 1
        self.in_flight_peak = max(self.in_flight_peak, self.in_flight)

    def backward_done(self) -> None:
        self.in_flight -= 1

    @contextmanager
    def hooks(self) -> Iterator[None]:
        """Count what autograd saves inside this context (and what it frees, whenever that is)."""
        _ACTIVE.set((*_ACTIVE.get(), self))
        try:
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                yield
        finally:  # not a token reset: a run summary's context and a pipeline's may close in any order
            _ACTIVE.set(tuple(m for m in _ACTIVE.get() if m is not self))

    def watch(self, blocks: Iterable[tuple[str, nn.Module]]) -> Callable[[], None]:
        """Attribute saves to the named blocks while their forward runs (``block_bytes``).
        Returns a function that removes the hooks again."""
        handles = []
        for name, block in blocks:
            self.block_bytes.setdefault(name, 0)
            self.block_host_bytes.setdefault(name, 0)
            # Registered after FSDP2's own hooks: the parameters seen here are the gathered ones.
            handles.append(block.register_forward_pre_hook(functools.partial(self._enter, name)))
            handles.append(block.register_forward_hook(self._leave))

        def unwatch() -> None:
            for handle in handles:
                handle.remove()

        return unwatch

    def _enter(self, name: str, block: nn.Module, args: Any) -> None:
        held = {innermost(p).untyped_storage().data_ptr() for p in block.parameters()}
        self._running.append((name, held))

    def _leave(self, block: nn.Module, args: Any, output: Any) -> None:
        if self._running:
            self._running.pop()

    def _hold(self, tensor: torch.Tensor) -> int | None:
        """Count ``tensor``'s storage as saved (once per storage); its key, or None if not counted."""
        try:
            storage = innermost(tensor).untyped_storage()
            key = storage.data_ptr()
        # A tensor subclass without a storage of its own.
        except (RuntimeError, NotImplementedError):
            return None
        if key in self._param_storages or (self._running and key in self._running[-1][1]):
            return None  # a parameter (or a view of one), not an activation
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [0, storage.nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
            if self._running:
                self.block_bytes[self._running[-1][0]] += entry[1]
        entry[0] += 1
        return key

    def _hold_host(self, nbytes: int) -> int:
        self.host_live += nbytes
        self.host_peak = max(self.host_peak, self.host_live)
        if self._running:
            name = self._running[-1][0]
            self.block_host_bytes[name] = self.block_host_bytes.get(name, 0) + nbytes
        return nbytes

    def _release_host(self, nbytes: int) -> None:
        self.host_live -= nbytes

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]


def innermost(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside wrapper subclasses (a DTensor's local shard, the result inside an
    ``AsyncCollectiveTensor`` that tensor parallelism's redistributions return)."""
    while is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, names[0])
    return tensor


def _hold_all(tensor: torch.Tensor) -> list[tuple[ActivationMeter, int]]:
    if _PAUSED.get():
        return []
    return [(meter, key) for meter in _ACTIVE.get() if (key := meter._hold(tensor)) is not None]


def _release_all(held: list[tuple[ActivationMeter, int]]) -> None:
    for meter, key in held:
        meter._release(key)


class _Saved:
    """A saved activation; its release (when autograd frees the graph) updates the meters."""

    __slots__ = ("held", "tensor")

    def __init__(self, tensor: torch.Tensor, held: list[tuple[ActivationMeter, int]]) -> None:
        self.tensor, self.held = tensor, held

    def __del__(self) -> None:
        _release_all(self.held)


def _pack(tensor: torch.Tensor) -> Any:
    # Keep a detached alias: holding ``tensor`` itself (an op's own output, with its grad_fn)
    # would tie the graph into a cycle through C++ nodes that nothing collects (also when
    # nothing counts it: a parameter's view, or a save while paused).
    # While Dynamo traces (context parallelism's attention Function inside a compiled block),
    # a save is a fake tensor of the graph being built: the compiled graph's own saves, at run
    # time, are the ones to count.
    held = [] if torch.compiler.is_compiling() else _hold_all(tensor)
    if not held:
        return tensor if tensor.grad_fn is None else tensor.detach()
    return _Saved(tensor.detach(), held)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved


def note_saved(tensor: torch.Tensor) -> None:
    """Count ``tensor`` as saved for backward by something other than autograd's hooks (selective
    checkpointing's cache) in every meter counting now, until its storage is freed."""
    held = _hold_all(tensor)
    if held:
        weakref.finalize(innermost(tensor).untyped_storage(), _release_all, held)


def saved_here(tensor: torch.Tensor) -> Any:
    """What the meters' own pack hook returns for ``tensor``: for a hook that runs inside the
    meters' (activation offload) and keeps ``tensor`` where it is; :func:`unpack_saved` undoes it."""
    return _pack(tensor)


def unpack_saved(saved: Any) -> torch.Tensor:
    """The tensor :func:`saved_here` packed."""
    return _unpack(saved)


def hold_host(host: torch.Tensor) -> list[tuple[ActivationMeter, int]]:
    """Count ``host``, the host copy of a saved activation, as host bytes in every meter counting
    now (the device tensor is not counted: it leaves the device once copied); pass the result to
    :func:`release_host` when the copy is dropped. A saved view moves only its own elements, so
    the bytes are the copy's, not the device storage's."""
    if _PAUSED.get() or torch.compiler.is_compiling():
        return []
    nbytes = host.untyped_storage().nbytes()
    return [(meter, meter._hold_host(nbytes)) for meter in _ACTIVE.get()]


def release_host(held: list[tuple[ActivationMeter, int]]) -> None:
    """Undo :func:`hold_host`."""
    for meter, nbytes in held:
        meter._release_host(nbytes)
