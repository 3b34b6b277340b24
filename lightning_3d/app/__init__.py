"""The Hydra app (``examples/train.py``, ``examples/finetune.py``): a tool on top of the library."""
