"""ZeRO-3's own step on gloo: FSDP2 gathers and reduce-scatters point to point (through its
custom-communication hooks) and the optimizer steps all shards with ``foreach``; both give the
one-process result, and checkpoints do not see the ``foreach`` switch (the checkpoint tests
compare saved param groups with one process's)."""

import pytest

from tools.harness.world import run_world

WORLD = 3  # odd: every shard of the 7- and 5-wide weights is padded


def _net():
    import torch
    from torch import nn

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(7, 5)
            self.blocks = nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)])
            self.head = nn.Linear(5, 3)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = torch.tanh(block(x))
            return self.head(x)

    class Outer(nn.Module):  # a LightningModule's shape: the body is its child
        def __init__(self):
            super().__init__()
            self.body = Body()

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    return Outer()


def _batches(rank: int, steps: int):
    import torch

    generator = torch.Generator().manual_seed(100 + rank)  # a different batch per rank
    return [torch.randn(4, 7, generator=generator) for _ in range(steps)]


def _train(model, optimizer, batches):
    for x in batches:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def _sharded_runs(rank: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.parallel import point_to_point
    from lightning_3d.parallel.foreach import step_shards_together
    from lightning_3d.parallel.fsdp import apply_zero3

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    out = {}
    calls = {"exchanges": 0}
    original = point_to_point.exchange

    def counted(*args, **kwargs):
        calls["exchanges"] += 1
        return original(*args, **kwargs)

    point_to_point.exchange = counted
    for scatter in ("point_to_point", "reduce_scatter"):
        calls["exchanges"] = 0
        model = _net()
        apply_zero3(model, mesh, scatter=scatter)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        switched = step_shards_together(optimizer)
        seen = []
        optimizer.register_step_pre_hook(  # runs after the switch's own pre-hook
            lambda opt, args, kwargs, seen=seen: seen.append(opt.param_groups[0]["foreach"])
        )
        _train(model, optimizer, _batches(rank, steps=3))
        out[scatter] = {
            "weights": [p.full_tensor().detach().clone() for p in model.parameters()],
            "exchanges": calls["exchanges"],
            "switched": switched,
            "foreach_in_steps": seen,
            "foreach_between": optimizer.param_groups[0]["foreach"],
        }
    point_to_point.exchange = original
    # Groups that mix plain tensors with shards, or where the user chose, are left as they are.
    plain = torch.nn.Parameter(torch.zeros(2))
    mixed = torch.optim.Adam([{"params": [plain, *model.parameters()]}], lr=0.1)
    chosen = torch.optim.Adam(model.parameters(), lr=0.1, foreach=False)
    out["mixed"] = step_shards_together(mixed), mixed.param_groups[0]["foreach"]
    out["chosen"] = step_shards_together(chosen), chosen.param_groups[0]["foreach"]
    dist.barrier()
    return out


def _one_process() -> list:
    import torch

    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_rank = [_batches(rank, steps=3) for rank in range(WORLD)]
    _train(model, optimizer, [torch.cat(step) for step in zip(*per_rank)])
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def results():
    return run_world(_sharded_runs, WORLD), _one_process()


def test_point_to_point_gather_and_scatter_match_one_process(results):
    """Every rank's gathered weights after three momentum-SGD steps (a wrong gradient scale
    shows, which Adam would normalise away) on different batches per rank equal the one-process
    run's on the concatenated batches, by the exchanges and by gloo's collectives alike. Seen
    failing against a reduce-scatter that leaves out the rank's own row or does not average,
    and against a gather that puts a peer's row in the wrong place."""
    import torch

    ranks, expected = results
    for rank, out in enumerate(ranks):
        for scatter in ("point_to_point", "reduce_scatter"):
            for index, (got, want) in enumerate(zip(out[scatter]["weights"], expected)):
                torch.testing.assert_close(
                    got, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {scatter} weight {index}"
                )


def test_gloo_units_exchange_point_to_point_only_when_asked(results):
    """Three units (two blocks and the body; the outer shell holds nothing of its own), three
    steps: each unit gathers in forward, the first block again in backward (the last block and
    the body stay gathered), and each reduce-scatters once. The exchanges count exactly that;
    ``scatter="reduce_scatter"`` makes none."""
    ranks, _ = results
    for out in ranks:
        # forward gathers: 3 units; backward regathers: the first block only; scatters: 3 units
        assert out["point_to_point"]["exchanges"] == 3 * (3 + 1 + 3)
        assert out["reduce_scatter"]["exchanges"] == 0


def test_sharded_groups_step_with_foreach_and_checkpoints_do_not_show_it(results):
    ranks, _ = results
    for out in ranks:
        for scatter in ("point_to_point", "reduce_scatter"):
            assert out[scatter]["switched"] == [0]
            assert out[scatter]["foreach_in_steps"] == [True] * 3
            assert out[scatter]["foreach_between"] is None
        assert out["mixed"] == ([], None)
        assert out["chosen"] == ([], False)


def test_an_unknown_scatter_mode_is_refused_by_both_engines():
    from lightning_3d.parallel.point_to_point import use_point_to_point

    with pytest.raises(ValueError, match="scatter must be one of .*got 'ring'"):
        use_point_to_point(None, "ring")
