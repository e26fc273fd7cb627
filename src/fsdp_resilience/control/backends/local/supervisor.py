"""The supervisor: parent of one local job's launchers, and its failure policy.

``LocalProcessBackend.submit`` runs ``python -m fsdp_resilience.control.backends.local.supervisor
--state-dir DIR --job NAME``, which forks once and exits (the submitter reaps it, so it keeps no
child). The forked supervisor, adopted by init, starts the node launchers, each in its own session,
waits for them (no launcher is left a zombie), records their exit codes, starts the spares
``add_spare`` appends, and acts like a Kubernetes Job controller's failure policy: once the job has
failed (``judge_job``), the other nodes get ``failure_grace_s`` to end by themselves and are then
stopped; so are spares still parked once no node trains any more. To debug it, run
``supervisor_main(["--state-dir", DIR, "--job", NAME, "--foreground"])`` on a submitted job record.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from fsdp_resilience.control.backends.base import JobStatus
from fsdp_resilience.control.backends.evidence import trained_nodes
from fsdp_resilience.control.backends.local.processes import (
    ExitWaiter,
    process_start_ticks,
    signal_processes,
    stop_job_processes,
    stop_nodes,
    tagged_processes,
)
from fsdp_resilience.control.backends.local.state import StateStore
from fsdp_resilience.control.backends.local.verdict import judge_job

#: The supervisor's failure-policy clock; a launcher's exit wakes it at once (where Linux has pidfds).
SUPERVISOR_POLL_S = 0.5


def supervisor_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="local-backend-supervisor",
        description="Start and watch the node launchers of one local job (started by LocalProcessBackend.submit).",
    )
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--foreground", action="store_true", help="do not fork (debugging)")
    args = parser.parse_args(argv)
    if not args.foreground and os.fork() > 0:
        os._exit(0)  # the submitter reaps this parent; the child is adopted by init
    return supervise(Path(args.state_dir), args.job)


def supervise(state_dir: Path, job_name: str) -> int:
    store = StateStore(state_dir)
    record = store.read_job(job_name)
    if record is None:
        print(f"no job {job_name} under {state_dir}", file=sys.stderr)
        return 1
    me, my_ticks = os.getpid(), process_start_ticks(os.getpid())
    record = store.update_job(
        job_name, lambda r: r["supervisor"].update(pid=me, start_ticks=my_ticks, started_at=time.time())
    )
    if record["cancel"]:
        store.update_job(job_name, lambda r: r.update(error="cancelled before it started"))
        return 0

    procs: dict[int, subprocess.Popen] = {}
    launched: set[int] = set()  # every node index this supervisor started, or tried to
    exits = ExitWaiter()

    def launch(node: dict[str, Any]) -> dict[str, Any]:
        launched.add(node["index"])
        with open(node["log_path"], "ab") as log:
            # Own session per launcher: cancel can signal the node as a group, and the
            # launcher's own SIGTERM handling (pod deletion) applies unchanged.
            proc = subprocess.Popen(
                node["command"],
                cwd=record["cwd"],
                env={**os.environ, **node["env"]},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        procs[node["index"]] = proc
        exits.add(node["index"], proc)
        return {
            "pid": proc.pid,
            "pgid": proc.pid,
            "start_ticks": process_start_ticks(proc.pid),
            "started_at": time.time(),
        }

    def record_started(started: dict[int, dict[str, Any]]) -> Callable[[dict[str, Any]], None]:
        def change(r: dict[str, Any]) -> None:
            for index, fields in started.items():
                r["nodes"][index].update(fields)

        return change

    started: dict[int, dict[str, Any]] = {}
    try:
        for node in record["nodes"]:
            started[node["index"]] = launch(node)
    except OSError as e:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        error = f"could not start a launcher: {e}"
        store.update_job(job_name, lambda r: r.update(error=error))
        print(error, file=sys.stderr)
        return 1

    record = store.update_job(job_name, record_started(started))
    if record["cancel"]:  # cancelled while we were starting: cancel saw no launcher to stop
        stop_job_processes(record, grace_s=record["cancel_grace_s"])
    print(f"supervisor {me}: started {len(procs)} launcher(s): { {i: p.pid for i, p in procs.items()} }", flush=True)

    def reap() -> bool:
        """Record the exit of every launcher that ended; whether any did."""
        any_ended = False
        for index, proc in list(procs.items()):
            rc = proc.poll()
            if rc is None:
                continue
            any_ended = True
            del procs[index]
            exits.forget(index)
            # Whatever the launcher left behind (it reaps its session itself unless it was killed).
            signal_processes(tagged_processes(job_name, index), signal.SIGKILL)
            now = time.time()

            def ended(r: dict[str, Any], index: int = index, rc: int = rc, now: float = now) -> None:
                r["nodes"][index].update(exit_code=rc, ended_at=now)

            store.update_job(job_name, ended)
            print(f"supervisor {me}: node {index} exited {rc}", flush=True)
        return any_ended

    def pending(r: dict[str, Any]) -> list[dict[str, Any]]:
        """Nodes add_spare appended that this supervisor has not started yet."""
        return [n for n in r["nodes"] if n["pid"] is None and n["index"] not in launched and not n.get("start_error")]

    def start_added() -> bool:
        """Start the spares ``add_spare`` appended to the record since the last poll; whether any."""
        new = pending(store.read_job(job_name))
        if not new:
            return False
        started: dict[int, dict[str, Any]] = {}
        refused: dict[int, str] = {}
        for node in new:
            if node["stopped_by"]:  # its slot was quarantined, or the job cancelled, before it started
                launched.add(node["index"])
                refused[node["index"]] = f"not started: stopped by {node['stopped_by']} before it started"
                continue
            try:
                started[node["index"]] = launch(node)
            except OSError as e:
                refused[node["index"]] = f"could not start its launcher: {e}"

        def change(r: dict[str, Any]) -> None:
            record_started(started)(r)
            for index, why in refused.items():
                r["nodes"][index]["start_error"] = why

        r = store.update_job(job_name, change)
        print(
            f"supervisor {me}: added node(s) started { {i: f['pid'] for i, f in started.items()} }"
            + (f", not started {refused}" if refused else ""),
            flush=True,
        )
        # Marked to stop (quarantine, cancel) between our read and our record: stop them now.
        stop_now = [i for i in started if r["nodes"][i]["stopped_by"] or r["cancel"]]
        if stop_now:
            stop_job_processes(r, grace_s=r["cancel_grace_s"], nodes=stop_now, reap=reap)
        return True

    def finished(r: dict[str, Any]) -> None:
        # Under the lock that add_spare appends under: once this is set, it adds nothing more.
        if not pending(r):
            r["supervisor"]["ended_at"] = time.time()

    failed_at: float | None = None  # when the job could no longer train (the rule of judge_job)
    parked_at: float | None = None  # since when only spares that never trained are left running
    verdict: JobStatus | None = None
    while True:
        exits.wait(SUPERVISOR_POLL_S)
        if reap() | start_added():
            record = store.read_job(job_name)
            verdict = judge_job(store, record)
            now = time.time()
            if verdict.state == "failed":
                failed_at = failed_at or now
            standby = {n["index"] for n in record["nodes"] if n.get("standby")}
            trained = trained_nodes(record["run_dir"], record["launch_id"]) if standby else set()
            going = [n.index for n in verdict.nodes if n.state in ("pending", "running")]
            parked = bool(going) and all(i in standby and i not in trained for i in going)
            parked_at = (parked_at or now) if parked else None
        if not procs:
            record = store.update_job(job_name, finished)
            if record["supervisor"].get("ended_at"):
                break
            continue
        if failed_at is not None and time.time() - failed_at > record["failure_grace_s"]:
            # The Job failure policy: the launch cannot succeed any more (a node that is no mere
            # spare failed, or too few nodes are left to train); stop the others.
            why = f"the failure policy ({verdict.message.split(': ')[0]})"
            stop_nodes(store, job_name, sorted(procs), why, reap)
        elif parked_at is not None and time.time() - parked_at > record["failure_grace_s"]:
            # No node trains any more, and a spare cannot train on its own: the launch is over.
            why = "the supervisor (no node left training; a spare on its own cannot train)"
            stop_nodes(store, job_name, sorted(procs), why, reap)
    print(f"supervisor {me}: all launchers ended", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(supervisor_main())
