"""pytest fixtures of the real control plane. Registered in tests/control/conftest.py.

``control_plane`` starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok
once per pytest run (the binaries are built or reused by build.sh) and stops them by PID at the
end, whatever the tests did. ``kube`` gives each test an empty cluster on it.

Where the control plane cannot be built (no Go, no module proxy) the tests that need it skip with
one line; with CI=true they fail instead.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from control.kube.cluster import KubeCluster
from control.kube.control_plane import ControlPlane, build, built_or_skip, remove_workdir


@pytest.fixture(scope="session")
def control_plane():
    cache = built_or_skip(build, "the Kubernetes control plane")
    workdir = Path(tempfile.mkdtemp(prefix="kube-", dir=os.environ.get("KUBE_WORKDIR")))
    plane = ControlPlane(cache=cache, workdir=workdir)
    try:
        plane.start(emulated_version=os.environ.get("KUBE_EMULATED_VERSION") or None)
        yield plane
    finally:
        plane.stop()
        if os.environ.get("KUBE_KEEP_WORKDIR") != "1":
            remove_workdir(workdir)


@pytest.fixture
def kube(control_plane):
    """An empty cluster (no nodes, Jobs or pods) on the shared control plane."""
    control_plane.check_alive()
    cluster = KubeCluster(control_plane)
    cluster.reset()
    yield cluster
    control_plane.check_alive()
