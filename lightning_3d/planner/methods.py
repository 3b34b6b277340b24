"""What a fine-tune method trains and keeps: a full fine-tune, LoRA or QLoRA
(:mod:`lightning_3d.adapters`), read from the shapes the planner already has.

The adapters go on every linear projection of the blocks (peft's ``all-linear``; not the
embedding, not the head): a weight of ``out × in`` gains ``A`` (``r × in``) and ``B``
(``out × r``), ``Φ = r·(in + out)`` trained parameters. A projection is a block parameter of two
dims, told apart in :attr:`Part.tensors <lightning_3d.planner.facts.Part.tensors>` by holding more
elements than rows (norms and biases hold one per row). Under tensor parallelism the adapters split
as the project splits them (:mod:`lightning_3d.adapters.tensor`): beside a column-parallel base
``A`` is replicated and ``B`` split by rows; beside a row-parallel base ``A`` is split by columns
and ``B`` replicated. As :class:`Part` s, ZeRO-3's dim-0 chunks of them follow with no new code.

Model state per rank (:func:`lightning_3d.planner.memory.model_state`):

- ``none``: every parameter trains (the planner's full model: 16 bytes a parameter under mixed
  precision);
- ``lora``: the frozen base at the parameters' own dtype (no gradient, no optimizer state; its
  ZeRO-3 shards cut like any parameter's) + the adapters at the precision's training bytes
  (``4 + 4 + 8 = 16`` a parameter under mixed precision);
- ``qlora``: as LoRA, with the projections' weights in NF4
  (:data:`~lightning_3d.adapters.qlora.NF4_BYTES_PER_VALUE`, 0.516 bytes a value); embeddings,
  norms, biases and the head at their dtype.

Activations: what the block's meter measures for the full model, plus each adapter's ``r``-wide
output ``A x``, which ``B``'s backward keeps (:func:`adapter_activation_bytes`). The input ``x``
is not extra: the frozen base no longer keeps it for a weight gradient, ``A`` keeps the same tensor.
"""

from __future__ import annotations

from typing import Optional

from lightning_3d.adapters.qlora import MULTIPLE, NF4_BYTES_PER_VALUE
from lightning_3d.planner.facts import Part


def projections(part: Part) -> Part:
    """The linear projection weights of ``part`` (its parameters of two dims) as a part."""
    shapes = tuple(((rows, n, dim), count) for (rows, n, dim), count in part.tensors if n > rows)
    total = sum(n * count for (_, n, _), count in shapes)
    split = sum(n * count for (_, n, dim), count in shapes if dim >= 0)
    return Part(total, split, total, shapes)


def adapter_part(blocks: Part, r: int) -> Part:
    """LoRA's ``A`` and ``B`` on every projection of ``blocks`` (split as the base; see above)."""
    if blocks.params and not blocks.tensors:
        raise ValueError(
            "the model's parts carry no parameter shapes (Part.tensors), so its adapters cannot be counted"
        )
    shapes: dict[tuple[int, int, int], int] = {}
    for (rows, n, dim), count in projections(blocks).tensors:
        out, inp = rows, n // rows
        a_dim = 1 if dim == 1 else -1  # row-parallel base: A split by input columns
        b_dim = 0 if dim == 0 else -1  # column-parallel base: B split by output rows
        for shape in ((r, r * inp, a_dim), (out, out * r, b_dim)):
            shapes[shape] = shapes.get(shape, 0) + count
    tensors = tuple(sorted(shapes.items()))
    total = sum(n * count for (_, n, _), count in tensors)
    split = sum(n * count for (_, n, dim), count in tensors if dim >= 0)
    return Part(total, split, total, tensors)


def trained_part(method: str, part: Part, blocks: Part, r: int) -> Part:
    """What trains on a rank holding ``part`` (of which ``blocks`` are its blocks' parameters)."""
    return part if method == "none" else adapter_part(blocks, r)


def frozen_bytes(method: str, base: float, base_projections: float, param_bytes: int) -> float:
    """Bytes of the frozen base of which a rank holds ``base`` elements, ``base_projections`` of
    them projection weights (NF4 under QLoRA); 0 for a full fine-tune (all of it trains)."""
    if method == "none":
        return 0.0
    if method == "lora":
        return base * param_bytes
    return base_projections * NF4_BYTES_PER_VALUE + (base - base_projections) * param_bytes


def adapter_activation_bytes(method: str, block: Part, r: int, seq_len: int, act: int) -> float:
    """Bytes per sample one block keeps beyond the full model's: ``A x`` (``seq × r``) of each
    adapted projection, whole on every tensor rank (beside a column-parallel base ``A`` is
    replicated; beside a row-parallel one its output is all-reduced)."""
    if method == "none":
        return 0.0
    count = sum(c for (rows, n, _), c in block.tensors if n > rows)
    return float(seq_len * r * count * act)


def qlora_problem(block: Part) -> Optional[str]:
    """Why QLoRA cannot hold this model's projections, as :func:`lightning_3d.adapters.qlora.quantize_base`
    refuses them (torchao keeps NF4 weights of a multiple of ``MULTIPLE`` elements), or ``None``."""
    bad = [
        f"({rows}, {n // rows})" for (rows, n, _), _ in projections(block).tensors if n % MULTIPLE
    ]
    if not bad:
        return None
    return (
        f"adapter method='qlora' stores nn.Linear weights of a multiple of {MULTIPLE} elements in "
        f"NF4; this model's blocks hold projections of shape {', '.join(bad)}"
    )
