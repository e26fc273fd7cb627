"""docs/benchmarks.md, section 3: goodput under chaos (ETTR, badput, the Young/Daly model, the mix)."""

from __future__ import annotations

from typing import Any

from bench.summarize.formats import fmt_load, fmt_s, fmt_stat, md_table


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


def chaos_section(summary: dict[str, Any]) -> list[str]:
    """### 3. Goodput under chaos, with the run with a hot spare side by side."""
    chaos = summary.get("chaos") or {}
    lines: list[str] = []
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
    return lines
