"""``ThreeDStrategy``: the Lightning adapter around the plan (``options/``), the recipe
(``recipe.py``), the precision subclasses (``precision.py``), the pipeline runtime and the
checkpoint hooks: it answers Lightning's calls with them and holds no parallelism of its own."""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_3d.checkpoint.io import AtomicCheckpointIO
from lightning_3d.layout import Layout, MeshAxis, build_mesh, shard_mesh
from lightning_3d.observe.telemetry import Telemetry
from lightning_3d.offload import OffloadedAdam
from lightning_3d.options import Plan
from lightning_3d.parallel.clip import collective_device, global_grad_norm
from lightning_3d.parallel.fsdp import accumulate_gathered, end_accumulation
from lightning_3d.parallel.loss import plain_loss, vocab_parallel_loss
from lightning_3d.parallel.materialize import to_device_keeping_meta
from lightning_3d.parallel.replicas import ReplicaCheck, plan_hint
from lightning_3d.runtime.agreement import agree_on_setup
from lightning_3d.runtime.failures import LINES_ATTR, REPORTS_ENV, describe_failure
from lightning_3d.runtime.preemption import StopOnSignal, without_signal_broadcast
from lightning_3d.runtime.watchdog import Watchdog, watch_world
from lightning_3d.strategy.checkpoint_hooks import CheckpointHooks
from lightning_3d.strategy.collectives import Collectives, sync_metrics_over
from lightning_3d.strategy.precision import distributed_precision, scale_loss
from lightning_3d.strategy.recipe import Parallelized, attach_optimizers, parallelize

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_3d.parallel.pipeline_runtime import PipelineRuntime


def refuse_manual_optimization(module: Any, layout: Layout) -> None:
    """``ValueError`` for a module that steps its own optimizers (``automatic_optimization =
    False``) under a layout that cannot run it: a pipeline, whose schedule runs forward and
    backward of every micro-batch inside ``training_step``, where no ``manual_backward`` or
    optimizer step of the module's own can take part."""
    if layout.pipeline > 1 and not getattr(module, "automatic_optimization", True):
        raise ValueError(
            f"manual optimization (automatic_optimization = False) cannot run under "
            f"pipeline={layout.pipeline}: the pipeline schedule runs forward and backward inside "
            "training_step itself; use pipeline=1 (ZeRO 0-3, tensor and context parallelism take "
            "manual optimization) or automatic optimization"
        )


def refuse_empty_optimizers(optimizers: list[Optimizer], layout: Layout, stage: int) -> None:
    """``ValueError`` naming the first optimizer that holds no parameter on this rank. Under a
    pipeline each stage holds only its own blocks' parameters, so an optimizer built over a
    sub-module on another stage is empty here; it is refused rather than dropped on that stage
    (the stages would then step different numbers of optimizers, and their checkpoints and LR
    schedulers would count them differently)."""
    for index, optimizer in enumerate(optimizers):
        if not any(group["params"] for group in optimizer.param_groups):
            raise ValueError(_empty_optimizer_words(index, layout, stage))


def explain_empty_optimizer(error: Exception, layout: Layout, stage: int) -> Exception:
    """Under a pipeline, torch's "optimizer got an empty parameter list" (an optimizer built over
    modules of another stage) as a ``ValueError`` saying so, from the original; ``error``
    otherwise."""
    if layout.pipeline > 1 and "empty parameter list" in str(error):
        explained = ValueError(_empty_optimizer_words(None, layout, stage))
        explained.__cause__ = error
        return explained
    return error


def _empty_optimizer_words(index: Optional[int], layout: Layout, stage: int) -> str:
    which = "an optimizer" if index is None else f"optimizer {index}"
    where = (
        f"pipeline stage {stage} of {layout.pipeline} holds only its own blocks' parameters, "
        "and an optimizer over modules of another stage has none there; build one optimizer "
        "over self.parameters() (the stages share it: each steps its own parameters)"
        if layout.pipeline > 1
        else "build it over the module's parameters"
    )
    return f"{which} got no parameters on this rank: {where}"


def computes_on_host(device_type: str, offload_device: str) -> bool:
    """Whether a rank's heavy work runs on its host's cores, which the ranks of a node share:
    on a CPU all of it; on an accelerator, the optimizer step of offloaded state (the CPU Adam
    over every parameter's moments, each step). Such ranks get ``cores / local ranks`` threads
    each, unless ``OMP_NUM_THREADS`` is set."""
    return device_type == "cpu" or offload_device != "none"


class ThreeDStrategy(CheckpointHooks, Collectives, ParallelStrategy):
    """Pipeline × data × tensor parallelism with ZeRO sharding on the data axis.

    Takes a :class:`~lightning_3d.options.Plan`, or its options by name (``tensor=2``, ...: the
    table in :data:`lightning_3d.options.OPTIONS` and docs/options.md). A bad value raises
    ``ValueError`` here, before any process exists.

    Example::

        import lightning as L
        import lightning_3d  # registers "3d", "3d_zero1", "3d_zero2", "3d_zero3", "3d_auto" (auto=True)

        trainer = L.Trainer(accelerator="cpu", devices=4, strategy="3d_zero3")
        trainer = L.Trainer(devices=8, strategy=lightning_3d.ThreeDStrategy(tensor=2, zero_stage=2))
    """

    strategy_name = "3d"
    # A module built on meta (LitGPT(deferred_init=True)) is materialised by the recipe, after
    # sharding, straight into its final dtype, device and shard (parallel/materialize.py).
    materializes_meta_modules = True

    def __init__(
        self,
        plan: Optional[Plan] = None,
        *,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        **options: Any,
    ) -> None:
        self.plan = (plan or Plan()).updated(**options)  # checked, even when built by hand
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            # Atomic files: a save killed half-way leaves the previous checkpoint, not a torn one.
            checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        self.telemetry = Telemetry()  # RunSummary subscribes (logits sizes, pipeline bubbles)
        self.signals = StopOnSignal()  # a callback: on SIGTERM / SIGINT every rank saves and stops
        # What the recipe made of the module (setup).
        self.parallelized: Optional[Parallelized] = None
        self.num_nodes = 1
        self._device_mesh: Optional[DeviceMesh] = None
        self._sample_group: Optional[Any] = None  # the mesh's dp group (setup_environment)
        # The token mean over the global batch (setup_environment: over ZeRO's axis).
        # parallel/objective.py's TokenMean (setup_environment).
        self.objective: Optional[Any] = None
        self._sync_grads = True
        self._in_step_context = False  # inside _step_context (manual_backward runs in it)
        self._setting_up: Optional[str] = None  # the setup step under way (for error reports)
        # Heartbeats: names a stalled or dead peer (setup_environment).
        self.watchdog: Optional[Watchdog] = None
        # auto=True: the planner's predictions (RunSummary writes them).
        self.planned: Optional[dict[str, Any]] = None
        self._replica_steps = 0  # optimizer steps of this run so far (the replica check's clock)

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        """Register ``"3d"`` and the ZeRO presets in Lightning's ``StrategyRegistry``."""
        registry.register(
            "3d", cls, description="lightning_3d: data x tensor x pipeline + ZeRO", override=True
        )
        for stage in (1, 2, 3):
            registry.register(
                f"3d_zero{stage}",
                cls,
                description=f"lightning_3d with ZeRO stage {stage}",
                zero_stage=stage,
                override=True,
            )
        registry.register(
            "3d_auto",
            cls,
            description="lightning_3d: the planner's layout",
            auto=True,
            override=True,
        )

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @property
    def checkpoint_format(self) -> str:
        return self.plan.checkpoint.format

    @property
    def pipeline(self) -> Optional[PipelineRuntime]:
        """This rank's pipeline runtime (``None`` without a pipeline, or before setup)."""
        return self.parallelized.runtime if self.parallelized is not None else None

    @property
    def step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (``nonfinite="skip"``: nothing applied).
        A module that moves state by each applied step's figures (a balancing bias) reads it
        after the step."""
        guard = getattr(self.precision_plugin, "nonfinite", None)
        return guard is not None and guard.skipped_step

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError(
                "the device mesh exists only after the processes have started (setup_environment)"
            )
        return self._device_mesh

    @property
    def dp_size(self) -> int:  # the mesh's own group (slicing the mesh costs ~0.3 ms per call)
        return self.device_mesh.get_group(MeshAxis.DATA.value).size()

    @property
    def dp_rank(self) -> int:
        return self.device_mesh.get_local_rank(MeshAxis.DATA.value)

    @property
    def sample_group(self) -> Optional[Any]:
        """The ranks holding different samples, which ``self.log(..., sync_dist=True)`` and the
        module's torchmetrics reduce over: this rank's group on the mesh's ``dp`` axis (tensor and
        context ranks hold copies of its samples, pipeline stages share its outputs); ``None``
        (the whole world) where that is every rank, or before the mesh exists."""
        return self._sample_group

    @property
    def context_size(self) -> int:
        """Ranks each sequence is split over (``context``): a batch on a rank holds 1/this of
        every sequence's tokens."""
        return self.layout.context

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

    @override
    def _configure_launcher(self) -> None:
        # Called while the Trainer is constructed: the last moment to reject a bad layout
        # before any process, process group or file exists.
        resolved = self.plan.resolved(self.num_nodes * self.num_processes)
        if not self.plan.auto.enabled:  # auto: data stays free (a size given is a constraint)
            self.plan = resolved
        # torchrun, srun: Lightning checks only its own launches.
        if self.cluster_environment.creates_processes_externally:
            self.cluster_environment.validate_settings(
                num_devices=self.num_processes, num_nodes=self.num_nodes
            )
        else:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if computes_on_host(self.root_device.type, self.plan.offload.device):
            # Ranks on one host share its cores; unless OMP_NUM_THREADS says otherwise, give each
            # rank its share instead of letting every rank start one thread per core.
            _set_num_threads_if_needed(num_processes=self.num_processes)
        reset_seed()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        backend = self.plan.dist.backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        device_id = self.root_device if self.root_device.type != "cpu" else None
        # ProcessGroupNCCL reads its error handling from the environment when it is built.
        from lightning_3d.runtime.nccl_env import nccl_fail_fast  # not on `import lightning_3d`

        for warning in nccl_fail_fast(backend, self.plan.dist.timeout_s):
            rank_zero_warn(warning)
        _init_dist_connection(
            self.cluster_environment, backend, timeout=self.plan.dist.timeout, device_id=device_id
        )
        # The planner's first choice for the world found (lightning_3d/strategy/auto.py).
        if self.plan.auto.enabled:
            from lightning_3d.strategy.auto import resolve_for_strategy  # loads the planner

            self.plan = resolve_for_strategy(self)
        self.plan = self.plan.resolved(self.world_size)
        self._device_mesh = build_mesh(self.layout, self.root_device.type)
        data = self._device_mesh.get_group(MeshAxis.DATA.value)
        self._sample_group = data if data.size() < self.world_size else None
        from lightning_3d.parallel.objective import TokenMean  # not on `import lightning_3d`

        self.objective = TokenMean(shard_mesh(self._device_mesh).get_group())
        self.watchdog = self.watchdog or watch_world(
            self.global_rank,
            self.world_size,
            self.plan,
            lambda: self.lightning_module.trainer.global_step,
        )

    @override
    def connect(self, model: pl.LightningModule) -> None:
        refuse_manual_optimization(model, self.layout)  # before any process group (auto: setup)
        self._refuse_unrun_training_step(model)
        super().connect(model)

    def _refuse_unrun_training_step(self, module: pl.LightningModule) -> None:
        if self.layout.pipeline > 1:  # loaded for pipelines only, not on `import lightning_3d`
            from lightning_3d.strategy.pipeline_step import refuse_unrun_training_step

            refuse_unrun_training_step(module, self.layout)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        refuse_manual_optimization(self.lightning_module, self.layout)  # the resolved layout
        self._refuse_unrun_training_step(self.lightning_module)
        self.accelerator.setup(trainer)
        self.model_to_device()
        self.model = self.precision_plugin.convert_module(self.model)
        module = self.lightning_module
        self._adopt_earlier_run(module)  # a module an earlier Trainer parallelized: its record
        # validate() after fit() reuses.
        if self.parallelized is None or self.parallelized.module is not module:
            # Through module.trainer: a later Trainer's strategy may run this schedule.
            self.parallelized = parallelize(
                module,
                self.device_mesh,
                self.plan,
                device=self.root_device,
                precision=str(self.precision_plugin.precision),
                accumulation=lambda: module.trainer.accumulate_grad_batches,
                scale_loss=lambda loss: scale_loss(module.trainer.strategy.precision_plugin, loss),
                telemetry=self.telemetry,
                step=lambda name: setattr(self, "_setting_up", name),
                objective=self.objective,
            )
            self._remember_run(module)
        # The module's torchmetrics sync over the ranks holding different samples, as self.log.
        sync_metrics_over(module, self.sample_group)
        self._setting_up = "optimizer setup"
        # The module's configure_optimizers may fail on some ranks only (an optimizer over a
        # sub-module that lives on another pipeline stage): the ranks agree on the outcome of
        # each such step before the next collective, and all raise together (agree_on_setup).
        agreement_device = collective_device(None)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            # SIGTERM: save, stop.
            trainer.callbacks += [] if self.signals in trainer.callbacks else [self.signals]
            without_signal_broadcast(trainer)  # the step's agreement carries the signal
        error: Optional[Exception] = None
        try:
            if fitting:
                self.setup_optimizers(trainer)
                refuse_empty_optimizers(self.optimizers, self.layout, self._pipeline_stage())
        except Exception as err:  # noqa: BLE001 -- raised below, on every rank alike
            error = explain_empty_optimizer(err, self.layout, self._pipeline_stage())
        agree_on_setup(self._setting_up, error, agreement_device)
        try:
            if fitting:
                self.optimizers = attach_optimizers(self.parallelized, self.optimizers, self.plan)
            self.setup_precision_plugin()
            # Clipping by the global norm over shards and stages, and a loss-scale overflow on
            # any rank skipping the step on every rank: a subclass of the plugin Lightning chose.
            self.precision_plugin = distributed_precision(
                self.precision_plugin,
                self._norm_scope,
                self.plan.nonfinite,
                before_step=self._check_replica_gradients,
                signals=self.signals,
            )
        except Exception as err:  # noqa: BLE001 -- raised below, on every rank alike
            error = err
        agree_on_setup(self._setting_up, error, agreement_device)  # also setup's last barrier
        self._setting_up = None

    def _adopt_earlier_run(self, module: pl.LightningModule) -> None:
        # The recipe rewrote the module in place (DTensor weights, FSDP2 blocks, this rank's
        # pipeline stages only) and cannot run on it again: take over that run's record, the
        # mesh its DTensors live on and the objective its schedule reports to (strategy/reuse.py).
        from lightning_3d.strategy.reuse import earlier_run  # not on `import lightning_3d`

        earlier = earlier_run(module, self.layout)
        if earlier is None or self.parallelized is earlier.parallelized:
            return
        self.parallelized = earlier.parallelized
        self._device_mesh = earlier.parallelized.mesh
        data = self._device_mesh.get_group(MeshAxis.DATA.value)
        self._sample_group = data if data.size() < self.world_size else None
        self.objective = earlier.objective
        earlier.relay_to(self.telemetry)

    def _remember_run(self, module: pl.LightningModule) -> None:
        # For the strategy of a later Trainer the module is handed to (_adopt_earlier_run).
        from lightning_3d.strategy.reuse import EarlierRun, remember

        remember(module, EarlierRun(self.parallelized, self.layout, self.objective, self.telemetry))

    def _pipeline_stage(self) -> int:
        return self.device_mesh.get_local_rank(MeshAxis.PIPELINE.value)

    def _norm_scope(self) -> tuple[Any, set[int]]:
        # Stages own disjoint parameters: their norms add up over pp, a tied copy's only once.
        return self.parallelized.pp_group, self.parallelized.norm_duplicates()

    @override
    def model_to_device(self) -> None:
        # meta: the recipe materialises it in place.
        to_device_keeping_meta(self.model, self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this on accumulation micro-batches: reduce only on the last one.
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = True

    @contextmanager
    def _step_context(self, training: bool = False) -> Generator[None, None, None]:
        # Entered once: manual_backward calls backward inside training_step's context, and a
        # nested loss_parallel() would remove torch's loss ops on its exit, under the outer one.
        if self._in_step_context:
            yield
            return
        self._in_step_context = True
        try:
            with self._loss_contexts(training):
                yield
        finally:
            self._in_step_context = False

    def _loss_contexts(self, training: bool = False) -> ExitStack:
        # Vocab-parallel logits (a DTensor sharded on the vocabulary) need loss_parallel for
        # cross-entropy, in the forward and in the backward; scoped to this strategy's steps.
        # Training: the loss is the token mean over the global batch (parallel/objective.py);
        # evaluation under context parallelism: over the whole sequence (every cp rank).
        stack = ExitStack()
        if self.layout.tensor > 1:
            stack.enter_context(vocab_parallel_loss())
        if training:
            stack.enter_context(self.objective.training())
        elif self.layout.context > 1:
            from lightning_3d.parallel.objective import evaluation_mean

            stack.enter_context(evaluation_mean(self.device_mesh.get_group(MeshAxis.CONTEXT.value)))
        return stack

    @override
    def batch_to_device(
        self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0
    ) -> Any:
        if self.layout.context > 1:
            # Context parallelism: this rank keeps its load-balanced tokens of every sequence,
            # cut before the copy to the device (only 1/context of each sequence crosses).
            from lightning_3d.parallel.context.batch import shard_batch

            axis = MeshAxis.CONTEXT.value
            mesh = self.device_mesh
            batch = shard_batch(batch, mesh.get_local_rank(axis), mesh.get_group(axis).size())
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        accumulation = self.lightning_module.trainer.accumulate_grad_batches
        calls = 1 if self.pipeline is None else self.pipeline.micro_batches
        self.objective.begin(window=batch_idx % accumulation == 0, calls_per_step=calls)
        with self._step_context(training=True):
            if self.pipeline is None:
                if self._keeps_gathered:
                    # Before the forward: this micro-batch's FSDP2 resharding and reduction.
                    accumulate_gathered(self.model, last=self._sync_grads)
                return plain_loss(super().training_step(*args, **kwargs))
            loss = self.pipeline.train_step(
                self.lightning_module,
                args[0],
                batch_idx,
                self._before_schedule,
                self.precision_plugin.train_step_context(),
            )
            # The module's own end of the step (strategy/pipeline_step.py): its logs and metrics.
            self.lightning_module.pipeline_training_step_end(loss, args[0], batch_idx)
            return loss

    def _before_schedule(self) -> None:
        self.pre_backward(None)
        # Only the last stage scales a loss: the other stages' grad scaler sets up its scale here.
        scale_loss(self.precision_plugin, torch.zeros((), device=self.root_device))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self._evaluation_step(super().predict_step, args, kwargs, plain=False)
        return self._whole_predictions(output)

    def _whole_predictions(self, output: Any) -> Any:
        # What ddp's predict returns: plain tensors (a vocab-parallel head's logits are DTensors),
        # whole sequences (context parallelism: this rank's tokens gathered back), in a bare
        # tensor or a dict / tuple / list of them.
        output = apply_to_collection(output, DTensor, lambda t: t.full_tensor())
        if self.layout.context > 1:
            from lightning_3d.parallel.context.batch import gather_outputs

            output = gather_outputs(output, self.device_mesh.get_group(MeshAxis.CONTEXT.value))
        return output

    def gradient_norm(self, optimizer: Optimizer) -> Tensor:
        """The 2-norm of the gradients ``optimizer`` is about to apply, over the whole model,
        as one process computes it: what ``grad_norm(module, 2)["grad_2.0_norm_total"]`` gives
        under ``ddp``. Lightning's ``grad_norm`` reads each parameter's ``.grad``, which holds
        this rank's shard under ZeRO-3 and tensor parallelism and nothing under ZeRO 1-2 (the
        engine's slices hold the gradients); this sums the squares over the shards, tensor
        ranks and pipeline stages instead. A collective: call it on every rank, e.g. in
        ``on_before_optimizer_step``::

            def on_before_optimizer_step(self, optimizer):
                self.log("grad_norm", self.trainer.strategy.gradient_norm(optimizer))
        """
        sum_over, skip = self._norm_scope()
        return global_grad_norm(self.precision_plugin.main_params(optimizer), sum_over, skip)

    def _evaluation_step(
        self, step: Callable, args: tuple, kwargs: dict, plain: bool = True
    ) -> Any:
        # Under a pipeline, a forward-only schedule runs the batch first and the module's own
        # step then runs on every rank with self(inputs) answering the last stage's outputs.
        answering = (
            nullcontext()
            if self.pipeline is None
            else self.pipeline.answering_forward(
                self.lightning_module,
                kwargs.get("batch", args[0] if args else None),
                self.precision_plugin.forward_context(),
            )
        )
        with self._step_context(), answering:
            output = step(*args, **kwargs)
            return plain_loss(output) if plain else output

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any
    ) -> Tensor:
        if self.pipeline is not None:  # the schedule already ran backward in training_step
            return self._pipeline_backward(closure_loss)
        with self._step_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _pipeline_backward(self, closure_loss: Tensor) -> Tensor:
        # The schedule's gradients were set aside in training_step: on_before_backward and
        # on_after_backward (the module's and callbacks', through the precision plugin, as
        # Lightning's backward calls them) run around their hand-back, so they see p.grad as a
        # backward in one process leaves it before and after.
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # ZeRO-3: FSDP2 reduced the tied copies' gradients; add them up (ZeRO 0-2 engines do it).
        self.pipeline.hand_back_grads(
            self.parallelized.tied_copies() if not self.parallelized.engines else []
        )
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        for engine in self.parallelized.engines:
            engine.prepare_backward(sync=self._sync_grads, early=self.pipeline is None)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        for engine in self.parallelized.engines:
            engine.finish_backward()
        if self._keeps_gathered and self._sync_grads:
            # The step's last backward reduced and resharded: evaluation reshards as usual.
            end_accumulation(self.model)

    @property
    def _keeps_gathered(self) -> bool:
        """``zero3_keep_gathered`` in effect: accumulated micro-batches without a pipeline."""
        return (
            self.plan.fsdp.keep_gathered
            and self.pipeline is None
            and self.lightning_module.trainer.accumulate_grad_batches > 1
        )

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Any] = None,
        **kwargs: Any,
    ) -> Any:
        def closure_of_the_token_mean() -> Any:
            result = closure()
            self._weigh_gradients(optimizer)
            return result

        output = super().optimizer_step(optimizer, closure_of_the_token_mean, model, **kwargs)
        engine = self.parallelized.engine_for(optimizer)
        if engine is not None:
            engine.after_step()
        if self._replicas_due:
            self.check_replicas(values_only=True)
        self._replica_steps += 1
        return output

    def _weigh_gradients(self, optimizer: Optimizer) -> None:
        # Accumulated micro-batches (and a pipeline's) each weighed their tokens by the first
        # one's count: now that the step's count is known, make it the step's token mean.
        if not self.lightning_module.automatic_optimization:
            return
        divisor = self.lightning_module.trainer.accumulate_grad_batches * (
            1 if self.pipeline is None else self.pipeline.micro_batches
        )
        if self.objective.factor(divisor) is None:  # one micro-batch a step: nothing to scale
            return
        grads = [p.grad for p in self.precision_plugin.main_params(optimizer)]
        self.objective.weigh([_local(g) for g in grads if g is not None], divisor)

    @property
    def _replicas_due(self) -> bool:
        return self.plan.replicas.due(self._replica_steps)

    def _check_replica_gradients(self, optimizer: Optimizer) -> None:
        # Before the step: replicas' gradients (what the optimizer is about to apply) agree.
        if self._replicas_due:
            self._compare_gradients(optimizer)

    def _compare_gradients(self, optimizer: Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        ReplicaCheck(self.root_device, plan_hint(self.parallelized.tp_plan)).compare(
            "gradient", self.parallelized.replica_gradients(params)
        )

    def check_replicas(self, values_only: bool = False) -> None:
        """Check that every parameter several ranks replicate (tensor ranks; a tied weight's
        copies on pipeline stages) holds the same value on each, and (``values_only=False``)
        the same gradient, where gradients are held per parameter; ``ReplicaMismatch`` on every
        rank naming the parameters otherwise. A collective: call it on every rank. Runs by
        itself at the run's first optimizer step (``replica_check``)."""
        if not values_only:
            for optimizer in self.optimizers:
                self._compare_gradients(optimizer)
        ReplicaCheck(self.root_device, plan_hint(self.parallelized.tp_plan)).compare(
            "value", self.parallelized.replica_values()
        )

    @override
    def on_exception(self, exception: BaseException) -> None:
        message = describe_failure(
            exception, self.global_rank, self._setting_up, self.lightning_module, self.layout
        )
        named = self.watchdog.failure_line(exception) if self.watchdog is not None else None
        if os.environ.get(REPORTS_ENV):  # the app reports it, in one line for every rank
            # The peer this rank lost, named first: by the watchdog now, or by its thread before.
            named = named or (self.watchdog.verdict if self.watchdog is not None else None)
            try:
                setattr(exception, LINES_ATTR, [line for line in (named, message) if line])
                return
            except AttributeError:  # an exception that takes no attributes: said here
                pass
        for line in (message, named):
            if line:
                print(line, file=sys.stderr, flush=True)

    @override
    def teardown(self) -> None:
        # Lightning's teardown, but an offloaded optimizer's state stays put (reading it would
        # stream the NVMe file); engines detach but stay for trainer.save_checkpoint() after fit.
        for engine in self.parallelized.engines if self.parallelized is not None else ():
            engine.detach()
        self.cluster_environment.teardown()
        # offload_delay_update: the last step's weights into the model.
        for optimizer in self.optimizers:
            if isinstance(optimizer, OffloadedAdam):
                optimizer.synchronize()
        _optimizers_to_device(
            [o for o in self.optimizers if not isinstance(o, OffloadedAdam)], torch.device("cpu")
        )
        if self.lightning_module is not None:
            self.lightning_module.cpu()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        if self.watchdog is not None:  # joins its thread: none left running at interpreter exit
            self.watchdog.stop()
            self.watchdog = None


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard (its storage: scaled in place), a plain tensor as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
