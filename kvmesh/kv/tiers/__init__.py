"""Lower KV tiers below the compute buffer: host memory and local disk (docs/tiers.md)."""
