"""The context-parallel options: names, defaults, checks, the Hydra group and the strategy."""

import pytest

from lightning_3d import ThreeDStrategy
from lightning_3d.options import Plan, from_hydra, hydra_schema


def test_context_and_its_scheme_are_options():
    plan = Plan.from_options(context=2, context_scheme="alltoall")
    assert (plan.layout.context, plan.cp.scheme) == (2, "alltoall")
    assert Plan().layout.context == 1 and Plan().cp.scheme == "ring"
    schema = hydra_schema("parallelism")()
    assert (schema.context, schema.context_scheme) == (1, "ring")
    assert from_hydra({"context": 4}).layout.context == 4
    assert ThreeDStrategy(context=2).layout.context == 2


def test_a_bad_scheme_or_size_is_named():
    with pytest.raises(ValueError, match=r"context_scheme='ulysses' must be one of \['ring', "):
        Plan.from_options(context=2, context_scheme="ulysses")
    with pytest.raises(ValueError, match="context=0 must be a positive integer"):
        ThreeDStrategy(context=0)


def test_the_world_is_cut_with_context():
    assert Plan.from_options(context=2, tensor=2).resolved(8).layout.shape == (1, 2, 2, 2)
    with pytest.raises(ValueError, match=r"context\(2\) \* tensor\(2\) = 4 does not divide world"):
        Plan.from_options(context=2, tensor=2).resolved(6)
