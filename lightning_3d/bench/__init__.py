"""Benchmarks that print figures (never timed tests). ``python -m lightning_3d.bench.zero_memory``."""
