"""The device guard (tests/support/device_guard.py) finds, on a CPU with gloo, the host tensors a
GPU with NCCL would refuse: it must flag each planted kind and pass what a GPU accepts."""

import torch

from tools.harness.world import run_world


def _planted(rank):
    import torch.distributed as dist

    from support.device_guard import DeviceGuard

    dist.init_process_group("gloo")
    device = torch.device("cpu")  # the strategy's root device, as a GPU run names it
    try:
        with DeviceGuard(counting=True) as guard:
            weight = torch.nn.Parameter(torch.ones(4))  # built on the host, then moved
            weight.data = weight.data.to(device)
            on_device = torch.zeros(3, device=device)
            dist.all_reduce(on_device)  # fine on NCCL
            dist.all_reduce(weight.data * 2)  # derived from a moved tensor: fine
            flag = torch.tensor([1.0])  # no device=: the host
            dist.all_reduce(flag)  # NCCL: "No backend type associated with device type cpu"
            parts = [torch.empty(3, device=device) for _ in range(2)]
            dist.all_gather(parts, on_device.cpu())  # .cpu() made it a host tensor
            staged = torch.empty(3, pin_memory=False).add_(1)  # an offload buffer
            dist.broadcast(staged * 1, src=0)  # still host after an op on it alone
            host_rows = torch.ones(4)  # each collective below with one host tensor
            dist.reduce_scatter_tensor(torch.empty(2, device=device), host_rows)
            dist.all_to_all_single(torch.empty(4, device=device), host_rows)
            peer = 1 - rank
            ops = [dist.P2POp(dist.isend, torch.ones(2), peer)]
            ops.append(dist.P2POp(dist.irecv, torch.empty(2, device=device), peer))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            torch.stack([on_device, torch.zeros(3)])  # mixed devices in one op
            on_device.sum().item()  # a host read of a device value
            torch.stack([on_device, torch.tensor(2.0).expand(3)])  # 0-dim scalar: still mixed
        return [str(v) for v in guard.violations], dict(guard.reads)
    finally:
        dist.destroy_process_group()


def test_guard_flags_each_host_tensor_a_gpu_would_refuse_with_where_it_was_made_and_sent():
    """Catches a guard that misses host tensors at collectives (all-reduce, all-gather, broadcast,
    reduce-scatter, all-to-all, a batched send; made with no device=, by .cpu(), or by an op on
    host tensors only), mixed-device ops or host reads, or that flags tensors a
    GPU run keeps on the device (made with device=, moved there, derived from them)."""
    for violations, reads in run_world(_planted, 2):
        collectives = [v for v in violations if v.startswith("collective")]
        assert len(collectives) == 6, violations
        allreduce, allgather, broadcast, scatter, alltoall, send = collectives
        assert "reduce_scatter" in scatter and "alltoall" in alltoall and "send" in send
        assert "allreduce_" in allreduce and "test_device_guard.py:" in allreduce
        assert "in _planted" in allreduce.split("reaches it at")[0]  # where it was made
        assert "in _planted" in allreduce.split("reaches it at")[1]  # where it was sent
        assert "allgather" in allgather and "broadcast" in broadcast
        mixed = [v for v in violations if v.startswith("mixed")]
        assert len(mixed) == 2 and all("stack" in v or "cat" in v for v in mixed), violations
        assert sum(reads.values()) == 2, reads  # .cpu() of a device tensor, and .item()
