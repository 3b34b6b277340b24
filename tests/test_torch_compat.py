"""torch 2.11 support: the collectives renamed in 2.13 (``lightning_3d/compat.py``) fall back to
their old names, and the ZeRO 1/2 engine trains the same way through either."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_3d import compat
from tools.harness.world import run_world

NEW = ("all_gather_single", "reduce_scatter_single")
OLD = ("all_gather_into_tensor", "reduce_scatter_tensor")
WORLD, STEPS, LR = 2, 2, 0.05


def test_newest_name_first_then_the_old_one(monkeypatch):
    calls = []
    for name in NEW + OLD:
        monkeypatch.setattr(
            dist,
            name,
            lambda *a, name=name, **kw: calls.append((name, a, kw)) or name,
            raising=False,
        )
    out, inp = torch.zeros(4), torch.ones(2)
    assert compat.all_gather_single(out, inp, group="g", async_op=True) == "all_gather_single"
    assert compat.reduce_scatter_single(inp, out, group="g") == "reduce_scatter_single"
    for name in NEW:
        monkeypatch.delattr(dist, name)
    assert compat.all_gather_single(out, inp, group="g", async_op=True) == "all_gather_into_tensor"
    assert (
        compat.reduce_scatter_single(inp, out, op=dist.ReduceOp.MAX, group="g")
        == "reduce_scatter_tensor"
    )
    # the arguments reach the old names unchanged
    assert calls[2] == ("all_gather_into_tensor", (out, inp), {"group": "g", "async_op": True})
    assert calls[3] == (
        "reduce_scatter_tensor",
        (inp, out),
        {"op": dist.ReduceOp.MAX, "group": "g", "async_op": False},
    )
    for name in OLD:
        monkeypatch.delattr(dist, name)
    with pytest.raises(AttributeError, match="all_gather_single, all_gather_into_tensor"):
        compat.all_gather_single(out, inp)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * step + rank))


def _train_with_and_without_new_names(rank: int) -> dict:
    """ZeRO 1 and 2 with the reduce-scatter collective (NCCL's path, forced on gloo): AdamW steps
    with torch's newest collective names, then again with them removed, counting which names ran."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.parallel.zero import ZeroDataParallel

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    out: dict = {"has_new_names": all(hasattr(dist, n) for n in NEW)}

    def count_calls(arm: str) -> None:
        for name in NEW + OLD:
            fn = getattr(dist, name, None)
            if fn is not None:

                def counted(*a, _fn=fn, _key=(arm, name), **kw):
                    out[_key] = out.get(_key, 0) + 1
                    return _fn(*a, **kw)

                setattr(dist, name, counted)

    def train(stage: int) -> dict:
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        # 3 buckets, padded.
        engine = ZeroDataParallel(mesh, stage=stage, bucket_numel=20, scatter="reduce_scatter")
        engine.attach(optimizer)
        for step in range(STEPS):
            engine.prepare_backward(sync=True)
            model(_batch(step, rank)).square().mean().backward()
            engine.finish_backward()
            optimizer.step()
            engine.after_step()
        states = engine.gather_param_states(optimizer)  # all-gathers the moments
        return {
            name: (p.detach().clone(), states[id(p)]["exp_avg"].clone())
            for name, p in model.named_parameters()
        }

    # the group behind a functional collective's group argument (2.13 and 2.11 resolve it by
    # different private functions; the one torch here has is used)
    group = mesh.get_group()
    out["groups"] = [
        compat.functional_process_group(g) is group
        for g in (mesh, group, (mesh, 0), group.group_name)
    ]

    count_calls("newest")
    for stage in (1, 2):
        out["newest", stage] = train(stage)
    for name in NEW:  # torch 2.11's API surface
        if hasattr(dist, name):
            delattr(dist, name)
    count_calls("fallback")
    for stage in (1, 2):
        out["fallback", stage] = train(stage)
    return out


def _one_process() -> dict:
    """The same steps on one process: every rank's batch at once (equal sizes: the mean of the
    ranks' mean losses is the mean loss of the whole batch)."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        x = torch.cat([_batch(step, r) for r in range(WORLD)])
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        name: (p.detach().clone(), optimizer.state[p]["exp_avg"].clone())
        for name, p in model.named_parameters()
    }


def test_zero_engine_on_the_old_collective_names_matches_the_new_ones_and_one_process():
    reference = _one_process()
    for rank, out in enumerate(run_world(_train_with_and_without_new_names, WORLD)):
        for stage in (1, 2):
            for name, (weight, moment) in reference.items():
                fallback_weight, fallback_moment = out["fallback", stage][name]
                newest_weight, newest_moment = out["newest", stage][name]
                torch.testing.assert_close(
                    fallback_weight, weight, rtol=1e-5, atol=1e-6, msg=f"{rank} {stage} {name}"
                )
                torch.testing.assert_close(
                    fallback_moment, moment, rtol=1e-5, atol=1e-7, msg=f"{rank} {stage} {name}"
                )
                # the same collective under another name: bit for bit the same run
                assert torch.equal(fallback_weight, newest_weight) and torch.equal(
                    fallback_moment, newest_moment
                )
        # the fallback ran the old names only; the first arm the newest names the torch has
        assert not any(out.get(("fallback", n)) for n in NEW)
        assert all(out.get(("fallback", n), 0) > 0 for n in OLD)
        first_arm = NEW if out["has_new_names"] else OLD
        assert out["groups"] == [True] * 4
        assert all(out.get(("newest", n), 0) > 0 for n in first_arm), out


def test_static_stage_shapes_are_what_this_torchs_pipeline_stage_takes(monkeypatch):
    import inspect

    import torch.distributed.pipelining as pipelining

    x, y = (torch.zeros(2, 4),), (torch.zeros(2, 3),)
    shapes = compat.static_stage_shapes(x, y)
    # every keyword binds to the installed PipelineStage (TypeError on one it does not take)
    inspect.signature(pipelining.PipelineStage.__init__).bind(
        None, nn.Linear(4, 3), 0, 2, torch.device("cpu"), **shapes
    )
    assert shapes["input_args"] is x and shapes["output_args"] is y

    class Torch211Stage:  # torch 2.11's signature: no gradient shapes
        def __init__(
            self,
            submodule,
            stage_index,
            num_stages,
            device,
            input_args=None,
            output_args=None,
            group=None,
            dw_builder=None,
        ) -> None: ...

    monkeypatch.setattr(pipelining, "PipelineStage", Torch211Stage)
    assert compat.static_stage_shapes(x, y) == {"input_args": x, "output_args": y}

    class Torch213Stage(Torch211Stage):
        def __init__(self, *args, input_grads=None, output_grads=None, **kwargs) -> None: ...

    monkeypatch.setattr(pipelining, "PipelineStage", Torch213Stage)
    assert compat.static_stage_shapes(x, y) == {
        "input_args": x,
        "output_args": y,
        "input_grads": x,
        "output_grads": y,
    }


def test_dcp_saved_metadata_knows_where_every_item_lies(tmp_path):
    """torch 2.11's ``dcp.save`` returns its Metadata without ``storage_data``; the checksums of a
    sharded checkpoint need it, so it is read back from the directory then."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    returned = dcp.save(
        {"w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True
    )
    complete = compat.dcp_saved_metadata(returned, tmp_path)
    as_on_211 = compat.dcp_saved_metadata(
        dataclasses.replace(returned, storage_data=None), tmp_path
    )
    for metadata in (complete, as_on_211):
        ((index, info),) = metadata.storage_data.items()
        assert (
            index.fqn == "w"
            and (tmp_path / info.relative_path).stat().st_size >= info.offset + info.length > 0
        )
    if returned.storage_data is not None:  # torch 2.13: what it returned, untouched
        assert complete is returned


def test_rng_neutral_stage_restores_the_generators_and_returns_what_inference_returns():
    class Stage:  # a stage whose shape inference draws, as torch 2.11's forward through dropout does
        device = torch.device("cpu")

        def _shape_inference(self, args, kwargs=None):
            return torch.rand(3), args

    neutral = compat.rng_neutral_stage(Stage)
    assert issubclass(neutral, Stage) and neutral.__name__ == "Stage"
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    drawn, args = neutral()._shape_inference(("x",))
    # Inference saw the generator as it was...
    assert torch.equal(drawn, expected) and args == ("x",)
    assert torch.equal(torch.rand(3), expected)  # ...and left it so: the next draw is the same one
    torch.manual_seed(5)
    Stage()._shape_inference(())
    assert not torch.equal(torch.rand(3), expected)  # the control: unwrapped, inference draws

    class Torch213Stage:  # no runtime shape inference by forward: nothing to wrap
        pass

    assert compat.rng_neutral_stage(Torch213Stage) is Torch213Stage


def _first_step_draws(rank: int) -> dict:
    """One pipeline stage with dropout: the value ``torch.rand`` gives after a fresh stage's first
    step (where torch 2.11 infers shapes) and after a warm stage's step, from the same seed."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo")  # run_world's environment names the store

    def after_step(stage_class, warm: bool) -> torch.Tensor:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
        schedule = ScheduleGPipe(
            stage_class(module, 0, 1, torch.device("cpu")),
            2,
            loss_fn=lambda out, target: (out - target).square().mean(),
        )
        x, y = torch.ones(4, 4), torch.zeros(4, 4)
        if warm:
            schedule.step(x, target=y)
        torch.manual_seed(1)
        schedule.step(x, target=y)
        return torch.rand(4)

    neutral = compat.rng_neutral_stage(PipelineStage)
    return {
        "infers_by_forward": hasattr(PipelineStage, "_shape_inference"),
        "fresh": after_step(neutral, warm=False),
        "warm": after_step(neutral, warm=True),
        "fresh_unwrapped": after_step(PipelineStage, warm=False),
    }


def test_a_pipeline_stages_first_step_draws_what_any_other_step_draws():
    """A resumed run restores the RNG states and then takes its first step: that step must draw
    from the generators exactly what the same step of the uninterrupted run drew."""
    (out,) = run_world(_first_step_draws, 1)
    assert torch.equal(out["fresh"], out["warm"])
    # the control: torch 2.11's own stage draws more at its first step (2.13's does not)
    assert torch.equal(out["fresh_unwrapped"], out["warm"]) != out["infers_by_forward"]
