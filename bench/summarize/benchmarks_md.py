"""docs/benchmarks.md: the Markdown of the latest figures, a pure function of the summary JSON
(standard library only), so a test can check that the committed page matches the committed JSON."""

from __future__ import annotations

from typing import Any

from bench.summarize.formats import (
    METHOD_HOW,
    METHOD_NAMES,
    fmt_load,
    fmt_met,
    fmt_s,
    fmt_stat,
    fmt_when,
    md_table,
    median_of,
)
from bench.summarize.targets import targets

#: NVRx 0.7's promotion of a hot spare, measured by the rendezvous experiment of issue 15 (a gloo
#: all-reduce loop, nodes=2:3, SIGKILL of a node -> the new round closed; 5 kills), not by make bench.
NVRX07_PROMOTION_S = (4.6, 4.8)


def _spare_section(spare: dict[str, Any], relaunch: dict[str, Any] | None, cp: dict[str, Any]) -> list[str]:
    """Node loss with a hot spare, next to the relaunch rung for the same loss."""
    same = next((r for r in (relaunch or {}).get("rows") or [] if r["kind"] == "node_loss"), None)
    measured = (cp.get("measured") or {}).get("spare") or {}
    load = fmt_load({"load": measured.get("load")}) if measured.get("load") else fmt_load(cp)
    by = sorted({t["recovered_by"] for t in spare["trials"] if t.get("recovered_by")})
    lines = [
        f"Node loss with a hot spare (local backend, {spare['nodes']} nodes × {spare['procs_per_node']} ranks + "
        f"{spare['spare_nodes']} spare, NVRx {spare.get('nvrx') or '?'}): node 1's launcher and ranks SIGKILLed "
        "(node 0 hosts the rendezvous store, which no spare covers), a run per trial, driven like the DAG: the "
        "watch watches on while the job stays running, and the pool keeper (`spare_refill.keep_spare_pool`) "
        "quarantines the lost slot and starts a new spare meanwhile. No relaunch: "
        + (
            "every loss was covered in-job."
            if spare["all_covered_in_job"]
            else "**not every loss was covered in-job** (see `trials`)."
        )
        + f" {load}.",
        "",
    ]
    rows = [
        (
            "node_loss, a spare takes its place",
            ", ".join(by) or "—",
            spare["recovery_s"].get("n", 0),
            fmt_stat(spare["recovery_s"]),
            fmt_stat(spare["promoted_s"]),
            fmt_stat(spare["refill_s"]),
        )
    ]
    if same:
        rows.append(
            (
                "node_loss, no spare: the relaunch rung (above)",
                "relaunch",
                same["total_s"]["n"],
                fmt_stat(same["total_s"]),
                "—",
                "—",
            )
        )
    lines += md_table(
        (
            "fault",
            "recovered by",
            "n",
            "fault → first step",
            "fault → spare trains (`spare_promoted`)",
            "fault → pool whole again (`spare_added`)",
        ),
        rows,
    )
    lines += [
        f"The spare's promotion waits for the rendezvous to drop the lost node. NVRx 0.4.1 (this lane) does so "
        "when its keep-alive expires, hard-coded at 5 s × 3 (≈ 14–15 s), and the in-process layer tries first. "
        f"NVRx 0.7's barrier rendezvous promotes in {NVRX07_PROMOTION_S[0]}–{NVRX07_PROMOTION_S[1]} s (kill → "
        "new round closed, 5 kills with a gloo all-reduce loop; measured by the issue-15 rendezvous "
        "experiment, not by this benchmark); the trainer's restart and resume come on top."
    ]
    if same and spare["recovery_s"].get("n") and same["total_s"]["median"] < spare["recovery_s"]["median"]:
        lines[-1] += (
            " Here the relaunch is faster: a local slot starts in seconds, while the spare waits for the "
            "rendezvous to drop the lost node. What a spare saves is the node's replacement where that "
            "takes minutes: a new instance's boot and join on EKS, or a wait for capacity that may not "
            "come; and it keeps the pool whole without holding up training."
        )
    return lines + [""]


def _chaos_side_by_side(plain: dict[str, Any], spared: dict[str, Any]) -> list[str]:
    """The chaos run without and with hot spares, column by column."""

    def topology(c: dict[str, Any]) -> str:
        t = c.get("topology") or {"nodes": 1, "procs_per_node": 2, "spare_nodes": 0}
        return f"{t['nodes']} × {t['procs_per_node']} ranks" + (
            f" + {t['spare_nodes']} spare" if t["spare_nodes"] else ""
        )

    def node_loss(c: dict[str, Any]) -> str:
        n = c.get("node_loss")
        if n is None:  # results from before the node_loss figures: the recovery table's rows
            rows = {
                k.split(" → ", 1)[1]: v
                for k, v in (c.get("recovery_by_kind_s") or {}).items()
                if k.startswith("node_loss → ")
            }
            return "; ".join(f"{fmt_stat(v)} by {layer}" for layer, v in rows.items()) or "—"
        if not n.get("n"):
            return "—"
        return f"{fmt_stat(n['fault_to_next_step_s'])} by {', '.join(n['recovered_by']) or '—'}"

    def refill(c: dict[str, Any]) -> str:
        n = c.get("node_loss") or {}
        if not n.get("spare_nodes"):
            return "—"
        return f"{n['covered_by_a_spare']} of {n['n']} covered in-job; pool whole again after {fmt_stat(n['refill_s'])}"

    def run(c: dict[str, Any]) -> str:
        fired, scheduled = c["faults_injected"], c.get("faults_scheduled", c["faults_injected"])
        return f"{c['wall_s'] / 60:.1f} min, {fired} faults" + (
            f" (**{scheduled} scheduled**: the others never fired)" if fired < scheduled else ""
        )

    rows = [
        ("nodes", topology(plain), topology(spared)),
        ("run", run(plain), run(spared)),
        ("**ETTR** (productive ÷ wall)", f"**{plain['ettr']:.3f}**", f"**{spared['ettr']:.3f}**"),
        (
            "ETTR without the first start-up and the final shutdown",
            f"{plain['ettr_steady']:.3f}",
            f"{spared['ettr_steady']:.3f}",
        ),
        ("lost per fault", fmt_s(plain["lost_per_fault_s"]), fmt_s(spared["lost_per_fault_s"])),
        ("node loss: fault → next step", node_loss(plain), node_loss(spared)),
        ("relaunches", str(len(plain.get("rungs") or [])), str(len(spared.get("rungs") or []))),
        ("spare pool", "—", refill(spared)),
    ]
    return [
        f"Side by side with the same fault schedule's mix and seed, with a hot spare (`{spared['command'].strip()}`): "
        "a node loss takes the training node holding the highest rank off node 0 (the rendezvous host), a spare "
        f"takes its place in-job, and the pool is refilled while training goes on. {fmt_load(spared)}.",
        "",
    ] + md_table(("", "without spares", "with spares"), rows)


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
        + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
        + ". "
        "Other work shared the machine; each part records its load average. Each figure is a ratio "
        "measured within one run, or a latency as median (min–max) over repeated trials. Targets "
        "missed are reported as missed. `make bench-quick` is a smoke run of the same scripts. "
        "Raw results: `bench/results/latest.json`.",
        "",
    ]
    if run.get("updates"):
        lines += [
            "Measured again since, and merged into the figures above (`python -m bench.run --only`): "
            + "; ".join(
                f"{', '.join(u['parts'])} on {fmt_when(u['started_at'])}" for u in run["updates"] if u.get("parts")
            )
            + ". When each part was measured: "
            + ", ".join(f"{name} {fmt_when(part.get('measured_at'))}" for name, part in run["parts"].items())
            + ".",
            "",
        ]
    if summary.get("quick"):
        lines += ["> **Quick smoke run**: too few trials and too small states to quote.", ""]

    lines += ["### Targets", ""]
    lines += md_table(
        ("figure", "target", "measured", ""), [(f, t, m, fmt_met(ok)) for f, t, m, ok in targets(summary)]
    )

    stall = tp.get("stall")
    if stall:
        lines += ["### 1. Checkpoint stall", ""]
        lines += [
            f"Blocking time per save (the training loop waits this long; the slowest of {stall['world_size']} "
            f"ranks), {stall['device']}, {stall['backend']}, {stall['trials']} trials after a warm-up save, "
            f"methods in round-robin; state: {stall['state']}. {fmt_load(tp)}.",
            "",
        ]
        lines += [f"Stall: {stall['blocking']}.", ""]
        header = (
            "state",
            *[METHOD_NAMES.get(m, m) for m in stall["sizes"][0]["methods"]],
            "project ÷ memcpy",
            "project ÷ torch at its best",
            "project ÷ dcp.save",
        )
        rows = []
        for size in stall["sizes"]:
            r = size["ratios"]
            cells = [fmt_stat(m["blocking_s"]) for m in size["methods"].values()]
            rows.append(
                (
                    f"{size['state_mb']:.0f} MB",
                    *cells,
                    f"{r['nvrx_async_over_memcpy']}×",
                    f"{r.get('nvrx_async_over_torch_async_save_best', '—')}×",
                    f"{r['nvrx_async_over_dcp_save']}×",
                )
            )
        lines += md_table(header, rows)
        if "interference" in stall:
            lines += [
                f"Writer interference: {stall['interference']}. Also how long the write took while the steps ran "
                "(the project's writer runs at a lower CPU priority, so on 2 busy cores it yields to training "
                "and takes longer to land):",
                "",
            ]
            async_methods = [
                m for m in stall["sizes"][0]["methods"] if "interference" in stall["sizes"][0]["methods"][m]
            ]
            rows = []
            for size in stall["sizes"]:
                rows.append(
                    (
                        f"{size['state_mb']:.0f} MB",
                        fmt_s(median_of(size.get("step_s_idle"))),
                        *[
                            f"{size['methods'][m]['interference']} (step "
                            f"{fmt_s(median_of(size['methods'][m]['step_s_save_in_flight']))}; "
                            f"write {fmt_s(median_of(size['methods'][m]['write_in_flight_s_while_stepping']))}"
                            + (
                                f", {size['methods'][m]['writes_past_stepping_window']} past the window"
                                if size["methods"][m].get("writes_past_stepping_window")
                                else ""
                            )
                            + ")"
                            for m in async_methods
                        ],
                    )
                )
            lines += md_table(("state", "step without a save", *[METHOD_NAMES.get(m, m) for m in async_methods]), rows)
        lines += [
            "Methods: "
            + "; ".join(
                f"*{METHOD_NAMES.get(k, k)}*: {METHOD_HOW[k]}" for k in stall["sizes"][0]["methods"] if k in METHOD_HOW
            )
            + ".",
            "",
        ]
        parts = [
            (
                f"{s['state_mb']:.0f} MB",
                fmt_s(median_of(s["methods"]["nvrx_async"].get("state_dict_s"))),
                *[fmt_s(v) for v in s["methods"]["nvrx_async"]["breakdown_median_s"].values()],
                fmt_stat(s["methods"]["nvrx_async"]["complete_s"]),
                fmt_s(s["methods"]["nvrx_async"]["warmup_blocking_s"][0]),
            )
            for s in stall["sizes"]
        ]
        keys = list(stall["sizes"][0]["methods"]["nvrx_async"]["breakdown_median_s"])
        lines += [
            "Where the project's blocking time goes (medians), how long until the save is committed, and the "
            "warm-up save at each size (new snapshot buffers; at the first size also the writer process still "
            "starting), which the figures above leave out:",
            "",
        ]
        lines += md_table(
            (
                "state",
                "state-dict collection",
                *[k.replace("_s", "") for k in keys],
                "save → committed",
                "warm-up save",
            ),
            parts,
        )
        lines += ["![checkpoint stall](/bench/results/stall.png)", ""]

    recovery = tp.get("recovery")
    relaunch = cp.get("relaunch")
    spare = cp.get("spare")
    if recovery or relaunch or spare:
        lines += ["### 2. Recovery per rung", ""]
    if recovery:
        s = recovery["settings"]
        lines += [
            f"Seconds from the fault to the next completed step (`restart_end.latency_s`), 2 ranks, "
            f"`{s['model']}` model, collective timeout {s['collective_timeout_s']:.0f} s, heartbeat timeout "
            f"{s['heartbeat_timeout_s']:.0f} s (the ceiling: once warm, each attempt derives its own from the "
            "measured steps "
            f"and saves, see `timeouts_derived`), hang timeout {s['hang_timeout_s']:.0f} s. Rows `torchrun`: the "
            "baseline, the same trainer without NVRx under plain `torchrun --standalone --max-restarts`. "
            "Breakdown: medians, "
            "from the events log and ft_launcher's log. {}.".format(fmt_load(tp)),
            "",
        ]
        rows = []
        for row in recovery["rows"]:
            p = row["parts_median_s"]
            if row["layer"] == "inprocess":
                detail = (
                    f"detect {fmt_s(p.get('detect'))} · tear down {fmt_s(p.get('tear_down'))} · rendezvous + restore "
                    f"{fmt_s(p.get('rendezvous_restore'))} · first step {fmt_s(p.get('first_step'))}"
                )
            else:
                detail = (
                    f"detect {fmt_s(p.get('detect'))} · tear down {fmt_s(p.get('tear_down'))} · rendezvous "
                    f"{fmt_s(p.get('rendezvous'))} · start + restore {fmt_s(p.get('start_restore'))} · first step "
                    f"{fmt_s(p.get('first_step'))}"
                )
            rows.append(
                (
                    row["kind"],
                    row["restart_mode"],
                    row["layer"],
                    row["latency_s"]["n"],
                    fmt_stat(row["latency_s"]),
                    detail,
                    f"≤ {row['target_s']:g} s: {fmt_met(row['target_met'])}" if "target_s" in row else "—",
                )
            )
        lines += md_table(
            ("fault", "restart mode", "recovered by", "n", "latency", "breakdown (median)", "target"), rows
        )
    if relaunch:
        lines += [
            f"Relaunch after node replacement (local backend), control-plane time only: from the failed launch "
            f"giving up to the relaunch's first step; the watch (the deferred sensor's trigger) checks fully every "
            f"{relaunch['poll_interval_s']:.0f} s (the sensor's default) and looks for the launch's end (its `final` "
            f"event, or the launcher's exit) every {relaunch.get('change_tick_s', relaunch['poll_interval_s']):g} s "
            "in between. The ladder's functions run without Airflow's scheduler. "
            f"{fmt_load(cp)}.",
            "",
        ]
        rows = []
        for row in relaunch["rows"]:
            p = row["parts_median_s"]
            rows.append(
                (
                    row["kind"],
                    row["launch_failed_by"],
                    row["total_s"]["n"],
                    fmt_stat(row["total_s"]),
                    f"detect {fmt_s(p['detect'])} · diagnose + replace {fmt_s(p['diagnose_replace'])} · capacity + "
                    "submit "
                    f"{fmt_s(p['capacity_submit'])} · start + restore {fmt_s(p['start_restore'])} · first step "
                    f"{fmt_s(p['first_step'])}",
                    fmt_stat(row["data_plane_s"]),
                    f"≤ {row.get('target_s', 60):g} s: {fmt_met(row['target_met'])}",
                )
            )
        lines += md_table(
            (
                "fault (bad node)",
                "launch failed by",
                "n",
                "failed launch → first step",
                "breakdown (median)",
                "before it: fault → launch gave up",
                "target",
            ),
            rows,
        )
    if spare:
        lines += _spare_section(spare, relaunch, cp)
    if recovery or relaunch:
        lines += ["![recovery per rung](/bench/results/recovery.png)", ""]

    if chaos:
        lines += ["### 3. Goodput under chaos", ""]
        stopped = (
            " stopped by the benchmark once it had lasted "
            f"{chaos['duration_s'] / 60:.0f} min and recovered from every fault,"
            if chaos.get("outcome") == "stopped"
            else ""
        )
        lines += [
            f"One run of {chaos['wall_s'] / 60:.1f} min (`{chaos['command'].strip()}`),{stopped} 2 ranks, `layered` "
            "restarts, "
            f"{chaos['faults_injected']} faults ({', '.join(f'{k} {v}' for k, v in chaos['faults_by_kind'].items())}), "
            f"one per ~{chaos['mtbf_s']:.0f} s, seeded ({chaos['seed']}), kinds apportioned from the Llama 3 "
            f"mix below; checkpoint every {chaos['plan']['interval_steps']} steps ({fmt_s(chaos['interval_s'])}: the "
            f"Young/Daly interval for that MTBF from the save cost and step time of "
            f"{chaos['calibration']['source']}); node losses climb the escalation ladder (replace the slot, relaunch). "
            f"Accounting: `fsdp_resilience.control.report.goodput`. {fmt_load(chaos)}.",
            "",
        ]
        b = chaos["badput_s"]
        wall = chaos["wall_s"]
        rows = [
            ("**ETTR** (productive ÷ wall)", f"**{chaos['ettr']:.3f}**", ""),
            (
                f"ETTR without the first start-up ({fmt_s(chaos['initial_startup_s'])}) and the final shutdown "
                f"({fmt_s(chaos['final_shutdown_s'])}), which a long run amortises",
                f"{chaos['ettr_steady']:.3f}",
                "",
            ),
            ("productive", fmt_s(chaos["productive_s"]), f"{100 * chaos['productive_s'] / wall:.1f} %"),
        ]
        rows += [(k.replace("_", " "), fmt_s(v), f"{100 * v / wall:.1f} %") for k, v in b.items() if v > 0]
        rows += [
            ("wall", fmt_s(wall), "100 %"),
            (
                "lost per fault (restart + restore + lost progress, first start-up excluded)",
                fmt_s(chaos["lost_per_fault_s"]),
                f"restart + restore {fmt_s(chaos['lost_per_fault_parts_s']['restart_and_restore'])}, lost progress "
                f"{fmt_s(chaos['lost_per_fault_parts_s']['lost_progress'])}",
            ),
        ]
        lines += md_table(("", "seconds", "share"), rows)
        if summary.get("chaos_spares"):
            lines += _chaos_side_by_side(chaos, summary["chaos_spares"])
        c = chaos["save_costs"]
        m = chaos["model"]
        lines += [
            f"Measured save cost: blocking {fmt_stat(c['blocking_s'])} per save; save → committed "
            f"{fmt_stat(c['commit_s'])}. Interference (badput, the `checkpoint interference` row): while the "
            f"background writer runs, steps take {fmt_s(c['step_s_during_a_save'].get('median'))} instead of "
            f"{fmt_s(c['step_s_otherwise_median'])} (ratio {c['interference_ratio']}; the writer shares the 2 cores "
            f"with the 2 ranks), {fmt_s(c['interference_per_save_s'])} more per save. "
            f"Model: {m['formula']}, with C = {fmt_s(m['C_save_cost_s'])}, I = "
            f"{fmt_s(m['I_interference_per_save_s'])}, "
            f"R = {fmt_s(m['R_restart_per_fault_s'])} "
            f"per fault, W = {fmt_s(m['W_commit_s'])}, loop overhead {100 * m['loop_overhead']:.1f} %; at this run's "
            f"interval and fault rate it gives {m['check']['model_at_this_run']:.3f} against the measured "
            f"{m['check']['measured_ettr_steady']:.3f} (without start-up and shutdown).",
            "",
        ]
        rows = [
            (
                y["mtbf"],
                fmt_s(y["mtbf_s"]),
                f"{fmt_s(y['young_interval_s'])} ({y['interval_steps']} steps)",
                f"{y['ettr']['half']:.3f}",
                f"**{y['ettr']['young_daly']:.3f}**",
                f"{y['ettr']['double']:.3f}",
            )
            for y in chaos["young_daly"]
        ]
        lines += [
            "Checkpoint interval by Young/Daly (sqrt(2·(C + I)·MTBF)) and the ETTR the model gives there, at half "
            "and at twice that interval (modeled, not measured: three more 10-minute runs do not fit the "
            "30-minute budget):",
            "",
        ]
        lines += md_table(("MTBF", "", "Young/Daly interval", "ETTR at ½×", "ETTR at 1×", "ETTR at 2×"), rows)
        recov = chaos.get("recovery_by_kind_s") or {}
        if recov:
            lines += md_table(
                ("fault → recovered by (in the chaos run)", "latency"), [(k, fmt_stat(v)) for k, v in recov.items()]
            )
        mix = {}
        for row in chaos["mix"]:
            mix.setdefault(row["drill"], []).append(f"{row['cause']} {row['count']}")
        lines += [
            "Llama 3 interruption causes (54 days, 419 unexpected interruptions; counts as weights — the "
            "paper prints 30.1 % for faulty GPU, but 148 of 419 is 35.3 %) mapped to the project's drills by "
            "how the fault reaches the training processes:",
            "",
        ]
        why = {row["drill"]: row["why"] for row in chaos["mix"]}
        lines += md_table(
            ("drill", "share", "causes (count)", "how it shows"),
            [(d, f"{100 * share:.1f} %", ", ".join(mix[d]), why[d]) for d, share in chaos["drill_shares"].items()],
        )
        lines += [
            "![chaos timeline](/bench/results/chaos-timeline.png)",
            "",
            "![chaos goodput](/bench/results/chaos-goodput.png)",
            "",
            "![ETTR against checkpoint interval](/bench/results/young_daly.png)",
            "",
        ]
        if summary.get("chaos_spares"):
            lines += [
                "The run with a hot spare:",
                "",
                "![chaos timeline, with a spare](/bench/results/chaos_spares-timeline.png)",
                "",
                "![chaos goodput, with a spare](/bench/results/chaos_spares-goodput.png)",
                "",
            ]

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

    evaluation = tp.get("eval_load")
    if evaluation:
        s = evaluation["seconds"]
        lines += ["### 5. Evaluation load", ""]
        lines += [
            f"`fsdp_resilience.training.evaluate.load_model` of a `{evaluation['model']}` checkpoint saved by "
            f"{evaluation['saved_world_size']} "
            f"ranks, {evaluation['file_mb']:.0f} MB of files of which {evaluation['model_mb']:.0f} MB are the model "
            f"(the rest is optimizer state, which evaluation skips), into one process, {evaluation['trials']} "
            f"trials. Page cache: {evaluation['page_cache']}. Raw read: "
            f"{evaluation.get('raw_read', 'reads into a buffer')}.",
            "",
        ]
        lines += md_table(
            ("", "seconds", "load ÷ this"),
            [
                (
                    f"load into the evaluation process (verified by {evaluation.get('verified_by', 'file checksums')}: "
                    f"{evaluation.get('verification', 'sizes and CRC32C of every file, then DCP load')})",
                    fmt_stat(s["load_model"]),
                    "1×",
                ),
                (
                    f"  of which building the model ({evaluation.get('build', 'random init')})",
                    fmt_stat(s["build_model_only"]),
                    "",
                ),
                (
                    "raw read of the model tensors' bytes (what the load reads) into a reused buffer",
                    fmt_stat(s["raw_read_model_bytes"]),
                    f"{evaluation['ratios']['load_over_raw_read_model_bytes']}×",
                ),
            ]
            + (
                [
                    (
                        "the same into memory allocated for each read (as a new model's parameters are: page faults)",
                        fmt_stat(s["raw_read_model_bytes_fresh_memory"]),
                        f"{evaluation['ratios']['load_over_raw_read_model_bytes_fresh_memory']}×",
                    )
                ]
                if "raw_read_model_bytes_fresh_memory" in s
                else []
            )
            + [
                (
                    "raw read of all the checkpoint's files",
                    fmt_stat(s["raw_read_files"]),
                    f"{evaluation['ratios']['load_over_raw_read_files']}×",
                )
            ]
            + (
                [
                    (
                        f"for comparison, what a resume's full verification costs: sizes + CRC32C of all the files "
                        f"({evaluation['ratios']['verify_gib_per_s']} GiB/s)",
                        fmt_stat(s["verify_checksums"]),
                        f"{round(1 / evaluation['ratios']['verify_over_load'], 2)}×",
                    )
                ]
                if "verify_checksums" in s
                else []
            ),
        )

    lines += [
        "### Reproduce",
        "",
        "```sh",
        "make bench          # everything, ≤ 30 min on 2 cores: bench/results/ (latest.json and the plots are",
        "                    # committed) and this table, docs/benchmarks.md",
        "make bench-quick    # smoke run of the same scripts, under a minute: bench/results/quick/",
        ".venv/bin/python -m bench.training_plane --sizes-mb 50,200,1000 --trials 5   # one part, any sizes",
        ".venv-airflow/bin/python -m bench.chaos --duration-s 600 --mtbf-s 60 --seed 1234",
    ]
    if summary.get("chaos_spares") or cp.get("spare"):
        lines += [
            ".venv-airflow/bin/python -m bench.chaos --duration-s 480 --spare-nodes 1   # the run with a hot spare",
            "python3 -m bench.run --only spare,chaos,chaos_spares   # some parts again, merged into the rest",
        ]
    lines += [
        "```",
        "",
        "On a GPU node the same scripts use CUDA and NCCL (`--device auto`); pass larger `--sizes-mb` and "
        "`--model` there.",
        "",
    ]
    return "\n".join(lines)
