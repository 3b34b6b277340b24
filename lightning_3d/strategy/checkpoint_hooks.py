"""The checkpoint half of ``ThreeDStrategy``: what Lightning's save and load hooks do in every layout.

Two formats (``ThreeDStrategy(checkpoint_format=...)``):

- ``"consolidated"`` (default): one file with full tensors under the ``LightningModule``'s own
  names and the optimizer state as one process would have it (``consolidated.py``). Every rank
  takes part in gathering; rank 0 writes. Plain Lightning can load it.
- ``"sharded"``: a directory written by every rank in parallel, each writing only its own shards
  (``sharded.py``). For models whose state does not fit one host's memory.

Both formats load in any layout, whichever format the run itself saves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_3d.checkpoint import sharded, sharded_files
from lightning_3d.checkpoint.checks import check_against, shapes_of
from lightning_3d.checkpoint.consolidated import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    load_master_state,
    master_state,
)
from lightning_3d.checkpoint.integrity import KEY as CHECKSUMS
from lightning_3d.checkpoint.view import full_state_dict
from lightning_3d.runtime.failures import naming_path

if TYPE_CHECKING:
    from lightning_3d.strategy.recipe import Parallelized


class CheckpointHooks:
    """Mixin for ``ThreeDStrategy``; uses only its public ``lightning_module``, ``optimizers``,
    ``checkpoint_format`` and ``parallelized`` (the :class:`~lightning_3d.strategy.recipe.Parallelized`
    record of setup: one-process names, the pipeline group, the ZeRO engine of each optimizer)."""

    checkpoint_format: str
    parallelized: Parallelized

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the parallelized model and the sharded optimizer

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # A module may save only part of itself (LoRA: the adapters): the rest is never gathered.
        keep = getattr(self.lightning_module, "keeps_in_checkpoint", None)
        recipe = self.parallelized
        if self.checkpoint_format == "sharded":
            # fp32 masters (ZeRO 0-2 under bf16-true) are saved as the weights, as consolidated.
            return sharded.model_state(self.lightning_module, keep, recipe.engines)
        return full_model_state(
            self.lightning_module, recipe.pp_group, recipe.full_names, keep, recipe.engines
        )

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        raw = getattr(optimizer, "_optimizer", optimizer)
        recipe = self.parallelized
        engine = recipe.engine_for(raw)
        if self.checkpoint_format == "sharded":
            return sharded.optimizer_state(
                self.lightning_module, raw, engine, recipe.full_param_names
            )
        return full_optimizer_state(
            self.lightning_module, raw, engine, recipe.pp_group, recipe.full_param_names
        )

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if self.checkpoint_format != "sharded":
            super().save_checkpoint(checkpoint, filepath, storage_options)  # rank 0, atomic file
            return
        if storage_options is not None:
            raise TypeError(f"sharded checkpoints take no storage_options, got {storage_options!r}")
        with naming_path(filepath):  # an ENOSPC inside a CheckpointException names no file
            sharded_files.save(*sharded_files.split_checkpoint(checkpoint), filepath)

    @override
    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        if not sharded_files.is_sharded_checkpoint(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        return self._load_sharded(checkpoint_path)

    def _load_sharded(self, path: _PATH) -> dict[str, Any]:
        """Read a sharded checkpoint into the model (and, when fitting, the optimizers) in place;
        return the rest of the checkpoint for Lightning to restore."""
        meta = sharded_files.read_meta(path)
        metadata = sharded_files.read_metadata(path)
        module = self.lightning_module
        saved = sharded_files.tensor_entries(metadata, sharded_files.MODEL)
        strict = getattr(module, "strict_loading", True)
        check_against(
            shapes_of(module.state_dict()),
            {n: tuple(md.size) for n, md in saved.items()},
            strict=strict,
            names=self.parallelized.full_names,
            source=str(path),
        )
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        # Every rank checks its share of the bytes it is about to read (the optimizer's only when
        # fitting); all refuse a damaged item before anything is read into the model.
        sharded_files.verify_shards(
            path,
            metadata,
            meta,
            prefix="" if fitting else sharded_files.MODEL,
            distributed=dist.is_available() and dist.is_initialized(),
        )
        meta.pop(CHECKSUMS, None)
        # fp32 masters (ZeRO 0-2 under bf16-true) are read from the saved weights exactly.
        engines = self.parallelized.engines
        targets, after = sharded.model_targets(
            module, [n for n in module.state_dict() if n in saved], engines
        )
        installs = []
        if fitting and "optimizer_states" in meta:
            states = meta["optimizer_states"]
            if len(states) != len(self.optimizers):
                raise ValueError(
                    f"{path} has {len(states)} optimizer states, the module configures {len(self.optimizers)}"
                )
            for index, (optimizer, state) in enumerate(zip(self.optimizers, states)):
                prefix = sharded_files.optimizer_prefix(index)
                found, install = sharded.optimizer_targets(
                    module,
                    optimizer,
                    self.parallelized.engine_for(optimizer),
                    sharded_files.tensor_entries(metadata, prefix),
                    state,
                    prefix,
                )
                targets.update(found)
                installs.append(install)
        sharded_files.load(targets, path, metadata)
        sharded.finish_model(module, after, engines)
        for install in installs:
            install()
        return meta

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if checkpoint.get("format") == sharded_files.FORMAT:
            return  # read in place by load_checkpoint
        # Names and shapes first (DTensors report full shapes), so a checkpoint of another model
        # fails naming the tensors before anything is overwritten.
        names = self.parallelized.full_names
        check_against(
            shapes_of(self.lightning_module.state_dict()),
            shapes_of(checkpoint["state_dict"]),
            strict=strict,
            names=names,
        )
        load_full_model_state(self.lightning_module, checkpoint["state_dict"], strict, names)
        # fp32 masters (ZeRO 0-2 under bf16-true) take the saved fp32 values, not their roundings.
        load_master_state(
            self.lightning_module, checkpoint["state_dict"], self.parallelized.engines
        )

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if checkpoint.get("format") == sharded_files.FORMAT:
            return  # read in place by load_checkpoint
        saved = checkpoint["optimizer_states"]
        if len(saved) != len(self.optimizers):
            raise ValueError(
                f"checkpoint has {len(saved)} optimizer states, the module configures {len(self.optimizers)}"
            )
        recipe = self.parallelized
        for optimizer, state in zip(self.optimizers, saved):
            load_full_optimizer_state(
                self.lightning_module,
                optimizer,
                state,
                recipe.engine_for(optimizer),
                recipe.pp_group,
                recipe.full_param_names,
            )

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every parameter and buffer of the module at full size, on CPU, merged over pipeline
        stages: what one process would hold. A collective: call on every rank."""
        module, recipe = self.lightning_module, self.parallelized
        full = full_state_dict(module, pp_group=recipe.pp_group)
        # fp32 masters, where ZeRO 0-2 keep them, are the weights one process would step.
        return {**full, **master_state(module, recipe.engines, pp_group=recipe.pp_group)}
