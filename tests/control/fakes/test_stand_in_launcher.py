"""The stand-in launcher runs in place of the training Python with the arguments the real
launcher gets, so the local backend's bookkeeping can be tested without torch."""

from __future__ import annotations

import time

from fsdp_resilience.training.contract import RunConfig

from control.fakes.stand_in_launcher import script_backend

RECORD_ARGS = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
"""


def test_the_script_gets_the_launchers_arguments(tmp_path):
    backend = script_backend(tmp_path / "b", RECORD_ARGS, slots=1)
    assert backend.training_python == str(tmp_path / "b" / "stand-in-python")
    cfg = RunConfig(
        run_id="standin",
        run_dir=str(tmp_path / "runs" / "standin"),
        dataset_dir=str(tmp_path / "data"),
        nodes=1,
        procs_per_node=1,
    )
    handle = backend.submit(cfg, launch_id="1")
    calls = tmp_path / "b" / "calls"
    deadline = time.monotonic() + 60
    while not (calls.exists() and calls.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    line = calls.read_text().split("\n")[0]
    assert line.startswith("-m fsdp_resilience.training.launch --config ")
    backend.cancel(handle)
