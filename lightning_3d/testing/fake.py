"""A fake torch.distributed world: one process plays one rank of a world of any size.

The "fake" backend performs no communication, so mesh and group *shape* logic (which rank lands
where in a 64-rank layout) can be tested in a single process, without starting any ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


def _fake_store() -> dist.Store:
    # Private torch API (torch.testing._internal): kept in this one place so a torch upgrade
    # that moves it breaks one import, not every test.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Initialise the default process group as ``rank`` of a fake ``world_size`` world.

    The group is always destroyed on exit, also when the body raises.
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
