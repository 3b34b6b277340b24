"""``python -m lightning_3d.planner`` (``lightning3d-plan``): rank layouts of a model for a cluster,
before any GPU is rented.

    python -m lightning_3d.planner                                  # gpt_small on one 8 x 80 GB node
    python -m lightning_3d.planner model=gpt_50m cluster=workstation_24gb
    python -m lightning_3d.planner cluster.nodes=4 planner.batch_size=512 top=20
    python -m lightning_3d.planner model=gpt_70b cluster=128_nodes_8x80gb layout.tensor=8 layout.pipeline=8 \
        planner.zero_stages=[1] planner.offloads=[none] validate=true

The configs are the app's (``lightning_3d/app/conf/``): the ``model`` group is training's
(``conf/model/``); ``cluster`` is ``conf/cluster/``; the ``planner`` keys are
:class:`~lightning_3d.planner.choice.PlannerOptions`. Prints the model's facts (activation bytes
measured per block), the ranked table and the rejected layouts. A bad value, or a cluster on which
nothing fits, ends with one ``error:`` line and exit code 2.

``layout.data`` / ``layout.tensor`` / ``layout.pipeline`` / ``layout.context`` keep only layouts of
those sizes (a fixed ``tensor`` also limits the activation measurement to that size, which is what
makes a 70B model quick to plan). ``validate=true`` then builds the first choice at its full world
size in this one process (:mod:`lightning_3d.strategy.choice_check`), prints its per-rank-kind table
of predicted against built bytes, and ends with an ``error:`` line and exit code 2 if a shape or
placement is wrong or a figure is more than 10% off.
"""

from __future__ import annotations

import sys
import time
from typing import NoReturn

from omegaconf import DictConfig, OmegaConf

from lightning_3d.app.cli import hydra_app


def plan(cfg: DictConfig) -> int:
    from hydra.core.hydra_config import HydraConfig

    from lightning_3d.app.config import check_target_keys
    from lightning_3d.app.run import model_on_meta
    from lightning_3d.planner import Cluster
    from lightning_3d.planner.search import divisors, plan_candidates
    from lightning_3d.planner.table import (
        method_summary,
        nothing_fits,
        ranked_table,
        rejected_summary,
    )

    started = time.perf_counter()
    validate = bool(cfg.get("validate", False))
    try:
        cluster = Cluster.from_mapping(OmegaConf.to_container(cfg.cluster, resolve=True))
        options = planner_options(cfg.planner)
        check_target_keys(cfg.model, "model")
        module = model_on_meta(cfg.model)
        if module is None:
            raise ValueError(
                f"model ({cfg.model.get('_target_')}) cannot be built on meta, so it cannot be planned"
            )
        name = (
            HydraConfig.get().runtime.choices.get("model", "model")
            if HydraConfig.initialized()
            else "model"
        )
        sizes = layout_pins(cfg.get("layout"))
        tps = [sizes["tensor"]] if "tensor" in sizes else None
        measured = len(options.adapters) * (
            len(tps) if tps else len(divisors(cluster.devices_per_node))
        )
        print(  # one block per method and tensor size, at the model's width: minutes at 8 B
            f"measuring one block's activations ({measured} block copies: "
            f"{len(options.adapters)} method(s) x tensor sizes) ...",
            flush=True,
        )
        facts, candidates = plan_candidates(module, cluster, options, tp_sizes=tps, name=name)
        candidates = [
            c for c in candidates if all(getattr(c.choice, k) == v for k, v in sizes.items())
        ]
        if not candidates:
            pins = ", ".join(f"{k}={v}" for k, v in sizes.items())
            raise ValueError(
                f"no layout of {cluster.world_size} ranks has {pins} (data x context x tensor x "
                "pipeline must equal nodes x devices_per_node)"
            )
        if validate and candidates[0].choice.adapter != "none":
            raise ValueError(
                f"validate=true builds full fine-tune layouts only; the first choice is "
                f"adapter={candidates[0].choice.adapter} (give planner.adapters=[none])"
            )
        if validate and candidates[0].fits:
            from lightning_3d.strategy.choice_check import check_choice

            check_choice(candidates[0].choice, options.precision)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not any(c.fits for c in candidates):
        print(
            f"error: {nothing_fits(candidates, cluster, options.reserve_gb, options.offloads)}",
            file=sys.stderr,
        )
        return 2
    from lightning_3d.planner.facts import facts_summary

    batch = options.global_batch(cluster.world_size)
    print(f"cluster: {cluster.describe()}")
    print(facts_summary(facts))
    efficiency = (
        f"efficiency {options.efficiency:g} of peak"
        if cluster.matmul_efficiency is None
        else f"matmul efficiency from shapes (at most {cluster.matmul_efficiency:g} of peak, "
        f"memory {cluster.memory_gbps:g} GB/s)"
    )
    print(
        f"global batch {batch} x {facts.seq_len} tokens; {efficiency}; memory in GB "
        f"per rank (largest pipeline stage), times in ms per optimizer step\n"
    )
    print(ranked_table(candidates, cfg.get("top", 10)))
    best = candidates[0]
    options_text = ", ".join(f"{k}={v!r}" for k, v in best.choice.options().items())
    trainer = "".join(f", Trainer({k}={v!r})" for k, v in best.choice.trainer_options().items())
    method = f", adapter={best.choice.adapter}" if best.choice.adapter != "none" else ""
    print(f"\nfirst choice: ThreeDStrategy({options_text}){trainer}{method}")
    from lightning_3d.planner.experts import expert_facts, expert_summary

    experts = expert_facts(module)
    if experts is not None:  # an MoE model: which expert axis on that layout
        device = cluster.device_bytes - options.reserve_gb * 1e9
        print(expert_summary(experts, best.choice, best.memory, device, facts.seq_len))
    if len(options.adapters) > 1:
        print(method_summary(candidates, options.adapters))
    print(rejected_summary(candidates))
    if validate:
        return validated(
            lambda: model_on_meta(cfg.model), facts, best.choice, options.precision, started
        )
    return 0


def layout_pins(node) -> dict[str, int]:
    """The sizes ``layout.*`` fixes (``null``: free); ``ValueError`` for anything but a positive integer."""
    values = dict(OmegaConf.to_container(node, resolve=True)) if node is not None else {}
    unknown = sorted(set(values) - {"data", "tensor", "pipeline", "context"})
    if unknown:
        raise ValueError(
            f"unknown layout key(s) {unknown}; known: ['context', 'data', 'pipeline', 'tensor']"
        )
    bad = {
        k: v
        for k, v in values.items()
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1)
    }
    if bad:
        raise ValueError(f"layout sizes must be positive integers or null, got {bad}")
    return {k: v for k, v in values.items() if v is not None}


def validated(make_module, facts, choice, precision: str, started: float) -> int:
    """Build ``choice`` at full size and print the comparison; 2 and an ``error:`` line if it is off."""
    import resource

    from lightning_3d.strategy.choice_check import table, validate_layout

    start = time.perf_counter()
    try:
        result = validate_layout(make_module, facts, choice, precision)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: kB
    print(
        f"\nvalidation: {choice.label()} built at {choice.world_size:,} ranks on a fake process group, "
        f"{len(result.kinds)} rank kind(s)\n"
    )
    print(table(result.rows, result.activations))
    tensors = sum(b.tensors for b in result.built)
    print(
        f"\n{tensors} parameter tensors checked for shape and placement; validation {seconds:.1f} s "
        f"(planning and validation {time.perf_counter() - started:.1f} s); process peak RSS {peak:.2f} GB"
    )
    if result.problems:
        more = f" (and {len(result.problems) - 1} more)" if len(result.problems) > 1 else ""
        print(f"error: validation failed: {result.problems[0]}{more}", file=sys.stderr)
        return 2
    print(
        "validation: every rank kind matches the prediction (shapes, placements, bytes within 10%)"
    )
    return 0


def planner_options(node: DictConfig):
    from lightning_3d.planner import PlannerOptions

    values = OmegaConf.to_container(node, resolve=True)
    known = set(PlannerOptions.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown planner key(s) {unknown}; known: {sorted(known)}")
    return PlannerOptions(**values)


def main() -> NoReturn:
    """The ``lightning3d-plan`` console script: Hydra's command line over the app's ``plan.yaml``."""
    from lightning_3d.app.config import CONF_DIR

    hydra_app(plan, config_path=str(CONF_DIR), config_name="plan")


if __name__ == "__main__":
    main()
