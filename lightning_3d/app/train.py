"""Train a model with lightning_3d, configured by Hydra (``conf/train.yaml`` in this package).

    lightning3d-train                                          # reference GPT, 2 CPU ranks
    lightning3d-train parallelism=zero3 trainer.devices=4
    lightning3d-train parallelism=auto                         # the planner's first choice for this world
    lightning3d-train -m parallelism.zero_stage=0,1,2,3         # a sweep: every job runs
    lightning3d-train model=hf model.path=DIR data=text data.path=corpus/  # a Hugging Face model
    lightning3d-train resume=last                              # continue the newest run's last.ckpt
    lightning3d-train resume=outputs/DATE/TIME/preempted.ckpt trainer.max_steps=600

The same app runs as ``python -m lightning_3d.app.train`` and, from a checkout, as
``python examples/train.py``. Writes summary.json (layout, per-step losses, tokens/s, per-rank
memory), last.ckpt (every checkpoint.every_n_steps steps and at the end) and final.ckpt to the run
directory, a new one per run under ``./outputs``; resume=last|PATH continues a run exactly (see
:mod:`lightning_3d.checkpoint.resume`). A bad value ends the app with one ``error:`` line and exit
code 2; a sweep with failed jobs lists them at the end and exits 1 (see :mod:`lightning_3d.app.cli`).
"""

from __future__ import annotations

from typing import NoReturn

from omegaconf import DictConfig


def task(cfg: DictConfig) -> int:
    """One Hydra job of the training app: the config Hydra composed -> the exit code."""
    from lightning_3d.app.run import run

    return run(cfg)


def main() -> NoReturn:
    """The ``lightning3d-train`` console script: Hydra's command line over the package's configs."""
    from lightning_3d.app.cli import hydra_app
    from lightning_3d.app.config import CONF_DIR, register_configs

    register_configs()
    hydra_app(task, config_path=str(CONF_DIR), config_name="train")


if __name__ == "__main__":
    main()
