"""Conversations rendered with the tokenizer's chat template, loss on the assistant's turns:
``data=chat data.path=FILE|DIR|GLOB``.

Each line of a ``.jsonl`` file is one conversation in OpenAI's format::

    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "2 + 2?"},
                  {"role": "assistant", "content": "4"}]}

It is rendered by the tokenizer's own chat template (``data.chat_template`` sets or replaces
it) and labelled ``-100`` everywhere but the assistant turns' tokens (their end-of-turn token
included, the template's role headers and the prompt excluded). Where the template marks the
assistant's text with ``{% generation %}`` transformers' ``return_assistant_tokens_mask`` finds
those tokens; elsewhere each assistant turn is located by rendering the conversation up to it,
with and without the turn (:func:`assistant_spans`, what TRL does for templates without markers).

Two layouts (:mod:`lightning_3d.data.chat_layout`): ``packing=true`` puts several whole
conversations in one row of ``block_size`` tokens, positions restarting at 0 for each, so that
``transformers`` keeps attention inside each conversation; ``packing=false`` one conversation per
row, right-padded. Bad records are refused naming the file and line, in the launching process.

Example::

    dm = ChatDataModule(path="chats.jsonl", tokenizer="/models/qwen2-0.5b", block_size=1024)
    dm.setup_for(1, 0)
    batch = next(iter(dm.train_dataloader()))  # input_ids, labels, position_ids: (B, 1024)
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from lightning_3d.data.chat_layout import Conversation, pack, pad_rows
from lightning_3d.data.labels import IGNORE_INDEX
from lightning_3d.data.text import TextDataModule
from lightning_3d.data.tokenized import find_text_files, load_tokenizer, text_of

ROLES = ("system", "user", "assistant", "tool")
TOO_LONG = ("error", "truncate", "skip")  # data.too_long: a conversation above block_size
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def read_conversations(files: Iterable[Path]) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """``(where, messages)`` of every non-blank line of ``files`` (``where``: ``FILE:LINE``), in
    order. ``ValueError`` naming the file and line of a record that is not a conversation: not
    JSON, no ``messages`` list, a message that is not ``{"role": ..., "content": str}``, an
    unknown role, no assistant turn."""
    for file in files:
        for number, line in enumerate(text_of(file, "error").split("\n"), 1):
            if line.strip():
                where = f"{file}:{number}"
                yield where, _messages(line, where)


def _messages(line: str, where: str) -> list[dict[str, str]]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not a JSON line: {err.msg}") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{where} has no 'messages' list (a conversation is "
            '{"messages": [{"role": "user", "content": "..."}, ...]})'
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: message {i} is not an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(
                f"{where}: message {i} has role {role!r}, not one of {', '.join(ROLES)}"
            )
        if not isinstance(content, str):
            raise ValueError(
                f"{where}: message {i} ({role}) has no string 'content' "
                f"(got {type(content).__name__})"
            )
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as err:  # JSON's "\ud800" decodes to a lone surrogate
            raise ValueError(
                f"{where}: message {i} ({role}) holds a lone surrogate "
                f"{content[err.start]!r} at character {err.start}, which no tokenizer can "
                "encode; fix the line (an unpaired \\u escape in its JSON)"
            ) from None
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the conversation has no assistant turn (nothing to train on)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def load_chat_tokenizer(directory: Optional[str], chat_template: Optional[str] = None) -> Any:
    """The tokenizer of ``directory`` (see :func:`~lightning_3d.data.tokenized.load_tokenizer`)
    with a chat template: ``chat_template`` (a Jinja string, or a file holding one) replaces its
    own. ``ValueError`` names ``data.chat_template`` when there is none, or when the file is
    missing."""
    tokenizer = load_tokenizer(directory)
    if chat_template is not None and str(chat_template).strip():
        text = str(chat_template)
        if "{{" not in text and "{%" not in text:  # not a template: a file
            file = Path(text).expanduser()
            if not file.is_file():
                raise ValueError(
                    f"data.chat_template={text!r} is neither a Jinja template nor a file"
                )
            text = file.read_text()
        tokenizer.chat_template = text
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer in {str(directory)!r} has no chat template: set "
            "data.chat_template=FILE (a Jinja file) or the template itself"
        )
    return tokenizer


def assistant_spans(
    tokenizer: Any, messages: list[dict[str, str]], text: str, where: str
) -> list[tuple[int, int]]:
    """Character spans of ``text`` (the whole rendered conversation) that are assistant turns,
    for a template without ``{% generation %}``: turn ``i`` is what rendering ``messages[:i+1]``
    adds to ``messages[:i]`` rendered with the generation prompt (the role header), with the
    whitespace after its end-of-turn token left out. ``ValueError`` naming ``where`` when the
    template does not render a conversation's prefixes as prefixes of it."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = (
            tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            if i
            else ""
        )
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not upto.startswith(before) or not text.startswith(upto):
            raise ValueError(
                f"{where}: the chat template does not render this conversation's turns as prefixes "
                "of it, so its assistant turns cannot be located; give a template whose assistant "
                "text is inside {% generation %} ... {% endgeneration %} (data.chat_template=)"
            )
        end = len(before) + len(upto[len(before) :].rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return spans


def render(tokenizer: Any, messages: list[dict[str, str]], where: str) -> Conversation:
    """One conversation as token ids and labels (``-100`` but on the assistant's tokens);
    ``ValueError`` naming ``where`` when the template refuses it (``raise_exception``)."""
    from jinja2 import TemplateError

    try:
        return _render(tokenizer, messages, where)
    except TemplateError as err:
        text = str(err).strip().splitlines()
        raise ValueError(
            f"{where}: the chat template refuses the conversation: "
            f"{text[0] if text else type(err).__name__}"
        ) from None


def _render(tokenizer: Any, messages: list[dict[str, str]], where: str) -> Conversation:
    template = tokenizer.get_chat_template()
    if _GENERATION_TAG.search(template):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        spans = assistant_spans(tokenizer, messages, text, where)
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(out["input_ids"])
        # A token overlapping a span is the assistant's (transformers' rule for its own masks).
        mask = [int(any(s < b and a < e for s, e in spans)) for a, b in out["offset_mapping"]]
    labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask)]
    if all(label == IGNORE_INDEX for label in labels):
        raise ValueError(
            f"{where}: no token of the assistant's turns is left after rendering "
            "(empty assistant content?)"
        )
    return Conversation(where, ids, labels)


def tokenize_conversations(
    files: Iterable[Path], tokenizer: Any, block_size: int, too_long: str = "error"
) -> list[Conversation]:
    """Every conversation of ``files`` rendered (:func:`render`); one above ``block_size``
    tokens is refused naming file, line and length (``too_long="error"``), cut to
    ``block_size`` (``"truncate"``; dropped if no assistant token is left) or dropped
    (``"skip"``), the drops counted in one warning."""
    if too_long not in TOO_LONG:
        raise ValueError(f"data.too_long={too_long!r} must be one of {', '.join(TOO_LONG)}")
    kept, dropped = [], 0
    for where, messages in read_conversations(files):
        conversation = render(tokenizer, messages, where)
        if len(conversation.ids) > block_size:
            if too_long == "error":
                raise ValueError(
                    f"{where}: the conversation is {len(conversation.ids)} tokens, above "
                    f"data.block_size={block_size}; raise block_size, or set "
                    "data.too_long=truncate or data.too_long=skip"
                )
            conversation = conversation.truncated(block_size) if too_long == "truncate" else None
            if conversation is None or conversation.trained_tokens() == 0:
                dropped += 1
                continue
        kept.append(conversation)
    if dropped:
        warnings.warn(
            f"data=chat: {dropped} conversation(s) above data.block_size={block_size} "
            f"dropped (data.too_long={too_long})",
            stacklevel=2,
        )
    return kept


class ChatDataset(Dataset):
    """Rows of a layout (dicts of ``(block_size,)`` tensors), see :mod:`.chat_layout`."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def _stamp(path: Optional[str]) -> tuple[Any, ...]:
    """``path`` and its files' sizes and times: a key that changes when the files do."""
    files = find_text_files(path, (".jsonl",))
    return (path, *((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@functools.lru_cache(maxsize=2)
def _row_counts(stamp: tuple[Any, ...], *options: Any) -> tuple[int, int]:
    """(training rows, validation rows) of :meth:`ChatDataModule.build_rows` (``options``: its
    arguments after ``path``), kept for the files of ``stamp``: the launcher's checks
    tokenize the conversations once."""
    train, val = ChatDataModule.build_rows(stamp[0], *options)
    return len(train), len(val)


class ChatDataModule(TextDataModule):
    """Chat conversations for supervised fine-tuning: loss on the assistant's tokens only.

    The tail ``val_fraction`` of the conversations (in file order) is the validation split; each
    split is laid out as ``packing`` says; the rest (global ``batch_size``, the seeded sampler,
    the training loader that resumes mid-epoch) is :class:`TextDataModule`'s. A batch is a dict:
    ``input_ids``, ``labels`` (unshifted, Hugging Face's convention) and ``position_ids``
    (packing) or ``attention_mask`` (padding), which :class:`~lightning_3d.models.HFCausalLM`
    takes as it is.

    Args:
        path: a ``.jsonl`` file, a directory of them, or a glob pattern.
        tokenizer: a directory ``AutoTokenizer.from_pretrained`` reads (a model directory).
        chat_template: a Jinja chat template, or a file holding one (``None``: the tokenizer's).
        packing: several conversations per row (``True``) or one, right-padded (``False``).
        too_long: a conversation above ``block_size``: ``"error"``, ``"truncate"`` or ``"skip"``.

    Example::

        dm = ChatDataModule(path="chats/", tokenizer="/models/qwen2-0.5b", block_size=2048,
                            batch_size=8, packing=False)
    """

    unit = "rows"
    size_option = "the conversations under data.path"

    def __init__(
        self,
        path: str,
        tokenizer: str,
        chat_template: Optional[str] = None,
        block_size: int = 1024,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        packing: bool = True,
        too_long: str = "error",
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            corpus="chat",
            block_size=block_size,
            batch_size=batch_size,
            val_fraction=val_fraction,
            max_bytes=None,
            seed=seed,
            num_workers=num_workers,
        )
        self.save_hyperparameters(ignore=["path", "corpus", "max_bytes"])
        self.hparams["data_path"] = path  # ``path`` would clash with the model's (a directory)
        if not isinstance(packing, bool):
            raise ValueError(f"data.packing={packing!r} must be true or false")
        if too_long not in TOO_LONG:
            raise ValueError(f"data.too_long={too_long!r} must be one of {', '.join(TOO_LONG)}")
        self.path, self.tokenizer_dir, self.chat_template = path, tokenizer, chat_template
        self.packing, self.too_long = packing, too_long

    def setup(self, stage: str | None = None) -> None:
        # The model is known here, before any row is built or step taken: packed rows need
        # token mixers that keep each conversation to itself.
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None:
            self.check_model(module, self.packing)
        super().setup(stage)

    def setup_for(self, dp_size: int, dp_rank: int) -> None:
        """Build both splits' rows (once) for an explicit data-parallel position."""
        self.per_rank_batch_size = self.check_batch(self.batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank ({dp_rank}) must be in [0, {dp_size})")
        self.dp_size, self.dp_rank = dp_size, dp_rank
        if self.train_dataset is None:
            train, val = self.build_rows(
                self.path,
                self.tokenizer_dir,
                self.chat_template,
                self.block_size,
                self.batch_size,
                self.val_fraction,
                self.packing,
                self.too_long,
            )
            self.train_dataset, self.val_dataset = ChatDataset(train), ChatDataset(val)

    @staticmethod
    def build_rows(
        path: Optional[str],
        tokenizer: Optional[str],
        chat_template: Optional[str],
        block_size: int,
        batch_size: int,
        val_fraction: float,
        packing: bool,
        too_long: str,
    ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
        """The training and validation rows; ``ValueError`` when either split has fewer rows
        than one global batch."""
        loaded = load_chat_tokenizer(tokenizer, chat_template)
        conversations = tokenize_conversations(
            find_text_files(path, (".jsonl",)), loaded, block_size, too_long
        )
        n_val = int(len(conversations) * val_fraction)
        pad_id = loaded.pad_token_id if loaded.pad_token_id is not None else loaded.eos_token_id
        lay_out = pack if packing else pad_rows
        splits = (
            conversations[: len(conversations) - n_val],
            conversations[len(conversations) - n_val :],
        )
        train, val = (lay_out(part, block_size, pad_id) for part in splits)
        if min(len(train), len(val)) < batch_size:
            raise ValueError(
                f"data.path={path!r}: {len(conversations)} conversations give {len(train)} "
                f"training and {len(val)} validation rows of {block_size} tokens "
                f"(data.packing={packing}), fewer than one global batch "
                f"(data.batch_size={batch_size}) in a split; add conversations or change "
                f"data.val_fraction={val_fraction}"
            )
        return train, val

    @classmethod
    def check(
        cls,
        path: Optional[str] = None,
        tokenizer: Optional[str] = None,
        chat_template: Optional[str] = None,
        block_size: int = 1024,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        packing: bool = True,
        too_long: str = "error",
        **_: Any,
    ) -> int:
        """Check every conversation in the launching process (rendered and tokenized: a bad or
        too long record is named by file and line here, not on every rank); return the
        vocabulary size the ids need (``len(tokenizer)``)."""
        for name, value in (("block_size", block_size), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"data.{name}={value!r} must be a positive integer")
        cls.split_windows(
            path, tokenizer, chat_template, block_size, batch_size, val_fraction, packing, too_long
        )
        return len(load_chat_tokenizer(tokenizer, chat_template))

    @classmethod
    def split_windows(
        cls,
        path: Optional[str] = None,
        tokenizer: Optional[str] = None,
        chat_template: Optional[str] = None,
        block_size: int = 1024,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        packing: bool = True,
        too_long: str = "error",
        **_: Any,
    ) -> tuple[int, int]:
        """(training rows, validation rows), for the launching process's checks against the
        Trainer's validation interval (the app's ``check_data_sizes``). The rows are counted
        once per launcher: :meth:`check` counted them already (without this, the
        :class:`TextDataModule` method would count the stdlib corpus instead)."""
        return _row_counts(
            _stamp(path),
            tokenizer,
            chat_template,
            block_size,
            batch_size,
            val_fraction,
            packing,
            too_long,
        )

    @staticmethod
    def check_model(model: Any, packing: bool = True, **_: Any) -> None:
        """``packing=true`` keeps each conversation of a row to itself only where every token
        mixer of the model is attention that reads the restarting positions: ``ValueError``
        naming the layer class otherwise (linear attention, Mamba, a mask built without the
        positions; :mod:`lightning_3d.families.mixers`). A model built on ``meta`` is enough."""
        if packing:
            from lightning_3d.families.mixers import check_packing

            check_packing(model)

    @staticmethod
    def check_layout(pipeline: int, packing: bool = True, context: int = 1, **_: Any) -> None:
        """Packed rows need their ``position_ids`` on every pipeline stage, which the pipeline
        does not carry: ``ValueError`` for ``packing=true`` with ``pipeline > 1``. (Context
        parallelism takes both layouts: :mod:`lightning_3d.parallel.context.batch`.)"""
        if packing and pipeline > 1:
            raise ValueError(
                f"data.packing=true needs pipeline=1 (got parallelism.pipeline={pipeline}): "
                "packed rows' positions do not reach later stages; set data.packing=false"
            )
