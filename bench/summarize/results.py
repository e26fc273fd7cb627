"""The merged results: every part's JSON (training plane, chaos runs, control plane) in one summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import read_json

SUMMARY = "latest.json"
PARTS = {
    "training_plane": "training_plane.json",
    # The training plane's recovery rows and spare takeover on NVRx 0.7 (the lane's root).
    "training_plane_nvrx07": "training_plane_nvrx07.json",
    "chaos": "chaos.json",
    "chaos_spares": "chaos_spares.json",
    "control_plane": "control_plane.json",
}


def build_summary(out: Path, quick: bool = False) -> dict[str, Any]:
    """One JSON with every part's results (quick: the *.quick.json files)."""
    summary: dict[str, Any] = {"quick": quick}
    driver = out / ("run.quick.json" if quick else "run.json")
    if driver.exists():
        summary["run"] = read_json(driver)
    for part, name in PARTS.items():
        path = out / (name.replace(".json", ".quick.json") if quick else name)
        if path.exists():
            summary[part] = read_json(path)
    return summary
