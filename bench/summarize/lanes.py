"""The training plane's lanes: NVRx 0.4.1 in the project's .venv (``training_plane``) and NVRx 0.7
(the production version) in the NVRx 0.7 test lane's Debian testing root
(``training_plane_nvrx07``). The pages show the 0.7 lane first."""

from __future__ import annotations

from typing import Any

#: The spare takeover's target on NVRx 0.7: fault -> the first step, 2 nodes + 1 spare, `tiny`.
SPARE_TARGET_S_NVRX07 = 8.0
#: Summary keys of the training-plane lanes, in the order the pages show them.
LANE_PARTS = ("training_plane_nvrx07", "training_plane")


def lane_label(tp: dict[str, Any]) -> str:
    """The lane's label as its results recorded it, e.g. "NVRx 0.7.0 (Debian testing chroot, Python
    3.14, Debian CPU torch 2.14.1)"; for results from before lanes were recorded, from the versions."""
    label = (tp.get("lane") or {}).get("label")
    if label:
        return label
    versions = tp.get("versions") or {}
    return f"NVRx {versions.get('nvidia-resiliency-ext', '?')} (.venv, torch {versions.get('torch', '?')})"


def lane_short(tp: dict[str, Any]) -> str:
    """The lane's NVRx version, e.g. "NVRx 0.7.0", for figure names."""
    return f"NVRx {(tp.get('versions') or {}).get('nvidia-resiliency-ext', '?')}"


def is_nvrx07(tp: dict[str, Any]) -> bool:
    version = (tp.get("versions") or {}).get("nvidia-resiliency-ext", "")
    parts = [int(p) for p in version.split(".")[:2] if p.isdigit()]
    return len(parts) == 2 and tuple(parts) >= (0, 7)


def training_lanes(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(summary key, results) of each training-plane lane that has results, 0.7 first."""
    return [(key, summary[key]) for key in LANE_PARTS if summary.get(key)]


def spare_parts_text(parts: dict[str, Any], fmt) -> str:
    """The spare takeover's breakdown in time order."""
    names = (
        ("detect", "detect (in-process layer gives up)"),
        ("tear_down", "tear down"),
        ("rendezvous", "rendezvous (lost node dropped, spare in)"),
        ("start_restore", "start + restore"),
        ("first_step", "first step"),
        ("detect_to_new_workers", "fault → new workers"),
    )
    return " · ".join(f"{label} {fmt(parts.get(key))}" for key, label in names if key in parts)
