"""docs/benchmarks.md, section 4: control-plane overhead (worker slots, the watch, DAG parse time)."""

from __future__ import annotations

from typing import Any

from bench.summarize.formats import fmt_load, fmt_s, fmt_stat, md_table


def control_plane_section(cp: dict[str, Any]) -> list[str]:
    """### 4. Control-plane overhead."""
    lines: list[str] = []
    if cp.get("slots") or cp.get("watch") or cp.get("parse"):
        lines += ["### 4. Control-plane overhead", ""]
        rows = []
        slots = cp.get("slots")
        if slots:
            rows.append(
                (
                    "worker slots held while training runs",
                    f"{slots['worker_slot_s_during_training']:.2f} slot-seconds in a "
                    f"{slots['training_window_s']:.0f} s "
                    f"training window ({100 * slots['worker_slot_share_of_training']:.1f} %): "
                    + ", ".join(f"{k} {v:.2f} s" for k, v in slots["worker_slot_s_by_task"].items())
                    + f"; the deferred sensor's trigger: {slots['deferred_trigger_s_during_training']:.0f} s; "
                    f"{slots['deferrals']} deferral(s)",
                )
            )
        watch = cp.get("watch")
        if watch:
            rows.append(
                (
                    f"checkpoint commit → the trigger fires (poll {watch['poll_interval_s']:g} s, {watch['trials']} "
                    "trials)",
                    fmt_stat(watch["commit_to_trigger_event_s"]),
                )
            )
        parse = cp.get("parse")
        if parse:
            fresh, pre = parse["fresh_imports"], parse["pre_imported"]
            rows.append(
                (
                    f"DAG parse of dags/ (torch blocked, {parse['trials']} trials)",
                    f"{fmt_stat(fresh['dagbag_s'])} importing the plugin modules; {fmt_stat(pre['dagbag_s'])} with "
                    "them "
                    "pre-imported (as Airflow's DAG processor does); per file: "
                    + ", ".join(f"{f} {fmt_s(v['median'])}" for f, v in fresh["per_file_s"].items())
                    + f"; importing Airflow itself: {fmt_s(parse['airflow_import_s'])}",
                )
            )
        lines += md_table(("figure", "measured"), rows)
        if slots:
            lines += [f"About the slot figure: {slots['note']}", ""]
        lines += [f"{fmt_load(cp)}.", ""]
    return lines
