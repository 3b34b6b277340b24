"""The chunked head and loss under tensor parallelism: the vocabulary stays sharded.

The tensor plans shard the head's weight on the vocabulary (``ColwiseParallel``: rank ``r`` of
``tp`` holds rows ``[r * ceil(V / tp), ...)``), and the unchunked loss never gathers the logits
(``loss_parallel``: a max and a sum of exponentials all-reduced). Here the same holds one chunk
of tokens at a time, with the gradients computed in the forward as in
:mod:`lightning_3d.parallel.chunked_loss`. Per chunk, on every tp rank:

* the local logits ``h @ W_r^T`` (chunk x V/tp);
* the log-sum-exp over the whole vocabulary: the row maxima all-reduced (max), then the sums of
  ``exp(logit - max)`` all-reduced (sum), together with each target's logit, which only the
  rank that owns the target's row contributes (the others add 0): two small collectives of
  device tensors per chunk, nothing of the vocabulary's size crosses;
* the gradient of the logits ``softmax - one_hot`` on the local columns, from which this rank's
  weight shard gets its whole gradient and the hidden states a partial one (each rank's columns'
  share). The partial sums are added over tp by DTensor: the head's input goes in through
  ``to_local(grad_placements=[Partial()])``, so autograd all-reduces it (a replicated input)
  or reduce-scatters it (sequence parallelism) exactly where the unchunked head's backward would.

Sequence parallelism: the head's input arrives sharded on the sequence (``Shard(1)``) and is
gathered over tp first, as the unchunked head's ``ColwiseParallel`` input does. Chunking each
rank's own tokens instead would need every other rank's vocabulary rows for them: gathering the
weight (V x D) to save gathering the hidden states (T x D) is the wrong trade at any vocabulary
wider than the sequence, and the sums over the vocabulary would still cross ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_3d.layout import MeshAxis

# F.cross_entropy's default, as in chunked_loss (which loads this module where it needs it, so
# this one does not import it back).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's rows of the head sit in the whole vocabulary."""

    group: Any
    """The tensor-parallel process group the sums over the vocabulary run on."""
    start: int
    """The first vocabulary row (global index) this rank holds."""


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """``(sum, count)`` of the cross-entropy of vocabulary-sharded logits, chunk by chunk; the
    same on every tp rank. ``hidden``'s gradient is this rank's partial sum (see the module).
    As in ``chunked_loss``'s unsharded twin, the gradients are held on ``ctx`` (not saved), so
    backward hands them on without a copy, scaled by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunks, ignore_index, training, shard):  # type: ignore[override]
        want_h, want_w, want_b = (need and training for need in ctx.needs_input_grad[:3])
        rows, local_vocab = hidden.shape[0], weight.shape[0]
        grad_h = torch.empty_like(hidden) if want_h else None
        loss_dtype = torch.promote_types(hidden.dtype, torch.float32)
        grad_w = (
            torch.zeros(weight.shape, dtype=loss_dtype, device=weight.device) if want_w else None
        )
        grad_b = torch.zeros(bias.shape, dtype=loss_dtype, device=bias.device) if want_b else None
        total = torch.zeros((), dtype=loss_dtype, device=hidden.device)
        counted = torch.zeros((), dtype=torch.int64, device=hidden.device)
        size = max(1, -(-rows // chunks))
        # Every tp rank holds the same tokens, so all run the same chunks and collectives.
        for start in range(0, rows, size):
            h, t = hidden[start : start + size], targets[start : start + size]
            logits = F.linear(h, weight, bias)  # (n, V/tp) in the head's compute dtype
            compute = logits.dtype
            logits = logits.to(torch.promote_types(compute, torch.float32))  # (n, V/tp)
            keep = t != ignore_index  # (n,)
            local = t - shard.start  # (n,): the target's row on this rank, if it is here
            mine = keep & (local >= 0) & (local < local_vocab)  # (n,)
            safe = torch.where(mine, local, torch.zeros_like(local)).unsqueeze(1)  # (n, 1)
            if local_vocab:
                top = logits.amax(dim=1)  # (n,)
            else:  # an uneven split can leave a rank no rows
                top = torch.full_like(t, float("-inf"), dtype=logits.dtype)
            # The row maxima over the whole vocabulary: exp never overflows on any rank.
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=shard.group)
            logits.sub_(top.unsqueeze(1))  # (n, V/tp): shifted
            picked = logits.gather(1, safe).squeeze(1) if local_vocab else torch.zeros_like(top)
            sums = torch.stack([logits.exp().sum(1), torch.where(mine, picked, 0.0)])  # (2, n)
            # Sum of exponentials and the target's shifted logit (from its owner alone).
            dist.all_reduce(sums, group=shard.group)
            lse = sums[0].log()  # (n,): log-sum-exp of the shifted logits
            total += ((lse - sums[1]) * keep).sum()
            counted += keep.sum()
            if not (want_h or want_w or want_b):
                continue
            # d(sum of losses)/d logits on this rank's columns: softmax - one_hot, in place.
            grad = logits.sub_(lse.unsqueeze(1)).exp_()  # (n, V/tp)
            grad.scatter_add_(1, safe, -mine.unsqueeze(1).to(grad.dtype))
            grad.mul_(keep.unsqueeze(1))
            low = grad.to(compute)  # (n, V/tp)
            if want_h:
                # This rank's columns' share of the hidden states' gradient (summed over tp).
                grad_h[start : start + size] = (low @ weight.to(compute)).to(hidden.dtype)
            if want_w:
                grad_w += (low.t() @ h.to(compute)).to(loss_dtype)  # (V/tp, D)
            if want_b:
                grad_b += grad.sum(0)
        ctx.grads = [grad_h, grad_w, grad_b]
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(counted)
        return total, counted

    @staticmethod
    def backward(ctx, grad_total, grad_counted):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError(
                "the chunked loss's backward ran twice: its gradients were computed in the "
                "forward and handed on the first time (retain_graph is not supported)"
            )
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None
        if grad_h is not None:
            grad_h.mul_(grad_total.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_total).to(ctx.dtypes[0])
        if grad_b is not None:
            grad_b = grad_b.mul_(grad_total).to(ctx.dtypes[1])
        return grad_h, grad_w, grad_b, None, None, None, None, None


def vocab_problems(weight: DTensor) -> list[str]:
    """Why the head's weight ``weight`` is not one this loss can take (empty: it can): it must
    be sharded on the vocabulary (dim 0) over the tensor axis alone, as the tensor plans leave
    the head. A weight still sharded over data ranks (ZeRO-3 between its gathers) would
    otherwise pass for a vocabulary split and train on the wrong sums."""
    names = weight.device_mesh.mesh_dim_names
    if names != (MeshAxis.TENSOR.value,) or tuple(weight.placements) != (Shard(0),):
        return [
            f"the head's weight is a DTensor with placements {tuple(weight.placements)} on mesh "
            f"axes {names}; the chunked loss takes one sharded on the vocabulary, "
            f"(Shard(dim=0),) on the {MeshAxis.TENSOR.value!r} axis alone (the tensor plans' head)"
        ]
    return []


def vocab_parallel_linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: DTensor,
    targets: torch.Tensor,
    chunks: int,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, count)`` as :func:`~lightning_3d.parallel.chunked_loss.linear_cross_entropy_sum`,
    for a head whose ``weight`` (and ``bias``) is a DTensor sharded on the vocabulary. ``hidden``
    ``(..., D)``: the same tokens on every tp rank (a plain tensor or a replicated DTensor) or a
    DTensor sharded on them (sequence parallelism: gathered here). ``targets``: every token's,
    as plain tensors (the same on every tp rank). Both results are plain tensors, equal on every
    tp rank."""
    problems = vocab_problems(weight)
    if problems:
        raise ValueError(problems[0])
    mesh = weight.device_mesh
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(mesh, [Replicate()])  # sequence parallelism: gathered
    else:
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    # Each rank's hidden-state gradient is a partial sum: DTensor adds them up in backward.
    local_h = hidden.to_local(grad_placements=[Partial()])
    if local_h.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(local_h.shape)} and targets {tuple(targets.shape)} differ in their "
            "leading (token) dimensions"
        )
    local_b = bias.to_local() if isinstance(bias, DTensor) else bias
    rows_per_rank = -(-weight.shape[0] // mesh.size())  # torch's Shard: ceil(V / tp) rows each
    start = min(mesh.get_local_rank() * rows_per_rank, weight.shape[0])
    shard = VocabShard(mesh.get_group(), start)
    return _VocabParallelLinearCrossEntropy.apply(
        local_h.reshape(-1, local_h.shape[-1]),
        weight.to_local(),
        local_b,
        targets.reshape(-1),
        chunks,
        ignore_index,
        torch.is_grad_enabled(),
        shard,
    )
