import os

# Two cores on CI: one intra-op thread per process, or ranks fight over the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
