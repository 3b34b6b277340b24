"""Multi-node on one machine: two "nodes" on localhost, started as a cluster starts them.

* two ``torchrun`` launchers (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous): Lightning
  must pick ``TorchElasticEnvironment``;
* four processes with the variables ``srun`` sets (``srun`` is not installed here): Lightning
  must pick ``SLURMEnvironment``;

and in both the ranks Lightning reads must be those the launchers gave, and a 2 x 2 layout must
train exactly as one process does (``support.multinode``). No second machine is
involved: the network between nodes is the loopback interface.

Timings on 2 cores (the 2 x 2 worlds and the timeout check are ``slow``): torchrun 2 x 2 ~26 s,
SLURM 2 x 2 ~18 s, SLURM 2 x 1 ~10-13 s, the app under SLURM 2 x 1 plus its one-process run ~18 s,
the timeout check ~20 s, the sbatch check ~0.3 s.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.multinode import slurm_env, slurm_nodes, slurm_tasks, torchrun_nodes
from tools.harness.apps import start_app, wait_all
from tools.harness.parity import assert_same_run, rank_state_mismatches
from tools.harness.runs import Run, fit_gpt

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
STEPS, SEED = 3, 1234


@pytest.fixture(scope="module")
def reference():
    """One process, Lightning's own single-device strategy, the same seed and global batch."""
    return fit_gpt(0, Run(steps=STEPS, seed=SEED))


def _run(strategy: dict, procs_per_node: int) -> Run:
    return Run(strategy=strategy, devices=procs_per_node, steps=STEPS, seed=SEED)


def _assert_world(results: list[dict], environment: str, nodes: int, procs_per_node: int) -> None:
    """Each rank: the cluster environment Lightning picked, and the node / local / global rank and
    world size it read, are what the launchers gave; the world that trained is that world."""
    assert len(results) == nodes * procs_per_node
    for rank, got in enumerate(results):
        seen = {
            k: got[k]
            for k in (
                "environment",
                "global_rank",
                "node_rank",
                "local_rank",
                "world_size",
                "num_nodes",
                "dist_rank",
                "dist_world_size",
            )
        }
        assert seen == {
            "environment": environment,
            "global_rank": rank,
            "node_rank": rank // procs_per_node,
            "local_rank": rank % procs_per_node,
            "world_size": nodes * procs_per_node,
            "num_nodes": nodes,
            "dist_rank": rank,
            "dist_world_size": nodes * procs_per_node,
        }


def _assert_same_as_one_process(results: list[dict], reference: dict) -> None:
    """Rank 0's losses and gathered weights, and every rank's own parameters, equal the reference's."""
    assert_same_run(results[0], reference)
    assert rank_state_mismatches(results, reference) == []
    for got in results[1:]:
        assert got["losses"] == results[0]["losses"]


@pytest.mark.slow
def test_two_torchrun_launchers_as_two_nodes_match_one_process(tmp_path, reference):
    """Catches: a strategy that ignores ``num_nodes`` (a world of 2 instead of 4: the rendezvous
    never completes, or the layout is resolved for the wrong size), global ranks computed without
    the node rank (two ranks 0), a tensor group that spans the two nodes instead of one node."""
    results = torchrun_nodes(
        _run({"data": 2, "tensor": 2}, 2), nodes=2, procs_per_node=2, work=tmp_path
    )
    _assert_world(results, "TorchElasticEnvironment", nodes=2, procs_per_node=2)
    assert results[0]["main_address"] in ("localhost", "127.0.0.1")
    _assert_same_as_one_process(results, reference)


def test_slurm_two_nodes_one_task_each_match_one_process(tmp_path, reference):
    """The SLURM path, smallest world: two nodes of one task each, data parallel across them.
    Also: the main address is resolved by Lightning from the node list (``127.0.0.[1-2]``)."""
    results = slurm_nodes(_run({"data": 2}, 1), nodes=2, procs_per_node=1, work=tmp_path)
    _assert_world(results, "SLURMEnvironment", nodes=2, procs_per_node=1)
    assert {r["main_address"] for r in results} == {"127.0.0.1"}
    _assert_same_as_one_process(results, reference)


@pytest.mark.slow
def test_slurm_two_nodes_two_tasks_each_pipeline_across_nodes_match_one_process(
    tmp_path, reference
):
    """2 x 2 under SLURM's variables: pipeline=2 x data=2 (a stage per node pair)."""
    results = slurm_nodes(
        _run({"pipeline": 2, "data": 2}, 2), nodes=2, procs_per_node=2, work=tmp_path
    )
    _assert_world(results, "SLURMEnvironment", nodes=2, procs_per_node=2)
    _assert_same_as_one_process(results, reference)


APP_SMALL = [
    "model=gpt_tiny",
    "data.batch_size=8",
    "data.max_bytes=100000",
    "trainer.limit_val_batches=0",
    "trainer.max_steps=3",
    "checkpoint.every_n_steps=null",
]


@pytest.mark.slow  # ~15 s; the fast suite keeps the two-node SLURM world without the app
def test_the_app_under_slurm_on_two_nodes_trains_as_one_process(tmp_path):
    """``examples/train.py`` as ``srun`` runs it on two nodes (one task each, as the sbatch example
    does with 8): each task trains in its own process (the app launches nothing), both write into
    the one run directory given, and the losses are the one-process app's."""
    single = wait_all(
        {
            "one": start_app(
                REPO / "examples" / "train.py",
                [*APP_SMALL, "trainer.devices=1", f"hydra.run.dir={tmp_path / 'one'}"],
                tmp_path,
            )
        },
        timeout=300,
    )["one"]
    assert single.returncode == 0, single.stderr[-3000:]
    work = tmp_path / "slurm"
    work.mkdir()
    command = [
        sys.executable,
        str(REPO / "examples" / "train.py"),
        *APP_SMALL,
        "trainer.devices=1",
        "trainer.num_nodes=2",
        "parallelism.data=2",
        f"hydra.run.dir={work / 'run'}",
    ]
    slurm_tasks(command, nodes=2, procs_per_node=1, work=work, timeout=300)
    summary = json.loads((work / "run" / "summary.json").read_text())
    reference = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert (summary["layout"]["world_size"], summary["layout"]["data"]) == (2, 2)
    assert reference["layout"]["world_size"] == 1
    assert summary["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert (work / "run" / "final.ckpt").exists()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has already ended
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_world_past_its_timeout_leaves_no_process(tmp_path):
    """torchrun starts its workers in sessions of their own, out of reach of the launcher's process
    group: every rank must still be gone after a timeout, not only the launchers."""
    long_run = Run(strategy={"data": 2, "tensor": 2}, devices=2, steps=10_000, seed=SEED)
    with pytest.raises(RuntimeError, match="timed out"):
        # long enough for all four ranks to start (two launchers, then four ranks importing torch
        # and Lightning on 2 cores: over 20 s here, 2026-12-02), far too short for 10,000 steps
        torchrun_nodes(long_run, nodes=2, procs_per_node=2, work=tmp_path, timeout=60)
    pids = [int(p.name.split(".")[1]) for p in tmp_path.glob("pid.*")]
    assert len(pids) == 4  # the ranks had started: the check below is not vacuous
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # killed: init reaps the orphans
    assert [pid for pid in pids if _alive(pid)] == []


def test_slurm_variables_make_a_launched_rank(monkeypatch):
    """What :func:`slurm_env` sets is what Lightning's ``SLURMEnvironment`` reads (and the app's
    ``already_launched``, so the app trains in the task instead of starting ranks)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_3d.app.launch import already_launched

    for key in [
        k for k in os.environ if k.startswith("SLURM_") or k in ("LOCAL_RANK", "MASTER_ADDR")
    ]:
        monkeypatch.delenv(key)
    # Lightning's SLURMEnvironment sets it: undone after the test.
    monkeypatch.setenv("MASTER_ADDR", "")
    monkeypatch.delenv("MASTER_ADDR")
    for key, value in slurm_env(rank=5, nodes=2, procs_per_node=4, port=29511, job_id="77").items():
        monkeypatch.setenv(key, value)
    env = SLURMEnvironment()
    assert SLURMEnvironment.detect() and already_launched()
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (8, 5, 1, 1)
    assert (env.main_address, env.main_port) == ("127.0.0.1", 29511)
    # Raises on a mismatch with devices / num_nodes.
    env.validate_settings(num_devices=4, num_nodes=2)
    with pytest.raises(ValueError, match="ntasks-per-node=4"):
        env.validate_settings(num_devices=8, num_nodes=2)


@pytest.mark.parametrize("bad", [{"nodes": 0}, {"procs_per_node": 0}, {"timeout": 0}])
def test_bad_world_is_refused_before_anything_starts(tmp_path, bad):
    args = {"nodes": 2, "procs_per_node": 1, "timeout": 10.0, **bad}
    with pytest.raises(ValueError, match=str(next(iter(bad)))):
        slurm_nodes(_run({"data": 2}, 1), work=tmp_path, **args)
    assert list(tmp_path.iterdir()) == []


def _sbatch_command(tmp_path: Path) -> list[str]:
    """The command the sbatch script runs under ``srun``, through a stand-in ``srun`` that records
    its arguments (as the batch script's shell expands them in a job)."""
    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir()
    fake.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$SRUN_ARGS"\n')
    fake.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{fake.parent}:{os.environ['PATH']}",
        SRUN_ARGS=str(tmp_path / "args"),
        SLURM_JOB_ID="4242",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_CPUS_PER_TASK="8",
    )
    subprocess.run(["bash", str(SBATCH)], env=env, check=True, timeout=60)
    return (tmp_path / "args").read_text().split("\0")[:-1]


def _sbatch_options() -> dict[str, str]:
    options = {}
    for line in SBATCH.read_text().splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --") :].partition("=")
            options[key] = value.split()[0] if value else ""
    return options


def test_sbatch_example_is_valid_bash_and_its_overrides_a_valid_run(tmp_path, monkeypatch):
    """``examples/slurm/train.sbatch``: bash accepts it; under ``srun`` it runs the training app with
    overrides that Hydra composes and :func:`lightning_3d.app.run.validate` accepts for the world of
    its ``#SBATCH`` lines, read as Lightning's ``SLURMEnvironment`` reads them (rank 0 of 16); the
    only change is ``trainer.accelerator=cpu`` (no 8 GPUs here). Every task gets one run directory."""
    from omegaconf import open_dict

    from lightning_3d.app.run import validate
    from tools.harness.apps import compose_config

    subprocess.run(["bash", "-n", str(SBATCH)], check=True, timeout=30)
    options = _sbatch_options()
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    assert (nodes, per_node) == (2, 8) and options["gpus-per-node"] == str(per_node)

    command = _sbatch_command(tmp_path)
    assert Path(command[0]).name.startswith("python") and command[1] == "examples/train.py"
    overrides = [o for o in command[2:] if not o.startswith("hydra.")]
    assert [o for o in command[2:] if o.startswith("hydra.")] == [
        "hydra.run.dir=outputs/slurm-4242"
    ]

    cfg = compose_config("train", *overrides)
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.num_nodes) == (
        "gpu",
        per_node,
        nodes,
    )
    assert cfg.parallelism.tensor == per_node  # tensor parallel inside a node
    for key in [
        k for k in os.environ if k.startswith("SLURM_") or k in ("LOCAL_RANK", "MASTER_ADDR")
    ]:
        monkeypatch.delenv(key)
    # Lightning's SLURMEnvironment sets it: undone after the test.
    monkeypatch.setenv("MASTER_ADDR", "")
    monkeypatch.delenv("MASTER_ADDR")
    for key, value in slurm_env(
        rank=0, nodes=nodes, procs_per_node=per_node, port=29500, job_id="4242"
    ).items():
        monkeypatch.setenv(key, value)
    with open_dict(cfg):
        cfg.trainer.accelerator = "cpu"
    validate(cfg)  # raises ValueError on any bad value, a world the layout cannot divide included


def test_ranks_of_an_external_launch_share_one_run_directory(tmp_path, monkeypatch):
    """Under torchrun / srun every rank resolves ``${unique_dir:...}`` itself, possibly a second
    later than its peers: the directory is named after the job, not the time, and is shared."""
    from lightning_3d.app.config import unique_dir

    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    alone = [unique_dir(str(tmp_path / "day" / "10-00-00")) for _ in range(2)]
    assert alone == [str(tmp_path / "day" / "10-00-00"), str(tmp_path / "day" / "10-00-00-1")]
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    ranks = {unique_dir(str(tmp_path / "day" / second)) for second in ("10-00-01", "10-00-02")}
    assert ranks == {str(tmp_path / "day" / "job-77.0")}
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "myjob")
    assert unique_dir(str(tmp_path / "day" / "10-00-03")) == str(tmp_path / "day" / "job-myjob")


def test_devices_that_disagree_with_srun_are_refused_when_the_trainer_is_built(monkeypatch):
    """Lightning compares ``devices`` / ``num_nodes`` with SLURM's tasks only when it launches the
    processes itself; under srun the strategy asks for the same check (before: an IndexError in
    ``root_device`` at the first step)."""
    import lightning as L

    from lightning_3d import ThreeDStrategy
    from support.multinode import slurm_env

    for key, value in slurm_env(rank=0, nodes=2, procs_per_node=2, port=29500, job_id="5").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="ntasks-per-node=2"):
        L.Trainer(
            accelerator="cpu", devices=1, num_nodes=2, strategy=ThreeDStrategy(), logger=False
        )
