"""A rank SIGKILLed mid-training: the survivor stops with an error instead of hanging, the
checkpoints written so far are intact, and relaunching with ``ckpt_path="last"`` resumes.
"""

import multiprocessing as mp
import os
import queue
import time
import traceback
from contextlib import contextmanager

import torch

from lightning_3d.app.launch import hosted_store, local_rank_env

TIMEOUT_S = 30.0  # the strategy's collective timeout in this test


def _entry(rank, port, results, root, kill_at, resume):
    os.environ.update(local_rank_env(rank, 2, port, threads=1, agent_store=True))
    from support.faults import fit_until_killed

    try:
        out = fit_until_killed(rank, root, 6, kill_at, timeout_s=TIMEOUT_S, resume=resume)
        results.put((rank, "ok", out, time.time()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc(), time.time()))


@contextmanager
def _world(root, kill_at, resume):
    """Two ranks around a rendezvous store this process hosts (no port race); torn down on exit."""
    ctx = mp.get_context("spawn")
    with hosted_store() as port:
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_entry, args=(r, port, results, root, kill_at, resume))
            for r in range(2)
        ]
        try:
            for p in procs:
                p.start()
            yield procs, results
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
                    p.join()


def test_a_killed_rank_stops_the_others_and_last_resumes(tmp_path):
    root = str(tmp_path)
    with _world(root, kill_at=3, resume=False) as (procs, results):
        rank, status, message, _ = results.get(timeout=300)  # the victim never reports
        procs[1].join(timeout=60)
        assert procs[1].exitcode == -9  # SIGKILL, no clean-up
        assert (rank, status) == (0, "error"), message
        # gloo: "Connection closed by peer" / "Connection reset by peer" at once, or a timeout.
        assert any(text in message.lower() for text in ("by peer", "timed out", "timeout")), message
        procs[0].join(timeout=TIMEOUT_S + 30)  # the survivor exits, it does not hang
        assert procs[0].exitcode is not None
    # The last complete checkpoint (ModelCheckpoint runs after the killing callback: step 2's).
    saved_step = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)[
        "global_step"
    ]
    assert saved_step == 2
    with _world(root, kill_at=None, resume=True) as (procs, results):
        try:
            outs = [results.get(timeout=300) for _ in range(2)]
        except queue.Empty:
            raise AssertionError("the relaunched world did not finish") from None
    for _rank, status, out, _ in outs:
        assert status == "ok", out
        # Only the remaining steps.
        assert out["global_step"] == 6 and len(out["losses"]) == 6 - saved_step
