"""ZeRO stages 0, 1 and 2 on the data-parallel axis, built on flat gradient buckets.

FSDP2 gives ZeRO-3 (see ``fsdp.py``) but not the replicated-parameter stages: with
``reshard_after_forward=False`` it still keeps a separate sharded copy of every parameter, so
stage 2 would cost 4Ψ + 16Ψ/N instead of the paper's 4Ψ + 12Ψ/N. Here every parameter of an
optimizer param group becomes a view into one flat, padded buffer per bucket; rank ``r`` owns
the ``r``-th equal slice of each bucket. The optimizer is rewritten in place to step only those
slices, each wrapped as a ``DTensor`` sharded on the data axis — so gradient clipping, DCP and
any elementwise optimizer (SGD, Adam, AdamW, ...) see one correctly-sharded tensor and compute
global norms by themselves.

    stage 0: grads all-reduced, every rank steps everything      16Ψ per rank
    stage 1: grads reduce-scattered into full-size buffers,     8Ψ + 8Ψ/N
             optimizer state for own slice only
    stage 2: each bucket's grads are reduce-scattered as soon   4Ψ + 12Ψ/N
             as backward has produced them, then dropped

A post-accumulate-grad hook adds each parameter's fresh gradient into its bucket and frees it;
a full bucket starts its reduction at once, overlapping with the rest of backward. After the
optimizer step, stages 1 and 2 all-gather the updated slices back into the flat parameter
buffers (in place, since the slice is a view of the buffer). Tensor-parallel parameters
(DTensors on ``tp``) contribute their local shards; buckets never mix tp-sharded with
tp-replicated parameters, so each slice can say which it is.

With a bf16 module (``precision="bf16-true"``) the buckets hold bf16 weights and gradients and
the optimizer steps fp32 masters of this rank's slice instead (stage 0: of the whole bucket),
cast back into the buckets before the all-gather: the paper's 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N
(``masters.py`` says when; :attr:`ZeroOptions.master_weights`). With an offload device the
masters and their fp32 gradients live in host memory (``master_device="cpu"``, ZeRO-Offload's
split): each bucket is reduced as soon as backward completes it, at every micro-batch, and this
rank's part is added into an fp32 host accumulator, so the device holds the bf16 weights and
the staging of at most :data:`HOST_IN_FLIGHT` + 1 buckets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_3d.compat import all_gather_single, reduce_scatter_single
from lightning_3d.parallel.masters import HostLanding
from lightning_3d.parallel.optimizers import quantization_block
from lightning_3d.parallel.point_to_point import (
    SCATTER_MODES,
    add_rows,
    gather_rows,
    scatter_rows,
    use_point_to_point,
)
from lightning_3d.parallel.tensor import local_tensor as _local
from lightning_3d.parallel.zero_state import ZeroState, like_param

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ZeroOptions:
    """The ZeRO 0-2 engine's options (the ``zero`` group of :class:`~lightning_3d.options.Plan`;
    ``zero_stage`` itself is part of the :class:`~lightning_3d.layout.Layout`)."""

    bucket_size_mb: float = 25.0
    """The largest gradient bucket, in MiB (option ``bucket_size_mb``)."""

    master_weights: bool = True
    """Whether ZeRO 0-2 keep fp32 master weights for parameters held in a lower precision
    (option ``zero_master_weights``). A module in bf16 (``precision="bf16-true"``: Lightning
    converts it) then has bf16 weights and gradients in the flat buckets, and each rank's optimizer
    steps an fp32 copy of only its slice (the ZeRO paper's mixed-precision Adam: 2 + 2 + 12 bytes
    a parameter, the 12 sharded from stage 1). False: the optimizer steps the bf16 slices
    themselves (bf16 moments, updates rounded to bf16 every step), as one process under
    ``bf16-true`` does. With an offload device the masters and their fp32 gradients live in host
    memory (ZeRO-Offload's split: 2 bytes a parameter on the device); False there: the offload
    store keeps the masters and the device the bf16 gradients. No effect on fp32 parameters
    (``bf16-mixed`` keeps fp32 weights and autocast) or under ZeRO-3 (FSDP2 shards what the
    module holds)."""

    reduce_dtype: str = "bf16"
    """``"bf16"`` or ``"fp32"``: the dtype of the gradient buffers of a bucket with fp32 masters,
    in which micro-batches are accumulated and ranks' gradients summed (option
    ``zero_reduce_dtype``). Default bf16, the paper's choice (it reduced in fp16) and DeepSpeed's
    (the model's dtype): it keeps the gradients at 2 bytes a parameter and sends half the bytes.
    ``"fp32"`` is Megatron-LM's default (``accumulate_allreduce_grads_in_fp32``): no bf16 rounding
    of the sum over ranks and micro-batches, for 2 more bytes a parameter of gradient buffer at
    stages 0-1 (2/N at stage 2, plus an fp32 staging buffer during backward) and twice the bytes
    on the wire."""

    defer_reduce: bool = False
    """ZeRO-2 with gradient accumulation: hold full-size gradients over the step's
    micro-batches, as stage 1 does, and reduce-scatter once after the last (option
    ``zero2_defer_reduce``). Default False, stage 2's memory: a reduce-scatter after every
    micro-batch, so k micro-batches send k times the bytes. True sends one step's bytes, for the
    gradient buffer's full size held during accumulation (2Ψ in bf16, 4Ψ in fp32)."""

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_size_mb * 2**20))

    @property
    def grad_dtype(self) -> Optional[torch.dtype]:
        """The gradient buffers' dtype for buckets with fp32 masters (``reduce_dtype``; None:
        the parameters' own)."""
        return REDUCE_DTYPES[self.reduce_dtype]

    def problems(self) -> list[str]:
        """What is wrong with these values, in the option names users give (empty: nothing)."""
        problems = []
        size = self.bucket_size_mb
        if not (isinstance(size, (int, float)) and not isinstance(size, bool) and size > 0):
            problems.append(f"bucket_size_mb must be positive, got {size!r}")
        if not isinstance(self.master_weights, bool):
            problems.append(
                f"zero_master_weights must be True or False, got {self.master_weights!r}"
            )
        if not isinstance(self.defer_reduce, bool):
            problems.append(f"zero2_defer_reduce must be True or False, got {self.defer_reduce!r}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            problems.append(
                f"zero_reduce_dtype must be one of {sorted(REDUCE_DTYPES)}, got {self.reduce_dtype!r}"
            )
        return problems


# "bf16": the gradients keep the parameters' own low precision (fp16 under "16-true").
REDUCE_DTYPES: dict[str, Optional[torch.dtype]] = {"bf16": None, "fp32": torch.float32}


MIN_BUCKETS = 4  # a param group smaller than this many full buckets is cut into this many
MIN_BUCKET_BYTES = 2**20  # ... but none under 1 MiB (DDP's first bucket): latency would dominate
# Host masters: buckets whose reduction may still run while the next one is launched; older ones
# land in host memory then, so their device staging is freed during backward.
HOST_IN_FLIGHT = 1


@dataclass(eq=False)
class _Bucket:
    """A contiguous run of same-dtype parameters from one optimizer param group."""

    params: list[nn.Parameter]
    offsets: list[int]
    flat: Tensor  # (padded,) every parameter of the bucket, replicated; params are views of it
    shard_numel: int  # padded / data-parallel size
    grad: Optional[Tensor] = None  # (padded,) stages 0-1: reduced (or accumulating) gradients
    shard_grad: Optional[Tensor] = None  # (padded / N,) stage 2: this rank's reduced grads
    shard_fresh: bool = True  # stage 2: shard_grad holds nothing of this step yet (overwrite it)
    staging: Optional[Tensor] = None  # (padded,) stage 2: grads of one backward, then freed
    slice: Optional[nn.Parameter] = None  # stages 1-2: DTensor view of this rank's slice
    # With fp32 masters (``master_dtype``): this rank's slice in fp32 (stage 0: the whole
    # bucket), a tensor of its own that ``slice`` wraps and the optimizer steps; cast into
    # ``flat`` after each step.
    master: Optional[Tensor] = None
    ready: int = 0  # parameters whose gradient this backward has produced
    work: Optional[dist.Work] = None
    reduced: Optional[Tensor] = None  # reduce-scatter output, waiting for ``work``
    received: Optional[Tensor] = None  # gloo: the other ranks' parts of this rank's slice
    # Stages 0-1: for each plain (non-DTensor) parameter, its gradient's place in ``grad``, made
    # once: no slice or view per parameter and step.
    views: list[Optional[Tensor]] = field(default_factory=list)
    # Which parameters' gradients this step has put into the buffer. The first one of a step is
    # copied in (as DDP does), later ones added: the buffer is never zeroed as a whole, only
    # the places of parameters that got no gradient, before it is reduced.
    written: list[bool] = field(default_factory=list)
    # Whether the bucket takes part in the backward under way: its optimizer's parameters
    # require gradients (``toggle_optimizer`` turns them off; at stages 1-2 it sees only the
    # slices). A bucket that does not keeps its gradients as they are and drops autograd's.
    live: bool = True
    # Whether the bucket holds the reduced gradient of a backward since the optimizer's last step
    # (manual optimization: several backwards per step, or other optimizers' backwards between).
    held: bool = False
    # Stage 1: this rank's reduced slice of earlier backwards, added after the next reduction.
    carry: Optional[Tensor] = None
    # Host masters: this backward's reduced part is in the host accumulator (``shard_grad``).
    landed: bool = False


class ZeroDataParallel(ZeroState):
    """Gradient synchronisation and optimizer sharding for ZeRO stages 0–2.

    Example::

        engine = ZeroDataParallel(mesh["dp"], stage=2)
        engine.attach(optimizer)          # after the optimizer exists, before the first step
        for batch in loader:
            engine.prepare_backward(sync=True)
            loss(batch).backward()
            engine.finish_backward()
            optimizer.step()
            engine.after_step()
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        stage: int,
        bucket_numel: Optional[int] = None,
        scatter: str = "auto",
        master_dtype: Optional[torch.dtype] = None,
        grad_dtype: Optional[torch.dtype] = None,
        defer_reduce: bool = False,
        master_device: Optional[str] = None,
        divide: Optional[int] = None,
    ) -> None:
        """``mesh`` is the data axis, or the (data, tensor) mesh when parameters are tensor-parallel.

        ``bucket_numel``: the most elements a gradient bucket holds (a param group smaller than
        four such buckets is cut into four, :meth:`_bucket_limit`); default: the plan's default
        ``bucket_size_mb`` of fp32 elements (the strategy passes its own size for the
        optimizer's element size).

        ``scatter`` is how stages 1–2 reduce-scatter gradients and all-gather the stepped
        slices: ``"reduce_scatter"`` (the two collectives, what NCCL runs), ``"point_to_point"``
        (each rank sends row ``j`` of a bucket to rank ``j`` and adds the rows it receives to its
        own; the stepped slices go to every peer and land in place: the same bytes as the
        collectives' ring algorithms) or ``"auto"``: point to point on gloo, where it is faster,
        the collectives elsewhere. ``"reduce_scatter"`` on gloo runs the NCCL path on CPUs, e.g.
        in tests.

        ``master_dtype`` (e.g. ``torch.float32``): buckets of parameters in a lower precision
        (bf16, fp16) get master copies in it, which the optimizer steps instead (see
        :attr:`ZeroOptions.master_weights`); ``grad_dtype``: those buckets' gradient buffers'
        dtype (None: the parameters', see :attr:`ZeroOptions.reduce_dtype`).

        ``defer_reduce`` (stage 2): a backward with ``sync=False`` keeps its full-size gradients
        for the next one to add to, and only the step's last backward reduce-scatters them
        (see :attr:`ZeroOptions.defer_reduce`).

        ``master_device="cpu"`` (with ``master_dtype``): the masters and their gradients in host
        memory, for an offloaded optimizer to step in place (ZeRO-Offload). Every backward
        reduces (micro-batches accumulate on the host, in the masters' dtype), and a bucket's
        device staging is freed once its part has landed, during backward: the device keeps the
        low-precision weights and at most ``HOST_IN_FLIGHT + 1`` buckets of gradient.

        ``divide``: what the summed gradients are divided by (default: the ranks summed over, a
        mean). Expert weights are summed over the ranks holding the same experts and divided by
        the whole data size (``parallel/expert_zero.py``).
        """
        if scatter not in SCATTER_MODES:
            raise ValueError(f"scatter must be one of {list(SCATTER_MODES)}, got {scatter!r}")
        if stage not in (0, 1, 2):
            raise ValueError(f"ZeroDataParallel handles zero_stage 0, 1 and 2, got {stage}")
        if bucket_numel is None:
            bucket_numel = ZeroOptions().bucket_bytes // 4
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"expected a 1-D (dp) or 2-D (dp, tp) mesh, got {mesh.ndim} dimensions"
            )
        self.mesh = mesh
        self.stage = stage
        self.bucket_numel = bucket_numel
        self.master_dtype = master_dtype
        self.grad_dtype = grad_dtype
        self.defer_reduce = defer_reduce
        if master_device is not None and master_dtype is None:
            raise ValueError(f"master_device={master_device!r} needs a master_dtype")
        # Kept as given ("cpu"): where host buffers are made, not a device of the mesh.
        self.master_device = master_device
        self._in_flight: list[_Bucket] = []  # host masters: launched, not landed yet
        self._landing: Optional[HostLanding] = None  # host masters: parts on their way
        self.staging_peak_bytes = 0  # host masters: the most device staging held at once
        dp_mesh = mesh[mesh.mesh_dim_names[0]] if mesh.ndim == 2 else mesh
        self.group = dp_mesh.get_group()
        self.size = dp_mesh.size()
        self.rank = dp_mesh.get_local_rank()
        self.divide = self.size if divide is None else divide
        # The same optimizer's expert weights, bucketed over their replica group by a second
        # engine (parallel/expert_zero.py): stepped with this one, so its after_step follows.
        self.experts: Optional[ZeroDataParallel] = None
        self._point_to_point = use_point_to_point(self.group, scatter)  # see point_to_point.py
        self.buckets: list[_Bucket] = []
        self.original_groups: list[list[nn.Parameter]] = []  # each param group as the user built it
        self._hooks: list = []
        self._sync = True
        self._early = True
        self.tied: dict[int, dist.ProcessGroup] = {}  # see attach()
        self.align = 1  # elements: where parameters start in a bucket (see attach())

    @property
    def passthrough(self) -> bool:
        """Whether there is nothing to do: stage 0 on a mesh of one rank (no data or tensor
        peers) with no tied copies on other stages. Autograd's own gradients are then exactly
        the reduced ones, so the engine makes no buckets, hooks, copies or collectives (on a GPU
        those cost a gradient copy, a bucket zeroing and a collective per step over a plain
        loop), and every per-step call below is a no-op over zero buckets."""
        # fp32 masters for low-precision parameters need the buckets even on one rank.
        return self.stage == 0 and self.mesh.size() == 1 and not self.tied and not self.master_dtype

    @property
    def state_in_slices(self) -> bool:
        """Whether the optimizer steps the engine's slices (stages 1-2, or fp32 masters at any
        stage) rather than the model's parameters: its state is keyed by them."""
        return self.stage >= 1 or any(b.slice is not None for b in self.buckets)

    @property
    def landing_bytes(self) -> int:
        """Host bytes of the split's landing buffers (:class:`HostLanding`, made at the first
        landing; 0 before it or without host masters), which the planner counts as host memory."""
        return self._landing.nbytes if self._landing is not None else 0

    @property
    def state_dtype(self) -> Optional[torch.dtype]:
        """The optimizer state's dtype where it is not the parameters' (fp32 masters), else None."""
        return self.master_dtype if any(b.master is not None for b in self.buckets) else None

    # ---------------------------------------------------------------- setup
    def attach(self, optimizer: torch.optim.Optimizer, tied: Optional[dict] = None) -> None:
        """Flatten the optimizer's parameters into buckets and (stages 1–2) shard its groups.

        ``tied``: ``{id(parameter): process group}`` for copies of a tied weight held on several
        pipeline stages (``parallel/tied.py``). Each gets a bucket of its own, whose gradient is
        summed over that group before the data-parallel reduction."""
        self.tied.update(tied or {})
        if optimizer.state:
            raise ValueError(
                "attach the ZeRO engine before the optimizer's first step (its state is not empty)"
            )
        owned = {id(p) for b in self.buckets for p in b.params}
        # A low-bit optimizer quantizes a slice in blocks of its flattened elements: each
        # parameter starts, and each slice ends, on a block boundary, so that no block mixes two
        # parameters or two ranks (parallel/optimizers.py). 1 for every other optimizer.
        self.align = quantization_block(optimizer)
        for group in optimizer.param_groups:
            self.original_groups.append(list(group["params"]))
            if self.passthrough:
                continue
            params = [p for p in group["params"] if p.requires_grad]
            if any(id(p) in owned for p in params):
                raise ValueError("a parameter appears in more than one optimizer param group")
            # Reverse registration order approximates the order backward produces gradients,
            # so the first buckets fill (and can be reduced) while backward is still running.
            limit = self._bucket_limit(params)
            buckets = [self._make_bucket(chunk) for chunk in self._chunks(params[::-1], limit)]
            self.buckets.extend(buckets)
            if any(b.slice is not None for b in buckets):
                group["params"] = [
                    q for b in buckets for q in (b.params if b.slice is None else [b.slice])
                ]

    def _bucket_limit(self, params: list[nn.Parameter]) -> int:
        """Elements per bucket of one param group: ``bucket_numel``, or where the group holds
        fewer than :data:`MIN_BUCKETS` of those, a :data:`MIN_BUCKETS`-th of the group (not under
        :data:`MIN_BUCKET_BYTES`). The bucket backward fills last is reduced with no backward
        left to overlap, so its size is what a step waits for: one 25 MB bucket holding a 13 MB
        model waited for the whole reduction (16 ms of each ~460 ms step on two gloo ranks),
        four of a quarter wait for one quarter."""
        if not params:
            return self.bucket_numel
        total = sum(_local(p).numel() for p in params)
        floor = MIN_BUCKET_BYTES // _local(params[0]).element_size()
        return min(self.bucket_numel, max(floor, -(-total // MIN_BUCKETS)))

    def _chunks(self, params: list[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
        chunks: list[list[nn.Parameter]] = []
        numel = 0
        for p in params:
            same_kind = chunks and _kind(chunks[-1][0]) == _kind(p)
            solo = id(p) in self.tied or (chunks and id(chunks[-1][0]) in self.tied)
            if solo or not same_kind or numel + _local(p).numel() > limit:
                chunks.append([])
                numel = 0
            chunks[-1].append(p)
            numel += _local(p).numel()
        return chunks

    def _make_bucket(self, params: list[nn.Parameter]) -> _Bucket:
        # Tensor-parallel parameters contribute their local shard: the bucket is per tp rank.
        locals_ = [_local(p) for p in params]
        offsets, offset, align = [], 0, self.align
        for t in locals_:
            offsets.append(offset)
            offset += -(-t.numel() // align) * align  # the next block boundary (gaps stay zero)
        # Ceil to a multiple of N whole blocks: equal slices.
        padded = -(-offset // (self.size * align)) * self.size * align
        flat = torch.zeros(padded, dtype=locals_[0].dtype, device=locals_[0].device)
        for t, offset in zip(locals_, offsets):
            flat[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
            t.data = flat[offset : offset + t.numel()].view_as(t)
        # Identical start on every rank, whatever the seeding: data-parallel rank 0 wins.
        dist.broadcast(flat, src=dist.get_global_rank(self.group, 0), group=self.group)
        bucket = _Bucket(params=params, offsets=offsets, flat=flat, shard_numel=padded // self.size)
        bucket.written = [False] * len(params)
        master = self.master_dtype is not None and flat.element_size() < self.master_dtype.itemsize
        grad_dtype = (self.grad_dtype if master else None) or flat.dtype
        part_numel = self._part(flat, bucket).numel()
        if master and self.master_device is not None:  # the step's gradient, summed on the host
            bucket.shard_grad = torch.zeros(
                part_numel, dtype=self.master_dtype, device=self.master_device
            )
        elif self.stage <= 1:
            bucket.grad = torch.zeros_like(flat, dtype=grad_dtype)
            bucket.views = [
                None
                if isinstance(p, DTensor)
                else bucket.grad[offset : offset + p.numel()].view_as(p)
                for p, offset in zip(params, offsets)
            ]
        else:
            bucket.shard_grad = torch.zeros(
                bucket.shard_numel, dtype=grad_dtype, device=flat.device
            )
        if master:  # the optimizer steps an fp32 copy of this rank's part, not the flat buffer
            # Host masters are not pinned: CUDA's host allocator would round each bucket's up
            # to a power of two.
            bucket.master = self._part(flat, bucket).to(
                device=self.master_device or flat.device, dtype=self.master_dtype, copy=True
            )
            bucket.slice = nn.Parameter(self._as_slice(bucket.master, bucket))
        elif self.stage >= 1:
            bucket.slice = nn.Parameter(self.slice_dtensor(self._own(flat, bucket), params[0]))
        for index, p in enumerate(params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(bucket, index)))
        return bucket

    def _hosted(self, bucket: _Bucket) -> bool:
        """Whether the bucket's master and its gradient live in host memory (``master_device``)."""
        return self.master_device is not None and bucket.master is not None

    def _own(self, full: Tensor, bucket: _Bucket) -> Tensor:
        return full[self.rank * bucket.shard_numel : (self.rank + 1) * bucket.shard_numel]

    def _part(self, full: Tensor, bucket: _Bucket) -> Tensor:
        """What of a full-size buffer the optimizer steps here: the rank's slice (stages 1-2),
        or all of it (stage 0, whose masters are whole)."""
        return full if self.stage == 0 else self._own(full, bucket)

    def _as_slice(self, local: Tensor, bucket: _Bucket) -> DTensor:
        """``local`` (a slice's part, or a stage-0 master's whole) as the optimizer's DTensor."""
        return self.slice_dtensor(local, bucket.params[0], sharded=self.stage >= 1)

    def slice_dtensor(self, local: Tensor, like: nn.Parameter, sharded: bool = True) -> DTensor:
        """This rank's slice as a DTensor: sharded over dp (replicated: a stage-0 master, which
        every rank holds whole); over tp sharded or replicated like the bucket's parameters, so
        global norms count every element exactly once."""
        placements = [Shard(0) if sharded else Replicate()]
        if self.mesh.ndim == 2:
            placements.append(Shard(0) if _kind(like)[2] else Replicate())
        return DTensor.from_local(local, self.mesh, placements, run_check=False)

    def detach(self) -> None:
        """Remove the gradient hooks (parameters stay views of the flat buffers)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # ---------------------------------------------------------------- backward
    def prepare_backward(self, sync: bool, early: bool = True) -> None:
        """Call before each backward. ``sync=False`` accumulates locally (stages 0–1 only).

        ``early=False`` when one "backward" is several (a pipeline schedule's micro-batches):
        each parameter's hook then fires once per micro-batch, so a full bucket is not final
        and every reduction waits for :meth:`finish_backward`.

        As autograd does with ``p.grad``, a backward adds to the gradients the optimizer holds
        (several backwards before a step), unless its ``zero_grad()`` cleared them. Only
        buckets whose optimizer parameters require gradients take part (:meth:`_takes_part`):
        another optimizer's backward under ``toggle_optimizer`` leaves them as they are. That
        is decided by flags every rank sets alike, so every rank runs the same collectives.
        """
        # Stage 2 keeps no full-size gradient, so it must reduce on every backward, unless told
        # to hold one over the step's micro-batches (``defer_reduce``).
        # Host masters reduce every backward too: micro-batches add up on the host, in fp32.
        self._sync = sync or (self.stage == 2 and not self.defer_reduce)
        self._sync = self._sync or self.master_device is not None
        self._early = early
        self._in_flight = []
        for bucket in self.buckets:
            bucket.live = self._takes_part(bucket)
            if not bucket.live:
                continue
            bucket.ready = 0
            bucket.landed = False
            if bucket.held:
                self._resume(bucket)
            for p in bucket.params:
                p.grad = None  # the hook copies (or adds) autograd's fresh gradient into our buffer

    def _takes_part(self, bucket: _Bucket) -> bool:
        """Whether ``bucket`` takes part in the coming backward: some of its parameters require
        gradients and (stages 1–2) so does the slice its optimizer steps, which is what
        Lightning's ``toggle_optimizer`` freezes there. A tied copy's bucket always does (the
        pipeline ranks holding the tie sum it together)."""
        if id(bucket.params[0]) in self.tied:
            return True
        if bucket.slice is not None and not bucket.slice.requires_grad:
            return False
        return any(p.requires_grad for p in bucket.params)

    def _resume(self, bucket: _Bucket) -> None:
        """The bucket holds the reduced gradient of an earlier backward (no step since): keep
        what its optimizer's gradient still holds for the coming backward to add to, or start
        afresh where ``zero_grad()`` cleared it (``set_to_none=False`` zeroed it in place: kept,
        zeros)."""
        bucket.held = False
        if self.stage == 0 and not self._hosted(bucket):
            # The whole buffer holds the mean; this backward adds its local gradients and the
            # next reduction's mean gives mean + new mean, as DDP computes it.
            for index, p in enumerate(bucket.params):
                holder = p if bucket.slice is None else bucket.slice
                if holder.grad is None:  # cleared: the next gradient is copied in
                    bucket.written[index] = False
            return
        cleared = bucket.slice.grad is None
        if self.stage == 1 and not self._hosted(bucket):
            # Only this rank's slice is reduced; the rest of the buffer holds this rank's own
            # share of the other slices, which their ranks have already added up: reducing it
            # again would count it twice. Set the slice aside and start the buffer afresh.
            if not cleared:
                bucket.carry = self._own(bucket.grad, bucket).clone()
            bucket.written = [False] * len(bucket.params)
        else:  # stage 2: the next reduction adds to the gradient shard, or overwrites it
            bucket.shard_fresh = cleared

    def _grad_hook(self, bucket: _Bucket, index: int):
        def hook(p: nn.Parameter) -> None:
            if not bucket.live:  # its optimizer's slices are toggled off: no gradient for them
                p.grad = None
                return
            self._consume(bucket, index, p)
            bucket.ready += 1
            if bucket.ready == len(bucket.params) and self._sync and self._early:
                self._launch(bucket)

        return hook

    def _consume(self, bucket: _Bucket, index: int, p: nn.Parameter) -> None:
        """Copy (first of the step) or add ``p.grad`` into the bucket, and free it."""
        grad = p.grad
        if isinstance(grad, DTensor):  # e.g. a partial sum under sequence parallelism
            grad = grad.redistribute(p.device_mesh, p.placements).to_local()
        view = bucket.views[index] if bucket.views else None
        if view is None:
            offset = bucket.offsets[index]
            view = self._target(bucket)[offset : offset + grad.numel()].view_as(grad)
        if bucket.written[index]:
            view.add_(grad)
        else:
            view.copy_(grad)
            bucket.written[index] = True
        p.grad = None  # the bucket holds it now; free autograd's copy

    def _target(self, bucket: _Bucket) -> Tensor:
        """The full-size buffer this backward's gradients go to (stage 2: made per backward,
        uninitialised but for its padding, which is never written)."""
        hosted = self._hosted(bucket)
        if self.stage <= 1 and not hosted:
            return bucket.grad
        if bucket.staging is None:
            dtype = (self.grad_dtype or bucket.flat.dtype) if hosted else bucket.shard_grad.dtype
            bucket.staging = torch.empty_like(bucket.flat, dtype=dtype)
            if hosted:
                held = sum(b.staging.nbytes for b in self.buckets if b.staging is not None)
                self.staging_peak_bytes = max(self.staging_peak_bytes, held)
            end = bucket.offsets[-1] + _local(bucket.params[-1]).numel()
            bucket.staging[end:].zero_()
            if self.align > 1:  # the gaps between block-aligned parameters too
                bucket.staging.zero_()
        return bucket.staging

    def _fill_unwritten(self, bucket: _Bucket) -> Tensor:
        """The bucket's buffer, with zeros where no gradient was put this step; from now on the
        whole buffer counts as written."""
        target = self._target(bucket)
        for index, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
            if not bucket.written[index]:
                target[offset : offset + _local(p).numel()].zero_()
                bucket.written[index] = True
        return target

    def _launch(self, bucket: _Bucket) -> None:
        # Collectives must start in the same order on every rank; buckets fill in backward order,
        # which is the same on every rank for the same model, so this holds without a barrier.
        full = self._fill_unwritten(bucket)  # e.g. a stage 2 bucket given no gradient at all
        full.div_(self.divide)  # SUM then mean: gloo has no AVG
        if self.stage == 0:
            bucket.work = dist.all_reduce(full, group=self.group, async_op=True)
        else:
            if self._point_to_point:  # row j to rank j; the others' rows of mine in
                bucket.work, bucket.received = scatter_rows(self.group, full.view(self.size, -1))
            else:
                bucket.reduced = torch.empty(
                    bucket.shard_numel, dtype=full.dtype, device=full.device
                )
                bucket.work = reduce_scatter_single(
                    bucket.reduced, full, group=self.group, async_op=True
                )
        if self._hosted(bucket):  # land the older ones: their staging is freed during backward
            self._in_flight.append(bucket)
            while len(self._in_flight) > HOST_IN_FLIGHT:
                self._land(self._in_flight[0])

    def _land(self, bucket: _Bucket) -> None:
        """Host masters: wait for the bucket's reduction, add this rank's part to the host
        accumulator (in the masters' dtype: micro-batches lose nothing to bf16 sums) and free
        the device staging."""
        bucket.work.wait()
        bucket.work = None
        if bucket in self._in_flight:
            self._in_flight.remove(bucket)
        if bucket.received is not None:  # gloo's exchange: the peers' parts of my slice
            reduced = add_rows(self._own(bucket.staging, bucket), bucket.received)
            bucket.received = None
        else:
            reduced = bucket.staging if self.stage == 0 else bucket.reduced
        self._host_landing(reduced).send(reduced, bucket.shard_grad, bucket.shard_fresh)
        bucket.shard_fresh = False
        bucket.staging = bucket.reduced = None
        bucket.written = [False] * len(bucket.params)  # the next backward's staging is new
        bucket.landed = True

    def _host_landing(self, reduced: Tensor) -> HostLanding:
        """The buffers that carry reduced parts to the host (made at the first landing, sized
        for the largest part of a hosted bucket)."""
        if self._landing is None:
            numel = max(b.shard_grad.numel() for b in self.buckets if self._hosted(b))
            slots = HOST_IN_FLIGHT + 1
            self._landing = HostLanding(numel, reduced.dtype, reduced.device, slots)
        return self._landing

    def finish_backward(self) -> None:
        """Call after each backward: completes the reductions of a synchronising backward."""
        for bucket in self.buckets:
            if bucket.live and bucket.work is None:
                # Gradients assigned without autograd's accumulation (zero-bubble pipeline
                # schedules compute weight gradients separately) never fired the hook.
                for index, p in enumerate(bucket.params):
                    if p.grad is not None:
                        self._consume(bucket, index, p)
        if not self._sync:
            return
        self._sum_tied()
        live = [bucket for bucket in self.buckets if bucket.live]
        for bucket in live:  # buckets with unused parameters never fired their hook
            if bucket.work is None and not bucket.landed:
                self._launch(bucket)
        for bucket in live:  # the last parts sent to the host, in order
            if self._hosted(bucket) and not bucket.landed:
                self._land(bucket)
        if self._landing is not None:
            self._landing.finish()
        for bucket in live:
            if self._hosted(bucket):  # the step's gradient is the host accumulator
                bucket.held = True
                for p in bucket.params:
                    p.grad = None
                bucket.slice.grad = self._as_slice(bucket.shard_grad, bucket)
                continue
            bucket.work.wait()
            bucket.work = None
            if bucket.received is not None:  # the other ranks' parts of my slice: add them
                own = self._own(self._target(bucket), bucket)  # my own part, still in place
                # Straight into this rank's slice of the buffer (stage 1), or into the first
                # reduction of a step's gradient shard (stage 2): no new tensor, no copy.
                if self.stage == 2 and bucket.shard_fresh:
                    add_rows(own, bucket.received, out=bucket.shard_grad)
                else:
                    add_rows(own, bucket.received)
                    bucket.reduced = own if self.stage == 2 else None
                bucket.received = None
            if self.stage == 1:
                if bucket.reduced is not None:
                    self._own(bucket.grad, bucket).copy_(bucket.reduced)
                if bucket.carry is not None:  # what earlier backwards of the step reduced
                    self._own(bucket.grad, bucket).add_(bucket.carry)
                    bucket.carry = None
            elif self.stage == 2:
                if bucket.reduced is not None and bucket.shard_fresh:
                    bucket.shard_grad.copy_(bucket.reduced)
                elif bucket.reduced is not None:
                    bucket.shard_grad.add_(bucket.reduced)
                bucket.shard_fresh = False
                bucket.staging = None
                bucket.written = [False] * len(bucket.params)  # the next backward's buffer is new
            bucket.reduced = None
            bucket.held = True
            if bucket.slice is None:  # the optimizer steps the parameters: give them the grads
                for i, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
                    view = bucket.views[i]
                    p.grad = (
                        view
                        if view is not None
                        else like_param(p, bucket.grad[offset : offset + _local(p).numel()])
                    )
            else:
                for p in bucket.params:  # the optimizer steps the slice, which holds them
                    p.grad = None
                own = self._part(bucket.grad, bucket) if self.stage <= 1 else bucket.shard_grad
                # A master's gradient is in its dtype: a copy when the buffers are bf16 (made
                # per step and dropped after it, as DeepSpeed's fp32 gradient partition).
                dtype = bucket.slice.dtype
                bucket.slice.grad = self._as_slice(own.to(dtype), bucket)

    def _sum_tied(self) -> None:
        """Add up a tied weight's gradient over the pipeline ranks holding a copy (its bucket
        holds it alone). Before any data-parallel reduction of this backward, so that collectives
        on different groups cannot wait on each other; sums commute with the later mean."""
        for bucket in self.buckets:
            group = self.tied.get(id(bucket.params[0]))
            if group is None:
                continue
            # No gradient here this backward: still take part, with zeros.
            dist.all_reduce(self._fill_unwritten(bucket), group=group)

    def slice_of(self, p: nn.Parameter) -> Optional[nn.Parameter]:
        """The optimizer's parameter (stages 1–2: the DTensor slice) whose gradient holds ``p``'s."""
        bucket = next((b for b in self.buckets if any(q is p for q in b.params)), None)
        if bucket is None:
            return None
        return bucket.slice if bucket.slice is not None else p

    # ---------------------------------------------------------------- step
    def after_step(self) -> None:
        """Call after ``optimizer.step()``: re-replicate parameters, clear gradients."""
        # Passthrough: autograd's gradients are the engine's, cleared here as the buckets' are.
        if self.passthrough:
            for group in self.original_groups:
                for p in group:
                    p.grad = None
        for bucket in self.buckets:
            if bucket.master is not None:  # the stepped fp32 slice, rounded into the bf16 buffer
                self._part(bucket.flat, bucket).copy_(bucket.master)
        if self.stage >= 1:
            for work in self._gather_slices():
                work.wait()
        for bucket in self.buckets:
            # The next step copies its first gradients over this step's: no zeroing pass.
            bucket.written = [False] * len(bucket.params)
            bucket.held, bucket.carry = False, None
            bucket.shard_fresh = True  # overwritten by the next step's first reduction
            if bucket.slice is not None:
                bucket.slice.grad = None
            for p in bucket.params:
                p.grad = None
        if self.experts is not None:
            self.experts.after_step()

    def _gather_slices(self) -> list:
        """Start the all-gather of every bucket's stepped slices into its flat buffer (in place):
        the collective, or on gloo (``_point_to_point``) each rank's slice sent to
        every peer and theirs received straight into their places, the same bytes a ring
        all-gather sends, all in one batch (every rank posts them in the same order)."""
        if not self._point_to_point:
            return [
                all_gather_single(b.flat, self._own(b.flat, b), group=self.group, async_op=True)
                for b in self.buckets
            ]
        return [gather_rows(self.group, b.flat.view(self.size, -1)) for b in self.buckets]


def _kind(p: Tensor) -> tuple:
    """Parameters that can share a bucket: same dtype, device, and tensor-parallel sharding."""
    sharded = isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
    return (p.dtype, _local(p).device, sharded)
