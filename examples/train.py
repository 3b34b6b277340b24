"""Train a model with lightning_3d, configured by Hydra: the package's training app
(:mod:`lightning_3d.app.train`, installed as ``lightning3d-train``), run from a checkout.

    python examples/train.py                                   # reference GPT, 2 CPU ranks
    python examples/train.py parallelism=zero3 trainer.devices=4
    python examples/train.py parallelism=auto                  # the planner's first choice for this world
    python examples/train.py -m parallelism.zero_stage=0,1,2,3  # a sweep: every job runs
    python examples/train.py model=hf model.path=DIR data=text data.path=corpus/  # a Hugging Face model
    python examples/train.py resume=last                       # continue the newest run's last.ckpt
    python examples/train.py resume=outputs/DATE/TIME/preempted.ckpt trainer.max_steps=600

The configs are the package's, lightning_3d/app/conf/ (train.yaml and its groups).
"""

from lightning_3d.app.train import main

if __name__ == "__main__":
    main()
