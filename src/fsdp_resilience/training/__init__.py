"""The data plane: one command a pod runs (``python -m fsdp_resilience.training.launch``), the
training loop, checkpoints, restarts and evaluation. Needs torch and NVRx, except
``fsdp_resilience.training.contract`` (the seam), which the control plane imports too.

Importing this package imports nothing else: the control plane reaches the contract through it.
"""
