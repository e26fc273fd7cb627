"""docs/benchmarks.md, section 1: the checkpoint stall (training plane)."""

from __future__ import annotations

from typing import Any

from bench.summarize.formats import METHOD_HOW, METHOD_NAMES, fmt_load, fmt_s, fmt_stat, md_table, median_of


def stall_section(tp: dict[str, Any]) -> list[str]:
    """### 1. Checkpoint stall: blocking time per save, writer interference, where the time goes."""
    lines: list[str] = []
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
                _next_step(s["methods"]),
            )
            for s in stall["sizes"]
        ]
        keys = list(stall["sizes"][0]["methods"]["nvrx_async"]["breakdown_median_s"])
        lines += [
            "Where the project's blocking time goes (medians; snapshot: starting the copy in save(), snapshot "
            "wait: what was left of it before the next optimizer step), how long until the save is committed, "
            "the warm-up save at each size (new snapshot buffers; at the first size also the writer process "
            "still starting), which the figures above leave out, and the model's next forward and backward "
            "with the copy running beside it, against the same after the memcpy floor's save (what the overlap "
            "costs the step):",
            "",
        ]
        lines += md_table(
            (
                "state",
                "state-dict collection",
                *[k.replace("_s", "") for k in keys],
                "save → committed",
                "warm-up save",
                "next forward + backward: with the copy beside it (after the floor's copy)",
            ),
            parts,
        )
        lines += ["![checkpoint stall](/bench/results/stall.png)", ""]
    return lines


def _next_step(methods: dict[str, Any]) -> str:
    """The next forward and backward after the project's save, and after the floor's."""
    project, floor = (median_of(methods[m].get("next_step_s")) for m in ("nvrx_async", "memcpy"))
    if project is None:
        return "—"
    return f"{fmt_s(project)} ({fmt_s(floor)})" if floor is not None else fmt_s(project)
