"""A real Kubernetes control plane for the EKS tests (see README.md here)."""
