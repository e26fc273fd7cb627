"""docs/benchmarks.md: the Markdown of the latest figures, a pure function of the summary JSON
(standard library only), so a test can check that the committed page matches the committed JSON."""

from __future__ import annotations

from typing import Any

from bench.summarize.formats import fmt_met, fmt_when, md_table
from bench.summarize.lanes import lane_label
from bench.summarize.sections.chaos import chaos_section
from bench.summarize.sections.control_plane import control_plane_section
from bench.summarize.sections.evaluation import evaluation_section
from bench.summarize.sections.recovery import recovery_section
from bench.summarize.sections.scale import scale_section
from bench.summarize.sections.stall import stall_section
from bench.summarize.targets import targets


def render_markdown(summary: dict[str, Any]) -> str:
    tp = summary.get("training_plane") or {}
    cp = summary.get("control_plane") or {}
    chaos = summary.get("chaos") or {}
    tp07 = summary.get("training_plane_nvrx07") or {}
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
        + (
            "; the recovery rows"
            + (", the spare takeover and spares used up" if tp07.get("spares_used_up") else " and the spare takeover")
            + f" also on {lane_label(tp07)} (tests/nvrx07/lane.sh --bench)"
            if tp07
            else ""
        )
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

    lines += stall_section(tp)
    lines += recovery_section(tp, cp, summary.get("training_plane_nvrx07"))
    lines += chaos_section(summary)
    lines += control_plane_section(cp)
    lines += evaluation_section(tp)
    lines += scale_section(cp)

    lines += [
        "### Reproduce",
        "",
        "```sh",
        "make bench          # everything, ≤ 30 min on 2 cores: bench/results/ (latest.json and the plots are",
        "                    # committed) and this table, docs/benchmarks.md",
        "make bench-quick    # smoke run of the same scripts, under a minute: bench/results/quick/",
        ".venv/bin/python -m bench.training_plane --sizes-mb 50,200,1000 --trials 5   # one part, any sizes",
        "python3 -m bench.run --only training_plane_nvrx07   # recovery, spare takeover, spares used up on NVRx 0.7",
        ".venv-airflow/bin/python -m bench.chaos --duration-s 600 --mtbf-s 60 --seed 1234",
    ]
    if summary.get("chaos_spares") or cp.get("spare"):
        lines += [
            ".venv-airflow/bin/python -m bench.chaos --duration-s 480 --spare-nodes 1   # the run with a hot spare",
            "python3 -m bench.run --only spare,chaos,chaos_spares   # some parts again, merged into the rest",
        ]
    if tp.get("spares_used_up") or tp07.get("spares_used_up"):
        lines += ["python3 -m bench.run --only spares_used_up   # a node loss with the spares used up, both lanes"]
    if cp.get("scale"):
        lines += [
            "python3 -m bench.run --only scale   # the EKS backend at 16 to 1,024 kwok nodes (about 10 min)",
            ".venv-airflow/bin/python -m bench.control_plane --only scale --scale-sizes 64,256   # other sizes",
        ]
    lines += [
        "```",
        "",
        "On a GPU node the same scripts use CUDA and NCCL (`--device auto`); pass larger `--sizes-mb` and "
        "`--model` there.",
        "",
    ]
    return "\n".join(lines)
