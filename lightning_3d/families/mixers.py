"""Which token mixers of a ``transformers`` decoder honour packed rows and context parallelism.

Both rest on one property of a layer: it mixes tokens only through attention that goes through
transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``). Packed rows then reach it as a
block-diagonal mask built from the restarting ``position_ids``; context parallelism replaces the
attention function itself. A layer that mixes tokens any other way (a gated delta net, a Mamba
mixer, a short convolution, lightning attention) runs a recurrence or a convolution along the
row: it carries the first conversation's state into the second, and under context parallelism
each rank's chunks as if they were contiguous. Such layers are found structurally
(:func:`unrouted_mixers`): a decoder layer whose ``config.layer_types`` entry is not an
attention kind, or a child of a decoder layer that is not routed attention and convolves along
the sequence (every state-space and linear-attention mixer of ``transformers`` does).

Attention that does go through the interface can still ignore the packing: a family whose model
builds its mask without the ``position_ids`` (gpt-oss, AFMoE in transformers 5.25) lets the second
conversation of a row see the first. :func:`packing_problems` therefore also runs the family's
tiny twin (:mod:`.twin`) on a packed row and on its conversations alone.

Example::

    problems = packing_problems(model)  # [] for Llama; Qwen3.5: its Qwen3_5GatedDeltaNet layers
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

# config.layer_types entries that are attention through the interface, and those that mix no
# tokens at all (Nemotron-H's MLP-only layers).
ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
NON_MIXING_KINDS = frozenset({"mlp", "moe"})
PACKED_TOLERANCE = 1e-4  # fp32 logits of a conversation packed or alone: 1e-7 when honoured


def is_routed_attention(module: nn.Module) -> bool:
    """An attention module of a ``transformers`` model that calls the attention interface: it
    holds the model's config and a layer index (what :func:`route_hf_attention` routes)."""
    return (
        hasattr(module, "layer_idx")
        and hasattr(module, "config")
        and "Attention" in type(module).__name__
    )


def hf_model_of(module: nn.Module) -> Optional[nn.Module]:
    """The outermost ``transformers`` model in ``module`` (an ``HFCausalLM``'s, under peft's
    wrapper too), or ``None``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)


def _layer_stack(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: the base model's ``layers`` (``model.layers``, ``backbone.layers``),
    else the ``ModuleList`` with one entry per ``config.num_hidden_layers``."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    layers = getattr(base, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    count = getattr(model.config, "num_hidden_layers", None)
    for sub in model.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) == count:
            return list(sub)
    return []


def unrouted_mixers(model: nn.Module) -> dict[str, tuple[Optional[str], list[int]]]:
    """Class name -> (its layers' ``layer_types`` entry, its layer indices) of every token mixer
    of the ``transformers`` ``model`` that is not attention through the attention interface."""
    stack = _layer_stack(model)
    kinds = list(getattr(model.config, "layer_types", None) or [])
    found: dict[str, tuple[Optional[str], list[int]]] = {}
    for index, layer in enumerate(stack):
        kind = kinds[index] if index < len(kinds) else None
        unknown_kind = kind is not None and kind not in ATTENTION_KINDS | NON_MIXING_KINDS
        named = False
        for child in layer.children():
            if is_routed_attention(child):
                continue
            convolves = any(isinstance(m, nn.Conv1d) for m in child.modules())
            if convolves or (unknown_kind and hasattr(child, "layer_idx")):
                layers = found.setdefault(type(child).__name__, (kind, []))[1]
                if index not in layers:  # two mixers of one class in a layer (Inkling)
                    layers.append(index)
                named = True
        if unknown_kind and not named:  # e.g. an indexer inside the attention: the layer itself
            found.setdefault(type(layer).__name__, (kind, []))[1].append(index)
    return found


def layers_without_attention(model: nn.Module) -> dict[str, list[int]]:
    """Decoder-layer class -> the indices of its layers that mix tokens (an attention layer
    type, or none given) yet hold no module :func:`is_routed_attention` recognises (an MLA
    class not named ``*Attention``): context parallelism would leave them unrouted."""
    kinds = list(getattr(model.config, "layer_types", None) or [])
    found: dict[str, list[int]] = {}
    for index, layer in enumerate(_layer_stack(model)):
        kind = kinds[index] if index < len(kinds) else None
        if kind in NON_MIXING_KINDS or (kind is not None and kind not in ATTENTION_KINDS):
            continue  # no token mixing, or a mixer unrouted_mixers names
        if next(layer.parameters(), None) is None:
            continue  # a stand-in for another pipeline stage's layer: it mixes nothing here
        if not any(is_routed_attention(m) for m in layer.modules()):
            found.setdefault(type(layer).__name__, []).append(index)
    return found


def layer_list(indices: list[int]) -> str:
    """``"layer 3"``, ``"layers 0, 2"``, ``"layers 0-27"`` (a run of three or more collapsed)."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs]
    return f"layer{'s' if len(indices) > 1 else ''} {', '.join(parts)}"


def mixer_problems(model: nn.Module) -> list[str]:
    """One sentence per token mixer of ``model`` that is not routed attention (see the module
    docstring), naming its class, its layers and its layer type."""
    name = type(model).__name__
    problems = []
    for cls, (kind, layers) in unrouted_mixers(model).items():
        where = layer_list(layers)
        how = f"layer type {kind!r}" if kind is not None else "a sequence convolution"
        problems.append(
            f"{name}: {where} {'mix' if len(layers) > 1 else 'mixes'} tokens in {cls} ({how}), "
            "not in attention through transformers' attention interface"
        )
    return problems


def packing_problems(module: nn.Module) -> list[str]:
    """Why packed rows (several conversations per row, positions restarting at 0) would not
    keep each conversation to itself in ``module``'s ``transformers`` model: token mixers that
    are not routed attention, or a twin whose packed logits differ from the conversations alone.
    ``[]`` for a model that is not a ``transformers`` one (nothing known to check)."""
    model = hf_model_of(module)
    if model is None:
        return []
    problems = mixer_problems(model)
    if problems:
        return problems
    leak = _packed_leak(model)
    if leak is not None:
        problems.append(
            f"{type(model).__name__}: in a packed row the second conversation's logits differ "
            f"from the same conversation alone by {leak:.1e} (its attention mask does not read the "
            "restarting position_ids, or a layer mixes tokens outside attention)"
        )
    return problems


def check_packing(module: nn.Module, option: str = "data.packing=true") -> None:
    """``ValueError`` naming ``option`` and every reason of :func:`packing_problems`."""
    problems = packing_problems(module)
    if problems:
        raise ValueError(
            f"{option} would let conversations of a packed row see each other: "
            + "; ".join(problems)
            + ". Set data.packing=false (one conversation per row, padded)"
        )


def _packed_leak(model: nn.Module) -> Optional[float]:
    """The largest logit difference between two conversations packed in one row and each
    alone, on the family's tiny twin; ``None`` when they agree or no twin can be built."""
    from lightning_3d.families.twin import tiny_twin

    with torch.device("cpu"):
        twin = tiny_twin(model)
    if twin is None:
        return None
    twin.eval()
    # The caller may hold a meta device context (a model checked as it is built on meta).
    with torch.device("cpu"):
        generator = torch.Generator().manual_seed(0)
        first = torch.randint(3, 250, (1, 5), generator=generator)
        second = torch.randint(3, 250, (1, 7), generator=generator)
        positions = torch.cat([torch.arange(5), torch.arange(7)])[None]  # (1, 12)
        try:
            with torch.no_grad():
                packed = _logits(twin, torch.cat([first, second], 1), positions)
                alone = [_logits(twin, ids, None) for ids in (first, second)]
        except Exception:  # noqa: BLE001 - a twin that cannot run here proves nothing either way
            return None
    leak = max(
        (packed[:, :5] - alone[0]).abs().max().item(),
        (packed[:, 5:] - alone[1]).abs().max().item(),
    )
    return leak if leak > PACKED_TOLERANCE else None


def _logits(model: nn.Module, ids: torch.Tensor, positions: Any) -> torch.Tensor:
    return model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
