"""Layout planner: which data × tensor × pipeline layout, ZeRO stage, micro-batching, activation
checkpointing and offload to run a model with on a cluster, predicted before anything runs.

:func:`plan_layouts` (pure: model facts, a :class:`Cluster`, :class:`PlannerOptions` in; ranked
:class:`Candidate` s out) is what the CLI (``python -m lightning_3d.planner``) prints and what
``parallelism=auto`` runs (:mod:`.auto`: the strategy's and the app's glue). Per-rank memory:
:mod:`.memory`; step time: :mod:`.timing`; activation bytes measured with the runs' own meter:
:mod:`.activations`.

Example::

    from lightning_3d.planner import Cluster, PlannerOptions, model_facts, plan_layouts

    facts = model_facts(module_on_meta, precision="bf16-mixed", tp_sizes=(1, 2, 4, 8))
    best = plan_layouts(facts, Cluster(nodes=1, devices_per_node=8, device_memory_gb=80))[0]
    ThreeDStrategy(**best.choice.options())
"""

from lightning_3d.planner.choice import Choice, PlannerOptions
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.facts import ModelFacts, model_facts
from lightning_3d.planner.memory import MemorySplit, rank_memory
from lightning_3d.planner.search import Candidate, plan_layouts
from lightning_3d.planner.timing import StepTime, step_time

__all__ = [
    "Candidate",
    "Choice",
    "Cluster",
    "MemorySplit",
    "ModelFacts",
    "PlannerOptions",
    "StepTime",
    "model_facts",
    "plan_layouts",
    "rank_memory",
    "step_time",
]
