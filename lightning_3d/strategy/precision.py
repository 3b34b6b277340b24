"""Lightning's precision plugin, made to clip and skip steps for the whole distributed model.

Under data x tensor x pipeline parallelism with ZeRO every rank holds different gradients (a
ZeRO slice, a tensor shard, a pipeline stage), so two things Lightning does per rank must see
every rank:

* ``gradient_clip_val`` clips by the norm over all gradients of the model: Lightning calls
  ``plugin.clip_grad_by_norm``, whose ``torch.nn.utils.clip_grad_norm_`` sees this rank's part
  only (and cannot mix DTensors of different placements); with
  ``gradient_clip_algorithm="value"`` it calls ``plugin.clip_grad_by_value``, whose
  ``torch.nn.utils.clip_grad_value_`` cannot mix plain tensors and DTensors in one fused clamp;
* under 16-mixed, a step whose gradients overflowed on any rank is skipped on every rank (and
  the scale backs off everywhere), or the ranks' weights part ways: Lightning calls
  ``scaler.unscale_``, which checks this rank's gradients only;
* a non-finite loss on any rank, or a non-finite global gradient norm, stops the run (or skips
  the step) on every rank before the optimizer applies it (:mod:`lightning_3d.runtime.nonfinite`):
  ``optimizer_step`` runs the closure (training step + backward) wrapped in the check, and the
  ranks agree on it, on the signals they received and (where it spans the world) on the
  clipping norm's sum in one small all-reduce and one host read per step
  (:mod:`lightning_3d.runtime.agreement`).

:func:`distributed_precision` returns the plugin Lightning chose as an instance of a subclass of
its own type (so every ``isinstance`` check, e.g. ``XLAStrategy``'s, still holds) with the same
state, overriding ``optimizer_step``, ``clip_grad_by_norm`` and ``clip_grad_by_value`` and,
where it has a ``torch.amp.GradScaler``, holding a scaler of a subclass of the scaler's type
that overrides ``unscale_``. Nothing in torch or Lightning is reassigned, and no method is set
on an instance.

Why subclasses made per type, not written out: Lightning picks one of many plugin types
(``Precision``, ``MixedPrecision``, ``HalfPrecision``, ``DoublePrecision``, ``FSDPPrecision``,
...) and users pass their own; scalers come as ``GradScaler``, ``ShardedGradScaler`` or a user's
subclass. One mixin each, combined with whatever concrete type is there, covers them all with one
code path. :func:`_subclass` is cached (``functools.lru_cache``, no module-level mutable state),
so each type gets one class however often it is adapted, and ``__reduce__`` rebuilds instances
through it, which makes them picklable although the class is not a module attribute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from lightning_3d.parallel.clip import clip_grad_norm_, clip_grad_value_, collective_device
from lightning_3d.runtime.nonfinite import NonFiniteGuard, NonFiniteOptions, SkipStep

NormScope = Callable[[], "tuple[Optional[dist.ProcessGroup], Collection[int]]"]
"""Called at clip time: ``(sum_over, skip_in_norm)`` for :func:`lightning_3d.parallel.clip.clip_grad_norm_`
(the pipeline group, whose ranks hold disjoint parameters; ids of parameters another rank counts)."""


def _no_scope() -> tuple[None, frozenset]:
    return None, frozenset()


def _nothing_before_step(optimizer: Any) -> None:
    """The default ``before_step``: the optimizer steps unchecked."""


class _Adapted:
    """Base of the mixins: pickling goes through :func:`_restore`, which re-derives the class."""

    _adapted_from: tuple[type, type]  # (mixin, original type); set on each generated class

    def __reduce__(self) -> tuple:
        getstate = getattr(self, "__getstate__", None)  # GradScaler's; object's from Python 3.11
        state = getstate() if getstate is not None else vars(self)
        return _restore, (*type(self)._adapted_from, state)


class SharedOverflowChecks(_Adapted):
    """Mixin for a ``torch.amp.GradScaler`` type: after unscaling, the found-inf flags are
    all-reduced (MAX) over the default group, so ``step`` skips and ``update`` backs off on
    every rank alike. One flag per rank is reduced (its devices' flags combined first), so ranks
    whose gradients sit on different numbers of devices still make the same collective calls."""

    _prefix = "SharedOverflow"

    def unscale_(self, optimizer: Optimizer) -> None:
        super().unscale_(optimizer)  # type: ignore[misc]
        if not self.is_enabled() or not (dist.is_available() and dist.is_initialized()):
            return
        found = list(self._found_inf_per_device(optimizer).values())
        flag = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for f in found:
            flag = torch.maximum(flag, f.reshape(()).to(flag.device))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        for f in found:
            f.copy_(flag)


class GlobalNormClipping(_Adapted):
    """Mixin for a Lightning ``Precision`` type: ``clip_grad_by_norm`` (what Lightning's
    ``gradient_clip_val`` with the norm algorithm calls) clips by the norm over every rank's
    gradients, summed over the group the norm scope names at clip time; ``optimizer_step``
    checks the loss and gradients, and ``clip_grad_by_norm`` the norm, for non-finite values
    before the optimizer steps (:class:`~lightning_3d.runtime.nonfinite.NonFiniteGuard`, the instance's own)."""

    _prefix = "Distributed"
    _norm_scope: NormScope = staticmethod(_no_scope)  # an instance's own scope replaces this
    # Called with the optimizer once its gradients are final (clipped, checked for non-finite
    # values) and before it steps: the strategy's replica check.
    _before_step: Callable[[Any], None] = staticmethod(_nothing_before_step)

    @property
    def nonfinite(self) -> NonFiniteGuard:
        """This plugin's guard: its options and the steps skipped so far."""
        return self.__dict__.setdefault("_nonfinite", NonFiniteGuard())

    def optimizer_step(
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        guard = self.nonfinite
        guard.step = model.trainer.global_step
        guard.scaler_overflow = None
        # Manual steps run no training closure.
        check = getattr(model, "automatic_optimization", False)

        def checked_closure() -> Any:
            result = closure()
            # Gradient overflow under 16-mixed is the scaler's to find.
            if check and self._has_scaler():
                guard.check_step(result, [], model.device)  # now: the scaler unscales right after
            # Agreed with the norm and the signals in _after_closure: one host sync per step.
            elif check:
                guard.flag_step(
                    result,
                    [
                        p.grad
                        for p in self.main_params(optimizer)  # type: ignore[attr-defined]
                        if p.grad is not None
                    ],
                    model.device,
                )
            return result

        try:
            output = super().optimizer_step(optimizer, model, checked_closure, **kwargs)  # type: ignore[misc]
            # A plugin whose optimizer_step never calls _after_closure stepped unchecked: say so
            # now rather than carry the flags into the next step.
            guard.resolve()
            return output
        except SkipStep:
            # Nothing was applied (the check runs before the step); drop the gradients. ZeRO
            # engines zero their buckets in after_step, which the strategy calls next as always.
            optimizer.zero_grad(set_to_none=True)
            return None

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        # Every Lightning plugin calls this after the closure (training step + backward), after
        # unscaling and before the optimizer steps; it clips. The loss, gradient and norm flags
        # noted on the way are read here together, in one host sync.
        super()._after_closure(model, optimizer)  # type: ignore[misc]
        self.nonfinite.resolve()
        # Under 16-mixed: the agreed overflow flag, with which the scaler skips the step (kept on
        # the device: read only by what asks whether the step was skipped, after the scaler's read).
        found = self._found_inf(optimizer)
        if found:
            flags = [f.reshape(()).to(found[0].device) for f in found]
            self.nonfinite.scaler_overflow = torch.stack(flags).amax()
        self._before_step(optimizer)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        sum_over, skip = self._norm_scope()
        guard = self.nonfinite
        if not self._has_scaler():  # no overflow for a scaler to skip: agreed with the step
            # Where the norm's sum runs over the whole world, its partial sums ride in the step's
            # agreement (one collective for both); its finiteness stands for the gradients'.
            def world_sum(squares: torch.Tensor) -> torch.Tensor:
                return guard.fold_norm(squares, _agreement_device(squares))

            norm = clip_grad_norm_(
                self.main_params(optimizer),  # type: ignore[attr-defined]
                clip_val,
                sum_over=sum_over,
                skip_in_norm=skip,
                world_sum=world_sum,
            )
            guard.flag_norm(norm)
            return
        norm = clip_grad_norm_(
            self.main_params(optimizer), clip_val, sum_over=sum_over, skip_in_norm=skip
        )  # type: ignore[attr-defined]
        found_inf = self._found_inf(optimizer)
        # The norm's flag and the scaler's found-inf flags in one host read (the scaler reads its
        # own flags again in step(): 16-mixed costs two reads per step, other precisions one).
        read = torch.cat(
            [
                (~torch.isfinite(norm.detach())).float().reshape(1),
                *(f.detach().float().reshape(1).to(norm.device) for f in found_inf),
            ]
        ).tolist()
        if not read[0]:
            return
        if any(read[1:]):  # an overflow the grad scaler skips (and backs off for)
            return
        try:
            self.nonfinite.check_norm(norm)
        except SkipStep:
            if not found_inf:
                raise
            for flag in found_inf:  # finite gradients, overflowing norm: the scaler skips the step
                flag.fill_(1.0)  # (unscale_ ran already: the scaler's state must see its step)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        # Lightning's calls torch's clip_grad_value_, whose fused clamp fails on a list mixing
        # plain tensors and DTensors (tensor parallelism): clamp each local shard instead.
        clip_grad_value_(self.main_params(optimizer), clip_val)  # type: ignore[attr-defined]

    def _has_scaler(self) -> bool:
        """An enabled grad scaler (16-mixed) checks the gradients for inf/NaN itself."""
        scaler = getattr(self, "scaler", None)
        return isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()

    def _found_inf(self, optimizer: Optimizer) -> list[torch.Tensor]:
        """The grad scaler's found-inf flags for ``optimizer`` after ``unscale_`` (shared over
        the ranks by :class:`SharedOverflowChecks`); empty without an enabled scaler."""
        if not self._has_scaler():
            return []
        return list(self.scaler._found_inf_per_device(optimizer).values())  # type: ignore[attr-defined]


def _agreement_device(like: torch.Tensor) -> torch.device:
    """Where a ballot begun at clipping lives: where the default group reduces (a CUDA device
    under NCCL even when the gradients sit in CPU memory), else beside ``like``."""
    if dist.is_available() and dist.is_initialized():
        return collective_device(None)
    return like.device


@functools.lru_cache(maxsize=None)
def _subclass(mixin: type, base: type) -> type:
    """The one subclass of ``base`` with ``mixin``'s overrides (the mixin comes first in the MRO)."""
    name = f"{mixin._prefix}{base.__name__}"
    namespace = {"__module__": __name__, "__qualname__": name, "_adapted_from": (mixin, base)}
    return type(name, (mixin, base), namespace)


def _restore(mixin: type, base: type, state: Any) -> Any:
    """A new instance of ``base`` adapted by ``mixin`` holding ``state``, as unpickling makes it
    (``__init__`` is not run: the state is the original's, as a shallow copy carries it)."""
    cls = _subclass(mixin, base)
    new = cls.__new__(cls)
    setstate = getattr(new, "__setstate__", None)
    if setstate is not None:
        setstate(state)
    else:
        new.__dict__.update(state)
    return new


def scale_loss(plugin: Precision, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` as backward should see it: times the dynamic loss scale where the plugin has a
    grad scaler (16-mixed), as is otherwise. For backward passes Lightning does not start itself
    (a pipeline schedule's); calling it also sets the scaler up on a rank with no loss."""
    scaler = getattr(plugin, "scaler", None)
    return scaler.scale(loss) if scaler is not None else loss


def shared_overflow_scaler(scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
    """``scaler`` as an instance of a subclass of its type whose ``unscale_`` shares the
    overflow check over the default group (see :class:`SharedOverflowChecks`).

    The result takes over the scaler's state (scale, growth tracker, factors, interval, per
    optimizer stage), sharing its tensors: keep using the result, not the original. A scaler so
    adapted already is returned as is.
    """
    if isinstance(scaler, SharedOverflowChecks):
        return scaler
    return _restore(SharedOverflowChecks, type(scaler), dict(vars(scaler)))


def distributed_precision(
    plugin: Precision,
    norm_scope: NormScope = _no_scope,
    nonfinite: NonFiniteOptions = NonFiniteOptions(),
    before_step: Callable[[Any], None] = _nothing_before_step,
    signals: Optional[Any] = None,
) -> Precision:
    """``plugin`` as an instance of a subclass of its type, with the same state, whose
    ``clip_grad_by_norm`` clips by the global norm (``norm_scope()`` is called at every clip for
    ``(sum_over, skip_in_norm)``), whose ``optimizer_step`` stops or skips a step with a
    non-finite loss or gradient norm as ``nonfinite`` says and then calls ``before_step(optimizer)``,
    agreeing on the signal ``signals`` received in the same collective (see
    :class:`~lightning_3d.runtime.nonfinite.NonFiniteGuard`), and whose ``scaler``, if it has a
    ``torch.amp.GradScaler``, is :func:`shared_overflow_scaler`'s.

    A plugin so adapted already is returned unchanged (with the scope it was adapted with). The
    original plugin is left as it was; the result replaces it (``strategy.precision_plugin``).
    """
    if isinstance(plugin, GlobalNormClipping):
        return plugin
    state = dict(vars(plugin))
    if isinstance(state.get("scaler"), torch.amp.GradScaler):
        state["scaler"] = shared_overflow_scaler(state["scaler"])
    state["_norm_scope"] = norm_scope
    state["_before_step"] = before_step
    state["_nonfinite"] = NonFiniteGuard(nonfinite, signals)
    return _restore(GlobalNormClipping, type(plugin), state)
