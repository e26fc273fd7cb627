"""Benchmarks: checkpoint stall, recovery per rung, goodput under chaos, control-plane overhead and
evaluation load. ``python -m bench.run`` (``make bench``) runs them all; see docs/benchmarks.md."""
