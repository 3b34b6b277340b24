"""What a run reports: the run summary, FLOPs and memory measures, telemetry."""
