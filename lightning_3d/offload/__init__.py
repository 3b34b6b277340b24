"""Optimizer-state offload to CPU RAM or NVMe.

The strategy wraps the user's ``torch.optim.Adam`` / ``AdamW`` *after* the ZeRO engine has
rewritten its param groups, so only this rank's shard of the state is offloaded::

    engine.attach(optimizer)
    optimizer = OffloadedAdam.from_optimizer(optimizer, device="nvme", path="/mnt/nvme")
    ...
    optimizer.close()   # at teardown: frees the buffers, deletes the NVMe files

``optimizer.py`` is the algorithm, ``storage.py`` where the state lives (RAM or one file,
streamed in chunks), ``paths.py`` the checks and the private, self-deleting directory.
"""

from lightning_3d.offload.optimizer import DEFAULT_CHUNK_BYTES, DEVICES, OffloadedAdam
from lightning_3d.offload.options import offload_options
from lightning_3d.offload.paths import PrivateDirectory, check_offload_path
from lightning_3d.offload.storage import ChunkStore, CpuChunkStore, FileChunkStore

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEVICES",
    "ChunkStore",
    "CpuChunkStore",
    "FileChunkStore",
    "OffloadedAdam",
    "PrivateDirectory",
    "check_offload_path",
    "offload_options",
]
