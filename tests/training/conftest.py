"""The training lane's session: the versions line, the one_lane marker, and the shared dataset
fixture. Helpers the tests call live in training/support.py."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from shared import make_dataset


def lane_versions() -> str:
    """Which NVRx and torch this lane runs: the .venv lane (0.4.1) and tests/nvrx07/lane.sh (0.7).
    From package metadata (the same string as torch.__version__): importing torch this early
    would cost seconds and move its import-time warnings out of pytest's capture."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return (
        f"nvidia-resiliency-ext {installed('nvidia-resiliency-ext')}, torch {installed('torch')}, "
        f"Python {platform.python_version()}"
    )


def pytest_report_header(config) -> str:
    return lane_versions()


#: Set by tests/nvrx07/lane.sh: this session is the NVRx 0.7 lane, the second run of these tests.
SECOND_LANE = os.environ.get("TRAINING_TESTS_LANE") == "nvrx07"


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "one_lane: runs on the .venv lane only (NVRx 0.4.1, the GPU image's torch), not again on the "
        "NVRx 0.7 lane. Only for slow tests that import nothing of NVRx and run no restart, "
        "checkpoint or launcher code of training/: the second lane would repeat them on "
        "Debian's torch, which the GPU image does not use.",
    )


def pytest_collection_modifyitems(config, items) -> None:
    if SECOND_LANE:
        skip = pytest.mark.skip(reason="one_lane: NVRx-independent, run on the .venv lane")
        for item in items:
            if "one_lane" in item.keywords:
                item.add_marker(skip)


def pytest_sessionstart(session) -> None:
    """-q (as in make test) hides the report header: print the versions line anyway."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.get_verbosity() < 0:
        reporter.write_line(lane_versions())


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data") / "dataset")
