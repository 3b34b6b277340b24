"""One module per parallel concern: ``zero`` (ZeRO 0-2 buckets), ``fsdp`` (ZeRO-3)."""
