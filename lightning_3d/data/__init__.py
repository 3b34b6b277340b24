from lightning_3d.data.chat import ChatDataModule
from lightning_3d.data.text import (
    ByteWindowDataset,
    TextDataModule,
    load_docs_corpus,
    load_stdlib_corpus,
    load_text_corpus,
)
from lightning_3d.data.tokenized import TokenizedTextDataModule

__all__ = [
    "ByteWindowDataset",
    "ChatDataModule",
    "TextDataModule",
    "TokenizedTextDataModule",
    "load_docs_corpus",
    "load_stdlib_corpus",
    "load_text_corpus",
]
