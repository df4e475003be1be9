"""The efficient variant: the baseline's files, fused (diff each pair to see what changed and why)."""
