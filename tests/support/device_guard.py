"""What a GPU with NCCL refuses, found on a CPU with gloo.

On a GPU, an NCCL group has no host backend: a tensor made on the host (``torch.tensor(x)`` with
no ``device=``, ``device="cpu"``, ``.cpu()``, ``.to("cpu")``, ``pin_memory``) that reaches a
collective raises "No backend type associated with device type cpu"; an op that mixes a host
tensor (other than a 0-dim scalar) with device tensors raises "Expected all tensors to be on the
same device"; and every read of a device value on the host (``.item()``, ``bool(t)``, a copy to
the host) waits for the device. On a CPU, where host and device are one, gloo forgives all of it.

:class:`DeviceGuard` tells them apart by provenance. A function mode marks every tensor that
code outside torch makes on the host (the list above), and unmarks a tensor moved to a
``torch.device`` (what Lightning's ``model.to(root_device)`` and ``batch_to_device`` do); a
dispatch mode carries the mark through every op (an op's result is host-born when all of its
tensor inputs are) and, at each ``c10d`` collective, send and receive, records every marked
tensor with the place it was made and the place it was sent. It also records ops that mix a
marked tensor with unmarked ones, and counts host reads of unmarked tensors (per call site).

Torch's own code is trusted to choose devices for the backend it runs on (on gloo it picks the
host, on NCCL the device): tensors it makes are not marked. A device given as a ``torch.device``
object counts as the device, since on a CPU the strategy's root device *is* ``cpu``; only the
string ``"cpu"``, no device at all, or the ``.device`` read off a host-born tensor (code that
groups tensors by device and moves a scalar to each group's: ``factor.to(host.device)``) count
as the host.

Both modes are thread-local and stay on through backward, but a function mode is off inside
its own ``__torch_function__``, and the autograd engine runs the whole backward inside the
call to ``Tensor.backward`` / ``torch.autograd.backward`` / ``torch.autograd.grad``. So those
three are passed on with the mode back on (``torch.overrides.redispatch_function``): tensors
made in tensor and post-accumulate-grad hooks, ``autograd.Function.backward``, module backward
hooks, FSDP2's and the pipeline's backward and activation checkpointing's recompute are marked
as anywhere else.

Use it around a rank's work; it records and lets the work go on (a raise in one rank's
collective would leave the others waiting), so one run lists every site::

    with DeviceGuard() as guard:
        trainer.fit(module)
    assert not guard.violations, guard.report()
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)
_MARK = "_device_guard_made"  # attribute on a host-born tensor: where it was made

# Python-level calls that make a tensor where their ``device`` argument says (none: the host).
_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.asarray,
    torch.from_numpy,
    torch.frombuffer,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.empty_strided,
    torch.scalar_tensor,
}
# ... and those that follow their input unless given a device.
_LIKE = {
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
    torch.Tensor.new_tensor,
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_empty,
    torch.Tensor.new_full,
}
# Entries to the autograd engine: the user code it calls (tensor and post-accumulate-grad hooks,
# autograd.Function.backward, module backward hooks, FSDP2's and the pipeline's backward, queued
# callbacks) runs inside them.
_ENGINE_ENTRIES = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}
# Calls a function past one level of ``__torch_function__`` (absent from older torch: there the
# backward stays unseen by the function mode).
_REDISPATCH = getattr(torch.overrides, "redispatch_function", None)
# ``Tensor.device``: a mode sees the attribute's ``__get__``, whose ``__self__`` this is.
_DEVICE_ATTRIBUTE = torch.Tensor.device
_HELD_DEVICES = 100_000
# Reads of a tensor's values on the host: on a GPU each waits for the device's queue.
_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
}
# Ops a GPU runs with a host tensor among device ones: copies, and indexing by host indices.
_CROSS_DEVICE = {
    "copy_",
    "_to_copy",
    "_copy_from",
    "_copy_from_and_resize",
    "index",
    "index_put_",
    "_index_put_impl_",
    "set_",
    "lift_fresh",
    "detach",
    "alias",
    # The offload's CPU Adam step: on a GPU its gradients are copied to the host first
    # (offload/fused.py ``_cast``); on a CPU the device's gradient already is a host tensor.
    "_fused_adam_",
    "_fused_adamw_",
}


@dataclasses.dataclass(frozen=True)
class Violation:
    """A host tensor where a GPU would refuse it: ``kind`` is ``"collective"`` (``op`` the c10d
    op) or ``"mixed"`` (an op mixing host and device tensors); ``made`` and ``used`` are the
    sites (``file:line in function``, innermost last) where the tensor was made and used."""

    kind: str
    op: str
    made: str
    used: str

    def __str__(self) -> str:
        return f"{self.kind} {self.op}: a host tensor made at {self.made} reaches it at {self.used}"


def _sites(skip_torch: bool = True, depth: int = 3) -> str:
    """The innermost ``depth`` frames of the caller outside torch and this file (and outside
    any ``TorchFunctionMode``'s ``__torch_function__``: a mode forwards a call, it does not
    make it)."""
    frame, found = sys._getframe(1), []
    while frame is not None and len(found) < depth:
        name = frame.f_code.co_filename
        forwarding = frame.f_code.co_name == "__torch_function__"
        if not (name == _HERE or forwarding or (skip_torch and name.startswith(_TORCH))):
            found.append(f"{_short(name)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(found) or "?"


def _short(path: str) -> str:
    for root in ("lightning_3d", "tests", "lightning", "transformers", "peft", "torchao"):
        at = path.rfind(os.sep + root + os.sep)
        if at >= 0:
            return path[at + 1 :]
    return os.path.basename(path)


def _caller_in_torch() -> bool:
    """Whether the code that called the torch function being handled is torch's own."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == _HERE:
        frame = frame.f_back
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        # The overrides machinery's own frames sit between the caller and the handler.
        if "overrides" not in frame.f_code.co_filename and "_python_dispatch" not in (
            frame.f_code.co_filename
        ):
            return True
        frame = frame.f_back
    return False


def made_at(t: Any) -> Optional[str]:
    """Where ``t`` was made on the host, or ``None`` (not marked: a device tensor)."""
    return getattr(t, _MARK, None) if isinstance(t, torch.Tensor) else None


def _host_device(device: Any, read_off_host: dict) -> Optional[bool]:
    """True: the argument names the host; False: a device; None: not a device argument.
    ``read_off_host``: the ``torch.device`` objects read off host-born tensors, by id."""
    if isinstance(device, str):
        return device.split(":")[0] == "cpu"
    if isinstance(device, torch.device):
        # ``host.device`` is the host on a GPU too; any other torch.device is the strategy's
        # root device (on a CPU, cpu) or another device.
        return id(device) in read_off_host
    return None


def _mark(t: Any, site: str) -> None:
    for part in tree_flatten(t)[0]:
        if isinstance(part, torch.Tensor) and part.device.type != "meta":
            try:
                setattr(part, _MARK, site)
            except (AttributeError, RuntimeError):  # a tensor type without attributes
                pass


def _unmark(t: Any) -> None:
    for part in tree_flatten(t)[0]:
        if isinstance(part, torch.Tensor) and hasattr(part, _MARK):
            delattr(part, _MARK)


class _Provenance(TorchFunctionMode):
    """Marks tensors made on the host by code outside torch; unmarks moves to a device; counts
    reads of device values by code outside torch (torch keeps its own counters, such as an
    optimizer's step, on the host)."""

    def __init__(self, guard: DeviceGuard) -> None:
        super().__init__()
        self.guard = guard
        # ``host.device`` of host-born tensors, held (so that their ids stay theirs), oldest
        # first: code that groups tensors by device and moves a device scalar to each group's
        # device (``factor.to(grad.device)``) moves it to the host on a GPU.
        self.read_off_host: collections.OrderedDict = collections.OrderedDict()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE_ATTRIBUTE:  # t.device
            out = func(*args, **kwargs)
            if made_at(args[0]) is not None:
                self.read_off_host[id(out)] = out
                if len(self.read_off_host) > _HELD_DEVICES:
                    self.read_off_host.popitem(last=False)
            return out
        if func in _ENGINE_ENTRIES and _REDISPATCH is not None:
            # A mode is off inside its own handler, and the autograd engine keeps the mode
            # stack it was entered with: without ``with self`` every hook, Function.backward
            # and checkpoint recompute of the backward would make host tensors unseen.
            with self:
                return _REDISPATCH(func, types, args, kwargs)
        out = func(*args, **kwargs)
        if func in _FACTORIES or func in _LIKE:
            host = _host_device(kwargs.get("device"), self.read_off_host)
            if host is None and func in _FACTORIES:
                host = True
            if kwargs.get("pin_memory"):
                host = True
            if host and not _caller_in_torch():
                _mark(out, _sites())
            elif host is False:
                _unmark(out)
        elif func in (torch.Tensor.cpu, torch.Tensor.pin_memory):
            if not _caller_in_torch():
                out = _host_copy(self.guard, out, args[0])
        elif func in _READS:
            if made_at(args[0]) is None and not _caller_in_torch():
                self.guard._read()
        elif func is torch.Tensor.to:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            host = _host_device(target, self.read_off_host)
            if isinstance(target, torch.Tensor):
                host = made_at(target) is not None
            if host and not _caller_in_torch():
                out = _host_copy(self.guard, out, args[0])
            elif host is False:
                _unmark(out)
        return out


def _host_copy(guard: DeviceGuard, out: Any, source: Any) -> Any:
    """``out`` marked as made here, on the host. On a CPU a move of a host-resident tensor to
    the host returns the tensor itself; a GPU returns a copy, and so does this (marking the
    original would make a device tensor host-born)."""
    if made_at(source) is None and not _caller_in_torch():
        guard._read()  # a blocking copy from the device
    if out is source and made_at(source) is None:
        out = out.clone()
    _mark(out, _sites(depth=4))
    return out


def _dispatches(cls: type) -> bool:
    """Whether tensors of ``cls`` have a ``__torch_dispatch__`` of their own."""
    return getattr(cls, "__torch_dispatch__", None) is not torch._C._disabled_torch_dispatch_impl


class _Checks(TorchDispatchMode):
    """Carries marks through ops; records host tensors at collectives and in mixed ops."""

    def __init__(self, guard: DeviceGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, FakeTensor) for t in types):
            return func(*args, **kwargs)  # DTensor's sharding propagation: shapes, no data
        if any(_dispatches(t) for t in types):
            return NotImplemented  # a subclass (DTensor, NF4): its inner ops come back here
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        name = func.__name__.split(".")[0]
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional"):
            self.guard.collectives[name] += 1
            for t in inputs:
                if made_at(t) is not None:
                    self.guard._record("collective", str(func), made_at(t))
        elif namespace == "aten":
            self._check_mixed(func, name, inputs)
        out = func(*args, **kwargs)
        if namespace == "aten" and inputs:
            host = all(made_at(t) is not None for t in inputs)
            if host:
                site = made_at(inputs[0])
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and not any(t is i for i in inputs):
                        _mark(t, site)
        return out

    def _check_mixed(self, func, name: str, inputs: list) -> None:
        if name in _CROSS_DEVICE or len(inputs) < 2:
            return
        host = [t for t in inputs if made_at(t) is not None and t.dim() > 0]
        device = [t for t in inputs if made_at(t) is None and t.device.type != "meta"]
        if host and device:
            self.guard._record("mixed", str(func), made_at(host[0]))


class DeviceGuard:
    """See the module docstring. ``violations`` (each once per distinct site), ``reads``
    (host reads of device values by call site, counted while ``counting`` is true) and
    ``collectives`` (the c10d ops it checked, by name: proof that it saw the run's traffic)."""

    def __init__(self, counting: bool = False) -> None:
        self.violations: list[Violation] = []
        self.reads: collections.Counter = collections.Counter()
        self.collectives: collections.Counter = collections.Counter()  # c10d ops seen, by name
        self.counting = counting
        self._seen: set = set()
        self._modes: list = []

    def _record(self, kind: str, op: str, made: str) -> None:
        used = _sites()
        key = (kind, op, made, used)
        if key not in self._seen:
            self._seen.add(key)
            self.violations.append(Violation(kind, op, made, used))

    def _read(self) -> None:
        if self.counting:
            self.reads[_sites(depth=2)] += 1

    def report(self) -> str:
        return "\n".join(str(v) for v in self.violations) or "no violation"

    def __enter__(self) -> DeviceGuard:
        self._modes = [_Provenance(self), _Checks(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
