"""How ZeRO 0-2 cut a param group into gradient buckets: a model smaller than four full buckets
gets four, so that most of its gradient reduction runs while backward is still going, and what
is left after backward is a quarter of it (one 25 MB bucket holding a 13 MB model used to leave
the whole reduction after backward). Two gloo ranks, stage 0 and stage 2."""

import pytest

from tools.harness.world import run_world


def _buckets(rank: int, spec: dict) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.parallel.zero import ZeroDataParallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    width, depth = spec["width"], spec["depth"]
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))
    engine = ZeroDataParallel(mesh, stage=spec["stage"], bucket_numel=spec.get("bucket_numel"))
    launched_before_last = []

    def note(_):
        launched_before_last.append(sum(b.work is not None for b in engine.buckets))

    # Backward produces the first layer's weight gradient last; this hook runs before the
    # engine's (registered first), so it sees what was on the wire before that gradient.
    model[0].weight.register_post_accumulate_grad_hook(note)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.prepare_backward(sync=True)
    model(torch.randn(4, width)).square().sum().backward()
    engine.finish_backward()
    return {
        "sizes": [b.flat.numel() for b in engine.buckets],
        "launched_before_last": launched_before_last[0],
    }


@pytest.mark.parametrize("stage", [0, 2])
def test_a_model_under_four_buckets_is_cut_in_four_and_reduces_during_backward(stage):
    # 8 layers of 512 x 512 (+ bias): 2.1 M fp32 elements, 8.4 MB, under one 25 MB bucket.
    out = run_world(_buckets, 2, {"stage": stage, "width": 512, "depth": 8})
    for rank in out:
        assert len(rank["sizes"]) == 4, rank["sizes"]
        assert max(rank["sizes"]) <= 2 * min(rank["sizes"]), rank["sizes"]
        # Three buckets were on the wire before backward reached the first layer's weight.
        assert rank["launched_before_last"] == 3, rank


def test_small_models_keep_one_bucket_and_an_explicit_size_wins():
    # 2 x (64 x 64 + 64): 33 KB, under the 1 MiB floor: one bucket, one collective.
    small = run_world(_buckets, 2, {"stage": 0, "width": 64, "depth": 2})
    assert [len(r["sizes"]) for r in small] == [1, 1]
    # bucket_numel below a quarter of the model: that size, as asked (one layer per bucket).
    given = run_world(
        _buckets, 2, {"stage": 0, "width": 512, "depth": 8, "bucket_numel": 512 * 513}
    )
    assert [len(r["sizes"]) for r in given] == [8, 8]
