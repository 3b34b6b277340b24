"""What a checkpoint reads from and writes into the ZeRO 0-2 engine (``zero.py``): which
elements of each parameter this rank's bucket slices hold, the optimizer state and the fp32
masters per parameter (gathered over the data ranks for a save, scattered back into the slices
on a load).

:class:`ZeroState` is the engine's checkpoint half, kept apart so that ``zero.py`` holds the
reduction and the step: it reads the engine's ``buckets``, ``stage``, ``rank`` and ``group``
and its slice helpers (``_part``, ``_as_slice``, ``_gather_slices``), and holds no state of
its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_3d.compat import all_gather_single
from lightning_3d.parallel.tensor import local_tensor as _local


@dataclass(frozen=True)
class OwnedSlice:
    """A bucket's slice on this rank, in the model's terms (checkpoints save state per parameter):
    for ``params[i]``, ``ranges[i] = (start, stop, base)``: its local elements ``[start, stop)``
    (memory order; none if ``start >= stop``) sit at ``[k - base]`` of the slice's state."""

    param: nn.Parameter  # the optimizer's parameter: a DTensor view of this rank's slice
    params: list[nn.Parameter]  # the bucket's model parameters
    ranges: list[tuple[int, int, int]]
    numel: int  # elements in the slice (padded bucket size / data-parallel size)
    device: torch.device


class ZeroState:
    """The checkpoint methods of :class:`~lightning_3d.parallel.zero.ZeroDataParallel`."""

    buckets: list
    stage: int
    rank: int
    group: Any

    def owned_slices(self) -> list[OwnedSlice]:
        """Each bucket's slice on this rank (stages 1–2) and which elements of each parameter it holds."""
        slices = []
        for b in self.buckets:
            whole = self.stage == 0  # a stage-0 master holds the whole bucket
            numel = b.flat.numel() if whole else b.shard_numel
            lo = 0 if whole else self.rank * b.shard_numel
            hi = lo + numel
            ends = [(offset, offset + _local(p).numel()) for p, offset in zip(b.params, b.offsets)]
            ranges = [(max(s, lo) - s, max(max(s, lo), min(e, hi)) - s, lo - s) for s, e in ends]
            slices.append(OwnedSlice(b.slice, list(b.params), ranges, numel, b.flat.device))
        return slices

    def gather_param_states(self, optimizer: torch.optim.Optimizer) -> dict[int, dict]:
        """Per-parameter optimizer state (stages 1–2): ``{id(param): {key: value}}``, each tensor
        shaped like the parameter (a DTensor when the parameter is one). A collective over dp."""
        states: dict[int, dict] = {}
        for bucket in self.buckets:
            if bucket.slice is None:  # stage 0 without masters: the state is per parameter
                states.update(
                    {id(p): optimizer.state[p] for p in bucket.params if p in optimizer.state}
                )
                continue
            saved = optimizer.state.get(bucket.slice, {})
            per_param = [dict() for _ in bucket.params]
            for key, value in saved.items():
                if not (isinstance(value, Tensor) and value.dim() == 1):  # e.g. Adam's scalar step
                    for entry in per_param:
                        entry[key] = value
                    continue
                full = torch.empty_like(bucket.flat, dtype=_local(value).dtype)
                if self.stage == 0:  # a stage-0 master's state is whole on every rank
                    full.copy_(_local(value))
                else:
                    # Offloaded state lives on the host; an NCCL group gathers device tensors only.
                    all_gather_single(full, _local(value).to(full.device), group=self.group)
                for entry, p, offset in zip(per_param, bucket.params, bucket.offsets):
                    entry[key] = like_param(p, full[offset : offset + _local(p).numel()])
            for p, entry in zip(bucket.params, per_param):
                if entry:
                    states[id(p)] = entry
        return states

    def load_param_states(self, optimizer: torch.optim.Optimizer, states: dict[int, dict]) -> None:
        """Inverse of :meth:`gather_param_states`: per-parameter (local) state into the slices."""
        for bucket in self.buckets:
            entries = [states.get(id(p)) for p in bucket.params]
            if not any(entries):
                continue
            if bucket.slice is None:  # stage 0 without masters: the state is per parameter
                optimizer.state.update({p: e for p, e in zip(bucket.params, entries) if e})
                continue
            first = next(e for e in entries if e)
            slice_state = {}
            for key, value in first.items():
                if not (isinstance(value, Tensor) and value.dim() >= 1):
                    slice_state[key] = value
                    continue
                full = torch.zeros_like(bucket.flat, dtype=_local(first[key]).dtype)
                for entry, p, offset in zip(entries, bucket.params, bucket.offsets):
                    if entry:
                        full[offset : offset + _local(p).numel()].copy_(
                            _local(entry[key]).reshape(-1)
                        )
                slice_state[key] = self._as_slice(self._part(full, bucket).clone(), bucket)
            optimizer.state[bucket.slice] = slice_state

    # ---------------------------------------------------------------- master weights
    def master_weights(self, only: Optional[set[int]] = None) -> list[tuple[nn.Parameter, Tensor]]:
        """``(parameter, its fp32 master)`` for every parameter with one, the master shaped like
        the parameter's local data (a DTensor when the parameter is one): what a checkpoint saves
        as the model's weights, so that a resume starts from the fp32 values, not from their bf16
        roundings. ``only``: ids of parameters; only the buckets holding one are gathered (every
        data rank must name the same ones). A collective over dp (stages 1-2: the masters are
        sharded)."""
        out = []
        for bucket in self.buckets:
            if bucket.master is None:
                continue
            if only is not None and not any(id(p) in only for p in bucket.params):
                continue
            full = torch.empty_like(bucket.flat, dtype=bucket.master.dtype)
            if self.stage == 0:
                full.copy_(bucket.master)
            else:  # host masters: an NCCL group gathers device tensors only
                all_gather_single(full, bucket.master.to(full.device), group=self.group)
            for p, offset in zip(bucket.params, bucket.offsets):
                out.append((p, like_param(p, full[offset : offset + _local(p).numel()])))
        return out

    def master_params(self) -> list[nn.Parameter]:
        """The model parameters whose buckets keep fp32 masters."""
        return [p for b in self.buckets if b.master is not None for p in b.params]

    @torch.no_grad()
    def load_master_weights(self, values: dict[int, Tensor]) -> None:
        """Inverse of :meth:`master_weights`: ``{id(parameter): its local part}`` (fp32) into the
        masters, and their roundings into the flat buffers. Parameters not given keep theirs."""
        for bucket in self.buckets:
            if bucket.master is None:
                continue
            full = bucket.master.clone()  # what is there now, for parameters not given
            start = 0 if self.stage == 0 else self.rank * bucket.shard_numel
            for p, offset in zip(bucket.params, bucket.offsets):
                value = values.get(id(p))
                lo, hi = max(offset, start), min(offset + _local(p).numel(), start + full.numel())
                if value is None or lo >= hi:
                    continue
                flat_value = _local(value).reshape(-1).to(full.dtype)
                full[lo - start : hi - start].copy_(flat_value[lo - offset : hi - offset])
            bucket.master.copy_(full)
            self._part(bucket.flat, bucket).copy_(full)

    @torch.no_grad()
    def refresh_from_masters(self) -> None:
        """Every bucket's low-precision weights from the masters, as after a step: this rank's
        part rounded from its master, the other ranks' parts gathered (stages 1-2). For a load
        that read only the masters (``checkpoint/sharded.py``: each rank reads its fp32 slice, not
        every whole weight). A collective over dp from stage 1."""
        for bucket in self.buckets:
            if bucket.master is not None:
                self._part(bucket.flat, bucket).copy_(bucket.master)
        if self.stage >= 1:
            for work in self._gather_slices():
                work.wait()


def like_param(p: Tensor, flat_view: Tensor) -> Tensor:
    """``flat_view`` shaped as ``p``'s (local) data, a DTensor when ``p`` is one."""
    local = flat_view.view_as(_local(p))
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
    return local
