"""The context-parallel attention a model's attention layers call: one object per model,
holding the context group and the scheme, attached to each attention module by
:func:`lightning_3d.parallel.context.apply.apply_context_parallel`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

from lightning_3d.parallel.context.chunks import local_positions
from lightning_3d.parallel.context.ring import ring_attention
from lightning_3d.parallel.context.ulysses import ulysses_attention

ATTR = "context_attention"  # the attribute an attention module holds a ContextAttention under


@dataclass(frozen=True, eq=False)
class ContextAttention:
    """Causal attention across the context ranks by ``scheme`` (``"ring"`` or ``"alltoall"``).

    Example::

        attend = ContextAttention(mesh["cp"].get_group(), "ring")
        y = attend(q, k, v)  # (B, H, T/cp, D) each: this rank's load-balanced tokens
    """

    group: Any
    scheme: str

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def rank(self) -> int:
        return self.group.rank()

    def positions(self, local_length: int, device: Any = None) -> Tensor:
        """Where this rank's ``local_length`` tokens sit in the whole sequence, (T/cp,)."""
        return local_positions(local_length * self.size, self.rank, self.size, device)

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        scale: Optional[float] = None,
        documents: Optional[Tensor] = None,
    ) -> Tensor:
        """``documents``: (B, T) document ids of the whole sequence, for packed rows (a query
        sees only its own document's earlier keys); ``None``: one document per row."""
        # Grouped-query k/v (fewer heads than q) go to the kernels as they are: both exchange
        # them unrepeated where they can.
        kernel = ring_attention if self.scheme == "ring" else ulysses_attention
        return kernel(q, k, v, self.group, scale, documents)
