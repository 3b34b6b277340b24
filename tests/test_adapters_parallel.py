"""LoRA adapters under every layout reproduce one process running LoRA (gloo worlds).

The parity standard of the project (``tools.harness.parity``): the same losses, and the
same adapter updates tensor by tensor (relative error of ``final - initial`` per tensor), with
the base bit-for-bit the initial weights on every rank. Tiny random Llama (grouped-query
attention, untied head), fp32, ``gradient_clip_val`` always hit so a norm that counts a shard
twice or misses one shows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from lightning_3d.adapters import is_adapter_name  # noqa: E402
from tools.harness.parity import loss_mismatches, update_mismatches  # noqa: E402
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks  # noqa: E402
from tools.harness.world import run_world  # noqa: E402

LORA = {"method": "lora", "r": 4, "lora_alpha": 8}
STEPS, SEED = 4, 1234
TRAINER = {"gradient_clip_val": 0.05}


def lora_run(strategy, **changes) -> Run:
    model = {"adapter": LORA, "lr": 1e-2, **changes.pop("model", {})}
    return Run(
        **{
            "strategy": strategy,
            "steps": STEPS,
            "seed": SEED,
            "arch": "hf_llama",
            "model": model,
            "trainer": TRAINER,
            **changes,
        }
    )


@pytest.fixture(scope="module")
def references():
    cache: dict[str, dict] = {}

    def get(family: str = "llama") -> dict:
        if family not in cache:
            cache[family] = fit_gpt(0, lora_run(None, arch=f"hf_{family}"))
        return cache[family]

    return get


@pytest.fixture(scope="module")
def reference(references):
    return references("llama")


def assert_same_lora_run(world: list[dict], ref: dict, rtol: float = 1e-4) -> None:
    """Rank 0's losses and gathered adapters against one process; every rank's own copy of the
    base equal to the initial weights, bit for bit."""
    run, initial = world[0], ref["initial_state"]
    problems = loss_mismatches(run["losses"], ref["losses"], rtol=1e-5)
    adapters = {k: v for k, v in run["state"].items() if is_adapter_name(k)}
    assert adapters and set(adapters) == {k for k in ref["state"] if is_adapter_name(k)}
    problems += update_mismatches(adapters, ref["state"], initial, rtol)
    for rank, result in enumerate(world):
        for name, value in (result["rank_state"] or {}).items():
            if not is_adapter_name(name) and name in initial:
                if not torch.equal(value, initial[name]):
                    problems.append(f"rank {rank}: base weight {name} changed")
    assert not problems, "LoRA run differs from one process:\n  " + "\n  ".join(problems)


LAYOUTS = {
    "one_device_3d": (1, {}),
    "one_device_offload": (1, {"offload": "cpu"}),
    "dp2_zero1": (2, {"data": 2, "zero_stage": 1}),
    "dp2_zero2": (2, {"data": 2, "zero_stage": 2}),
    "dp2_zero3": (2, {"data": 2, "zero_stage": 3}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_under_data_parallel_layouts_matches_one_process(reference, layout):
    """Catches: frozen base weights handed to a ZeRO engine or sharded optimizer (updated, or
    given state); adapters' gradients not averaged over data ranks (the update doubles); a
    ZeRO-3 base left unsharded or a clip norm over one rank's adapters only."""
    world_size, strategy = LAYOUTS[layout]
    run = lora_run(strategy, devices=world_size)
    world = run_world(fit_gpt_ranks, world_size, run)
    assert_same_lora_run(world, reference)
    assert_adapter_state_only(
        world, reference, strategy.get("data", 1), strategy.get("zero_stage", 0)
    )


def assert_adapter_state_only(world: list[dict], ref: dict, dp: int, zero_stage: int) -> None:
    """Each rank's gradients and optimizer state are the adapters' (its share of them under
    ZeRO), never the base's; under ZeRO-3 the frozen base is sharded over ``dp`` too (bytes the
    strategy's run summary counts from the tensors themselves)."""
    initial = ref["initial_state"]
    adapter_bytes = sum(4 * v.numel() for k, v in initial.items() if is_adapter_name(k))
    total_bytes = sum(4 * v.numel() for v in initial.values())
    for rank, result in enumerate(world):
        held = result["summary"]["ranks"][rank]
        assert held["grad_bytes"] <= adapter_bytes, (rank, held)
        steps = 8 * sum(map(is_adapter_name, initial))  # Adam's step counters
        assert (
            held["optimizer_state_bytes"] <= 2 * adapter_bytes // (dp if zero_stage else 1) + steps
        )
        if zero_stage == 3:
            assert held["unsharded_param_bytes"] == 0, (rank, held)
            assert held["param_bytes"] <= total_bytes // dp + 1024, (rank, held, total_bytes)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_ranks_seeded_apart_train_rank_zeros_base(reference, zero_stage):
    """A script that seeds by rank builds another random base on every rank: the frozen base is
    in no ZeRO bucket and no optimizer, so nothing else would make rank 0's everyone's. Catches:
    the start broadcast covering only the optimizer's parameters (rank 1 trains its adapters on
    its own base: the losses and the adapter updates differ from one process)."""
    run = lora_run({"data": 2, "zero_stage": zero_stage}, devices=2, rank_seeds=True)
    world = run_world(fit_gpt_ranks, 2, run)
    assert_same_lora_run(world, reference)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_lora_dropout_under_data_parallelism_matches_lightnings_ddp(zero_stage):
    """``lora_dropout=0.1``: every data rank draws its masks as it would under Lightning's own
    DDP (same seed, same order), so that independent implementation is the reference (one
    process cannot be: it draws one stream for the whole batch). Catches: the adapters' dropout
    off in training (the losses equal the run without it), masks drawn in another order."""
    model = {"adapter": {**LORA, "lora_dropout": 0.1}}
    ddp = run_world(fit_gpt_ranks, 2, lora_run(None, devices=2, model=model))
    if zero_stage == 1:  # the dropout is on (once is enough)
        plain = run_world(fit_gpt_ranks, 2, lora_run(None, devices=2))
        assert ddp[0]["losses"] != plain[0]["losses"]
    run = lora_run({"data": 2, "zero_stage": zero_stage}, devices=2, model=model)
    assert_same_lora_run(run_world(fit_gpt_ranks, 2, run), ddp[0])


TENSOR_LAYOUTS = {
    "llama-tp2": (2, {"tensor": 2}),
    "llama-tp2_zero3": (2, {"tensor": 2, "zero_stage": 3}),
    "llama-dp2_tp2_zero1": (4, {"data": 2, "tensor": 2, "zero_stage": 1}),
    "gpt2-tp2": (2, {"tensor": 2}),  # Conv1D bases, fused q/k/v (B's rows regrouped as the base's)
    "qwen2-tp2": (2, {"tensor": 2}),  # tied embedding and head (not adapted)
}


@pytest.mark.parametrize("layout", list(TENSOR_LAYOUTS))
def test_lora_under_tensor_parallel_matches_one_process(references, layout):
    """Column-parallel bases (q, k, v, gate, up): A replicated, B column-split; row-parallel
    bases (o, down): A row-split, B replicated. Catches: adapters split against their base (the
    sum base + B A mixes features of other ranks); a replicated A whose gradient is one rank's
    part (tensor ranks' copies drift: the replica guard stops the run at the first step)."""
    world_size, strategy = TENSOR_LAYOUTS[layout]
    family = layout.split("-")[0]
    run = lora_run(strategy, devices=world_size, arch=f"hf_{family}")
    assert_same_lora_run(run_world(fit_gpt_ranks, world_size, run), references(family))


def test_adapters_split_beside_their_base():
    """The split itself (fake world of 2, one process): a column-parallel base's A replicated and
    B split by output rows, a row-parallel base's A split by input columns and B replicated.
    Catches a plan that leaves the adapters out (``resolve_plan`` refuses a LoRA layer as a
    ``Linear``) or splits A and B alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_3d.adapters.tensor import adapter_tensor_plan
    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.parallel.fake_world import fake_world
    from lightning_3d.parallel.plans import build_plan
    from lightning_3d.parallel.tensor import resolve_plan
    from tools.harness.hf_configs import tiny_hf_config

    module = HFCausalLM(config=tiny_hf_config("llama"), adapter=LORA)
    with fake_world(0, 2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        styles = adapter_tensor_plan(module, build_plan(module, None, False))
        parallelize_module(module, mesh, resolve_plan(module, styles, 2))
        layer = module.model.model.layers[0]
        for proj, a_split, b_split in [
            (layer.self_attn.q_proj, None, Shard(0)),
            (layer.mlp.up_proj, None, Shard(0)),
            (layer.self_attn.o_proj, Shard(1), None),
            (layer.mlp.down_proj, Shard(1), None),
        ]:
            base = proj.base_layer.weight
            assert isinstance(base, DTensor) and base.placements == ((b_split or a_split),)
            for weight, split in [
                (proj.lora_A.default.weight, a_split),
                (proj.lora_B.default.weight, b_split),
            ]:
                if split is None:
                    assert not isinstance(weight, DTensor)
                else:
                    assert isinstance(weight, DTensor) and weight.placements == (split,)
                    assert weight.to_local().shape[split.dim] * 2 == weight.shape[split.dim]


def test_sequence_parallel_adapters_are_refused_naming_the_module():
    """The family's translated plan refuses sequence parallelism over the adapters' unsplit
    weights; a hand-written plan whose row-parallel output stays a ``DTensor`` is refused by the
    adapter split itself."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    from lightning_3d.adapters.tensor import adapter_tensor_plan
    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.parallel.plans import build_plan
    from tools.harness.hf_configs import tiny_hf_config

    module = HFCausalLM(config=tiny_hf_config("llama"), adapter=LORA)
    attention = r"model\.model\.layers\.0\.self_attn \(LlamaAttention\) would see a shard"
    with pytest.raises(ValueError, match=attention + r".*sequence_parallel=False"):
        build_plan(module, None, True)
    plan = {"model.layers.*.self_attn.o_proj": RowwiseParallel(use_local_output=False)}
    o_proj = r"model\.model\.layers\.0\.self_attn\.o_proj"
    with pytest.raises(ValueError, match=o_proj + r" \(RowwiseParallel, use_local_output=False"):
        adapter_tensor_plan(module, {f"model.{k}": v for k, v in plan.items()})


PIPELINE_LAYOUTS = {
    "llama-pp2": (2, {"pipeline": 2}),
    "qwen2-pp2": (2, {"pipeline": 2}),  # tied embedding / head on both stages
    "llama-pp2_tp2": (4, {"pipeline": 2, "tensor": 2}),
    "llama-pp2_dp2_zero3": (4, {"pipeline": 2, "data": 2, "zero_stage": 3}),
}


@pytest.mark.parametrize("layout", list(PIPELINE_LAYOUTS))
def test_lora_under_pipeline_layouts_matches_one_process(references, layout):
    """Each stage holds its blocks' adapters; stages run the model's own (adapted) modules.
    Catches: a stage that rebuilds its blocks without the adapters, or hands the optimizer its
    frozen base; a checkpoint or gathered state that drops one stage's adapters."""
    world_size, strategy = PIPELINE_LAYOUTS[layout]
    family = layout.split("-")[0]
    run = lora_run(strategy, devices=world_size, arch=f"hf_{family}")
    assert_same_lora_run(run_world(fit_gpt_ranks, world_size, run), references(family))


@pytest.mark.slow
def test_lora_in_three_dimensions_matches_one_process(reference):
    """dp2 x tp2 x pp2 with ZeRO-3: eight processes."""
    strategy = {"data": 2, "tensor": 2, "pipeline": 2, "zero_stage": 3}
    world = run_world(fit_gpt_ranks, 8, lora_run(strategy, devices=8))
    assert_same_lora_run(world, reference)


@pytest.mark.parametrize(
    "saved_in, resumed_in, fmt",
    [
        ((2, {"data": 2, "zero_stage": 3}), (2, {"tensor": 2}), "consolidated"),
        ((2, {"data": 2, "zero_stage": 3}), (2, {"pipeline": 2}), "sharded"),
    ],
    ids=["zero3-to-tp2-consolidated", "zero3-to-pp2-sharded"],
)
def test_adapter_checkpoint_resumes_in_another_layout(
    tmp_path, reference, saved_in, resumed_in, fmt
):
    """Stop after 2 steps in one layout, resume in another to 4: the same losses and adapters
    as one uninterrupted process. The checkpoint's model part is the adapters alone. Catches:
    the base written into it; an adapter optimizer state keyed by the base's parameter indices
    (it would land on other adapters on resume)."""
    from lightning_3d.checkpoint import sharded_files

    (n, first), (m, second) = saved_in, resumed_in
    save = lora_run(
        {**first, "checkpoint_format": fmt},
        devices=n,
        steps=2,
        save_to=str(tmp_path / "lora.ckpt"),
        save_every_n_steps=2,
    )
    first_half = run_world(fit_gpt_ranks, n, save)[0]
    path = tmp_path / "lora-step=2.ckpt"
    if fmt == "sharded":
        names = set(
            sharded_files.tensor_entries(sharded_files.read_metadata(path), sharded_files.MODEL)
        )
    else:
        names = set(torch.load(path, map_location="cpu", weights_only=False)["state_dict"])
    assert names and all(is_adapter_name(n) for n in names), sorted(names)[:4]
    resume = lora_run(second, devices=m, resume_from=str(path))
    world = run_world(fit_gpt_ranks, m, resume)
    world[0]["losses"] = first_half["losses"] + world[0]["losses"]
    assert_same_lora_run(world, reference)


def _gathered_by_the_save(rank: int, run: Run) -> dict:
    """``fit_gpt`` with every tensor the checkpoint's model state gathers counted (values)."""
    from lightning_3d.checkpoint import view
    from lightning_3d.strategy.checkpoint_hooks import CheckpointHooks

    gathered, saving = [], [False]
    real_to_full, real_state = view.to_full, CheckpointHooks.lightning_module_state_dict

    def to_full(tensor, *args, **kwargs):
        out = real_to_full(tensor, *args, **kwargs)
        if saving[0]:
            gathered.append(out.numel())
        return out

    def state(self):
        saving[0] = True
        try:
            return real_state(self)
        finally:
            saving[0] = False

    view.to_full, CheckpointHooks.lightning_module_state_dict = to_full, state
    result = fit_gpt(rank, run)
    return {"gathered": sum(gathered), "initial_state": result["initial_state"]}


def test_an_adapter_checkpoint_never_gathers_the_frozen_base(tmp_path):
    """dp2 ZeRO-3 (every weight sharded), a consolidated save: the values gathered for the
    checkpoint are the adapters', not the whole model's that the module then drops. Catches:
    the strategy assembling the full base on every save (a full model's bytes at each
    checkpoint, on a model whose point is not to hold them)."""
    run = lora_run(
        {"data": 2, "zero_stage": 3},
        devices=2,
        steps=2,
        save_to=str(tmp_path / "lora.ckpt"),
        save_every_n_steps=2,
    )
    world = run_world(_gathered_by_the_save, 2, run)
    initial = world[0]["initial_state"]
    adapters = sum(v.numel() for k, v in initial.items() if is_adapter_name(k))
    assert adapters > 0 and all(rank["gathered"] == adapters for rank in world), (
        [rank["gathered"] for rank in world],
        adapters,
        sum(v.numel() for v in initial.values()),
    )


@pytest.fixture(scope="module")
def directory_reference(tmp_path_factory):
    """A tiny Qwen2 directory (tied embedding and head) and one process running LoRA on it, the
    model built on ``meta`` and its weights read where they land; ``initial_state`` is the
    materialised start (``fit_gpt``'s own is still on ``meta``)."""
    import lightning as L

    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_hf_config

    directory = tmp_path_factory.mktemp("qwen2")
    HFCausalLM(config=tiny_hf_config("qwen2")).model.save_pretrained(directory)
    ref = fit_gpt(0, lora_run(None, arch="hf_qwen2", model={"path": str(directory)}))
    L.seed_everything(SEED, verbose=False)
    start = HFCausalLM(path=str(directory), adapter=LORA)
    start.load_weights()
    ref["initial_state"] = {k: v.clone() for k, v in start.state_dict().items()}
    return directory, ref


@pytest.mark.parametrize("layout", ["dp2_zero3", "tp2", "pp2"])
def test_lora_on_a_directory_read_in_place_matches_one_process(directory_reference, layout):
    """The base read from the files into each rank's slices under its peft names, the adapters
    filled from their own record (every rank the same). Catches: base weights left unread (the
    record still naming ``q_proj.weight``: materialising refuses, or fills nothing); adapters
    drawn differently on different ranks or left empty."""
    directory, ref = directory_reference
    strategy = {
        "dp2_zero3": {"data": 2, "zero_stage": 3},
        "tp2": {"tensor": 2},
        "pp2": {"pipeline": 2},
    }[layout]
    run = lora_run(strategy, devices=2, arch="hf_qwen2", model={"path": str(directory)})
    assert_same_lora_run(run_world(fit_gpt_ranks, 2, run), ref)
    lora_a = ref["initial_state"]["model.model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    assert lora_a.abs().min() > 0 or lora_a.abs().mean() > 1e-3  # filled, not left empty


def test_adapters_on_some_layers_only_split_with_the_rest():
    """``target_modules`` naming one layer's q_proj: that one splits as adapted, the other
    layers' q_proj as plain column-parallel ``Linear`` s. Catches a pattern rewritten for the
    adapted module only, which leaves its unadapted namesakes whole (their k/v split: wrong
    shapes)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_3d.adapters.tensor import adapter_tensor_plan
    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.parallel.plans import build_plan
    from tools.harness.hf_configs import tiny_hf_config

    one = {**LORA, "target_modules": ["model.layers.0.self_attn.q_proj"]}
    module = HFCausalLM(config=tiny_hf_config("llama"), adapter=one)
    plan = adapter_tensor_plan(module, build_plan(module, None, False))
    q0, q1 = "model.model.layers.0.self_attn.q_proj", "model.model.layers.1.self_attn.q_proj"
    assert isinstance(plan[f"{q0}.base_layer"], ColwiseParallel)
    assert isinstance(plan[f"{q0}.lora_B.default"], ColwiseParallel)
    assert f"{q0}.lora_A.default" not in plan and isinstance(plan[q1], ColwiseParallel)
