"""Activation offload: what a transformer block saves for backward waits in host memory.

A block's forward runs inside :func:`offloaded_saves`, a ``saved_tensors_hooks`` context whose
pack hook copies each saved tensor to the host and whose unpack hook copies it back when
backward needs it, as torchtune's ``OffloadActivations`` and torch's ``save_on_cpu`` do. Under
``ac_policy="full"`` the hooks sit outside ``torch.utils.checkpoint``: checkpoint saves the
block's inputs through the hooks around it (the recomputed region's own saves go to its inner
hooks and are never kept), so exactly the checkpointed inputs move to the host.

On a GPU the copy down goes into pinned host memory on a side stream, ordered after the op that
made the tensor (``wait_stream``) and overlapped with the forward compute that follows; the
device tensor is released at once, its memory kept from reuse until the side stream has read it
(``record_stream``). The copy up is issued on the compute stream, non-blocking from pinned
memory, after the copy down's event, when backward unpacks the tensor. Nothing here waits on
the host or reads a device value. On a CPU "host" is a separate copy: the mechanism runs
and is counted the same way (the activation meters see host bytes, not saved bytes).

Kept where they are (not copied): the block's parameters and views of them (under ZeRO-3 the
gathered ones: FSDP2 gathers them again for backward) and tensor subclasses (DTensors of tensor
parallelism, whose placement a plain copy would lose). A tensor saved by several ops is copied
once (the same tensor object, unchanged since); two view objects of one storage are copied
apart, which can cost the host more than the device held (about 1.2x for a GPT block).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lightning_3d.parallel import activations


class _Offloaded:
    """A saved tensor in host memory: its copy, the device to return to, and (GPU) the event
    that marks the copy down as finished."""

    __slots__ = ("device", "done", "host", "meters")

    def __init__(self, host: torch.Tensor, device: torch.device, meters: Any) -> None:
        self.host, self.device, self.meters = host, device, meters
        self.done: Any = None

    def __del__(self) -> None:
        activations.release_host(self.meters)


class _BlockOffload:
    """The pack and unpack hooks of one block's forward (one per call: the parameters it
    skips are the ones this forward sees, gathered under ZeRO-3)."""

    def __init__(self, block: nn.Module) -> None:
        self.params = {_storage_key(p) for p in block.parameters()}
        self.stream: Any = None  # the side stream, made at the first device tensor
        # The same tensor saved by several ops (an input read by q, k and v) is copied once:
        # id(tensor) -> (a weak reference to it, its version, its copy), for the duration of the
        # forward. The reference tells a freed tensor whose id (and memory) a new one took, the
        # version an in-place change since the copy.
        self.copies: dict[int, tuple[weakref.ref, int, _Offloaded]] = {}

    def keep(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` stays where it is (see the module's docstring)."""
        if is_traceable_wrapper_subclass(tensor) or tensor.device.type == "meta":
            return True
        if tensor.device.type != "cpu" and not torch.cuda.is_available():
            return True  # an accelerator without the stream machinery below
        return _storage_key(tensor) in self.params

    def pack(self, tensor: torch.Tensor) -> Any:
        if self.keep(tensor):
            # A kept save is still one the meters count as saved on the device.
            return activations.saved_here(tensor)
        ref, version, saved = self.copies.get(id(tensor), (None, -1, None))
        if ref is not None and ref() is tensor and version == tensor._version:
            return saved
        if tensor.device.type == "cpu":
            # CPU: "host" is a separate copy; empty_like keeps the strides autograd saved.
            host = torch.empty_like(tensor).copy_(tensor)
            saved = _Offloaded(host, tensor.device, activations.hold_host(host))
        else:
            saved = self._pack_cuda(tensor)
        self.copies[id(tensor)] = (weakref.ref(tensor), tensor._version, saved)
        return saved

    def _pack_cuda(self, tensor: torch.Tensor) -> _Offloaded:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=tensor.device)
        # Pinned: the copy is a DMA that runs beside compute; empty_like keeps saved strides.
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        # The copy waits for the op that made the tensor, then runs beside the next ops.
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        # The caching allocator must not hand the device memory to another tensor before the
        # side stream has read it: record the use instead of holding the tensor (freed now).
        tensor.record_stream(self.stream)
        saved = _Offloaded(host, tensor.device, activations.hold_host(host))
        saved.done = done
        return saved

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Offloaded):
            return activations.unpack_saved(saved)
        if saved.device.type == "cpu":
            return saved.host
        stream = torch.cuda.current_stream(saved.device)
        if saved.done is not None:
            stream.wait_event(saved.done)  # the copy down has landed before it is read back
        return saved.host.to(saved.device, non_blocking=True)


def _storage_key(tensor: torch.Tensor) -> int:
    return activations.innermost(tensor).untyped_storage().data_ptr()


@contextlib.contextmanager
def offloaded_saves(block: nn.Module) -> Iterator[None]:
    """Inside, what autograd saves for backward goes to host memory until backward needs it.

    Example::

        with offloaded_saves(gpt.blocks[0]):
            y = gpt.blocks[0](x)  # y.grad_fn's saved tensors wait on the host
    """
    hooks = _BlockOffload(block)
    try:
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            yield
    finally:
        # Autograd keeps the hooks (and so this object) until the graph is freed: without this,
        # each copy would live as long as the block's last one. A data pointer may be reused.
        hooks.copies.clear()
