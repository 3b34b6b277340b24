"""The architecture's rules, checked on the source: the imports of the package and of ``tools/``
form no cycle and point down the floors, folder by folder (the package never imports ``tools/``
or the tests), nothing outside ``strategy/three_d.py`` reads a private member of the strategy,
the option table is the one source of names and defaults, and a fit reassigns nothing in torch or
Lightning."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import subprocess
import sys
from collections.abc import Container
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


def _run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (annotations only: what is
    imported there never runs, so it binds no floor)."""
    found: list[ast.AST] = []
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
            for node in child.orelse:
                found += [node, *_run_time_nodes(node)]
        else:
            found += [child, *_run_time_nodes(child)]
    return found


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module a ``from`` import names, relative ones (``from ..x import y``) resolved against
    ``module``; ``ValueError`` for one that climbs past the top of its package."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if node.level > len(parts) - 1:
        raise ValueError(
            f"{module}: 'from {'.' * node.level}{node.module or ''} import' climbs past {parts[0]}"
        )
    base = parts[: len(parts) - node.level]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(
    module: str, source: str, modules: Container[str], package: bool = False
) -> set[str]:
    """The modules of ``modules`` that ``module`` imports when it runs: every import at any depth
    of the file (function-level ones too), none under ``if TYPE_CHECKING:``; ``from a import b``
    is ``a.b`` where that is a module, else ``a``. ``package``: ``module`` is an ``__init__``."""
    anchor = f"{module}.__init__" if package else module  # where its relative imports start
    deps = set()
    for node in _run_time_nodes(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            name = _absolute(anchor, node)
            for alias in node.names:
                full = f"{name}.{alias.name}"
                deps.add(full if full in modules else name)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names)
    return {d for d in deps if d in modules and d != module}


def import_graph() -> dict[str, set[str]]:
    """Every run-time import (:func:`imports_of`) inside the package and ``tools/``."""
    modules = {
        _module_name(path): path for root in (PACKAGE, TOOLS_DIR) for path in root.rglob("*.py")
    }
    return {
        name: imports_of(name, path.read_text(), modules, path.name == "__init__.py")
        for name, path in modules.items()
    }


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


# The floors, bottom to top. A folder of the package (a top-level module counts as one) imports
# only from itself and from folders on lower floors: folders that share a floor do not import
# each other. The order is the code's: each floor is the lowest its imports allow.
#   compat, layout,       import nothing of ours (families: what a transformers family's config
#   families              and modules say: its token mixers, its tiny twin)
#   data                  the label convention (data/labels.py), chat rows checked by families
#   parallel              the techniques, each on its mesh slice; ZeroOptions beside its engine
#   offload, observe,     each stands on parallel alone: the offloaded optimizer, the run summary,
#   runtime, adapters     the failure and preemption handling, LoRA/QLoRA layers and their splits
#   models, options       models on adapters and parallel; the option table (options/) gathers
#                         the option groups of parallel, offload and runtime, and model_check
#                         checks a plan against a model on meta
#   checkpoint, planner   checkpoint files of models, adapters and tied groups; the planner on
#                         the option table
#   strategy              ThreeDStrategy and its recipe, on everything below
#   lightning_3d          the package's __init__: registers the strategy
#   app                   the Hydra apps and every ``__main__``: the only place Hydra is imported
#   tools                 tools/ at the repository root, not installed: stands on all of it
FLOORS = (
    ("compat", "layout", "families"),
    ("data",),
    ("parallel",),
    ("offload", "observe", "runtime", "adapters"),
    ("models", "options"),
    ("checkpoint", "planner"),
    ("strategy",),
    ("lightning_3d",),
    ("app",),
    ("tools",),
)
FLOOR = {folder: i for i, floor in enumerate(FLOORS) for folder in floor}
MODULE_BUDGET = 75  # what ``import lightning_3d`` may load (70 when this was written)


def folder_of(module: str) -> str:
    """The folder of the package ``module`` is in (``compat``, ``parallel``, ...), ``app`` for
    every ``__main__``, ``tools`` for tools/, ``lightning_3d`` for the package's __init__."""
    parts = module.split(".")
    if parts[0] == "tools":
        return "tools"
    if parts[-1] == "__main__":
        return "app"
    folder = parts[1] if len(parts) > 1 else parts[0]
    if folder not in FLOOR:
        raise AssertionError(
            f"{module} is on no floor: add its folder to FLOORS in tests/test_architecture.py"
        )
    return folder


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of another folder on a higher floor (``a imports b (a's < b's)``) or on the
    same one (``a imports b (a's beside b's)``)."""
    found = []
    for a, deps in graph.items():
        for d in deps:
            mine, theirs = folder_of(a), folder_of(d)
            if mine != theirs and FLOOR[theirs] >= FLOOR[mine]:
                relation = "beside" if FLOOR[theirs] == FLOOR[mine] else "<"
                found.append(f"{a} imports {d} ({mine} {relation} {theirs})")
    return sorted(found)


def test_imports_point_down_the_floors():
    graph = import_graph()
    assert {folder_of(m) for m in graph} == set(FLOOR)
    assert upward_imports(graph) == []


def test_the_floor_check_finds_an_upward_and_a_sideways_import():
    graph = {
        "lightning_3d.parallel.zero": {"lightning_3d.options", "lightning_3d.compat"},
        "lightning_3d.options": {"lightning_3d.parallel.zero", "lightning_3d.checkpoint.io"},
        "lightning_3d.checkpoint.io": set(),
        "lightning_3d.models.gpt": {"lightning_3d.parallel.zero", "lightning_3d.options"},
        "lightning_3d.compat": set(),
        "lightning_3d.planner.__main__": {"lightning_3d.app.run"},
        "lightning_3d.app.run": {"tools.harness.runs", "lightning_3d"},
        "lightning_3d": {"lightning_3d.strategy.three_d"},
        "lightning_3d.strategy.three_d": {"lightning_3d"},
        "tools.harness.runs": {"lightning_3d.app.run"},
    }
    assert upward_imports(graph) == [
        "lightning_3d.app.run imports tools.harness.runs (app < tools)",
        "lightning_3d.models.gpt imports lightning_3d.options (models beside options)",
        "lightning_3d.options imports lightning_3d.checkpoint.io (options < checkpoint)",
        "lightning_3d.parallel.zero imports lightning_3d.options (parallel < options)",
        "lightning_3d.strategy.three_d imports lightning_3d (strategy < lightning_3d)",
    ]


def test_relative_imports_are_resolved_and_may_not_climb_past_the_package():
    modules = {
        "lightning_3d.parallel.zero",
        "lightning_3d.options",
        "lightning_3d.parallel",
        "lightning_3d.app.run",
    }
    source = "from ..options import Plan\nif TYPE_CHECKING:\n    from lightning_3d.app import run\n"
    assert imports_of("lightning_3d.parallel.zero", source, modules) == {"lightning_3d.options"}
    assert imports_of("lightning_3d.parallel", "from . import zero", modules, package=True) == {
        "lightning_3d.parallel.zero"
    }
    with pytest.raises(ValueError, match="climbs past lightning_3d"):
        imports_of("lightning_3d.layout", "from .. import tools", modules)


def _hydra_imports(source: str) -> list[str]:
    """The modules of Hydra (and its OmegaConf) that ``source`` imports, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append(node.module or "")
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return [n for n in found if n.split(".")[0] in ("hydra", "omegaconf")]


def test_no_library_module_imports_hydra():
    """Hydra composes the apps' configs; the library below them takes typed values (the app hands
    the strategy a Plan, the stop messages its command line: runtime/resume_hint.py)."""
    offenders = {
        str(path.relative_to(REPO)): _hydra_imports(path.read_text())
        for path in PACKAGE.rglob("*.py")
        if folder_of(_module_name(path)) != "app"
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    planted = "def hint():\n    from hydra.core.hydra_config import HydraConfig\n"
    assert _hydra_imports(planted) == ["hydra.core.hydra_config"]


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
    assert [m for m in loaded if folder_of(m) in ("planner", "app")] == []
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
