"""``run_world`` under contention: worlds started at the same time, and ports other programs hold.

A launcher that picks a free port and lets rank 0 bind it later can be handed a port that another
world was handed too (the OS reuses a just-released port), or that another program takes in
between; rank 0 then fails with "address already in use", or ranks join another world's store.
These tests make both happen on purpose, through ``free_port`` (the port picker), and check that
every world still forms on its own and computes its own result.
"""

import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

import lightning_3d.app.launch
import tools.harness.world
from lightning_3d.app.launch import free_port, local_rank_env
from tools.harness.world import run_world

WORLD_TIMEOUT_S = 90.0  # a broken rendezvous fails, or times out, well before this
PG_TIMEOUT = timedelta(seconds=30)
MEET_TIMEOUT_S = 60.0  # the slowest rank of the other world starts well within this


def _all_reduce(rank, tag, meet=None, everyone=0):
    """All-reduce a value unique to this world. With ``meet`` (a directory), first wait there until
    all ``everyone`` ranks of all worlds have joined their worlds, so that the rendezvous overlap."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=PG_TIMEOUT)  # env://, as Lightning does it
    if meet is not None:
        (Path(meet) / f"{tag}-{rank}").touch()
        deadline = time.monotonic() + MEET_TIMEOUT_S
        while len(os.listdir(meet)) < everyone:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {sorted(os.listdir(meet))} of {everyone} ranks joined")
            time.sleep(0.05)
    t = torch.tensor([100.0 * tag + rank + 1])
    dist.all_reduce(t)
    env = {
        k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return t.item(), env


def _expected(tag, world_size):
    return sum(100.0 * tag + r + 1 for r in range(world_size))


def _pick(monkeypatch, port):
    """Make the port picker return ``port``, wherever a launcher looks it up."""
    monkeypatch.setattr(lightning_3d.app.launch, "free_port", lambda: port)
    monkeypatch.setattr(tools.harness.world, "free_port", lambda: port, raising=False)


# Each rank imports Lightning (~8 s of CPU on the 2-core CI machine), hence small worlds.
def test_concurrent_worlds_handed_the_same_port(monkeypatch, tmp_path):
    _pick(monkeypatch, free_port())  # both worlds are handed the same (free) port
    sizes = {1: 2, 2: 1}  # tag: world size
    results, errors = {}, {}

    def world(tag):
        try:
            args = (tag, str(tmp_path), sum(sizes.values()))
            results[tag] = run_world(_all_reduce, sizes[tag], *args, timeout=WORLD_TIMEOUT_S)
        except BaseException as err:  # noqa: BLE001 - reported below, with the tag
            errors[tag] = err

    threads = [threading.Thread(target=world, args=(tag,)) for tag in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, "\n".join(f"world {tag}: {err!r}"[:3000] for tag, err in errors.items())
    ports = set()
    for tag, size in sizes.items():
        assert len(results[tag]) == size
        for rank, (value, env) in enumerate(results[tag]):
            # Each world reduced its own ranks' values, no others.
            assert value == _expected(tag, size)
            assert env["RANK"] == env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == str(size)
            assert (
                env["MASTER_ADDR"] == "127.0.0.1"
                and env["MASTER_PORT"] == results[tag][0][1]["MASTER_PORT"]
            )
        ports.add(results[tag][0][1]["MASTER_PORT"])
    assert len(ports) == len(sizes)  # one store per world


def test_a_world_forms_when_the_picked_port_is_taken(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other_program:
        other_program.bind(("127.0.0.1", 0))
        other_program.listen()
        taken = other_program.getsockname()[1]
        _pick(monkeypatch, taken)  # taken between being picked and being bound
        [(value, env)] = run_world(_all_reduce, 1, 7, timeout=WORLD_TIMEOUT_S)  # one rank: CI time
    assert value == _expected(7, 1)
    assert env["MASTER_PORT"] != str(taken)


def test_the_store_lives_exactly_as_long_as_the_block():
    with lightning_3d.app.launch.hosted_store() as port:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # something listens on it
    with pytest.raises(OSError):  # and nothing once the world is gone
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_rank_env_says_who_hosts_the_store():
    assert local_rank_env(1, 2, 1234, 1, agent_store=True)["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    # Rank 0 starts it.
    assert local_rank_env(1, 2, 1234, 1)["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def _fail_like_a_world(rank, kind):
    """Rank 1 reports a lost connection at once; rank 0 — the cause — fails a moment later, or is
    killed by a signal and reports nothing."""
    if rank == 1:
        raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:12202: Connection reset by peer")
    time.sleep(1.0)
    if kind == "killed":
        os.kill(os.getpid(), 9)
    raise ValueError("the root cause")


@pytest.mark.parametrize("kind", ["error", "killed"])
def test_a_failed_world_reports_the_rank_that_caused_it_first(kind):
    with pytest.raises(RuntimeError) as failed:
        run_world(_fail_like_a_world, 2, kind, timeout=WORLD_TIMEOUT_S)
    message = str(failed.value)
    if kind == "error":  # reported second, named first
        assert message.startswith("rank 0 failed:") and "ValueError: the root cause" in message
        assert "rank 1 also failed:" in message and "Connection reset by peer" in message
    else:
        assert message.startswith("rank 1 failed:")
        assert "rank 0 reported nothing (killed by SIGKILL)" in message


def _die_silently_while_a_peer_waits(rank):
    """Rank 0 ends without a report or a traceback (as a segfault or an OOM kill would); rank 1
    waits for it in a collective, which only gloo's own timeout would end."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    if rank == 0:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def test_a_rank_that_dies_without_a_report_fails_the_world_at_once():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 reported nothing \(exit code 3\)"):
        run_world(_die_silently_while_a_peer_waits, 2, timeout=WORLD_TIMEOUT_S)
    assert time.monotonic() - start < WORLD_TIMEOUT_S / 2  # not the whole timeout


def _where_am_i(rank):
    import torch

    return os.environ.get("LIGHTNING3D_TEST_MARK"), os.getcwd(), torch.get_num_threads()


def test_forked_ranks_take_the_callers_environment_and_directory(monkeypatch, tmp_path):
    """A fork server started earlier (by an earlier world) holds an older environment; a rank
    must see the caller's as it is now, as a spawned one would."""
    # The server is up.
    run_world(_where_am_i, 1, timeout=WORLD_TIMEOUT_S, start_method="forkserver")
    monkeypatch.setenv("LIGHTNING3D_TEST_MARK", "now")
    monkeypatch.chdir(tmp_path)
    for method in ("forkserver", "spawn"):
        [(mark, cwd, threads)] = run_world(
            _where_am_i, 1, timeout=WORLD_TIMEOUT_S, start_method=method
        )
        assert (mark, Path(cwd), threads) == ("now", tmp_path, 1), method


def _speak_and_leave_a_mark(rank, mark):
    import atexit
    import sys

    print(f"rank {rank} to stdout", flush=True)
    print(f"rank {rank} to stderr", file=sys.stderr, flush=True)
    atexit.register(Path(f"{mark}-{rank}").touch)  # as the offload store removes its files at exit


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_write_where_the_caller_writes_and_run_their_exit_handlers(capfd, tmp_path, method):
    saved = [os.dup(1), os.dup(2)]
    # A fork server (if none yet) started writing there.
    with open(tmp_path / "elsewhere", "w") as elsewhere:
        os.dup2(elsewhere.fileno(), 1)
        os.dup2(elsewhere.fileno(), 2)
        try:
            run_world(_where_am_i, 1, timeout=WORLD_TIMEOUT_S, start_method=method)
        finally:
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
    capfd.readouterr()
    run_world(
        _speak_and_leave_a_mark,
        2,
        str(tmp_path / "exited"),
        timeout=WORLD_TIMEOUT_S,
        start_method=method,
    )
    out, err = capfd.readouterr()
    for rank in range(2):
        assert f"rank {rank} to stdout" in out and f"rank {rank} to stderr" in err
        assert (tmp_path / f"exited-{rank}").is_file()


def test_an_unknown_start_method_is_refused():
    with pytest.raises(
        ValueError, match="start_method must be one of \\('spawn', 'forkserver'\\), got 'fork'"
    ):
        run_world(_where_am_i, 1, start_method="fork")
