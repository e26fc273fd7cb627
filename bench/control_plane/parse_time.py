"""DAG parse time of dags/ with torch blocked: plugin modules imported fresh for each parse, and
already imported (as Airflow's DAG processor pre-imports a DAG file's imports before it forks)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, summarize


def bench_parse(trials: int) -> dict[str, Any]:
    sys.modules.setdefault("torch", None)  # any import of torch now fails: the control plane must not need it
    t0 = time.perf_counter()
    from airflow.dag_processing.dagbag import DagBag

    airflow_import = time.perf_counter() - t0
    ours = ("fsdp_resilience", "training")

    def parse(fresh: bool) -> tuple[float, dict[str, float], DagBag]:
        if fresh:
            for name in [m for m in sys.modules if m.split(".")[0] in ours]:
                del sys.modules[name]
        t = time.perf_counter()
        bag = DagBag(dag_folder=str(REPO / "dags"))
        elapsed = time.perf_counter() - t
        if bag.import_errors:
            raise RuntimeError(f"DAG import errors: {bag.import_errors}")
        per_file = {Path(s.file).name: s.duration.total_seconds() for s in bag.dagbag_stats}
        return elapsed, per_file, bag

    parse(fresh=True)  # warm-up: Airflow's own lazy imports
    runs: dict[str, list[tuple[float, dict[str, float]]]] = {"fresh_imports": [], "pre_imported": []}
    for _ in range(trials):
        for mode in runs:
            elapsed, per_file, bag = parse(fresh=mode == "fresh_imports")
            runs[mode].append((elapsed, per_file))
    files = sorted(runs["fresh_imports"][0][1])
    return {
        "dags": sorted(bag.dag_ids),
        "trials": trials,
        "airflow_import_s": round(airflow_import, 3),
        "torch_blocked": True,
        **{
            mode: {
                "dagbag_s": summarize(r[0] for r in rs),
                "per_file_s": {f: summarize(r[1].get(f) for r in rs) for f in files},
            }
            for mode, rs in runs.items()
        },
    }
