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

import lightning_3d.launch
import lightning_3d.testing.world
from lightning_3d.launch import free_port, local_rank_env
from lightning_3d.testing.world import run_world

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
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return t.item(), env


def _expected(tag, world_size):
    return sum(100.0 * tag + r + 1 for r in range(world_size))


def _pick(monkeypatch, port):
    """Make the port picker return ``port``, wherever a launcher looks it up."""
    monkeypatch.setattr(lightning_3d.launch, "free_port", lambda: port)
    monkeypatch.setattr(lightning_3d.testing.world, "free_port", lambda: port, raising=False)


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
            assert value == _expected(tag, size)  # each world reduced its own ranks' values, no others
            assert env["RANK"] == env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == str(size)
            assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == results[tag][0][1]["MASTER_PORT"]
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
    with lightning_3d.launch.hosted_store() as port:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # something listens on it
    with pytest.raises(OSError):  # and nothing once the world is gone
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_rank_env_says_who_hosts_the_store():
    assert local_rank_env(1, 2, 1234, 1, agent_store=True)["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert local_rank_env(1, 2, 1234, 1)["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # rank 0 starts it
