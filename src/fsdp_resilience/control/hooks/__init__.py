"""Hooks: the control plane's clients of external services (FSx, S3), one module per service."""
