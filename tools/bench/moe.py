"""The benchmark's mixture-of-experts rows: the reference MoE GPT (``LitMoEGPT``, the bench's
GPT with every MLP a mixture of ``moe.n_experts`` experts, ``moe.top_k`` per token) at
``expert`` = 1 and 2, on 2 and 4 ranks; on 2 ranks ep2 (ZeRO-1) beside ep1 under ZeRO-1 and
ZeRO-3 (``3d_moe_ep1_zero3``), the layout an expert axis competes with: ZeRO-3 moves the experts'
weights where ep moves the tokens (the crossover: ``lightning_3d/planner/experts.py``). Not in
``bench.yaml``'s default rows (each MoE row adds a 2-4 rank run per repeat); run them by name:

    python -m tools.bench --rows 3d_moe_ep1 3d_moe_ep2 3d_moe_ep1_zero3 --repeats 5
    python -m tools.bench --rows 3d_moe_ep1_w4_zero3 3d_moe_ep2_dp2_zero3

Theory per rank (:mod:`lightning_3d.planner.experts`, E = 4 bytes, Ψ_e the experts' parameters,
Ψ_d the rest, N data ranks, ``ep`` the expert axis, ``r = N / ep`` ranks per expert, L MoE
layers, ``k`` experts per token, ``n`` tokens per rank and step, C the width):

- model state: ZeRO(Ψ_d + Ψ_e, N) at ``ep`` = 1; ZeRO(Ψ_d, N) + 16 Ψ_e / ep otherwise;
- bytes sent per step: the data-parallel term of the row's ZeRO stage over Ψ_d (over Ψ at
  ``ep`` = 1), less at ZeRO-3 one all-gather of what ``parallel/fsdp.py`` keeps gathered from
  forward to backward (the last block and the outer unit, Ψ_kept); the expert gradients'
  all-reduce over the ``r`` replicas, 2(r-1)/r·EΨ_e/ep (at ZeRO-3, where their own units split
  them over the replicas, two gathers and a reduce-scatter: 3(r-1)/r·EΨ_e/ep); the all-to-all,
  ``4 L k n C E (ep-1)/ep`` (2 directions × forward and backward) plus the counts (one int64 per expert,
  layer and forward, (ep-1)/ep of them sent); the router's load statistics, an all-reduce of
  2·experts + 1 floats per layer and forward.

The all-to-all is counted as ``tools/bench/comm.py`` counts every all-to-all: (n-1)/n of what the
call is handed, i.e. an even router's share; the mean over ranks of what is handed is exact.
"""

from __future__ import annotations

from typing import Any

E = 4  # bytes per fp32 element
DP_FACTOR = {0: 2, 1: 2, 2: 2, 3: 3}  # ring passes of the data-parallel exchange, by ZeRO stage
MOE_DEFAULTS = {"n_experts": 4, "top_k": 2}


def moe_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """``LitMoEGPT``'s expert keywords: ``cfg["moe"]`` over the defaults."""
    return {**MOE_DEFAULTS, **dict(cfg.get("moe") or {})}


def _moe_module(cfg: dict[str, Any]) -> Any:
    import torch

    from lightning_3d.models.moe import LitMoEGPT

    with torch.device("meta"):
        return LitMoEGPT(**cfg["model"], **moe_kwargs(cfg))


def moe_facts(cfg: dict[str, Any]) -> Any:
    """:class:`~lightning_3d.planner.experts.ExpertFacts` of the bench's MoE GPT, built on meta."""
    from lightning_3d.planner.experts import expert_facts

    return expert_facts(_moe_module(cfg))


def kept_gathered_params(cfg: dict[str, Any], expert: int) -> int:
    """Parameters ZeRO-3 does not gather a second time for backward: ``parallel/fsdp.py`` keeps
    the last block and the outer unit (embeddings, final norm, head) gathered from forward to
    backward. The experts are FSDP2's only at ``expert`` = 1."""
    model = _moe_module(cfg).model
    last = model.blocks[-1]
    experts = 0 if expert == 1 else sum(p.numel() for p in last.mlp.experts.parameters())
    outer = sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for p in model.blocks.parameters()
    )
    return outer + sum(p.numel() for p in last.parameters()) - experts


def moe_theory(cfg: dict[str, Any], world: int, options: dict[str, Any]) -> dict[str, float]:
    """Model-state bytes and bytes sent per step for one rank of an MoE row (module docstring)."""
    from lightning_3d.planner.experts import all_to_all_bytes, expert_state_bytes

    facts = moe_facts(cfg)
    ep, stage, n = options.get("expert", 1), options.get("zero_stage", 0), world
    state = expert_state_bytes(facts, ep, n, stage)
    sharded = facts.dense_params + (facts.expert_params if ep == 1 else 0)
    sent = DP_FACTOR[stage] * (n - 1) / n * E * sharded
    if stage == 3:  # the units kept gathered skip backward's all-gather
        sent -= (n - 1) / n * E * kept_gathered_params(cfg, ep)
    if ep > 1:
        replicas = n // ep
        # ZeRO-3 with replicas: the experts' own FSDP2 units (parallel/expert_fsdp.py) gather for
        # forward and again for backward, and reduce-scatter; else their gradient's all-reduce.
        passes = 3 if stage == 3 and replicas > 1 else 2
        sent += passes * (replicas - 1) / replicas * E * facts.expert_params / ep
    tokens = cfg["data"]["batch_size"] // n * cfg["model"]["block_size"]
    sent += all_to_all_bytes(facts, tokens, ep)["sent"]
    if ep > 1:
        sent += 8 * facts.n_experts * facts.moe_layers * (ep - 1) / ep
    sent += 2 * (n - 1) / n * E * (2 * facts.n_experts + 1) * facts.moe_layers
    return {
        "state_bytes": state,
        "sent_bytes": sent,
        "num_params": facts.dense_params + facts.expert_params,
    }


def moe_formula(options: dict[str, Any], world: int) -> str:
    """A MoE row's theory columns in words (state; bytes sent)."""
    ep, stage = options.get("expert", 1), options.get("zero_stage", 0)
    psi = "Ψ" if ep == 1 else "Ψ_d"
    dp = f"{DP_FACTOR[stage]}(N-1)/N·E{psi}" if stage < 3 else f"(N-1)/N·E(3{psi}-Ψ_kept)"
    if ep == 1:
        return f"ZeRO-{stage}(Ψ, N={world}); {dp} + AR stats"
    replicas = world // ep
    split = stage == 3 and replicas > 1  # the experts' own FSDP2 units over the replicas
    experts = f"RS+2AG(r={replicas})" if split else f"AR(r={replicas})"
    held = f"16Ψ_e/{world}" if split else f"16Ψ_e/{ep}"
    return (
        f"ZeRO-{stage}(Ψ_d, N={world}) + {held}; {dp} + {experts}·EΨ_e/{ep}"
        f" + 4Lkn·C·E·{ep - 1}/{ep} + AR stats"
    )
