"""Pipeline stages of a ``transformers`` decoder that run the model's own code.

The split follows the model's ``pp_plan`` (``config.base_model_pp_plan`` and the class's own
entries: ``embed_tokens`` → ``layers`` → ``norm`` → ``lm_head``, in the order the model runs them)
or, for a family that ships none (GPT-2, StableLM), the base model's children: parameter-holding
modules before its block list go to the first stage, those after it (and the LM head) to the last.

No family's forward is written a second time. Each stage calls the model's own ``forward``, so
the model computes what its layers need exactly as in one process: its causal mask for the
attention implementation and each layer type (full, sliding window), its rotary embeddings, its
embedding scaling, final norm, head and logit soft-capping. What makes that a stage:

* modules another stage holds are parameter-free stand-ins (:func:`placeholder`): a block or a
  norm passes its input through, an embedding returns zeros of its output's shape;
* a stage after the first calls the model with ``inputs_embeds`` of the input's shape (only its
  shape, dtype and device are used), and a forward pre-hook on the stage's first block hands that
  block the received hidden states instead of what the stand-ins before it produced;
* a stage before the last stops at the stand-in after its last block, which raises the hidden
  states it was handed (:class:`_StageOutput`): nothing after the stage's blocks runs;
* the last stage calls the causal LM itself, whose forward applies the norm, the head and any
  logit soft-capping; its output is the logits. With ``loss_chunks`` > 1 the head is handed no
  token in training (``chunked_loss.head_input``): the stage's output is the head's input and
  the pipeline's loss runs the head and cross-entropy by chunks of tokens, as the reference
  GPT's last stage does; a forward without autograd (validation, test, predict) still ends at
  the logits, which the module's own step reads.

Under the interleaved schedules a rank holds several stages of one model: during one stage's
forward the other stages' blocks are swapped for stand-ins. Attention masks do not cross stages:
every layer sees the model's causal mask, so right padding must be marked in the targets
(``-100``), which the loss skips.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_3d.parallel.chunked_loss import chunked_cross_entropy, head_input
from lightning_3d.parallel.pipeline import PipelineSpec


class _StageOutput(Exception):
    """Raised by the stand-in after a stage's last block: the stage's output."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.hidden = hidden


def _first_input(args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    return kwargs.get("hidden_states", next(iter(kwargs.values()), None))


def _returned_items(module: nn.Module) -> int:
    """How many values ``module``'s forward returns by its annotation: ``n`` for a fixed-length
    ``tuple[...]`` (Bamba's layers return ``(hidden_states, attn_weights)``, which the model
    unpacks), 0 for anything else."""
    hint = inspect.signature(type(module).forward).return_annotation
    if typing.get_origin(hint) is not tuple:
        return 0
    items = typing.get_args(hint)
    return 0 if Ellipsis in items else len(items)


class PassThrough(nn.Module):
    """A parameter-free stand-in for a block or norm another stage holds: returns its first input
    (followed by ``None`` for each further value where the module returns a tuple). Keeps the
    plain attributes the model's forward reads off its layers (``attention_type``)."""

    def __init__(self, like: nn.Module) -> None:
        super().__init__()
        for key, value in vars(like).items():
            if not key.startswith("_") and isinstance(value, (str, int, float, bool)):
                setattr(self, key, value)
        self._items = _returned_items(like)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = _first_input(args, kwargs)
        return (first, *[None] * (self._items - 1)) if self._items > 1 else first


class ZeroLookup(nn.Module):
    """A parameter-free stand-in for an embedding another stage holds (GPT-2's position
    embedding, called on every stage): zeros of the lookup's shape, which the next block's
    received input replaces."""

    def __init__(self, like: nn.Embedding) -> None:
        super().__init__()
        self.embedding_dim = like.embedding_dim
        self.dtype = like.weight.dtype

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros((*ids.shape, self.embedding_dim), dtype=self.dtype, device=ids.device)


class _StopAfter(PassThrough):
    """The stand-in after a stage's last block: raises what it is handed as the stage's output."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _StageOutput(_first_input(args, kwargs))


def placeholder(module: nn.Module) -> nn.Module:
    """The stand-in for ``module`` on a stage that does not hold it."""
    return ZeroLookup(module) if isinstance(module, nn.Embedding) else PassThrough(module)


# ---------------------------------------------------------------------------------- layout
def _base_model(outer: nn.Module) -> nn.Module:
    """The decoder inside the causal LM ``outer`` (``get_decoder()``, or its base model)."""
    get = getattr(outer, "get_decoder", None)
    base = get() if callable(get) else getattr(outer, getattr(outer, "base_model_prefix", ""), None)
    if not isinstance(base, nn.Module) or base is outer:
        raise ValueError(
            f"no pipeline split for {type(outer).__name__}: it holds no separate decoder model"
        )
    return base


def stage_layout(outer: nn.Module) -> tuple[list[str], str, list[str]]:
    """``(first, blocks, last)``: module names relative to the causal LM ``outer``, from its
    ``pp_plan`` in the order the model runs them, or from its base model's children."""
    base = _base_model(outer)
    names = dict(outer.named_modules())
    prefix = next(n for n, m in names.items() if m is base)
    head = next((n for n, m in names.items() if m is outer.get_output_embeddings()), None)
    plan = [k for k in (getattr(outer, "pp_plan", None) or {}) if k in names]
    # The class's own entries alone name no blocks.
    if any(isinstance(names[k], nn.ModuleList) for k in plan):
        # The base model's, in its forward's order.
        inner = [k for k in plan if k.startswith(prefix + ".")]
        order = inner + [k for k in plan if k not in inner]
    else:
        with_params = [
            f"{prefix}.{n}"
            for n, m in base.named_children()
            if isinstance(m, nn.ModuleList) or any(True for _ in m.parameters())
        ]
        order = with_params + ([head] if head is not None and head not in with_params else [])
    lists = [k for k in order if isinstance(names[k], nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(
            f"no pipeline split for {type(outer).__name__}: expected one block list among "
            f"{order}, found {lists}; override pipeline_spec() to return a lightning_3d.PipelineSpec"
        )
    at = order.index(lists[0])
    return order[:at], lists[0], order[at + 1 :]


# ---------------------------------------------------------------------------------- running
@contextmanager
def _only(layers: nn.ModuleList, keep: range, stop: int) -> Iterator[None]:
    """Every layer outside ``keep`` a stand-in for the duration (the one at ``stop`` ends the
    stage); the rank's own blocks of other (virtual) stages come back afterwards."""
    saved = dict(layers._modules)
    try:
        for key, layer in saved.items():
            index = int(key)
            if index == stop:
                layers._modules[key] = _StopAfter(layer)
            elif index not in keep and not isinstance(layer, PassThrough):
                layers._modules[key] = PassThrough(layer)
        yield
    finally:
        layers._modules.update(saved)


def _hand_input(holder: Any, first_block: nn.Module) -> Any:
    """A pre-hook on a stage's first block that swaps the hidden states the model hands it for
    the stage's received input (``holder._l3d_received``, taken once per forward). Returns the
    hook's handle."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        received = holder.__dict__.pop("_l3d_received", None)
        if received is None:
            return None
        if args:
            return (received, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": received}

    return first_block.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


def _stand_in_input(stage: Any, x: torch.Tensor) -> torch.Tensor:
    """What a later stage hands the model as ``inputs_embeds``: zeros of the full sequence's
    shape (under sequence parallelism ``x`` holds a shard of it), ``(B, S, D)`` also where the
    layers pass more (DeepSeek-V4's residual streams, ``(B, S, streams, D)``). Only their shape,
    dtype and device matter; a fresh tensor, so nothing the model does to it can touch ``x``."""
    batch, seq, width = x.shape[0], x.shape[1], x.shape[-1]
    return x.new_zeros(batch, seq * stage.sequence_shards, width)


def _hidden(value: Any) -> Any:
    return value[0] if isinstance(value, (tuple, list)) and value else value


@contextmanager
def _checked(outer: nn.Module, layers: nn.ModuleList, stage: Any) -> Iterator[None]:
    """On a stage's first forward: check that the model runs its layers as a pipeline split
    assumes (each once, in order, each handed what the one before returned, the stage's first
    block handed the received input), or ``ValueError`` naming the class. A model that loops
    over its layers (a recurrent depth) or adds something between them computes a different
    model when split there; it needs a pipeline_spec() of its own."""
    received = stage.__dict__.get("_l3d_received")
    if stage.__dict__.get("_l3d_checked") or (
        isinstance(received, torch.Tensor) and received.is_meta
    ):
        yield  # checked already, or a shape-inference forward on meta tensors: nothing to compare
        return
    calls: list[tuple[str, int, Any]] = []
    handles = []
    for key, layer in layers._modules.items():
        index = int(key)
        handles.append(
            layer.register_forward_pre_hook(
                lambda m, a, k, i=index: calls.append(("in", i, _first_input(a, k))),
                with_kwargs=True,
            )
        )
        handles.append(
            layer.register_forward_hook(
                lambda m, a, o, i=index: calls.append(("out", i, _hidden(o)))
            )
        )
    stopped = None
    try:
        yield
    except _StageOutput as done:  # a stage before the last ends here: check it all the same
        stopped = done
    finally:
        for handle in handles:
            handle.remove()
    stand_ins = {int(k) for k, m in layers._modules.items() if isinstance(m, PassThrough)}
    problem = _sequence_problem(calls, stage.block_ids[0], received, stand_ins)
    if problem:
        raise ValueError(
            f"{type(outer).__name__} cannot be split into pipeline stages at its layers: {problem}; "
            "override pipeline_spec() to return a lightning_3d.PipelineSpec, or use pipeline=1"
        )
    stage._l3d_checked = True
    if stopped is not None:
        raise stopped


def _sequence_problem(
    calls: list[tuple[str, int, Any]], first: int, received: Any, stand_ins: set[int]
) -> str:
    """What breaks the contract :func:`_checked` states (``""``: nothing). A stand-in's output
    is not compared: it returns a tensor where the family's layers may return a tuple."""
    inputs = [(i, t) for kind, i, t in calls if kind == "in"]
    outputs = {i: t for kind, i, t in calls if kind == "out"}
    order = [i for i, _ in inputs]
    if order != sorted(set(order)) or order != list(
        range(order[0] if order else 0, (order[-1] + 1) if order else 0)
    ):
        return f"its forward calls its layers in the order {order}, not each once in turn"
    for i, tensor in inputs:
        if i == first and received is not None:
            expected = received
        elif i - 1 in stand_ins:
            continue
        else:
            expected = outputs.get(i - 1)
        if i > order[0] and expected is not None and not _same(tensor, expected):
            return f"layer {i} is not handed what layer {i - 1} returned"
    return ""


def _same(a: Any, b: Any) -> bool:
    """``a`` is ``b``, or ``b`` cast for the block's compute dtype (FSDP2's mixed precision)."""
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return False
    # equal_nan: the schedule's shape inference runs a forward on uninitialised memory
    return torch.allclose(
        a.detach().float(), b.detach().float(), rtol=1e-2, atol=1e-3, equal_nan=True
    )


def run_stage(
    outer: nn.Module, layers_name: str, stage: Any, x: Any, ends_at_norm: bool = False
) -> Any:
    """One stage's forward through the model's own code (see the module docstring);
    ``ends_at_norm``: the last stage returns the head's input when autograd records."""
    layers = outer.get_submodule(layers_name)
    keep = range(stage.block_ids[0], stage.block_ids[-1] + 1)
    kwargs: dict[str, Any] = {"use_cache": False}
    shard = getattr(outer, "context_shard", None)  # context parallelism: x holds T/cp tokens
    if shard is not None:
        B, T = x.shape[0], x.shape[1]
        kwargs["position_ids"] = shard.positions(T, x.device).expand(B, T)
    if stage.is_first:
        kwargs["input_ids"] = x
    else:
        if "_l3d_hook" not in stage.__dict__:  # once per stage: its first block is its own
            stage._l3d_hook = _hand_input(stage, layers[keep.start])
        stage._l3d_received = x
        kwargs["inputs_embeds"] = _stand_in_input(stage, x)
    stop = -1 if stage.is_last else keep.stop
    try:
        with _only(layers, keep, stop), _checked(outer, layers, stage):
            if stage.is_last and ends_at_norm and torch.is_grad_enabled():
                with head_input(outer.get_output_embeddings()) as seen:  # the head: no token
                    outer(**kwargs)
                return seen[0]  # (B, T, D): what the head was handed
            if stage.is_last:
                return outer(**kwargs).logits
            _base_model(outer)(**kwargs)
    except (
        _StageOutput
    ) as done:  # under sequence parallelism a DTensor: stages pass their local shard
        return done.hidden.to_local() if isinstance(done.hidden, DTensor) else done.hidden
    finally:
        stage.__dict__.pop("_l3d_received", None)
    raise RuntimeError(
        f"pipeline stage with blocks {list(keep)} of {type(outer).__name__} returned without "
        "reaching the stand-in after its last block"
    )


def run_one_block(
    outer: nn.Module, layers_name: str, block: nn.Module, x: torch.Tensor
) -> torch.Tensor:
    """``block`` on ``x`` with the inputs the model gives its layers (for the planner, which
    measures one block's activations): a one-block stage at ``block``'s index. A block that is
    not one of the layers (the planner's copy, at a tensor rank's local shapes) runs in the first
    layer's place for the call."""
    from lightning_3d.models.hf_load import compute_buffers

    compute_buffers(outer)  # a model built on meta: its rotary frequencies, computed
    layers = outer.get_submodule(layers_name)
    index = next((int(k) for k, m in layers._modules.items() if m is block), None)
    replaced = None
    if index is None:
        index, replaced = 0, layers._modules["0"]
        layers._modules["0"] = block
    probe = types.SimpleNamespace(_l3d_received=x)
    handle = _hand_input(probe, block)
    stop = index + 1 if index + 1 < len(layers) else -1
    try:
        with _only(layers, range(index, index + 1), stop), _zero_embeddings(outer, x):
            out = _base_model(outer)(inputs_embeds=torch.zeros_like(x), use_cache=False)
    except _StageOutput as done:
        return done.hidden
    finally:
        handle.remove()
        if replaced is not None:
            layers._modules["0"] = replaced
    return out.last_hidden_state  # the model's last block: its final norm ran too


@contextmanager
def _zero_embeddings(outer: nn.Module, x: torch.Tensor) -> Iterator[None]:
    """Embeddings still on ``meta`` (learned positions, GPT-2's ``wpe``) give zeros on ``x``'s
    device for the duration: what the layers receive is replaced by ``x`` anyway, and a meta
    output cannot meet a real one."""

    class Zeros(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.width = width

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return x.new_zeros(*ids.shape, self.width)

    swapped = []
    for name, module in list(outer.named_modules()):
        if isinstance(module, nn.Embedding) and module.weight.is_meta and "." in name:
            parent, _, leaf = name.rpartition(".")
            owner = outer.get_submodule(parent)
            owner._modules[leaf] = Zeros(module.embedding_dim)
            swapped.append((owner, leaf, module))
    try:
        yield
    finally:
        for owner, leaf, module in swapped:
            owner._modules[leaf] = module


def stages_in_one_process(module: Any, pipeline: int, virtual: int = 1) -> list[Any]:
    """Every stage of ``module`` (a ``LightningModule`` with ``pipeline_spec()``) split for
    ``pipeline`` ranks of ``virtual`` stages each, each rank's from its own copy of the module,
    in stage order: the split run in one process, with no process group."""
    from lightning_3d.parallel.stages import split_stages

    stages = []
    for rank in range(pipeline):
        copied = copy.deepcopy(module)
        stages += split_stages(copied, copied.pipeline_spec(), rank, pipeline, virtual)
    return sorted(stages, key=lambda stage: stage.block_ids[0])


def _first_line(err: BaseException, limit: int = 200) -> str:
    lines = str(err).strip().splitlines()
    return (lines[0] if lines else "")[:limit]


def run_in_turn(stages: list[Any], ids: torch.Tensor) -> torch.Tensor:
    """``ids`` through ``stages`` one after the other: what a pipeline's last stage outputs."""
    x = ids
    for stage in stages:
        x = stage(*x) if isinstance(x, tuple) else stage(x)  # a tuple: what a stage carries on
    return x


def check_split(lit: Any, wrap: Callable[[nn.Module], Any]) -> None:
    """Before launch: split a tiny random copy of the model's family (``families.twin``: its code, its
    layer types, small sizes) into 2 stages in one process; ``ValueError`` naming the class if
    the stages in turn do not compute the copy's logits (a forward that loops over its layers or
    passes them more than the hidden states). A family that does not build small is checked at
    its first forward instead (:func:`_checked`). ``wrap`` makes the LightningModule that holds
    the copy."""
    from lightning_3d.families.twin import tiny_twin

    # The launcher's model may be on meta: the twin is not.
    with torch.device("cpu"), torch.no_grad():
        twin_model = tiny_twin(lit.model)
        if twin_model is None:
            return
        twin = wrap(twin_model)
        if len(twin.get_submodule(twin.pipeline_spec().blocks)) < 2:
            return
        ids = torch.randint(
            3, twin_model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
        )
        whole = twin(ids)
        try:
            split = run_in_turn(stages_in_one_process(twin, 2), ids)
        except Exception as err:  # noqa: BLE001 - the model's own code, failing on what a stage hands it
            raise ValueError(
                f"{type(lit.model).__name__} cannot be split into pipeline stages at its layers: on a "
                f"tiny copy of its family a stage fails ({type(err).__name__}: {_first_line(err)}); "
                "override pipeline_spec() to return a lightning_3d.PipelineSpec, or use pipeline=1"
            ) from err
    if not torch.allclose(split, whole, rtol=1e-4, atol=1e-5):
        worst = (split - whole).abs().max().item()
        raise ValueError(
            f"{type(lit.model).__name__} cannot be split into pipeline stages at its layers: on a tiny "
            f"copy of its family the stages in turn give other logits than the whole model (max "
            f"difference {worst:.2e}); override pipeline_spec() to return a lightning_3d.PipelineSpec, "
            "or use pipeline=1"
        )


def hf_pipeline_spec(
    lit: Any, wrap: Callable[[nn.Module], Any], prefix: str = "model"
) -> PipelineSpec:
    """The :class:`PipelineSpec` of ``lit.model`` (a ``transformers`` causal LM held at ``prefix``
    of the LightningModule ``lit``, whose ``split_batch`` and ``loss_fn`` it uses; ``wrap`` holds a
    model in a LightningModule like ``lit``, for :func:`check_split`); ``ValueError``
    naming the class where the model has no single block list to split."""
    outer = lit.model
    first, blocks, last = stage_layout(outer)
    # Set by ThreeDStrategy(loss_chunks=n) before the split: the last stage then ends at the norm.
    chunks = getattr(lit, "loss_chunks", 1)

    def split(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(batch, dict) and batch.get("position_ids") is not None:  # stages count from 0
            raise ValueError(
                "a batch with position_ids (packed sequences) cannot run under "
                "pipeline parallelism: its positions do not reach later stages; use "
                "unpacked rows"
            )
        ids, _, targets = lit.split_batch(batch)
        return ids, targets

    return PipelineSpec(
        blocks=f"{prefix}.{blocks}",
        first=tuple(f"{prefix}.{n}" for n in first),
        last=tuple(f"{prefix}.{n}" for n in last),
        loss=lit.loss_fn if chunks == 1 else functools.partial(_chunked_loss, outer, chunks),
        split_batch=split,
        inputs=lambda batch: split(batch)[0],
        block_forward=lambda block, x: run_one_block(outer, blocks, block, x),
        stage_forward=lambda stage, x: run_stage(outer, blocks, stage, x, chunks > 1),
        placeholder=placeholder,
        check=lambda: check_split(lit, wrap),
    )


def _chunked_loss(outer: nn.Module, chunks: int, outputs: Any, targets: Any) -> torch.Tensor:
    """The head and cross-entropy by chunks of the last stage's ``outputs`` (the head's input).
    The head is looked up at each call: under ZeRO-3, the weight FSDP2 keeps gathered for it
    (``parallel/fsdp.py`` ``keep_head_gathered``), not the shard it holds between steps."""
    head = outer.get_output_embeddings()
    return chunked_cross_entropy(outputs, head.weight, targets, chunks, bias=head.bias)
