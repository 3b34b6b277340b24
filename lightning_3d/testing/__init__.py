"""Helpers for tests and benchmarks: multi-process gloo worlds and reference training runs."""
