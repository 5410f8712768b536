"""Measurement: the machine report (env) and, later, the CPU-vs-GPU ladder."""
