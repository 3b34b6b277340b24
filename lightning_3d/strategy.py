"""``ThreeDStrategy``: data × tensor × pipeline parallelism with ZeRO, as one Lightning strategy."""

from __future__ import annotations

import sys
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_3d.checkpoint.io import AtomicCheckpointIO
from lightning_3d.checkpoint.strategy_hooks import CHECKPOINT_FORMATS, CheckpointHooks
from lightning_3d.optim_wiring import OptimizerWiring
from lightning_3d.layout import Layout, MeshAxis, build_mesh
from lightning_3d.offload import OffloadedAdam, offload_options
from lightning_3d.parallel.activation_checkpoint import apply_activation_checkpointing, checkpoint_options
from lightning_3d.parallel.fsdp import apply_zero3
from lightning_3d.parallel.loss import vocab_parallel_loss
from lightning_3d.parallel.pipeline import PipelineRuntime, pipeline_options, split_stages
from lightning_3d.parallel.stages import tied_holders
from lightning_3d.parallel.tensor import apply_tensor_parallel, local_tensor, resolve_plan
from lightning_3d.parallel.tied import TiedGroups, check_tied_styles, find_tied, record_aliases, retie
from lightning_3d.parallel.zero import ZeroDataParallel
from lightning_3d.plans import build_plan
from lightning_3d.recipe import Parallelized

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

_OPTIONS = (
    "data", "tensor", "pipeline", "zero_stage", "tp_plan", "sequence_parallel", "micro_batches", "schedule",
    "virtual_stages", "split", "activation_checkpointing", "checkpoint_every_n", "offload", "offload_path",
    "offload_chunk_mb", "offload_params", "checkpoint_format", "bucket_size_mb", "process_group_backend", "timeout",
)


class ThreeDStrategy(CheckpointHooks, OptimizerWiring, ParallelStrategy):
    """Pipeline × data × tensor parallelism with ZeRO sharding on the data axis.

    Args:
        data: data-parallel size, or ``"auto"`` for ``world_size / (tensor * pipeline)``.
        tensor: tensor-parallel size (Megatron-style layer splitting).
        pipeline: pipeline-parallel size (layers split into stages).
        zero_stage: 0 replicates everything and all-reduces gradients; 1 shards optimizer state;
            2 also gradients; 3 also parameters (FSDP2).
        tp_plan: explicit tensor-parallel plan, ``{module-name pattern: style or style name}``;
            default: recognise the architecture (reference GPT, Llama-style, GPT-2-style).
        sequence_parallel: with ``tensor > 1``, also shard norms and the residual stream along
            the sequence.
        micro_batches: with ``pipeline > 1``, micro-batches each rank's batch is cut into
            (default: ``pipeline``).
        schedule: ``"gpipe"``, ``"1f1b"`` (default), ``"interleaved_1f1b"``, ``"zero_bubble"``
            (PyTorch's interleaved zero-bubble).
        virtual_stages: stages per rank for the interleaved schedules (default 2; 1 otherwise).
        split: how blocks are divided into stages: ``"uniform"`` by count (default),
            ``"params"`` balanced by parameter count, or a list of the block names that start
            stages 1, 2, ... (e.g. ``["model.blocks.3"]``).
        activation_checkpointing: ``"none"`` (default), ``"full"`` (every block recomputes its
            activations in backward), ``"every_n"`` (blocks 0, n, 2n, ...), ``"selective"``
            (every block, keeping matmul and attention outputs).
        checkpoint_every_n: n for ``"every_n"``.
        offload: where Adam / AdamW state (and fp32 master weights) lives: ``"none"`` (with the
            parameters), ``"cpu"`` (CPU RAM; the step runs there) or ``"nvme"`` (files under
            ``offload_path``, streamed in chunks of ``offload_chunk_mb``).
        offload_params: with ``zero_stage=3`` and an offload device: the sharded parameters and
            their gradients live in CPU memory too (FSDP2's ``CPUOffloadPolicy``), each block's
            shard copied to the accelerator for its all-gather. Default ``False``.
        bucket_size_mb: size of the flat gradient buckets used by zero stages 0–2.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default follows the device.
        timeout: collective timeout.

    Example::

        import lightning as L
        import lightning_3d  # registers "3d", "3d_zero1", "3d_zero2", "3d_zero3"

        trainer = L.Trainer(accelerator="cpu", devices=4, strategy="3d_zero3")
        trainer = L.Trainer(devices=8, strategy=lightning_3d.ThreeDStrategy(zero_stage=2))
    """

    strategy_name = "3d"

    def __init__(
        self,
        data: Union[int, str] = "auto",
        tensor: int = 1,
        pipeline: int = 1,
        zero_stage: int = 0,
        tp_plan: Optional[Mapping[str, Any]] = None,
        sequence_parallel: bool = False,
        micro_batches: Optional[int] = None,
        schedule: str = "1f1b",
        virtual_stages: Optional[int] = None,
        split: Union[str, Sequence[str]] = "uniform",
        activation_checkpointing: str = "none",
        checkpoint_every_n: int = 2,
        offload: str = "none",
        offload_path: Optional[str] = None,
        offload_chunk_mb: float = 16.0,
        offload_params: bool = False,
        checkpoint_format: str = "consolidated",
        bucket_size_mb: float = 25.0,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ValueError(
                f"unknown ThreeDStrategy option(s) {sorted(unknown)}; valid options are {list(_OPTIONS)}"
            )
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb!r}")
        self.layout = Layout(data=data, tensor=tensor, pipeline=pipeline, zero_stage=zero_stage)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            # Atomic files: a save killed half-way leaves the previous checkpoint, not a torn one.
            checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        self._pipeline_options = pipeline_options(
            self.layout.pipeline, micro_batches, schedule, virtual_stages, split
        )
        self._pipeline: Optional[PipelineRuntime] = None
        self._checkpointing = checkpoint_options(activation_checkpointing, checkpoint_every_n)
        self._offload = offload_options(offload, offload_path, offload_chunk_mb, offload_params, self.layout.zero_stage)
        self.checkpoint_format = checkpoint_format
        self._pipeline_grads: list = []
        self._tp_plan = dict(tp_plan) if tp_plan else None
        self._sequence_parallel = bool(sequence_parallel)
        self._bucket_size_mb = bucket_size_mb
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._device_mesh: Optional[DeviceMesh] = None
        self._engines: list[ZeroDataParallel] = []
        self._sync_grads = True
        self.logits_bytes = self.logits_dense_bytes = 0
        self._parallelized: Optional[pl.LightningModule] = None
        self._full_names: Optional[list[str]] = None  # state / parameter names before a pipeline split
        self._full_param_names: Optional[list[str]] = None
        self._tied: Optional[TiedGroups] = None  # tied weights with a copy on several pipeline ranks
        self.num_nodes = 1
        self._setting_up: Optional[str] = None  # the setup step under way (for error reports)
        self.parallelized: Optional[Parallelized] = None  # what the recipe made of the module (setup)

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        """Register ``"3d"`` and the ZeRO presets in Lightning's ``StrategyRegistry``."""
        registry.register("3d", cls, description="lightning_3d: data x tensor x pipeline + ZeRO", override=True)
        for stage in (1, 2, 3):
            registry.register(
                f"3d_zero{stage}", cls, description=f"lightning_3d with ZeRO stage {stage}",
                zero_stage=stage, override=True,
            )

    # ------------------------------------------------------------------ properties
    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("the device mesh exists only after the processes have started (setup_environment)")
        return self._device_mesh

    @property
    def dp_size(self) -> int:
        return self.device_mesh[MeshAxis.DATA.value].size()

    @property
    def dp_rank(self) -> int:
        return self.device_mesh[MeshAxis.DATA.value].get_local_rank()

    @property
    @override
    def root_device(self) -> torch.device:
        if self.parallel_devices is None:
            raise RuntimeError("root_device is unknown until the Trainer has assigned devices")
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks that share a data-parallel coordinate (tensor / pipeline peers) read the same data.
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    # ------------------------------------------------------------------ launch and setup
    @override
    def _configure_launcher(self) -> None:
        # Called while the Trainer is constructed: the last moment to reject a bad layout
        # before any process, process group or file exists.
        self.layout = self.layout.resolve(self.num_nodes * self.num_processes)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.root_device.type == "cpu":
            # Ranks on one host share its cores; unless OMP_NUM_THREADS says otherwise, give each
            # rank its share instead of letting every rank start one thread per core.
            _set_num_threads_if_needed(num_processes=self.num_processes)
        reset_seed()
        self._set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        self.layout = self.layout.resolve(self.world_size)
        self._device_mesh = build_mesh(self.layout, self.root_device.type)

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._setting_up = "setup"
        self._setup(trainer)
        self._setting_up = None

    def _setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        self.model_to_device()
        self.model = self.precision_plugin.convert_module(self.model)
        if self._parallelized is not self.lightning_module:  # e.g. trainer.validate() after fit()
            self._parallelize(self.lightning_module)
            self._parallelized = self.lightning_module
        self._setting_up = "optimizer setup"
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.layout.zero_stage < 3:
                self._attach_engines(self.device_mesh[MeshAxis.DATA.value, MeshAxis.TENSOR.value])
            self._offload_optimizers()
        self.setup_precision_plugin()
        self._use_global_norm_clipping()
        self._share_overflow_checks()
        self.barrier()

    def _parallelize(self, module: pl.LightningModule) -> None:
        # The recipe, in order. 1. Pipeline split: keep only this rank's stages, so nothing
        # else is ever sharded or handed to the optimizer. 2. Tensor parallelism: weights become
        # tp-sharded DTensors. 3. ZeRO: stage 3 shards them on the data axis now; stages 0-2
        # bucket them at optimizer setup.
        stages = None
        # Names as one process has them (checkpoints are written and read in that form).
        self._full_names = list(module.state_dict())
        self._full_param_names = [name for name, _ in module.named_parameters()]
        # Tied weights (embedding = head), found while the model is whole: each stays one
        # parameter below, or one copy per pipeline stage with summed gradients (parallel/tied.py).
        ties = find_tied(module)
        record_aliases(module, ties)
        if self.layout.tensor > 1:  # recognise the architecture while the model is still whole
            plan = build_plan(module, self._tp_plan, self._sequence_parallel)
        self._setting_up = "the pipeline split"
        if self.layout.pipeline > 1:
            spec = self._pipeline_spec(module)
            pp_mesh, options = self.device_mesh[MeshAxis.PIPELINE.value], self._pipeline_options
            holders = tied_holders(module, spec, pp_mesh.size(), options["virtual_stages"], options["split"])
            self._tied = TiedGroups(self.device_mesh, holders)
            stages = self._split_pipeline(module, spec)
        self._setting_up = "tensor parallelism"
        if self.layout.tensor > 1:
            # Under a pipeline, patterns for other stages' modules (the head, say) match nothing here.
            tp_mesh = self.device_mesh[MeshAxis.TENSOR.value]
            check_tied_styles(module, resolve_plan(module, plan, tp_mesh.size(), stages is None), ties)
            resolved = apply_tensor_parallel(module, tp_mesh, plan, require_all=stages is None)
            retie(module, ties)  # each module got its own sharded copy: make them one again
            self._watch_logits(resolved)
        # 4. Activation checkpointing, per block: after the split (placeholders are skipped) and
        # after tensor parallelism (its hooks run inside the recomputed region); before FSDP2,
        # whose per-block gather / reshard hooks then wrap the checkpointed forward.
        self._setting_up = "activation checkpointing"
        apply_activation_checkpointing(module, self._checkpointing["policy"], self._checkpointing["every_n"])
        self._setting_up = "ZeRO-3 (FSDP2) sharding"
        if self.layout.zero_stage == 3:
            apply_zero3(module, self.device_mesh[MeshAxis.DATA.value], roots=stages, **self._fsdp_policies())
        self.parallelized = Parallelized(
            module, self.device_mesh, self._full_names, self._full_param_names, stages, None, self._tied
        )
        if stages is not None:
            options, mesh = self._pipeline_options, self.device_mesh[MeshAxis.PIPELINE.value]
            self._pipeline = PipelineRuntime(
                stages, spec, mesh, options, module.trainer, self.root_device, self.device_mesh[MeshAxis.TENSOR.value],
                scale_loss=self._scale_loss,
            )
            self.parallelized.runtime = self._pipeline

    @staticmethod
    def _pipeline_spec(module: pl.LightningModule) -> Any:
        if not callable(getattr(module, "pipeline_spec", None)):
            raise ValueError(
                f"{type(module).__name__} cannot be split into pipeline stages: define "
                "pipeline_spec() returning a lightning_3d.PipelineSpec (see the README)"
            )
        return module.pipeline_spec()

    def _split_pipeline(self, module: pl.LightningModule, spec: Any) -> list:
        pp_mesh = self.device_mesh[MeshAxis.PIPELINE.value]
        virtual = self._pipeline_options["virtual_stages"]
        split = self._pipeline_options["split"]
        return split_stages(module, spec, pp_mesh.get_local_rank(), pp_mesh.size(), virtual, split)

    def _watch_logits(self, resolved: Mapping[str, Any]) -> None:
        """Record the bytes of vocab-parallel logits (local and full) for the run summary."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import ColwiseParallel

        def record(module: Any, inputs: Any, output: Any) -> None:
            if isinstance(output, DTensor):
                self.logits_bytes = output._local_tensor.numel() * output.element_size()
                self.logits_dense_bytes = output.numel() * output.element_size()

        for name, style in resolved.items():
            if isinstance(style, ColwiseParallel) and not style.use_local_output:  # the loss-parallel head
                self.lightning_module.get_submodule(name).register_forward_hook(record)

    def _attach_engines(self, mesh: DeviceMesh) -> None:
        for engine in self._engines:
            engine.detach()
        bucket_numel = max(1, int(self._bucket_size_mb * 2**20) // 4)
        self._engines = []
        tied = {id(p): group for p, group, _ in self._tied_copies()}
        for optimizer in self.optimizers:
            engine = ZeroDataParallel(mesh, self.layout.zero_stage, bucket_numel=bucket_numel)
            engine.attach(optimizer, tied=tied)
            self._engines.append(engine)
            self.parallelized.bind(optimizer, engine)

    def _tied_copies(self) -> list[tuple[Any, Any, bool]]:
        """``(parameter, group, is_first_holder)`` for this rank's copies of tied weights that
        other pipeline ranks hold too."""
        return self._tied.local(self.lightning_module) if self._tied else []

    def _norm_duplicates(self) -> set[int]:
        """Optimizer parameters whose gradient another pipeline rank counts in the global norm
        already (a tied weight's copy on any holder but the first)."""
        out = set()
        for p, _, first in self._tied_copies():
            if not first:
                engine = next((e for e in self._engines if e.slice_of(p) is not None), None)
                out.add(id(engine.slice_of(p) if engine is not None else p))
        return out

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ training hooks
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this on accumulation micro-batches: reduce only on the last one.
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = True

    def _step_context(self):
        # Vocab-parallel logits (a DTensor sharded on the vocabulary) need loss_parallel for
        # cross-entropy, in the forward and in the backward.
        return vocab_parallel_loss() if self.layout.tensor > 1 else nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            if self._pipeline is not None:
                return self._pipeline_training_step(*args)
            return _plain(super().training_step(*args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context(), self._pipeline_forward(args, kwargs):
            return _plain(super().validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context(), self._pipeline_forward(args, kwargs):
            return _plain(super().test_step(*args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context(), self._pipeline_forward(args, kwargs):
            return super().predict_step(*args, **kwargs)

    @contextmanager
    def _pipeline_forward(self, args: tuple, kwargs: dict) -> Generator[None, None, None]:
        """Under a pipeline, run the batch through a forward-only schedule first, then let the
        module's own step run on every rank with ``self(inputs)`` answering the last stage's
        outputs (shared over the pipeline group): its metrics, logging and returned values are
        then what one process computes, on every rank."""
        if self._pipeline is None:
            yield
            return
        module = self.lightning_module
        batch = kwargs.get("batch", args[0] if args else None)
        with self.precision_plugin.forward_context():
            output = self._pipeline.outputs(batch)
        calls: list[int] = []

        def forward(*_: Any, **__: Any) -> Any:
            if calls:
                raise RuntimeError(
                    f"under pipeline={self.layout.pipeline}, {type(module).__name__}'s step may call self(...) "
                    "once per batch: the pipeline ran the batch's inputs (PipelineSpec.inputs) already"
                )
            calls.append(1)
            return output

        module.forward = forward  # an instance attribute shadows the class's forward
        try:
            yield
        finally:
            del module.forward

    def _pipeline_training_step(self, batch: Any, batch_idx: int = 0, *rest: Any) -> Tensor:
        # The schedule runs forward and backward of every micro-batch here, but Lightning zeroes
        # gradients *between* training_step and backward. So: clear stale gradients ourselves at
        # the start of an accumulation window, set this step's aside, and hand them back in
        # backward(), which otherwise does nothing.
        params = list(self.lightning_module.parameters())
        if batch_idx % self.lightning_module.trainer.accumulate_grad_batches == 0:
            for p in params:
                p.grad = None
        self.pre_backward(None)
        # Only the last stage computes (and scales) a loss; a grad scaler on the other stages
        # sets up its scale here, so their unscale_ (of gradients scaled downstream) works.
        self._scale_loss(torch.zeros((), device=self.root_device))
        with self.precision_plugin.train_step_context():  # autocast under mixed precision
            loss = self._pipeline.run(batch)
        self._pipeline_grads = [(p, p.grad) for p in params if p.grad is not None]
        for p, _ in self._pipeline_grads:
            p.grad = None
        self.lightning_module.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is not None:  # the schedule already ran backward in training_step
            if not self._engines:  # ZeRO-3: FSDP2 reduced the copies' gradients; add them up
                self._sum_tied_grads()
            for p, grad in self._pipeline_grads:
                p.grad = grad if p.grad is None else p.grad + grad
            self._pipeline_grads = []
            self.post_backward(closure_loss)
            return closure_loss
        with self._step_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _sum_tied_grads(self) -> None:
        """This step's gradient of each tied weight, summed over the pipeline ranks holding a copy
        (the ZeRO 0-2 engines do this in their buffers)."""
        pending = {id(p): grad for p, grad in self._pipeline_grads}
        for p, group, _ in self._tied_copies():
            if id(p) not in pending:  # no gradient on this stage: still take part
                pending[id(p)] = torch.zeros_like(p)
                self._pipeline_grads.append((p, pending[id(p)]))
            dist.all_reduce(local_tensor(pending[id(p)]), group=group)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        for engine in self._engines:
            engine.prepare_backward(sync=self._sync_grads, early=self._pipeline is None)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        for engine in self._engines:
            engine.finish_backward()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Any] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        engine = self._engine_for(getattr(optimizer, "_optimizer", optimizer))
        if engine is not None:
            engine.after_step()
        return output

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints
    # Save and load hooks: lightning_3d/checkpoint/strategy_hooks.py (CheckpointHooks).

    def count_parameters(self) -> int:
        """Parameters of the whole model (a DTensor counts its global size; pipeline stages add
        up). A collective under a pipeline."""
        copies = sum(p.numel() for p, _, first in self._tied_copies() if not first)  # counted on another stage
        count = torch.tensor(sum(p.numel() for p in self.lightning_module.parameters()) - copies, dtype=torch.int64)
        if self._pp_group is not None:
            dist.all_reduce(count, group=self._pp_group)
        return int(count)

    @property
    def _pp_group(self) -> Any:
        """The pipeline group when stages hold different parameters, else ``None``."""
        pp = self.device_mesh[MeshAxis.PIPELINE.value]
        return pp.get_group() if pp.size() > 1 else None

    def _engine_for(self, optimizer: Optimizer) -> Optional[ZeroDataParallel]:
        return next((e for e, o in zip(self._engines, self.optimizers) if o is optimizer), None)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # A peer that died (killed, out of memory, lost node) surfaces here as a failed
        # collective: gloo's "Connection closed by peer" at once, or after `timeout` if the
        # peer just went silent. Say what it means and how to continue.
        if self._setting_up is not None:  # not a peer's failure: this rank could not build the layout
            print(
                f"lightning_3d: rank {self.global_rank}: setting up {type(self.lightning_module).__name__} for "
                f"{self.layout} failed during {self._setting_up}: {type(exception).__name__}: "
                f"{str(exception).splitlines()[0][:300] if str(exception) else ''}",
                file=sys.stderr, flush=True,
            )
            return
        if _is_collective_failure(exception) and _distributed_is_initialized():
            print(
                f"lightning_3d: rank {self.global_rank}: a collective failed ({type(exception).__name__}: "
                f"{str(exception).splitlines()[0][:200]}). Another rank has probably stopped; checkpoints "
                "already written are complete (saves are atomic): relaunch with ckpt_path='last' to resume.",
                file=sys.stderr, flush=True,
            )

    @override
    def teardown(self) -> None:
        for engine in self._engines:  # kept (not dropped): trainer.save_checkpoint() after fit needs them
            engine.detach()
        # Lightning moves optimizer state to CPU here; an offloaded state is already off the
        # device (reading it would stream the whole NVMe file). Its files stay until the
        # optimizer is dropped or the process exits, so a checkpoint after fit still has them.
        kept = self._optimizers
        self._optimizers = [o for o in kept if not isinstance(o, OffloadedAdam)]
        try:
            super().teardown()
        finally:
            self._optimizers = kept


def _is_collective_failure(exception: BaseException) -> bool:
    """A failed collective (a peer stopped or went silent), as gloo and NCCL report it."""
    if isinstance(exception, dist.DistError):
        return True
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and any(
        word in text for word in ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout")
    )


def _plain(output: Any) -> Any:
    """A replicated DTensor loss (from ``loss_parallel``) as a plain tensor, keeping its graph."""
    from torch.distributed.tensor import DTensor

    if isinstance(output, DTensor):
        return output.full_tensor()
    if isinstance(output, dict) and isinstance(output.get("loss"), DTensor):
        return {**output, "loss": output["loss"].full_tensor()}
    return output
