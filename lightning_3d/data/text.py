"""Byte-level text corpora that ship with every CPython, plus a DataModule.

No downloads: the training text is the standard library's own source and
the fine-tuning text is its prose documentation. Both are gathered in a
fixed (sorted) order, so the bytes are identical on every machine running
the same Python build, and so are the batches.
"""

from __future__ import annotations

import ast
import os
import sysconfig
from typing import Any, Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_3d.data.resumable import ResumableDataLoader, ResumableDistributedSampler

# Never part of the corpus: third-party or build/machine-specific content.
_ALWAYS_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__", "lib-dynload")
# Test suites and demo/GUI apps: large, repetitive, and not "library" code.
_TEST_DIRS = ("test", "tests", "idlelib", "turtledemo")


def _stdlib_py_files(exclude_tests: bool = True) -> Iterator[tuple[str, str]]:
    """Yield ``(relative_path, absolute_path)`` of stdlib ``.py`` files, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    skip = set(_ALWAYS_SKIP_DIRS) | (set(_TEST_DIRS) if exclude_tests else set())
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith("config-")]
        for fn in filenames:
            # _sysconfigdata embeds build paths: differs between builds.
            if fn.endswith(".py") and not fn.startswith("_sysconfigdata"):
                full = os.path.join(dirpath, fn)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                found.append((rel, full))
    # os.walk order depends on the filesystem; sorting makes it reproducible.
    yield from sorted(found)


def _take(chunks: Iterator[bytes], max_bytes: int | None) -> bytes:
    """Concatenate ``chunks``, stopping (and truncating) at ``max_bytes``."""
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    out = bytearray()
    for chunk in chunks:
        out += chunk
        if max_bytes is not None and len(out) >= max_bytes:
            del out[max_bytes:]
            break
    return bytes(out)


def load_stdlib_corpus(max_bytes: int | None = None, exclude_tests: bool = True) -> bytes:
    """Source code of the Python standard library as one byte string."""

    def chunks() -> Iterator[bytes]:
        for _, path in _stdlib_py_files(exclude_tests):
            with open(path, "rb") as f:
                yield f.read() + b"\n"

    return _take(chunks(), max_bytes)


def _docstrings(source: bytes) -> Iterator[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):  # BFS: deterministic for a given file
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def load_docs_corpus(max_bytes: int | None = None) -> bytes:
    """English prose about Python: the pydoc topic pages, then stdlib docstrings.

    A different distribution from the source-code corpus (mostly prose, no
    code bodies), for fine-tuning experiments.
    """
    from pydoc_data.topics import topics

    def chunks() -> Iterator[bytes]:
        for key in sorted(topics):
            yield f"{key}\n\n{topics[key].strip()}\n\n".encode()
        for _, path in _stdlib_py_files(exclude_tests=True):
            with open(path, "rb") as f:
                source = f.read()
            for doc in _docstrings(source):
                yield (doc + "\n\n").encode("utf-8", errors="replace")

    return _take(chunks(), max_bytes)


CORPUS_NAMES = ("docs", "stdlib")


def load_text_corpus(name: str, max_bytes: int | None = None) -> bytes:
    """Load a named corpus: ``"stdlib"`` (source code) or ``"docs"`` (prose)."""
    if name == "stdlib":
        return load_stdlib_corpus(max_bytes=max_bytes)
    if name == "docs":
        return load_docs_corpus(max_bytes=max_bytes)
    raise ValueError(f"unknown corpus {name!r}; known corpora: {list(CORPUS_NAMES)}")


class ByteWindowDataset(Dataset):
    """Fixed-length windows over a 1-D tensor of ids (bytes, or tokens of a tokenizer); targets
    are inputs shifted by one.

    Item ``i`` covers ``data[i*stride : i*stride + block_size + 1]``; only
    windows that fit completely are counted.
    """

    def __init__(self, data: torch.Tensor, block_size: int, stride: int | None = None) -> None:
        if data.dim() != 1:
            raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.data = data
        self.block_size = block_size
        self.stride = block_size if stride is None else stride
        if self.stride <= 0:
            raise ValueError(f"stride must be positive, got {self.stride}")
        # Each window needs block_size + 1 bytes (the extra one is the last target).
        span = block_size + 1
        n = len(data)
        self._len = 0 if n < span else (n - span) // self.stride + 1

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self._len:
            raise IndexError(f"window {i} out of range for {self._len} windows")
        start = i * self.stride
        chunk = self.data[start : start + self.block_size + 1].long()  # (T + 1,)
        return chunk[:-1], chunk[1:]  # (T,), (T,)


def split_counts(length: int, block_size: int, val_fraction: float) -> tuple[int, int]:
    """(training windows, validation windows) of ``block_size + 1`` positions in a stream of
    ``length`` ids, its tail ``val_fraction`` the validation split, as
    :meth:`TextDataModule.setup_for` cuts it."""
    n_val = int(length * val_fraction)
    span = block_size + 1
    train, val = (
        0 if part < span else (part - span) // block_size + 1 for part in (length - n_val, n_val)
    )
    return train, val


class TextDataModule(pl.LightningDataModule):
    """Byte windows of a built-in corpus, sharded over data-parallel ranks.

    ``batch_size`` is GLOBAL (summed over data-parallel ranks). Each rank
    draws ``batch_size // dp_size`` samples per step from a
    ``DistributedSampler`` with a shared seed, so global step ``k`` sees the
    same set of windows regardless of how the world is split into
    data/tensor/pipeline groups.
    """

    def __init__(
        self,
        corpus: str = "stdlib",
        block_size: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        max_bytes: int | None = 8_000_000,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
        self.corpus = corpus
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.seed = seed
        self.num_workers = num_workers
        self.dp_size: int | None = None
        self.dp_rank: int | None = None
        self.per_rank_batch_size: int | None = None
        self.train_dataset: ByteWindowDataset | None = None
        self.val_dataset: ByteWindowDataset | None = None

    @staticmethod
    def check_batch(batch_size: int, dp_size: int) -> int:
        """Validate the global batch against the DP size; return the per-rank batch."""
        if dp_size <= 0 or batch_size % dp_size != 0:
            raise ValueError(
                f"global batch_size ({batch_size}) is not divisible by "
                f"data-parallel size ({dp_size})"
            )
        return batch_size // dp_size

    def _resolve_dp(self) -> tuple[int, int]:
        """(dp_size, dp_rank) from the trainer's strategy, else (1, 0)."""
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        strategy = trainer.strategy
        # A 3D strategy replicates data only across its DP group; TP/PP
        # peers must see the same batch, so world size would be wrong there.
        if hasattr(strategy, "dp_size") and hasattr(strategy, "dp_rank"):
            return int(strategy.dp_size), int(strategy.dp_rank)
        return trainer.world_size, trainer.global_rank

    def setup(self, stage: str | None = None) -> None:
        self.setup_for(*self._resolve_dp())

    def setup_for(self, dp_size: int, dp_rank: int) -> None:
        """Build the datasets for an explicit data-parallel position."""
        self.per_rank_batch_size = self.check_batch(self.batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank ({dp_rank}) must be in [0, {dp_size})")
        self.dp_size, self.dp_rank = dp_size, dp_rank
        if self.train_dataset is not None:
            return  # the corpus does not depend on the DP layout
        data = self.load_data()  # (N,)
        n_val = int(len(data) * self.val_fraction)
        self.train_dataset = ByteWindowDataset(data[: len(data) - n_val], self.block_size)
        self.val_dataset = ByteWindowDataset(data[len(data) - n_val :], self.block_size)
        # Fail loudly rather than silently validating on zero batches.
        if len(self.val_dataset) < self.batch_size:
            raise ValueError(
                f"validation split has {len(self.val_dataset)} windows of "
                f"{self.block_size + 1} {self.unit}, fewer than one global batch "
                f"({self.batch_size}); increase {self.size_option} or val_fraction"
            )

    unit = "bytes"  # what one position of load_data() is, for messages
    size_option = "max_bytes"  # the option that makes the corpus longer, for messages

    def load_data(self) -> torch.Tensor:
        """The whole corpus as one 1-D tensor of token ids (here: bytes), split into train / val
        by :meth:`setup_for`. Subclasses with another source override this alone."""
        raw = load_text_corpus(self.corpus, self.max_bytes)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # (N,)

    @classmethod
    def check(cls, corpus: str = "stdlib", **_: Any) -> int:
        """Check the configuration in the launching process, without loading the corpus; return
        the vocabulary size its ids need (bytes: 256). ``ValueError`` names a bad value."""
        if corpus not in CORPUS_NAMES:
            raise ValueError(
                f"data.corpus={corpus!r} is not a known corpus; known corpora: {list(CORPUS_NAMES)}"
            )
        return 256

    @classmethod
    def split_windows(
        cls,
        corpus: str = "stdlib",
        max_bytes: int | None = 8_000_000,
        block_size: int = 128,
        val_fraction: float = 0.05,
        **_: Any,
    ) -> tuple[int, int] | None:
        """(training windows, validation windows) of the corpus as :meth:`setup_for` splits it,
        for the launching process's checks; reads the corpus (the ranks read it again)."""
        return split_counts(len(load_text_corpus(corpus, max_bytes)), block_size, val_fraction)

    def _loader(
        self, dataset: ByteWindowDataset, shuffle: bool, resumable: bool = False
    ) -> DataLoader:
        if self.dp_size is None or dataset is None:
            raise RuntimeError("call setup() or setup_for() before requesting dataloaders")
        # Always an explicit DistributedSampler (even for dp=1): its seeded
        # permutation is identical on every rank and rank r takes perm[r::dp],
        # so the union of a global step's per-rank batches is layout-free.
        # Lightning leaves an existing DistributedSampler untouched.
        sampler_cls, loader_cls = (
            (ResumableDistributedSampler, ResumableDataLoader)
            if resumable
            else (DistributedSampler, DataLoader)
        )
        sampler = sampler_cls(
            dataset,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            shuffle=shuffle,
            seed=self.seed,
            drop_last=True,
        )
        return loader_cls(
            dataset,
            batch_size=self.per_rank_batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            # The loader's own generator: creating an iterator draws a worker base seed, and from
            # the global RNG that draw would shift dropout's stream by one draw per epoch and per
            # validation, differently in a run resumed from a checkpoint than in one that was not.
            generator=torch.Generator().manual_seed(self.seed),
        )

    def train_dataloader(self) -> ResumableDataLoader:
        """The training split, resumable mid-epoch (see ``lightning_3d/data/resumable.py``)."""
        return self._loader(self.train_dataset, shuffle=True, resumable=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """The held-out split (the embedded corpora have one)."""
        return self._loader(self.val_dataset, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)
