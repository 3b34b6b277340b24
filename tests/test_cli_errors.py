"""The Hydra app's failure paths: every bad value is refused before any rank starts (one
``error:`` line, exit code 2, no run directory), a run never reuses another's directory, and a
sweep runs every job and reports the failed ones.

The table below (71 bad values) is checked in process through Hydra's ``compose`` and
:func:`lightning_3d.app.run.validate` (~0.1 s each); the ``CLI`` dozen also through
``python examples/train.py`` as a user runs it (~10 s each, all started together).
"""

import errno
from pathlib import Path

import pytest

from tools.harness.apps import compose_config, start_app, wait_all

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train.py"
SMALL = [
    "model=gpt_tiny",
    "data.batch_size=4",
    "data.max_bytes=100000",
    "trainer.limit_val_batches=0",
    "trainer.devices=1",
    "trainer.max_steps=2",
]

# id -> (overrides, substrings of the error). "hydra:" ids are Hydra's own errors (compose fails).
BAD = {
    # ---- the layout and the strategy's options
    "zero_stage_7": (["parallelism.zero_stage=7"], ["zero_stage=7"]),
    "zero_stage_negative": (["parallelism.zero_stage=-1"], ["zero_stage=-1"]),
    "data_zero": (["parallelism.data=0"], ["data=0"]),
    "tensor_zero": (["parallelism.tensor=0"], ["tensor=0"]),
    "pipeline_zero": (["parallelism.pipeline=0"], ["pipeline=0"]),
    "tensor_does_not_divide_world": (
        ["parallelism.tensor=2", "trainer.devices=3"],
        ["tensor(2)", "world size 3"],
    ),
    "pipeline_does_not_divide_world": (["parallelism.pipeline=3"], ["pipeline", "3"]),
    "sequence_parallel_without_tensor": (
        ["parallelism.sequence_parallel=true"],
        ["sequence_parallel=True needs tensor > 1"],
    ),
    "ac_policy": (["parallelism.ac_policy=half"], ["policy 'half'"]),
    "checkpoint_format": (["parallelism.checkpoint_format=zip"], ["checkpoint_format", "'zip'"]),
    "bucket_size": (["parallelism.bucket_size_mb=0"], ["bucket_size_mb"]),
    "timeout": (["parallelism.timeout_s=0"], ["timeout_s"]),
    "pipeline_split": (
        ["parallelism=pp2", "parallelism.split=zigzag"],
        ["unknown pipeline split 'zigzag'"],
    ),
    "pipeline_split_module": (
        ["parallelism=pp2", "parallelism.split=[model.blocks.9]"],
        ["'model.blocks.9'"],
    ),
    "micro_batches": (["parallelism=pp2", "parallelism.micro_batches=3"], ["micro_batches=3"]),
    "interleaved_blocks": (
        ["parallelism=pp2", "parallelism.schedule=interleaved_1f1b", "model.n_layer=3"],
        ["4 pipeline stages for 3 blocks"],
    ),
    "tensor_heads": (
        ["parallelism.tensor=2", "trainer.devices=2", "model.n_head=3", "model.n_embd=48"],
        ["heads 3", "tensor=2"],
    ),
    "tensor_vocab": (
        ["parallelism.tensor=2", "trainer.devices=2", "model.vocab_size=255"],
        ["255", "tensor=2"],
    ),
    "tp_plan_pattern": (
        [
            "parallelism.tensor=2",
            "trainer.devices=2",
            "parallelism.tp_plan={model.nothing.*:colwise}",
        ],
        ["model.nothing.*", "match no module"],
    ),
    "tp_plan_style": (
        [
            "parallelism.tensor=2",
            "trainer.devices=2",
            "parallelism.tp_plan={model.blocks.*.attn.wq:diagonal}",
        ],
        ["'diagonal'"],
    ),
    # ---- offload
    "offload_device": (["offload.device=disk"], ["'disk'"]),
    "offload_path_missing": (
        ["offload=nvme", "offload.path=/no/such/dir"],
        ["'/no/such/dir' does not exist"],
    ),
    "offload_path_full": (
        ["offload=nvme", "offload.path=/proc"],
        ["'/proc'"],
    ),  # no room: 0 bytes free
    "offload_params_stage": (
        ["offload=cpu", "offload.params=true"],
        ["offload_params=True needs zero_stage=3"],
    ),
    "offload_chunk": (["offload=nvme", "offload.chunk_mb=0"], ["chunk_mb"]),
    # ---- the Trainer's arguments
    "devices_zero": (["trainer.devices=0"], ["trainer.devices=0"]),
    "devices_auto": (["trainer.devices=auto"], ["'auto'"]),
    "num_nodes_zero": (["trainer.num_nodes=0"], ["trainer.num_nodes=0"]),
    "precision": (["trainer.precision=fp8"], ["'fp8'"]),
    "max_steps_negative": (["trainer.max_steps=-5"], ["max_steps=-5"]),
    "max_steps_zero": (["trainer.max_steps=0"], ["max_steps=0"]),
    "accumulate_zero": (["trainer.accumulate_grad_batches=0"], ["accumulate_grad_batches=0"]),
    "accumulate_negative": (["trainer.accumulate_grad_batches=-2"], ["accumulate_grad_batches=-2"]),
    "val_check_interval": (["trainer.val_check_interval=-1"], ["val_check_interval"]),
    "val_check_interval_text": (
        ["trainer.val_check_interval=often"],
        ["val_check_interval", "'often'"],
    ),
    "limit_val_batches": (["trainer.limit_val_batches=-1"], ["limit_val_batches"]),
    "gradient_clip_val": (["trainer.gradient_clip_val=-1"], ["gradient_clip_val=-1"]),
    "gradient_clip_algorithm": (
        ["+trainer.gradient_clip_algorithm=sideways"],
        ["gradient_clip_algorithm", "sideways"],
    ),
    "max_epochs": (["+trainer.max_epochs=-5"], ["max_epochs", "-5"]),
    "log_every_n_steps": (["trainer.log_every_n_steps=-1"], ["log_every_n_steps=-1"]),
    "num_sanity_val_steps": (["trainer.num_sanity_val_steps=-5"], ["num_sanity_val_steps=-5"]),
    "trainer_unknown_argument": (["+trainer.foo=1"], ["foo"]),
    "accelerator": (["trainer.accelerator=abacus"], ["abacus"]),
    # ---- the model (built on meta in the launching process)
    "model_target": (
        ["model._target_=does.not.Exist"],
        ["model._target_='does.not.Exist'", "No module named 'does'"],
    ),
    "model_block_size": (["model.block_size=0"], ["block_size", "0"]),
    "model_dropout": (["model.dropout=2"], ["dropout", "2"]),
    "model_layers": (["model.n_layer=0"], ["n_layer", "0"]),
    "model_heads_zero": (["model.n_head=0"], ["n_head", "0"]),
    "model_vocab": (["model.vocab_size=0"], ["vocab_size", "0"]),
    "model_embd": (["model.n_embd=-1"], ["n_embd", "-1"]),
    "model_unknown_key": (["+model.foo=1"], ["model.foo", "not a parameter"]),
    "model_hf_nothing": (["model=hf"], ["neither is set"]),
    "model_hf_path": (
        ["model=hf", "model.path=/no/such/model"],
        ["'/no/such/model' is not a directory"],
    ),
    # ---- the data (its module built, nothing read)
    "batch_zero": (["data.batch_size=0"], ["batch_size", "0"]),
    "batch_not_divisible": (["data.batch_size=30", "trainer.devices=4"], ["(30)", "(4)"]),
    "val_fraction_high": (["data.val_fraction=1.5"], ["val_fraction", "1.5"]),
    "val_fraction_zero": (["data.val_fraction=0"], ["val_fraction", "0"]),
    "data_block_size": (["data.block_size=1024"], ["data.block_size=1024", "128"]),
    "data_unknown_key": (["+data.foo=1"], ["data.foo"]),
    "data_target": (["data._target_=nope.Nope"], ["data._target_='nope.Nope'"]),
    # ---- checkpoints and resume (resume=last with no earlier run: tests/test_app_resume.py)
    "ckpt_path": (["+ckpt_path=last"], ["ckpt_path is not a key of this app", "resume=last"]),
    "resume_missing": (
        ["resume=/no/such/last.ckpt"],
        ["resume='/no/such/last.ckpt'", "does not exist"],
    ),
    "checkpoint_every_zero": (["checkpoint.every_n_steps=0"], ["checkpoint.every_n_steps=0"]),
    "checkpoint_unknown_key": (["+checkpoint.every=5"], ["checkpoint.every"]),
    "enable_checkpointing": (["+trainer.enable_checkpointing=true"], ["checkpoint.every_n_steps"]),
    "top_level_unknown_key": (["+max_steps=5"], ["max_steps: not a key of this app"]),
    # ---- Hydra's own: unknown key, unknown group option, wrong type
    "hydra:unknown_key": (["parallelism.tensr=2"], ["tensr"]),
    "hydra:unknown_option": (["parallelism=nope"], ["parallelism/nope"]),
    "hydra:wrong_type": (["parallelism.tensor=two"], ["'two'"]),
    "hydra:unknown_trainer_key": (["trainer.foo=1"], ["trainer.foo"]),
    "hydra:unknown_offload": (["offload=tape"], ["offload/tape"]),
}
# Through the command line as well: Hydra's own errors and every value that used to fail only
# after the ranks had started (with a traceback per rank and a run directory left behind).
CLI = [
    "hydra:unknown_key",
    "hydra:unknown_option",
    "hydra:wrong_type",
    "model_target",
    "batch_zero",
    "model_block_size",
    "val_fraction_high",
    "model_dropout",
    "precision",
    "max_steps_negative",
    "accumulate_zero",
    "offload_path_full",
    "sequence_parallel_without_tensor",
    "ckpt_path",
]


def test_the_table_is_large():
    assert len(BAD) >= 50 and set(CLI) <= set(BAD)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_value_is_refused_in_process(case):
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from lightning_3d.app.run import validate

    overrides, named = BAD[case]
    if case.startswith("hydra:"):
        with pytest.raises((HydraException, OmegaConfBaseException)):
            compose_config("train", *overrides)
        return
    cfg = compose_config("train", *overrides)
    with pytest.raises(ValueError) as err:
        validate(cfg)
    for part in named:
        assert part in str(err.value), str(err.value)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Every CLI case at once (each is the imports and the checks, nothing else)."""
    run_dirs, procs = {}, {}
    for case in CLI:
        # Hydra would make it.
        run_dirs[case] = tmp_path_factory.mktemp(case.replace(":", "_")) / "run"
        procs[case] = start_app(SCRIPT, [*BAD[case][0], f"hydra.run.dir={run_dirs[case]}"], REPO)
    return run_dirs, wait_all(procs, timeout=300)


def _describe(proc):
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("case", CLI)
def test_bad_value_is_refused_on_the_command_line(case, cli_runs):
    run_dirs, finished = cli_runs
    proc = finished[case]
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, _describe(proc)
    assert "Traceback" not in output, _describe(proc)
    assert "Initializing distributed" not in output, _describe(proc)  # no rank started
    error_lines = [line for line in output.splitlines() if "error:" in line.lower()]
    assert len(error_lines) == 1 and error_lines[0].startswith("error: "), _describe(proc)
    assert error_lines[0] in proc.stderr.splitlines()
    for part in BAD[case][1]:
        assert part in error_lines[0], _describe(proc)
    assert not run_dirs[case].exists(), sorted(p.name for p in run_dirs[case].iterdir())


# ------------------------------------------------------------------ run directories
def test_unique_dir_never_reuses_a_directory(tmp_path):
    from lightning_3d.app.config import unique_dir

    base = tmp_path / "runs" / "12-00-00"
    made = [unique_dir(str(base)) for _ in range(3)]
    assert made == [str(base), f"{base}-1", f"{base}-2"]
    assert all(Path(p).is_dir() for p in made)


@pytest.mark.slow  # ~15 s; the fast suite keeps unique_dir's own test (above)
def test_two_runs_in_the_same_second_keep_both_outputs(tmp_path):
    """The run directory's time part pinned (as if both started in the same second): the second
    run gets its own directory instead of overwriting the first's final.ckpt and summary.json."""
    pinned = f"hydra.run.dir=${{unique_dir:{tmp_path}/same-second}}"
    procs = {
        name: start_app(SCRIPT, [*SMALL, f"seed={seed}", pinned], REPO)
        for name, seed in (("a", 1), ("b", 2))
    }
    finished = wait_all(procs, timeout=400)
    for proc in finished.values():
        assert proc.returncode == 0, _describe(proc)
    dirs = sorted(p.name for p in tmp_path.iterdir())
    assert dirs == ["same-second", "same-second-1"], dirs
    for name in dirs:
        assert (tmp_path / name / "final.ckpt").is_file() and (
            tmp_path / name / "summary.json"
        ).is_file()
    # each app reported its own directory's summary
    reported = sorted(
        line.rsplit("summary: ", 1)[1]
        for p in finished.values()
        for line in p.stdout.splitlines()
        if line.startswith("done:")
    )
    assert reported == sorted(str(tmp_path / name / "summary.json") for name in dirs)


# ------------------------------------------------------------------ sweeps
def test_a_sweep_runs_every_job_and_exits_non_zero(tmp_path):
    procs = {
        "sweep": start_app(
            SCRIPT,
            ["-m", "parallelism.zero_stage=1,5,2", *SMALL, f"hydra.sweep.dir={tmp_path}"],
            REPO,
        )
    }
    proc = wait_all(procs, timeout=400)["sweep"]
    assert proc.returncode == 1, _describe(proc)
    assert proc.stdout.count("done:") == 2, _describe(proc)  # jobs 0 and 2 trained
    assert (tmp_path / "0" / "summary.json").is_file() and (
        tmp_path / "2" / "summary.json"
    ).is_file()
    assert not (tmp_path / "1").exists()  # the refused job left no directory
    tail = proc.stderr[proc.stderr.index("sweep: 1 job(s) failed:") :]
    assert "job 1 (parallelism.zero_stage=5" in tail and "exit code 2" in tail, _describe(proc)
    assert "job 0" not in tail and "job 2" not in tail


# ------------------------------------------------------------------ what a rank says
def test_own_errors_are_not_reported_as_a_lost_peer():
    from lightning_3d.runtime.failures import describe_failure, is_collective_failure

    disk_full = OSError(errno.ENOSPC, "No space left on device", "/mnt/nvme/state.bin")
    wrapped = RuntimeError("gloo: writing the checkpoint failed")
    wrapped.__cause__ = disk_full
    for own in (
        disk_full,
        wrapped,
        ValueError("timed out waiting for nothing"),
        RuntimeError("gloo is not NCCL"),
    ):
        assert not is_collective_failure(own), own
    for lost in (
        RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"),
        RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)"),
        ConnectionResetError("Connection reset by peer"),
    ):
        assert is_collective_failure(lost), lost
    line = describe_failure(wrapped, 1, None, None, None)
    assert line == (
        "lightning_3d: rank 1: no space left on device: /mnt/nvme/state.bin; free space "
        "there, or write to another disk (this rank's own I/O error, not a lost peer)"
    )
    assert (
        describe_failure(ValueError("bad"), 0, None, None, None)
        == "lightning_3d: rank 0: ValueError: bad"
    )
    assert describe_failure(KeyboardInterrupt(), 0, None, None, None) is None
