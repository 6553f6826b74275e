"""Stage 2 of the flow: the on-disk contract (format, signature, weights, reading)."""
