"""The language-model head and its cross-entropy over chunks of tokens: no whole logits tensor.

At a 128k vocabulary one 2,048-token sequence's fp32 logits are 1 GB, and autograd keeps more
than one tensor of that size (the logits, their log-softmax, then their gradient). Here the head
``h @ W^T (+ b)`` and the loss are computed ``chunks`` rows at a time, and each chunk's gradients
with respect to ``h`` and ``W`` are computed at once, in the forward (Liger's fused linear
cross-entropy does the same; Liger is not installed here, so this is plain torch): nothing of
size tokens x vocabulary outlives its chunk. What is kept for backward is the gradient of the
hidden states (tokens x width) and of the head's weight (vocabulary x width, fp32, which becomes
the weight's ``.grad`` as autograd would have made it at the start of backward anyway). The
backward only scales them by the incoming gradient, so the head is not recomputed (a
checkpoint-per-chunk head would cost one more head matmul, a third more head time).

The sum and count of counted targets go through :func:`~lightning_3d.parallel.objective.token_mean`,
so inside a strategy's step the loss is the global batch's token mean exactly as
``F.cross_entropy`` on whole logits would be (data x context ranks, accumulation, pipeline).
Under tensor parallelism (the head's weight a DTensor sharded on the vocabulary) the chunks stay
vocabulary-parallel: :mod:`lightning_3d.parallel.chunked_loss_tp`.

A model opts in with an attribute ``loss_chunks`` (1: whole logits and ``F.cross_entropy``) that
:func:`apply_chunked_loss` sets, and may name what it cannot chunk in a method
``loss_chunk_problems()`` (a soft-capped head, an adapted head): ``ThreeDStrategy(loss_chunks=8)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

# F.cross_entropy's default, and lightning_3d.data.labels.IGNORE_INDEX; written out (and the
# objective imported where it is used) so that the option table, which imports this module for
# its option group, loads neither the data package nor the objective on `import lightning_3d`.
IGNORE_INDEX = -100


AUTO = "auto"


@dataclass(frozen=True)
class ChunkedLossOptions:
    """How the head and loss of a model that supports it are computed (``loss_chunks``)."""

    chunks: Union[int, str] = 1
    """Chunks of tokens the head and cross-entropy run in; 1: whole logits and
    ``F.cross_entropy`` (the module's own code path). More chunks: less memory (one chunk's
    logits at a time), more, smaller matmuls. ``"auto"``: ``ceil(vocabulary / width)`` chunks,
    so that one chunk's logits are about the size of the hidden states (Liger's rule; 1 for a
    vocabulary narrower than the model; under tensor parallelism the rank's own share of the
    vocabulary, ``ceil(vocabulary / tensor)``, since that is what its logits hold), and 1
    wherever the chunked loss is not built (an adapted or soft-capped head, ...) instead of a
    refusal."""

    def problems(self, tensor: int = 1) -> list[str]:
        """What is wrong with these values, each naming them (empty: nothing); any ``tensor``
        size is built (:mod:`lightning_3d.parallel.chunked_loss_tp`)."""
        chunks = self.chunks
        if chunks == AUTO:
            return []
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            return [
                f"loss_chunks={chunks!r} must be a whole number >= 1 (1: no chunking) or {AUTO!r}"
            ]
        return []


def auto_chunks(vocabulary: int, width: int, tensor: int = 1) -> int:
    """``loss_chunks="auto"``'s count for a head of ``vocabulary`` x ``width`` sharded over
    ``tensor`` ranks: each chunk's logits (rows x ``ceil(vocabulary / tensor)`` on one rank)
    about the size of the hidden states it is computed from."""
    return max(1, math.ceil(math.ceil(vocabulary / max(1, tensor)) / max(1, width)))


class _LinearCrossEntropy(torch.autograd.Function):
    """``(sum, count)`` of the cross-entropy of ``hidden @ weight^T + bias`` against ``targets``;
    gradients computed in the forward, chunk by chunk (see the module)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunks, ignore_index, training):  # type: ignore[override]
        # needs_input_grad says True under no_grad too: evaluation would compute gradients.
        want_h, want_w, want_b = (need and training for need in ctx.needs_input_grad[:3])
        rows = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if want_h else None
        loss_dtype = torch.promote_types(hidden.dtype, torch.float32)
        # fp32 accumulators: the chunks' contributions add up as one matmul's would.
        grad_w = (
            torch.zeros(weight.shape, dtype=loss_dtype, device=weight.device) if want_w else None
        )
        grad_b = torch.zeros(bias.shape, dtype=loss_dtype, device=bias.device) if want_b else None
        total = torch.zeros((), dtype=loss_dtype, device=hidden.device)
        counted = torch.zeros((), dtype=torch.int64, device=hidden.device)
        size = max(1, -(-rows // chunks))
        for start in range(0, rows, size):
            h, t = hidden[start : start + size], targets[start : start + size]
            logits = F.linear(h, weight, bias)  # (n, V) in the head's compute dtype
            compute = logits.dtype
            # (n, V): the loss in fp32 at least, as F.cross_entropy under autocast.
            logits = logits.to(torch.promote_types(compute, torch.float32))
            keep = t != ignore_index  # (n,)
            safe = torch.where(keep, t, torch.zeros_like(t)).unsqueeze(1)  # (n, 1)
            lse = torch.logsumexp(logits, dim=1)  # (n,)
            picked = logits.gather(1, safe).squeeze(1)  # (n,)
            total += ((lse - picked) * keep).sum()
            counted += keep.sum()
            if not (want_h or want_w or want_b):
                continue
            # d(sum of losses)/d logits = softmax - one_hot, zero on ignored rows; in place.
            grad = logits.sub_(lse.unsqueeze(1)).exp_()  # (n, V)
            grad.scatter_add_(1, safe, -torch.ones_like(safe, dtype=grad.dtype))
            grad.mul_(keep.unsqueeze(1))
            low = grad.to(compute)  # (n, V): the matmuls in the head's dtype, as autograd's
            if want_h:
                grad_h[start : start + size] = (low @ weight.to(compute)).to(hidden.dtype)
            if want_w:
                grad_w += (low.t() @ h.to(compute)).to(loss_dtype)  # (V, D)
            if want_b:
                grad_b += grad.sum(0)
        # Held on ctx, not saved for backward: backward drops its references and hands the
        # tensors on, so autograd makes them the parameters' .grad without a copy (a saved
        # tensor would still be referenced, and the weight's gradient copied: V x D more).
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
        scale = grad_total  # a scalar: d(objective)/d(sum)
        if grad_h is not None:
            grad_h.mul_(scale.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(scale).to(ctx.dtypes[0])
        if grad_b is not None:
            grad_b = grad_b.mul_(scale).to(ctx.dtypes[1])
        return grad_h, grad_w, grad_b, None, None, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunks: int,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, count)``: the summed cross-entropy (fp32, differentiable) of the logits
    ``hidden @ weight^T + bias`` against ``targets`` and the number of targets that are not
    ``ignore_index``, in ``chunks`` chunks of rows. ``hidden``: ``(N, D)`` or ``(B, T, D)``;
    ``targets``: the same leading shape."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be a whole number >= 1")
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):  # a tensor-parallel head: the vocabulary stays sharded
        from lightning_3d.parallel.chunked_loss_tp import vocab_parallel_linear_cross_entropy_sum

        return vocab_parallel_linear_cross_entropy_sum(
            hidden, weight, targets, chunks, bias, ignore_index
        )
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} differ in their "
            "leading (token) dimensions"
        )
    training = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        targets.reshape(-1),
        chunks,
        ignore_index,
        training,
    )


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunks: int,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, -2), targets.flatten(),
    ignore_index=ignore_index)`` without the whole logits: the token mean, through
    :func:`~lightning_3d.parallel.objective.token_mean` (the global batch's inside a strategy's
    step).

    Example::

        >>> h, w, t = torch.randn(2, 6, 4), torch.randn(10, 4), torch.randint(10, (2, 6))
        >>> whole = F.cross_entropy(F.linear(h, w).flatten(0, 1), t.flatten())
        >>> torch.allclose(chunked_cross_entropy(h, w, t, chunks=3), whole)
        True
    """
    from lightning_3d.parallel.objective import token_mean

    total, counted = linear_cross_entropy_sum(hidden, weight, targets, chunks, bias, ignore_index)
    return token_mean(total, counted)


def _takers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in module.named_modules() if hasattr(m, "loss_chunks")]


def chunked_loss_problems(module: nn.Module, options: ChunkedLossOptions, layout: Any) -> list[str]:
    """Why ``module`` cannot run ``options`` under ``layout`` (a
    :class:`~lightning_3d.layout.Layout`; empty: it can). Shapes and attributes only, so a model
    on ``meta`` is checked before launch."""
    problems = options.problems(layout.tensor)
    if problems or options.chunks in (1, AUTO):
        return problems
    name = f"loss_chunks={options.chunks}"
    takers = _takers(module)
    if not takers:
        return [
            f"{name}: {type(module).__name__} has no head that can be split into chunks (no "
            "module with a `loss_chunks` attribute: LitGPT and HFCausalLM have one); use "
            "loss_chunks=1"
        ]
    for _, taker in takers:
        check = getattr(taker, "loss_chunk_problems", None)
        if check is not None:
            problems += [f"{name}: {p}" for p in check(layout.pipeline)]
    return problems


def apply_chunked_loss(module: nn.Module, options: ChunkedLossOptions, layout: Any) -> None:
    """Set ``loss_chunks`` on every module of ``module`` that has one; ``ValueError`` naming the
    values where the model's head cannot be split (:func:`chunked_loss_problems`)."""
    problems = chunked_loss_problems(module, options, layout)
    if problems:
        raise ValueError("; ".join(problems))
    for _, taker in _takers(module):
        chunks = options.chunks
        if chunks == AUTO:
            fixed = ChunkedLossOptions(auto_chunks(*_head_shape(taker), layout.tensor))
            # Where a count would be refused, auto means whole logits.
            chunks = fixed.chunks if not chunked_loss_problems(taker, fixed, layout) else 1
        taker.loss_chunks = chunks


def _head_shape(taker: nn.Module) -> tuple[int, int]:
    """(vocabulary, width) of a taker's head: the reference GPT's ``lm_head``, a
    ``transformers`` model's output embeddings; (1, 1) where neither is found (no chunking)."""
    head = getattr(taker, "lm_head", None)
    inner = getattr(taker, "model", None)
    if head is None and callable(getattr(inner, "get_output_embeddings", None)):
        head = inner.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])
    return 1, 1


# Config entries of transformers models whose forward changes the logits after the head: a
# chunked loss on the head's output alone would train another objective.
_LOGIT_CHANGES = (
    "final_logit_softcapping",
    "logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
)


def head_problems(model: nn.Module, pipeline: int = 1) -> list[str]:
    """Why a ``transformers`` causal LM's head and loss cannot run in chunks: a head that is no
    plain ``nn.Linear`` (a LoRA-adapted or quantized head), or logits changed after the head
    (soft-capping, scaling). Any ``pipeline``: the last stage then ends at the final norm
    (``models/hf_pipeline.py``)."""
    problems = []
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        problems.append(
            f"the head {type(head).__name__} is not a plain nn.Linear (an adapted head: leave "
            "lm_head out of the adapter's target_modules)"
        )
    configs = [model.config, getattr(model.config, "text_config", None)]
    for config in (c for c in configs if c is not None):
        for key in _LOGIT_CHANGES:
            value = getattr(config, key, None)
            if value is not None and value != 1:
                problems.append(
                    f"{type(model).__name__} changes its logits after the head ({key}={value})"
                )
    return problems


@contextmanager
def head_input(head: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside, ``head`` is called on none of the tokens it is handed (one, under tensor
    parallelism), whose input is appended to the list yielded: the model's own forward runs (its
    masks, positions, final norm) and gives (almost) no logits, and the chunked loss takes the
    head's input from the list."""
    from torch.distributed.tensor import DTensor

    seen: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # (B, T, D)
        seen.append(hidden)
        # A tensor-parallel head's DTensor input cannot be viewed at 0 tokens (torch's sharding
        # propagation divides by every size): one token's logits per row there, B x V/tp.
        tokens = 1 if isinstance(hidden, DTensor) else 0
        return (hidden[..., :tokens, :], *args[1:])  # (B, 0 or 1, D): (almost) no logits

    handle = head.register_forward_pre_hook(keep)
    try:
        yield seen
    finally:
        handle.remove()
