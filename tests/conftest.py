import os

# Two cores on CI: one intra-op thread per process, or ranks fight over the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Ranks of run_world are forked from a server that imported torch and Lightning once (~4 s of
# CPU saved per rank); they still take this process's environment (lightning_3d/testing/world.py).
os.environ.setdefault("LIGHTNING3D_WORLD_START", "forkserver")
