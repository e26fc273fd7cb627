"""The DAGs in a real Airflow deployment: PostgreSQL, and the API server, scheduler, dag-processor and
triggerer as separate processes (tests/control/airflow_stack.py), driven as a user would: through
the REST API v2 with a JWT, and through the trigger form in headless Chromium.

One stack for the module, and as few launches as possible: one good training run carries the
fault drills, the deferred watch and the triggerer restart; a user bug and a diverging run train
alongside it, and the refused confs run in validate_config while the dataset stages. Without
PostgreSQL, psycopg2, Chromium or Playwright the tests skip with one line saying what to install;
with CI set they fail instead.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

import pytest

from fsdp_resilience.training.contract import CheckpointCatalog, read_events

from control.support.airflow_stack import REPO, AirflowStack, missing_for_browser, missing_for_stack, wait_for
from control.support.browser import logged_in_page
from shared import FAST_RUN

pytestmark = pytest.mark.slow

TRAINING, STAGE = "fsdp_training", "stage_dataset"
#: A dataset name of this module's own: the form's default (python-stdlib) is left unstaged.
DATASET = "deploy-text"
GOOD = "deploy-good"
#: Where the screenshots of the trigger form go (test artifacts; .gitignore'd).
ARTIFACTS = Path(os.environ.get("FSDP_TEST_ARTIFACTS", REPO / "tests" / "control" / "artifacts"))
#: Generous: a 2-core machine shared by other test runs.
STAGE_TIMEOUT_S, TRAIN_TIMEOUT_S, REFUSED_TIMEOUT_S = 300, 600, 300


def require(missing: str | None) -> None:
    """Skip with one line naming what is missing, or fail in CI, where it must run."""
    if missing is None:
        return
    message = f"deployment test needs {missing}"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{message} (CI is set: .ci/run installs it)", pytrace=False)
    pytest.skip(message)


def conf(run_name: str, **overrides) -> dict:
    """A short run (as tests/control/test_training_dag.py's base_conf) on this module's dataset."""
    c = {
        "run_name": run_name,
        "dataset": DATASET,
        "steps": 12,
        "checkpoint_interval": 3,
        "max_restarts": 1,
        "max_node_replacements": 1,
        "run_config": dict(FAST_RUN),
    }
    c.update(overrides)
    return c


class _LogTails:
    """A pytest plugin for this module's lifetime: a failed test's report gets the tail of every
    component's log (the stack's processes write nowhere pytest captures)."""

    def __init__(self, stack: AirflowStack):
        self.stack = stack

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.failed and Path(str(item.path)) == Path(__file__):
            report.sections.append(("airflow component logs", self.stack.tails()))


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory):
    require(missing_for_stack())
    require(
        None
        if Path(REPO / ".venv" / "bin" / "python").exists()
        else "the training environment .venv (make setup): the local backend trains with it"
    )
    stack = AirflowStack(tmp_path_factory.mktemp("airflow-stack"))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    tails = _LogTails(stack)
    request.config.pluginmanager.register(tails)
    began = time.monotonic()
    try:
        stack.start()
        stack.wait_for_dags(TRAINING, STAGE)
        for dag_id in (TRAINING, STAGE):  # new DAGs start paused
            stack.unpause(dag_id)
        print(f"\n[deployment] stack up in {time.monotonic() - began:.0f}s: {stack.base_url}, logs in {stack.logs}")
        yield stack
    finally:
        left = stop_training_jobs(stack)
        ended = stack.stop()
        request.config.pluginmanager.unregister(tails)
        print(
            f"\n[deployment] stopped: {ended}; training jobs stopped at teardown: {left or 'none'}; "
            f"{time.monotonic() - began:.0f}s in all"
        )


def stop_training_jobs(stack: AirflowStack) -> list[str]:
    """Training processes run in sessions of their own and outlive the Airflow processes: stop any
    a run left going (none, normally), so nothing outlives the test."""
    from fsdp_resilience.control.backends.local.processes import stop_job_processes

    stopped = []
    for path in sorted((stack.runs_root / ".local-backend" / "jobs").glob("*.json")):
        record = json.loads(path.read_text())
        if stop_job_processes(record, grace_s=10) or any(
            n.get("stopped_by") is None and n.get("exit_code") is None and n.get("pid") for n in record["nodes"]
        ):
            stopped.append(record["job_name"])
    return stopped


def job_records(stack: AirflowStack) -> list[dict]:
    jobs = stack.runs_root / ".local-backend" / "jobs"
    return [json.loads(p.read_text()) for p in sorted(jobs.glob("*.json"))] if jobs.is_dir() else []


# ---------------------------------------------------------------------------------------------
# Confs the params' JSON schema refuses: 400 from the REST API, no run created.

SCHEMA_REFUSES = {
    "zero nodes": {"nodes": 0},
    "negative nodes": {"nodes": -1},
    "unknown model preset": {"model": "giant"},
    "dataset ../x": {"dataset": "../x"},
    "absolute dataset": {"dataset": "/etc"},
    "run_config run_dir": {"run_config": {"run_dir": "/tmp/x"}},
    "run_config run_id": {"run_config": {"run_id": "elsewhere"}},
    "run_config dataset_dir": {"run_config": {"dataset_dir": "/etc"}},
    "bad run name": {"run_name": "Bad_Name/.."},
}


@pytest.mark.parametrize("overrides", SCHEMA_REFUSES.values(), ids=SCHEMA_REFUSES.keys())
def test_the_params_schema_answers_400(stack, overrides):
    param = next(iter(overrides))
    response = stack.trigger(TRAINING, {**conf("refused-by-schema"), **overrides})
    assert response.status_code == 400, response.text
    assert f"param {param}" in response.json()["detail"], response.text


# ---------------------------------------------------------------------------------------------
# Confs only validate_config can judge: the run fails there, with the reason, and nothing launches.

VALIDATE_REFUSES = {
    "missing-rank": ({"fault_drill": {"kind": "exception", "step": 2, "rank": 7}}, "rank=7"),
    "beyond-capacity": ({"nodes": 5}, "pool has 4"),
    "symlinked-dataset": ({"dataset": "escape"}, "outside its root"),
}


@pytest.fixture(scope="module")
def refused_runs(stack) -> dict[str, str]:
    """Trigger them all at once (they run in parallel); the dag run id of each, by run name."""
    # A dataset name that passes the schema's pattern but is a symlink out of the data root.
    (stack.data_root / "escape").symlink_to(stack.root, target_is_directory=True)
    runs = {}
    for name, (overrides, _) in VALIDATE_REFUSES.items():
        response = stack.trigger(TRAINING, conf(name, **overrides))
        assert response.status_code in (200, 201), response.text
        runs[name] = response.json()["dag_run_id"]
    return runs


@pytest.mark.parametrize("name", VALIDATE_REFUSES)
def test_validate_config_refuses_and_nothing_launches(stack, refused_runs, name):
    run_id, reason = refused_runs[name], VALIDATE_REFUSES[name][1]
    assert stack.wait_for_run(TRAINING, run_id, REFUSED_TIMEOUT_S) == "failed"
    states = stack.task_states(TRAINING, run_id)
    assert states["validate_config"] == "failed", states
    assert reason in stack.task_log(TRAINING, run_id, "validate_config")
    # Failed once, where the reason is; everything after it upstream_failed (no second, misleading
    # failure in resolve_outcome), so the run is failed, not a success of skipped tasks.
    assert {s for t, s in states.items() if t != "validate_config"} == {"upstream_failed"}, states
    assert not (stack.runs_root / name).exists()
    assert not [r["job_name"] for r in job_records(stack) if r["run_id"] == name]


# ---------------------------------------------------------------------------------------------
# A good run: stage a dataset, train with a fault drill, kill the triggerer mid-watch.


#: Runs that fail for a reason that is not the machine's: the ladder never climbs, no node is
#: quarantined, resolve_outcome fails with the class. Overrides, and the failure class and exit code.
FAILING_RUNS = {
    "deploy-userbug": ({"fault_drill": {"kind": "user_bug", "step": 5, "rank": 1}}, "user_error"),
    # rank 1's loss turns NaN at step 5 on every pass: rolled back max_nonfinite_rollbacks times,
    # then the run ends non_finite; no checkpoint holds state from after the NaN.
    "deploy-diverges": (
        {
            "max_node_replacements": 2,
            "run_config": {**FAST_RUN, "faults": [{"kind": "nan", "step": 5, "rank": 1, "attempt": None}]},
        },
        "non_finite",
    ),
}


REPORT_TAB, FLEET_TAB = "Training report", "Training fleet"


def open_plugin_tab(page, stack: AirflowStack, path: str, tab: str):
    """Open a page of the Airflow UI and its plugin tab ``tab``, as a user would; the tab's frame
    once its page has loaded its data."""
    page.goto(f"{stack.base_url}{path}")
    page.get_by_text(tab, exact=True).first.click()
    frame = page.frame_locator(f"iframe[title='{tab}']")
    frame.locator("body[data-loaded]").wait_for()
    return frame


def report_tab(page, stack: AirflowStack, run_id: str):
    return open_plugin_tab(page, stack, f"/dags/{TRAINING}/runs/{quote(run_id, safe='')}", REPORT_TAB)


class LiveLook(threading.Thread):
    """The run's report view in Chromium while the run trains: the view's own polling must show it
    running with steps done, before the run ends. A screenshot of that moment is the artifact."""

    def __init__(self, stack: AirflowStack, run_id: str):
        super().__init__(name="report-view-live", daemon=True)
        self.stack, self.run_id = stack, run_id
        self.seen: str | None = None  # the status line while running, with a step done
        self.ended: str | None = None  # the status line once the run ended, in the same page
        self.states: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with logged_in_page(self.stack) as page:
                frame = report_tab(page, self.stack, self.run_id)
                deadline = time.monotonic() + TRAIN_TIMEOUT_S
                while time.monotonic() < deadline:
                    state = frame.locator("#run-state").text_content()
                    status = frame.locator("#status").inner_text()
                    if not self.states or self.states[-1] != state:
                        self.states.append(state)
                    if self.seen is None and state == "running" and re.search(r"steps [1-9]", status):
                        self.seen = status
                        page.screenshot(path=str(ARTIFACTS / "report-view-while-training.png"))
                    if state not in ("running", "not started"):
                        # The same page, never reloaded: its own polling brought the end in.
                        self.ended = status
                        return
                    page.wait_for_timeout(1000)
        except BaseException as e:  # reported by the test, not lost in the thread
            self.error = e


@dataclass
class GoodRun:
    stage_run: str
    run_id: str
    state: str = ""
    states: dict[str, str | None] = field(default_factory=dict)
    #: when the watch's trigger was created (the task deferred), as the API server reports it
    deferred_at: float | None = None
    #: the watch was still deferred after the triggerer was killed
    deferred_after_kill: bool = False
    killed_triggerer_job: int | None = None
    killed_triggerer_pid: int | None = None
    new_triggerer_pid: int | None = None
    #: the dag run id of each of FAILING_RUNS, by run name
    failing: dict[str, str] = field(default_factory=dict)
    #: the report view, looked at in Chromium while the run trained
    live: "LiveLook | None" = None


def ti_of(stack: AirflowStack, run_id: str, task_id: str) -> dict:
    return stack.get(f"/api/v2/dags/{TRAINING}/dagRuns/{run_id}/taskInstances/{task_id}")


@pytest.fixture(scope="module")
def good_run(stack, refused_runs) -> GoodRun:
    # refused_runs first: they run in validate_config while the dataset stages (overlap on a
    # 2-core machine, not a dependency).
    response = stack.trigger(
        STAGE, {"source": "stdlib", "dataset": DATASET, "max_bytes": 256 * 1024, "val_fraction": 0.1}
    )
    assert response.status_code in (200, 201), response.text
    stage_run = response.json()["dag_run_id"]
    assert stack.wait_for_run(STAGE, stage_run, STAGE_TIMEOUT_S) == "success", stack.task_states(STAGE, stage_run)

    # Two layers of the ladder's bottom: the form's drill (an exception, recovered in-process) and
    # a SIGKILL from run_config's list (recovered in-job, in the same pods).
    response = stack.trigger(
        TRAINING,
        conf(
            GOOD,
            fault_drill={"kind": "exception", "step": 4, "rank": 1},
            run_config={**FAST_RUN, "faults": [{"kind": "sigkill", "step": 8, "rank": 0}]},
        ),
    )
    assert response.status_code in (200, 201), response.text
    record = GoodRun(stage_run=stage_run, run_id=response.json()["dag_run_id"])
    # The report view in a browser while the run trains, alongside the watch's checks below.
    if missing_for_browser() is None:
        record.live = LiveLook(stack, record.run_id)
        record.live.start()
    # Two runs that must fail without the ladder climbing, alongside it (4 slots; each takes one).
    for name, (overrides, _) in FAILING_RUNS.items():
        response = stack.trigger(TRAINING, conf(name, **overrides))
        assert response.status_code in (200, 201), response.text
        record.failing[name] = response.json()["dag_run_id"]

    # Poll the watch until it is deferred and a triggerer has taken its trigger.
    def deferred_and_taken():
        ti = ti_of(stack, record.run_id, "watch_checkpoints")
        if ti["state"] in ("success", "failed", "upstream_failed", "skipped"):
            raise AssertionError(f"the watch ended {ti['state']} before it was seen deferred")
        trigger = ti.get("trigger") or {}
        return ti["state"] == "deferred" and trigger.get("triggerer_id") is not None and trigger

    trigger = wait_for(
        "the watch to be deferred and taken by the triggerer",
        deferred_and_taken,
        timeout_s=TRAIN_TIMEOUT_S,
        interval_s=1,
        on_timeout=stack.tails,
    )
    record.deferred_at = datetime.fromisoformat(trigger["created_date"]).timestamp()
    record.killed_triggerer_job = trigger["triggerer_id"]

    # Kill the triggerer as a crash would, mid-watch: with none running the watch stays deferred;
    # a new one takes the trigger once the old one's heartbeat is stale.
    record.killed_triggerer_pid = stack.processes["triggerer"].pid
    stack.kill("triggerer")
    record.deferred_after_kill = stack.task_state(TRAINING, record.run_id, "watch_checkpoints") == "deferred"
    record.new_triggerer_pid = stack.restart("triggerer").pid

    record.state = stack.wait_for_run(TRAINING, record.run_id, TRAIN_TIMEOUT_S)
    record.states = stack.task_states(TRAINING, record.run_id)
    if record.live is not None:
        record.live.join(timeout=120)
    return record


def test_stage_dataset_stages_the_dataset_and_announces_it(stack, good_run):
    assert stack.run_state(STAGE, good_run.stage_run) == "success"
    assert (stack.data_root / DATASET / "index.json").is_file()
    events = stack.asset_events(source_dag_id=STAGE, source_run_id=good_run.stage_run)
    assert [e["name"] for e in events] == ["fsdp_dataset"], events
    assert events[0]["extra"]["dataset"] == DATASET and events[0]["extra"]["train_tokens"] > 0


def test_the_watch_is_deferred_while_training_runs(stack, good_run):
    events = read_events(stack.runs_root / GOOD / "events.jsonl")
    began = next(e["ts"] for e in events if e["event"] == "launch_begin")
    ended = next(e["ts"] for e in events if e["event"] == "final")
    # The watch deferred (its trigger was created) after the launch began and before it ended:
    # no worker slot was held while the job trained.
    assert began < good_run.deferred_at < ended, (began, good_run.deferred_at, ended)
    assert good_run.states["watch_checkpoints"] == "success"


def test_a_run_with_a_fault_drill_succeeds_with_one_launch(stack, good_run):
    assert good_run.state == "success", good_run.states
    st = good_run.states
    assert st["launch_training"] == st["watch_checkpoints"] == st["publish"] == "success", st
    # No escalation: every rung skipped, so launch_training was the only launch.
    assert all(
        st[f"escalation_{k}.decide"] == "skipped" and st[f"escalation_{k}.relaunch"] == "skipped" for k in (1, 2, 3)
    ), st
    assert stack.xcom(TRAINING, good_run.run_id, "launch_training")["handle"]["launch_id"] == "0"
    events = read_events(stack.runs_root / GOOD / "events.jsonl")
    assert {e.get("launch_id") for e in events if e["event"] == "launch_begin"} == {"0"}
    assert len([e for e in events if e["event"] == "launch_begin"]) == 1  # one node, one launch
    # Both drills fired and the job recovered from each inside the launch, without the DAG's help.
    assert len([e for e in events if e["event"] == "fault_injected"]) == 2, events
    assert {e["layer"] for e in events if e["event"] == "restart_end"} == {"inprocess", "injob"}, events


def test_the_run_publishes_its_checkpoint_and_evaluation(stack, good_run):
    events = stack.asset_events(source_dag_id=TRAINING, source_run_id=good_run.run_id)
    by_name = {e["name"]: e for e in events}
    assert set(by_name) == {"fsdp_model_checkpoint", "fsdp_model_evaluation"}, events
    checkpoint = by_name["fsdp_model_checkpoint"]["extra"]
    assert checkpoint["run_id"] == GOOD and checkpoint["checkpoint_id"] == "step_00000012"
    # Every byte checked against its commit's CRC32C before it was published.
    assert (checkpoint["verified"], checkpoint["skipped"]) == ("checksums", [])
    assert Path(checkpoint["path"]).resolve().is_relative_to(stack.runs_root.resolve() / GOOD)
    assert by_name["fsdp_model_evaluation"]["extra"]["run_id"] == GOOD
    assert json.loads((stack.runs_root / GOOD / "eval.json").read_text())["step"] == 12
    assert (stack.runs_root / GOOD / "report" / "report.md").is_file()


def test_a_killed_triggerer_is_replaced_and_the_watch_resumes(stack, good_run):
    assert good_run.deferred_after_kill
    assert good_run.new_triggerer_pid != good_run.killed_triggerer_pid and stack.processes["triggerer"].alive()
    # The trigger fired in the new triggerer, not in the killed one (each triggerer job writes the
    # trigger's log to a file of its own).
    logs = stack.trigger_logs(TRAINING, good_run.run_id, "watch_checkpoints")
    fired = [job for job, lines in logs.items() if any(e.get("event") == "Trigger fired event" for e in lines)]
    newest = max(j["id"] for j in stack.get("/api/v2/jobs", job_type="TriggererJob", limit=100)["jobs"])
    assert fired == [newest] and newest != good_run.killed_triggerer_job, (fired, newest, good_run)
    # ... and the run went on to the end with its one launch.
    assert good_run.states["watch_checkpoints"] == "success" and good_run.state == "success", good_run.states
    assert [r["launch_id"] for r in job_records(stack) if r["run_id"] == GOOD] == ["0"]


@pytest.mark.parametrize("name", FAILING_RUNS)
def test_a_user_bug_or_a_diverging_run_fails_without_replacing_a_node(stack, good_run, name):
    failure_class = FAILING_RUNS[name][1]
    run_id = good_run.failing[name]
    assert stack.wait_for_run(TRAINING, run_id, TRAIN_TIMEOUT_S) == "failed"
    st = stack.task_states(TRAINING, run_id)
    assert st["watch_checkpoints"] == "success" and st["resolve_outcome"] == "failed", st
    assert all(st[f"escalation_{k}.decide"] == "skipped" for k in (1, 2, 3)), st
    assert st["evaluate"] == st["publish"] == "upstream_failed", st
    assert stack.xcom(TRAINING, run_id, "watch_checkpoints")["failure_class"] == failure_class
    assert failure_class in stack.task_log(TRAINING, run_id, "resolve_outcome")
    events = read_events(stack.runs_root / name / "events.jsonl")
    assert not [e for e in events if e["event"] == "escalation"]
    assert any(e["event"] == "final" and e["failure_class"] == failure_class for e in events)
    slots_file = stack.runs_root / ".local-backend" / "slots.json"
    slots = json.loads(slots_file.read_text()) if slots_file.exists() else {}
    assert not [s for s, v in slots.items() if v.get("state") == "quarantined"], slots
    if failure_class == "non_finite":
        assert all(c.step < 5 for c in CheckpointCatalog(stack.runs_root / name).committed())


# ---------------------------------------------------------------------------------------------
# The run report and the fleet page in the Airflow UI (the project's plugin, served by the API
# server behind Airflow's auth).


def test_the_report_view_shows_the_run_while_it_trains(stack, good_run):
    require(missing_for_browser())
    live = good_run.live
    assert live is not None and not live.is_alive(), "the live look did not finish"
    if live.error is not None:
        raise live.error
    assert live.seen, f"the report view never showed the run training with a step done (states seen: {live.states})"
    assert "DAG run: running" in live.seen, live.seen
    # The page kept itself up to date: without a reload it went on to show the run's end.
    assert live.ended is not None and live.ended.startswith("success"), (live.states, live.ended)
    assert "steps 12 / 12" in live.ended, live.ended
    assert (ARTIFACTS / "report-view-while-training.png").is_file()


def test_the_report_view_shows_the_finished_run(stack, good_run):
    require(missing_for_browser())
    from playwright.sync_api import expect

    with logged_in_page(stack) as page:
        frame = report_tab(page, stack, good_run.run_id)
        expect(frame.locator("#run-state")).to_have_text("success", timeout=60_000)
        status = frame.locator("#status").inner_text()
        assert "steps 12 / 12" in status and "DAG run: success" in status, status
        assert "restarts 2 (inprocess 1, injob 1)" in status, status
        # The figures: both restarts' windows and the faults on the timeline, a loss curve.
        assert frame.locator("#timeline-svg rect.restart").count() == 2
        assert frame.locator("#timeline-svg path.fault").count() >= 1
        assert frame.locator("#loss-svg circle").count() >= 1
        # Hover a restart: its layer, latency and reason.
        frame.locator("#timeline-svg rect.restart").first.hover()
        expect(frame.locator("#tip")).to_contain_text("inprocess restart")
        # The report's tables: restarts per layer, each fault with the layer that took it.
        body = frame.locator("body").inner_text()
        for text in ("Summary", "Restarts", "Faults", "recovered (inprocess", "recovered (injob", "step_00000012"):
            assert text in body, f"{text!r} not in the report view"
        # A fault that was recovered is never shown as restarts_exhausted.
        assert "restarts_exhausted" not in body
        page.screenshot(path=str(ARTIFACTS / "report-view.png"))
        frame.locator("body").screenshot(path=str(ARTIFACTS / "report-view-full.png"))
    print(f"\n[deployment] report view screenshots: {ARTIFACTS}/report-view*.png")


def test_the_fleet_page_lists_every_run_sortable(stack, good_run):
    require(missing_for_browser())
    for run_id in good_run.failing.values():
        stack.wait_for_run(TRAINING, run_id, TRAIN_TIMEOUT_S)
    with logged_in_page(stack) as page:
        frame = open_plugin_tab(page, stack, f"/dags/{TRAINING}", FLEET_TAB)
        table = frame.locator("#runs table")
        rows = {}
        for line in table.locator("tbody tr").all_inner_texts():
            cells = line.split("\t")
            rows[cells[0].strip()] = cells
        assert {GOOD, *FAILING_RUNS} <= set(rows), rows
        assert rows[GOOD][2].strip() == "success" and rows["deploy-userbug"][2].strip() == "user error", rows
        assert rows[GOOD][7].startswith("2"), rows[GOOD]  # two restarts

        # Sort by restarts: most first, then (a second click) fewest first.
        def restarts_column() -> list[int]:
            return [int(line.split("\t")[7].split()[0]) for line in table.locator("tbody tr").all_inner_texts()]

        header = frame.get_by_text("restarts", exact=True)
        header.click()
        assert restarts_column() == sorted(restarts_column(), reverse=True) and restarts_column()[0] >= 2
        frame.get_by_text("restarts ▼", exact=True).click()
        assert restarts_column() == sorted(restarts_column()) and restarts_column()[0] == 0
        page.screenshot(path=str(ARTIFACTS / "fleet-page.png"))


def test_the_report_needs_a_login_and_read_access_to_the_dag(stack, good_run):
    import httpx

    data = f"/fsdp-report/api/runs/{TRAINING}/{quote(good_run.run_id, safe='')}"
    page = f"/fsdp-report/runs/{TRAINING}/{quote(good_run.run_id, safe='')}"
    fleet = f"/fsdp-report/api/dags/{TRAINING}/fleet"
    airflow_run = f"/api/v2/dags/{TRAINING}/dagRuns/{quote(good_run.run_id, safe='')}"
    with httpx.Client(base_url=stack.base_url, timeout=60) as anonymous:
        for path in (data, page, fleet, "/fsdp-report/assets/report.js"):
            assert anonymous.get(path).status_code == 401, path

    def as_user(user: str, path: str, cookie: bool = False) -> httpx.Response:
        token = stack.token_for(user)
        auth = {"cookies": {"_token": token}} if cookie else {"headers": {"Authorization": f"Bearer {token}"}}
        with httpx.Client(base_url=stack.base_url, timeout=60, **auth) as client:
            return client.get(path)

    # A user Airflow grants no access to the DAG: Airflow's own API and the report both say 403.
    assert as_user("outsider", airflow_run).status_code == 403
    for path in (data, page, fleet):
        response = as_user("outsider", path)
        assert response.status_code == 403, (path, response.status_code, response.text[:300])
    # A viewer reads it, with a bearer token or with the UI's cookie.
    for cookie in (False, True):
        response = as_user("viewer", data, cookie=cookie)
        assert response.status_code == 200, response.text[:300]
        assert response.json()["status"]["state"] == "success" and response.json()["brief"]["last_step"] == 12
    # Another DAG's run has no training report.
    response = stack.request("GET", f"/fsdp-report/api/runs/{STAGE}/{quote(good_run.stage_run, safe='')}")
    assert response.status_code == 404 and "does not train" in response.json()["detail"]


# ---------------------------------------------------------------------------------------------
# The trigger form in a real browser (Debian's chromium driven by Playwright).

#: The form's sections (dags/fsdp_training.py), each with a field it shows when open.
FORM_SECTIONS = {
    "What to train": "Model preset",
    "Restarts and escalation": "Restart mode",
    "Where it runs": "Nodes",
    "Drills and other settings": "Fault drill",
}


def test_the_trigger_form_submits_with_its_defaults(stack):
    require(missing_for_browser())
    from playwright.sync_api import expect

    before = {r["dag_run_id"] for r in stack.get(f"/api/v2/dags/{TRAINING}/dagRuns", limit=100)["dag_runs"]}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with logged_in_page(stack) as page:
        page.goto(f"{stack.base_url}/dags/{TRAINING}")
        page.get_by_role("button", name="Trigger").first.click()
        dialog = page.get_by_role("dialog")
        expect(dialog).to_be_visible()
        submit = dialog.get_by_role("button", name="Trigger")
        expect(submit).to_be_enabled()  # every optional field is nullable: nothing to type
        # The artifact: the form, one picture per section (the sections open one at a time).
        for n, (section, field_label) in enumerate(FORM_SECTIONS.items(), 1):
            dialog.get_by_role("button", name=section).click()
            expect(dialog.get_by_role("region").filter(has_text=field_label)).to_be_visible()
            dialog.screenshot(path=str(ARTIFACTS / f"fsdp_training-trigger-form-{n}.png"))
        expect(submit).to_be_enabled()
        submit.click()
        expect(dialog).to_be_hidden()
    print(f"\n[deployment] trigger form screenshots: {ARTIFACTS}/fsdp_training-trigger-form-*.png")

    def new_run():
        runs = stack.get(f"/api/v2/dags/{TRAINING}/dagRuns", limit=100)["dag_runs"]
        return [r for r in runs if r["dag_run_id"] not in before]

    runs = wait_for("the run the form submitted", new_run, timeout_s=60)
    assert len(runs) == 1 and runs[0]["run_type"] == "manual", runs
    # Its training never starts (the default dataset is not staged here); the stack's teardown
    # stops whatever is still going.
    assert runs[0]["conf"].get("dataset", "python-stdlib") == "python-stdlib"
