"""Keep long PyTorch FSDP training runs alive on Amazon EKS.

Two planes, one seam:

- ``fsdp_resilience.training``: the data plane, what a training pod runs (torch, NVRx);
- ``fsdp_resilience.training.contract``: the seam, torch-free, imported by both planes;
- ``fsdp_resilience.control``: the control plane, what Airflow runs (never torch).

Importing this package imports neither plane.
"""
