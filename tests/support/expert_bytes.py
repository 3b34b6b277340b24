"""What one rank holds of a mixture-of-experts model's expert weights, counted from the tensors
themselves at the optimizer step: the check that ZeRO splits them over all ``G`` data ranks, not
only the ``ep`` ones. :func:`expert_bytes` counts weights, gradients and optimizer state from the
module (ZeRO-3's FSDP2 units); :func:`expert_zero_bytes` the ZeRO 1-2 expert engine's slices,
gradient buffers and fp32 masters (``parallel/expert_zero.py``).

``fit_counting_experts`` and ``fit_counting_expert_zero`` are ``run_world`` rank functions: they
train a :class:`~tools.harness.runs.Run` of the reference MoE GPT (``arch="moe"``) as ``fit_gpt``
does, with a callback that counts before each optimizer step, and return the last step's counts.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


def _nbytes(t: Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def expert_bytes(module: Any, optimizer: Any) -> dict[str, Any]:
    """This rank's bytes of the expert weights of ``module`` (names holding ``.experts.``):
    ``param``, ``grad`` and ``state`` (the optimizer's tensors for them); ``elements``: the
    weights' global element count; ``meshes``: each weight's mesh axes and placements."""
    from torch.distributed.tensor import DTensor

    params = [(n, p) for n, p in module.named_parameters() if ".experts." in n]
    state = [
        v
        for _, p in params
        for v in optimizer.state.get(p, {}).values()
        if isinstance(v, Tensor) and v.dim() > 0
    ]
    return {
        "param": sum(_nbytes(p) for _, p in params),
        "grad": sum(_nbytes(p.grad) for _, p in params if p.grad is not None),
        "state": sum(_nbytes(v) for v in state),
        "elements": sum(p.numel() for _, p in params),
        "meshes": {
            n: (p.device_mesh.mesh_dim_names, tuple(str(pl) for pl in p.placements))
            for n, p in params
            if isinstance(p, DTensor)
        },
    }


def expert_zero_bytes(made: Any, optimizer: Any) -> dict[str, Any]:
    """This rank's bytes for the expert weights of ``made`` (the strategy's ``Parallelized``):
    ``state`` (the optimizer's tensors, of the expert engine's slices or of whole expert weights),
    ``grads`` (the expert engine's gradient buffers), ``masters`` (its fp32 masters);
    ``elements``: the experts' global element count; ``bucketed``: the elements of the expert
    engine's buckets on this rank (its ``ep`` slice, padded); ``replicas``: its group's size
    (0 without an expert engine); ``full_grad``: whether it keeps full-size gradient buffers."""
    engine = made.engine_for(optimizer)
    experts = engine.experts if engine is not None else None
    buckets = experts.buckets if experts is not None else []
    owners = [b.slice for b in buckets] + list(made.experts)
    state = [
        v
        for owner in owners
        for v in optimizer.state.get(owner, {}).values()
        if isinstance(v, Tensor) and v.dim() > 0
    ]
    grads = [t for b in buckets for t in (b.grad, b.shard_grad) if t is not None]
    return {
        "state": sum(_nbytes(v) for v in state),
        "grads": sum(_nbytes(g) for g in grads),
        "masters": sum(_nbytes(b.master) for b in buckets if b.master is not None),
        "elements": sum(p.numel() for p in made.experts),
        "bucketed": sum(b.flat.numel() for b in buckets),
        "replicas": experts.size if experts is not None else 0,
        "full_grad": any(b.grad is not None for b in buckets),
    }


def fit_counting_experts(rank: int, run: Any) -> dict[str, Any]:
    """Train ``run`` (``arch="moe"``) on this rank; return :func:`expert_bytes` just before
    its last optimizer step (the optimizer's state exists from the second step on)."""
    return _fit_counting(run, lambda trainer, module, raw: expert_bytes(module, raw))


def fit_counting_expert_zero(rank: int, run: Any) -> dict[str, Any]:
    """Train ``run`` (``arch="moe"``) on this rank; return :func:`expert_zero_bytes` at the last
    optimizer step."""
    return _fit_counting(
        run, lambda trainer, module, raw: expert_zero_bytes(trainer.strategy.parallelized, raw)
    )


def _fit_counting(run: Any, count: Any) -> dict[str, Any]:
    """Train ``run``; ``count(trainer, module, optimizer)`` before each optimizer step, the last
    step's result returned."""
    import lightning as L

    from lightning_3d import ThreeDStrategy
    from lightning_3d.data import TextDataModule
    from lightning_3d.models.moe import LitMoEGPT
    from tools.harness.runs import TINY_DATA, TINY_MODEL

    counts: dict[str, Any] = {}

    class Count(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            raw = getattr(optimizer, "_optimizer", optimizer)
            counts.update(count(trainer, pl_module, raw))

    L.seed_everything(run.seed, verbose=False)
    module = LitMoEGPT(**{**TINY_MODEL, **(run.model or {})})
    trainer = L.Trainer(
        accelerator="cpu",
        devices=run.devices,
        strategy=ThreeDStrategy(**run.strategy),
        max_steps=run.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Count()],
        **(run.trainer or {}),
    )
    trainer.fit(module, TextDataModule(seed=run.seed, **{**TINY_DATA, **(run.data or {})}))
    return counts
