"""Starting the example apps as a user would (a fresh process, no launcher variables) and
collecting several started together — shared by the app tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from omegaconf import DictConfig


def app_env() -> dict[str, str]:
    """This environment, one intra-op thread per process, without what would change an app's
    behaviour: a stray launcher variable would make it think it is a rank already, a set
    HYDRA_FULL_ERROR would turn Hydra's one-paragraph errors into tracebacks."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_PROCID", "HYDRA_FULL_ERROR"):
        env.pop(key, None)
    return env


def start_app(
    script: Union[str, Path], args: Sequence[str], cwd: Union[str, Path]
) -> subprocess.Popen:
    """``python script *args`` in ``cwd``, its output captured as text."""
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env=app_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_all(
    procs: Mapping[str, subprocess.Popen], timeout: float
) -> dict[str, subprocess.CompletedProcess]:
    """name -> finished process, for processes started together; any still running when one
    times out (or the caller is interrupted) is killed."""
    done = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=timeout)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def compose_config(config_name: str, *overrides: str) -> DictConfig:
    """The app's config ``conf/<config_name>.yaml`` with ``overrides``, as Hydra composes it for
    ``examples/*.py`` (schemas and resolvers registered), without running anything."""
    from hydra import compose, initialize_config_dir

    from lightning_3d.app.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))
