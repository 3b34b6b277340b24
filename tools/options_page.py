"""``docs/options.md``, rendered from the option table (:data:`lightning_3d.options.OPTIONS`).

The page is generated so that it cannot drift from the code: ``tests/test_docs.py`` compares the
file with :func:`options_page` and names the command that rewrites it.

Example::

    >>> from tools.options_page import options_page, write_options_page
    >>> options_page().splitlines()[0]
    '# Options'
    >>> write_options_page()  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lightning_3d.options import options_table

OPTIONS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "options.md"
REGENERATE = (
    'PYTHONPATH=. python -c "from tools.options_page import write_options_page; '
    'write_options_page()"'
)

_INTRO = """\
# Options

<!-- Generated from OPTIONS in lightning_3d/options/__init__.py; do not edit by hand. Rewrite with:
{regenerate} -->

Every option of the strategy, its default and its Hydra key, from the one table the code reads
(`OPTIONS` in `lightning_3d/options/__init__.py`). The same names are the keyword arguments of
`ThreeDStrategy(**options)` and `lightning_3d.options.Plan.from_options(**options)` (a `Plan` is
passed as `ThreeDStrategy(plan)`), and the keys of the Hydra `parallelism` and `offload` groups
(`lightning_3d/app/conf/parallelism/`, `lightning_3d/app/conf/offload/`), whose schemas are made from
the table too.

```python
import lightning as L
from lightning_3d import ThreeDStrategy

trainer = L.Trainer(devices=8, strategy=ThreeDStrategy(tensor=2, pipeline=2, zero_stage=3))
```

```bash
python examples/train.py parallelism.tensor=2 parallelism.pipeline=2 parallelism.zero_stage=3 trainer.devices=8
```

`data="auto"` is `world_size / (tensor × pipeline)`. Invalid sizes, a stage outside 0–3, a bad
value of any option or an unknown option raise `ValueError` naming the values while the
`Trainer` is constructed, before any process or process group exists; the Hydra app turns the
same check into one `error:` line and exit code 2 before any rank starts.
"""


def options_page() -> str:
    """The whole of ``docs/options.md``: an introduction and the option table."""
    intro = _INTRO.format(regenerate=REGENERATE)
    return f"{intro}\n{options_table()}\n"


def write_options_page(path: Optional[Path] = None) -> Path:
    """Write :func:`options_page` to ``docs/options.md`` (or ``path``) and return the path."""
    target = OPTIONS_PAGE if path is None else Path(path)
    target.write_text(options_page())
    return target
