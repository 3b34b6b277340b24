import pytest
import torch

from lightning_3d.data import (
    ByteWindowDataset,
    TextDataModule,
    load_stdlib_corpus,
    load_text_corpus,
)


def test_stdlib_corpus_deterministic_and_large():
    a = load_stdlib_corpus(max_bytes=1_500_000)
    b = load_stdlib_corpus(max_bytes=1_500_000)
    assert a == b
    assert len(a) == 1_500_000  # more than 1 MB is available
    assert b"def " in a and b"import " in a
    # A prefix request returns a prefix of the larger corpus.
    assert load_stdlib_corpus(max_bytes=1000) == a[:1000]


def test_docs_corpus_differs_from_stdlib():
    docs = load_text_corpus("docs", max_bytes=200_000)
    src = load_text_corpus("stdlib", max_bytes=200_000)
    assert len(docs) == 200_000
    assert docs != src
    assert docs == load_text_corpus("docs", max_bytes=200_000)


def test_unknown_corpus():
    with pytest.raises(ValueError, match="docs.*stdlib"):
        load_text_corpus("wikipedia")


def test_windows_shift_by_one():
    data = torch.arange(100, dtype=torch.uint8)
    ds = ByteWindowDataset(data, block_size=8)
    assert len(ds) == (100 - 9) // 8 + 1  # complete windows only
    x, y = ds[3]
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert x.tolist() == list(range(24, 32))
    assert y.tolist() == list(range(25, 33))
    last_x, last_y = ds[len(ds) - 1]
    assert last_y[-1].item() <= 99
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_windows_stride_and_short_data():
    ds = ByteWindowDataset(torch.arange(20, dtype=torch.uint8), block_size=4, stride=2)
    assert len(ds) == (20 - 5) // 2 + 1
    assert ds[1][0].tolist() == [2, 3, 4, 5]
    assert len(ByteWindowDataset(torch.zeros(4, dtype=torch.uint8), block_size=4)) == 0


def _dm(**kw) -> TextDataModule:
    args = dict(max_bytes=100_000, block_size=32, batch_size=8)
    args.update(kw)
    return TextDataModule(**args)


def _first_batch_indices(dm: TextDataModule) -> list[int]:
    return next(iter(dm.train_dataloader().batch_sampler))


def test_sampler_partition_is_layout_independent():
    single = _dm()
    single.setup_for(1, 0)
    reference = _first_batch_indices(single)
    assert len(reference) == 8

    shards = []
    for rank in range(2):
        dm = _dm()
        dm.setup_for(2, rank)
        assert dm.per_rank_batch_size == 4
        shards.append(_first_batch_indices(dm))
    assert set(shards[0]).isdisjoint(shards[1])
    assert set(shards[0]) | set(shards[1]) == set(reference)


def test_dataloader_batches():
    dm = _dm()
    dm.setup()  # no trainer: dp=1, rank 0
    assert dm.dp_size == 1 and dm.per_rank_batch_size == 8
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (8, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    vx, vy = next(iter(dm.val_dataloader()))
    assert vx.shape == (8, 32)
    # Validation is the tail of the corpus, in order.
    assert torch.equal(vx[0], dm.val_dataset[0][0])


def test_train_val_split_by_bytes():
    dm = _dm(val_fraction=0.1)
    dm.setup_for(1, 0)
    n_train = len(dm.train_dataset.data)
    n_val = len(dm.val_dataset.data)
    assert n_train + n_val == 100_000 and n_val == 10_000


def test_batch_divisibility():
    with pytest.raises(
        ValueError, match=r"global batch_size \(6\) is not divisible by data-parallel size \(4\)"
    ):
        TextDataModule.check_batch(6, 4)
    assert TextDataModule.check_batch(8, 4) == 2
    with pytest.raises(ValueError, match="not divisible"):
        _dm(batch_size=6).setup_for(4, 0)


def test_resolve_dp_from_strategy_attributes():
    class FakeStrategy:
        dp_size, dp_rank = 2, 1

    class FakeTrainer:
        strategy = FakeStrategy()
        world_size, global_rank = 8, 5

    dm = _dm()
    dm.trainer = FakeTrainer()
    assert dm._resolve_dp() == (2, 1)
    FakeTrainer.strategy = object()
    assert dm._resolve_dp() == (8, 5)
