"""The tensor plan a ``transformers`` model ships, as this project's DTensor styles.

Every decoder family of ``transformers`` declares how its modules split over a tensor axis:
``config.base_model_tp_plan``, merged with the model class's own entries into ``model.tp_plan``
(``{"model.layers.*.self_attn.q_proj": "colwise", ...}``). :func:`hf_tensor_plan` finds the
``transformers`` model inside a ``LightningModule`` and translates that plan, so the family's own
knowledge (Qwen3's per-head norms, Phi-3's fused projections, OLMo2's full-width q/k norms, a
mixture of experts) decides the split instead of module names recognised here.

Translation (``transformers`` style → what runs here):

* ``colwise`` / ``rowwise`` → column / row parallel (``Linear`` and ``Conv1D``), local outputs;
* ``colwise_gather_output`` / ``colwise_rep`` → column parallel whose output is gathered, and
  ``rowwise_split_input`` / ``rowwise_rep`` → row parallel that slices a replicated input: the
  module reads global sizes after the projection (OLMo2's full-width q/k norms, Phi-3's q/k/v
  slicing by ``config.num_attention_heads``). A fused ``gate_up_proj`` whose MLP only chunks it
  in two (Phi-3, GLM) is the exception: its rows are regrouped so each rank holds its own halves
  of gate and up (``FusedColwiseParallel``), no gather, and its ``down_proj`` is plain row parallel;
* ``packed_colwise`` on a 2-D weight → the same regrouping into two chunks;
* ``embedding_rowwise`` / ``embedding_colwise`` → vocab- / feature-parallel embedding; the input
  embedding is vocab-parallel even where the plan does not name it, and the LM head is always the
  loss-parallel head (vocab-sharded logits, never gathered), so a tied pair splits alike;
* ``replicated_with_grad_allreduce`` → :class:`~lightning_3d.parallel.tensor.ReplicatedGradSum`
  (per-head norms: replicated weights whose gradients are summed over ``tp``);
* mixture-of-experts styles (``moe_tp_experts``, ``packed_colwise`` on 3-D expert weights,
  ``grouped_gemm``, ...) → the experts and the router are **replicated**: every tensor rank
  computes every expert on the full (replicated) input, so nothing about routing changes, and
  the attention is still split;
* ``replicate`` → nothing.

Any other style (``mla_kv_a_proj``, ``local_params``, ``all_reduce``, ...) is refused with a
``ValueError`` naming the ``transformers`` class, the module and the style, and what to pass
instead. With ``sequence_parallel`` the decoder layers' own norms and the final norm hold a
sequence shard (the base model's one list of blocks, and the norms after it); a layer with any
other module that holds parameters outside the plan is refused, since it would see only part of
the sequence, and so is a base model that does more than run its blocks in order (two block
lists run in cycles, parameters of its own, a module with parameters after the blocks).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Optional

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_3d.parallel.tensor import (
    ColwiseConv1DParallel,
    FusedColwiseParallel,
    PrepareHiddenStates,
    ReplicatedGradSum,
    RowwiseConv1DParallel,
    name_matches,
)

COLUMN = ("colwise",)
GATHERED_COLUMN = ("colwise_gather_output", "colwise_rep")
SPLIT_INPUT_ROW = ("rowwise_split_input", "rowwise_rep")
EXPERT_STYLES = (
    "moe_tp_experts",
    "grouped_gemm",
    "ep_dispatch_experts",
    "moe_identity_expert",
    "packed_rowwise",
)
TRANSLATED = (
    *COLUMN,
    *GATHERED_COLUMN,
    "rowwise",
    *SPLIT_INPUT_ROW,
    "packed_colwise",
    "embedding_rowwise",
    "embedding_colwise",
    "replicated_with_grad_allreduce",
    "replicate",
    *EXPERT_STYLES,
)


def outermost_hf_model(root: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """``(name, model)`` of the outermost ``transformers`` model inside ``root`` (``""`` for
    ``root`` itself), without importing ``transformers``; ``None`` if there is none."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return None
    for name, module in root.named_modules():  # pre-order: the outermost comes first
        if isinstance(module, modeling.PreTrainedModel):
            return name, module
    return None


def hf_tensor_plan(root: nn.Module, sequence_parallel: bool) -> Optional[dict[str, ParallelStyle]]:
    """The translated plan of the ``transformers`` model in ``root`` (see the module docstring);
    ``None`` when ``root`` holds none, or one whose plan names nothing but its LM head."""
    found = outermost_hf_model(root)
    if found is None:
        return None
    prefix, model = found
    head = model.get_output_embeddings()
    head_names = {n for n, m in model.named_modules() if m is head}
    entries = {
        k: v for k, v in (getattr(model, "tp_plan", None) or {}).items() if k not in head_names
    }
    if not entries:
        return None
    return _Translation(root, prefix, model, entries, sequence_parallel).plan()


def whole_output_conflicts(root: nn.Module, plan: Mapping[str, object]) -> list[str]:
    """Entries of an explicit ``plan`` (``tp_plan=``) that split plain column-wise a module
    whose output the ``transformers`` model reads whole: its shipped plan gives the module a
    gathered or packed style (Phi-3's fused ``qkv_proj`` and ``gate_up_proj``, which the model
    slices by global sizes; OLMo2's q/k under full-width norms). Split plain, a rank would hold
    a band of the fused rows (all of q and none of v) and the model's slicing fails on the
    first forward. One sentence per entry; ``[]`` where there is no ``transformers`` model."""
    found = outermost_hf_model(root)
    if found is None:
        return []
    prefix, model = found
    shipped = {
        _join(prefix, k): v
        for k, v in (getattr(model, "tp_plan", None) or {}).items()
        if v in (*GATHERED_COLUMN, "packed_colwise")
    }
    names = [n for n, _ in root.named_modules() if n]
    out = []
    for pattern, style in plan.items():
        if not _plain_colwise(style):
            continue
        hits = [n for n in names if name_matches(n, pattern)]
        whole = next((s for p, s in shipped.items() if any(name_matches(n, p) for n in hits)), None)
        if whole is not None:
            given = style if isinstance(style, str) else type(style).__name__
            out.append(
                f"tp_plan (parallelism.tp_plan in the app) gives {pattern} {given!r}, but "
                f"{type(model).__name__} reads that projection's whole output (transformers' "
                f"plan gives it {whole!r}: a fused projection, such as q/k/v in one, sliced by "
                "global sizes, or one under a full-width norm); split plain, each rank would "
                "hold a band of it: the fused projection needs its own style, "
                "'colwise_gather_output' (its output projection 'rowwise_split_input'), or "
                "leave tp_plan unset for the model's own plan"
            )
    return out


def _plain_colwise(style: object) -> bool:
    """A column split whose output stays local (``"colwise"``, or such a style object)."""
    if isinstance(style, str):
        return style == "colwise"
    return (
        isinstance(style, ColwiseParallel)
        and not isinstance(style, FusedColwiseParallel)
        and style.output_layouts != (Replicate(),)
    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


class _Translation:
    """One model's plan, translated entry by entry (``plan()``)."""

    def __init__(
        self, root: nn.Module, prefix: str, model: nn.Module, entries: Mapping[str, str], sp: bool
    ) -> None:
        self.root, self.prefix, self.model, self.sp = root, prefix, model, sp
        self.entries = {_join(prefix, k): v for k, v in entries.items()}
        self.modules = dict(root.named_modules())
        self.params = dict(root.named_parameters(remove_duplicate=False))
        # Activations (B, T, C): dim 1 is the sequence.
        self.col_in = Shard(1) if sp else Replicate()
        self.row_out = Shard(1) if sp else Replicate()

    def plan(self) -> dict[str, ParallelStyle]:
        plan: dict[str, ParallelStyle] = {}
        experts = self._expert_patterns()
        regrouped = self._regrouped_gate_up()
        for pattern, style in self.entries.items():
            if any(pattern == e or pattern.startswith(e + ".") for e in experts):
                continue  # experts (and anything inside them) stay whole: see the module docstring
            if self._in_moe_blocks_only(pattern):
                # A dense MLP's projection, named for the layers a config may keep dense
                # (Qwen3-MoE's mlp_only_layers), where this one built MoE blocks: nothing to split.
                continue
            translated = self._translate(pattern, style, regrouped)
            if translated is not None:
                plan[pattern] = translated
        plan.update(self._scalars_between(plan))
        plan.update(self._ends())
        if self.sp:
            plan.update(self._sequence_parallel(plan))
        return plan

    # ---------------------------------------------------------------- one entry
    def _translate(self, pattern: str, style: str, regrouped: set[str]) -> Optional[ParallelStyle]:
        if style not in TRANSLATED:
            self._refuse(pattern, style, "has no translation here")
        if style == "replicate":
            return None
        if style in COLUMN:
            return ColwiseConv1DParallel(input_layouts=self.col_in)
        if style == "packed_colwise" or pattern in regrouped:
            return FusedColwiseParallel(2, input_layouts=self.col_in)
        if style in GATHERED_COLUMN:
            return ColwiseConv1DParallel(input_layouts=self.col_in, output_layouts=Replicate())
        beside_regrouped = pattern.rpartition(".")[0] in {r.rpartition(".")[0] for r in regrouped}
        local = not self.sp  # under sequence parallelism the residual stream stays a DTensor
        # Its input is this rank's.
        if style == "rowwise" or (style in SPLIT_INPUT_ROW and beside_regrouped):
            return RowwiseConv1DParallel(output_layouts=self.row_out, use_local_output=local)
        if style in SPLIT_INPUT_ROW:
            return RowwiseConv1DParallel(
                input_layouts=Replicate(), output_layouts=self.row_out, use_local_output=local
            )
        if style == "embedding_rowwise":
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if style == "embedding_colwise":
            return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if style == "replicated_with_grad_allreduce":
            return ReplicatedGradSum()
        self._refuse(pattern, style, "is an expert style outside a mixture-of-experts block")

    def _scalars_between(self, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
        """Modules beside a column-parallel projection with a local output and a row-parallel
        one whose parameters are scalars (Apertus' xIELU activation, ``alpha_p`` and ``alpha_n``,
        between ``up_proj`` and ``down_proj``) or a norm's ``head_dim`` vectors (per-head ``q_norm``
        / ``k_norm``, which Sarvam-MoE's and Param2-MoE's plans leave out): each
        rank applies them to its own share of the features or heads, so each holds a share of
        the gradient, summed over ``tp`` (:class:`ReplicatedGradSum`). Left alone, every tensor
        rank would step with its own share (the replica guard's mismatch at the first step). A
        norm over a split width (Nemotron-H's gated norm over the mixer's channels) is not one."""
        out: dict[str, ParallelStyle] = {}
        parents: dict[str, set[str]] = {}
        for pattern, style in plan.items():
            parent, _, leaf = pattern.rpartition(".")
            kind = (
                "col"
                if isinstance(style, (ColwiseConv1DParallel, FusedColwiseParallel))
                else "row"
                if isinstance(style, RowwiseConv1DParallel)
                else None
            )
            if kind == "col" and style.output_layouts != (Replicate(),) or kind == "row":
                parents.setdefault(parent, set()).add(kind)
        for parent, kinds in parents.items():
            if kinds != {"col", "row"}:
                continue
            holder = next((m for n, m in self.modules.items() if name_matches(n, parent)), None)
            for name, child in holder.named_children() if holder is not None else ():
                params = list(child.parameters())
                pattern = f"{parent}.{name}"
                shared = all(p.numel() == 1 for p in params) or (
                    "norm" in type(child).__name__.lower()
                    and all(p.shape == (self._head_dim(),) for p in params)
                )
                if params and shared and pattern not in plan:
                    out[pattern] = ReplicatedGradSum()
        return out

    def _head_dim(self) -> int:
        """The attention head size (``head_dim``, or hidden size / heads); 0 where unknown."""
        config = self.model.config
        for read in (
            lambda: config.head_dim,
            lambda: config.hidden_size // config.num_attention_heads,
        ):
            try:
                value = read()
            except Exception:  # noqa: BLE001 - absent, or per-layer in a heterogeneous config
                continue
            if isinstance(value, int) and value > 0:
                return value
        return 0

    def _refuse(self, pattern: str, style: str, why: str) -> None:
        cls = type(self.model)
        raise ValueError(
            f"{cls.__module__}.{cls.__qualname__}: transformers' tensor plan gives {pattern} the style {style!r}, "
            f"which {why}; pass an explicit plan for this model (tp_plan={{pattern: style}}, e.g. its "
            "attention projections only: parallelism.tp_plan in the app) or tensor=1"
        )

    # ---------------------------------------------------------------- experts and fused pairs
    def _expert_patterns(self) -> list[str]:
        """Patterns of the expert modules: named by an expert style, or owning a weight a style
        is given to directly (transformers' packed 3-D expert weights are parameters)."""
        out = []
        for pattern, style in self.entries.items():
            if style in EXPERT_STYLES:
                out.append(pattern)
            elif not any(name_matches(n, pattern) for n in self.modules) and any(
                name_matches(n, pattern) for n in self.params
            ):
                out.append(pattern.rpartition(".")[0])  # the parameter's owner
        return out

    def _in_moe_blocks_only(self, pattern: str) -> bool:
        """Whether ``pattern`` matches no module or weight and its parent matches only MoE
        blocks (modules with an ``experts`` child)."""
        if any(name_matches(n, pattern) for n in (*self.modules, *self.params)):
            return False
        parent = pattern.rpartition(".")[0]
        holders = [m for n, m in self.modules.items() if name_matches(n, parent)]
        return bool(holders) and all(hasattr(m, "experts") for m in holders)

    def _regrouped_gate_up(self) -> set[str]:
        """Gathered ``gate_up_proj`` entries whose sibling ``down_proj`` slices a replicated
        input: the MLP only chunks the pair, so each rank can keep its own halves instead."""
        out = set()
        for pattern, style in self.entries.items():
            parent, _, leaf = pattern.rpartition(".")
            if (
                style in GATHERED_COLUMN
                and leaf == "gate_up_proj"
                and self.entries.get(f"{parent}.down_proj") in SPLIT_INPUT_ROW
            ):
                out.add(pattern)
        return out

    # ---------------------------------------------------------------- embedding, head, SP
    def _name_of(self, module: Optional[nn.Module]) -> Optional[str]:
        return next((n for n, m in self.modules.items() if m is module), None)

    def _ends(self) -> dict[str, ParallelStyle]:
        """The input embedding vocab-parallel (unless the plan splits it otherwise) and the LM
        head loss-parallel: vocabulary rows split alike, so a tied pair stays one parameter."""
        out: dict[str, ParallelStyle] = {}
        embed = self._name_of(self.model.get_input_embeddings())
        if embed is not None and not any(name_matches(embed, p) for p in self.entries):
            out[embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        head = self._name_of(self.model.get_output_embeddings())
        if head is not None:
            out[head] = ColwiseParallel(
                input_layouts=self.col_in, output_layouts=Shard(-1), use_local_output=False
            )
        return out

    def _sequence_parallel(self, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
        """The norms between the blocks' split projections, and where the residual stream turns
        sequence-sharded; refused for a layer whose other modules would see a sequence shard."""
        layers_name, final_norms = self._layers_and_final_norms()
        layers = self.modules[layers_name]
        out: dict[str, ParallelStyle] = {}
        for index, layer in enumerate(layers):
            # The residual stream is a DTensor sharded on the sequence inside and between the
            # layers, so a norm's output (a DTensor) and the residual it is added to (Gemma's
            # post-norms) are alike; it enters as the full embedding at layer 0, as a stage's
            # local shard elsewhere.
            out[f"{layers_name}.{index}"] = PrepareHiddenStates(
                input_layout=Replicate() if index == 0 else Shard(1),
                desired_layout=Shard(1),
                use_local_output=False,
            )
            for child, module in layer.named_children():
                name = f"{layers_name}.{index}.{child}"
                if "norm" in type(module).__name__.lower():
                    out[name] = SequenceParallel()
                elif list(module.parameters()) and not _covered(module, name, plan):
                    self._refuse_sp(
                        f"{name} ({type(module).__name__}) would see a shard of the sequence, "
                        "its parameters not split by the tensor plan"
                    )
                elif _reads_columns(module, name, plan):
                    # One all-gather of the sequence for the whole module: its column-parallel
                    # projections (q, k and v; gate and up) all read that one replicated copy,
                    # and autograd saves it once, instead of each gathering and saving its own
                    # (Megatron gathers once per attention and MLP too).
                    out[name] = PrepareHiddenStates(
                        input_layout=Shard(1), desired_layout=Replicate(), use_local_output=False
                    )
        for name in final_norms:
            out[name] = SequenceParallel()
        return out

    def _layers_and_final_norms(self) -> tuple[str, list[str]]:
        """The decoder's block list and its final norms: the base model's one ``ModuleList`` child
        and every norm registered after it. Refused where the base model's forward does more
        than run the blocks one after another between its embedding and that norm (two block
        lists run in cycles, parameters of its own): that work would see a sequence shard."""
        base = self.model.base_model
        base_name = _join(self.prefix, next(n for n, m in self.model.named_modules() if m is base))
        children = list(base.named_children())
        lists = [i for i, (_, m) in enumerate(children) if isinstance(m, nn.ModuleList)]
        nested = [
            n
            for n, m in base.named_modules()
            if isinstance(m, nn.ModuleList)
            and "." in n
            and not any(n.startswith(children[i][0] + ".") for i in lists)
        ]
        own = [n for n, _ in base.named_parameters(recurse=False)]
        if len(lists) != 1 or nested or own:
            what = (
                f"its parameters {own}"
                if own
                else f"block lists {[children[i][0] for i in lists] + nested}"
            )
            self._refuse_sp(
                f"{type(base).__name__}'s forward is not one list of blocks run in order ({what})"
            )
        index = lists[0]
        embeddings = {id(m) for m in base.modules() if isinstance(m, nn.Embedding)}
        norms = [n for n, m in children[index + 1 :] if "norm" in type(m).__name__.lower()]
        source = _forward_source(base)
        for name in norms:  # NanoChat's model.norm runs before the blocks too
            if source.count(f"self.{name}(") > 1:
                self._refuse_sp(
                    f"{_join(base_name, name)} runs more than once in {type(base).__name__}'s forward "
                    "(before the blocks too), so it cannot hold the sequence shard the last block "
                    "hands it"
                )
        for name, module in children[index + 1 :]:
            if name not in norms and list(module.parameters()) and id(module) not in embeddings:
                self._refuse_sp(
                    f"{_join(base_name, name)} ({type(module).__name__}) runs after the blocks "
                    "and is not split by the tensor plan"
                )
        return _join(base_name, children[index][0]), [_join(base_name, n) for n in norms]

    def _refuse_sp(self, why: str) -> None:
        cls = type(self.model)
        raise ValueError(
            f"{cls.__module__}.{cls.__qualname__}: sequence_parallel=True needs the residual stream "
            f"split on the sequence between the blocks, and {why}; use sequence_parallel=False for "
            "this model"
        )


def _forward_source(module: nn.Module) -> str:
    """The source of ``module``'s forward (empty where Python has none to show)."""
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def _reads_columns(module: nn.Module, name: str, plan: Mapping[str, ParallelStyle]) -> bool:
    """Whether two or more of ``module``'s own children are column-parallel projections (the
    inputs a sequence-parallel plan gathers, one gather each)."""
    columns = 0
    for child, _ in module.named_children():
        styles = [style for p, style in plan.items() if name_matches(f"{name}.{child}", p)]
        columns += any(isinstance(s, (ColwiseConv1DParallel, FusedColwiseParallel)) for s in styles)
    return columns >= 2


def _covered(module: nn.Module, name: str, plan: Mapping[str, ParallelStyle]) -> bool:
    """Whether every parameter of ``module`` belongs to a module the plan gives a style."""
    owners = [
        f"{name}.{n}" if n else name
        for n, m in module.named_modules()
        if list(m.parameters(recurse=False))
    ]
    return all(any(name_matches(owner, p) for p in plan) for owner in owners)
