"""A real Airflow deployment for tests, in a temp dir: PostgreSQL (Debian's server) as the metadata
database, then ``airflow api-server``, ``scheduler``, ``dag-processor`` and ``triggerer`` as
separate processes on 127.0.0.1, with LocalExecutor, this repo's dags/ and plugins/.

Nothing here reuses the dag.test() set-up of conftest.py: each component gets an environment built
from scratch (no unit-test mode, no SQLite), as a deployment would. Every process is ours by PID
and is stopped by PID: SIGINT, then SIGTERM, then SIGKILL as a last resort; PostgreSQL with
``pg_ctl stop -m fast``. The logs of every component stay under the temp dir (``logs/``).
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
AIRFLOW = Path(sys.executable).with_name("airflow")
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
#: Debian's chromium; Playwright drives it (``playwright install`` cannot download browsers here).
CHROMIUM = "/usr/bin/chromium"


class StackError(RuntimeError):
    """The stack could not start or answer; the message carries the components' log tails."""


# ---------------------------------------------------------------------------------------------
# What the stack needs from the machine


def postgres_bin() -> Path | None:
    """The newest Debian PostgreSQL server's bin dir (15 on this image), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    return Path(found[-1]).parent if found else None


def missing_for_stack() -> str | None:
    """One line naming what the stack needs and this machine lacks (and how to get it), or None."""
    if postgres_bin() is None or shutil.which("pg_isready", path=str(postgres_bin())) is None:
        return "PostgreSQL server binaries (/usr/lib/postgresql/*/bin): apt-get install postgresql"
    if os.geteuid() == 0 and not _has_user("postgres"):
        return "the postgres system user (initdb refuses root): apt-get install postgresql"
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        return (
            "psycopg2 in .venv-airflow: .venv-airflow/bin/pip install -c requirements/constraints-airflow.txt "
            "'.[test-deployment]'"
        )
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "runuser (util-linux), to run PostgreSQL as the postgres user"
    return None


def missing_for_browser() -> str | None:
    """One line naming what the browser test needs and this machine lacks, or None."""
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM}: apt-get install chromium"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return (
            "playwright in .venv-airflow: .venv-airflow/bin/pip install -c requirements/constraints-airflow.txt "
            "'.[test-deployment]' (no `playwright install`: it drives Debian's chromium)"
        )
    return None


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout_s: float,
    interval_s: float = 1.0,
    on_timeout: Callable[[], str] = lambda: "",
) -> Any:
    """Poll ``check`` until it returns something truthy (returned); StackError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise StackError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})\n{on_timeout()}")
        time.sleep(interval_s)


# ---------------------------------------------------------------------------------------------
# Processes


class Process:
    """One long-running process of the stack, in a session of its own (a Ctrl-C to pytest does not
    reach it; the stack stops it), its output in ``log``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path):
        self.name, self.log = name, log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash of its container would: the process and what it started (a
        triggerer's trigger runner and log server) get no chance to hand anything back."""
        members = _session_members(self.pid)
        if self.alive():
            self.popen.kill()
        self.popen.wait(timeout=30)
        for pid in members + _session_members(self.pid):
            _kill_pid(pid, signals=(signal.SIGKILL,))

    def stop(self, grace_s: float = 30.0) -> str:
        """SIGINT (the components' clean shutdown), then SIGTERM, then SIGKILL, each by this PID;
        then any process it left in its session, by theirs. Returns how it ended."""
        how = "already exited"
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            if not self.alive():
                break
            os.kill(self.pid, sig)
            how = f"stopped by {sig.name}"
            try:
                self.popen.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        left = _session_members(self.pid)
        for pid in left:  # e.g. a task process the scheduler's executor had not reaped
            _kill_pid(pid)
        return how + (f"; killed {len(left)} process(es) it left behind" if left else "")

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


def _session_members(sid: int) -> list[int]:
    """PIDs of live processes in session ``sid`` (our components start their own sessions)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session, ...
            found.append(int(stat.parent.name))
    return found


def _kill_pid(pid: int, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGKILL)) -> None:
    for sig in signals:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if not Path(f"/proc/{pid}").exists() or _state(pid) == "Z":
                return
            time.sleep(0.2)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# PostgreSQL


class Postgres:
    """A throwaway PostgreSQL cluster, listening only on a unix socket. Durability is off (fsync,
    synchronous_commit): the database lives as long as the test.

    Its folder is a fresh one of its own under /tmp, owned by the postgres user when we are root:
    pytest's temp folders are private to root, and loosening them would race other pytest runs
    that tighten them again. A short path, too: a socket path is at most 107 bytes."""

    def __init__(self, log: Path):
        self.bin = postgres_bin()
        self.root: Path | None = None
        self.port = free_port()  # names the socket file (.s.PGSQL.<port>); nothing listens on TCP
        self.log = log
        self.process: Process | None = None

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        return self.root / "socket"

    def _as_postgres(self, argv: list[str]) -> list[str]:
        # initdb and postgres refuse to run as root: run them as the postgres system user.
        return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv

    def start(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="fsdp-pg-"))
        self.socket_dir.mkdir()
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            for path in (self.root, self.socket_dir):
                os.chown(path, user.pw_uid, user.pw_gid)
        subprocess.run(
            self._as_postgres(
                [
                    str(self.bin / "initdb"),
                    "-D",
                    str(self.data),
                    "-U",
                    "airflow",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ]
            ),
            check=True,
            capture_output=True,
            cwd="/",
        )
        self.process = Process(
            "postgres",
            self._as_postgres(
                [
                    str(self.bin / "postgres"),
                    "-D",
                    str(self.data),
                    "-p",
                    str(self.port),
                    "-k",
                    str(self.socket_dir),
                    "-c",
                    "listen_addresses=",
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=off",
                    "-c",
                    "full_page_writes=off",
                    "-c",
                    "max_connections=200",
                ]
            ),
            env=dict(os.environ),
            log=self.log,
            cwd=Path("/"),
        )
        wait_for("PostgreSQL to accept connections", self._ready, timeout_s=60, on_timeout=lambda: self.process.tail())
        subprocess.run(
            [str(self.bin / "createdb"), "-h", str(self.socket_dir), "-p", str(self.port), "-U", "airflow", "airflow"],
            check=True,
            capture_output=True,
        )

    def _ready(self) -> bool:
        if self.process is not None and not self.process.alive():
            raise StackError(f"postgres exited:\n{self.process.tail()}")
        return (
            subprocess.run(
                [str(self.bin / "pg_isready"), "-q", "-U", "airflow", "-h", str(self.socket_dir), "-p", str(self.port)],
                capture_output=True,
            ).returncode
            == 0
        )

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://airflow@/airflow?host={self.socket_dir}&port={self.port}"

    def stop(self) -> str:
        """``pg_ctl stop -m fast`` (then SIGTERM, SIGKILL by PID if it hangs); the folder goes too."""
        how = "never started"
        if self.process is not None and self.process.alive():
            subprocess.run(
                self._as_postgres(
                    [str(self.bin / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast", "-w", "-t", "60"]
                ),
                capture_output=True,
                cwd="/",
            )
            try:
                self.process.popen.wait(timeout=30)
                how = "stopped by pg_ctl stop -m fast"
            except subprocess.TimeoutExpired:
                how = self.process.stop(grace_s=10)
        elif self.process is not None:
            how = "already exited"
        if self.root is not None and (self.process is None or not self.process.alive()):
            shutil.rmtree(self.root, ignore_errors=True)
        return how


# ---------------------------------------------------------------------------------------------
# Airflow


class AirflowStack:
    """PostgreSQL and the four Airflow components, in ``root``. ``start()``, then ``api`` for REST
    calls (a JWT from POST /auth/token), ``restart("triggerer")``; ``stop()`` ends everything."""

    def __init__(self, root: Path, extra_env: dict[str, str] | None = None):
        self.root = root
        self.home, self.logs = root / "airflow-home", root / "logs"
        self.runs_root, self.data_root = root / "runs", root / "data"
        self.source_root = root / "sources"
        self.postgres = Postgres(self.logs / "postgres.log")
        self.api_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.api_port}"
        self.password = secrets.token_urlsafe(16)
        #: Users besides admin: a viewer (reads every DAG) and a user with no role, whom the auth
        #: manager grants no DAG at all (SimpleAuthManager's only per-DAG denial without
        #: multi-team mode): the report must answer them as Airflow's own API does.
        self.users = {"viewer": ("viewer", secrets.token_urlsafe(16)), "outsider": ("", secrets.token_urlsafe(16))}
        self.secrets = {"secret_key": secrets.token_hex(16), "jwt_secret": secrets.token_hex(32)}
        self.extra_env = extra_env or {}
        self.processes: dict[str, Process] = {}
        self.restarts: dict[str, int] = {}
        self.token: str | None = None
        self._client = None

    # -- environment ------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The components' environment, built from scratch: a few OS variables from ours, then
        only what this deployment sets."""
        keep = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME")
        env = {k: os.environ[k] for k in keep if k in os.environ}
        af = "AIRFLOW__"
        env.update(
            {
                "AIRFLOW_HOME": str(self.home),
                f"{af}CORE__DAGS_FOLDER": str(REPO / "dags"),
                f"{af}CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
                f"{af}CORE__LOAD_EXAMPLES": "False",
                f"{af}CORE__EXECUTOR": "LocalExecutor",
                f"{af}DATABASE__SQL_ALCHEMY_CONN": self.postgres.url,
                # A real login: the admin user's password in a file of ours (POST /auth/token checks it).
                f"{af}CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(
                    ["admin:admin"] + [f"{name}:{role}" for name, (role, _) in self.users.items()]
                ),
                f"{af}CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
                f"{af}API__HOST": "127.0.0.1",
                f"{af}API__PORT": str(self.api_port),
                # Without it, task processes send their execution-API calls to localhost:8080.
                f"{af}API__BASE_URL": self.base_url,
                f"{af}API__WORKERS": "1",
                # One secret for all: the scheduler signs the task processes' execution-API tokens, and
                # the API server checks them.
                f"{af}API__SECRET_KEY": self.secrets["secret_key"],
                f"{af}API_AUTH__JWT_SECRET": self.secrets["jwt_secret"],
                f"{af}LOGGING__BASE_LOG_FOLDER": str(self.logs / "tasks"),
                f"{af}LOGGING__DAG_PROCESSOR_CHILD_PROCESS_LOG_DIRECTORY": str(self.logs / "dag-processor"),
                # A 2-core machine shared with others: one parser, a handful of task slots, no
                # re-parsing of files that do not change during the test.
                f"{af}CORE__PARALLELISM": "6",
                f"{af}DAG_PROCESSOR__PARSING_PROCESSES": "1",
                f"{af}DAG_PROCESSOR__REFRESH_INTERVAL": "600",
                f"{af}DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
                f"{af}DAG_PROCESSOR__PRINT_STATS_INTERVAL": "600",
                f"{af}SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.5",
                # Slow is not dead on a loaded machine: generous parse and API timeouts.
                f"{af}CORE__DAGBAG_IMPORT_TIMEOUT": "120",
                f"{af}DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "180",
                f"{af}WORKERS__EXECUTION_API_TIMEOUT": "30",
                # A killed triggerer's triggers go to a live one after this long without a heartbeat
                # (default 30 s); a live one heartbeats every 5 s.
                f"{af}TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "20",
                # What the DAGs need: the local backend's roots and the training environment.
                "FSDP_RUNS_ROOT": str(self.runs_root),
                "FSDP_DATA_ROOT": str(self.data_root),
                "FSDP_SOURCE_ROOT": str(self.source_root),
                "FSDP_DEFAULT_BACKEND": "local",
                "TRAINING_PYTHON": str(REPO / ".venv" / "bin" / "python"),
            }
        )
        env.update(self.extra_env)
        return env

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        for path in (self.home, self.logs, self.runs_root, self.data_root, self.source_root):
            path.mkdir(parents=True, exist_ok=True)
        passwords = {"admin": self.password, **{name: p for name, (_, p) in self.users.items()}}
        (self.home / "passwords.json").write_text(json.dumps(passwords))
        self.postgres.start()
        migrate = subprocess.run(
            [str(AIRFLOW), "db", "migrate"], env=self.env(), cwd=self.root, capture_output=True, text=True
        )
        (self.logs / "db-migrate.log").write_text(migrate.stdout + migrate.stderr)
        if migrate.returncode != 0:
            raise StackError(f"airflow db migrate failed:\n{(migrate.stdout + migrate.stderr)[-4000:]}")
        for name in COMPONENTS:
            self.start_component(name)
        wait_for("the API server", self._api_up, timeout_s=180, on_timeout=self.tails)
        self.login()
        wait_for(
            "scheduler, triggerer and dag-processor heartbeats",
            self._healthy,
            timeout_s=180,
            interval_s=2,
            on_timeout=self.tails,
        )

    def start_component(self, name: str) -> Process:
        n = self.restarts.get(name, 0)
        log = self.logs / (f"{name}.log" if n == 0 else f"{name}.{n}.log")
        # The scheduler's and triggerer's log servers bind every interface (Airflow 3.3 hard-codes
        # the host); they are for API servers on other machines, and ours reads the log folder.
        serve_logs = ["--skip-serve-logs"] if name in ("scheduler", "triggerer") else []
        self.processes[name] = Process(name, [str(AIRFLOW), name, *serve_logs], self.env(), log, cwd=self.root)
        return self.processes[name]

    def kill(self, name: str) -> None:
        """SIGKILL one component (a crash: it hands nothing back)."""
        self.processes[name].kill()

    def restart(self, name: str) -> Process:
        """A new process of component ``name`` (after ``kill`` or a clean stop)."""
        old = self.processes[name]
        if old.alive():
            old.stop()
        self.restarts[name] = self.restarts.get(name, 0) + 1
        return self.start_component(name)

    def stop(self) -> dict[str, str]:
        """Every component by its PID, the API server last (the others talk to it), then PostgreSQL."""
        ended = {}
        for name in ("scheduler", "triggerer", "dag-processor", "api-server"):
            if name in self.processes:
                ended[name] = self.processes[name].stop()
        if self._client is not None:
            self._client.close()
        ended["postgres"] = self.postgres.stop()
        return ended

    def tails(self, lines: int = 40) -> str:
        """The end of every component's log (and PostgreSQL's), for a failure message."""
        parts = []
        for log in sorted(self.logs.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"----- {log.name} (last {len(text)} lines) -----\n" + "\n".join(text))
        return "\n".join(parts)

    # -- REST -----------------------------------------------------------------------------------

    def _api_up(self) -> bool:
        import httpx

        proc = self.processes["api-server"]
        if not proc.alive():
            raise StackError(f"the API server exited:\n{proc.tail()}")
        try:
            return httpx.get(f"{self.base_url}/api/v2/monitor/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def _healthy(self) -> bool:
        for name, proc in self.processes.items():
            if not proc.alive():
                raise StackError(f"{name} exited:\n{proc.tail()}")
        health = self.get("/api/v2/monitor/health")
        return all(
            (health.get(part) or {}).get("status") == "healthy"
            for part in ("metadatabase", "scheduler", "triggerer", "dag_processor")
        )

    def token_for(self, username: str) -> str:
        """A JWT the way a client gets one: POST /auth/token with the user's password."""
        import httpx

        password = self.password if username == "admin" else self.users[username][1]
        response = httpx.post(
            f"{self.base_url}/auth/token", json={"username": username, "password": password}, timeout=60
        )
        if response.status_code != 201:
            raise StackError(f"POST /auth/token as {username} answered {response.status_code}: {response.text}")
        return response.json()["access_token"]

    def login(self) -> str:
        """Log the stack's client in as admin."""
        import httpx

        self.token = self.token_for("admin")
        self._client = httpx.Client(
            base_url=self.base_url, timeout=60, headers={"Authorization": f"Bearer {self.token}"}
        )
        return self.token

    def request(self, method: str, path: str, **kwargs: Any):
        """The raw response (for tests of status codes)."""
        return self._client.request(method, path, **kwargs)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise StackError(f"{method} {path} answered {response.status_code}: {response.text[:2000]}")
        return response.json() if response.content else None

    def get(self, path: str, **params: Any) -> Any:
        return self.call("GET", path, params=params or None)

    # -- DAGs and runs --------------------------------------------------------------------------

    def wait_for_dags(self, *dag_ids: str, timeout_s: float = 240) -> None:
        """Until the dag-processor has parsed and serialized each DAG, and none has import errors."""

        def parsed() -> bool:
            errors = self.get("/api/v2/importErrors")
            if errors["total_entries"]:
                raise StackError(f"DAG import errors: {json.dumps(errors['import_errors'], indent=1)[:4000]}")
            return all(self.request("GET", f"/api/v2/dags/{d}/details").status_code == 200 for d in dag_ids)

        wait_for(f"DAGs {', '.join(dag_ids)}", parsed, timeout_s=timeout_s, interval_s=2, on_timeout=self.tails)

    def unpause(self, dag_id: str) -> None:
        self.call("PATCH", f"/api/v2/dags/{dag_id}", json={"is_paused": False})

    def trigger(self, dag_id: str, conf: dict[str, Any], run_id: str | None = None):
        """POST a DAG run; the raw response (201, or 400 with the params' schema message)."""
        body: dict[str, Any] = {"logical_date": None, "conf": conf}
        if run_id:
            body["dag_run_id"] = run_id
        return self.request("POST", f"/api/v2/dags/{dag_id}/dagRuns", json=body)

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"]

    def wait_for_run(self, dag_id: str, run_id: str, timeout_s: float) -> str:
        """Until the run ends; its final state."""
        return wait_for(
            f"{dag_id} run {run_id} to end",
            lambda: (s := self.run_state(dag_id, run_id)) in ("success", "failed") and s,
            timeout_s=timeout_s,
            interval_s=2,
            on_timeout=lambda: f"task states: {self.task_states(dag_id, run_id)}\n{self.tails()}",
        )

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        tis = self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances", limit=100)["task_instances"]
        return {ti["task_id"]: ti["state"] for ti in tis}

    def task_state(self, dag_id: str, run_id: str, task_id: str) -> str | None:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}")["state"]

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}")["value"]

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        """A task's log as the UI shows it (its lines' events, joined)."""
        log = self.get(
            f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}", full_content="true"
        )
        content = log.get("content")
        if not isinstance(content, list):
            return str(content)
        lines = []
        for entry in content:  # structured entries: the message, then its fields (an error's detail)
            if isinstance(entry, dict):
                rest = {k: v for k, v in entry.items() if k not in ("event", "timestamp", "level", "logger")}
                lines.append(f"{entry.get('event', '')} {json.dumps(rest, default=str) if rest else ''}".rstrip())
            else:
                lines.append(str(entry))
        return "\n".join(lines)

    def trigger_logs(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> dict[int, list[dict]]:
        """What each triggerer wrote for a deferred task, by triggerer job id: the triggerer keeps
        a log file per job (``attempt=N.log.trigger.<job id>.log``) in the deployment's log folder."""
        folder = self.logs / "tasks" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        found = {}
        for path in folder.glob(f"attempt={try_number}.log.trigger.*.log"):
            job_id = int(path.name.rsplit(".", 2)[-2])
            found[job_id] = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
        return found

    def asset_events(self, **filters: Any) -> list[dict[str, Any]]:
        return self.get("/api/v2/assets/events", limit=100, **filters)["asset_events"]
