"""Control-plane benchmarks (``python -m bench.control_plane``, see ``__main__``), a module per
measurement: ``parse_time``, ``watch_latency``, ``worker_slots``, ``relaunch``, ``hot_spare``."""
