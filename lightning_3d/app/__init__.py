"""The Hydra apps, a tool on top of the library, with their configs (``conf/``, package data).

    lightning3d-train ...      # python -m lightning_3d.app.train; from a checkout examples/train.py
    lightning3d-finetune ...   # python -m lightning_3d.app.finetune; examples/finetune.py
    lightning3d-plan ...       # python -m lightning_3d.planner (validate=true: the plan check)

Resuming is the same command with ``resume=last`` (:mod:`lightning_3d.checkpoint.resume`).
"""
