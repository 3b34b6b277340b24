"""The run harness the tools share: gloo worlds, reference runs, parity measures."""
