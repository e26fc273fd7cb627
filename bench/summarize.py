"""Merge the benchmark results into one summary JSON, draw the plots, and write the Markdown
table of the latest figures (docs/benchmarks.md, merged into the README).

    .venv-airflow/bin/python -m bench.summarize [--out bench/results] [--quick] [--docs docs/benchmarks.md]

``render_markdown(summary)`` is a pure function of the summary JSON (standard library only), so
a test can check that the committed table matches the committed JSON. Plots need matplotlib
(the control-plane venv has it).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, read_json, write_json

SUMMARY = "latest.json"
#: How each checkpoint method saves, for the table's notes.
METHOD_HOW = {
    "memcpy": "copies each rank's tensors into buffers allocated once (no file: the floor)",
    "nvrx_async": "`AsyncCheckpointer.save`: snapshot into reused shared-memory buffers, DCP plan, hand-off to "
                  "NVRx's persistent writer process, which writes and fsyncs; committed by the next poll/wait",
    "nvrx_async_no_checksum": "the project's saves without the writer's CRC32C pass over the files it wrote (a "
                              "size-only record instead; bench only: such a checkpoint would never verify)",
    "torch_async_save": "`torch.distributed.checkpoint.async_save` with its default stager (a fresh CPU copy per "
                        "save), written by a background thread",
    "torch_async_save_thread": "torch at its best, thread: `dcp.async_save` with one persistent `DefaultStager` "
                               "(`StagingOptions` as recorded: shared memory; pinned memory and non-blocking copies "
                               "need an accelerator) reused across saves, a gloo group of its own created once, "
                               "`AsyncCheckpointerType.THREAD`",
    "torch_async_save_process": "the same with `AsyncCheckpointerType.PROCESS` (a persistent writer process)",
    "dcp_save": "`torch.distributed.checkpoint.save`, returns when written (fsync) and the metadata is out",
    "torch_save": "`torch.save` of each rank's local shards to its own file, then fsync",
}
#: Short names of the checkpoint methods, for table headers and legends.
METHOD_NAMES = {"memcpy": "memcpy (floor)", "nvrx_async": "project: NVRx async DCP",
                "nvrx_async_no_checksum": "project without checksums", "torch_async_save": "torch dcp.async_save",
                "torch_async_save_thread": "torch async_save, best config, thread",
                "torch_async_save_process": "torch async_save, best config, process",
                "dcp_save": "torch dcp.save (sync)", "torch_save": "torch.save"}
PARTS = {"training_plane": "training_plane.json", "chaos": "chaos.json", "chaos_spares": "chaos_spares.json",
         "control_plane": "control_plane.json"}
#: NVRx 0.7's promotion of a hot spare, measured by the rendezvous experiment of issue 15 (a gloo
#: all-reduce loop, nodes=2:3, SIGKILL of a node -> the new round closed; 5 kills), not by make bench.
NVRX07_PROMOTION_S = (4.6, 4.8)
#: Phases of a recovery, in time order, and their colours in the plot.
PHASES = ("detect", "tear_down", "rendezvous", "rendezvous_restore", "detect_to_new_workers", "diagnose_replace",
          "capacity_submit", "start_restore", "first_step")
PHASE_COLORS = {"detect": "tab:red", "tear_down": "tab:orange", "rendezvous": "tab:olive",
                "rendezvous_restore": "tab:purple", "detect_to_new_workers": "tab:brown", "diagnose_replace": "tab:pink",
                "capacity_submit": "tab:gray", "start_restore": "tab:cyan", "first_step": "tab:green"}
PLOTS = ("stall.png", "recovery.png", "young_daly.png", "chaos-timeline.png", "chaos-goodput.png",
         "chaos_spares-timeline.png", "chaos_spares-goodput.png")


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


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def _s(x: float | None) -> str:
    """Seconds, with the precision the value needs."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if x < 0.01:
        return f"{x * 1000:.1f} ms"
    if x < 1:
        return f"{x * 1000:.0f} ms"
    if x < 10:
        return f"{x:.2f} s"
    if x < 100:
        return f"{x:.1f} s"
    return f"{x:.0f} s"


def _stat(stats: dict[str, Any] | None) -> str:
    """median (min–max, n)"""
    if not stats or not stats.get("n"):
        return "—"
    if stats["n"] == 1:
        return f"{_s(stats['median'])} (n=1)"
    return f"{_s(stats['median'])} ({_s(stats['min'])}–{_s(stats['max'])})"


def _when(iso: str | None) -> str:
    """An ISO timestamp as date and minute (its zone as recorded)."""
    return iso[:16].replace("T", " ") + iso[19:] if iso else "?"


def _median(x: Any) -> float | None:
    """A figure that is either a number or ``summarize``'s statistics."""
    return x.get("median") if isinstance(x, dict) else x


def _ok(met: bool | None) -> str:
    return "—" if met is None else ("met" if met else "**missed**")


def _table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _load(part: dict[str, Any]) -> str:
    load = part.get("load") or {}
    during = load.get("loadavg_1m_during") or {}
    if not during.get("n"):
        return "load average not recorded"
    return f"1-min load average {during['min']}–{during['max']} (median {during['median']}) on {load.get('cores')} cores"


def _spare_section(spare: dict[str, Any], relaunch: dict[str, Any] | None, cp: dict[str, Any]) -> list[str]:
    """Node loss with a hot spare, next to the relaunch rung for the same loss."""
    same = next((r for r in (relaunch or {}).get("rows") or [] if r["kind"] == "node_loss"), None)
    measured = (cp.get("measured") or {}).get("spare") or {}
    load = _load({"load": measured.get("load")}) if measured.get("load") else _load(cp)
    by = sorted({t["recovered_by"] for t in spare["trials"] if t.get("recovered_by")})
    lines = [f"Node loss with a hot spare (local backend, {spare['nodes']} nodes × {spare['procs_per_node']} ranks + "
             f"{spare['spare_nodes']} spare, NVRx {spare.get('nvrx') or '?'}): node 1's launcher and ranks SIGKILLed "
             "(node 0 hosts the rendezvous store, which no spare covers), a run per trial, driven like the DAG: the "
             "watch watches on while the job stays running, and the pool keeper (`ladder.keep_spare_pool`) "
             "quarantines the lost slot and starts a new spare meanwhile. No relaunch: "
             + ("every loss was covered in-job." if spare["all_covered_in_job"] else "**not every loss was covered "
                "in-job** (see `trials`).") + f" {load}.", ""]
    rows = [("node_loss, a spare takes its place", ", ".join(by) or "—", spare["recovery_s"].get("n", 0),
             _stat(spare["recovery_s"]), _stat(spare["promoted_s"]), _stat(spare["refill_s"]))]
    if same:
        rows.append(("node_loss, no spare: the relaunch rung (above)", "relaunch", same["total_s"]["n"],
                     _stat(same["total_s"]), "—", "—"))
    lines += _table(("fault", "recovered by", "n", "fault → first step", "fault → spare trains (`spare_promoted`)",
                     "fault → pool whole again (`spare_added`)"), rows)
    lines += [f"The spare's promotion waits for the rendezvous to drop the lost node. NVRx 0.4.1 (this lane) does so "
              "when its keep-alive expires, hard-coded at 5 s × 3 (≈ 14–15 s), and the in-process layer tries first. "
              f"NVRx 0.7's barrier rendezvous promotes in {NVRX07_PROMOTION_S[0]}–{NVRX07_PROMOTION_S[1]} s (kill → "
              "new round closed, 5 kills with a gloo all-reduce loop; measured by the issue-15 rendezvous "
              "experiment, not by this benchmark); the trainer's restart and resume come on top."]
    if same and spare["recovery_s"].get("n") and same["total_s"]["median"] < spare["recovery_s"]["median"]:
        lines[-1] += (" Here the relaunch is faster: a local slot starts in seconds, while the spare waits for the "
                      "rendezvous to drop the lost node. What a spare saves is the node's replacement where that "
                      "takes minutes: a new instance's boot and join on EKS, or a wait for capacity that may not "
                      "come; and it keeps the pool whole without holding up training.")
    return lines + [""]


def _chaos_side_by_side(plain: dict[str, Any], spared: dict[str, Any]) -> list[str]:
    """The chaos run without and with hot spares, column by column."""
    def topology(c: dict[str, Any]) -> str:
        t = c.get("topology") or {"nodes": 1, "procs_per_node": 2, "spare_nodes": 0}
        return f"{t['nodes']} × {t['procs_per_node']} ranks" + (f" + {t['spare_nodes']} spare" if t["spare_nodes"] else "")

    def node_loss(c: dict[str, Any]) -> str:
        n = c.get("node_loss")
        if n is None:  # results from before the node_loss figures: the recovery table's rows
            rows = {k.split(" → ", 1)[1]: v for k, v in (c.get("recovery_by_kind_s") or {}).items()
                    if k.startswith("node_loss → ")}
            return "; ".join(f"{_stat(v)} by {layer}" for layer, v in rows.items()) or "—"
        if not n.get("n"):
            return "—"
        return f"{_stat(n['fault_to_next_step_s'])} by {', '.join(n['recovered_by']) or '—'}"

    def refill(c: dict[str, Any]) -> str:
        n = c.get("node_loss") or {}
        if not n.get("spare_nodes"):
            return "—"
        return f"{n['covered_by_a_spare']} of {n['n']} covered in-job; pool whole again after {_stat(n['refill_s'])}"

    def run(c: dict[str, Any]) -> str:
        fired, scheduled = c["faults_injected"], c.get("faults_scheduled", c["faults_injected"])
        return (f"{c['wall_s'] / 60:.1f} min, {fired} faults"
                + (f" (**{scheduled} scheduled**: the others never fired)" if fired < scheduled else ""))

    rows = [("nodes", topology(plain), topology(spared)),
            ("run", run(plain), run(spared)),
            ("**ETTR** (productive ÷ wall)", f"**{plain['ettr']:.3f}**", f"**{spared['ettr']:.3f}**"),
            ("ETTR without the first start-up and the final shutdown", f"{plain['ettr_steady']:.3f}",
             f"{spared['ettr_steady']:.3f}"),
            ("lost per fault", _s(plain["lost_per_fault_s"]), _s(spared["lost_per_fault_s"])),
            ("node loss: fault → next step", node_loss(plain), node_loss(spared)),
            ("relaunches", str(len(plain.get("rungs") or [])), str(len(spared.get("rungs") or []))),
            ("spare pool", "—", refill(spared))]
    return [f"Side by side with the same fault schedule's mix and seed, with a hot spare (`{spared['command'].strip()}`): "
            "a node loss takes the training node holding the highest rank off node 0 (the rendezvous host), a spare "
            f"takes its place in-job, and the pool is refilled while training goes on. {_load(spared)}.", ""] + _table(("", "without spares", "with spares"), rows)


def targets(summary: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(figure, target, measured, met) for every target of the issue."""
    rows: list[tuple[str, str, str, bool | None]] = []
    stall = (summary.get("training_plane") or {}).get("stall")
    if stall:
        for size in stall["sizes"]:
            r = size["ratios"]
            rows.append((f"checkpoint stall, {size['state_mb']:.0f} MB: project ÷ memcpy floor", "≤ 1.5×",
                         f"{r['nvrx_async_over_memcpy']}×", r["nvrx_async_over_memcpy"] <= 1.5))
            if "nvrx_async_over_torch_async_save_best" in r:
                best = METHOD_NAMES.get(size["torch_async_save_best"], size["torch_async_save_best"])
                rows.append((f"checkpoint stall, {size['state_mb']:.0f} MB: project ÷ torch async_save at its best "
                             f"({best})", "≤ 1×", f"{r['nvrx_async_over_torch_async_save_best']}×",
                             r["nvrx_async_over_torch_async_save_best"] <= 1.0))
                rows.append((f"writer interference, {size['state_mb']:.0f} MB: step time with a save in flight ÷ "
                             f"without (torch at its best: {r['torch_async_save_best_interference']})", "≤ 1.3",
                             f"{r['nvrx_async_interference']}", r["nvrx_async_interference"] <= 1.3))
            rows.append((f"checkpoint stall, {size['state_mb']:.0f} MB: project ÷ synchronous dcp.save", "≤ 0.1×",
                         f"{r['nvrx_async_over_dcp_save']}×", r["nvrx_async_over_dcp_save"] <= 0.1))
            if "checksum_stall_overhead" in r:
                cost = size["methods"]["nvrx_async"].get("checksum_s_per_save") or {}
                rows.append((f"checkpoint stall, {size['state_mb']:.0f} MB: what CRC32C checksums add (with ÷ without, "
                             f"side by side; in the writer {_stat(cost)} a save, save→commit "
                             f"{r['checksum_commit_overhead']:+.1%})", "≤ +10%",
                             f"{r['checksum_stall_overhead']:+.1%}", r["checksum_stall_overhead"] <= 0.10))
    recovery = (summary.get("training_plane") or {}).get("recovery")
    if recovery:
        for row in recovery["rows"]:
            if "target_s" in row:
                rows.append((f"recovery, {row['kind']} ({row['restart_mode']}) → {row['layer']}", f"≤ {row['target_s']:g} s",
                             _stat(row["latency_s"]), row["target_met"]))
        for kind, row in (recovery.get("vs_torchrun") or {}).items():
            if "ratio" in row:
                rows.append((f"recovery, {kind}: the project's in-job restart ÷ plain `torchrun --max-restarts` "
                             f"(same trainer without NVRx, same run; {_s(row['injob_median_s'])} vs "
                             f"{_s(row['torchrun_median_s'])})", "≤ 1×", f"{row['ratio']}×", row["at_least_as_fast"]))
    relaunch = (summary.get("control_plane") or {}).get("relaunch")
    if relaunch:
        for row in relaunch["rows"]:
            rows.append((f"recovery, {row['kind']} → relaunch on a replaced node (failed launch → first step)",
                         f"≤ {row.get('target_s', 60):g} s",
                         _stat(row["total_s"]), row["target_met"]))
    spare = (summary.get("control_plane") or {}).get("spare")
    if spare:
        rows.append((f"recovery, node_loss with a hot spare → in-job restart onto the spare (fault → first step; "
                     f"the pool whole again after {_stat(spare['refill_s'])})", "no relaunch", _stat(spare["recovery_s"]),
                     spare["all_covered_in_job"]))
    chaos = summary.get("chaos")
    if chaos:
        target = chaos["young_daly"][1]
        rows.append((f"goodput: measured ETTR of the chaos run, one fault per ~{chaos['mtbf_s']:.0f} s (Llama 3 mix; "
                     "interference counted as badput)", "≥ 0.85", f"{chaos['ettr']:.3f}", chaos["ettr"] >= 0.85))
        rows.append(("goodput: ETTR at one fault per 10 min, Young/Daly interval (model fed with measured costs)",
                     "≥ 0.97", f"{target['ettr']['young_daly']:.3f}", target["ettr"]["young_daly"] >= 0.97))
        rows.append((f"goodput: time lost per fault (measured, {chaos['faults_injected']} faults)", "≤ 10 s",
                     _s(chaos["lost_per_fault_s"]), chaos["lost_per_fault_s"] is not None and chaos["lost_per_fault_s"] <= 10))
    slots = (summary.get("control_plane") or {}).get("slots")
    if slots:
        sensor = sum(v for k, v in slots["worker_slot_s_by_task"].items() if "watch" in k)
        rows.append(("worker slots held while training runs (dag.test: the sensor deferred)", "0",
                     f"{slots['slots_held_while_deferred']} while deferred ({slots['deferred_trigger_s_during_training']:.0f} s "
                     f"in the trigger); the sensor ran {_s(sensor)} to defer; {slots['worker_slot_s_during_training']:.2f} "
                     f"slot-s of task code in the {slots['training_window_s']:.0f} s window",
                     slots["slots_held_while_deferred"] == 0 and slots["deferrals"] > 0))
    evaluation = (summary.get("training_plane") or {}).get("eval_load")
    if evaluation:
        r = evaluation["ratios"]["load_over_raw_read_model_bytes"]
        rows.append((f"evaluation load ÷ raw read of the same bytes ({evaluation['model']})", "≤ 1.5×", f"{r}×", r <= 1.5))
    return rows


def render_markdown(summary: dict[str, Any]) -> str:
    tp = summary.get("training_plane") or {}
    cp = summary.get("control_plane") or {}
    chaos = summary.get("chaos") or {}
    run = summary.get("run") or {}
    machine = tp.get("machine") or cp.get("machine") or chaos.get("machine") or {}
    versions = {**(tp.get("versions") or {}), **(cp.get("versions") or {})}
    lines = ["## Benchmarks", ""]
    lines += [
        f"Produced by `{run.get('command', 'make bench')}`"
        + (f" in {run['wall_s'] / 60:.1f} min" if run.get("wall_s") else "")
        + (f" on {run['started_at'][:10]}" if run.get("started_at") else "")
        + f": {machine.get('cores', '?')} cores ({machine.get('cpu', 'CPU')}), {machine.get('memory_gb', '?')} GB, "
        + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) + ". "
        "Other work shared the machine; each part records its load average. Each figure is a ratio "
        "measured within one run, or a latency as median (min–max) over repeated trials. Targets "
        "missed are reported as missed. `make bench-quick` is a smoke run of the same scripts. "
        "Raw results: `bench/results/latest.json`.", ""]
    if run.get("updates"):
        lines += ["Measured again since, and merged into the figures above (`python -m bench.run --only`): "
                  + "; ".join(f"{', '.join(u['parts'])} on {_when(u['started_at'])}" for u in run["updates"] if u.get("parts"))
                  + ". When each part was measured: "
                  + ", ".join(f"{name} {_when(part.get('measured_at'))}" for name, part in run["parts"].items())
                  + ".", ""]
    if summary.get("quick"):
        lines += ["> **Quick smoke run**: too few trials and too small states to quote.", ""]

    lines += ["### Targets", ""]
    lines += _table(("figure", "target", "measured", ""), [(f, t, m, _ok(ok)) for f, t, m, ok in targets(summary)])

    stall = tp.get("stall")
    if stall:
        lines += ["### 1. Checkpoint stall", ""]
        lines += [f"Blocking time per save (the training loop waits this long; the slowest of {stall['world_size']} "
                  f"ranks), {stall['device']}, {stall['backend']}, {stall['trials']} trials after a warm-up save, "
                  f"methods in round-robin; state: {stall['state']}. {_load(tp)}.", ""]
        lines += [f"Stall: {stall['blocking']}.", ""]
        header = ("state", *[METHOD_NAMES.get(m, m) for m in stall["sizes"][0]["methods"]], "project ÷ memcpy",
                  "project ÷ torch at its best", "project ÷ dcp.save")
        rows = []
        for size in stall["sizes"]:
            r = size["ratios"]
            cells = [_stat(m["blocking_s"]) for m in size["methods"].values()]
            rows.append((f"{size['state_mb']:.0f} MB", *cells, f"{r['nvrx_async_over_memcpy']}×",
                         f"{r.get('nvrx_async_over_torch_async_save_best', '—')}×", f"{r['nvrx_async_over_dcp_save']}×"))
        lines += _table(header, rows)
        if "interference" in stall:
            lines += [f"Writer interference: {stall['interference']}. Also how long the write took while the steps ran "
                      "(the project's writer runs at a lower CPU priority, so on 2 busy cores it yields to training "
                      "and takes longer to land):", ""]
            async_methods = [m for m in stall["sizes"][0]["methods"] if "interference" in stall["sizes"][0]["methods"][m]]
            rows = []
            for size in stall["sizes"]:
                rows.append((f"{size['state_mb']:.0f} MB", _s(_median(size.get("step_s_idle"))), *[
                    f"{size['methods'][m]['interference']} (step {_s(_median(size['methods'][m]['step_s_save_in_flight']))}; "
                    f"write {_s(_median(size['methods'][m]['write_in_flight_s_while_stepping']))}"
                    + (f", {size['methods'][m]['writes_past_stepping_window']} past the window" if size['methods'][m].get('writes_past_stepping_window') else "")
                    + ")" for m in async_methods]))
            lines += _table(("state", "step without a save", *[METHOD_NAMES.get(m, m) for m in async_methods]), rows)
        lines += ["Methods: " + "; ".join(f"*{METHOD_NAMES.get(k, k)}*: {METHOD_HOW[k]}" for k in stall["sizes"][0]["methods"]
                                       if k in METHOD_HOW) + ".", ""]
        parts = [(f"{s['state_mb']:.0f} MB", _s(_median(s["methods"]["nvrx_async"].get("state_dict_s"))),
                  *[_s(v) for v in s["methods"]["nvrx_async"]["breakdown_median_s"].values()],
                  _stat(s["methods"]["nvrx_async"]["complete_s"]), _s(s["methods"]["nvrx_async"]["warmup_blocking_s"][0]))
                 for s in stall["sizes"]]
        keys = list(stall["sizes"][0]["methods"]["nvrx_async"]["breakdown_median_s"])
        lines += ["Where the project's blocking time goes (medians), how long until the save is committed, and the "
                  "warm-up save at each size (new snapshot buffers; at the first size also the writer process still "
                  "starting), which the figures above leave out:", ""]
        lines += _table(("state", "state-dict collection", *[k.replace("_s", "") for k in keys], "save → committed",
                         "warm-up save"), parts)
        lines += ["![checkpoint stall](/bench/results/stall.png)", ""]

    recovery = tp.get("recovery")
    relaunch = cp.get("relaunch")
    spare = cp.get("spare")
    if recovery or relaunch or spare:
        lines += ["### 2. Recovery per rung", ""]
    if recovery:
        s = recovery["settings"]
        lines += [f"Seconds from the fault to the next completed step (`restart_end.latency_s`), 2 ranks, "
                  f"`{s['model']}` model, collective timeout {s['collective_timeout_s']:.0f} s, heartbeat timeout "
                  f"{s['heartbeat_timeout_s']:.0f} s (the ceiling: once warm, each attempt derives its own from the measured steps "
                  f"and saves, see `timeouts_derived`), hang timeout {s['hang_timeout_s']:.0f} s. Rows `torchrun`: the "
                  "baseline, the same trainer without NVRx under plain `torchrun --standalone --max-restarts`. "
                  "Breakdown: medians, "
                  "from the events log and ft_launcher's log. {}.".format(_load(tp)), ""]
        rows = []
        for row in recovery["rows"]:
            p = row["parts_median_s"]
            if row["layer"] == "inprocess":
                detail = (f"detect {_s(p.get('detect'))} · tear down {_s(p.get('tear_down'))} · rendezvous + restore "
                          f"{_s(p.get('rendezvous_restore'))} · first step {_s(p.get('first_step'))}")
            else:
                detail = (f"detect {_s(p.get('detect'))} · tear down {_s(p.get('tear_down'))} · rendezvous "
                          f"{_s(p.get('rendezvous'))} · start + restore {_s(p.get('start_restore'))} · first step "
                          f"{_s(p.get('first_step'))}")
            rows.append((row["kind"], row["restart_mode"], row["layer"], row["latency_s"]["n"], _stat(row["latency_s"]),
                         detail, f"≤ {row['target_s']:g} s: {_ok(row['target_met'])}" if "target_s" in row else "—"))
        lines += _table(("fault", "restart mode", "recovered by", "n", "latency", "breakdown (median)", "target"), rows)
    if relaunch:
        lines += [f"Relaunch after node replacement (local backend), control-plane time only: from the failed launch "
                  f"giving up to the relaunch's first step; the watch (the deferred sensor's trigger) checks fully every "
                  f"{relaunch['poll_interval_s']:.0f} s (the sensor's default) and looks for the launch's end (its `final` "
                  f"event, or the launcher's exit) every {relaunch.get('change_tick_s', relaunch['poll_interval_s']):g} s "
                  "in between. The ladder's functions run without Airflow's scheduler. "
                  f"{_load(cp)}.", ""]
        rows = []
        for row in relaunch["rows"]:
            p = row["parts_median_s"]
            rows.append((row["kind"], row["launch_failed_by"], row["total_s"]["n"], _stat(row["total_s"]),
                         f"detect {_s(p['detect'])} · diagnose + replace {_s(p['diagnose_replace'])} · capacity + submit "
                         f"{_s(p['capacity_submit'])} · start + restore {_s(p['start_restore'])} · first step {_s(p['first_step'])}",
                         _stat(row["data_plane_s"]), f"≤ {row.get('target_s', 60):g} s: {_ok(row['target_met'])}"))
        lines += _table(("fault (bad node)", "launch failed by", "n", "failed launch → first step", "breakdown (median)",
                         "before it: fault → launch gave up", "target"), rows)
    if spare:
        lines += _spare_section(spare, relaunch, cp)
    if recovery or relaunch:
        lines += ["![recovery per rung](/bench/results/recovery.png)", ""]

    if chaos:
        lines += ["### 3. Goodput under chaos", ""]
        stopped = (" stopped by the benchmark once it had lasted "
                   f"{chaos['duration_s'] / 60:.0f} min and recovered from every fault," if chaos.get("outcome") == "stopped" else "")
        lines += [f"One run of {chaos['wall_s'] / 60:.1f} min (`{chaos['command'].strip()}`),{stopped} 2 ranks, `layered` restarts, "
                  f"{chaos['faults_injected']} faults ({', '.join(f'{k} {v}' for k, v in chaos['faults_by_kind'].items())}), "
                  f"one per ~{chaos['mtbf_s']:.0f} s, seeded ({chaos['seed']}), kinds apportioned from the Llama 3 "
                  f"mix below; checkpoint every {chaos['plan']['interval_steps']} steps ({_s(chaos['interval_s'])}: the "
                  f"Young/Daly interval for that MTBF from the save cost and step time of "
                  f"{chaos['calibration']['source']}); node losses climb the escalation ladder (replace the slot, relaunch). "
                  f"Accounting: `fsdp_resilience.control.report.goodput`. {_load(chaos)}.", ""]
        b = chaos["badput_s"]
        wall = chaos["wall_s"]
        rows = [("**ETTR** (productive ÷ wall)", f"**{chaos['ettr']:.3f}**", ""),
                (f"ETTR without the first start-up ({_s(chaos['initial_startup_s'])}) and the final shutdown "
                 f"({_s(chaos['final_shutdown_s'])}), which a long run amortises", f"{chaos['ettr_steady']:.3f}", ""),
                ("productive", _s(chaos["productive_s"]), f"{100 * chaos['productive_s'] / wall:.1f} %")]
        rows += [(k.replace("_", " "), _s(v), f"{100 * v / wall:.1f} %") for k, v in b.items() if v > 0]
        rows += [("wall", _s(wall), "100 %"),
                 ("lost per fault (restart + restore + lost progress, first start-up excluded)",
                  _s(chaos["lost_per_fault_s"]),
                  f"restart + restore {_s(chaos['lost_per_fault_parts_s']['restart_and_restore'])}, lost progress "
                  f"{_s(chaos['lost_per_fault_parts_s']['lost_progress'])}")]
        lines += _table(("", "seconds", "share"), rows)
        if summary.get("chaos_spares"):
            lines += _chaos_side_by_side(chaos, summary["chaos_spares"])
        c = chaos["save_costs"]
        m = chaos["model"]
        lines += [f"Measured save cost: blocking {_stat(c['blocking_s'])} per save; save → committed "
                  f"{_stat(c['commit_s'])}. Interference (badput, the `checkpoint interference` row): while the "
                  f"background writer runs, steps take {_s(c['step_s_during_a_save'].get('median'))} instead of "
                  f"{_s(c['step_s_otherwise_median'])} (ratio {c['interference_ratio']}; the writer shares the 2 cores "
                  f"with the 2 ranks), {_s(c['interference_per_save_s'])} more per save. "
                  f"Model: {m['formula']}, with C = {_s(m['C_save_cost_s'])}, I = {_s(m['I_interference_per_save_s'])}, "
                  f"R = {_s(m['R_restart_per_fault_s'])} "
                  f"per fault, W = {_s(m['W_commit_s'])}, loop overhead {100 * m['loop_overhead']:.1f} %; at this run's "
                  f"interval and fault rate it gives {m['check']['model_at_this_run']:.3f} against the measured "
                  f"{m['check']['measured_ettr_steady']:.3f} (without start-up and shutdown).", ""]
        rows = [(y["mtbf"], _s(y["mtbf_s"]), f"{_s(y['young_interval_s'])} ({y['interval_steps']} steps)",
                 f"{y['ettr']['half']:.3f}", f"**{y['ettr']['young_daly']:.3f}**", f"{y['ettr']['double']:.3f}")
                for y in chaos["young_daly"]]
        lines += ["Checkpoint interval by Young/Daly (sqrt(2·(C + I)·MTBF)) and the ETTR the model gives there, at half "
                  "and at twice that interval (modeled, not measured: three more 10-minute runs do not fit the "
                  "30-minute budget):", ""]
        lines += _table(("MTBF", "", "Young/Daly interval", "ETTR at ½×", "ETTR at 1×", "ETTR at 2×"), rows)
        recov = chaos.get("recovery_by_kind_s") or {}
        if recov:
            lines += _table(("fault → recovered by (in the chaos run)", "latency"), [(k, _stat(v)) for k, v in recov.items()])
        mix = {}
        for row in chaos["mix"]:
            mix.setdefault(row["drill"], []).append(f"{row['cause']} {row['count']}")
        lines += ["Llama 3 interruption causes (54 days, 419 unexpected interruptions; counts as weights — the "
                  "paper prints 30.1 % for faulty GPU, but 148 of 419 is 35.3 %) mapped to the project's drills by "
                  "how the fault reaches the training processes:", ""]
        why = {row["drill"]: row["why"] for row in chaos["mix"]}
        lines += _table(("drill", "share", "causes (count)", "how it shows"),
                        [(d, f"{100 * share:.1f} %", ", ".join(mix[d]), why[d]) for d, share in chaos["drill_shares"].items()])
        lines += ["![chaos timeline](/bench/results/chaos-timeline.png)", "",
                  "![chaos goodput](/bench/results/chaos-goodput.png)", "",
                  "![ETTR against checkpoint interval](/bench/results/young_daly.png)", ""]
        if summary.get("chaos_spares"):
            lines += ["The run with a hot spare:", "",
                      "![chaos timeline, with a spare](/bench/results/chaos_spares-timeline.png)", "",
                      "![chaos goodput, with a spare](/bench/results/chaos_spares-goodput.png)", ""]

    if cp.get("slots") or cp.get("watch") or cp.get("parse"):
        lines += ["### 4. Control-plane overhead", ""]
        rows = []
        slots = cp.get("slots")
        if slots:
            rows.append(("worker slots held while training runs",
                         f"{slots['worker_slot_s_during_training']:.2f} slot-seconds in a {slots['training_window_s']:.0f} s "
                         f"training window ({100 * slots['worker_slot_share_of_training']:.1f} %): "
                         + ", ".join(f"{k} {v:.2f} s" for k, v in slots["worker_slot_s_by_task"].items())
                         + f"; the deferred sensor's trigger: {slots['deferred_trigger_s_during_training']:.0f} s; "
                           f"{slots['deferrals']} deferral(s)"))
        watch = cp.get("watch")
        if watch:
            rows.append((f"checkpoint commit → the trigger fires (poll {watch['poll_interval_s']:g} s, {watch['trials']} trials)",
                         _stat(watch["commit_to_trigger_event_s"])))
        parse = cp.get("parse")
        if parse:
            fresh, pre = parse["fresh_imports"], parse["pre_imported"]
            rows.append((f"DAG parse of dags/ (torch blocked, {parse['trials']} trials)",
                         f"{_stat(fresh['dagbag_s'])} importing the plugin modules; {_stat(pre['dagbag_s'])} with them "
                         "pre-imported (as Airflow's DAG processor does); per file: "
                         + ", ".join(f"{f} {_s(v['median'])}" for f, v in fresh["per_file_s"].items())
                         + f"; importing Airflow itself: {_s(parse['airflow_import_s'])}"))
        lines += _table(("figure", "measured"), rows)
        if slots:
            lines += [f"About the slot figure: {slots['note']}", ""]
        lines += [f"{_load(cp)}.", ""]

    evaluation = tp.get("eval_load")
    if evaluation:
        s = evaluation["seconds"]
        lines += ["### 5. Evaluation load", ""]
        lines += [f"`fsdp_resilience.training.evaluate.load_model` of a `{evaluation['model']}` checkpoint saved by {evaluation['saved_world_size']} "
                  f"ranks, {evaluation['file_mb']:.0f} MB of files of which {evaluation['model_mb']:.0f} MB are the model "
                  f"(the rest is optimizer state, which evaluation skips), into one process, {evaluation['trials']} "
                  f"trials. Page cache: {evaluation['page_cache']}. Raw read: {evaluation.get('raw_read', 'reads into a buffer')}.", ""]
        lines += _table(("", "seconds", "load ÷ this"), [
            (f"load into the evaluation process (verified by {evaluation.get('verified_by', 'file checksums')}: "
             f"{evaluation.get('verification', 'sizes and CRC32C of every file, then DCP load')})",
             _stat(s["load_model"]), "1×"),
            (f"  of which building the model ({evaluation.get('build', 'random init')})", _stat(s["build_model_only"]), ""),
            ("raw read of the model tensors' bytes (what the load reads) into a reused buffer",
             _stat(s["raw_read_model_bytes"]), f"{evaluation['ratios']['load_over_raw_read_model_bytes']}×")]
            + ([("the same into memory allocated for each read (as a new model's parameters are: page faults)",
                 _stat(s["raw_read_model_bytes_fresh_memory"]),
                 f"{evaluation['ratios']['load_over_raw_read_model_bytes_fresh_memory']}×")]
               if "raw_read_model_bytes_fresh_memory" in s else []) + [
            ("raw read of all the checkpoint's files", _stat(s["raw_read_files"]),
             f"{evaluation['ratios']['load_over_raw_read_files']}×")]
            + ([(f"for comparison, what a resume's full verification costs: sizes + CRC32C of all the files "
                 f"({evaluation['ratios']['verify_gib_per_s']} GiB/s)", _stat(s["verify_checksums"]),
                 f"{round(1 / evaluation['ratios']['verify_over_load'], 2)}×")] if "verify_checksums" in s else []))

    lines += ["### Reproduce", "", "```sh",
              "make bench          # everything, ≤ 30 min on 2 cores: bench/results/ (latest.json and the plots are",
              "                    # committed) and this table, docs/benchmarks.md",
              "make bench-quick    # smoke run of the same scripts, under a minute: bench/results/quick/",
              ".venv/bin/python -m bench.training_plane --sizes-mb 50,200,1000 --trials 5   # one part, any sizes",
              ".venv-airflow/bin/python -m bench.chaos --duration-s 600 --mtbf-s 60 --seed 1234"]
    if summary.get("chaos_spares") or cp.get("spare"):
        lines += [".venv-airflow/bin/python -m bench.chaos --duration-s 480 --spare-nodes 1   # the run with a hot spare",
                  "python3 -m bench.run --only spare,chaos,chaos_spares   # some parts again, merged into the rest"]
    lines += ["```", "",
              "On a GPU node the same scripts use CUDA and NCCL (`--device auto`); pass larger `--sizes-mb` and "
              "`--model` there.", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_stall(stall: dict[str, Any], path: Path) -> None:
    figure = _figure(8, 4.5)
    ax = figure.subplots()
    sizes = [s["state_mb"] for s in stall["sizes"]]
    for method in stall["sizes"][0]["methods"]:
        stats = [s["methods"][method]["blocking_s"] for s in stall["sizes"]]
        med = [x["median"] for x in stats]
        err = [[m - x["min"] for m, x in zip(med, stats)], [x["max"] - m for m, x in zip(med, stats)]]
        ax.errorbar(sizes, med, yerr=err, marker="o", capsize=3, label=METHOD_NAMES.get(method, method),
                    linestyle="--" if method == "memcpy" else "-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("checkpoint state, MB (total over ranks)")
    ax.set_ylabel("blocking time per save, s (median, min–max)")
    ax.set_title(f"Checkpoint stall, {stall['world_size']} ranks, {stall['device']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    figure.savefig(path)


def plot_recovery(tp: dict[str, Any], cp: dict[str, Any], path: Path) -> None:
    rows = []
    for row in (tp.get("recovery") or {}).get("rows", []):
        rows.append((f"{row['kind']} ({row['restart_mode']}) → {row['layer']}", row["parts_median_s"], row["latency_s"],
                     row.get("target_s")))
    for row in (cp.get("relaunch") or {}).get("rows", []):
        rows.append((f"{row['kind']} → relaunch (control plane)", row["parts_median_s"], row["total_s"], row.get("target_s")))
    spare = cp.get("spare")
    if spare and spare["recovery_s"].get("n"):
        # Until rank 0 sees the spare in the group (spare_promoted), then the rest to the first step.
        promoted, total = spare["promoted_s"].get("median"), spare["recovery_s"]["median"]
        parts = {"detect_to_new_workers": promoted, "first_step": total - promoted} if promoted else {"first_step": total}
        rows.append(("node_loss → a hot spare (in-job)", parts, spare["recovery_s"], None))
    if not rows:
        return
    figure = _figure(10, 0.55 * len(rows) + 1.6)
    ax = figure.subplots()
    for y, (label, parts, total, target) in enumerate(rows):
        left = 0.0
        for name in sorted(parts, key=lambda n: PHASES.index(n) if n in PHASES else len(PHASES)):
            value = parts[name]
            if not value:
                continue
            ax.barh(y, value, left=left, color=PHASE_COLORS.get(name, "tab:gray"), label=name.replace("_", " "))
            left += value
        ax.errorbar([total["median"]], [y], xerr=[[total["median"] - total["min"]], [total["max"] - total["median"]]],
                    fmt="k|", capsize=4)
        if target:
            ax.plot([target], [y], marker="v", color="black", markersize=7)
    handles, labels = ax.get_legend_handles_labels()
    seen = {}
    for h, label in zip(handles, labels):
        seen.setdefault(label, h)
    order = [p.replace("_", " ") for p in PHASES]
    labels = sorted(seen, key=lambda label: order.index(label) if label in order else len(order))  # time order
    ax.legend([seen[label] for label in labels], labels, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the fault to the next completed step (bars: median breakdown; "
                  "whisker: min–max; ▼ target)")
    ax.set_title("Recovery per rung")
    ax.grid(alpha=0.3, axis="x")
    figure.savefig(path)


def plot_young_daly(chaos: dict[str, Any], path: Path) -> None:
    from bench.common import ettr_model

    m = chaos["model"]
    figure = _figure(8, 4.5)
    ax = figure.subplots()
    for row in chaos["young_daly"]:
        tau = row["young_interval_s"]
        xs = [tau * 2 ** (k / 8) for k in range(-24, 25)]
        ys = [ettr_model(x, save_cost_s=m["C_save_cost_s"], mtbf_s=row["mtbf_s"], restart_s=m["R_restart_per_fault_s"],
                         commit_s=m["W_commit_s"], loop_overhead=m["loop_overhead"]) for x in xs]
        line, = ax.plot(xs, ys, label=f"MTBF {_s(row['mtbf_s'])}: {row['mtbf']}")
        ax.plot([tau / 2, tau, 2 * tau], [row["ettr"]["half"], row["ettr"]["young_daly"], row["ettr"]["double"]], "o",
                color=line.get_color())
    ax.plot([chaos["interval_s"]], [m["check"]["measured_ettr_steady"]], "k*", markersize=12,
            label="measured in the chaos run (without start-up and shutdown)")
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.set_xlabel("checkpoint interval, s (dots: ½×, 1×, 2× the Young/Daly interval)")
    ax.set_ylabel("ETTR (modeled from measured costs)")
    ax.set_title("ETTR against checkpoint interval")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small", loc="lower center")
    figure.savefig(path)


README_BEGIN, README_END = "<!-- bench:begin (make bench writes this block) -->", "<!-- bench:end -->"


def readme_block(summary: dict[str, Any]) -> str:
    """The README's part of the table: the lead paragraph and the targets, up to the details
    (which stay in docs/benchmarks.md)."""
    lead = render_markdown(summary).split("\n### 1.", 1)[0]
    lead = lead.replace("## Benchmarks\n\n", "", 1).rstrip()
    return f"{README_BEGIN}\n{lead}\n\nPer-benchmark details, plots and how each figure is measured: " \
           f"[docs/benchmarks.md](docs/benchmarks.md).\n{README_END}"


def update_readme(readme: Path, summary: dict[str, Any]) -> None:
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    readme.write_text(head + readme_block(summary) + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.summarize", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="summarise the *.quick.json files into OUT/quick/")
    parser.add_argument("--docs", type=Path, default=None,
                        help="where the Markdown goes (default: docs/benchmarks.md; quick: OUT/quick/benchmarks.md)")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # absolute: subprocesses (and an SQLite URL) must not depend on the cwd
    summary = build_summary(args.out, args.quick)
    target_dir = args.out / "quick" if args.quick else args.out
    target_dir.mkdir(parents=True, exist_ok=True)
    summary = read_json(write_json(target_dir / SUMMARY, summary))  # render exactly what is committed
    tp, cp, chaos = summary.get("training_plane") or {}, summary.get("control_plane") or {}, summary.get("chaos")
    if tp.get("stall"):
        plot_stall(tp["stall"], target_dir / "stall.png")
    if tp.get("recovery") or cp.get("relaunch") or cp.get("spare"):
        plot_recovery(tp, cp, target_dir / "recovery.png")
    if chaos:
        plot_young_daly(chaos, target_dir / "young_daly.png")
    docs = args.docs or (target_dir / "benchmarks.md" if args.quick else REPO / "docs" / "benchmarks.md")
    docs.write_text(render_markdown(summary))
    if not args.quick and args.docs is None:
        update_readme(REPO / "README.md", summary)
    print(f"[bench] summary {target_dir / SUMMARY}; table {docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
