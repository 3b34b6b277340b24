"""The per-parameter state view both checkpoint writers share (``lightning_3d/checkpoint/view.py``),
and the ZeRO engine's public description of what each rank's slices hold."""

from __future__ import annotations

import torch
from torch import nn

from lightning_3d.checkpoint.consolidated import full_model_state
from lightning_3d.checkpoint.view import StateView, full_state_dict, to_full, to_local_like
from lightning_3d.parallel.tensor import FUSED_ROWS_ATTR, regroup_fused_rows
from lightning_3d.parallel.tied import find_tied, record_aliases
from tools.harness.world import run_world


def _fused_linear() -> tuple[nn.Linear, torch.Tensor]:
    """A q/k/v projection as tensor parallelism (tp 2) leaves it: rows regrouped per rank."""
    torch.manual_seed(0)
    qkv = nn.Linear(4, 12)
    plain = qkv.weight.detach().clone()
    with torch.no_grad():
        qkv.weight.copy_(regroup_fused_rows(plain, 3, 2))
    setattr(qkv, FUSED_ROWS_ATTR, (3, 2))
    return qkv, plain


def test_fused_rows_are_saved_in_the_plain_order_and_loaded_back_regrouped():
    qkv, plain = _fused_linear()
    view = StateView(qkv)
    assert view.fused == {id(qkv.weight): (3, 2), id(qkv.bias): (3, 2)}
    assert view.fused_by_name() == {"weight": (3, 2), "bias": (3, 2)}
    assert torch.equal(view.full(qkv.weight, qkv.weight), plain)
    assert torch.equal(full_state_dict(qkv)["weight"], plain)
    assert torch.equal(to_local_like(plain, qkv.weight, (3, 2)), qkv.weight.detach())
    before = qkv.weight.detach().clone()
    with torch.no_grad():
        qkv.weight.zero_()
    view.copy_into(qkv.weight, plain)
    assert torch.equal(qkv.weight.detach(), before)


def test_to_full_copies_and_passes_non_tensors_through():
    t = torch.arange(6.0).reshape(2, 3)
    full = to_full(t)
    assert torch.equal(full, t) and full.data_ptr() != t.data_ptr()
    # Scalars are never regrouped.
    assert to_full(3) == 3 and to_full(torch.tensor(2.0), (3, 2)) == 2.0


def test_a_tied_weight_is_one_entry_under_its_one_process_name():
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    record_aliases(model, find_tied(model))
    assert list(full_state_dict(model)) == ["0.weight"]
    assert StateView(model).name_of == {id(model[0].weight): "0.weight"}
    # The consolidated model state keys it as state_dict() does: under each name.
    assert sorted(full_model_state(model)) == ["0.weight", "1.weight"]


def _owned(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.parallel.zero import ZeroDataParallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))  # 40 + 18 elements
    engine = ZeroDataParallel(mesh, stage=1, bucket_numel=30)  # slices cut through parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(optimizer)
    slices = engine.owned_slices()
    # What it steps.
    assert [id(o.param) for o in slices] == [id(p) for p in optimizer.param_groups[0]["params"]]
    out = []
    for owned in slices:
        local = owned.param.to_local()
        for p, (start, stop, base) in zip(owned.params, owned.ranges):
            values = p.detach().reshape(-1)[start:stop] if start < stop else torch.empty(0)
            assert torch.equal(local[start - base : stop - base], values)
            out.append((tuple(p.shape), start, stop))
    return {"ranges": out, "numel": [o.numel for o in slices]}


def test_owned_slices_hold_every_element_of_every_parameter_once():
    ranks = run_world(_owned, 2)
    covered: dict[tuple, list[int]] = {}
    for result in ranks:
        for shape, start, stop in result["ranges"]:
            covered.setdefault(shape, []).extend(range(start, stop))
    for shape, elements in covered.items():
        assert sorted(elements) == list(range(torch.Size(shape).numel())), shape
    assert ranks[0]["numel"] == ranks[1]["numel"]
