"""A tokenizer with a chat template and a file of conversations, built without downloads, for
runs on ``data=chat`` rows (a word-level vocabulary of 22 entries: any tiny model's fits); and
a byte-level BPE tokenizer (as Qwen2's and Llama 3's: whitespace is tokens too)."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = "the quick brown fox jumps over a lazy dog while seven small cats watch".split()
SPECIALS = ["<unk>", "<eos>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "tool"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def words(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(n))


def conversation(i: int) -> dict:
    """Conversation ``i``: one or two exchanges, with a system prompt every other one."""
    messages = [
        {"role": "user", "content": words(i, 2 + i % 3)},
        {"role": "assistant", "content": words(i + 1, 1 + i % 4)},
    ]
    if i % 2:
        messages = [
            {"role": "system", "content": words(i + 2, 2)},
            *messages,
            {"role": "user", "content": words(i + 3, 2)},
            {"role": "assistant", "content": words(i + 4, 3)},
        ]
    return {"messages": messages}


def write_chat_files(root: Path, conversations: int = 60) -> dict[str, str]:
    """``tokenizer`` (a directory) and ``path`` (a ``.jsonl`` file) under ``root``: the keys
    :class:`~lightning_3d.data.ChatDataModule` takes them by."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML
    fast.save_pretrained(root / "tokenizer")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(conversations)))
    return {"tokenizer": str(root / "tokenizer"), "path": str(chats)}


def byte_level_tokenizer(template: str = CHATML):
    """A tiny byte-level BPE tokenizer (GPT-2's byte alphabet, a few hundred merges trained on
    :data:`WORDS` and the role names) with ``<|im_start|>`` / ``<|im_end|>`` special tokens and
    ``template``: unlike the word-level one, every newline of the rendered chat is a token
    (``Ċ``), so labels that run past an end-of-turn token show."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(WORDS), " ".join(SPECIALS[4:])], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.add_special_tokens({"additional_special_tokens": specials[1:]})
    fast.chat_template = template
    return fast


def write_model_dir(root: Path, family: str = "llama") -> str:
    """A tiny random ``family`` model saved with :func:`write_chat_files`'s tokenizer: a
    directory ``model.path`` and ``data.tokenizer`` can both name."""
    import torch

    from lightning_3d.models.hf import build_hf_model
    from tools.harness.hf_configs import tiny_hf_config

    files = write_chat_files(root)
    torch.manual_seed(0)
    model = build_hf_model(None, tiny_hf_config(family, vocab_size=32))
    model.save_pretrained(root / "model")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(files["tokenizer"]).save_pretrained(root / "model")
    return str(root / "model")
