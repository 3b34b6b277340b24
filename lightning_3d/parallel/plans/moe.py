"""The reference GPT with mixture-of-experts MLPs (``lightning_3d.models.moe.MoEGPT``).

Attention splits as the reference GPT's (:data:`~lightning_3d.parallel.plans.gpt.GPT_NAMES`);
the router and the grouped experts are **replicated** over the tensor ranks, as the
``transformers`` plans are translated (``plans/hf.py``): every tensor rank routes every token
of its data rank and runs the same experts on them, so routing, capacity and the
load-balancing statistics are those of the data rank whatever ``tensor`` is, and expert
parallelism (``parallel/expert.py``) exchanges tokens among the ``ep`` ranks at one tensor
coordinate. The optional shared expert is a dense MLP and splits like one (column then row
parallel, replicated in and out).

With sequence parallelism the MoE layer's input holds ``T / tp`` positions per rank. It is
gathered (``Replicate``) before the router and the output cut back to this rank's positions,
rather than routing each tensor rank's own tokens: that way nothing about routing differs from
the plain layout (the global capacity line, the router statistics' data group, the expert
gradients' replica group are all the data ranks', not data × tensor), and the experts' and
router's gradients come out equal on every tensor rank with no extra reduction. The price is
the experts' work done ``tensor`` times over; routing a rank's own tokens would save it, at the
cost of a tensor-axis sum of the expert and router gradients and a capacity line over
data × tensor.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
)

from lightning_3d.parallel.plans.common import TransformerNames, transformer_plan
from lightning_3d.parallel.tensor import name_matches

MOE_GPT_NAMES = TransformerNames(
    signature=("*tok_emb", "*.attn.wq", "*.mlp.router", "*lm_head"),
    embedding="*tok_emb",
    first_block="*blocks.0",
    colwise=("*.attn.wq", "*.attn.wk", "*.attn.wv"),
    rowwise=("*.attn.wo",),
    norms=("*.attn_norm", "*.mlp_norm", "*.norm"),
    head="*lm_head",
    shared_inputs=("*.attn",),
)
"""The attention and the ends; the MoE layers are added by :func:`moe_gpt_plan`."""

MOE_LAYER = "*.mlp"
SHARED_EXPERT = ("*.mlp.shared.fc1", "*.mlp.shared.fc2")


def moe_gpt_plan(module: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The tensor plan of ``module`` (an ``MoEGPT`` or a module holding one): attention split,
    router and experts replicated, a shared expert (where the model has one) split."""
    plan = transformer_plan(MOE_GPT_NAMES, sequence_parallel)
    if sequence_parallel:
        seq = Shard(1)  # (B, T, C): dim 1 is the sequence
        # The whole sequence in, this rank's positions out (the residual stream is local).
        plan[MOE_LAYER] = PrepareModuleInputOutput(
            input_layouts=(seq,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(seq,),
            use_local_output=True,
        )
    names = [n for n, _ in module.named_modules()]
    if any(name_matches(n, SHARED_EXPERT[0]) for n in names):
        # Inside the MoE layer the tokens are replicated, with or without sequence parallelism.
        plan[SHARED_EXPERT[0]] = ColwiseParallel(input_layouts=Replicate())
        plan[SHARED_EXPERT[1]] = RowwiseParallel(output_layouts=Replicate())
    return plan
