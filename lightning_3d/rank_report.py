"""One reporter for every failure: a rank's error reaches the user as one ``error:`` line from
the launching process, its traceback in a log file that line names.

A rank started by :func:`lightning_3d.app.launch.launch_job` that fails does not print its
traceback (two ranks failing in a sharded save used to print some 250 lines of
``CheckpointException``): it sends one record (its rank, exit code, one line saying what failed,
its traceback) to the launcher through the rendezvous store the launcher hosts, not through a
file, as the disk may be what failed (:func:`send`), and exits with the code of its kind of
failure (:mod:`lightning_3d.runtime.exit_codes`). The launcher, once every rank has ended, writes the
records' tracebacks to ``<run dir>/ranks.log`` (or, where that cannot be written, a file in the
temporary directory) and prints the line of the failure that caused the others: an I/O error
before a rank's own error before a lost peer (:func:`report`).

A one-process run reports the same way, from its own process (:func:`report_here`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

from lightning_3d.runtime.exit_codes import IO_ERROR, PEER_LOST, RANK_ERROR
from lightning_3d.runtime.failures import LINES_ATTR, exit_code_of, rank_line

KEY = "lightning_3d/failure/{rank}"
LOG = "ranks.log"
_PRIORITY = {IO_ERROR: 0, RANK_ERROR: 1, PEER_LOST: 2}  # the cause first, its consequences after


def record_of(exception: BaseException, rank: int) -> dict[str, Any]:
    """What a rank says about ``exception``: ``rank``, ``code``, ``line`` and ``traceback``."""
    lines = [line for line in getattr(exception, LINES_ATTR, None) or [] if line]
    code = exit_code_of(exception)
    own = rank_line(exception, rank)
    if code == IO_ERROR or not lines:  # the file of an I/O error, whatever the strategy said first
        lines = [own, *[line for line in lines if line != own]]
    text = "".join(traceback.format_exception(type(exception), exception, exception.__traceback__))
    return {
        "rank": rank,
        "code": code,
        "line": lines[0].removeprefix("lightning_3d: "),
        "details": lines[1:],
        "traceback": text,
    }


def send(exception: BaseException, rank: int) -> int:
    """Send ``exception``'s record to the launcher's store; return the rank's exit code. Where the
    store cannot be reached, the line and traceback go to stderr instead."""
    from torch.distributed import TCPStore

    record = record_of(exception, rank)
    try:
        store = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=10),
            wait_for_workers=False,
        )
        store.set(KEY.format(rank=rank), json.dumps(record))
    except Exception:  # noqa: BLE001 -- no launcher to tell: say it here
        print(
            record["traceback"],
            f"lightning_3d: {record['line']}",
            sep="",
            file=sys.stderr,
            flush=True,
        )
    return record["code"]


def collect(store: Any, world_size: int) -> list[dict[str, Any]]:
    """The records the ranks sent, by rank."""
    records = []
    for rank in range(world_size):
        key = KEY.format(rank=rank)
        try:
            if store.check([key]):
                records.append(json.loads(store.get(key)))
        except Exception:  # noqa: BLE001 -- an unreadable record: the rank's exit code still counts
            continue
    return records


def write_log(run_dir: Path, records: list[dict[str, Any]]) -> Optional[Path]:
    """The records' tracebacks in ``run_dir/ranks.log``, else in a file in the temporary
    directory (the run directory's disk may be the one that is full); ``None`` if neither."""
    text = "".join(
        f"=== rank {r['rank']} (exit code {r['code']}): {r['line']}\n"
        + "".join(f"{line}\n" for line in r.get("details", []))
        + f"{r['traceback']}\n"
        for r in records
    )
    try:
        path = run_dir / LOG
        with open(path, "a") as log:
            log.write(text)
        return path
    except OSError:
        pass
    try:
        fd, name = tempfile.mkstemp(prefix="lightning_3d-ranks-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            log.write(text)
        return Path(name)
    except OSError:
        return None


def root_cause(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The record of the failure that caused the others: an I/O error, else a rank's own error,
    else a lost peer; the lowest rank among equals."""
    return min(records, key=lambda r: (_PRIORITY.get(r["code"], 1), r["rank"]))


def report(run_dir: Path, records: list[dict[str, Any]]) -> int:
    """Print the one ``error:`` line for ``records`` (not empty), write the log; the exit code."""
    cause = root_cause(records)
    log = write_log(run_dir, records)
    others = sorted(r["rank"] for r in records if r is not cause)
    also = f"; rank(s) {', '.join(map(str, others))} failed too" if others else ""
    where = f"tracebacks: {log}" if log is not None else "no traceback log could be written"
    print(f"error: {cause['line']}{also} ({where})", file=sys.stderr, flush=True)
    return cause["code"]


def report_here(exception: BaseException, run_dir: Path) -> int:
    """A one-process run's failure: one ``error:`` line, the traceback in the log; the exit code."""
    return report(run_dir, [record_of(exception, 0)])
