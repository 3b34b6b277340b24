"""Train a model with lightning_3d, configured by Hydra.

    python examples/train.py                                   # reference GPT, 2 CPU ranks
    python examples/train.py parallelism=zero3 trainer.devices=4
    python examples/train.py parallelism=auto                  # the planner's first choice for this world
    python examples/train.py -m parallelism.zero_stage=0,1,2,3  # a sweep: every job runs
    python examples/train.py model=hf model.path=DIR data=text data.path=corpus/  # a Hugging Face model
    python examples/train.py resume=last                       # continue the newest run's last.ckpt
    python examples/train.py resume=outputs/DATE/TIME/preempted.ckpt trainer.max_steps=600

Writes summary.json (layout, per-step losses, tokens/s, per-rank memory), last.ckpt (every
checkpoint.every_n_steps steps and at the end) and final.ckpt to the run directory, a new one
per run; resume=last|PATH continues a run exactly (see lightning_3d/checkpoint/resume.py). A bad value
ends the app with one ``error:`` line and exit code 2; a sweep with failed jobs lists them at
the end and exits 1 (see :mod:`lightning_3d.app.cli`).
"""

from omegaconf import DictConfig

from lightning_3d.app.run import run
from lightning_3d.app.cli import hydra_app
from lightning_3d.app.config import register_configs


def main(cfg: DictConfig) -> int:
    return run(cfg, script=__file__)


if __name__ == "__main__":
    register_configs()
    hydra_app(main, config_path="../conf", config_name="train")
