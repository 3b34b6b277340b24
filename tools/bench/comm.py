"""Count the bytes that torch.distributed moves on this rank, by wrapping its collectives.

    with count_collectives() as counter:
        trainer.fit(...)
    counter.sent_bytes          # ring-equivalent bytes this rank sent
    counter.by_op["all_reduce"] # calls, payload bytes, sent bytes

Every entry point that the engines compared here call from Python is wrapped, in both
``torch.distributed`` (and its ``distributed_c10d`` home) and the functional collectives that
DTensor and loss-parallel use: all_reduce, reduce, broadcast, all_gather (list, single, into
tensor, coalesced), reduce_scatter (list, single, tensor), all_to_all, send/recv/isend/irecv.
A call made from inside another counted call (``all_gather_into_tensor`` forwards to
``all_gather_single``, ``send`` to ``isend``) is counted once. DDP's C++ reducer is invisible to
Python: the ``ddp`` peer routes it through :func:`counting_allreduce_hook`, which calls the
wrapped ``all_reduce``.

Payload is the tensor bytes handed to the call. ``sent`` converts a call to what one rank sends
with the bandwidth-optimal (ring) algorithm on a group of n ranks: all-reduce 2S(n-1)/n;
reduce-scatter, reduce, broadcast and all-to-all S(n-1)/n of the full tensor S; all-gather
(n-1) times the local input; send the tensor, recv nothing (its payload is still recorded).
No counter lives at module level: the context manager owns it and restores every function.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

from lightning_3d.compat import functional_process_group

# name -> (argument holding the tensor(s) that define the size, how the size maps to bytes sent).
# Kinds: "ar" all-reduce, "rs" input is the full tensor, "ag" input is the local part,
# "send" bytes sent as is, "recv" nothing sent.
_C10D: dict[str, tuple[str, str]] = {
    "all_reduce": ("tensor", "ar"),
    "all_reduce_coalesced": ("tensors", "ar"),
    "reduce": ("tensor", "rs"),
    "broadcast": ("tensor", "rs"),
    "all_gather": ("tensor", "ag"),
    "all_gather_single": ("input_tensor", "ag"),
    "all_gather_into_tensor": ("input_tensor", "ag"),
    "all_gather_coalesced": ("input_tensor_list", "ag"),
    "reduce_scatter": ("input_list", "rs"),
    "reduce_scatter_single": ("input", "rs"),
    "reduce_scatter_tensor": ("input", "rs"),
    "all_to_all_single": ("input", "rs"),
    "all_to_all": ("input_tensor_list", "rs"),
    "send": ("tensor", "send"),
    "isend": ("tensor", "send"),
    "recv": ("tensor", "recv"),
    "irecv": ("tensor", "recv"),
}
_FUNCOL: dict[str, tuple[str, str]] = {
    "all_reduce": ("self", "ar"),
    "all_reduce_coalesced": ("self", "ar"),
    "broadcast": ("self", "rs"),
    "all_gather_tensor": ("self", "ag"),
    "all_gather_tensor_autograd": ("self", "ag"),
    "all_gather_single": ("self", "ag"),
    "all_gather_single_autograd": ("self", "ag"),
    "all_gather_into_tensor_coalesced": ("self", "ag"),
    "all_gather_single_coalesced": ("self", "ag"),
    "reduce_scatter_tensor": ("self", "rs"),
    "reduce_scatter_tensor_autograd": ("self", "rs"),
    "reduce_scatter_single": ("self", "rs"),
    "reduce_scatter_single_autograd": ("self", "rs"),
    "reduce_scatter_tensor_coalesced": ("inputs", "rs"),
    "reduce_scatter_single_coalesced": ("inputs", "rs"),
    "all_to_all_single": ("self", "rs"),
    "all_to_all_single_autograd": ("self", "rs"),
}


@dataclass
class OpCount:
    """What one collective entry point moved on this rank."""

    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0


@dataclass
class CommCounter:
    """Per-op totals on this rank; ``snapshot()`` and ``since()`` bracket a region of interest."""

    by_op: dict[str, OpCount] = field(default_factory=dict)
    _depth: int = 0

    @property
    def sent_bytes(self) -> float:
        return sum(c.sent_bytes for c in self.by_op.values())

    @property
    def payload_bytes(self) -> int:
        return sum(c.payload_bytes for c in self.by_op.values())

    def snapshot(self) -> dict[str, tuple[int, int, float]]:
        return {k: (c.calls, c.payload_bytes, c.sent_bytes) for k, c in self.by_op.items()}

    def since(self, before: dict[str, tuple[int, int, float]]) -> dict[str, tuple[int, int, float]]:
        """Per-op (calls, payload, sent) accumulated after ``before`` was taken."""
        out = {}
        for key, (calls, payload, sent) in self.snapshot().items():
            c0, p0, s0 = before.get(key, (0, 0, 0.0))
            if calls > c0:
                out[key] = (calls - c0, payload - p0, sent - s0)
        return out

    def record(self, name: str, payload: int, sent: float) -> None:
        entry = self.by_op.setdefault(name, OpCount())
        entry.calls += 1
        entry.payload_bytes += payload
        entry.sent_bytes += sent


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        # A DTensor handed to a raw collective would be odd; count its local part if so.
        local = getattr(value, "_local_tensor", value)
        return local.numel() * local.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_size(group: Any, functional: bool) -> int:
    if functional:  # a group, a group name, a 1-D mesh or (mesh, dim): resolve to the group
        return functional_process_group(group).size()
    return group.size() if group is not None else dist.get_world_size()


def _sent(kind: str, payload: int, n: int) -> float:
    if kind == "ar":
        return 2 * payload * (n - 1) / n
    if kind == "rs":
        return payload * (n - 1) / n
    if kind == "ag":
        return payload * (n - 1)
    return float(payload) if kind == "send" else 0.0


def _wrap(
    counter: CommCounter, prefix: str, name: str, fn: Callable, arg: str, kind: str
) -> Callable:
    signature = inspect.signature(fn)
    functional = prefix == "funcol"

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if counter._depth:  # forwarded from another counted call: counted there
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        payload = _nbytes(bound.arguments.get(arg))
        n = 2 if kind in ("send", "recv") else _group_size(bound.arguments.get("group"), functional)
        counter.record(f"{prefix}.{name}", payload, _sent(kind, payload, max(n, 1)))
        counter._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            counter._depth -= 1

    return counted


@contextlib.contextmanager
def count_collectives() -> Iterator[CommCounter]:
    """Wrap the collectives for the duration of the block; always restore the originals."""
    counter = CommCounter()
    saved: list[tuple[Any, str, Any]] = []
    try:
        for name, (arg, kind) in _C10D.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = _wrap(counter, "dist", name, original, arg, kind)
            # torch.distributed re-exports c10d's functions; patch every module that holds the same object
            # (c10d's own globals too: P2POp checks ``op in [isend, irecv]`` against them).
            for module in (c10d, dist):
                if getattr(module, name, None) is original:
                    saved.append((module, name, original))
                    setattr(module, name, wrapped)
        for name, (arg, kind) in _FUNCOL.items():
            original = getattr(funcol, name, None)
            if original is not None:
                saved.append((funcol, name, original))
                setattr(funcol, name, _wrap(counter, "funcol", name, original, arg, kind))
        yield counter
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def counting_allreduce_hook(
    state: Any, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook equal to DDP's default (mean all-reduce), made through ``dist.all_reduce``.

    Calling the Python function (patched or not) instead of the C++ reducer's built-in path lets
    :func:`count_collectives` see DDP's gradient traffic. ``state`` is the process group or None.
    """
    group = state if state is not None else dist.group.WORLD
    tensor = bucket.buffer().div_(group.size())
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks the annotations as objects; ``from __future__ import annotations`` made them strings.
counting_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket, state=Any, **{"return": torch.futures.Future[torch.Tensor]}
)
