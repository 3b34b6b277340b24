"""Expert parallelism for Hugging Face mixture-of-experts families: the experts modules that the
config's ``base_model_ep_plan`` names, split over the ``ep`` ranks by this project's all-to-all
(``parallel/expert.py``).

What is taken from ``transformers``: *where* the experts are and *what* may be split. A family's
``base_model_ep_plan`` marks its experts modules (style ``ep_dispatch_experts``) and their
grouped 3-D weights (style ``grouped_gemm``, expert first); the experts module's own forward
(``experts_implementation``: eager, ``grouped_mm``, ...) computes the experts, with the family's
activation, gating, biases and layout. No family's forward is written here.

What is not taken, and why: ``transformers.distributed.expert_parallel`` applies the same plan
with its own styles, but (1) its weight style distributes placeholders without data
(``src_data_rank=None``: weights loaded afterwards), while here every rank must keep its slice of
the first data rank's random or loaded experts; (2) it reduces no gradient over the ranks that
hold the same experts, which ZeRO's data axis needs (``dp_replica`` here); (3) it installs its
dispatch by reassigning the module's ``forward``; (4) the GPU machine's ``transformers`` is older
and its module may differ. The dispatch here is the reference MoE's (one exchange of counts, one
host read per layer, a differentiable all-to-all that is its own dual), installed through
torch's forward hooks:

- the pre-hook sorts this rank's (token, expert) slots by expert, sends each row to its expert's
  rank and hands the experts' own forward the rows that arrived, with *local* expert ids and unit
  weights (top-1 per row), the experts' weights swapped for their local shards (``DTensor`` ->
  local, the swap ``transformers``' own styles make, differentiable);
- the experts' forward runs unchanged on those rows (``num_experts`` set to the local count);
- the post-hook puts the weights back, returns the outputs to the rows' ranks (the reverse
  all-to-all), restores each slot's place and applies the routing weights on the token's rank,
  so the router's gradient stays there.

Router load-balancing loss: where the family has Switch's (``output_router_logits``,
``router_aux_loss_coef``), :class:`~lightning_3d.models.HFCausalLM` trains it over the global
batch (``models/hf_moe.py``: counts and probability sums summed over the data ranks), from
the router logits each rank computes for its own tokens before any exchange; expert
parallelism changes nothing about it.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_3d.parallel.expert import (
    ExpertRouting,
    all_to_all,
    apply_expert_parallel,
    expert_groups,
    expert_problems,
    moe_layers,
    shard_expert_weight,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

EXPERTS_STYLE = "ep_dispatch_experts"
"""The ``base_model_ep_plan`` style that marks an experts module."""


def hf_causal_model(module: nn.Module) -> Optional[nn.Module]:
    """The outermost ``transformers`` model inside ``module`` (a module with a ``config`` and a
    ``base_model``), or ``None``."""
    for sub in module.modules():
        if hasattr(getattr(sub, "config", None), "model_type") and hasattr(sub, "base_model"):
            return sub
    return None


def _plan_patterns(plan: dict[str, str]) -> list[re.Pattern]:
    return [
        re.compile(re.escape(key).replace(r"\*", r"\d+") + "$")
        for key, style in plan.items()
        if style == EXPERTS_STYLE
    ]


def hf_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name under model, experts module)`` for every module that ``model``'s
    ``base_model_ep_plan`` marks ``ep_dispatch_experts`` (empty: no plan, or none matched)."""
    plan = getattr(model.config, "base_model_ep_plan", None) or {}
    patterns = _plan_patterns(plan)
    base = model.base_model
    prefix = next((n for n, m in model.named_modules() if m is base), "")
    found = []
    for name, sub in base.named_modules():
        if any(p.match(name) for p in patterns):
            found.append((f"{prefix}.{name}" if prefix else name, sub))
    return found


def hf_expert_problems(module: nn.Module, expert: int) -> Optional[list[str]]:
    """What stops ``expert`` ranks from splitting the experts of the ``transformers`` model in
    ``module``: ``None`` when ``module`` holds no such model (the caller's refusal applies),
    else the list of problems (empty: it can be split)."""
    model = hf_causal_model(module)
    if model is None:
        return None
    if expert == 1:
        return []
    family = model.config.model_type
    if not getattr(model.config, "base_model_ep_plan", None):
        import transformers

        return [
            f"expert={expert}: the {family!r} family ships no base_model_ep_plan in transformers "
            f"{transformers.__version__} (its experts, if any, are not grouped 3-D weights that "
            "transformers marks as splittable), so its experts cannot be split over ranks"
        ]
    found = hf_experts_modules(model)
    if not found:
        return [
            f"expert={expert}: no module of the {family!r} model matches its base_model_ep_plan's "
            f"{EXPERTS_STYLE!r} entries"
        ]
    problems = []
    if getattr(model, "deferred_init", None) is not None:
        # Each rank keeps its slice of weights it already holds; a deferred directory model
        # reads its files only after the split (shard-aware reading of experts: not yet).
        problems.append(
            f"expert={expert}: the {family!r} model is read from its directory after sharding "
            "(deferred_init=true, the default for model.path); the split needs its weights "
            "first: set model.deferred_init=false (HFCausalLM(deferred_init=False))"
        )
    name, experts = found[0]
    n_experts = getattr(experts, "num_experts", None)
    if not isinstance(n_experts, int):
        problems.append(f"expert={expert}: {family!r} experts module {name} has no num_experts")
    elif n_experts % expert:
        problems.append(
            f"expert={expert} does not divide the {family!r} model's num_experts={n_experts}"
        )
    if len(_forward_inputs(experts)) < 3:
        problems.append(
            f"expert={expert}: the {family!r} experts module {name} takes "
            f"({', '.join(_forward_inputs(experts))}), not (hidden_states, top_k_index, "
            "top_k_weights) as transformers 5's experts do"
        )
    nested = [f"{name}.{p}" for p, _ in experts.named_parameters() if "." in p]
    uneven = [
        f"{name}.{p} {tuple(w.shape)}"
        for p, w in experts.named_parameters(recurse=False)
        if w.dim() < 2 or w.shape[0] != n_experts
    ]
    if nested or uneven:
        problems.append(
            f"expert={expert}: the {family!r} experts hold weights that are not grouped with the "
            f"expert first: {', '.join(nested + uneven)}"
        )
    adapters = [n for n, _ in module.named_parameters() if "lora_" in n]
    if adapters:
        problems.append(
            f"expert={expert} with LoRA adapters on the {family!r} model is not supported yet "
            f"(the adapters, e.g. {adapters[0]}, are not split over the expert ranks; train the "
            "adapters at expert=1)"
        )
    return problems


@dataclass(eq=False)
class _InFlight:
    """What the post-hook needs from the pre-hook of the same call."""

    weights: Tensor  # (N, k) routing weights, on the token's rank
    order: Tensor  # (N * k,) slots sorted by expert
    in_splits: list[int]
    out_splits: list[int]
    arrived: int
    swapped: dict[str, DTensor]


class ExpertsDispatch:
    """The forward pre- and post-hook pair of one experts module (see the module docstring).
    ``routing``: its process groups; ``n_experts``: the global count."""

    def __init__(self, routing: ExpertRouting, n_experts: int) -> None:
        self.routing = routing
        self.n_experts = n_experts
        self.local = n_experts // routing.ep_size
        self.pending: list[_InFlight] = []

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, index, weights = _experts_inputs(module, args, kwargs)
        if isinstance(hidden, DTensor):
            hidden = hidden.to_local()
        k = index.shape[-1]  # index: (N, k)
        flat = index.reshape(-1)  # (N * k,) the expert of each slot
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)  # (E,)
        routed = hidden[order // k]  # (N * k, C) grouped by expert, so by the expert's rank
        sent, received = self.routing.exchange_counts(counts)
        ep, local = self.routing.ep_size, self.local
        in_splits, out_splits = self.routing.splits(sent, received)
        rows = all_to_all(routed, out_splits, in_splits, self.routing.ep_group)  # (n, C)
        # Rows arrive by source rank, then by local expert: their local ids, on the device.
        ids = torch.arange(local, device=rows.device).repeat(ep)
        ids = ids.repeat_interleave(
            torch.tensor(received, device=rows.device), output_size=len(rows)
        )
        swapped = {
            name: p for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)
        }
        # The local shards stand in for the DTensors while the experts' own forward runs.
        module._parameters.update({name: p.to_local() for name, p in swapped.items()})
        self.pending.append(_InFlight(weights, order, in_splits, out_splits, len(rows), swapped))
        return (rows, ids[:, None], rows.new_ones((len(rows), 1))), {}

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> Tensor:
        state = self.pending.pop()
        local_weights = [module._parameters[name] for name in state.swapped]
        module._parameters.update(state.swapped)
        if state.arrived == 0:
            # Nothing came: keep the rows and weights in the graph, so backward still runs the
            # reverse exchange and every replica's gradient reduction (a collective).
            tied = sum((w.sum() * 0 for w in local_weights), args[0].sum() * 0)
            output = output + tied
        back = all_to_all(output, state.in_splits, state.out_splits, self.routing.ep_group)
        slots = back[state.order.argsort()]  # (N * k, C) in slot order again
        tokens, k = state.weights.shape
        weights = state.weights.to(slots.dtype).unsqueeze(-1)  # (N, k, 1)
        return (slots.view(tokens, k, -1) * weights).sum(1)  # (N, C)


def _forward_inputs(experts: nn.Module) -> list[str]:
    """The names of the experts forward's inputs (``self`` left out): transformers 5 passes
    ``(hidden_states, top_k_index, top_k_weights)``, under these names or others (gpt-oss's
    ``router_indices``, ``routing_weights``)."""
    return list(inspect.signature(type(experts).forward).parameters)[1:]


def _experts_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Tensor, ...]:
    """``(hidden_states, top_k_index, top_k_weights)`` of an experts module's call."""
    names = _forward_inputs(module)[:3]
    values = list(args[:3]) + [kwargs[n] for n in names[len(args) :]]
    return values[0], values[1], values[2]


def apply_hf_expert_parallel(
    module: nn.Module, mesh: DeviceMesh, data_mesh: DeviceMesh, expert: int
) -> list[nn.Parameter]:
    """Split every experts module of the ``transformers`` model in ``module`` over ``expert``
    ranks (``parallel/expert.py``'s :func:`~lightning_3d.parallel.expert.apply_expert_parallel`
    contract: call it after the initial broadcast; returns the expert parameters, which the ZeRO
    engines leave to their own gradient hook). ``expert`` = 1: nothing to do."""
    model = hf_causal_model(module)
    if expert == 1 or model is None:
        return []
    problems = hf_expert_problems(module, expert)
    if problems:
        raise ValueError("; ".join(problems))
    found = hf_experts_modules(model)
    on_meta = [
        f"{name}.{p}" for name, experts in found for p, w in experts.named_parameters() if w.is_meta
    ]
    if on_meta:
        # Each rank keeps its slice of the first data rank's experts: they must exist already.
        raise ValueError(
            f"expert={expert} needs the experts' weights before the split, but {on_meta[0]} is "
            "still on meta (a model directory read after sharding): build the HFCausalLM with "
            "deferred_init=False"
        )
    ep_mesh, replicas = expert_groups(mesh, expert)
    data_group, data_size = data_mesh.get_group(), data_mesh.size()
    params: list[nn.Parameter] = []
    for _, experts in found:
        routing = ExpertRouting(
            ep_mesh.get_group(), expert, ep_mesh.get_local_rank(), data_group, data_size
        )
        dispatch = ExpertsDispatch(routing, experts.num_experts)
        for name, full in list(experts.named_parameters(recurse=False)):
            param = shard_expert_weight(full, ep_mesh, replicas, data_group, data_size)
            setattr(experts, name, param)
            params.append(param)
        # The experts' own forward then runs on local expert ids.
        experts.num_experts = dispatch.local
        experts.register_forward_pre_hook(dispatch.before, with_kwargs=True)
        experts.register_forward_hook(dispatch.after, with_kwargs=True)
    return params


def model_expert_problems(module: nn.Module, expert: int) -> list[str]:
    """What stops ``expert`` ranks from splitting ``module``'s experts: a ``transformers``
    model's by its ``base_model_ep_plan`` (:func:`hf_expert_problems`), any other model's by its
    MoE layers (:func:`~lightning_3d.parallel.expert.expert_problems`)."""
    problems = hf_expert_problems(module, expert)
    return expert_problems(module, expert) if problems is None else problems


def refuse_model_expert_plan(module: nn.Module, expert: int) -> None:
    """``ValueError`` with :func:`model_expert_problems`, if any."""
    problems = model_expert_problems(module, expert)
    if problems:
        raise ValueError("; ".join(problems))


def apply_model_expert_parallel(
    module: nn.Module, mesh: DeviceMesh, data_mesh: DeviceMesh, expert: int
) -> list[nn.Parameter]:
    """:func:`apply_hf_expert_parallel` for a ``transformers`` model, else
    :func:`~lightning_3d.parallel.expert.apply_expert_parallel` (the reference MoE's layers)."""
    if hf_causal_model(module) is not None and not moe_layers(module):
        return apply_hf_expert_parallel(module, mesh, data_mesh, expert)
    return apply_expert_parallel(module, mesh, data_mesh, expert)
