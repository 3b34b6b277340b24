"""What NCCL is told, before its process group exists, so that a lost rank ends the job promptly.

Under gloo a peer that dies closes its sockets and the survivors' collective fails at once; one
that stalls is named by the heartbeat watchdog (``runtime/watchdog.py``) after
``parallelism.timeout_s``. Under NCCL a collective is a kernel on the device: the host does not
wait in it, and a dead peer leaves it spinning until ProcessGroupNCCL's own watchdog thread sees
the group's timeout pass, and then ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` decides what happens.

ProcessGroupNCCL reads these variables when the group is constructed; torch 2.11 to 2.13 default
to ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (a failed or timed-out collective takes the process
down, without ``ncclCommAbort``, which can itself hang), ``TORCH_NCCL_BLOCKING_WAIT=0`` (the host
never waits in a collective: blocking would cost a host sync per collective, and the teardown
above already ends the rank), ``TORCH_NCCL_ENABLE_MONITORING=1`` and
``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=480`` (a monitor thread ends the process when NCCL's watchdog
thread itself is stuck, in a CUDA or NCCL call, for that long). Those defaults fail fast, so they
are left alone; the one gap is the heartbeat: a ``timeout_s`` shorter than 480 s would still let
a stuck NCCL watchdog hold the rank for 8 minutes, so it is brought down to ``timeout_s`` (never
under :data:`MIN_HEARTBEAT_S`). A variable the user set is never changed; one set to a value that
keeps a rank waiting is named in a warning.
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from typing import Optional

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT"
ENABLE_MONITORING = "TORCH_NCCL_ENABLE_MONITORING"
HEARTBEAT_TIMEOUT = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
TORCH_HEARTBEAT_S = 480  # torch's default for HEARTBEAT_TIMEOUT (2.11 to 2.13)
# NCCL's watchdog thread beats about every 0.1 s; a minute keeps a slow communicator
# initialisation or a long CUDA call from being mistaken for a hang.
MIN_HEARTBEAT_S = 60
# 1 tears the process down after aborting the communicators, 3 (torch's default) without; 0 only
# logs the error and 2 only aborts, both leaving the rank alive and waiting.
TEARS_DOWN = ("1", "3")


def nccl_fail_fast(
    backend: Optional[str], timeout_s: float, environ: Optional[MutableMapping[str, str]] = None
) -> list[str]:
    """Set in ``environ`` (default ``os.environ``) what ProcessGroupNCCL needs to end a rank whose
    peer is lost within about ``timeout_s``, when ``backend`` uses NCCL (``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``); return warnings about the user's own settings that defeat it.
    Nothing is set or said for any other backend (gloo keeps its behaviour).

    Example: ``nccl_fail_fast("nccl", 60.0)`` sets ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=60``.
    """
    if not backend or "nccl" not in backend:
        return []
    env = os.environ if environ is None else environ
    if HEARTBEAT_TIMEOUT not in env and timeout_s < TORCH_HEARTBEAT_S:
        env[HEARTBEAT_TIMEOUT] = str(max(MIN_HEARTBEAT_S, math.ceil(timeout_s)))
    warnings = []
    handling = env.get(ASYNC_ERROR_HANDLING)
    if handling is not None and handling.strip() not in TEARS_DOWN:
        warnings.append(
            f"{ASYNC_ERROR_HANDLING}={handling} leaves a rank whose NCCL collective failed or "
            "timed out running; unset it (torch's default 3) so that a lost peer ends the job"
        )
    if env.get(ENABLE_MONITORING, "1").strip().lower() in ("0", "false", "no", "off"):
        warnings.append(
            f"{ENABLE_MONITORING}={env[ENABLE_MONITORING]}: a rank whose NCCL watchdog thread "
            "hangs in a CUDA or NCCL call is not ended"
        )
    return warnings
