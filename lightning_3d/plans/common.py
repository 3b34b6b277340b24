"""The Megatron layout shared by decoder-only transformers, expressed once over module names.

Per block: attention input projections column-parallel (heads split across ranks), output
projection row-parallel; MLP up/gate column-parallel, down row-parallel. Token embedding
vocab-parallel; LM head column-parallel with vocab-sharded logits for ``loss_parallel``, so full
vocabulary logits never exist on one rank. With sequence parallelism the norms (and what lies
between blocks) hold T / tp positions per rank: row-parallel outputs are reduce-scattered along
the sequence and column-parallel inputs all-gathered, instead of one all-reduce.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_3d.parallel.tensor import (
    ColwiseConv1DParallel,
    FusedColwiseParallel,
    LocalSizes,
    PrepareHiddenStates,
    ReplicatedGradSum,
    RowwiseConv1DParallel,
)


@dataclass(frozen=True)
class TransformerNames:
    """Module-name patterns (fnmatch, ``*`` crosses dots) of one architecture's parts."""

    signature: tuple[str, ...]  # all must match for the architecture to be recognised
    embedding: str
    first_block: str  # where the replicated residual stream becomes sequence-sharded (SP)
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    norms: tuple[str, ...]
    head: str
    fused_colwise: Mapping[str, int] = None  # pattern -> number of fused chunks (q, k, v)
    # Modules whose one positional input feeds several column-parallel projections (attention:
    # q, k, v). Their input becomes a DTensor once, so backward sums the projections' partial
    # input gradients and all-reduces (or reduce-scatters) them once instead of once each.
    shared_inputs: tuple[str, ...] = ()
    # Modules whose forward reads global sizes from attributes (Hugging Face GPT-2 attention
    # splits the fused q/k/v output by ``split_size``): pattern -> attribute names, divided by
    # the tensor size so they describe this rank's heads.
    local_sizes: Mapping[str, tuple[str, ...]] = None


def transformer_plan(names: TransformerNames, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan for one architecture. Linear layers and ``transformers``' ``Conv1D`` alike."""
    sp = sequence_parallel
    seq = Shard(1)  # activations are (B, T, C): dim 1 is the sequence
    plan: dict[str, ParallelStyle] = {
        # Vocab-parallel embedding: each rank looks up its vocabulary rows, partial sums all-reduced.
        names.embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }
    if sp:
        # The block's other inputs (masks, cache, position embeddings) are not sequence-sharded.
        plan[names.first_block] = PrepareHiddenStates(input_layout=Replicate(), desired_layout=seq)
        for pattern in names.norms:
            plan[pattern] = SequenceParallel()
    col_in = seq if sp else Replicate()
    for pattern in names.shared_inputs:
        plan[pattern] = PrepareModuleInput(
            input_layouts=(col_in,), desired_input_layouts=(Replicate(),), use_local_output=False
        )
    for pattern, chunks in (names.fused_colwise or {}).items():
        plan[pattern] = FusedColwiseParallel(chunks, input_layouts=col_in)
    for pattern in names.colwise:
        plan[pattern] = ColwiseConv1DParallel(input_layouts=col_in)
    for pattern in names.rowwise:
        plan[pattern] = RowwiseConv1DParallel(output_layouts=seq if sp else Replicate())
    for pattern, attrs in (names.local_sizes or {}).items():
        plan[pattern] = LocalSizes(attrs)
    plan[names.head] = ColwiseParallel(
        input_layouts=col_in, output_layouts=Shard(-1), use_local_output=False
    )
    return plan


_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}
# transformers' names for what explicit plans may also need (its full set: plans/hf.py)
_HF_STYLES = {
    "replicated_with_grad_allreduce": ReplicatedGradSum,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
}


def plan_from_names(plan: Mapping, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Accept styles or their names (``"colwise"``, ``"rowwise"``, ``"sequence"``, ``"vocab"``,
    ``"head"`` for the loss-parallel LM head, and transformers' ``"replicated_with_grad_allreduce"``,
    ``"colwise_gather_output"``, ``"rowwise_split_input"``) so a plan can be written in YAML. Names describe
    the layout without sequence parallelism."""
    named = sorted(p for p, style in plan.items() if not isinstance(style, ParallelStyle))
    if sequence_parallel and named:
        # Names describe the plain Megatron layout; where the residual stream becomes
        # sequence-sharded is model-specific, so it must be spelled out with style objects.
        raise ValueError(
            f"sequence_parallel=True with style names for {named}: give ParallelStyle objects "
            "(SequenceParallel, PrepareModuleInput, ...) for a sequence-parallel explicit plan"
        )
    out: dict[str, ParallelStyle] = {}
    col_in = Replicate()
    for pattern, style in plan.items():
        if isinstance(style, ParallelStyle):
            out[pattern] = style
        elif style == "vocab":
            out[pattern] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif style == "head":
            out[pattern] = ColwiseParallel(
                input_layouts=col_in, output_layouts=Shard(-1), use_local_output=False
            )
        elif style in _STYLES:
            out[pattern] = _STYLES[style]()
        elif style in _HF_STYLES:
            out[pattern] = _HF_STYLES[style]()
        else:
            known = sorted([*_STYLES, *_HF_STYLES, "vocab", "head"])
            raise ValueError(
                f"unknown parallel style {style!r} for pattern {pattern!r}; known: {known}"
            )
    return out
