"""``auto=True`` / ``parallelism=auto`` (lightning_3d.strategy.auto): the planner's first choice for
the world found, the options given with it as constraints, and real 2-rank CPU runs that train
the chosen layout (the strategy through ``run_world``, and the Hydra app)."""

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_3d import ThreeDStrategy
from lightning_3d.options import Plan
from lightning_3d.options.model_check import check
from lightning_3d.planner import Cluster, PlannerOptions, model_facts, plan_layouts
from lightning_3d.strategy.auto import (
    CPU_OPTIONS,
    choose,
    constraints,
    found_cluster,
    host_memory_gb,
    planned,
    planned_figures,
    record_planned,
)
from tools.harness.runs import TINY_DATA, TINY_MODEL, Run, fit_gpt
from tools.harness.world import run_world

REPO = Path(__file__).resolve().parents[1]
BATCH, SEQ = TINY_DATA["batch_size"], TINY_DATA["block_size"]
# 4 devices of 1.03 GB, 1 GB of it reserved: the tiny model's dp=4 replica (~27 MB) does not
# fit, so the first choice has to shard (ZeRO or tensor parallelism) -- not the trivial layout.
TIGHT = Cluster(nodes=1, devices_per_node=4, device_memory_gb=1.022, host_memory_gb=64)


@pytest.fixture(scope="module")
def module():
    from lightning_3d.models import LitGPT

    with torch.device("meta"):
        return LitGPT(**TINY_MODEL)


def _first(module, cluster, **options):
    facts = model_facts(
        module,
        seq_len=SEQ,
        precision="32-true",
        tp_sizes=(1, 2, 4),
        name="LitGPT",
        policies=tuple(
            dict.fromkeys(("none", *options.get("ac_policies", ("none", "selective", "full"))))
        ),
    )
    opts = PlannerOptions(batch_size=BATCH, seq_len=SEQ, precision="32-true", **options)
    return plan_layouts(facts, cluster, opts, check=functools.partial(check, module))


def test_the_choice_is_the_planners_first(module):
    best = choose(module, TIGHT, Plan.from_options(auto=True), batch_size=BATCH, seq_len=SEQ)
    first = _first(module, TIGHT)[0]
    assert first.fits and best.choice == first.choice
    assert (
        best.choice.zero_stage > 0 or best.choice.tensor > 1
    )  # the replica does not fit: it shards
    assert best.memory.total == first.memory.total and best.tokens_per_s == first.tokens_per_s
    plan = planned(Plan.from_options(auto=True, bucket_size_mb=5.0), best.choice)
    assert not plan.auto.enabled and plan.zero.bucket_size_mb == 5.0  # other options pass through
    assert (plan.layout.data, plan.layout.tensor, plan.layout.pipeline, plan.layout.zero_stage) == (
        best.choice.data,
        best.choice.tensor,
        best.choice.pipeline,
        best.choice.zero_stage,
    )


def test_options_given_with_auto_constrain_the_choice(module):
    # zero_stage / ac_policy narrow the planner's enumeration: still its first choice, of those
    best = choose(
        module,
        TIGHT,
        Plan.from_options(auto=True, zero_stage=3, ac_policy="full"),
        batch_size=BATCH,
        seq_len=SEQ,
    )
    assert best.choice == _first(module, TIGHT, zero_stages=(3,), ac_policies=("full",))[0].choice
    # sizes keep only layouts of that size
    best = choose(
        module, TIGHT, Plan.from_options(auto=True, pipeline=2), batch_size=BATCH, seq_len=SEQ
    )
    assert best.choice.pipeline == 2
    # the loader's batch is fixed: without a pipeline, micro-batches = accumulate_grad_batches
    best = choose(
        module,
        TIGHT,
        Plan.from_options(auto=True, data=4),
        batch_size=2 * BATCH,
        seq_len=SEQ,
        accumulate=2,
    )
    assert (best.choice.data, best.choice.micro_batches) == (4, 2)
    # a constraint no fitting layout meets: one sentence naming it and what the planner would run
    with pytest.raises(
        ValueError,
        match=r"no fitting layout of 4 ranks has pipeline=2, micro_batches=3.*first choice",
    ):
        choose(
            module,
            TIGHT,
            Plan.from_options(auto=True, pipeline=2, micro_batches=3),
            batch_size=BATCH,
            seq_len=SEQ,
        )


def test_values_the_planner_cannot_plan_are_refused_when_built(tmp_path):
    # NVMe is planned where the run names its drive (and only then)
    assert constraints(
        Plan.from_options(auto=True, offload="nvme", offload_path=str(tmp_path)), "cuda"
    ).planner["offloads"] == ("nvme", "nvme+params")
    assert not any(
        o.startswith("nvme")
        for o in constraints(Plan.from_options(auto=True), "cuda").planner["offloads"]
    )
    assert constraints(
        Plan.from_options(
            auto=True, tensor=2, sequence_parallel=True, schedule="zero_bubble", virtual_stages=2
        )
    ).sizes == {"tensor": 2, "sequence_parallel": True}
    with pytest.raises(ValueError, match=r"auto=True cannot plan ac_policy='every_n'"):
        ThreeDStrategy(auto=True, ac_policy="every_n")
    with pytest.raises(ValueError, match=r"auto='yes' must be True or False"):
        ThreeDStrategy(auto="yes")
    # CPU ranks share the host: offload is not enumerated unless asked for
    assert constraints(Plan.from_options(auto=True), "cpu").planner["offloads"] == ("none",)
    assert constraints(
        Plan.from_options(auto=True, zero_stage=3, offload="cpu", offload_params=True), "cpu"
    ).planner == {"zero_stages": (3,), "offloads": ("cpu+params",)}


def test_the_cpu_cluster_is_the_host_shared_by_its_ranks():
    cluster = found_cluster(4, 2, "cpu")
    assert (cluster.nodes, cluster.devices_per_node, cluster.world_size) == (2, 4, 8)
    assert cluster.device_memory_gb == pytest.approx(host_memory_gb() / 4)


def test_the_predictions_are_recorded_as_json_next_to_the_measured(module, tmp_path):
    """``planned_figures``: the choice's options and predicted parts, as JSON; ``record_planned``
    adds them to a written summary.json, keeping what was measured."""
    best = choose(module, TIGHT, Plan.from_options(auto=True), batch_size=BATCH, seq_len=SEQ)
    figures = json.loads(json.dumps(planned_figures(best, TIGHT)))
    assert Plan.from_options(
        **{
            k: v
            for k, v in figures["layout"].items()
            if k not in ("micro_batches", "batch_per_rank")
        }
    )
    assert (figures["layout"]["zero_stage"], figures["layout"]["tensor"]) == (
        best.choice.zero_stage,
        best.choice.tensor,
    )
    mem, time = figures["memory_bytes"], figures["step_time_s"]
    for key in (
        "params",
        "grads",
        "optimizer",
        "activations",
        "buffers",
        "host",
        "total",
    ):  # the candidate's own
        assert mem[key] == pytest.approx(getattr(best.memory, key)), key
    for key in ("compute", "comm", "bubble", "offload", "optimizer", "total"):
        assert time[key] == pytest.approx(getattr(best.time, key)), key
    assert time["total"] > 0 and mem["total"] > 0
    assert figures["tokens_per_s"] == pytest.approx(best.tokens_per_s)
    assert figures["cluster"]["devices_per_node"] == 4
    path = tmp_path / "summary.json"
    record_planned(path, figures)  # no summary written: nothing to add to
    assert not path.exists()
    path.write_text(json.dumps({"tokens_per_s": 123.0}))
    record_planned(path, figures)
    assert json.loads(path.read_text()) == {"tokens_per_s": 123.0, "planned": figures}


def test_a_two_rank_auto_run_trains_the_chosen_layout(module, capfd):
    """``ThreeDStrategy(auto=True, zero_stage=2)`` on 2 CPU ranks: rank 0 plans (the same choice as
    the planner here, for the cluster found), every rank trains it, rank 0 logs it once."""
    out = run_world(fit_gpt, 2, Run(strategy={"auto": True, "zero_stage": 2}, devices=2, steps=3))
    cluster = found_cluster(2, 1, "cpu")
    best = choose(
        module,
        cluster,
        Plan.from_options(auto=True, zero_stage=2),
        batch_size=BATCH,
        seq_len=SEQ,
        device_type="cpu",
    )
    assert (
        best.choice
        == _first(module, cluster, zero_stages=(2,), offloads=("none",), **CPU_OPTIONS)[0].choice
    )
    expected = json.loads(json.dumps(planned_figures(best, cluster)))
    for rank in out:
        # the predictions, next to the measured figures (RunSummary reads the strategy's planned)
        assert rank["summary"]["planned"]["layout"] == expected["layout"]
        assert rank["summary"]["planned"]["step_time_s"] == pytest.approx(expected["step_time_s"])
        layout = rank["summary"]["layout"]
        assert (layout["data"], layout["tensor"], layout["pipeline"], layout["zero_stage"]) == (
            best.choice.data,
            best.choice.tensor,
            best.choice.pipeline,
            2,
        )
        assert len(rank["losses"]) == 3 and rank["losses"][-1] < rank["losses"][0]
    logged = re.findall(
        r"auto: dp=(\d+) x tp=(\d+) x pp=(\d+), ZeRO stage (\d+).*tokens/s", capfd.readouterr().err
    )
    assert logged == [
        tuple(str(v) for v in (best.choice.data, best.choice.tensor, best.choice.pipeline, 2))
    ]


def test_the_app_runs_parallelism_auto(tmp_path):
    """``python examples/train.py parallelism=auto``: chosen in the launching process, logged once,
    and the ranks train it (summary.json names the layout and carries the prediction)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_PROCID")
    }
    args = [
        "parallelism=auto",
        "parallelism.zero_stage=1",
        "model=gpt_tiny",
        f"data.batch_size={BATCH}",
        "data.max_bytes=300000",
        "trainer.limit_val_batches=0",
        "trainer.max_steps=3",
        "checkpoint.every_n_steps=null",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples/train.py"), *args],
        cwd=tmp_path,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(
        r"auto: dp=(\d+) x tp=(\d+) x pp=(\d+), ZeRO stage (\d+)", proc.stdout + proc.stderr
    )
    assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    layout = summary["layout"]
    assert tuple(str(layout[k]) for k in ("data", "tensor", "pipeline", "zero_stage")) == lines[0]
    assert layout["zero_stage"] == 1
    planned = summary["planned"]  # the launcher's prediction, next to what the ranks measured
    assert planned["layout"]["zero_stage"] == 1 and planned["layout"]["data"] == layout["data"]
    assert planned["step_time_s"]["total"] > 0 and planned["memory_bytes"]["total"] > 0


LONG = 1024  # tokens per sample of the tiny GPT below: one sequence per step on 2 ranks


def _long_choice(module_long, memory_gb=None, **options):
    return choose(
        module_long,
        found_cluster(2, 1, "cpu"),
        Plan.from_options(auto=True, auto_memory_gb=memory_gb, **options),
        batch_size=1,
        seq_len=LONG,
        device_type="cpu",
    )


@pytest.fixture(scope="module")
def module_long():
    from lightning_3d.models import LitGPT

    with torch.device("meta"):
        return LitGPT(**{**TINY_MODEL, "block_size": LONG})


def _split_budget(module_long) -> float:
    """GB between the least a layout needs unsplit and the least one split over 2 ranks needs,
    both counted with the chunked loss (CPU ``auto`` may climb it, at tensor 2 too)."""
    opts = PlannerOptions(
        batch_size=1,
        seq_len=LONG,
        precision="32-true",
        offloads=("none",),
        loss_chunks="auto",
        **CPU_OPTIONS,
    )
    facts = model_facts(module_long, seq_len=LONG, precision="32-true", tp_sizes=(1, 2))
    cands = plan_layouts(
        facts, found_cluster(2, 1, "cpu"), opts, check=functools.partial(check, module_long)
    )
    need = {
        cp: min(c.memory.total for c in cands if c.fits and c.choice.context == cp) for cp in (1, 2)
    }
    assert need[2] < need[1]
    return (need[1] + need[2]) / 2 / 1e9


def test_auto_splits_the_sequence_where_only_that_fits(module_long):
    """``auto_memory_gb`` between what the unsplit and the split layouts need: without the
    context axis nothing fits; ``auto`` chooses a split (and keeps a context constraint)."""
    budget = _split_budget(module_long)
    with pytest.raises(ValueError, match="auto: "):
        choose(
            module_long,
            found_cluster(2, 1, "cpu"),
            Plan.from_options(auto=True, auto_memory_gb=budget),
            batch_size=1,
            seq_len=LONG,
            device_type="cpu",
            context_sizes=(1,),
        )
    best = _long_choice(module_long, budget)
    assert best.choice.context == 2 and best.memory.total <= budget * 1e9
    plan = planned(Plan.from_options(auto=True, auto_memory_gb=budget), best.choice)
    assert (plan.layout.context, plan.cp.scheme) == (2, best.choice.context_scheme)
    assert _long_choice(module_long, context=2).choice.context == 2
    # compile and sequence parallelism compose with context: they leave the choice as it is
    assert _long_choice(module_long, budget, compile=True).choice == best.choice
    with pytest.raises(ValueError, match=r"auto_memory_gb=-1 must be a positive number"):
        Plan.from_options(auto=True, auto_memory_gb=-1)


def test_a_two_rank_auto_run_splits_a_long_sequence(module_long, capfd):
    """``ThreeDStrategy(auto=True, auto_memory_gb=...)`` on 2 CPU ranks with a budget only a split
    sequence fits: every rank trains at context 2, and rank 0 logs the split once."""
    budget = _split_budget(module_long)
    best = _long_choice(module_long, budget)
    out = run_world(
        fit_gpt,
        2,
        Run(
            strategy={"auto": True, "auto_memory_gb": budget},
            devices=2,
            steps=4,
            model={"block_size": LONG},
            data={"block_size": LONG, "batch_size": 1},
        ),
    )
    for rank in out:
        assert rank["summary"]["layout"]["context"] == 2
        assert rank["summary"]["planned"]["layout"]["context"] == 2
        losses = rank["losses"]
        assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
        assert losses[-1] < losses[0]
    assert out[0]["losses"] == out[1]["losses"]  # the two halves of one sequence: one loss
    logged = re.findall(r"auto: dp=1 x tp=1 x pp=1, .*context 2 \((\w+)\)", capfd.readouterr().err)
    assert logged == [best.choice.context_scheme]


def test_the_apps_choice_hands_the_split_to_the_ranks():
    """``parallelism=auto`` in the app's launcher: a choice that splits sequences reaches the
    ranks as ``parallelism.context`` and ``parallelism.context_scheme`` overrides (without them
    the ranks would run the unsplit layout the launcher did not choose)."""
    from dataclasses import replace

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lightning_3d.app.config import CONF_DIR, register_configs
    from lightning_3d.app.run import model_on_meta
    from lightning_3d.app.spec import read_spec, with_auto

    register_configs()
    overrides = ["parallelism=auto", "model=gpt_tiny", f"model.block_size={LONG}"]
    overrides += [f"data.block_size={LONG}", "data.batch_size=1", "trainer.devices=2"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        spec = read_spec(compose("train", overrides=overrides))
    model = model_on_meta(spec.model)
    spec = replace(spec, plan=spec.plan.updated(auto_memory_gb=_split_budget(model)))
    chosen, given, planned_ = with_auto(spec, model)
    assert chosen.plan.layout.context == 2 and not chosen.plan.auto.enabled
    assert "parallelism.context=2" in given
    assert f"parallelism.context_scheme={chosen.plan.cp.scheme}" in given
    assert planned_["layout"]["context"] == 2
    # chat data's dict batches are split too (packed or padded rows)
    chat = {"_target_": "lightning_3d.data.ChatDataModule", "block_size": LONG, "batch_size": 1}
    chat = OmegaConf.create(chat)
    chosen, given, _ = with_auto(replace(spec, data=chat), model)
    assert chosen.plan.layout.context == 2 and "parallelism.context=2" in given
    # data whose batches context parallelism cannot split: planned unsplit (here nothing fits)
    unsplit = {"_target_": f"{__name__}.UnsplitData", "block_size": LONG, "batch_size": 1}
    with pytest.raises(ValueError, match="auto: "):
        with_auto(replace(spec, data=OmegaConf.create(unsplit)), model)


def test_the_apps_choice_plans_with_accumulate_grad_batches():
    """Catches: ``parallelism=auto`` in the app's launcher (``with_auto``) planning without
    ``trainer.accumulate_grad_batches`` (always 1), so at 4 accumulation steps the chosen layout,
    its tokens per step and its recorded predictions are 4x off. At 4: 4 micro-batches of the
    loader's batch per optimizer step, 4x the samples per rank, activations of one micro-batch."""
    from lightning_3d.app.run import model_on_meta
    from lightning_3d.app.spec import read_spec, with_auto
    from tools.harness.apps import compose_config

    planned_ = {}
    for accumulate in (1, 4):
        overrides = ["parallelism=auto", "model=gpt_tiny", "trainer.devices=2"]
        overrides.append(f"trainer.accumulate_grad_batches={accumulate}")
        spec = read_spec(compose_config("train", *overrides))
        planned_[accumulate] = with_auto(spec, model_on_meta(spec.model))[2]
    one, four = planned_[1]["layout"], planned_[4]["layout"]
    assert (one["micro_batches"], four["micro_batches"]) == (1, 4)
    assert four["batch_per_rank"] == 4 * one["batch_per_rank"]
    assert planned_[4]["memory_bytes"]["activations"] == planned_[1]["memory_bytes"]["activations"]


class UnsplitData:
    """A data module whose ``check_layout`` refuses context parallelism."""

    @staticmethod
    def check_layout(pipeline: int, context: int = 1, **_) -> None:
        if context > 1:
            raise ValueError(f"context={context}: these batches cannot be split")
