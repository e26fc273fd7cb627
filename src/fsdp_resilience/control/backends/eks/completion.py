"""When a launch with hot spares has succeeded, on any cluster.

A launch with spares is an Indexed Job of ``nodes + spares`` completions, and a spare's index never
succeeds by itself. Where the apiserver keeps the Job's ``successPolicy`` (manifests.success_policy:
batch/v1, GA in Kubernetes 1.33, beta and on by default in 1.31-1.32), the Job controller completes
the Job once ``nodes`` indexes succeeded. Where it does not (an older server, or one that dropped
the field), the backend's own rule ends it: when every training node's ``final`` record of this
launch (its incarnation: the Job's UID) says success and the final step is committed, the backend
suspends the Job (its pods end; none is recreated) and marks it SUCCEEDED_ANNOTATION, which
status.job_status reads as succeeded (``settle``).

The server's version is read once per connection and kept (``VERSION_TTL_S``): ``GET /version``,
which every identity may read (the ``system:public-info-viewer`` ClusterRole). An emulated version
(``--emulated-version``: the apiserver then serves that release's API) counts over the binary's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from typing import Any

from fsdp_resilience.control.backends.base import JobStatus
from fsdp_resilience.control.backends.eks.constants import ANNOTATION_LAUNCH, LABEL_LAUNCH, SUCCEEDED_ANNOTATION
from fsdp_resilience.control.backends.eks.status import job_finished, run_config_of
from fsdp_resilience.training.contract import (
    CheckpointCatalog,
    Event,
    FailureClass,
    RunConfig,
    RunDir,
    read_events,
)

#: The first Kubernetes release whose Job successPolicy is GA (on whatever the gates).
SUCCESS_POLICY_SINCE = (1, 33)
#: How long a server version read stays trusted (an upgrade shows within this).
VERSION_TTL_S = 600.0

_VERSIONS: dict[str, tuple[float, tuple[int, int] | None]] = {}


def parse_version(info: dict[str, Any]) -> tuple[int, int] | None:
    """(major, minor) of a ``/version`` answer: the emulated version where the server has one
    (``emulationMajor``/``emulationMinor``), else its own; EKS writes minors such as ``"33+"``."""

    def number(value: Any) -> int | None:
        match = re.match(r"\d+", str(value or ""))
        return int(match.group()) if match else None

    for major_key, minor_key in (("emulationMajor", "emulationMinor"), ("major", "minor")):
        major, minor = number(info.get(major_key)), number(info.get(minor_key))
        if major is not None and minor is not None:
            return major, minor
    match = re.match(r"v?(\d+)\.(\d+)", str(info.get("gitVersion") or info.get("git_version") or ""))
    return (int(match.group(1)), int(match.group(2))) if match else None


def cached_version(key: str, read) -> tuple[int, int] | None:
    """The server version for connection ``key``: kept from a read within ``VERSION_TTL_S``, else
    ``read()`` (a ``/version`` answer as a dict; an error reads as unknown, None, not kept)."""
    now = time.monotonic()
    kept = _VERSIONS.get(key)
    if kept is not None and now - kept[0] < VERSION_TTL_S:
        return kept[1]
    try:
        version = parse_version(read() or {})
    except Exception:  # noqa: BLE001 - an unknown version only means the backend's own rule applies
        return None
    _VERSIONS[key] = (now, version)
    return version


def kept_version(key: str) -> tuple[int, int] | None:
    """The version kept for ``key`` (no read: the triggerer's event loop asks), or None."""
    kept = _VERSIONS.get(key)
    return kept[1] if kept is not None and time.monotonic() - kept[0] < VERSION_TTL_S else None


def needs_own_rule(job: dict[str, Any], version: tuple[int, int] | None) -> bool:
    """Whether the backend must end this Job itself when its training nodes succeed: a launch with
    spares, on a server older than SUCCESS_POLICY_SINCE (or of unknown version), or whose Job as
    stored has no successPolicy (the apiserver dropped the field)."""
    spec = job.get("spec") or {}
    completions = int(spec.get("completions") or 1)
    cfg = _config(job)
    if cfg is None or cfg.nodes >= completions:
        return False
    return version is None or version < SUCCESS_POLICY_SINCE or not spec.get("successPolicy")


def _config(job: dict[str, Any]) -> RunConfig | None:
    try:
        return run_config_of(job)
    except (ValueError, TypeError):
        return None


def launch_trained(job: dict[str, Any]) -> str | None:
    """Why this Job's launch succeeded, read from its run dir, or None: every training node's
    latest ``final`` of this launch and incarnation (the Job's UID) says success, and the final
    step (``cfg.steps``) is committed. The training nodes are those of the launch's newest
    membership record (``control/membership.json``: a spare that took a lost node's place trains
    under its own index), else indexes ``0..nodes-1``. A run dir that cannot be read (not mounted
    here) says nothing: None."""
    cfg = _config(job)
    meta = job.get("metadata") or {}
    launch_id = (meta.get("annotations") or {}).get(ANNOTATION_LAUNCH) or (meta.get("labels") or {}).get(LABEL_LAUNCH)
    uid = meta.get("uid")
    if cfg is None or not launch_id or not uid:
        return None
    layout = RunDir(cfg.run_dir)
    training = set(range(cfg.nodes))
    try:
        membership = json.loads(layout.membership.read_text())
        if isinstance(membership, dict) and membership.get("launch_id") == launch_id:
            training = {int(rank) for rank, _ in membership.get("members") or []} or training
    except (OSError, ValueError, TypeError):
        pass
    finals: dict[int, dict[str, Any]] = {}
    for record in read_events(layout.events, Event.FINAL):
        if record.get("launch_id") == launch_id and record.get("launch_uid") == uid and "node_rank" in record:
            finals[int(record["node_rank"])] = record
    if not all(finals.get(i, {}).get("failure_class") == FailureClass.SUCCESS.value for i in training):
        return None
    latest = CheckpointCatalog(layout).latest()
    if latest is None or latest.step < cfg.steps:
        return None
    return (
        f"training node(s) {sorted(training)} ended success and step {cfg.steps} is committed as {latest.checkpoint_id}"
    )


def succeeded_patch(reason: str) -> dict[str, Any]:
    """The patch that ends a Job whose training nodes succeeded: suspended (the Job controller ends
    its pods and creates none) and marked, so every reader sees it succeeded."""
    verdict = {"at": time.time(), "failure_class": FailureClass.SUCCESS.value, "message": reason}
    return {"metadata": {"annotations": {SUCCEEDED_ANNOTATION: json.dumps(verdict)}}, "spec": {"suspend": True}}


def read_version(api_client) -> dict[str, Any]:
    """``GET /version`` through a kubernetes ``ApiClient``, as the server wrote it (the client's
    model would drop the emulated version)."""
    from kubernetes import client

    return json.loads(client.VersionApi(api_client).get_code(_preload_content=False).data)


def settle(kube, job: dict[str, Any], version) -> dict[str, Any]:
    """The Job, ended by the backend's own rule where it applies (``needs_own_rule``; ``version``:
    a callable that returns the server's version, called only for a running launch with spares)
    and its launch trained (``launch_trained``): suspended and marked through ``kube`` (a
    KubeClient), else as it was."""
    spec = job.get("spec") or {}
    cfg = _config(job)
    if job_finished(job) or spec.get("suspend") or cfg is None or not cfg.spare_nodes:
        return job
    if not needs_own_rule(job, version()):
        return job
    reason = launch_trained(job)
    if reason is None:
        return job
    return kube.patch_job(job["metadata"]["name"], succeeded_patch(reason))


async def status_as_read(job: dict[str, Any], status: JobStatus, version: tuple[int, int] | None) -> JobStatus:
    """``status`` as the triggerer reports it: succeeded where the backend's own rule applies and
    the launch trained. The triggerer may not patch the Job, so it only reports; the worker's next
    ``status`` (the watch's completion calls it) suspends the Job (``settle``)."""
    cfg = _config(job)
    if status.state not in ("pending", "running") or cfg is None or not cfg.spare_nodes:
        return status
    if not needs_own_rule(job, version):
        return status
    reason = await asyncio.to_thread(launch_trained, job)
    if reason is None:
        return status
    return dataclasses.replace(
        status,
        state="succeeded",
        failure_class=FailureClass.SUCCESS.value,
        message=f"{reason} (the Job is suspended at the next status from a worker)",
    )
