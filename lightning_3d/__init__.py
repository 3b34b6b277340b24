"""lightning_3d: DeepSpeed- and Megatron-class parallelism as one PyTorch Lightning strategy.

Importing the package registers ``strategy="3d"`` (and ``"3d_zero1"``, ``"3d_zero2"``,
``"3d_zero3"``) in Lightning's ``StrategyRegistry``::

    import lightning as L
    import lightning_3d

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="3d")
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_3d.layout import Layout, MeshAxis
from lightning_3d.parallel.pipeline import PipelineSpec
from lightning_3d.strategy.three_d import ThreeDStrategy

ThreeDStrategy.register_strategies(StrategyRegistry)

__all__ = ["Layout", "MeshAxis", "PipelineSpec", "ThreeDStrategy"]
__version__ = "0.1.0"
