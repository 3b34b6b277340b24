from lightning_3d.data.text import (
    ByteWindowDataset,
    TextDataModule,
    load_docs_corpus,
    load_stdlib_corpus,
    load_text_corpus,
)

__all__ = [
    "ByteWindowDataset",
    "TextDataModule",
    "load_docs_corpus",
    "load_stdlib_corpus",
    "load_text_corpus",
]
