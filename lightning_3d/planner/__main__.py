"""``python -m lightning_3d.planner``: rank layouts of a model for a cluster, before any GPU is rented.

    python -m lightning_3d.planner                                  # gpt_small on one 8 x 80 GB node
    python -m lightning_3d.planner model=gpt_50m cluster=workstation_24gb
    python -m lightning_3d.planner cluster.nodes=4 planner.batch_size=512 top=20

The ``model`` group is training's (``conf/model/``); ``cluster`` is ``conf/cluster/``; the
``planner`` keys are :class:`~lightning_3d.planner.choice.PlannerOptions`. Prints the model's
facts (activation bytes measured per block), the ranked table and the rejected layouts. A bad
value, or a cluster on which nothing fits, ends with one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import functools
import sys

from omegaconf import DictConfig, OmegaConf

from lightning_3d.cli import hydra_app


def plan(cfg: DictConfig) -> int:
    from hydra.core.hydra_config import HydraConfig

    from lightning_3d.app import model_on_meta
    from lightning_3d.config import check_target_keys
    from lightning_3d.planner import Cluster, model_facts, plan_layouts
    from lightning_3d.planner.table import nothing_fits, ranked_table, rejected_summary
    from lightning_3d.recipe import check

    try:
        cluster = Cluster.from_mapping(OmegaConf.to_container(cfg.cluster, resolve=True))
        options = planner_options(cfg.planner)
        check_target_keys(cfg.model, "model")
        module = model_on_meta(cfg.model)
        if module is None:
            raise ValueError(f"model ({cfg.model.get('_target_')}) cannot be built on meta, so it cannot be planned")
        name = HydraConfig.get().runtime.choices.get("model", "model") if HydraConfig.initialized() else "model"
        tps = [t for t in range(1, cluster.devices_per_node + 1) if cluster.devices_per_node % t == 0]
        facts = model_facts(module, seq_len=options.seq_len, precision=options.precision, tp_sizes=tps, name=name,
                            policies=tuple(dict.fromkeys(("none", *options.ac_policies))))
        candidates = plan_layouts(facts, cluster, options, check=functools.partial(check, module))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not any(c.fits for c in candidates):
        print(f"error: {nothing_fits(candidates, cluster, options.reserve_gb, options.offloads)}", file=sys.stderr)
        return 2
    from lightning_3d.planner.facts import facts_summary

    batch = options.global_batch(cluster.world_size)
    print(f"cluster: {cluster.describe()}")
    print(facts_summary(facts))
    print(f"global batch {batch} x {facts.seq_len} tokens; efficiency {options.efficiency:g} of peak; memory in GB "
          f"per rank (largest pipeline stage), times in ms per optimizer step\n")
    print(ranked_table(candidates, cfg.get("top", 10)))
    best = candidates[0]
    options_text = ", ".join(f"{k}={v!r}" for k, v in best.choice.options().items())
    trainer = "".join(f", Trainer({k}={v!r})" for k, v in best.choice.trainer_options().items())
    print(f"\nfirst choice: ThreeDStrategy({options_text}){trainer}")
    print(rejected_summary(candidates))
    return 0


def planner_options(node: DictConfig):
    from lightning_3d.planner import PlannerOptions

    values = OmegaConf.to_container(node, resolve=True)
    known = set(PlannerOptions.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown planner key(s) {unknown}; known: {sorted(known)}")
    return PlannerOptions(**values)


if __name__ == "__main__":
    hydra_app(plan, config_path="../../conf", config_name="plan")
