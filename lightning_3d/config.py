"""Typed configuration for the Hydra apps, and the one function that turns it into a strategy.

The dataclasses are registered in Hydra's ``ConfigStore`` as schemas, so a typo in a key
(``parallelism.zero_stag=2``) or a wrong type (``parallelism.tensor=two``) is refused by Hydra
before anything runs; values are range-checked by :class:`~lightning_3d.layout.Layout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from lightning_3d.strategy import ThreeDStrategy


@dataclass
class ParallelismConfig:
    """The parallel layout (see :class:`lightning_3d.ThreeDStrategy`)."""

    data: Any = "auto"  # data-parallel size, or "auto" = world / (tensor * pipeline)
    tensor: int = 1  # tensor-parallel size
    pipeline: int = 1  # pipeline-parallel size
    zero_stage: int = 0  # 0 replicate, 1 shard optimizer state, 2 + gradients, 3 + parameters
    sequence_parallel: bool = False  # with tensor > 1: shard norms and the residual stream along T
    # {module pattern: colwise|rowwise|sequence|vocab|head}. Typed Any: OmegaConf 2.3 cannot
    # override an Optional[Dict] that is None from the command line.
    tp_plan: Any = None
    micro_batches: Optional[int] = None  # with pipeline > 1: micro-batches per batch (default: pipeline)
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    virtual_stages: Optional[int] = None  # stages per rank for interleaved schedules (default 2)
    # Blocks per stage: "uniform" (by count), "params" (balanced by parameter count), or a list
    # of the block names that start stages 1, 2, ... (e.g. [model.blocks.3]). Typed Any (str or list).
    split: Any = "uniform"
    bucket_size_mb: float = 25.0  # gradient bucket size for zero stages 0-2
    activation_checkpointing: str = "none"  # none | full | every_n | selective
    checkpoint_every_n: int = 2  # with every_n: blocks 0, n, 2n, ... recompute
    # consolidated: one file of full tensors (rank 0 writes); sharded: a directory in which every
    # rank writes its own shards (torch.distributed.checkpoint). Either loads in any layout.
    checkpoint_format: str = "consolidated"


@dataclass
class OffloadConfig:
    """Where Adam / AdamW state and fp32 master weights live (see ``ThreeDStrategy(offload=...)``)."""

    device: str = "none"  # none | cpu | nvme
    path: Optional[str] = None  # directory for nvme offload (a private subdirectory is made in it)
    chunk_mb: float = 16.0  # nvme: state streamed through RAM in chunks of this size
    params: bool = False  # zero_stage 3: the sharded parameters and gradients live in CPU memory too


def register_configs(store: Optional[ConfigStore] = None) -> None:
    """Register the schemas that ``conf/parallelism/*.yaml`` and ``conf/offload/*.yaml`` extend."""
    store = store or ConfigStore.instance()
    store.store(group="parallelism", name="schema", node=ParallelismConfig)
    store.store(group="offload", name="schema", node=OffloadConfig)


def build_strategy(parallelism: Any, offload: Any = None) -> ThreeDStrategy:
    """Turn a ``parallelism`` config (dataclass, DictConfig or mapping) into a ``ThreeDStrategy``."""
    options = dict(parallelism if isinstance(parallelism, dict) else _to_dict(parallelism))
    if offload is not None:
        cfg = offload if isinstance(offload, dict) else _to_dict(offload)
        options.update(offload=cfg.get("device", "none"), offload_path=cfg.get("path"),
                       offload_chunk_mb=cfg.get("chunk_mb", 16.0), offload_params=cfg.get("params", False))
    return ThreeDStrategy(**options)


def world_size_of(trainer_cfg: Any) -> int:
    """Processes a Trainer config asks for: ``devices * num_nodes`` (``devices`` must be a count)."""
    cfg = _to_dict(trainer_cfg)
    devices, nodes = cfg.get("devices", 1), cfg.get("num_nodes", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"trainer.devices={devices!r} must be a positive number of processes")
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"trainer.num_nodes={nodes!r} must be a positive integer")
    return devices * nodes


def _to_dict(cfg: Any) -> dict:
    from dataclasses import asdict, is_dataclass

    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    if is_dataclass(cfg):
        return asdict(cfg)
    return dict(cfg)
