"""What the benchmark scripts share: statistics, machine state, run settings, the dataset, the
Llama 3 interruption mix and the fault schedules built from it, and the Young/Daly model (restart
breakdowns from a run's logs: ``bench.restarts``).

Standard library only: the training-plane scripts (.venv, torch) and the control-plane scripts
(.venv-airflow, no torch) both import it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sysconfig
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
#: Airflow's plugins folder (a shim: the control plane is the installed package).
PLUGINS = REPO / "plugins"
TRAINING_PYTHON = REPO / ".venv" / "bin" / "python"
AIRFLOW_PYTHON = REPO / ".venv-airflow" / "bin" / "python"

#: Run settings for benchmark runs: the ones the demo and the tests use (short sequences, and
#: timeouts that resolve faults in seconds on a loaded 2-core machine). On a GPU node pass larger
#: ones (model, seq_len, batch_size) on the command line; the timeouts then bound detection.
RUN_SETTINGS: dict[str, Any] = {
    "model": "tiny",
    "seq_len": 64,
    "batch_size": 4,
    "collective_timeout_s": 3.0,
    "heartbeat_timeout_s": 30.0,
    "initial_heartbeat_timeout_s": 90.0,
    "hang_timeout_s": 5.0,
    "device": "cpu",
    "eval_batches": 4,
}


# --------------------------------------------------------------------------------------------
# Statistics and machine state
# --------------------------------------------------------------------------------------------


def summarize(values: Iterable[float | None], digits: int = 4) -> dict[str, Any]:
    """``{n, min, median, max, mean, values}`` of the known values (``{n: 0}`` when none)."""
    known = [float(v) for v in values if v is not None]
    if not known:
        return {"n": 0, "values": []}
    return {
        "n": len(known),
        "min": round(min(known), digits),
        "median": round(statistics.median(known), digits),
        "max": round(max(known), digits),
        "mean": round(statistics.fmean(known), digits),
        "values": [round(v, digits) for v in known],
    }


def machine() -> dict[str, Any]:
    """The machine the figures come from."""
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gb"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    return info


class LoadMonitor:
    """Samples the 1-minute load average while a benchmark runs: other work on the machine makes
    figures noisier, and the JSON says how busy it was."""

    def __init__(self, interval_s: float = 5.0):
        self.interval_s = interval_s
        self.samples: list[float] = []
        self.started = time.time()
        self.start_load = os.getloadavg()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="load-monitor", daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "LoadMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict[str, Any]:
        return {
            "cores": os.cpu_count(),
            "loadavg_at_start": [round(x, 2) for x in self.start_load],
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
            "loadavg_1m_during": summarize(self.samples, 2),
            "started_at": datetime.fromtimestamp(self.started).astimezone().isoformat(timespec="seconds"),
            "wall_s": round(time.time() - self.started, 1),
        }


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as JSON, atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")  # keys in order: phases stay in time order
    os.replace(tmp, path)
    return path


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------------------------
# Dataset: real text (Python standard library sources) as byte tokens
# --------------------------------------------------------------------------------------------


def ensure_dataset(dst: Path, python: str | os.PathLike = TRAINING_PYTHON) -> Path:
    """A byte-token dataset at ``dst`` made by ``fsdp_resilience.training.prepare_data`` from a few stdlib
    packages (a no-op when it is there). The sampler loops over epochs, so a long run needs no
    bigger corpus."""
    dst = Path(dst)
    if (dst / "index.json").exists():
        return dst
    src = dst.parent / f"{dst.name}-corpus"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in ("json", "email", "collections", "asyncio", "unittest"):
        for f in sorted((stdlib / package).rglob("*.py")):
            out = src / package / f.relative_to(stdlib / package)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(f.read_bytes())
    subprocess.run(
        [str(python), "-m", "fsdp_resilience.training.prepare_data", str(src), str(dst), "--val-fraction", "0.1"],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    shutil.rmtree(src, ignore_errors=True)  # copies of .py files: tools that walk the repo need not see them
    return dst


def nvrx_version(python: str | os.PathLike = TRAINING_PYTHON) -> str | None:
    """The training plane's NVRx version (how spares are promoted depends on it)."""
    try:
        out = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('nvidia-resiliency-ext'))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# The Llama 3 interruption mix and fault schedules
# --------------------------------------------------------------------------------------------

#: Unexpected interruptions in 54 days of Llama 3 405B pre-training (Llama 3 paper, "The Llama 3
#: Herd of Models", 2024, Table 5): (cause, count, the paper's printed share, drill, why).
#: The counts add up to 419. The paper prints 30.1 % for faulty GPU, but 148 of 419 is 35.3 %
#: (every other row is count / 419): the counts are used as weights here.
#: Each cause maps to the drill that reproduces how it reaches the training processes.
LLAMA3_INTERRUPTIONS: tuple[tuple[str, int, float, str, str], ...] = (
    ("Faulty GPU", 148, 30.1, "sigkill", "the rank's process dies with its GPU (Xid, fell off the bus)"),
    ("GPU HBM3 memory", 72, 17.2, "oom", "uncorrectable ECC: the driver ends the process (exit 137)"),
    ("Software bug", 54, 12.9, "exception", "a transient Python/CUDA error raised in one rank"),
    ("Network switch/cable", 35, 8.4, "hang", "a collective never completes; peers time out"),
    ("Host maintenance", 32, 7.6, "node_loss", "the node is taken away: launcher and all its ranks"),
    ("GPU SRAM memory", 19, 4.5, "oom", "uncorrectable ECC: the driver ends the process (exit 137)"),
    ("GPU system processor", 17, 4.1, "sigkill", "the rank's process dies with its GPU"),
    ("NIC", 7, 1.7, "hang", "a collective never completes; peers time out"),
    ("NCCL watchdog timeouts", 7, 1.7, "hang", "a collective never completes; peers time out"),
    ("Silent data corruption", 6, 1.4, "exception", "caught by a numerics check that raises"),
    ("GPU thermal interface + sensor", 6, 1.4, "sigkill", "the rank's process dies with its GPU"),
    ("SSD", 3, 0.7, "checkpoint_crash", "the storage under the checkpoint writer fails"),
    ("Power supply", 3, 0.7, "node_loss", "the node goes down"),
    ("Server chassis", 2, 0.5, "node_loss", "the node goes down"),
    ("IO expansion board", 2, 0.5, "node_loss", "the node goes down"),
    ("Dependency", 2, 0.5, "checkpoint_crash", "an external service (storage) fails under the writer"),
    ("CPU", 2, 0.5, "node_loss", "the node goes down"),
    ("System memory", 2, 0.5, "node_loss", "the node goes down"),
)

#: Drills after which the next launcher round starts (ft_launcher respawns the workers, so the
#: drill attempt counter moves on), per restart mode.
_NEW_ROUND = {
    "layered": {"sigkill", "oom", "sigstop"},
    "injob": {"sigkill", "oom", "sigstop", "exception", "hang", "checkpoint_crash"},
}


def drill_weights(mix: Iterable[tuple[str, int, float, str, str]] = LLAMA3_INTERRUPTIONS) -> dict[str, float]:
    """Share of each drill kind in the mix (by count)."""
    totals: dict[str, int] = {}
    for _cause, count, _pct, drill, _why in mix:
        totals[drill] = totals.get(drill, 0) + count
    n = sum(totals.values())
    return {drill: count / n for drill, count in sorted(totals.items(), key=lambda kv: -kv[1])}


def apportion(n: int, weights: dict[str, float]) -> dict[str, int]:
    """``n`` faults split by ``weights`` with the largest-remainder method: the realised mix is as
    close to the weights as whole faults allow (a random draw of 10 would not be)."""
    quotas = {k: n * w for k, w in weights.items()}
    counts = {k: int(q) for k, q in quotas.items()}
    for k in sorted(quotas, key=lambda k: (-(quotas[k] - counts[k]), k))[: n - sum(counts.values())]:
        counts[k] += 1
    return {k: c for k, c in counts.items() if c}


def spread_schedule(
    kinds: list[str], *, first_step: int, last_step: int, min_gap: int, interval: int, world_size: int, seed: int
) -> list[dict[str, Any]]:
    """One drill per kind in ``kinds`` (in that order), one in each equal stretch of
    [first_step, last_step], at a seeded random step inside it, at least ``min_gap`` steps apart;
    ranks are seeded too. A ``checkpoint_crash`` fires after a save, so it moves to a
    checkpoint step."""
    rng = random.Random(seed)
    n = len(kinds)
    if n == 0:
        return []
    stretch = (last_step - first_step) / n
    if stretch < min_gap:
        raise ValueError(
            f"{n} faults need {n * min_gap} steps between {first_step} and {last_step}; "
            "train more steps or schedule fewer faults"
        )
    drills, previous = [], -min_gap
    for i, kind in enumerate(kinds):
        lo = max(int(first_step + i * stretch), previous + min_gap)
        hi = max(lo, int(first_step + (i + 1) * stretch) - min_gap // 2)
        step = rng.randint(lo, hi)
        if kind == "checkpoint_crash":
            step = math.ceil(step / interval) * interval
        drill = {"kind": kind, "step": step, "rank": rng.randrange(world_size)}
        if kind == "node_loss":
            drill = {"kind": kind, "step": step, "node": 0}
        drills.append(drill)
        previous = step
    return drills


def assign_attempts(
    drills: list[dict[str, Any]],
    restart_mode: str,
    slot_prefix: str | None = None,
    *,
    nodes: int = 1,
    procs_per_node: int = 2,
    spare_nodes: int = 0,
) -> list[dict[str, Any]]:
    """Set each drill's ``attempt`` (the launcher round it fires in) so every scheduled fault fires
    exactly once, and aim each ``node_loss`` at the last training node, ``nodes - 1``.

    Without spares the round moves on after each fault an in-job restart recovers, and starts
    over at 0 after a node loss (the control plane relaunches). With ``slot_prefix`` each drill is
    also tied to the local slot its node runs on in its launch (``node_id``): a relaunch replays
    steps, and a drill must not fire again there. The local backend takes the free healthy slots
    in order and the ladder quarantines the lost node's slot, so launch L runs node i < nodes - 1
    on slot i and node nodes - 1 on slot nodes - 1 + L.

    With ``spare_nodes`` a node loss is an in-job restart (a spare takes the node's place), and
    which launchers train is the rendezvous's choice: NVRx 0.4.1 was seen promoting a refilled
    spare before the launch's own, and swapping a spare in at an in-job restart after a rank's
    fault (that node then parked), which starts the restart round over or does not advance it.
    So with spares every drill fires ``once``, on whatever round first reaches it (``attempt``
    null), and a node loss takes ``node`` null: the training node holding the highest rank off
    node 0 (which hosts the rendezvous store, which no spare covers) when its step comes.
    """
    last = nodes - 1
    if nodes < 2 and spare_nodes:
        raise ValueError("spares need nodes >= 2: node 0 hosts the rendezvous store, so its loss ends the launch")

    def slot(node: int, launch: int) -> str:
        return f"{slot_prefix}{node if node < last else last + launch}"

    attempt, launch = 0, 0
    out = []
    for d in sorted(drills, key=lambda d: d["step"]):
        d = {**d, "attempt": attempt}
        if d["kind"] == "node_loss":
            d["node"] = last
        if spare_nodes:
            # Once, on any round, on whichever node trains then: see above.
            out.append({**d, "attempt": None, "once": True, **({"node": None} if d["kind"] == "node_loss" else {})})
            continue
        if slot_prefix is not None:
            d["node_id"] = slot(d["node"] if d["kind"] == "node_loss" else d["rank"] // procs_per_node, launch)
        out.append(d)
        if d["kind"] == "node_loss":
            attempt, launch = 0, launch + 1
        elif d["kind"] in _NEW_ROUND.get(restart_mode, set()):
            attempt += 1
    return out


# --------------------------------------------------------------------------------------------
# Checkpoint interval: Young/Daly, and a first-order ETTR model fed with measured costs
# --------------------------------------------------------------------------------------------


def young_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Young (1974): the checkpoint interval that minimises lost time, sqrt(2 * C * MTBF)."""
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), higher order: sqrt(2CM)·[1 + (1/3)·sqrt(C/2M) + (1/9)·(C/2M)] − C, for C < 2M."""
    c, m = save_cost_s, mtbf_s
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def ettr_model(
    interval_s: float,
    *,
    save_cost_s: float,
    mtbf_s: float,
    restart_s: float,
    commit_s: float,
    loop_overhead: float = 0.0,
) -> float:
    """Expected ETTR at a checkpoint interval, to first order.

    Fault-free, a fraction ``loop_overhead`` of the time and ``save_cost_s`` per interval are not
    training. Each fault (one per ``mtbf_s``) costs ``restart_s`` (detect, restart, restore) plus
    the progress since the newest *committed* checkpoint: on average half an interval plus the
    commit latency ``commit_s`` (an async save commits that long after it starts).
    """
    fault_free = 1.0 - loop_overhead - save_cost_s / interval_s
    per_fault = restart_s + interval_s / 2.0 + commit_s
    return max(0.0, fault_free * (1.0 - per_fault / mtbf_s))
