"""What the planner knows about a model: its parts' parameter counts (and which of them tensor
parallelism splits), its sizes, and its activation bytes per block, measured.

Everything is read from the model built on ``meta`` (no memory), except the activation bytes:
the project's :class:`~lightning_3d.parallel.activations.ActivationMeter` cannot count on
``meta``, where every storage has data pointer 0 (all saves look like one tensor), so one block
is copied to the CPU at its real width, with tensor parallelism's local shapes, and its forward
run at batch 1 under each activation-checkpointing policy (see
:mod:`lightning_3d.planner.activations`). Batch and sequence length are then scaled analytically.

Example::

    >>> facts = model_facts(model_on_meta(cfg.model), seq_len=128, precision="bf16-mixed", tp_sizes=(1, 2))
    >>> facts.num_params, facts.activations[("none", 1)].bytes_per_sample(128)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from torch import nn

from lightning_3d.parallel.activation_checkpoint import transformer_blocks
from lightning_3d.parallel.context.apply import context_problems
from lightning_3d.planner.activations import (
    ActivationFit,
    measure_activations,
    measure_sequence_parallel,
)

# Bytes per parameter of (parameters, gradients, optimizer state) resident with the parameters
# (Adam(W): two moments), and of one activation element, by Lightning precision. Mixed
# precision keeps fp32 parameters (they are the master weights) and computes in 16 bits;
# "bf16-true" keeps bf16 parameters, and torch's Adam keeps its moments in the parameters'
# dtype. An offloaded optimizer (lightning_3d.offload) keeps fp32 moments in host memory, plus an
# fp32 master of every parameter that is not itself an fp32 host tensor: offloaded_state_bytes.
PRECISIONS: Mapping[str, tuple[int, int, int, int]] = {
    "32-true": (4, 4, 8, 4),
    "bf16-mixed": (4, 4, 8, 2),
    "16-mixed": (4, 4, 8, 2),
    "bf16-true": (2, 2, 4, 2),
}
# Optimizer bytes per trained parameter where ZeRO 0-2 keep fp32 masters of a low-precision
# module (``zero_master_weights``, the default): an fp32 master and Adam's two fp32 moments, the
# ZeRO paper's K = 12 (parallel/masters.py). ZeRO-3 (FSDP2) steps the bf16 shards themselves,
# and ``zero_master_weights=False`` the bf16 slices at ZeRO 0-2: the table above
# (planner/memory.py ``keeps_masters``).
MASTER_STATE_BYTES: Mapping[str, int] = {"bf16-true": 12}


# Low-bit AdamW moments (parallel/optimizers.py): (bytes of code per moment element, elements
# per fp32 scale). Tensors under 4096 elements keep fp32 moments: not modelled (norms, biases).
LOW_BIT_MOMENTS: Mapping[str, tuple[float, int]] = {
    "adamw8bit": (1, 256),
    "adamw4bit": (0.5, 128),
    "adamw8bit_bnb": (1, 256),
}


def optimizer_state_bytes(optimizer: str, adam_bytes: float) -> dict[str, float]:
    """Bytes per trained parameter of ``optimizer``'s state, by the dtype it is stored in.
    ``adam_bytes``: what AdamW keeps at this precision (two moments, plus a 4-byte fp32 master
    where it is more than 8: ZeRO 0-2's masters of a bf16 module, kept by every optimizer).

    Example::

        optimizer_state_bytes("adamw8bit", 8)  # {"uint8": 2, "float32": 0.03125}
    """
    moments = min(adam_bytes, 8)
    masters = {"float32": adam_bytes - moments} if adam_bytes > moments else {}
    kind = "float32" if moments == 8 else "bfloat16"
    if optimizer == "sgd":  # one momentum buffer
        state = {kind: moments / 2}
    elif optimizer in LOW_BIT_MOMENTS:
        code, block = LOW_BIT_MOMENTS[optimizer]
        state = {"uint8": 2 * code, "float32": 2 * 4 / block}
    else:
        state = {kind: moments}
    for dtype, nbytes in masters.items():
        state[dtype] = state.get(dtype, 0) + nbytes
    return state


def offloaded_state_bytes(param_bytes: int, params_on_host: bool = False) -> int:
    """Host bytes per parameter of an offloaded Adam (``lightning_3d.offload``): fp32 moments (8),
    and an fp32 master (4) unless the parameter is its own: an fp32 tensor in host memory
    (``params_on_host``: ZeRO-3's shards offloaded with ``+params``). Parameters on an accelerator
    always get a separate master, fp32 ones too. Not modelled: the delayed update keeps a master
    for every parameter (12 B where this says 8), and on a CPU-only cluster fp32 parameters are
    their own master (8 B where this says 12: the safe side)."""
    return 8 + (0 if param_bytes == 4 and params_on_host else 4)


def check_precision(precision: str) -> tuple[int, int, int, int]:
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not one the planner models; use one of {list(PRECISIONS)}"
        )
    return PRECISIONS[precision]


@dataclass(frozen=True)
class Part:
    """Parameters of one part of the model (the first stage's modules, one block, the last's)."""

    params: int = 0  # elements, each parameter once
    split: int = 0  # of which tensor parallelism splits across the tp ranks (full count)
    flop_params: int = 0  # elements of weights used in matmuls (embedding lookups are not)
    # ((rows, elements, tensor-split dim or -1), how many such parameters), sorted: the shapes
    # ZeRO-3's dim-0 chunks need, counted (a model's blocks repeat a dozen shapes). Empty for a
    # part given by its counts alone: ZeRO-3 is then taken as an even split.
    tensors: tuple[tuple[tuple[int, int, int], int], ...] = ()

    def local(self, tp: int) -> float:
        """Elements one tensor-parallel rank holds."""
        return self.params - self.split + self.split / tp

    def sharded(self, tp: int, dp: int, dp_rank: int = 0) -> float:
        """Elements data rank ``dp_rank`` holds under ZeRO-3: FSDP2 cuts dim 0 of each tensor
        rank's parameter into ``dp`` chunks of ``ceil(rows / dp)`` rows with ``torch.chunk``, so
        rank 0 holds the most (a full chunk of every parameter) and the last ranks a short or
        empty one; on small dims this is far from ``local(tp) / dp``."""
        if not self.tensors:
            return self.local(tp) / dp
        return float(sum(count * _held(shape, tp, dp, dp_rank) for shape, count in self.tensors))

    def __add__(self, other: Part) -> Part:
        return Part(
            self.params + other.params,
            self.split + other.split,
            self.flop_params + other.flop_params,
            _counted(self.tensors, other.tensors, 1),
        )

    def __sub__(self, other: Part) -> Part:
        """This part without ``other``'s parameters (a tied weight counted once)."""
        return Part(
            self.params - other.params,
            self.split - other.split,
            self.flop_params - other.flop_params,
            _counted(self.tensors, other.tensors, -1),
        )


def _counted(
    mine: Sequence[tuple[tuple[int, int, int], int]],
    theirs: Sequence[tuple[tuple[int, int, int], int]],
    sign: int,
) -> tuple[tuple[tuple[int, int, int], int], ...]:
    counts = Counter(dict(mine))
    for shape, n in theirs:
        counts[shape] += sign * n
    if any(n < 0 for n in counts.values()):
        raise ValueError("cannot take away parameters a part does not hold")
    return tuple(sorted((shape, n) for shape, n in counts.items() if n))


def _held(shape: tuple[int, int, int], tp: int, dp: int, dp_rank: int) -> int:
    """Elements of one ``(rows, elements, split dim)`` parameter on data rank ``dp_rank`` under
    ZeRO-3, on its tensor rank."""
    rows, elements, dim = shape
    if dim >= 0:
        elements //= tp
        rows = rows // tp if dim == 0 else rows
    chunk = -(-rows // dp)
    held = max(0, min(chunk, rows - dp_rank * chunk))
    return held * (elements // rows) if rows else 0


@dataclass(frozen=True)
class ModelFacts:
    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int
    precision: str
    first: Part  # modules only the first pipeline stage keeps (embeddings)
    blocks: tuple[Part, ...]
    last: Part  # modules only the last stage keeps (final norm, head)
    tied: Part  # parameters held by both first and last (one copy per stage under a pipeline)
    buffer_bytes: int
    # (policy, tp) -> fit; (policy, tp, "sp") with sequence parallelism
    activations: Mapping[tuple, ActivationFit] = field(default_factory=dict)
    pipeline_ready: bool = True  # the model has a pipeline_spec
    context_ready: bool = True  # context parallelism can route the model's attention
    # An MoE model's experts (planner/experts.py: ExpertFacts, which stands on this module, so
    # planner/search.py fills it in), which an expert axis splits; None: a dense model.
    experts: Optional[Any] = None
    # What the search asks again for each of its candidates (a stage split's parts, by
    # (what, pipeline, virtual)), computed once per facts: not copied by ``replace``.
    memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def num_params(self) -> int:
        """Parameters of the whole model, a tied weight once."""
        return (
            self.first.params
            + sum(b.params for b in self.blocks)
            + self.last.params
            - self.tied.params
        )

    @property
    def flop_params(self) -> int:
        """Weights that take part in matmuls (6 FLOPs each per trained token)."""
        return (
            self.first.flop_params + sum(b.flop_params for b in self.blocks) + self.last.flop_params
        )

    @property
    def bytes(self) -> tuple[int, int, int, int]:
        return PRECISIONS[self.precision]

    def activation(
        self, policy: str, tp: int, sequence_parallel: bool = False, method: str = "none"
    ) -> ActivationFit:
        """The fit for ``policy`` at tensor size ``tp`` (with sequence parallelism: key
        ``(policy, tp, "sp")``); ``method``: the fine-tune method's own where it was measured
        (:meth:`measured_method`), else the full model's."""
        if self.measured_method(policy, tp, sequence_parallel, method):
            return self.activations[(policy, tp, method)]
        key = (policy, tp, "sp") if sequence_parallel else (policy, tp)
        try:
            return self.activations[key]
        except KeyError:
            have = sorted(self.activations, key=str)
            raise ValueError(
                f"no activation measurement for policy={policy!r}, tensor={tp}"
                f"{', sequence_parallel' if sequence_parallel else ''}; have {have}"
            ) from None

    def measured_method(self, policy: str, tp: int, sequence_parallel: bool, method: str) -> bool:
        """Whether the block was measured with ``method``'s adapters (never with sequence
        parallelism, which adapters cannot take)."""
        return (
            method != "none" and not sequence_parallel and (policy, tp, method) in self.activations
        )


def _sizes(module: nn.Module) -> dict[str, Optional[int]]:
    """n_head / d_model / vocab / positions from a config the module or its ``model`` carries."""
    configs = [
        getattr(module, "config", None),
        getattr(getattr(module, "model", None), "config", None),
    ]
    names = {
        "n_head": ("n_head", "num_attention_heads"),
        "d_model": ("n_embd", "hidden_size", "d_model"),
        "vocab_size": ("vocab_size",),
        "positions": ("block_size", "max_position_embeddings", "n_positions"),
    }
    found: dict[str, Optional[int]] = dict.fromkeys(names)
    for config in configs:
        if config is None:
            continue
        for key, options in names.items():
            for option in options:
                value = (
                    config.get(option)
                    if isinstance(config, Mapping)
                    else getattr(config, option, None)
                )
                if found[key] is None and isinstance(value, int):
                    found[key] = value
    return found


def split_dims(module: nn.Module) -> tuple[dict[str, int], set[str]]:
    """Full names of the parameters the architecture's tensor-parallel plan splits, each with the
    dim it splits, and the names of its column-parallel modules (none if the model has no plan:
    ``tensor > 1`` is then refused by the strategy's own check)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_3d.parallel.plans import build_plan
    from lightning_3d.parallel.tensor import resolve_plan, split_dim

    try:
        resolved = resolve_plan(module, build_plan(module, None, False), 1)
    except ValueError:
        return {}, set()
    dims = {}
    for name, style in resolved.items():
        sub = module.get_submodule(name)
        for pname, _ in sub.named_parameters(recurse=False):
            dim = split_dim(sub, style, pname)
            if dim is not None:
                dims[f"{name}.{pname}"] = dim
    return dims, {name for name, style in resolved.items() if isinstance(style, ColwiseParallel)}


def _part(modules: Iterable[tuple[str, nn.Module]], split: Mapping[str, int]) -> Part:
    # id -> (rows, elements, split dim or -1, used in a matmul): a parameter reached under two
    # names (tied) counts once, split or in a matmul if it is under either name.
    seen: dict[int, tuple[int, int, int, bool]] = {}
    for prefix, module in modules:
        for sub_name, sub in module.named_modules(prefix=prefix):
            for pname, p in sub.named_parameters(recurse=False):
                rows, n, dim, flop = seen.get(
                    id(p), (p.shape[0] if p.dim() else 1, p.numel(), -1, False)
                )
                dim = split.get(f"{sub_name}.{pname}", dim)
                seen[id(p)] = (rows, n, dim, flop or not isinstance(sub, nn.Embedding))
    shapes = Counter((rows, n, dim) for rows, n, dim, _ in seen.values())
    return Part(
        sum(n for _, n, _, _ in seen.values()),
        sum(n for _, n, d, _ in seen.values() if d >= 0),
        sum(n for _, n, _, f in seen.values() if f),
        tuple(sorted(shapes.items())),
    )


def model_facts(
    module: nn.Module,
    *,
    seq_len: Optional[int] = None,
    precision: str = "bf16-mixed",
    policies: Sequence[str] = ("none", "selective", "full"),
    tp_sizes: Sequence[int] = (1,),
    name: str = "model",
    sequence_parallel: bool = False,
    methods: Sequence[str] = ("none",),
    lora_r: int = 8,
) -> ModelFacts:
    """The facts of ``module`` (built on ``meta``) at ``seq_len`` tokens per sample, with
    activations measured for each policy and each tensor size in ``tp_sizes`` that divides the
    model; ``sequence_parallel``: also with sequence parallelism at each tensor size above 1, where
    it can be measured (:func:`sequence_parallel_activations`); each fine-tune method of
    ``methods`` other than ``"none"`` (``lora``, ``qlora``: adapters of rank ``lora_r`` on every
    projection) measured too, with its adapters in the block (key ``(policy, tp, method)``; a
    method the block cannot take is left to the formula). ``ValueError`` for a module the
    planner cannot read (no transformer blocks, no width)."""
    check_precision(precision)
    spec = module.pipeline_spec() if callable(getattr(module, "pipeline_spec", None)) else None
    blocks = transformer_blocks(module)
    if not blocks:
        raise ValueError(
            f"{type(module).__name__} has no transformer blocks (an nn.ModuleList of modules with "
            "parameters): the planner splits models by block"
        )
    sizes = _sizes(module)
    d_model = sizes["d_model"] or _width(blocks[0][1])
    n_head = sizes["n_head"]
    if not d_model or not n_head:
        raise ValueError(
            f"cannot read the width and head count of {type(module).__name__} from its config"
        )
    seq_len = seq_len or sizes["positions"]
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(
            f"seq_len={seq_len!r} must be a positive integer (the model gives no block_size)"
        )
    if sizes["positions"] and seq_len > sizes["positions"]:
        raise ValueError(
            f"seq_len={seq_len} is above the model's maximum positions {sizes['positions']}"
        )
    split, columns = split_dims(module)
    block_names = {name for name, _ in blocks}
    if spec is not None:
        first_modules = [(n, module.get_submodule(n)) for n in spec.first]
        last_modules = [(n, module.get_submodule(n)) for n in spec.last]
    else:  # no pipeline: everything outside the blocks counts with the first (only) stage
        first_modules = [
            (n, m) for n, m in module.named_children() if not _holds_blocks(n, block_names)
        ]
        last_modules = []
    first, last = _part(first_modules, split), _part(last_modules, split)
    both = _part(first_modules + last_modules, split)
    tied = replace(first + last - both, flop_params=0)
    block_parts = tuple(_part([(n, b)], split) for n, b in blocks)
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    vocab = sizes["vocab_size"] or 0
    tps = sorted({t for t in tp_sizes if n_head % t == 0})
    forward = getattr(spec, "block_forward", None) if spec is not None else None
    measure = dict(
        forward=forward,
        split=set(split),
        columns=columns,
        d_model=d_model,
        n_head=n_head,
        seq_len=seq_len,
        act_bytes=PRECISIONS[precision][3],
        policies=policies,
        tp_sizes=tps,
    )
    activations = measure_activations(blocks[0], **measure)
    for method in (m for m in dict.fromkeys(methods) if m != "none"):
        activations.update(_method_activations(method, lora_r, blocks[0], **measure))
    if sequence_parallel:
        activations.update(
            sequence_parallel_activations(
                module,
                blocks[0],
                forward=forward,
                d_model=d_model,
                seq_len=seq_len,
                act_bytes=PRECISIONS[precision][3],
                policies=policies,
                tp_sizes=[t for t in tps if t > 1],
            )
        )
    return ModelFacts(
        name=name,
        n_layer=len(blocks),
        d_model=d_model,
        n_head=n_head,
        vocab_size=vocab,
        seq_len=seq_len,
        precision=precision,
        first=first,
        blocks=block_parts,
        last=last,
        tied=tied,
        buffer_bytes=buffers,
        activations=activations,
        pipeline_ready=spec is not None,
        context_ready=not context_problems(module, "ring", 2),
    )


def _method_activations(method: str, lora_r: int, block: Any, **measure: Any) -> dict:
    """``(policy, tp, method)`` -> fit, measured with the method's adapters in the block; none
    where the measurement fails (peft missing, an NF4 base it cannot hold, a block that does not
    run alone): the planner then adds the adapters' formula to the full model's."""
    from lightning_3d.adapters import AdapterOptions

    try:
        fits = measure_activations(
            block, adapter=AdapterOptions(method=method, r=lora_r), **measure
        )
    except (ImportError, ValueError):
        return {}
    return {
        (policy, tp, method): fit for (policy, tp), fit in fits.items() if fit.source == "measured"
    }


def sequence_parallel_activations(
    module: nn.Module,
    block: tuple[str, nn.Module],
    *,
    forward: Optional[Callable],
    d_model: int,
    seq_len: int,
    act_bytes: int,
    policies: Sequence[str],
    tp_sizes: Sequence[int],
) -> dict[tuple, ActivationFit]:
    """``(policy, tp, "sp")`` fits of the block under the architecture's sequence-parallel plan.
    None where the model has no plan, the plan does not divide the model, the block cannot run
    alone (e.g. a rotary embedding whose buffers are still on meta), or this process
    already has a process group (``parallelism=auto`` inside a run: the fake world that measures
    it cannot coexist with one); the planner then rejects those layouts as not measured."""
    import torch.distributed as dist

    from lightning_3d.parallel.plans import build_plan
    from lightning_3d.parallel.tensor import resolve_plan

    name = block[0]
    out: dict[tuple, ActivationFit] = {}
    if dist.is_initialized():
        return out
    for tp in tp_sizes:
        try:
            plan = resolve_plan(module, build_plan(module, None, True), tp)
            own = {
                key[len(name) + 1 :] if key != name else "": style
                for key, style in plan.items()
                if key == name or key.startswith(name + ".")
            }
            out.update(
                measure_sequence_parallel(
                    block,
                    own,
                    forward=forward,
                    d_model=d_model,
                    seq_len=seq_len,
                    act_bytes=act_bytes,
                    policies=policies,
                    tp=tp,
                )
            )
        except Exception:  # noqa: BLE001 - a block that cannot run alone (e.g. meta buffers): not measured
            continue
    return out


def _holds_blocks(name: str, block_names: set[str]) -> bool:
    return any(b == name or b.startswith(name + ".") for b in block_names)


def _width(block: nn.Module) -> Optional[int]:
    for sub in block.modules():
        if isinstance(sub, nn.LayerNorm) and sub.normalized_shape:
            return int(sub.normalized_shape[-1])
    return None


def facts_summary(facts: ModelFacts) -> str:
    """One paragraph: sizes and the measured activation bytes per block per sample."""
    acts = ", ".join(
        f"{key[0]}/tp{key[1]}{''.join('/' + str(extra) for extra in key[2:])}: "
        f"{fit.bytes_per_sample(facts.seq_len) / 2**20:.2f} MiB ({fit.source})"
        for key, fit in sorted(facts.activations.items(), key=lambda kv: (len(kv[0]), kv[0]))
    )
    return (
        f"{facts.name}: {facts.num_params / 1e6:.1f}M parameters ({facts.n_layer} blocks, d_model {facts.d_model}, "
        f"{facts.n_head} heads, vocab {facts.vocab_size}), seq_len {facts.seq_len}, {facts.precision}; "
        f"activations per block per sample: {acts}"
    )
