"""A fake torch.distributed world: one process plays one rank of a world of any size.

The "fake" backend performs no communication, so mesh and group *shape* logic (which rank lands
where in a 64-rank layout) can be tested in a single process, without starting any ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


def _fake_store() -> dist.Store:
    # Private torch API (torch.testing._internal): kept in this one place so a torch upgrade
    # that moves it breaks one import, not every test.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def _forget_meshes() -> None:
    """Empty DTensor's sharding-propagation caches (private torch APIs, kept here).

    They key an op's output placements by its inputs' specs, and a ``DeviceMesh`` compares
    equal to one of an earlier world with the same shape and axis names: a later world's
    ``DTensor.from_local`` would hand back the earlier world's mesh, whose process groups were
    destroyed with it (seen as "Could not resolve the process group" when FSDP2 then asks that
    mesh for a group). One process builds several worlds in turn (``validate=true``'s rank kinds)."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # torch 2.13
    if clear is not None:
        clear()


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Initialise the default process group as ``rank`` of a fake ``world_size`` world.

    The group is always destroyed on exit, also when the body raises, and DTensor forgets the
    world's meshes (:func:`_forget_meshes`).
    """
    if dist.is_initialized():
        raise RuntimeError(
            "a default process group already exists; fake_world needs a clean process"
        )
    dist.init_process_group("fake", store=_fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _forget_meshes()
