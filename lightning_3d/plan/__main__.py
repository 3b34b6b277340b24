"""``python -m lightning_3d.planner``: the layout planner (``lightning_3d/planner/``) under the name
of what it plans. Same arguments as ``python -m lightning_3d.planner``."""

import runpy

if __name__ == "__main__":
    # Run the planner as ``__main__`` so that Hydra finds ``conf/`` relative to its file.
    runpy.run_module("lightning_3d.planner", run_name="__main__", alter_sys=True)
