"""Hydra's entry point for the apps (train, fine-tune, the planner), with the apps' exit codes and
sweep semantics.

``@hydra.main`` alone ends a bad command line (an unknown key, group option or a wrong type)
with a paragraph and exit code 1, the code a crash has too, and a ``-m`` sweep stops at the first
job that exits. :func:`hydra_app` runs the same ``hydra.main`` but

* a config error Hydra raises before the task runs becomes one ``error:`` line and exit code 2,
  as the app's own checks (:func:`lightning_3d.app.run.validate`) report bad values; a run directory
  where Hydra cannot write its own files (a full disk, a read-only one) is named as such, exit
  code 3 (:mod:`lightning_3d.runtime.exit_codes`);
* under ``-m`` every job runs: a job that fails (a non-zero exit code or an exception) is
  recorded, the next one starts, and at the end the failed ones are listed and the sweep exits 1.

Example (:mod:`lightning_3d.app.train`)::

    def task(cfg):
        return run(cfg)

    def main():
        register_configs()
        hydra_app(task, config_path=str(CONF_DIR), config_name="train")
"""

from __future__ import annotations

import functools
import io
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, Optional

from omegaconf import DictConfig

# What Hydra adds to a message that is not about the user's config.
_HYDRA_HINTS = ("Set the environment variable HYDRA_FULL_ERROR=1",)


class _HeldStream(io.TextIOBase):
    """Holds what is written to it until :meth:`release` (then passes it through): Hydra's
    message for a config error is turned into one line instead of being printed as it is."""

    def __init__(self, target: Any) -> None:
        super().__init__()
        self.target = target
        self.held: Optional[list[str]] = []

    def write(self, text: str) -> int:
        if self.held is None:
            return self.target.write(text)
        self.held.append(text)
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def fileno(self) -> int:
        return self.target.fileno()

    def isatty(self) -> bool:
        return self.target.isatty()

    def release(self) -> None:
        """Write what was held and pass everything written from now on straight through."""
        held, self.held = self.held, None
        if held:
            self.target.write("".join(held))

    def one_line(self) -> str:
        """What was held, as one line (Hydra's hints and a traceback's frames left out)."""
        lines = [line.strip() for line in "".join(self.held or []).splitlines() if line.strip()]
        if any(line.startswith("Traceback") for line in lines):
            lines = lines[-1:]  # the exception itself
        argparse_errors = [line.split(": error: ", 1)[1] for line in lines if ": error: " in line]
        lines = argparse_errors or lines  # argparse prints its usage first
        return " ".join(line for line in lines if not line.startswith(_HYDRA_HINTS))


def _run_dir() -> Optional[str]:
    """The run directory Hydra was setting up, as the command line gives it (Hydra has
    forgotten its config by the time it exits)."""
    keys = ("hydra.run.dir=", "hydra.sweep.dir=")
    given = [arg.split("=", 1)[1] for arg in sys.argv[1:] if arg.startswith(keys)]
    return given[-1].strip("'\"") if given else None


@dataclass
class _Sweep:
    """The jobs of this invocation: whether the task has started, and the failed ones."""

    started: bool = False
    failed: list[str] = field(default_factory=list)


def hydra_app(task: Callable[[DictConfig], int], config_path: str, config_name: str) -> NoReturn:
    """Run ``task`` (config -> exit code) under ``hydra.main`` and exit with the app's code:
    0, 2 for a bad config (Hydra's or the app's), the task's own otherwise; a sweep with failed
    jobs exits 1 after running all of them. ``config_path`` is relative to ``task``'s file, as
    in ``hydra.main``, or absolute (:data:`lightning_3d.app.config.CONF_DIR`)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from lightning_3d.app.streams import guard_streams
    from lightning_3d.runtime.exit_codes import BAD_INPUT, IO_ERROR
    from lightning_3d.runtime.failures import io_error_of, io_error_words

    guard_streams()  # a reader closing stdout (| head) never stops the run
    sweep = _Sweep()
    stderr = _HeldStream(sys.stderr)

    @functools.wraps(task)  # Hydra names the job and finds the config from the wrapped function
    def task_function(cfg: DictConfig) -> None:
        if not sweep.started:
            sweep.started = True
            stderr.release()
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            code = task(cfg)
            if code:
                sys.exit(code)
            return
        job = f"job {hydra_cfg.job.num} ({' '.join(hydra_cfg.overrides.task)})"
        try:
            code = task(cfg)
        except Exception as err:  # noqa: BLE001 -- one job's failure must not stop the sweep
            traceback.print_exc()
            sweep.failed.append(f"{job}: {type(err).__name__}: {err}".splitlines()[0])
            return
        if code:
            sweep.failed.append(f"{job}: exit code {code}")

    import hydra

    app = hydra.main(version_base=None, config_path=config_path, config_name=config_name)(
        task_function
    )
    sys.stderr = stderr
    try:
        app()
    except SystemExit as exit_:
        if not sweep.started and exit_.code not in (0, None):
            # Hydra could not write its own files: not the command line's fault.
            io_error = io_error_of(exit_)  # (not Hydra's MissingConfigException, an IOError too)
            io_error = io_error if io_error is not None and io_error.errno is not None else None
            # Failed at close: name the directory.
            if io_error is not None and not io_error.filename:
                io_error = OSError(io_error.errno, io_error.strerror, _run_dir())
            message = (
                io_error_words(io_error)
                if io_error is not None
                else stderr.one_line() or "bad command line"
            )
            stderr.held = None  # said in one line instead
            print(f"error: {message}", file=stderr.target)
            sys.exit(IO_ERROR if io_error is not None else BAD_INPUT)
        raise
    finally:
        sys.stderr = stderr.target
        if stderr.held is not None:
            stderr.release()  # --help, --cfg, --info: Hydra's own output, as it is
    if sweep.failed:
        print(
            f"sweep: {len(sweep.failed)} job(s) failed:", *sweep.failed, sep="\n  ", file=sys.stderr
        )
        sys.exit(1)
    sys.exit(0)
