"""The device guard (tests/support/device_guard.py) finds, on a CPU with gloo, the host tensors a
GPU with NCCL would refuse: it must flag each planted kind and pass what a GPU accepts."""

import pytest
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
            host_grads = [torch.zeros(3, device="cpu")]  # ZeRO-Offload's host accumulators
            factor = on_device.sum()
            # Grouped by device: a GPU copies the scalar to the host (a read), then multiplies.
            torch._foreach_mul_(host_grads, factor.to(host_grads[0].device))
            torch._foreach_mul_(host_grads, factor)  # a device scalar with host tensors: mixed
        return [str(v) for v in guard.violations], dict(guard.reads)
    finally:
        dist.destroy_process_group()


def test_guard_flags_each_host_tensor_a_gpu_would_refuse_with_where_it_was_made_and_sent():
    """Catches a guard that misses host tensors at collectives (all-reduce, all-gather, broadcast,
    reduce-scatter, all-to-all, a batched send; made with no device=, by .cpu(), or by an op on
    host tensors only), mixed-device ops or host reads, or that flags tensors a
    GPU run keeps on the device (made with device=, moved there, derived from them) or a device
    scalar moved to a host tensor's device (``factor.to(host.device)``, the host on a GPU)."""
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
        assert len(mixed) == 3 and all("stack" in v or "cat" in v for v in mixed[:2]), violations
        assert "_foreach_mul_" in mixed[2], violations
        assert sum(reads.values()) == 3, reads  # .cpu(), .item(), .to(host.device)


# Each place user code runs during a training step, by the name of the function planted there.
PLACES = (
    "tensor_hook",
    "post_accumulate_grad_hook",
    "function_backward",
    "queued_callback",
    "autograd_grad_hook",
    "checkpoint_recompute",
    "forward_pre_hook",
    "forward_hook",
    "backward_pre_hook",
    "backward_hook",
    "fsdp_all_reduce_hook",
    "step_pre_hook",
    "step_post_hook",
)


def _planted_in_hooks(rank):
    """A host tensor sent to an all-reduce from each of :data:`PLACES`, each made in a function
    of that name (the innermost frame of the violation's ``made`` site)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import checkpoint

    from support.device_guard import DeviceGuard

    dist.init_process_group("gloo")
    device = torch.device("cpu")

    def sent(host):
        dist.all_reduce(host)

    def tensor_hook(grad):
        sent(torch.ones(2))  # no device=: the host

    def post_accumulate_grad_hook(param):
        sent(torch.ones(2))

    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            function_backward()
            return grad * 2

    def function_backward():
        sent(torch.ones(2))

    def queued_callback():
        sent(torch.ones(2))

    def queue_from_a_hook(grad):
        torch.autograd.Variable._execution_engine.queue_callback(queued_callback)

    def autograd_grad_hook(grad):
        sent(torch.ones(2))

    forwards = []

    def checkpoint_recompute(x):
        forwards.append(x)
        if len(forwards) == 2:  # the recompute, in backward (the first is the forward)
            sent(torch.ones(2))
        return x.sin()  # saves x: its unpack in backward recomputes

    def forward_pre_hook(*_):
        sent(torch.ones(2))

    def forward_hook(*_):
        sent(torch.ones(2))

    def backward_pre_hook(*_):
        sent(torch.ones(2))

    def backward_hook(*_):
        sent(torch.ones(2))

    def fsdp_all_reduce_hook(reduced):
        sent(torch.ones(2))

    def step_pre_hook(*_):
        sent(torch.ones(2))

    def step_post_hook(*_):
        sent(torch.ones(2))

    def parameter():
        return torch.nn.Parameter(torch.ones(3, device=device))

    try:
        with DeviceGuard() as guard:
            for hook in (tensor_hook, queue_from_a_hook):
                param = parameter()
                param.register_hook(hook)
                param.sum().backward()
            param = parameter()
            param.register_post_accumulate_grad_hook(post_accumulate_grad_hook)
            param.sum().backward()
            Doubled.apply(parameter()).sum().backward()
            param = parameter()
            param.register_hook(autograd_grad_hook)
            torch.autograd.grad((param * 2).sum(), [param])
            checkpoint(checkpoint_recompute, parameter(), use_reentrant=False).sum().backward()
            module = torch.nn.Linear(3, 3, device=device)
            module.register_forward_pre_hook(forward_pre_hook)
            module.register_forward_hook(forward_hook)
            module.register_full_backward_pre_hook(backward_pre_hook)
            module.register_full_backward_hook(backward_hook)
            module(torch.ones(2, 3, device=device, requires_grad=True)).sum().backward()
            sharded = fully_shard(torch.nn.Linear(4, 4, device=device))
            sharded.set_all_reduce_hook(fsdp_all_reduce_hook)
            sharded(torch.ones(2, 4, device=device)).sum().backward()
            param = parameter()
            optimizer = torch.optim.SGD([param], lr=0.1)
            optimizer.register_step_pre_hook(step_pre_hook)
            optimizer.register_step_post_hook(step_post_hook)
            param.sum().backward()
            optimizer.step()
        return [str(v) for v in guard.violations]
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def planted_in_hooks():
    return run_world(_planted_in_hooks, 2)


@pytest.mark.parametrize("place", PLACES)
def test_guard_sees_host_tensors_made_in_hooks_backward_and_the_optimizer_step(
    planted_in_hooks, place
):
    """Catches a guard blind to code the autograd engine calls (a function mode is off inside
    its own handler, so inside ``Tensor.backward`` / ``torch.autograd.grad`` factories went
    unmarked: an expert weight's gradient hook sent a host tensor unseen), or to module,
    FSDP2 or optimizer hooks."""
    for violations in planted_in_hooks:
        made = [v.split(" reaches it at ")[0] for v in violations if v.startswith("collective")]
        assert any(f" in {place} <- " in m for m in made), "\n".join(violations)
