"""Unit tests of ``Layout`` (validation, resolution, shape) and ``build_mesh`` on a fake world."""

import dataclasses
import re

import pytest
import torch.distributed as dist

from lightning_3d.layout import (
    MESH_AXES,
    ZERO_STAGES,
    Layout,
    MeshAxis,
    build_mesh,
    shard_mesh,
)
from lightning_3d.parallel.fake_world import fake_world


# ------------------------------------------------------------------ axes
def test_mesh_axis_order_is_pp_dp_cp_tp():
    assert [axis.value for axis in MeshAxis] == ["pp", "dp", "cp", "tp"]
    assert MESH_AXES == ("pp", "dp", "cp", "tp")
    assert MeshAxis.TENSOR == "tp"  # str enum: usable wherever a dim name is expected
    assert ZERO_STAGES == (0, 1, 2, 3)


# ------------------------------------------------------------------ resolve
def test_defaults():
    layout = Layout()
    assert (layout.data, layout.tensor, layout.pipeline, layout.zero_stage) == ("auto", 1, 1, 0)
    assert not layout.is_resolved


@pytest.mark.parametrize(
    "kwargs, world, expected_data",
    [
        (dict(), 1, 1),
        (dict(), 8, 8),
        (dict(tensor=2), 8, 4),
        (dict(pipeline=2), 6, 3),
        (dict(tensor=2, pipeline=2), 8, 2),
        (dict(tensor=4, pipeline=4), 64, 4),
        (dict(tensor=8), 8, 1),
    ],
)
def test_resolve_auto_data(kwargs, world, expected_data):
    layout = Layout(**kwargs)
    resolved = layout.resolve(world)
    assert resolved.data == expected_data
    assert resolved.is_resolved
    assert resolved.world_size == world
    # Everything else is carried over, and the original is untouched (frozen).
    assert dataclasses.replace(resolved, data="auto") == layout
    assert layout.data == "auto"


def test_resolve_example_from_docstring():
    assert Layout(tensor=2, pipeline=2).resolve(world_size=8) == Layout(
        data=2, tensor=2, pipeline=2, zero_stage=0
    )


def test_resolve_explicit_data():
    layout = Layout(data=2, tensor=2, pipeline=3, zero_stage=1)
    assert layout.is_resolved
    assert layout.resolve(12) == layout
    assert layout.world_size == 12


def test_resolve_is_idempotent_and_rechecks_world():
    # The strategy resolves twice (at Trainer construction and again in setup_environment).
    resolved = Layout(tensor=2).resolve(8)
    assert resolved.resolve(8) == resolved
    with pytest.raises(
        ValueError,
        match=r"pipeline\(1\) \* data\(4\) \* tensor\(2\) = 8 does not equal world size 6",
    ):
        resolved.resolve(6)


def test_layout_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Layout().tensor = 2  # type: ignore[misc]


# ------------------------------------------------------------------ world-size mismatch
def test_auto_data_mismatch_names_all_numbers():
    with pytest.raises(ValueError) as err:
        Layout(tensor=2, pipeline=2).resolve(6)
    assert str(err.value) == "pipeline(2) * tensor(2) = 4 does not divide world size 6"


def test_explicit_data_mismatch_names_all_numbers():
    with pytest.raises(ValueError) as err:
        Layout(data=3, tensor=2, pipeline=1).resolve(8)
    message = str(err.value)
    assert "pipeline(1) * data(3) * tensor(2) = 6" in message
    assert "world size 8" in message


@pytest.mark.parametrize("world", [3, 5, 7])
def test_tensor_does_not_divide_odd_world(world):
    with pytest.raises(ValueError, match=rf"tensor\(2\) = 2 does not divide world size {world}$"):
        Layout(tensor=2).resolve(world)


@pytest.mark.parametrize("world", [0, -4])
def test_resolve_rejects_non_positive_world(world):
    # auto: world // 4 is 0 or -1, which the re-validated copy rejects; explicit: the product differs.
    with pytest.raises(ValueError):
        Layout(tensor=2, pipeline=2).resolve(world)
    with pytest.raises(ValueError, match=rf"world size {world}$"):
        Layout(data=1, tensor=2, pipeline=2).resolve(world)


# ------------------------------------------------------------------ bad values
@pytest.mark.parametrize("name", ["tensor", "pipeline"])
@pytest.mark.parametrize("value", [0, -1, 1.5, 2.0, "2", None, True, False])
def test_bad_model_parallel_size(name, value):
    with pytest.raises(ValueError) as err:
        Layout(**{name: value})
    assert f"{name}={value!r}" in str(err.value)


@pytest.mark.parametrize("value", [0, -2, 1.5, 2.0, "2", "AUTO", None, True, False])
def test_bad_data_size(value):
    with pytest.raises(ValueError) as err:
        Layout(data=value)
    assert f"data={value!r}" in str(err.value)


@pytest.mark.parametrize("value", [4, -1, "2", 2.0, None, True, False])
def test_bad_zero_stage(value):
    with pytest.raises(ValueError) as err:
        Layout(zero_stage=value)
    message = str(err.value)
    assert f"zero_stage={value!r}" in message
    assert "[0, 1, 2, 3]" in message


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_every_zero_stage_is_accepted(stage):
    assert Layout(zero_stage=stage).zero_stage == stage


def test_all_problems_reported_at_once():
    with pytest.raises(ValueError) as err:
        Layout(data=0, tensor=-1, pipeline=0, zero_stage=9)
    message = str(err.value)
    for part in ("tensor=-1", "pipeline=0", "data=0", "zero_stage=9"):
        assert part in message


# ------------------------------------------------------------------ shape
@pytest.mark.parametrize(
    "layout, shape",
    [
        (Layout(data=8), (1, 8, 1, 1)),
        (Layout(data=2, tensor=2, pipeline=2), (2, 2, 1, 2)),
        (Layout(tensor=4, pipeline=2).resolve(16), (2, 2, 1, 4)),
        (Layout(tensor=2, pipeline=3).resolve(24), (3, 4, 1, 2)),
        (Layout(tensor=2, context=2).resolve(16), (1, 4, 2, 2)),
    ],
)
def test_shape_is_pp_dp_cp_tp(layout, shape):
    assert layout.shape == shape
    assert shape[0] * shape[1] * shape[2] * shape[3] == layout.world_size


def test_unresolved_layout_has_no_world_size_or_shape():
    with pytest.raises(RuntimeError, match="resolved"):
        _ = Layout(tensor=2).world_size
    with pytest.raises(RuntimeError, match="resolved"):
        _ = Layout(tensor=2).shape


def test_as_dict():
    assert Layout(tensor=2).resolve(4).as_dict() == {
        "data": 2,
        "tensor": 2,
        "pipeline": 1,
        "zero_stage": 0,
        "context": 1,
        "expert": 1,
    }


# ------------------------------------------------------------------ build_mesh on a fake 64-rank world
@pytest.mark.parametrize("rank", [0, 1, 3, 4, 5, 15, 16, 21, 37, 42, 63])
def test_build_mesh_coordinates_tp_innermost(rank):
    layout = Layout(tensor=4, pipeline=4).resolve(64)
    with fake_world(rank, 64):
        mesh = build_mesh(layout, "cpu")
        assert mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
        assert tuple(mesh.shape) == (4, 4, 1, 4)
        expected = (rank // 16, (rank // 4) % 4, 0, rank % 4)
        assert tuple(mesh.get_coordinate()) == expected
        for axis, coordinate in zip(MESH_AXES, expected):
            assert mesh[axis].size() == (1 if axis == "cp" else 4)
            assert mesh[axis].get_local_rank() == coordinate
        # Tensor peers are consecutive ranks; pipeline peers are 16 apart.
        assert mesh["tp"].mesh.tolist() == [rank - rank % 4 + i for i in range(4)]
        assert mesh["pp"].mesh.tolist() == [rank % 16 + 16 * i for i in range(4)]
    assert not dist.is_initialized()


def test_build_mesh_uneven_axes():
    layout = Layout(tensor=2, pipeline=4).resolve(64)  # data = 8
    with fake_world(45, 64):
        mesh = build_mesh(layout, "cpu")
        assert tuple(mesh.shape) == (4, 8, 1, 2)
        assert tuple(mesh.get_coordinate()) == (45 // 16, (45 // 2) % 8, 0, 45 % 2)
        assert mesh["dp"].size() == 8


@pytest.mark.parametrize("rank", [0, 3, 5, 6])
def test_expert_mesh_cuts_the_data_axis_into_neighbouring_ep_ranks(rank):
    """data 8 with expert=4: data rank d is ep rank d % 4 of replica group d // 4; the ep peers
    are neighbours, the replicas 4 ranks apart."""
    from lightning_3d.layout import EXPERT_AXES, build_expert_mesh

    layout = Layout(expert=4).resolve(8)
    with fake_world(rank, 8):
        mesh = build_expert_mesh(build_mesh(layout, "cpu"), layout.expert)
        assert mesh.mesh_dim_names == EXPERT_AXES
        assert tuple(mesh.shape) == (1, 2, 4, 1, 1)
        assert mesh["ep"].get_local_rank() == rank % 4
        assert mesh["dp_replica"].get_local_rank() == rank // 4
        assert mesh["ep"].mesh.tolist() == [rank - rank % 4 + i for i in range(4)]
        assert mesh["dp_replica"].mesh.tolist() == [rank % 4, rank % 4 + 4]
    assert not dist.is_initialized()


# ------------------------------------------------------------------ the context axis
def test_context_takes_its_share_of_the_world():
    assert Layout(context=2).resolve(8).data == 4
    assert Layout(context=2, tensor=2, pipeline=2).resolve(8).data == 1
    with pytest.raises(ValueError) as err:
        Layout(context=4, tensor=2).resolve(12)
    assert (
        str(err.value) == "pipeline(1) * context(4) * tensor(2) = 8 does not divide world size 12"
    )
    with pytest.raises(ValueError, match=r"pipeline\(1\) \* data\(2\) \* context\(2\) \* "):
        Layout(data=2, context=2).resolve(8)


def test_the_layout_names_context_only_where_it_is_used():
    assert repr(Layout(tensor=2)) == "Layout(data='auto', tensor=2, pipeline=1, zero_stage=0)"
    assert repr(Layout(context=2)).endswith("zero_stage=0, context=2)")


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", None, True])
def test_bad_context_size(value):
    with pytest.raises(ValueError, match=re.escape(f"context={value!r}")):
        Layout(context=value)


@pytest.mark.parametrize("rank", [0, 5, 6, 13])
def test_context_is_between_data_and_tensor(rank):
    # 16 ranks: pp 1, dp 2, cp 4, tp 2 -- context peers are tp apart; ZeRO's axis is dp x cp.
    layout = Layout(tensor=2, context=4).resolve(16)
    with fake_world(rank, 16):
        mesh = build_mesh(layout, "cpu")
        assert tuple(mesh.get_coordinate()) == (0, rank // 8, (rank // 2) % 4, rank % 2)
        assert mesh["cp"].mesh.tolist() == [rank - rank % 8 + rank % 2 + 2 * i for i in range(4)]
        shards = shard_mesh(mesh)
        assert shards.size() == 8 and shards.get_local_rank() == rank // 2
        assert shards.mesh.tolist() == [rank % 2 + 2 * i for i in range(8)]
        assert shard_mesh(mesh, tensor=True).mesh.shape == (8, 2)
        assert shard_mesh(mesh) is shards  # flattened once, then the same mesh


def test_without_context_zero_shards_over_the_data_axis():
    with fake_world(3, 8):
        mesh = build_mesh(Layout(tensor=2).resolve(8), "cpu")
        assert shard_mesh(mesh).mesh_dim_names == ("dp",)
        assert shard_mesh(mesh, tensor=True).mesh_dim_names == ("dp", "tp")


def test_fake_world_destroys_group_on_error():
    with pytest.raises(ZeroDivisionError):
        with fake_world(0, 8):
            assert dist.get_world_size() == 8
            raise ZeroDivisionError
    assert not dist.is_initialized()
