"""Test doubles of the control-plane tests, each tested in this folder (``test_<double>.py``): an
EKS cluster (a real control plane with kwok's nodes, moto's AWS, and TrainingPodPlayer playing the
training pods), checkpoints on disk as the training plane leaves them, a stand-in launcher behind
the local backend, FSx's API stubbed where moto lacks it, and a run's events log as the training
plane writes it (for the report)."""
