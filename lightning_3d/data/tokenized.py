"""Text files tokenized with a Hugging Face tokenizer: ``data=text data.path=FILE|DIR|GLOB``.

Documents are read in a fixed (sorted) order — a ``.txt`` file is one document, a ``.jsonl``
file one document per line (its ``text`` field) — tokenized without special tokens, each
followed by the tokenizer's EOS token, and concatenated into one stream of ids. From there on
the data are the byte corpora's: the stream's tail is the validation split, both splits are cut
into windows of ``block_size + 1`` ids (inputs and targets shifted by one), and the training
loader resumes mid-epoch (:class:`~lightning_3d.data.text.TextDataModule` does all of that;
this module only replaces where the ids come from).

Needs ``transformers`` (imported when a tokenizer is loaded). Example::

    dm = TokenizedTextDataModule(path="corpus/*.jsonl", tokenizer="/models/qwen2-0.5b", block_size=512)
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_3d.data.text import TextDataModule, split_counts

TEXT_SUFFIXES = (".txt", ".jsonl")
# What a tokenizer directory holds (any one is enough for AutoTokenizer to try).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
_TOKENIZE_BATCH = 256  # documents per call into the (Rust, multi-threaded) fast tokenizer


def find_text_files(path: Optional[str], suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> list[Path]:
    """The files ``path`` names: a file, a directory (every file below it whose suffix is one of
    ``suffixes``) or a glob pattern; sorted, so the corpus is the same on every rank and machine.
    ``ValueError`` names the path when it is empty, matches nothing, or names a file of another
    type."""
    kinds = " or ".join(suffixes)
    if path is None or not str(path).strip():
        raise ValueError(f"data.path is empty: give data.path=FILE, DIR or GLOB ({kinds} files)")
    path = str(path)
    root = Path(path).expanduser()
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes)
        if not files:
            raise ValueError(f"data.path={path!r} is a directory without {kinds} files")
        return files
    if root.is_file():
        files = [root]
    else:
        files = sorted(Path(p) for p in glob.glob(str(root), recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"data.path={path!r} matches no file")
    others = [str(p) for p in files if p.suffix not in suffixes]
    if others:
        raise ValueError(f"data.path={path!r}: {others[:3]} not {kinds} (text files only)")
    return files


INVALID_UTF8 = ("error", "replace")  # data.invalid_utf8: refuse such bytes, or read them as U+FFFD


def text_of(file: Path, invalid_utf8: str) -> str:
    """``file`` decoded as UTF-8; ``ValueError`` naming the file and the byte offset of a NUL
    byte (binary content) or, unless ``invalid_utf8="replace"``, of bytes that are not UTF-8."""
    data = file.read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(
            f"{file}: not a text file (a NUL byte at offset {nul}): data.path takes .txt / .jsonl text"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        if invalid_utf8 == "replace":
            return data.decode("utf-8", errors="replace")
        raise ValueError(
            f"{file}: not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start} ({err.reason}); "
            "fix the file, or read such bytes as U+FFFD with data.invalid_utf8=replace"
        ) from None


def read_documents(
    files: Iterable[Path], text_field: str = "text", invalid_utf8: str = "error"
) -> Iterator[str]:
    """Every non-blank document of ``files``, in order. ``ValueError`` names the file (and line)
    of a ``.jsonl`` line that is not a JSON object with a string ``text_field``, and of content
    that is not text (see :func:`text_of`)."""
    if invalid_utf8 not in INVALID_UTF8:
        raise ValueError(f"data.invalid_utf8={invalid_utf8!r} must be one of {INVALID_UTF8}")
    for file in files:
        text = text_of(file, invalid_utf8)
        if file.suffix == ".txt":
            if text.strip():
                yield text
            continue
        # Not splitlines: JSON strings may hold U+2028.
        for number, line in enumerate(text.split("\n"), 1):
            if line.strip():
                document = _jsonl_text(line, text_field, f"{file}:{number}")
                if document.strip():
                    yield document


def _jsonl_text(line: str, field: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not a JSON line: {err.msg}") from None
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ValueError(f"{where} has no string field {field!r} (set data.text_field=...)")
    return text


def load_tokenizer(directory: Optional[str]) -> Any:
    """``AutoTokenizer.from_pretrained(directory)``, local files only, after checking that the
    directory holds a tokenizer with an EOS token (documents are separated by it). ``ValueError``
    names the directory otherwise."""
    if directory is None or not str(directory).strip():
        raise ValueError(
            "data=text needs a tokenizer: set data.tokenizer=DIR (by default the model directory, model.path)"
        )
    root = Path(str(directory)).expanduser()
    if not root.is_dir():
        raise ValueError(
            f"tokenizer directory {str(directory)!r} does not exist (data.tokenizer / model.path)"
        )
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"no tokenizer in {str(root)!r} (none of {', '.join(TOKENIZER_FILES)}); "
            "pass data.tokenizer=DIR with one"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"cannot load the tokenizer in {str(root)!r}: {first}") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"the tokenizer in {str(root)!r} has no eos_token (it separates the documents)"
        )
    return tokenizer


def token_pieces(documents: Iterable[str], tokenizer: Any) -> Iterator[torch.Tensor]:
    """Each document's ids (no special tokens) followed by EOS, one int32 tensor per document."""
    eos = tokenizer.eos_token_id
    for batch in _batches(documents, _TOKENIZE_BATCH):
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            yield torch.tensor([*ids, eos], dtype=torch.int32)


def tokenize_documents(
    documents: Iterable[str], tokenizer: Any, max_tokens: Optional[int] = None
) -> torch.Tensor:
    """One 1-D int32 tensor: each document's ids followed by EOS, in order; cut at ``max_tokens``
    (``None``: everything)."""
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"data.max_tokens must be positive or null, got {max_tokens}")
    pieces, count = [], 0
    for piece in token_pieces(documents, tokenizer):
        pieces.append(piece)
        count += len(piece)
        if max_tokens is not None and count >= max_tokens:
            break
    tokens = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)
    return tokens[:max_tokens] if max_tokens is not None else tokens


def enough_tokens(count: int, block_size: int, batch_size: int, val_fraction: float) -> bool:
    """Whether a stream of ``count`` ids gives both splits one global batch of windows (what
    :meth:`TextDataModule.setup_for` needs); grows with ``count``, so a prefix can answer."""
    return min(split_counts(count, block_size, val_fraction)) >= batch_size


def count_tokens(
    documents: Iterator[str], tokenizer: Any, max_tokens: int | None, enough: Callable[[int], bool]
) -> int:
    """The length of the stream :func:`tokenize_documents` makes of ``documents``, tokenizing
    only until ``enough(length)`` holds (then a lower bound; ``enough`` must grow with the
    length, as a prefix answers for the whole stream). The rest of ``documents`` is read and
    parsed, not tokenized, so a bad line is found wherever it is."""
    total = count = 0
    for piece in token_pieces(documents, tokenizer):
        total += len(piece)
        count = total if max_tokens is None else min(total, max_tokens)
        if enough(count) or count == max_tokens:
            break
    for _ in documents:
        pass
    return count


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class TokenizedTextDataModule(TextDataModule):
    """Token windows of local text files, sharded over data-parallel ranks, resumable.

    Everything but the source of the ids is :class:`TextDataModule`'s: global ``batch_size``,
    the tail ``val_fraction`` of the stream as validation split, windows of ``block_size + 1``
    ids, the seeded sampler and the resumable training loader.

    Args:
        path: a ``.txt`` / ``.jsonl`` file, a directory of them, or a glob pattern.
        tokenizer: a directory ``AutoTokenizer.from_pretrained`` reads (a model directory).
        max_tokens: cut the stream after this many ids (``None``: all of it).
        text_field: the field of each ``.jsonl`` record that holds the text.
        invalid_utf8: ``"error"`` (default) refuses bytes that are not UTF-8, naming the file and
            offset; ``"replace"`` reads them as U+FFFD.
    """

    unit = "tokens"
    size_option = "the text under data.path"

    def __init__(
        self,
        path: str,
        tokenizer: str,
        block_size: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_tokens: Optional[int] = None,
        text_field: str = "text",
        seed: int = 1234,
        num_workers: int = 0,
        invalid_utf8: str = "error",
    ) -> None:
        super().__init__(
            corpus="files",
            block_size=block_size,
            batch_size=batch_size,
            val_fraction=val_fraction,
            max_bytes=None,
            seed=seed,
            num_workers=num_workers,
        )
        # Logged hyper-parameters are merged with the model's, which may have its own ``path``
        # (a model directory): this one is logged as ``data_path``.
        self.save_hyperparameters(ignore=["path", "corpus", "max_bytes"])
        self.hparams["data_path"] = path
        self.path, self.tokenizer_dir = path, tokenizer
        self.max_tokens, self.text_field, self.invalid_utf8 = max_tokens, text_field, invalid_utf8

    def load_data(self) -> torch.Tensor:
        tokenizer = load_tokenizer(self.tokenizer_dir)
        documents = read_documents(find_text_files(self.path), self.text_field, self.invalid_utf8)
        tokens = tokenize_documents(documents, tokenizer, self.max_tokens)
        if len(tokens) == 0:
            raise ValueError(f"data.path={self.path!r}: the files hold no text")
        return tokens

    @classmethod
    def split_windows(
        cls,
        path: str | None = None,
        tokenizer: str | None = None,
        block_size: int = 128,
        val_fraction: float = 0.05,
        max_tokens: int | None = None,
        text_field: str = "text",
        invalid_utf8: str = "error",
        enough: Callable[[int, int], bool] | None = None,
        **_: Any,
    ) -> tuple[int, int]:
        """(training windows, validation windows) of the files' token stream, for the launching
        process's checks. Tokenizing stops once ``enough(training, validation)`` holds (then
        the counts are lower bounds that satisfy it): the launcher tokenizes no more text than
        the check it makes needs. ``None``: every file tokenized, the counts exact."""

        def satisfied(count: int) -> bool:
            return enough is not None and enough(*split_counts(count, block_size, val_fraction))

        documents = read_documents(find_text_files(path), text_field, invalid_utf8)
        count = count_tokens(documents, load_tokenizer(tokenizer), max_tokens, satisfied)
        return split_counts(count, block_size, val_fraction)

    @classmethod
    def check(
        cls,
        path: Optional[str] = None,
        tokenizer: Optional[str] = None,
        block_size: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_tokens: Optional[int] = None,
        text_field: str = "text",
        invalid_utf8: str = "error",
        **_: Any,
    ) -> int:
        """Check the files and the tokenizer in the launching process: every file read and every
        ``.jsonl`` line parsed (a bad line 301 is named here, not on every rank), tokenizing only
        as much text as one global batch of each split needs; return the vocabulary size the ids
        need (``len(tokenizer)``). ``ValueError`` names the bad value."""
        for name, value in (
            ("block_size", block_size),
            ("batch_size", batch_size),
            ("max_tokens", max_tokens),
        ):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"data.{name}={value!r} must be a positive integer")
        files = find_text_files(path)
        loaded = load_tokenizer(tokenizer)
        documents = read_documents(files, text_field, invalid_utf8)

        def enough(count: int) -> bool:
            return enough_tokens(count, block_size, batch_size, val_fraction)

        count = count_tokens(documents, loaded, max_tokens, enough)
        if enough(count):
            return len(loaded)
        if count == 0:
            raise ValueError(
                f"data.path={path!r}: the files hold no text ({len(files)} file(s), all blank)"
            )
        raise ValueError(
            f"data.path={path!r} gives {count} tokens"
            + (f" (data.max_tokens={max_tokens})" if max_tokens else "")
            + f": too few for one global batch (data.batch_size={batch_size}) of {block_size + 1}-token windows "
            f"in both the training and the validation split (data.val_fraction={val_fraction})"
        )
