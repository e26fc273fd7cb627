"""The EKS backend at the size users run, on the real control plane of the tests
(tests/control/kube: kube-apiserver, controller-manager, scheduler, etcd, kwok nodes shaped like
p5.48xlarge): per cluster size N, a run on N/2 nodes with 2 hot spares launched through
``EksBackend.submit`` as the worker, its pods bound by the real kube-scheduler; the deferred watch
polled as the triggerer runs it; then 1, and in a second launch 8, nodes failed through kwok and
diagnosed and replaced by the backend.

What it measures is the control plane's side only (the cluster's reaction times are kwok's and the
controllers'): per poll of ``TrainingProgressTrigger`` (-> ``EksBackend.status_async``), the API
requests the apiserver's audit log records for the triggerer and the bytes it answered (counted on
the client's REST layer), and the process CPU time; for ``diagnose`` and ``replace_nodes``
(replacement=asg; Auto Scaling behind a botocore Stubber, so AWS's latency is not in the figure)
the wall and CPU time and the worker's API requests and bytes.

The control plane and its fixtures are the tests' own (tests/control/kube, tests/control/fakes,
imported from there); ``scale_row`` also runs on the tests' ``kube`` fixture
(tests/control/integration/test_bench_control_plane.py, at a tiny size).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import REPO, log

if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))  # the control plane and its fixtures are the tests'

#: EKS's node heartbeat (kubelet lease 40 s, renewed every 10 s; the node lifecycle controller's
#: grace 50 s): at 1,024 nodes the tests' 12 s lease would be 340 lease writes a second.
EKS_LEASE_S, EKS_GRACE_S = 40, 50
logging.getLogger("bench.eks_scale.watch").setLevel(logging.WARNING)
GPU_FAULT = ("AcceleratedHardwareReady", "False", "NvidiaXID79", "GPU has fallen off the bus")


class ApiMeter:
    """Bytes the apiserver answered to the kubernetes (sync) and kubernetes_asyncio (the
    triggerer's) clients, counted on their REST layer while ``on``."""

    def __init__(self, monkeypatch):
        import kubernetes.client.rest
        import kubernetes_asyncio.client.rest

        self.bytes = 0
        self.calls = 0
        sync_request = kubernetes.client.rest.RESTClientObject.request
        async_request = kubernetes_asyncio.client.rest.RESTClientObject.request
        meter = self

        def request(self, *args, **kwargs):
            r = sync_request(self, *args, **kwargs)
            meter._count(r, kwargs)
            return r

        async def request_async(self, *args, **kwargs):
            r = await async_request(self, *args, **kwargs)
            meter._count(r, kwargs)
            return r

        monkeypatch.setattr(kubernetes.client.rest.RESTClientObject, "request", request)
        monkeypatch.setattr(kubernetes_asyncio.client.rest.RESTClientObject, "request", request_async)

    def _count(self, response, kwargs) -> None:
        self.calls += 1
        if kwargs.get("_preload_content", True):
            self.bytes += len(getattr(response, "data", b"") or b"")

    def reset(self) -> None:
        self.bytes = self.calls = 0


def audited(kube, user: str) -> Counter:
    """The requests ``user`` made since the last ``kube.clear_requests()``, as 'verb resource'."""
    return Counter(
        f"{r.verb} {r.resource}" + (f"/{r.subresource}" if r.subresource else "")
        for r in kube.requests
        if r.user == user
    )


def asg_client(instances: list[str]):
    """A real botocore Auto Scaling client behind a Stubber that answers replace_instance's three
    calls for each of ``instances``, in order: the group of each is tagged managed."""
    import datetime

    import boto3
    from botocore.stub import Stubber

    client = boto3.client("autoscaling", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    stubber = Stubber(client)
    now = datetime.datetime.now(datetime.timezone.utc)
    for instance in instances:
        group = "gpu-ng-a"
        stubber.add_response(
            "describe_auto_scaling_instances",
            {"AutoScalingInstances": [{"InstanceId": instance, "AutoScalingGroupName": group,
                                       "AvailabilityZone": "us-west-2a", "LifecycleState": "InService",
                                       "HealthStatus": "HEALTHY", "ProtectedFromScaleIn": False}]},
        )  # fmt: skip
        stubber.add_response(
            "describe_auto_scaling_groups",
            {"AutoScalingGroups": [{"AutoScalingGroupName": group, "MinSize": 1, "MaxSize": 2048,
                                    "DesiredCapacity": 1024, "DefaultCooldown": 300,
                                    "AvailabilityZones": ["us-west-2a"], "HealthCheckType": "EC2",
                                    "CreatedTime": now,
                                    "Tags": [{"Key": "fsdp-resilience/managed", "Value": "true"}]}]},
        )  # fmt: skip
        stubber.add_response(
            "terminate_instance_in_auto_scaling_group",
            {"Activity": {"ActivityId": f"a-{instance}", "AutoScalingGroupName": group, "Cause": "bench",
                          "StartTime": now, "StatusCode": "InProgress"}},
        )  # fmt: skip
    stubber.activate()
    return client, stubber


def _wait(predicate, timeout: float, what: str, interval: float = 1.0):
    from control.kube.cluster import wait_for

    return wait_for(predicate, timeout=timeout, what=what, interval=interval)


def add_pool(kube, count: int, prefix: str) -> dict[str, str]:
    """``count`` p5.48xlarge nodes of the GPU pool (8 threads of POSTs); node -> instance id. Waits
    until each is Ready without the not-ready taint new nodes get."""
    from control.fakes.eks_cluster import add_gpu_node

    names = {f"{prefix}-{i:04d}": f"i-{abs(hash((prefix, i))) % 16**17:017x}" for i in range(count)}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: add_gpu_node(kube, item[0], item[1]), names.items()))

    def settled() -> bool:
        ready = 0
        for node in kube.nodes():
            conds = {c["type"]: c["status"] for c in node["status"].get("conditions") or []}
            taints = {t["key"] for t in node["spec"].get("taints") or []}
            ready += conds.get("Ready") == "True" and "node.kubernetes.io/not-ready" not in taints
        return ready >= count

    _wait(settled, 120 + count / 5, f"{count} nodes Ready", interval=2.0)
    return names


def running_pods(kube, job_name: str, count: int) -> list[dict]:
    from control.fakes.eks_cluster import NS

    def running():
        pods = [p for p in kube.pods(NS, job_name) if p["status"].get("phase") == "Running"]
        return len(pods) >= count and sorted(pods, key=lambda p: int(p["metadata"]["labels"][_INDEX]))

    return _wait(running, 120 + count / 2, f"{count} running pods of {job_name}", interval=1.0)


_INDEX = "batch.kubernetes.io/job-completion-index"


def measure_watch(backend, handle, cfg, kube, meter: ApiMeter, polls: int, monkeypatch) -> dict[str, Any]:
    """``polls`` polls of the real TrainingProgressTrigger (as the triggerer: its token), a
    poll_interval_s of 1 ms between them: API requests per poll (audit log), bytes per poll, CPU
    and wall time per poll."""
    from fsdp_resilience.control.backends.eks.backend import EksBackend
    from fsdp_resilience.control.triggers.training_progress import TrainingProgressTrigger

    from control.fakes.eks_cluster import TRIGGERER, credentials_for

    asyncio.run(_poll_as(credentials_for(kube, TRIGGERER), backend, handle))  # connections, caches warm

    class EnoughPolls(Exception):
        pass

    real = EksBackend.status_async
    done = {"n": 0, "states": Counter()}

    async def counted(self, handle):
        if done["n"] >= polls:
            raise EnoughPolls
        status = await real(self, handle)
        done["n"] += 1
        done["states"][status.state] += 1
        return status

    trigger = TrainingProgressTrigger(
        backend=backend.to_config(), handle=handle.to_dict(), run_dir=cfg.run_dir, final_step=cfg.steps,
        stall_timeout_s=3600.0, launched_at=time.time(), poll_interval_s=0.001, change_tick_s=0,
    )  # fmt: skip

    async def drive() -> None:
        try:
            async for event in trigger.run():
                raise RuntimeError(f"the watch fired during the measurement: {event.payload}")
        except EnoughPolls:
            return

    with monkeypatch.context() as patch:
        patch.setattr(EksBackend, "status_async", counted)
        patch.setattr(trigger, "_log", logging.getLogger("bench.eks_scale.watch"))  # not a line per poll
        kube.clear_requests()
        meter.reset()
        cpu, wall = time.process_time(), time.perf_counter()
        asyncio.run(drive())
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    calls = audited(kube, TRIGGERER.username)
    return {
        "polls": done["n"],
        "states": dict(done["states"]),
        "api_calls_per_poll": round(sum(calls.values()) / done["n"], 2),
        "api_calls_by_kind": {k: round(v / done["n"], 2) for k, v in sorted(calls.items())},
        "bytes_per_poll": round(meter.bytes / done["n"]),
        "cpu_s_per_poll": round(cpu / done["n"], 4),
        "wall_s_per_poll": round(wall / done["n"], 4),
    }


async def _poll_as(credentials, backend, handle) -> None:
    from control.fakes.eks_cluster import ACTING_TOKEN

    ACTING_TOKEN.set(credentials)
    await backend.status_async(handle)


def timed(kube, meter: ApiMeter, user: str, call) -> tuple[Any, dict[str, Any]]:
    """``call()`` with its wall and CPU time, its API requests as ``user`` and the bytes answered."""
    kube.clear_requests()
    meter.reset()
    cpu, wall = time.process_time(), time.perf_counter()
    result = call()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    calls = audited(kube, user)
    return result, {
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "api_calls": sum(calls.values()),
        "api_calls_by_kind": dict(sorted(calls.items())),
        "bytes": meter.bytes,
    }


def fail_nodes(kube, pods: list[dict], count: int, lost: int, lose_timeout: float) -> list[str]:
    """Fail ``count`` nodes of a running launch through kwok. With ``lost`` 0: the node monitoring
    agent reports the GPU condition (AcceleratedHardwareReady) False on each and its pod exits 75
    (restarts exhausted: the Job fails at once). Else the GPU condition goes False on
    ``count - lost`` nodes (their pods run on) and ``lost`` nodes stop reporting (NotReady: the node
    lifecycle controller marks them Ready=Unknown and evicts their pods), more than the spares
    cover: the launch fails (status.job_status). Spares (the last two indexes) and node 0 are left
    alone. Returns the failed nodes."""
    from control.fakes.eks_cluster import NS

    candidates = pods[1:-2]
    chosen = candidates[:: max(1, len(candidates) // count)][:count]
    nodes = [p["spec"]["nodeName"] for p in chosen]
    for node in nodes[lost:]:
        kube.set_node_condition(node, *GPU_FAULT)
    if not lost:
        for pod in chosen:
            kube.terminate_pod(NS, pod["metadata"]["name"], 75)
        return nodes
    kube._set_lost(nodes[0], False)  # its ConfigMap made once: lose_node in parallel would race to create it
    with concurrent.futures.ThreadPoolExecutor(lost) as pool:
        for f in [pool.submit(kube.lose_node, n, timeout=lose_timeout) for n in nodes[:lost]]:
            f.result()
    return nodes


def failed_status(backend, handle, timeout: float = 180):
    return _wait(lambda: (s := backend.status(handle)).state == "failed" and s, timeout, "the launch to fail", 1.0)


def scale_row(
    kube, work: Path, nodes: int, monkeypatch, *, polls: int, lose_timeout: float, many: int = 8, spares: int = 2
) -> dict[str, Any]:
    """One cluster size: ``nodes`` GPU nodes, a run on nodes/2 with ``spares`` spares; its watch,
    then 1 failed node (diagnose, replace), a second launch, ``many`` failed nodes (half NotReady,
    half a GPU condition False; diagnose, replace; none: no second launch)."""
    from fsdp_resilience.control.backends.eks.backend import EksBackend

    from control.fakes.eks_cluster import NS, WORKER, backend_for, run_config

    meter = ApiMeter(monkeypatch)
    kube.reset(timeout=300)
    row: dict[str, Any] = {"nodes": nodes, "run_nodes": nodes // 2, "spare_nodes": spares}
    t0 = time.perf_counter()
    instances = add_pool(kube, nodes, f"gpu-{nodes}")
    row["setup"] = {"nodes_ready_s": round(time.perf_counter() - t0, 1)}
    backend: EksBackend = backend_for(work, max_unhealthy_share=1.0, pod={"max_pod_disruptions": 0})
    cfg = run_config(work, run_id=f"scale-{nodes}", nodes=nodes // 2, spare_nodes=spares)
    handle, row["submit"] = timed(kube, meter, WORKER.username, lambda: backend.submit(cfg, "0"))
    t0 = time.perf_counter()
    pods = running_pods(kube, handle.job_name, nodes // 2 + spares)
    row["setup"]["pods_running_s"] = round(time.perf_counter() - t0, 1)
    log(f"scale {nodes}: {len(pods)} pods running; the watch, {polls} polls")
    row["watch"] = measure_watch(backend, handle, cfg, kube, meter, polls, monkeypatch)
    log(f"scale {nodes}: watch {row['watch']}")

    rounds = [("fail_1", "0", 1, 0)] + ([(f"fail_{many}", "1", many, many // 2)] if many else [])
    for label, launch, count, lost in rounds:
        if launch != "0":
            handle = backend.submit(cfg, launch)
            pods = running_pods(kube, handle.job_name, nodes // 2 + spares)
        failed = fail_nodes(kube, pods, count, lost, lose_timeout)
        failed_status(backend, handle)
        # diagnose as the launch failed, then stop it (the DAG's stop_launch): the suspended Job's
        # pods go, and with them what names the nodes the healthy-looking pods ran on.
        diagnosis, diagnose = timed(kube, meter, WORKER.username, lambda h=handle: backend.diagnose(h))
        _, stop = timed(kube, meter, WORKER.username, lambda h=handle: backend.cancel(h))
        if sorted(diagnosis.bad_node_ids) != sorted(failed):
            raise RuntimeError(f"diagnose blamed {diagnosis.bad_node_ids}, not the failed {failed}: {diagnosis}")
        client, stubber = asg_client([instances[n] for n in diagnosis.bad_node_ids])
        monkeypatch.setattr(backend, "_autoscaling", lambda client=client: client)
        replaced, replace = timed(
            kube, meter, WORKER.username, lambda d=diagnosis: backend.replace_nodes(d.bad_node_ids, "bench")
        )
        stubber.assert_no_pending_responses()
        if sorted(replaced.replaced) != sorted(failed):
            raise RuntimeError(f"replace_nodes replaced {replaced.replaced}, not {failed}: {replaced.reason}")
        row[label] = {
            "failed": count,
            "not_ready": lost,
            "gpu_condition_false": count - lost,
            "stop": stop,
            "diagnose": diagnose,
            "replace": replace,
            "diagnose_and_replace_s": round(diagnose["wall_s"] + replace["wall_s"], 3),
        }
        log(f"scale {nodes}: {label}: diagnose {diagnose['wall_s']} s, replace {replace['wall_s']} s")
    kube.pods(NS)  # the cluster is still answering
    return row


def bench_scale(work: Path, sizes: list[int], polls: int, *, eks_heartbeat: bool) -> dict[str, Any]:
    """Start a control plane of the tests' (under ``work``), apply the deploy kit, and measure
    each size in ``sizes``."""
    import shutil

    import pytest

    from control.fakes.eks_cluster import start_strict_cluster
    from control.kube.cluster import KubeCluster
    from control.kube.control_plane import ControlPlane, ControlPlaneUnavailable, build

    try:
        cache = build()
    except ControlPlaneUnavailable as e:
        return {"skipped": f"no control plane here: {e}"}
    root = work / "scale"
    shutil.rmtree(root, ignore_errors=True)
    (root / "run").mkdir(parents=True)
    lease, grace = (EKS_LEASE_S, EKS_GRACE_S) if eks_heartbeat else (None, None)
    plane = ControlPlane(cache=cache, workdir=root / "kube")
    if eks_heartbeat:
        plane.node_lease_duration_s, plane.node_monitor_grace_s = lease, grace
    t0 = time.perf_counter()
    plane.start()
    rows = []
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            kube = start_strict_cluster(KubeCluster(plane), root / "run", monkeypatch)
            for n in sizes:
                rows.append(
                    scale_row(
                        kube, root / "run", n, monkeypatch, polls=polls, lose_timeout=plane.node_monitor_grace_s + 90
                    )
                )
    finally:
        plane.stop()
    return {
        "sizes": sizes,
        "polls": polls,
        "kubernetes": plane.version(),
        "node_lease_s": plane.node_lease_duration_s,
        "node_monitor_grace_s": plane.node_monitor_grace_s,
        "wall_s": round(time.perf_counter() - t0, 1),
        "rows": rows,
        "note": "per size N: N kwok nodes shaped like p5.48xlarge, a run on N/2 nodes + 2 spares submitted as the "
        "worker; watch = the real TrainingProgressTrigger's polls as the triggerer (API requests from the "
        "apiserver's audit log, bytes on the client's REST layer, process CPU); fail_1: a GPU condition False "
        "and its pod exit 75; fail_8 (a second launch): 4 nodes NotReady (heartbeat stopped) and 4 with the GPU "
        "condition False and their pods exit 75; diagnose and replace_nodes (replacement=asg, Auto Scaling behind "
        "a botocore Stubber) timed as the worker calls them.",
    }
