"""What a Hugging Face mixture-of-experts family trains besides its cross-entropy: the router's
load-balancing loss over the global batch, the expert loads, and DeepSeek-V3's aux-loss-free
balancing bias moved by them.

**Router loss.** ``transformers`` adds ``router_aux_loss_coef * aux`` to a MoE family's loss when
``output_router_logits`` is on, where ``aux`` is Switch Transformer's ``E * sum_e f_e * P_e``
computed by the family's ``load_balancing_loss_func`` from every layer's router logits together:
``f_e`` the share of (layer, token, top-k slot) choices that went to expert ``e``, ``P_e`` the
mean router probability of ``e`` over (layer, token) rows (padding left out where an attention
mask is given). Computed on each rank from its own rows, it would be a different objective under
every data layout (the average of per-rank products is not the product of averages).

Here the same formula is computed from the **global** batch's sums: the counts and probability
sums of each rank are summed over the ranks whose gradients are averaged
(:func:`~lightning_3d.parallel.objective.batch_sum`: the data, or data × context, ranks; one
all-reduce of ``2E + 1`` numbers a micro-batch). The value is the global one on every rank; the
gradient is that of ``G`` times this rank's share of ``P_e``, which the data-parallel average
(over ``G`` ranks) turns into the global gradient, as the token-mean objective does for the
cross-entropy and the reference MoE does for its own loss (``models/moe.py``). Under gradient
accumulation the objective's per-step factor rescales this term's gradient with the rest: exact
for one micro-batch per step, or micro-batches with equal numbers of counted tokens. Under a
pipeline the sums travel with the activations and the last stage carries the loss
(``models/hf_pipeline_router.py``).

What is taken from ``transformers``: whether the family has the loss (its modeling module's
``load_balancing_loss_func`` with Switch's signature), the number of experts and the top-k
(the model's ``num_experts`` and ``num_experts_per_tok``, what its own forward passes), the
default coefficient (``router_aux_loss_coef``, on where ``output_router_logits`` is), and the
router logits (``output_router_logits=True``). Families whose loss is another formula (Doge's
product-key routing) are refused rather than trained with Switch's.

**Loads.** Every experts module that the config's ``base_model_ep_plan`` marks (the ones
expert parallelism splits, ``parallel/expert_hf.py``) is called by its MoE block as
``experts(hidden_states, top_k_index, top_k_weights)`` (transformers 5). A forward pre-hook
counts the token slots ``top_k_index`` sends to each expert; it runs before expert parallelism's
own hook (registered when the model is built, before any strategy), so it sees this rank's tokens'
global expert ids. A recomputed forward (activation checkpointing) overwrites the layer's count,
never adds to it. :meth:`ExpertLoads.take` sums the latest counts over the data ranks (one
all-reduce of layers x experts numbers a micro-batch,
:func:`~lightning_3d.parallel.objective.batch_sum`) and adds them to the step's.

**Bias** (``router_bias_update_rate`` > 0; families whose router keeps an
``e_score_correction_bias`` buffer: deepseek_v3, glm4_moe, dots1, ...). The family adds the bias
to the router's scores to choose the top-k and never to the gating weights; ``transformers``
only reads it (a released checkpoint's values). Trained here as DeepSeek-V3's paper and the
reference MoE (``models/moe.py``) do: after each optimizer step each expert's bias moves by
``+rate`` if its layer sent it fewer slots than the mean over experts during the step, ``-rate``
if more, from the global batch's loads, so every rank moves its copy the same way; not after a
step the non-finite check (``nonfinite="skip"``) or the grad scaler (an fp16 overflow) skips:
nothing applied. The bias is a buffer: saved in checkpoints, exported with the model.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_3d.parallel.objective import batch_sum

# The signature of the Switch load-balancing loss the MoE families of transformers share.
_SWITCH_SIGNATURE = ("gate_logits", "num_experts", "top_k", "attention_mask")


@dataclass(frozen=True)
class RouterLoss:
    """What a family's router loss needs: its weight in the objective, the experts, the top-k."""

    coef: float
    experts: int
    top_k: int


def router_loss_problems(model: nn.Module, coef: Optional[float]) -> list[str]:
    """Why ``model`` (a ``transformers`` causal LM) cannot train a router loss of weight
    ``coef`` (``None``: the model config's choice, never a problem). Empty: it can."""
    if coef is None:
        return []
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
        return [f"router_aux_loss_coef={coef!r} must be a number >= 0 (or null: the config's)"]
    if coef == 0:
        return []
    name = type(model).__name__
    module = inspect.getmodule(type(model))
    func = getattr(module, "load_balancing_loss_func", None)
    if func is None:
        return [
            f"router_aux_loss_coef={coef}: {name} has no router load-balancing loss "
            "(not a mixture-of-experts family of transformers); leave it null"
        ]
    if tuple(inspect.signature(func).parameters) != _SWITCH_SIGNATURE:
        return [
            f"router_aux_loss_coef={coef}: {name}'s router loss is not Switch Transformer's "
            "(another formula); leave it null or 0"
        ]
    missing = [a for a in ("num_experts", "num_experts_per_tok") if not hasattr(model, a)]
    if missing:
        return [f"router_aux_loss_coef={coef}: {name} has no {' / '.join(missing)}"]
    return []


def router_loss_of(model: nn.Module, coef: Optional[float]) -> Optional[RouterLoss]:
    """The router loss ``model`` trains with (``None``: none). ``coef`` ``None`` follows the
    config as ``transformers`` does: ``router_aux_loss_coef`` where ``output_router_logits`` is
    on (and the family's loss is Switch's), else none. ``ValueError`` for a ``coef`` the model
    cannot take (:func:`router_loss_problems`)."""
    problems = router_loss_problems(model, coef)
    if problems:
        raise ValueError("; ".join(problems))
    if coef is None:
        config = getattr(model, "config", None)
        if not getattr(config, "output_router_logits", False):
            return None
        coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        if router_loss_problems(model, coef):
            return None  # a family of another formula: transformers' own, which is not trained
    if coef == 0:
        return None
    return RouterLoss(float(coef), int(model.num_experts), int(model.num_experts_per_tok))


def global_router_loss(
    router_logits: tuple[Tensor, ...], loss: RouterLoss, attention_mask: Optional[Tensor] = None
) -> Tensor:
    """``loss.coef`` times Switch's load-balancing loss of every layer's ``router_logits``
    ((rows, experts) each, rows = this rank's tokens) over the global batch (the module
    docstring). ``attention_mask``: (B, T) of the rows, 0 on padding, or ``None``."""
    probs, stats = router_sums(router_logits, loss, attention_mask)
    stats, size = batch_sum(stats)
    return pooled_router_loss(stats, probs, size, loss)


def router_sums(
    router_logits: tuple[Tensor, ...], loss: RouterLoss, attention_mask: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """This rank's sums over the layers of ``router_logits``: the router probabilities per
    expert (E,), with their gradient, and ``(counts, probabilities, rows)`` (2E + 1,) without,
    to be summed over the ranks (:func:`batch_sum`) before :func:`pooled_router_loss`."""
    E, k = loss.experts, loss.top_k
    device = router_logits[0].device
    weight = None if attention_mask is None else attention_mask.reshape(-1, 1).to(device).float()
    counts = torch.zeros(E, device=device)
    probs = torch.zeros(E, device=device)
    rows = torch.zeros(1, device=device)
    for logits in router_logits:
        p = torch.softmax(logits.to(device).float(), dim=-1)
        chosen = torch.topk(p, k, dim=-1).indices  # (rows, k)
        slots = (
            torch.ones_like(chosen, dtype=torch.float32)
            if weight is None
            else weight.expand_as(chosen)
        )
        counts = counts.scatter_add(0, chosen.reshape(-1), slots.reshape(-1))
        probs = probs + (p if weight is None else p * weight).sum(0)
        rows = rows + (p.shape[0] if weight is None else weight.sum())
    return probs, torch.cat([counts, probs.detach(), rows])


def pooled_router_loss(stats: Tensor, probs: Tensor, size: int, loss: RouterLoss) -> Tensor:
    """``loss.coef`` times Switch's loss from the global ``stats`` (counts, probabilities, rows)
    (2E + 1,) and this rank's probability sums ``probs`` (E,) with their gradient, ``size`` the
    ranks summed over: the global value, ``size`` times this rank's share of the gradient."""
    E = loss.experts
    stats = stats.detach()
    total, mass, n = stats[:E], stats[E : 2 * E], stats[2 * E].clamp(min=1)
    share = probs * size / n  # gradient: G times this rank's part of P_e
    mean_prob = mass / n + share - share.detach()  # value: the global P_e
    return loss.coef * E * ((total / n) * mean_prob).sum()


def router_logits_kwargs(model: nn.Module, loss: Optional[RouterLoss], training: bool) -> dict:
    """The ``output_router_logits`` keyword for ``model``'s forward: on where the router loss is
    trained, off where the config turned it on but nothing uses it (``transformers`` would
    compute its own per-rank loss for nothing), absent for a family that takes none."""
    parameters = inspect.signature(model.forward).parameters
    wanted = loss is not None and training
    if "output_router_logits" in parameters:
        return {"output_router_logits": wanted}
    # A wrapper that passes keywords on (peft's model): asked for only where it is needed.
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return {"output_router_logits": True} if wanted and passes_on else {}


BIAS_BUFFER = "e_score_correction_bias"


def _index_position(experts: nn.Module) -> tuple[int, str]:
    """Where an experts module's forward takes ``top_k_index``: its second input, by position
    or by its name (gpt-oss calls it ``router_indices``)."""
    names = list(inspect.signature(type(experts).forward).parameters)[1:]
    return 1, names[1]


def _bias_of(block: nn.Module, experts: nn.Module) -> Optional[Tensor]:
    """The ``e_score_correction_bias`` buffer of the MoE block holding ``experts`` (its router's),
    or ``None``."""
    for name, buffer in block.named_buffers():
        if name.rsplit(".", 1)[-1] == BIAS_BUFFER:
            return buffer
    return None


class ExpertLoads:
    """Token slots per expert of every experts module of ``model`` (a ``transformers`` causal
    LM), per micro-batch and per optimizer step, and the balancing bias they move."""

    def __init__(self, model: nn.Module, experts_modules: list[tuple[str, nn.Module]]) -> None:
        self._latest: list[Optional[Tensor]] = [None] * len(experts_modules)
        self._step: Optional[Tensor] = None
        self._aux: Optional[tuple[Tensor, int]] = None  # the step's router loss: sum, micro-batches
        self.finished: dict[str, Tensor] = {}
        modules = dict(model.named_modules())
        self.biases: list[Optional[Tensor]] = []
        self.experts = [int(getattr(m, "num_experts", 0)) for _, m in experts_modules]
        for index, (name, experts) in enumerate(experts_modules):
            block = modules[name.rsplit(".", 1)[0]] if "." in name else model
            self.biases.append(_bias_of(block, experts))
            experts.register_forward_pre_hook(self._counter(index, experts), with_kwargs=True)

    def _counter(self, index: int, experts: nn.Module) -> Any:
        position, name = _index_position(experts)
        n_experts = self.experts[index]

        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not module.training:
                return
            chosen = args[position] if len(args) > position else kwargs[name]
            slots = chosen.reshape(-1)
            counts = torch.zeros(n_experts, device=slots.device, dtype=torch.float32)
            self._latest[index] = counts.scatter_add(
                0, slots, torch.ones_like(slots, dtype=counts.dtype)
            )

        return count

    @property
    def has_bias(self) -> bool:
        return any(b is not None for b in self.biases)

    def take(self) -> Optional[Tensor]:
        """The last forward's counts (layers, experts), summed over the data ranks, added to the
        step's; ``None`` where no experts module ran (a pipeline stage without them)."""
        if not self._latest or any(c is None for c in self._latest):
            return None
        counts, _ = batch_sum(torch.stack(self._latest))
        self._latest = [None] * len(self._latest)
        self._step = counts if self._step is None else self._step + counts
        return counts

    def add_aux(self, value: Tensor, micro_batches: int = 1) -> None:
        """Add the router loss of ``micro_batches`` micro-batches (their sum) to the step's."""
        total, count = self._aux if self._aux is not None else (0.0, 0)
        self._aux = (value.detach() + total, count + micro_batches)

    def finish_step(self, rate: float) -> None:
        """An optimizer step ended: keep its figures, move each bias by ``rate`` (0: none)."""
        counts, self._step = self._step, None
        aux, self._aux = self._aux, None
        self.finished = {} if aux is None else {"router_aux_loss": aux[0] / aux[1]}
        if counts is None:
            return
        self.finished.update(
            tokens_per_expert=counts,
            expert_imbalance=counts.max(-1).values / counts.mean(-1).clamp(min=1e-12),
        )
        if rate <= 0:
            return
        with torch.no_grad():
            for load, bias in zip(counts, self.biases):
                if bias is not None:
                    step = rate * torch.sign(load.mean() - load)
                    bias.add_(step.to(device=bias.device, dtype=bias.dtype))


def bias_problems(loads: Optional[ExpertLoads], rate: Any, name: str) -> list[str]:
    """Why ``router_bias_update_rate=rate`` cannot be trained on the model ``name``."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
        return [f"router_bias_update_rate={rate!r} must be a number >= 0"]
    if rate > 0 and (loads is None or not loads.has_bias):
        return [
            f"router_bias_update_rate={rate}: {name} has no router balancing bias "
            f"({BIAS_BUFFER}: deepseek_v3, glm4_moe, ...); leave it 0"
        ]
    return []
