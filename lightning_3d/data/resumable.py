"""A training data loader that resumes mid-epoch exactly where a checkpoint left it.

Lightning restores a loader's position only when the loader has ``state_dict`` /
``load_state_dict`` (``lightning.fabric.utilities.types._Stateful``): ``FitLoop`` saves
``[loader.state_dict()]`` under ``loops.fit_loop.state_dict.combined_loader`` and, on resume,
calls ``load_state_dict`` just before it creates the epoch's iterator. ``ResumableDataLoader``
has that interface; its state is the epoch and the number of samples of that epoch already handed
out, counted in global (all data-parallel ranks) samples, so it resumes under another
data-parallel size too.

Counting is done where batches leave the loader, not in the sampler: with worker processes the
``DataLoader`` iterator draws indices several batches ahead of what the training loop has taken.
Lightning's own prefetch (``_PrefetchDataFetcher``) is off for a loader with a length — it only
prefetches to detect the last batch of an unsized iterable — so at checkpoint time (e.g.
``ModelCheckpoint`` in ``on_train_batch_end``) the loader has handed out exactly the batches of
the steps taken. That is the same contract torchdata's ``StatefulDataLoader`` relies on; the
resume test checks it end to end.

Resuming skips at the sampler's index level: the permutation of the epoch is recomputed (a list
of integers) and cut, and the skipped windows are never loaded.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` whose next epoch can start part-way through.

    ``resume_at(epoch, skip)`` makes the next iteration of ``epoch`` leave out this rank's first
    ``skip`` indices (rank ``r`` takes ``perm[r::dp]``, so skipping ``s * dp`` global samples is
    skipping ``s`` on every rank). An iteration of any other epoch ignores it. ``len()`` stays the
    full epoch: Lightning counts the resumed batches as already done.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resume: Optional[tuple[int, int]] = None  # (epoch, this rank's samples to skip)
        self.start = 0  # samples of this rank skipped by the current iteration

    def resume_at(self, epoch: int, skip: int) -> None:
        if not 0 <= skip <= self.num_samples:
            raise ValueError(
                f"cannot skip {skip} samples of an epoch of {self.num_samples} on this rank"
            )
        # So that even an iterator created eagerly (worker processes) sees this epoch.
        self.set_epoch(epoch)
        self._resume = (epoch, skip)

    def pending_skip(self) -> Optional[int]:
        """This rank's samples to skip when the current epoch is next iterated, if any."""
        if self._resume is not None and self._resume[0] == self.epoch:
            return self._resume[1]
        return None

    def __iter__(self) -> Iterator[int]:
        # Decided when the indices are drawn (lazily, at the first batch without workers), i.e.
        # after Lightning's set_epoch for the epoch being run.
        self.start = self.pending_skip() or 0
        self._resume = None
        indices = list(super().__iter__())
        return iter(indices[self.start :])


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a ``ResumableDistributedSampler`` with Lightning's stateful interface.

    Example::

        sampler = ResumableDistributedSampler(dataset, num_replicas=2, rank=0, seed=1, drop_last=True)
        loader = ResumableDataLoader(dataset, batch_size=4, sampler=sampler)
        batches = iter(loader); next(batches); next(batches)
        state = loader.state_dict()   # {"epoch": 0, "samples": 16, ...}: 2 batches of 4 on each of 2 ranks
        fresh = ResumableDataLoader(dataset, batch_size=4, sampler=ResumableDistributedSampler(...))
        fresh.load_state_dict(state)  # iter(fresh) starts at the third batch of epoch 0
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        sampler: ResumableDistributedSampler,
        **kwargs: Any,
    ) -> None:
        if not isinstance(sampler, ResumableDistributedSampler):
            raise TypeError(
                f"sampler must be a ResumableDistributedSampler, got {type(sampler).__name__}"
            )
        if not sampler.drop_last or not kwargs.get("drop_last", False):
            # A short last batch would make "samples consumed" depend on the layout.
            raise ValueError(
                "ResumableDataLoader needs drop_last=True for both the sampler and the loader"
            )
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self._position = (sampler.epoch, 0)  # (epoch, this rank's samples handed out in it)

    def __iter__(self) -> Iterator[Any]:
        batches = super().__iter__()
        sampler: ResumableDistributedSampler = self.sampler
        batch_size: int = self.batch_size

        def counted() -> Iterator[Any]:
            for i, batch in enumerate(batches):  # the sampler has been iterated by now
                self._position = (sampler.epoch, sampler.start + (i + 1) * batch_size)
                yield batch

        return counted()

    def _consumed(self) -> int:
        """This rank's samples of the sampler's current epoch already handed out (or to be skipped)."""
        sampler: ResumableDistributedSampler = self.sampler
        pending = sampler.pending_skip()
        if pending is not None:
            return pending
        epoch, consumed = self._position
        return consumed if epoch == sampler.epoch else 0

    def state_dict(self) -> dict[str, int]:
        sampler: ResumableDistributedSampler = self.sampler
        return {
            "epoch": sampler.epoch,
            "samples": self._consumed() * sampler.num_replicas,  # global: layout-free
            # To check on load (layout-free, unlike total_size).
            "dataset_size": len(sampler.dataset),
            "seed": sampler.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler: ResumableDistributedSampler = self.sampler
        epoch, samples = int(state["epoch"]), int(state["samples"])
        saved = (int(state["dataset_size"]), int(state["seed"]))
        if saved != (len(sampler.dataset), sampler.seed):
            raise ValueError(
                f"the checkpoint's data position is for a dataset of {saved[0]} samples shuffled with seed "
                f"{saved[1]}; this loader has {len(sampler.dataset)} samples and seed {sampler.seed}"
            )
        if samples % sampler.num_replicas != 0:
            raise ValueError(
                f"the checkpoint consumed {samples} samples of epoch {epoch}, not divisible by the "
                f"data-parallel size {sampler.num_replicas}"
            )
        skip = samples // sampler.num_replicas
        if skip >= sampler.num_samples // self.batch_size * self.batch_size:
            # Saved after the epoch's last full batch: the next epoch is fresh.
            epoch, skip = (epoch + 1, 0)
        sampler.resume_at(epoch, skip)
        self._position = (epoch, skip)
