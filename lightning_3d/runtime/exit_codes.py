"""The exit codes of the apps (``examples/*.py``) and of ``python -m lightning_3d.checkpoint``.

One code per kind of failure, so that a script or a scheduler can tell a run worth relaunching
(a lost peer: resume) from one that will fail the same way (a bad value, a full disk). The
docs/reliability.md lists them.
"""

OK = 0
RANK_ERROR = 1  # a rank's own error (an exception in training); a stop on a non-finite loss
BAD_INPUT = 2  # a bad value or command line, refused before anything ran
IO_ERROR = 3  # a file could not be written or read: no space left, read-only, no permission
PEER_LOST = 4  # a rank lost a peer (its collective failed, or a peer stopped making progress)
SIGNALLED = 128  # 128 + N: stopped by signal N (a scheduler's SIGTERM, Ctrl-C, a SIGKILLed rank)
