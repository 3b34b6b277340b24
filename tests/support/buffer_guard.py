"""A memory sanitizer at the level of torch ops, for the buffers of collectives.

gloo runs every collective, send and receive on threads of its own: the call returns (or its
``Work`` is handed back) while a worker still reads the input and writes the output through the
raw pointers it took. The ``Work`` keeps the tensors alive, but not their memory: a storage
freed or swapped while the work runs (FSDP2 frees gathered parameters with
``untyped_storage().resize_(0)``; ``set_``, ``.data =`` and ``resize_`` swap or free a
storage in place) leaves gloo writing into freed memory: a corrupted heap that glibc reports
much later, at some unrelated ``malloc`` ("malloc(): unaligned tcache chunk detected",
"corrupted double-linked list"), on one rank, once in many runs. Nothing in torch checks it, and
neither do glibc's malloc checks nor AddressSanitizer on uninstrumented torch.

:class:`BufferGuard` is a dispatch mode that makes that hazard deterministic to see:

- at every ``c10d`` op (what ``torch.distributed``'s functions, FSDP2 and pipelining reach) and
  every functional collective (DTensor's), it records each tensor the op was given with its
  storage's identity, address and size, and the ``Work`` (a functional collective's ends at its
  ``wait_tensor``);
- at every later op it checks that no tensor of a work still in flight has had its storage
  freed, resized or replaced;
- at every op it checks that no tensor reaches past the end of its storage (torch does not
  check: a view of a storage resized smaller reads and writes freed memory silently);
- ``delay_s`` sleeps before each collective this rank issues, so that the peers' works stay in
  flight that long: give it on one rank of a world, then on the other, and a missing wait or an
  early free on the waiting ranks is in its window every time, not once in a loaded run.

Subclass arguments (DTensor, NF4) are handed back to the subclass, so that the ops on their
inner tensors come through the mode too. It records and lets the work go on (a raise inside one
rank's collective would leave the others waiting); the problems are read afterwards::

    with BufferGuard() as guard:
        trainer.fit(module)
    assert not guard.problems, guard.problems
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# Functional collectives that end or wrap a collective rather than start one.
_NOT_STARTS = ("wait_tensor", "_wrap_tensor_autograd")


def _storage_key(storage: Any) -> tuple[int, int, int]:
    """What changes when a storage is freed, resized or replaced: its identity, address, size."""
    return (storage._cdata, storage.data_ptr(), storage.nbytes())


def _tensors(values: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, (list, tuple)):
            out += _tensors(value)
        elif isinstance(value, torch.Tensor):
            out.append(value)
    return out


def past_storage(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """``(bytes the tensor reaches, bytes its storage has)`` where the first exceeds the second
    (a view of a storage resized smaller or freed), else ``None``."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    extent = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    need, have = extent * t.element_size(), t.untyped_storage().nbytes()
    return (need, have) if need > have else None


class _Ended:
    """A functional collective's end: its ``wait_tensor`` (the work itself stays in torch)."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


@dataclass
class _InFlight:
    """One collective's work and its tensors: (the tensor, weakly; its storage; their key)."""

    op: str
    work: Any
    buffers: list[tuple[Any, Any, tuple[int, int, int]]]
    outputs: list[int] = field(default_factory=list)  # a functional collective's storages


class BufferGuard(TorchDispatchMode):
    """See the module's docstring. ``problems``: one line per hazard seen; ``issued``: the
    collectives recorded (a test asserts some were, or it watched nothing)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.problems: list[str] = []
        self.issued = 0
        self._in_flight: list[_InFlight] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        subclasses = [t for t in types if t not in (torch.Tensor, torch.nn.Parameter)]
        if any("Fake" in t.__name__ or "Functional" in t.__name__ for t in subclasses):
            return func(*args, **kwargs)  # shapes only (DTensor's sharding propagation)
        if subclasses:
            return NotImplemented  # the subclass runs; its inner ops come back here
        self._check_in_flight(func)
        self._check_bounds(func, args, kwargs)
        name = func.__name__.split(".")[0]
        collective = func.namespace == "c10d" or (
            func.namespace == "_c10d_functional" and name not in _NOT_STARTS
        )
        if collective and self.delay_s:
            time.sleep(self.delay_s)
        out = func(*args, **kwargs)
        if func.namespace == "c10d" and "barrier" not in name:
            work = out[-1] if isinstance(out, tuple) else out
            try:
                work = dist.distributed_c10d.Work.unbox(work)
            except (AttributeError, RuntimeError, TypeError):
                return out  # an op that returns no work (a process group's metadata)
            self._record(str(func), work, _tensors(args))
        elif collective:
            outputs = _tensors([out])
            record = self._record(str(func), _Ended(), _tensors(args) + outputs)
            record.outputs = [t.untyped_storage()._cdata for t in outputs]
        elif func.namespace == "_c10d_functional" and name == "wait_tensor":
            waited = args[0].untyped_storage()._cdata
            for record in self._in_flight:
                if waited in record.outputs:
                    record.work.done = True
        return out

    def _record(self, op: str, work: Any, tensors: list[torch.Tensor]) -> _InFlight:
        self.issued += 1
        buffers = [
            (weakref.ref(t), t.untyped_storage(), _storage_key(t.untyped_storage()))
            for t in tensors
        ]
        record = _InFlight(op, work, buffers)
        self._in_flight.append(record)
        return record

    def _check_in_flight(self, func: Any) -> None:
        still = []
        for record in self._in_flight:
            done = record.work.is_completed()
            for ref, storage, key in record.buffers:
                tensor = ref()
                now = _storage_key(tensor.untyped_storage() if tensor is not None else storage)
                if now != key and not done:
                    self.problems.append(
                        f"{record.op}: a buffer's storage changed while the work was in flight "
                        f"(identity, address, bytes {key} -> {now}), seen at {func}"
                    )
                    record.buffers = []  # once per work
                    break
            if not done:
                still.append(record)
        self._in_flight = still

    def _check_bounds(self, func: Any, args: tuple, kwargs: dict) -> None:
        arguments = func._schema.arguments
        written = {a.name for a in arguments if a.alias_info is not None and a.alias_info.is_write}
        named = [*zip((a.name for a in arguments), args), *kwargs.items()]
        for name, value in named:
            for t in _tensors([value]):
                if type(t) not in (torch.Tensor, torch.nn.Parameter):
                    continue
                past = past_storage(t)
                if past is not None:
                    self.problems.append(
                        f"{func} {'writes' if name in written else 'reads'} {name} "
                        f"{tuple(t.shape)}: {past[0]} bytes of a storage of {past[1]}"
                    )


def buffer_guarded_fit(rank: int, run: Any, delay_rank: int = -1, delay_s: float = 0.0) -> dict:
    """``fit_gpt`` of ``run`` under :class:`BufferGuard` (run_world imports it by name), with
    ``delay_s`` before each collective on rank ``delay_rank``; the result: ``losses``,
    ``problems``, ``issued``."""
    from tools.harness.runs import fit_gpt

    with BufferGuard(delay_s if rank == delay_rank else 0.0) as guard:
        result = fit_gpt(rank, run)
    return {"losses": result["losses"], "problems": guard.problems, "issued": guard.issued}
