"""`make demo`: a local 2-rank training run on real text, with one injected fault per restart layer.

1. stage data: the Python standard library's sources -> byte-level token shards (prepare_data);
2. train: `python -m fsdp_resilience.training.launch` with restart_mode=layered, 2 CPU ranks (gloo), and drills
   - an exception in rank 1 at step 15         -> recovered in-process (same PIDs)
   - SIGKILL of rank 0 at step 35              -> recovered by ft_launcher (in-job restart)
3. evaluate the newest committed checkpoint in one process (a different world size);
4. print where the run dir, the events log and the evaluation are, and what each layer did.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from fsdp_resilience.training.contract import CheckpointCatalog, Event, RunConfig, final_status, read_events


def stage(root: Path) -> Path:
    data = root / "data" / "python-stdlib"
    if not (data / "index.json").exists():
        src = sysconfig.get_paths()["stdlib"]
        subprocess.run(
            [
                sys.executable,
                "-m",
                "fsdp_resilience.training.prepare_data",
                src,
                str(data),
                "--max-bytes",
                str(8 << 20),
            ],
            check=True,
        )
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_resilience.training.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--root", default="runs", help="where data and runs go (default: ./runs)")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    data = stage(root)

    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    cfg = RunConfig(
        run_id=run_id,
        run_dir=str(root / run_id),
        dataset_dir=str(data),
        model="tiny",
        nodes=1,
        procs_per_node=2,
        steps=args.steps,
        checkpoint_interval=10,
        keep_checkpoints=3,
        restart_mode="layered",
        max_restarts=2,
        collective_timeout_s=3.0,
        heartbeat_timeout_s=30.0,
        hang_timeout_s=15.0,
        device="cpu",
        faults=({"kind": "exception", "step": 15, "rank": 1}, {"kind": "sigkill", "step": 35, "rank": 0}),
    )
    cfg_path = root / f"{run_id}.json"
    cfg_path.write_text(cfg.to_json())
    print(
        f"[demo] training {run_id}: 2 ranks, {cfg.steps} steps, drills: "
        + ", ".join(f"{f.kind}@step{f.step}/rank{f.rank}" for f in cfg.faults),
        flush=True,
    )
    launch_log = root / f"{run_id}.launch.log"
    print(f"[demo] launcher output (ft_launcher, NVRx, workers) goes to {launch_log}", flush=True)
    t0 = time.time()
    with open(launch_log, "w") as log:
        rc = subprocess.run(
            [sys.executable, "-m", "fsdp_resilience.training.launch", "--config", str(cfg_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
        ).returncode
    wall = time.time() - t0
    if rc == 0:
        subprocess.run(
            [
                sys.executable,
                "-W",
                "ignore",
                "-m",
                "fsdp_resilience.training.evaluate",
                "--config",
                str(cfg.layout.config),
            ],
            check=True,
        )
    else:
        print("".join(launch_log.read_text().splitlines(keepends=True)[-40:]))

    events = read_events(cfg.layout.events)
    print("\n[demo] what happened")
    for r in events:
        if r["event"] in (Event.FAULT_INJECTED.value, Event.RESTART_END.value, Event.CHECKPOINT_SKIP.value):
            detail = {k: r[k] for k in ("kind", "step", "layer", "latency_s", "checkpoint_id") if k in r}
            print(f"  rank {r.get('rank', '-')} pid {r['pid']}: {r['event']} {detail}")
    steps = [r for r in events if r["event"] == Event.STEP.value]
    if steps:
        print(
            f"  loss {steps[0]['loss']:.3f} at step {steps[0]['step']} -> {steps[-1]['loss']:.3f} at step "
            f"{steps[-1]['step']}"
        )
    latest = CheckpointCatalog(cfg.run_dir).latest()
    final = final_status(cfg.run_dir) or {}
    print(
        f"  final: {final.get('failure_class')} (exit {rc}) in {wall:.0f}s; newest committed checkpoint: "
        f"{latest.checkpoint_id if latest else None}"
    )
    print("\n[demo] where things are")
    print(f"  run dir:   {cfg.run_dir}")
    print(f"  events:    {cfg.layout.events}")
    print(f"  eval:      {cfg.layout.eval_result}" + ("" if cfg.layout.eval_result.exists() else " (not written)"))
    print(f"  logs:      {cfg.layout.logs} and {launch_log}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
