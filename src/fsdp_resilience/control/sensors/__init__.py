"""Sensors: the control plane's tasks that wait (for a launch to end, for node capacity)."""
