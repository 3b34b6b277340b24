"""The command-line overrides the adapter and chat pages show compose with the apps' config.

Every ``key=value`` of a ``python examples/train.py`` / ``examples/finetune.py`` command (or
``lightning3d-train`` / ``lightning3d-finetune``, the same apps installed) in the pages' ``bash`` /
``console`` blocks, and every inline code span made only of overrides, is composed with Hydra's
compose API against the apps' configs (``lightning_3d/app/conf/``, the schemas registered, nothing
run), with the page's groups in front (``model=hf``; ``data=chat`` on the chat page) so a lone
``data.packing=true`` is read where the page means it. Before: docs/adapters.md spelled
``adapter.quantization=bitsandbytes``, which Hydra refuses (the adapter group lives at
``model.adapter``); seen failing on it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tools.harness.apps import compose_config

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = {"adapters.md": ["model=hf"], "chat.md": ["model=hf", "data=chat"]}
OVERRIDE = re.compile(r"^[+~]?[A-Za-z_][\w.]*=\S*$")
APP = re.compile(r"(?:examples/|lightning3d-)(train|finetune)(?:\.py)?\b")
BLOCK = re.compile(r"```(?:bash|console)\n(.*?)```", re.S)
# Prose writes a number as N: composed as one.
PLACEHOLDERS = {"parallelism.context=N": "parallelism.context=2"}
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """(config name, overrides) of each app command in the page's shell blocks."""
    out = []
    for block in BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip().removeprefix("$ ")
            found = APP.search(line)
            if found is None:
                continue
            words = shlex.split(line[found.end() :])
            out.append((found.group(1), [w for w in words if OVERRIDE.match(w)]))
    return out


def _inline(text: str) -> list[tuple[str | None, list[str]]]:
    """(config name or ``None``, overrides) of inline code spans that are nothing but
    overrides (``adapter=qlora ...``, or one dotted ``data.packing=true``), or an app command
    (``examples/finetune.py adapter=lora``)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = []
    for span in INLINE.findall(prose):
        app = re.match(
            r"^(?:python )?(?:examples/|lightning3d-)(train|finetune)(?:\.py)?(?:\s|$)", span
        )
        words = span[app.end() :].split() if app else span.split()
        if not all(OVERRIDE.match(w) for w in words):
            continue
        # a lone ``quantization=bitsandbytes`` names an option in prose, not an override
        dotted = any("." in w.split("=")[0] for w in words)
        if app or (words and (len(words) > 1 or dotted)):
            spans.append((app.group(1) if app else None, [PLACEHOLDERS.get(w, w) for w in words]))
    return spans


def _cases() -> list[tuple[str, str, list[str]]]:
    cases = []
    for page, context in PAGES.items():
        text = (DOCS / page).read_text()
        for config, overrides in _commands(text):
            cases.append((page, config, overrides))
        for config, overrides in _inline(text):
            roots = {w.lstrip("+~").split(".")[0] for w in overrides}
            if config is not None:
                cases.append((page, config, overrides))
            elif "planner" in roots:  # python -m lightning_3d.planner's own config
                cases.append((page, "plan", overrides))
            else:
                config = "finetune" if "finetune" in roots else "train"
                cases.append((page, config, [*context, *overrides]))
    return cases


def test_the_pages_show_commands_and_override_spans():
    cases = _cases()
    assert sum(page == "adapters.md" for page, _, _ in cases) >= 3
    assert sum(page == "chat.md" for page, _, _ in cases) >= 3


@pytest.mark.parametrize(
    ("page", "config", "overrides"),
    _cases(),
    ids=lambda value: value if isinstance(value, str) else " ".join(value)[:60],
)
def test_every_override_the_pages_show_composes(page, config, overrides):
    try:
        compose_config(config, *overrides)
    except Exception as err:  # noqa: BLE001 -- Hydra's override and config errors differ in type
        pytest.fail(f"docs/{page}: {' '.join(overrides)}: {err}", pytrace=False)
