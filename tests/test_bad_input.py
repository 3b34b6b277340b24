"""Bad input to the strategy, the Trainer and the app's validation fails early, by name, without side effects."""

import os

import lightning as L
import pytest
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry

import lightning_3d  # noqa: F401  (registers the "3d*" strategies)
from lightning_3d import ThreeDStrategy
from lightning_3d.app.config import ParallelismConfig, build_strategy, world_size_of
from lightning_3d.data import TextDataModule


def _quiet_trainer(**kwargs):
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


# ------------------------------------------------------------------ strategy constructor
def test_unknown_option_is_named():
    with pytest.raises(ValueError) as err:
        ThreeDStrategy(zero_stag=2)
    message = str(err.value)
    assert "zero_stag" in message
    assert "zero_stage" in message  # the valid options are listed


def test_several_unknown_options_are_all_named():
    with pytest.raises(ValueError) as err:
        ThreeDStrategy(foo=1, offload="cpu")
    assert "foo" in str(err.value) and "offload" in str(err.value)


def test_bad_values_of_several_groups_are_all_named_at_once():
    """A pipeline schedule, a checkpointing policy, an offload device and a timeout, all wrong:
    one error names the four (the groups that fill in defaults used to stop at the first)."""
    with pytest.raises(ValueError) as err:
        ThreeDStrategy(pipeline=2, schedule="bogus", ac_policy="nope", offload="tape", timeout_s=-1)
    for named in ("'bogus'", "'nope'", "offload='tape'", "timeout_s"):
        assert named in str(err.value), str(err.value)


@pytest.mark.parametrize("stage", [5, -1, "3"])
def test_bad_zero_stage(stage):
    with pytest.raises(ValueError, match=rf"zero_stage={stage!r}"):
        ThreeDStrategy(zero_stage=stage)


@pytest.mark.parametrize(
    "kwargs, named", [(dict(tensor=0), "tensor=0"), (dict(data=-2), "data=-2")]
)
def test_bad_sizes(kwargs, named):
    with pytest.raises(ValueError, match=named):
        ThreeDStrategy(**kwargs)


@pytest.mark.parametrize("size", [0, -1.0])
def test_bad_bucket_size(size):
    with pytest.raises(ValueError, match="bucket_size_mb"):
        ThreeDStrategy(bucket_size_mb=size)


def test_bad_checkpoint_format():
    with pytest.raises(
        ValueError,
        match=r"checkpoint_format must be one of \('consolidated', 'sharded'\), got 'dcp'",
    ):
        ThreeDStrategy(checkpoint_format="dcp")


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(offload="cpu", offload_params=True, zero_stage=2), "zero_stage=2 and offload='cpu'"),
        (dict(offload_params=True, zero_stage=3), "zero_stage=3 and offload='none'"),
        (dict(offload="cpu", offload_params="yes", zero_stage=3), "offload_params='yes'"),
    ],
)
def test_bad_parameter_offload(kwargs, named):
    with pytest.raises(ValueError, match=named):
        ThreeDStrategy(**kwargs)


def test_good_options_are_kept():
    strategy = ThreeDStrategy(data=2, tensor=1, pipeline=1, zero_stage=2, bucket_size_mb=1.5)
    assert strategy.layout.zero_stage == 2 and strategy.layout.data == 2
    with pytest.raises(RuntimeError, match="device mesh"):
        _ = strategy.device_mesh  # only exists after the processes have started


# ------------------------------------------------------------------ Trainer construction
def test_trainer_rejects_layout_that_does_not_tile_world(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        L.Trainer(
            accelerator="cpu",
            devices=3,
            strategy=ThreeDStrategy(tensor=2),
            default_root_dir=tmp_path,
        )
    message = str(err.value)
    assert "tensor(2)" in message
    assert "world size 3" in message
    assert not dist.is_initialized()
    assert list(tmp_path.iterdir()) == []  # no logs, checkpoints or other files
    assert "LOCAL_RANK" not in os.environ  # no launcher set up a world


def test_trainer_counts_nodes_in_world_size(tmp_path):
    with pytest.raises(ValueError, match=r"tensor\(3\) = 3 does not divide world size 4"):
        _quiet_trainer(
            devices=2, num_nodes=2, strategy=ThreeDStrategy(tensor=3), default_root_dir=tmp_path
        )
    assert not dist.is_initialized()


def test_trainer_rejects_explicit_data_size(tmp_path):
    with pytest.raises(
        ValueError, match=r"data\(4\) \* tensor\(1\) = 4 does not equal world size 2"
    ):
        _quiet_trainer(devices=2, strategy=ThreeDStrategy(data=4), default_root_dir=tmp_path)


def test_trainer_resolves_layout_at_construction(tmp_path):
    trainer = _quiet_trainer(
        devices=2, strategy=ThreeDStrategy(zero_stage=1), default_root_dir=tmp_path
    )
    assert trainer.strategy.layout.data == 2
    assert trainer.strategy.layout.zero_stage == 1
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "name, stage", [("3d", 0), ("3d_zero1", 1), ("3d_zero2", 2), ("3d_zero3", 3)]
)
def test_registered_strategy_names(name, stage, tmp_path):
    assert name in StrategyRegistry
    trainer = _quiet_trainer(devices=1, strategy=name, default_root_dir=tmp_path)
    assert isinstance(trainer.strategy, ThreeDStrategy)
    assert trainer.strategy.layout.zero_stage == stage
    assert trainer.strategy.layout.data == 1
    assert not dist.is_initialized()


# ------------------------------------------------------------------ global batch
def test_check_batch_not_divisible():
    with pytest.raises(ValueError) as err:
        TextDataModule.check_batch(10, 4)
    assert "(10)" in str(err.value) and "(4)" in str(err.value)


@pytest.mark.parametrize("batch, dp, per_rank", [(8, 4, 2), (8, 1, 8), (6, 6, 1)])
def test_check_batch_divisible(batch, dp, per_rank):
    assert TextDataModule.check_batch(batch, dp) == per_rank


def test_check_batch_zero_dp():
    with pytest.raises(ValueError):
        TextDataModule.check_batch(8, 0)


# ------------------------------------------------------------------ the app's config checks (in process)
@pytest.fixture
def compose():
    from tools.harness.apps import compose_config

    return lambda *overrides: compose_config("train", *overrides)


def test_validate_accepts_default_config(compose):
    from lightning_3d.app.run import validate

    validate(compose())  # no exception
    # 30 % dp(2) == 0.
    validate(compose("trainer.devices=4", "parallelism.tensor=2", "data.batch_size=30"))
    # The epochs decide; the schedule too.
    validate(compose("trainer.max_steps=-1", "+trainer.max_epochs=1"))


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["data.batch_size=30", "trainer.devices=4"], ["(30)", "(4)"]),
        (["parallelism.tensor=2", "trainer.devices=3"], ["tensor(2)", "world size 3"]),
        (["parallelism.zero_stage=7"], ["zero_stage=7"]),
        (["parallelism.data=0"], ["data=0"]),
        (["trainer.devices=auto"], ["'auto'"]),
        (["offload.device=disk"], ["offload='disk'"]),
        (["offload=nvme", "offload.path=/no/such/dir"], ["'/no/such/dir' does not exist"]),
        (
            ["offload=cpu", "offload.params=true"],
            ["offload_params=True needs zero_stage=3", "zero_stage=0"],
        ),
        (["parallelism.ac_policy=half"], ["policy 'half'"]),
        (["parallelism.checkpoint_format=zip"], ["checkpoint_format", "'zip'"]),
        # the tensor-parallel plan is checked against the model's shapes (built on meta)
        (
            ["parallelism.tensor=2", "trainer.devices=2", "model.n_head=3", "model.n_embd=48"],
            ["heads 3", "tensor=2"],
        ),
        (
            ["parallelism.tensor=2", "trainer.devices=2", "model.vocab_size=255"],
            ["vocabulary) 255", "tensor=2"],
        ),
        (
            [
                "parallelism.tensor=2",
                "trainer.devices=2",
                "parallelism.tp_plan={model.nothing.*:colwise}",
            ],
            ["model.nothing.*", "match no module"],
        ),
        (
            [
                "parallelism.tensor=2",
                "trainer.devices=2",
                "parallelism.tp_plan={model.blocks.*.attn.wq:diagonal}",
            ],
            ["unknown parallel style 'diagonal'"],
        ),
        # the pipeline split is checked against the model (built on meta)
        (
            ["parallelism=pp2", "parallelism.split=[model.blocks.9]"],
            ["'model.blocks.9' names no module"],
        ),
        (["parallelism=pp2", "parallelism.split=zigzag"], ["unknown pipeline split 'zigzag'"]),
        (
            ["parallelism=pp2", "parallelism.schedule=interleaved_1f1b", "model.n_layer=3"],
            ["4 pipeline stages for 3 blocks"],
        ),
        # values the ranks used to meet first (a traceback each), or took silently
        (["seed=abc"], ["seed='abc'", "whole number"]),
        (
            ["offload=nvme", "offload.path="],
            ["offload path '' is empty"],
        ),  # was: the working directory
        (["seed=1.5"], ["seed=1.5"]),
        (["seed=-1"], ["seed=-1"]),
        (["model.lr=-0.1"], ["lr=-0.1 must be a number > 0"]),
        (["+model.betas=[0.9,1.5]"], ["betas=[0.9, 1.5]"]),
        (["data.batch_size=2.5"], ["batch_size must be a whole number >= 1, got 2.5"]),
        (["trainer.max_steps=2.5"], ["trainer.max_steps=2.5 must be an integer"]),
        (["+trainer.max_epochs=1.5"], ["trainer.max_epochs=1.5 must be an integer"]),
        (
            ["model=hf", "model.path=null", "+model.config={model_type:llama}", "model.lr=0"],
            ["lr=0 must be a number > 0"],
        ),
    ],
)
def test_validate_rejects(compose, overrides, named):
    from lightning_3d.app.run import validate

    with pytest.raises(ValueError) as err:
        validate(compose(*overrides))
    for part in named:
        assert part in str(err.value)


def test_an_old_option_name_is_an_unknown_key(compose):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="activation_checkpointing"):
        compose("parallelism.activation_checkpointing=full")


def test_explicit_tp_plan_from_hydra_builds_the_styles(compose):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_3d.app.run import validate

    cfg = compose(
        "parallelism.tensor=2",
        "trainer.devices=2",
        "parallelism.tp_plan={model.blocks.*.mlp.fc1:colwise,model.blocks.*.mlp.fc2:rowwise}",
    )
    validate(cfg)  # both patterns match, 512 hidden units split in 2
    strategy = build_strategy(cfg.parallelism)
    assert set(strategy.plan.tp.plan) == {"model.blocks.*.mlp.fc1", "model.blocks.*.mlp.fc2"}
    from lightning_3d.parallel.plans import plan_from_names

    styles = plan_from_names(strategy.plan.tp.plan)
    assert isinstance(styles["model.blocks.*.mlp.fc1"], ColwiseParallel)
    assert isinstance(styles["model.blocks.*.mlp.fc2"], RowwiseParallel)


def test_world_size_of():
    assert world_size_of({"devices": 2}) == 2
    assert world_size_of({"devices": [0, 1, 2], "num_nodes": 2}) == 6
    for devices in (0, "auto", True):
        with pytest.raises(ValueError, match="trainer.devices"):
            world_size_of({"devices": devices})
    with pytest.raises(ValueError, match="trainer.num_nodes"):
        world_size_of({"devices": 1, "num_nodes": 0})


def test_build_strategy_from_dataclass_and_mapping():
    assert build_strategy(ParallelismConfig(zero_stage=3)).layout.zero_stage == 3
    assert build_strategy({"tensor": 2}).layout.tensor == 2
    with pytest.raises(ValueError, match="foo"):
        build_strategy({"foo": 1})
