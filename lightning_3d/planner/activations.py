"""Activation bytes per transformer block per sample, measured with the project's meter.

:class:`~lightning_3d.parallel.activations.ActivationMeter` is what the runs use
(``RunSummary``'s ``activation_bytes_per_block``). It cannot count on ``meta`` (every meta
storage has data pointer 0, so all saves look like one tensor), so one block is copied to the
CPU at the model's real width, in the activation dtype (bf16 for the mixed precisions), with the
policy applied as the recipe applies it, and run forward at batch 1 on two short
sequences ``T1 < T2``. Saved bytes grow linearly in the batch and, per sample, as
``a·T + b·T²`` (``b`` is attention scores on the math path; 0 with fused attention), which the
two points fit. Tensor parallelism is measured too: the block's column-parallel linears get
``out / tp`` features and its row-parallel ones ``in / tp`` (the local shapes a tp rank holds),
so what stays replicated (norm inputs, the residual stream) and what is split are both counted.

Sequence parallelism (:func:`measure_sequence_parallel`) shards the norms, dropout and residual
stream by sequence, so what it saves depends on where DTensor gathers: the block is measured as
one rank of a fake world of ``tp`` ranks (no communication), with the architecture's own
sequence-parallel plan applied by ``parallelize_module``. Without sequence parallelism the same
fake-world measurement gives the local-shape copy's bytes exactly (a test holds them equal).

Blocks the copy cannot run alone (a forward needing more than the residual stream) or whose
split layers are not ``nn.Linear`` fall back to an estimate, marked in ``source``: the first
measurable point scaled by Megatron's split (about 10/34 of a block's saves stay replicated).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_3d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_3d.parallel.activations import ActivationMeter

MEASURE_TOKENS = 32  # T1; T2 = 2 * T1 (both capped at seq_len)
# Megatron (Korthikanti et al. 2022): 10 of 34 bytes·s·b·h per layer unsplit by TP.
REPLICATED_SHARE = 10 / 34


@dataclass(frozen=True)
class ActivationFit:
    """Bytes one block keeps for backward per sample of ``T`` tokens: ``per_token·T + per_token_sq·T²``."""

    per_token: float
    per_token_sq: float
    source: str  # "measured" or "estimated: why"
    points: tuple[tuple[int, int], ...] = ()  # the (T, bytes) measured at batch 1

    def bytes_per_sample(self, seq_len: int) -> float:
        return self.per_token * seq_len + self.per_token_sq * seq_len**2


def fit_points(points: Sequence[tuple[int, int]], source: str = "measured") -> ActivationFit:
    """``a·T + b·T²`` through one or two (T, bytes) points (one point: linear)."""
    if len(points) == 1 or points[0][0] == points[-1][0]:
        t, b = points[0]
        return ActivationFit(b / t, 0.0, source, tuple(points))
    (t1, b1), (t2, b2) = points[0], points[-1]
    sq = max(0.0, (b2 / t2 - b1 / t1) / (t2 - t1))
    return ActivationFit(max(0.0, b1 / t1 - sq * t1), sq, source, tuple(points))


def local_block(
    block: nn.Module, prefix: str, split: set[str], columns: set[str], tp: int
) -> Optional[nn.Module]:
    """A meta copy of ``block`` with the local shapes of one of ``tp`` ranks (``split``: names of
    the parameters tensor parallelism splits; ``columns``: names of the column-parallel modules);
    ``None`` when a split parameter is not an ``nn.Linear`` weight (its local shape is unknown here)."""
    local = copy.deepcopy(block)
    if tp == 1:
        return local
    for name, sub in list(local.named_modules()):
        full = f"{prefix}.{name}" if name else prefix
        hit = f"{full}.weight" in split
        if not hit:
            continue
        if type(sub) is not nn.Linear:
            return None
        column = full in columns
        fin, fout = sub.in_features, sub.out_features
        fin, fout = (fin, fout // tp) if column else (fin // tp, fout)
        twin = nn.Linear(fin, fout, bias=sub.bias is not None, device="meta")
        parent, _, attr = name.rpartition(".")
        setattr(local.get_submodule(parent) if parent else local, attr, twin)
    return local


def _materialize(block: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A CPU copy of a meta block with random weights (sizes, not values, decide what is saved)."""
    block = copy.deepcopy(block).to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block


def _adapted(block: nn.Module, adapter: Any) -> nn.Module:
    """``block`` (materialised) with ``adapter``'s LoRA layers on every linear projection; under
    QLoRA its projections' weights in NF4 (``ValueError`` where NF4 cannot hold them)."""
    from lightning_3d.adapters import adapted_modules
    from lightning_3d.adapters.options import require_peft

    require_peft().inject_adapter_in_model(adapter.lora_config(), block)
    dtype = next(p.dtype for p in block.parameters() if p.is_floating_point())
    block.to(dtype)  # the adapters in the block's activation dtype, as the runs compute them
    if adapter.method == "qlora":
        from lightning_3d.adapters.qlora import quantize_base

        quantize_base(block, adapted_modules(block))
    return block


def _measure(
    block: nn.Module, forward: Callable, d_model: int, seq: int, policy: str, backward: bool = False
) -> int:
    """Bytes the meter attributes to ``block`` (what its forward saves) at batch 1, then the graph
    is dropped. The count is complete after the forward (a test holds it equal with and without a
    backward), and a backward costs minutes at a 70B width on a CPU without fast bf16 matmuls
    (its weight gradients are ``(d, T) @ (T, 4d)`` products); ``backward=True`` runs one anyway."""
    dtype = next(block.parameters()).dtype
    holder = nn.Module()
    holder.blocks = nn.ModuleList([block])  # how the recipe finds blocks to checkpoint
    apply_activation_checkpointing(holder, policy)
    meter = ActivationMeter()
    unwatch = meter.watch([("block", block)])
    meter.reset(block.parameters())
    x = torch.randn(1, seq, d_model, dtype=dtype, requires_grad=True)  # (B=1, T, C)
    try:
        with meter.hooks():
            y = forward(block, x)
            y = y[0] if isinstance(y, (tuple, list)) else y
            # Sequence-parallel: this rank's shard.
            y = y.to_local() if isinstance(y, DTensor) else y
            if backward:
                y.float().sum().backward()  # frees what was saved (and checks the block runs backward)
            del y
    finally:
        unwatch()
        apply_activation_checkpointing(holder, "none")
        block.zero_grad(set_to_none=True)
    return meter.block_bytes["block"]


def measure_activations(
    entry: tuple[str, nn.Module],
    *,
    forward: Optional[Callable],
    split: set[str],
    columns: set[str],
    d_model: int,
    n_head: int,
    seq_len: int,
    act_bytes: int,
    policies: Sequence[str],
    tp_sizes: Sequence[int],
    adapter: Any = None,
) -> dict[tuple[str, int], ActivationFit]:
    """(policy, tp) -> :class:`ActivationFit` for the block ``entry = (name, meta block)``;
    ``adapter`` (:class:`~lightning_3d.adapters.AdapterOptions`): with its adapters put into the
    block first, at the tensor rank's local shapes (split beside their bases as the project
    splits them), QLoRA's bases in NF4."""
    name, block = entry
    dtype = torch.float32 if act_bytes == 4 else torch.bfloat16
    call = forward or (lambda b, x: b(x))
    t1 = min(MEASURE_TOKENS, seq_len)
    lengths = sorted({t1, min(2 * t1, seq_len)})
    out: dict[tuple[str, int], ActivationFit] = {}
    for tp in sorted(tp_sizes):
        local = local_block(block, name, split, columns, tp)
        real = _materialize(local, dtype) if local is not None else None  # once per tensor size
        if real is not None and adapter is not None:
            real = _adapted(real, adapter)
        for policy in policies:
            base = out.get((policy, 1))
            if real is not None:
                try:
                    out[(policy, tp)] = fit_points(
                        [(t, _measure(real, call, d_model, t, policy)) for t in lengths]
                    )
                except Exception as err:  # noqa: BLE001 -- a block that cannot run alone: estimate
                    reason = f"estimated: the block does not run alone ({type(err).__name__})"
                    out[(policy, tp)] = _megatron(d_model, n_head, act_bytes, policy, tp, reason)
            elif base is not None and base.source == "measured":
                scale = REPLICATED_SHARE + (1 - REPLICATED_SHARE) / tp
                out[(policy, tp)] = ActivationFit(
                    base.per_token * scale,
                    base.per_token_sq / tp,
                    "estimated: split layers are not nn.Linear (Megatron's split)",
                )
            else:
                out[(policy, tp)] = _megatron(
                    d_model,
                    n_head,
                    act_bytes,
                    policy,
                    tp,
                    "estimated: split layers are not nn.Linear",
                )
        del real
    return out


def measure_sequence_parallel(
    entry: tuple[str, nn.Module],
    plan: Mapping[str, Any],
    *,
    forward: Optional[Callable],
    d_model: int,
    seq_len: int,
    act_bytes: int,
    policies: Sequence[str],
    tp: int,
) -> dict[tuple, ActivationFit]:
    """``(policy, tp, "sp")`` -> :class:`ActivationFit` for the block ``entry = (name, meta block)``
    under ``plan`` (the block's own entries of the model's sequence-parallel plan, names relative
    to the block, ``""`` the block itself), measured as rank 0 of a fake world of ``tp`` ranks.

    Needs a process without a default process group (the fake world is one); ``ValueError``
    otherwise, or when ``tp`` does not divide the measured lengths."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_3d.parallel.fake_world import fake_world

    if dist.is_initialized():
        raise ValueError(
            "sequence-parallel activations are measured in a fake world, which needs a process "
            "without a process group"
        )
    _, block = entry
    dtype = torch.float32 if act_bytes == 4 else torch.bfloat16
    call = forward or (lambda b, x: b(x))
    t1 = min(MEASURE_TOKENS, seq_len)
    lengths = sorted({t1, min(2 * t1, seq_len)})
    if any(t % tp for t in lengths):
        raise ValueError(f"tensor={tp} does not divide the measured sequence lengths {lengths}")
    out: dict[tuple, ActivationFit] = {}
    with fake_world(0, tp):
        mesh = init_device_mesh("cpu", (tp,))
        # Still on meta: split first, so only this rank's shards exist.
        real = copy.deepcopy(block).to(dtype)
        inner = {name: style for name, style in plan.items() if name}
        parallelize_module(real, mesh, inner)
        if "" in plan:  # the block's own style (turns the replicated stream into sequence shards)
            parallelize_module(real, mesh, plan[""])
        real.to_empty(device="cpu")
        with torch.no_grad():
            for p in real.parameters():
                (p.to_local() if isinstance(p, DTensor) else p).normal_(0.0, 0.02)
        for policy in policies:
            out[(policy, tp, "sp")] = fit_points(
                [(t, _measure(real, call, d_model, t, policy)) for t in lengths]
            )
    return out


def _megatron(
    d: int, heads: int, act_bytes: int, policy: str, tp: int, source: str
) -> ActivationFit:
    """Korthikanti et al.: per layer s·b·h·(34 + 5·a·s/h) bytes in 16 bits; TP splits 24 of the 34;
    full recompute keeps the block input (2·s·b·h); selective drops the attention-score term."""
    scale = act_bytes / 2
    if policy == "full":
        return ActivationFit(2 * d * scale, 0.0, source)
    linear = d * (10 + 24 / tp) * scale
    quad = 0.0 if policy == "selective" else 5 * heads / tp * scale
    return ActivationFit(linear, quad, source)


def head_loss_bytes(
    tokens: int, vocab: int, width: int, act_bytes: int, chunks: int = 1, tensor: int = 1
) -> float:
    """Bytes the head and cross-entropy hold at their peak for ``tokens`` tokens of one
    micro-batch (the weight's gradient aside: model state counts it).

    Whole logits (``chunks`` = 1): the logits in the activation dtype and their fp32 softmax for
    every token (vocab-parallel: ``vocab / tensor``) plus the head's saved input. Chunked
    (:mod:`lightning_3d.parallel.chunked_loss`): one chunk's logits, their fp32 copy and its
    gradient in the matmul dtype, plus the hidden states' gradient kept for backward
    (``tokens x width``); under tensor parallelism a chunk's logits are this rank's
    ``vocab / tensor`` columns (:mod:`lightning_3d.parallel.chunked_loss_tp`), and every rank
    holds every token's hidden states (gathered under sequence parallelism)."""
    if chunks <= 1:
        return tokens * (vocab / tensor * (act_bytes + 4) + width * act_bytes)
    rows = -(-tokens // chunks)
    return rows * vocab / tensor * (2 * act_bytes + 4) + tokens * width * act_bytes
