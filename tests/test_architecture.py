"""The architecture's rules, checked on the source: the imports of the package and of ``tools/``
form no cycle and point down the layers (the package never imports ``tools/`` or the tests), nothing
outside ``strategy/three_d.py`` reads a private member of the strategy, the option table is the one
source of names and defaults, and a fit reassigns nothing in torch or Lightning."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_3d
import tools
from lightning_3d.options import OPTIONS, Plan, hydra_schema, options_table
from lightning_3d.strategy.three_d import ThreeDStrategy

PACKAGE = Path(lightning_3d.__file__).parent
TOOLS_DIR = Path(tools.__file__).parent  # benchmarks, calibration, the run harness: not installed
REPO = PACKAGE.parent
ROOTS = ("lightning_3d", "tools")


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _is_ours(module: str) -> bool:
    return module.split(".")[0] in ROOTS


def import_graph() -> dict[str, set[str]]:
    """Every import inside the package and ``tools/``, at any depth of the file (function-level
    ones too)."""
    modules = {
        _module_name(path): path for root in (PACKAGE, TOOLS_DIR) for path in root.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_ours(node.module or ""):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if _is_ours(a.name))
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert (
        "lightning_3d.strategy.recipe" in graph and graph["lightning_3d.strategy.three_d"]
    )  # the walk saw the package
    assert graph["tools.bench.compare"]  # and tools/
    assert cycles(graph) == []


# The layers, bottom to top: a module imports only from its own layer or those below it
# (function-level imports included). Every ``__main__`` of the package is an entry point, in the
# app's layer; ``tools/`` (benchmarks, calibration, the run harness) stands on all of it.
BASE = {"lightning_3d.compat", "lightning_3d.layout", "lightning_3d.runtime.exit_codes"}
CORE = (
    "parallel",
    "offload",
    "checkpoint",
    "runtime",
    "observe",
    "models",
    "data",
    "options",
    "adapters",
)
LAYERS = ("base", "core", "planner", "strategy", "app", "tools")
MODULE_BUDGET = 75  # what ``import lightning_3d`` may load (70 when this was written)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "tools":
        return "tools"
    if module in BASE:
        return "base"
    if parts[-1] == "__main__" or (len(parts) > 1 and parts[1] == "app"):
        return "app"
    if len(parts) == 1 or parts[1] == "strategy":
        return "strategy"
    if parts[1] == "planner":
        return "planner"
    if parts[1] in CORE:
        return "core"
    raise AssertionError(
        f"{module} belongs to no layer: add its package to one in tests/test_architecture.py"
    )


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    return sorted(
        f"{a} ({layer_of(a)}) imports {d} ({layer_of(d)})"
        for a, deps in graph.items()
        for d in deps
        if rank[layer_of(d)] > rank[layer_of(a)]
    )


def test_imports_point_down_the_layers():
    graph = import_graph()
    assert {layer_of(m) for m in graph} == set(LAYERS)
    assert upward_imports(graph) == []


def test_the_layer_check_finds_an_upward_import():
    graph = {
        "lightning_3d.parallel.zero": {"lightning_3d.planner.search"},
        "lightning_3d.planner.search": {"lightning_3d.app.run"},
        "lightning_3d.app.run": {"tools.harness.runs"},
        "tools.harness.runs": set(),
    }
    assert upward_imports(graph) == [
        "lightning_3d.app.run (app) imports tools.harness.runs (tools)",
        "lightning_3d.parallel.zero (core) imports lightning_3d.planner.search (planner)",
        "lightning_3d.planner.search (planner) imports lightning_3d.app.run (app)",
    ]


def _outside_imports(source: str) -> list[str]:
    """Modules of ``tools/`` or of the tests (``tests``, ``support``) that ``source`` imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [n for n in names if n.split(".")[0] in ("tools", "tests", "support")]
    return found


def test_the_package_imports_nothing_of_tools_or_the_tests():
    offenders = {
        str(path.relative_to(REPO)): _outside_imports(path.read_text())
        for path in PACKAGE.rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert _outside_imports("def f():\n    from tools.bench import compare\n") == ["tools.bench"]
    assert _outside_imports("import support.faults, torch") == ["support.faults"]


@pytest.mark.parametrize(
    "package, tool",
    [
        ("bench", "bench"),
        ("calibration", "calibration"),
        ("harness", "harness"),
        ("options.docs_page", "options_page"),
    ],
)
def test_the_package_holds_no_workshop(package, tool):
    """The workshop moved to tools/ whole: no copy or stub of it is left in the package (a folder
    left holding only ``__pycache__`` is a namespace package, without an origin: no module)."""
    spec = importlib.util.find_spec(f"lightning_3d.{package}")
    assert spec is None or spec.origin is None, spec.origin
    assert importlib.util.find_spec(f"tools.{tool}") is not None


def test_importing_the_package_loads_no_planner_app_or_tool():
    code = (
        "import sys, lightning_3d; print(' '.join(m for m in sys.modules "
        "if m.startswith(('lightning_3d', 'tools', 'support'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    loaded = done.stdout.split()
    assert [m for m in loaded if not m.startswith("lightning_3d.") and m != "lightning_3d"] == []
    assert [m for m in loaded if layer_of(m) in ("planner", "app")] == []
    assert 0 < len(loaded) <= MODULE_BUDGET, f"import lightning_3d loads {len(loaded)} modules"


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _private_strategy_reads(source: str) -> list[str]:
    """``<...strategy>._name`` in ``source``: a private member read through a strategy."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            owner = ast.unparse(node.value)
            if re.search(r"strategy$", owner):
                found.append(f"{owner}.{node.attr}")
    return found


def test_no_module_outside_the_strategy_reads_its_private_members():
    offenders = {}
    for path in [
        *PACKAGE.rglob("*.py"),
        *TOOLS_DIR.rglob("*.py"),
        *(REPO / "tests").glob("*.py"),
        *(REPO / "examples").glob("*.py"),
    ]:
        if path == PACKAGE / "strategy" / "three_d.py":
            continue
        reads = _private_strategy_reads(path.read_text())
        if reads:
            offenders[str(path.relative_to(REPO))] = reads
    assert offenders == {}
    assert _private_strategy_reads("trainer.strategy._pipeline.x") == ["trainer.strategy._pipeline"]


def test_the_strategys_mixins_use_only_their_own_private_members():
    # A base class of ThreeDStrategy defined in another module must not reach into the
    # strategy's own private state (self._x defined in strategy/three_d.py).
    own = {
        n.attr
        for n in ast.walk(ast.parse((PACKAGE / "strategy" / "three_d.py").read_text()))
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
    }
    for base in ThreeDStrategy.__mro__[1:]:
        if not base.__module__.startswith("lightning_3d"):
            continue
        tree = ast.parse(inspect.getsource(base))
        used = {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "self"
            and n.attr.startswith("_")
            and not n.attr.startswith("__")
        }
        assert used & own == set(), f"{base.__qualname__} reads the strategy's {sorted(used & own)}"


def test_options_have_one_source_for_names_and_defaults():
    names = [option.name for option in OPTIONS]
    assert len(names) == len(set(names))
    defaults = Plan().options()
    assert {option.name: option.default for option in OPTIONS} == defaults
    parallelism, offload = hydra_schema("parallelism")(), hydra_schema("offload")()
    for option in OPTIONS:
        schema = offload if option.hydra_group == "offload" else parallelism
        assert getattr(schema, option.key) == option.default, option.name
    # the strategy takes exactly these names
    assert (
        ThreeDStrategy(**{o.name: o.default for o in OPTIONS if o.name != "offload_path"}).plan
        == Plan.from_options()
    )
    with pytest.raises(ValueError, match="unknown ThreeDStrategy option"):
        ThreeDStrategy(no_such_option=1)


def test_the_options_page_carries_the_option_table():
    assert options_table() in (REPO / "docs" / "options.md").read_text()


def test_an_old_option_name_is_refused():
    with pytest.raises(ValueError, match="unknown ThreeDStrategy option"):
        Plan.from_options(activation_checkpointing="full")


def test_a_plan_rederives_its_defaults_when_updated():
    plan = Plan.from_options(pipeline=2)
    assert plan.pp.micro_batches == 2
    assert plan.updated(pipeline=4).pp.micro_batches == 4
    assert plan.updated(schedule="interleaved_1f1b").pp.virtual_stages == 2
    assert Plan.from_options(**plan.options()) == plan


def _functions_of_torch_and_lightning() -> dict[str, object]:
    """Every attribute of the torch and Lightning namespaces and classes a strategy could patch."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.pytorch.plugins import precision
    from lightning.pytorch.strategies import ParallelStrategy, Strategy
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.tensor import DTensor

    owners = {
        "F": F,
        "torch": torch,
        "dist": dist,
        "Tensor": torch.Tensor,
        "Module": torch.nn.Module,
        "GradScaler": torch.amp.GradScaler,
        "PipelineStage": PipelineStage,
        "DTensor": DTensor,
        "LightningModule": pl.LightningModule,
        "Trainer": pl.Trainer,
        "Strategy": Strategy,
        "ParallelStrategy": ParallelStrategy,
    }
    owners.update({f"schedules.{n}": c for n, c in vars(schedules).items() if isinstance(c, type)})
    owners.update({f"precision.{n}": c for n, c in vars(precision).items() if isinstance(c, type)})
    # __slotnames__ is copyreg's cache, filled in by the first pickling of an instance.
    return {
        f"{owner}.{name}": value
        for owner, obj in owners.items()
        for name, value in list(vars(obj).items())
        if name != "__slotnames__"
    }


def _fit_and_compare(rank: int, runs: list) -> dict:
    import torch.nn.functional as F

    from lightning_3d.models.lit_gpt import LitGPT
    from tools.harness.runs import fit_gpt

    cross_entropy = F.cross_entropy
    before = _functions_of_torch_and_lightning()
    model_class = dict(vars(LitGPT))
    losses = [fit_gpt(rank, run)["losses"] for run in runs]
    after = _functions_of_torch_and_lightning()
    return {
        "changed": sorted(
            k for k in before.keys() | after.keys() if before.get(k) is not after.get(k)
        ),
        "model_class_changed": sorted(
            k for k in model_class if vars(LitGPT).get(k) is not model_class[k]
        ),
        "cross_entropy_is_original": F.cross_entropy is cross_entropy,
        "losses": losses,
    }


def test_a_tensor_parallel_and_a_pipeline_fit_reassign_nothing_in_torch_or_lightning():
    from tools.harness.runs import Run
    from tools.harness.world import run_world

    runs = [
        Run(strategy={"tensor": 2}, devices=2, steps=2, validate=True),
        Run(
            strategy={"pipeline": 2},
            devices=2,
            steps=2,
            validate=True,
            trainer={"precision": "bf16-mixed", "gradient_clip_val": 1.0},
        ),
    ]
    for rank in run_world(_fit_and_compare, 2, runs):
        assert rank["cross_entropy_is_original"]
        assert rank["changed"] == [] and rank["model_class_changed"] == []
        assert all(len(losses) == 2 for losses in rank["losses"])


def test_a_hand_built_plan_is_checked_by_the_strategy_and_keeps_its_values():
    from lightning_3d.layout import Layout
    from lightning_3d.options import PipelineOptions

    plan = Plan(layout=Layout(pipeline=2), pp=PipelineOptions(schedule="gpipe"))
    strategy = ThreeDStrategy(plan, zero_stage=1)
    assert strategy.plan.pp.schedule == "gpipe" and strategy.plan.pp.micro_batches == 2
    assert strategy.plan.layout.zero_stage == 1 and strategy.plan.layout.pipeline == 2
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        ThreeDStrategy(Plan(pp=PipelineOptions(schedule="zigzag")))
