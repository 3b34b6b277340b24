"""Run-time safety on every rank: watchdog, preemption, non-finite steps, failures."""
