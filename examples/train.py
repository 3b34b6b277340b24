"""Train a model with lightning_3d, configured by Hydra.

    python examples/train.py                                   # reference GPT, 2 CPU ranks
    python examples/train.py parallelism=zero3 trainer.devices=4
    python examples/train.py -m parallelism.zero_stage=0,1,2,3  # a sweep
    python examples/train.py model=hf model.path=DIR data=text data.path=corpus/  # a Hugging Face model

Writes summary.json (layout, per-step losses, tokens/s, per-rank memory) to the run directory.
"""

import sys

import hydra
from omegaconf import DictConfig

from lightning_3d.app import run
from lightning_3d.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    code = run(cfg, script=__file__)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
