"""Test doubles of the control-plane tests, each tested in this folder: an EKS cluster (the fake
apiserver with moto's AWS), checkpoints on disk as the training plane leaves them, a stand-in
launcher behind the local backend, and FSx's API stubbed where moto lacks it."""
