"""fsdp_training on the EKS backend with dag.test(): the same DAG as on the local backend, switched
by the `backend` param alone. Kubernetes is a real control plane (tests/control/kube:
kube-apiserver, controller-manager and scheduler, kwok's nodes) with the rendered deploy kit
applied (eks_cluster.start_strict_cluster: the RBAC authorizer, the kit's admission policies, Pod
Security; the tasks call with a real token of the worker's ServiceAccount, the triggers with the
triggerer's); the node group is an Auto Scaling group in moto, FSx a temp folder, and the training
pods are played by eks_cluster.TrainingPodPlayer, which ends them through kwok. Everything the
cluster's controllers do (Jobs' pods, scheduling, evictions, PodGC) happens by itself, a moment
later.

The scenario of the issue: launch -> the pod on node X ends with restarts exhausted -> X is
cordoned and tainted and its instance terminated in the ASG -> the replacement instance joins as a
new Ready node -> relaunch from the newest checkpoint -> success -> evaluation Job -> report ->
export of the run's records and verified checkpoint to S3 with an FSx data repository task
(botocore Stubber: moto has none). The same under Karpenter (real Karpenter, its kwok cloud
provider, tests/control/kube/karpenter.py): it provisions the launch's nodes, X's NodeClaim is
deleted, Karpenter terminates X and provisions a node for the relaunch's pod left pending. And
what must never climb the ladder: a full run dir, a run another launcher holds; and a checkpoint
whose bytes changed after its commit, which nothing trusts. And what never starts: an `image`
outside the image allowlist fails validate_config. With a spare: a lost node replaced while
training goes on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_resilience.control.backends.eks import QUARANTINE_TAINT
from fsdp_resilience.training.contract import (
    CheckpointCatalog,
    Event,
    EventLog,
    ExitCode,
    FailureClass,
    exit_code_for,
    final_status,
    read_events,
)
from fsdp_resilience.training.contract.replacements import read_membership_deadline

from control.fakes.eks_cluster import (
    LOSE_NODE,
    NS,
    PARK,
    TOLERATIONS,
    WORKER,
    TrainingPodPlayer,
    add_gpu_node,
    asg_instances,
    make_asg,
    start_strict_cluster,
    wait_for,
)
from control.fakes.fsx_stubs import (  # noqa: F401
    FS,
    a_task,
    expect_associations,
    expect_create,
    expect_describe,
    expect_file_system,
    expect_in_flight,
    stub,
)
from control.fakes.saved_checkpoints import flip_bytes
from control.kube.karpenter import CLAIMS, karpenter_nodes
from control.support import make_dataset
from control.support.dag_runs import states, trigger, xcom

pytestmark = pytest.mark.slow


@pytest.fixture
def eks_env(tmp_path, monkeypatch, aws):
    """The Airflow workers' settings for the EKS backend (the tests ask for ``cluster`` too, or
    start the Karpenter kit's)."""
    fsx = tmp_path / "fsx"  # FSx for Lustre, as mounted in the Airflow workers and the pods
    env = {
        "FSDP_RUNS_ROOT": str(fsx / "runs"),
        "FSDP_DATA_ROOT": str(fsx / "datasets"),
        "FSDP_FSX_MOUNT_PATH": str(fsx),
        "FSDP_EKS_IMAGE": "123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp:test",
        "FSDP_KUBERNETES_CONN_ID": "kubernetes_fake",
        "FSDP_AWS_CONN_ID": "aws_fake",
        "FSDP_AWS_REGION": "us-west-2",
        # A lost node's pods evicted 2 s after it is tainted unreachable, not 300 s (TOLERATIONS).
        "FSDP_EKS_POD": json.dumps({"tolerations": TOLERATIONS}),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    make_dataset(fsx / "datasets" / "c4")
    return fsx


def expect_export(stub, paths: list[str]) -> None:
    """export_to_s3: the file system, its associations, no task in flight, the task for exactly
    ``paths``, and its success."""
    expect_file_system(stub)
    expect_associations(stub)
    expect_in_flight(stub)
    expect_create(stub, paths, "EXPORT_TO_REPOSITORY")
    expect_describe(
        stub,
        a_task(
            "SUCCEEDED", "EXPORT_TO_REPOSITORY", paths, Status={"TotalCount": 9, "SucceededCount": 9, "FailedCount": 0}
        ),
    )


def run_records(run: str) -> list[str]:
    """What the export takes of a run besides its checkpoint: what the pods, evaluate and
    build_report wrote (the fake pods write no run.json or logs)."""
    return [f"runs/{run}/{name}" for name in ("eval.json", "events.jsonl", "report")]


def rendezvous(placed: dict[str, dict[int, str]], launch_id: str, nodes: int) -> None:
    """Wait, as a launch's ranks do at their first rendezvous, until all ``nodes`` pods of launch
    ``launch_id`` arrived (``placed[launch_id]``: the indices the player started): node 0 never
    trains alone. (A relaunch's pods start apart when one waits for a new node; without this, node 0
    would finish before it and the other pod take its place.) An arrival barrier, not a count of
    Running pods: node 0 may finish before the player gets to the last pod of its launch."""
    wait_for(
        lambda: len(placed.get(launch_id, {})) >= nodes, timeout=300, what=f"the {nodes} pods of launch {launch_id}"
    )


def test_restarts_exhausted_on_one_node_replace_it_through_the_asg_and_finish(eks_env, cluster, stub, monkeypatch):
    monkeypatch.setenv("FSDP_FSX_FILE_SYSTEM_ID", FS)
    # Only the run's records and the verified, evaluated checkpoint go to S3.
    expect_export(stub, sorted(["runs/llm-eks/checkpoints/step_00000020", *run_records("llm-eks")]))
    instances = make_asg("gpu-ng", 2)
    for i, instance in enumerate(instances):
        add_gpu_node(cluster, f"gpu-{i}", instance)
    placed: dict[str, dict[int, str]] = {}

    def scenario(launch_id: str, index: int, node: str):
        placed.setdefault(launch_id, {})[index] = node
        rendezvous(placed, launch_id, 2)
        if launch_id == "0":  # node 1's GPU keeps faulting: its restarts run out; node 0 waits
            return int(ExitCode.RESTARTS_EXHAUSTED) if index == 1 else None
        return 0

    with TrainingPodPlayer(cluster, scenario, fail_at_step=10, asg="gpu-ng", threaded=True) as kubelet:
        dr = trigger(
            {
                "run_name": "llm-eks",
                "backend": "eks",
                "dataset": "c4",
                "nodes": 2,
                "procs_per_node": 2,
                "steps": 20,
                "checkpoint_interval": 5,
                "max_node_replacements": 1,
            }
        )
    st = states(dr)
    assert str(dr.state) == "success", st
    bad = placed["0"][1]
    bad_instance = instances[int(bad.split("-")[1])]

    # The ladder: launch 0 failed with restarts exhausted; rung 1 replaced the bad node.
    assert xcom(dr, "watch_checkpoints")["failure_class"] == "restarts_exhausted"
    replaced = xcom(dr, "escalation_1.diagnose_and_replace")
    assert replaced["replaced"] == [bad] and replaced["failure_class"] == "restarts_exhausted", replaced
    assert any("ECC" in e for e in replaced["evidence"])
    node = cluster.node(bad)
    assert node["spec"]["unschedulable"] and any(t["key"] == QUARANTINE_TAINT for t in node["spec"]["taints"])
    assert bad_instance not in asg_instances("gpu-ng") and len(asg_instances("gpu-ng")) == 2
    assert len(kubelet.joined) == 1  # the replacement instance joined as a new node...
    assert bad not in placed["1"].values() and kubelet.joined[0] in placed["1"].values()  # ...and got a pod
    assert st["escalation_2.decide"] == "skipped"

    # Relaunched from the newest checkpoint, finished, evaluated, reported.
    run_dir = eks_env / "runs" / "llm-eks"
    assert CheckpointCatalog(run_dir).latest().step == 20
    assert xcom(dr, "evaluate")["checkpoint_id"] == "step_00000020"
    assert Path(xcom(dr, "build_report")["markdown"]).is_file()
    escalations = [r for r in read_events(run_dir / "events.jsonl") if r["event"] == Event.ESCALATION.value]
    assert [(r["from_launch"], r["to_launch"], r["nodes"]) for r in escalations] == [("0", "1", [bad])]
    jobs = [r.name for r in cluster.requests if r.resource == "jobs" and r.verb == "create"]
    assert len(jobs) == 3  # launch 0, launch 1, the evaluation
    assert all(p["metadata"]["namespace"] == NS for p in cluster.pods(NS))
    assert st["export_to_s3"] == "success" and st["publish"] == "success"


def claims(kube) -> dict[str, str]:
    """Karpenter's NodeClaims by the name of their node."""
    return {c["status"].get("nodeName"): c["metadata"]["name"] for c in kube.get(CLAIMS)["items"]}


def test_restarts_exhausted_under_karpenter_delete_the_nodeclaim_and_finish_on_the_node_it_provisions(
    eks_env, kube, gpu_pool, karpenter, tmp_path, monkeypatch
):
    # Real Karpenter (its kwok cloud provider) with the NodePool gpu: no node until a launch's pods
    # are pending, then one p5.48xlarge NodeClaim and node for each.
    cluster = start_strict_cluster(kube, tmp_path, monkeypatch, "example-karpenter")
    monkeypatch.setenv("FSDP_EKS_REPLACEMENT", "karpenter")
    placed: dict[str, dict[int, str]] = {}
    claim_of: dict[str, str] = {}  # node -> its NodeClaim, as launch 0's pods found them

    def scenario(launch_id: str, index: int, node: str):
        placed.setdefault(launch_id, {})[index] = node
        if launch_id == "0":  # (a pod may run before Karpenter writes the claim's nodeName)
            claim_of[node] = wait_for(lambda: claims(cluster).get(node), timeout=60, what=f"the NodeClaim of {node}")
        rendezvous(placed, launch_id, 2)
        if launch_id == "0":  # node 1's restarts run out; node 0 waits
            return int(ExitCode.RESTARTS_EXHAUSTED) if index == 1 else None
        return 0

    with TrainingPodPlayer(cluster, scenario, fail_at_step=10, threaded=True):
        dr = trigger(
            {
                "run_name": "llm-karpenter",
                "backend": "eks",
                "dataset": "c4",
                "nodes": 2,
                "procs_per_node": 2,
                "steps": 20,
                "checkpoint_interval": 5,
                "max_node_replacements": 1,
            }
        )
    karpenter.check_alive()
    st = states(dr)
    assert str(dr.state) == "success", st
    bad = placed["0"][1]
    replaced = xcom(dr, "escalation_1.diagnose_and_replace")
    assert replaced["replaced"] == [bad] and replaced["failure_class"] == "restarts_exhausted", replaced
    # The worker deleted the bad node's NodeClaim (the kit allows the GPU pool's), and nothing else.
    deletes = [(r.name, r.user) for r in cluster.requests if r.resource == "nodeclaims" and r.verb == "delete"]
    assert deletes == [(claim_of[bad], WORKER.username)], deletes
    # Karpenter drained and terminated it (the node and its claim are gone)...
    wait_for(lambda: not cluster.exists(f"/api/v1/nodes/{bad}"), timeout=240, what=f"Karpenter to end node {bad}")
    wait_for(lambda: not cluster.exists(f"{CLAIMS}/{claim_of[bad]}"), timeout=60, what="the bad NodeClaim gone")
    # ...and launch 1 finished on a node it provisioned for the pod left pending (a claim of its own).
    assert bad not in placed["1"].values(), placed
    new = set(placed["1"].values()) - set(placed["0"].values())
    assert new and new <= set(karpenter_nodes(cluster)), (placed, sorted(karpenter_nodes(cluster)))
    now = {c["status"].get("nodeName"): c for c in cluster.get(CLAIMS)["items"]}
    for node in new:
        assert now[node]["metadata"]["labels"]["karpenter.sh/nodepool"] == "gpu"
        assert now[node]["metadata"]["name"] not in claim_of.values()
    assert st["escalation_2.decide"] == "skipped"
    assert CheckpointCatalog(eks_env / "runs" / "llm-karpenter").latest().step == 20
    assert xcom(dr, "evaluate")["checkpoint_id"] == "step_00000020"
    assert len([r for r in cluster.requests if r.resource == "jobs" and r.verb == "create"]) == 3


def test_a_checkpoint_that_fails_its_checksum_is_neither_evaluated_nor_exported_nor_published(
    eks_env, cluster, stub, monkeypatch
):
    # The final checkpoint commits, then a few of its bytes flip on FSx (a bad disk, a stray write).
    monkeypatch.setenv("FSDP_FSX_FILE_SYSTEM_ID", FS)
    expect_export(stub, sorted(["runs/flipped/checkpoints/step_00000015", *run_records("flipped")]))
    add_gpu_node(cluster, "gpu-0")

    def damage(cfg):
        flip_bytes(cfg.layout.checkpoint_dir(20) / "__1_0.distcp")

    with TrainingPodPlayer(cluster, lambda launch_id, index, node: 0, after_commits=damage) as kubelet:
        dr = trigger(
            {
                "run_name": "flipped",
                "backend": "eks",
                "dataset": "c4",
                "nodes": 1,
                "procs_per_node": 2,
                "steps": 20,
                "checkpoint_interval": 5,
                "max_node_replacements": 1,
            }
        )
    st = states(dr)
    assert str(dr.state) == "success", st
    run_dir = eks_env / "runs" / "flipped"
    # The launch succeeded with step 20 committed; nothing trusted it after that.
    assert xcom(dr, "watch_checkpoints")["checkpoint_id"] == "step_00000020"
    evaluation = xcom(dr, "evaluate")
    assert kubelet.evaluated == ["step_00000015"] and evaluation["checkpoint_id"] == "step_00000015"
    [skipped] = evaluation["checkpoint_check"]["skipped"]
    assert skipped["checkpoint_id"] == "step_00000020" and "__1_0.distcp fails its crc32c check" in skipped["reason"]
    published = xcom(dr, "publish")
    assert published["checkpoint"] == str(run_dir / "checkpoints" / "step_00000015")
    assert published["verified"] == "checksums" and "note" not in published
    assert [s["checkpoint_id"] for s in published["skipped"]] == ["step_00000020"]
    # On EKS the control plane never moves checkpoints on FSx: it skips, and says so.
    assert (run_dir / "checkpoints" / "step_00000020").is_dir() and not (
        run_dir / "checkpoints" / "quarantine"
    ).exists()
    skips = [r for r in read_events(run_dir / "events.jsonl") if r["event"] == Event.CHECKPOINT_SKIP.value]
    assert {(r["checkpoint_id"], r["role"], r["task"]) for r in skips} == {
        ("step_00000020", "control-plane", "evaluate"),
        ("step_00000020", "control-plane", "publish"),
    }
    report = Path(xcom(dr, "build_report")["markdown"]).read_text()
    assert "## Checkpoints that failed" in report and report.count("| step_00000020 |") == 1


@pytest.mark.parametrize("failure, nodes", [(FailureClass.STORAGE_ERROR, 2), (FailureClass.ALREADY_RUNNING, 1)])
def test_storage_and_already_running_fail_the_run_without_touching_a_node(eks_env, cluster, failure, nodes):
    group = f"gpu-ng-{failure.value.replace('_', '-')}"  # moto's account lives for the module
    instances = make_asg(group, 2)
    for i, instance in enumerate(instances):
        add_gpu_node(cluster, f"gpu-{i}", instance)
    run_dir = eks_env / "runs" / "no-replace"
    # What the run's events said before this DAG run: another launcher finished it.
    EventLog(run_dir / "events.jsonl", run_id="no-replace", launch_id="by-hand", node_rank=0).emit(
        Event.FINAL, failure_class="success", exit_code=0, step=10, message="trained by hand"
    )
    status_before = final_status(run_dir)
    code = int(exit_code_for(failure))

    def scenario(launch_id: str, index: int, node: str):
        return code if index == nodes - 1 else None  # the last node fails; the others keep training

    with TrainingPodPlayer(cluster, scenario, fail_at_step=10, asg=group, threaded=True):
        dr = trigger(
            {
                "run_name": "no-replace",
                "backend": "eks",
                "dataset": "c4",
                "nodes": nodes,
                "procs_per_node": 2,
                "steps": 20,
                "checkpoint_interval": 5,
                "max_node_replacements": 2,
            }
        )
    st = states(dr)
    assert str(dr.state) == "failed", st
    assert xcom(dr, "watch_checkpoints")["failure_class"] == failure.value
    assert all(st[f"escalation_{k}.decide"] == "skipped" for k in (1, 2, 3)), st
    assert st["resolve_outcome"] == "failed" and st["evaluate"] == "upstream_failed"
    # No node was cordoned, tainted or replaced; no relaunch; no escalation event.
    assert not [r for r in cluster.requests if r.resource == "nodes" and r.verb == "patch"]
    assert asg_instances(group) == sorted(instances)
    assert len([r for r in cluster.requests if r.resource == "jobs" and r.verb == "create"]) == 1
    events = read_events(run_dir / "events.jsonl")
    assert not [r for r in events if r["event"] == Event.ESCALATION.value]
    if failure is FailureClass.ALREADY_RUNNING:
        # The refused pod wrote nothing: the run's status is what the other launcher left.
        assert final_status(run_dir) == status_before


def test_an_image_outside_the_allowlist_fails_validate_config_and_nothing_is_submitted(eks_env, cluster, monkeypatch):
    from fsdp_resilience.control import ladder
    from fsdp_resilience.training.contract import ConfigError

    add_gpu_node(cluster, "gpu-0")
    repository = "123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp"
    conf = {
        "run_name": "evil",
        "backend": "eks",
        "dataset": "c4",
        "nodes": 1,
        "procs_per_node": 2,
        "steps": 10,
        "checkpoint_interval": 5,
        "image": f"{repository}-evil:1",
    }
    # The default allowlist is FSDP_EKS_IMAGE's repository, matched by whole path components.
    with pytest.raises(
        ConfigError, match=rf"not allowed: images must come from {repository} .*FSDP_EKS_IMAGE_ALLOWLIST"
    ):
        ladder.build_run_config(conf, "manual__1")
    assert ladder.build_run_config({**conf, "image": f"{repository}:2"}, "manual__1").backend["image_allowlist"] == [
        repository
    ]
    monkeypatch.setenv("FSDP_EKS_IMAGE_ALLOWLIST", f"{repository}, 123456789012.dkr.ecr.us-west-2.amazonaws.com/eval")
    assert ladder.build_run_config(
        {**conf, "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/eval/x:1"}, "manual__1"
    )

    monkeypatch.delenv("FSDP_EKS_IMAGE_ALLOWLIST")
    # What the backend would refuse at submit is refused here too: more processes than GPUs per pod.
    with pytest.raises(ConfigError, match=r"procs_per_node=16 is more than the 8 GPU"):
        ladder.build_run_config({**conf, "image": f"{repository}:2", "procs_per_node": 16}, "manual__1")
    dr = trigger(conf)
    st = states(dr)
    assert str(dr.state) == "failed" and st["validate_config"] == "failed", st
    assert st["launch_training"] == "upstream_failed"
    assert not [r for r in cluster.requests if r.verb == "create"]  # nothing reached the cluster


def test_a_lost_node_behind_a_spare_is_replaced_while_training_goes_on_and_its_pod_rejoins_as_the_spare(
    eks_env, cluster
):
    """nodes=2 + 1 spare on EKS. Node 1 stops reporting at step 10 (its pod Terminating, deleted by
    the taint manager): the job stays running with node 1 lost and the spare covering it. While
    node 0 trains on, keep_spare_pool cordons and taints node 1 and has the ASG replace its
    instance; the node object goes with the instance (the cloud node lifecycle controller), PodGC
    fails the pod, and the Job controller recreates index 1, whose launcher parks as the new spare.
    The launch then succeeds: one Job, no rung. As in test_training_dag's local counterpart, the
    watch's trigger and keep_spare_pool run side by side, as the triggerer runs them (dag.test()
    runs one task at a time, so the keeper would only start once the watch saw the launch end)."""
    import asyncio
    import copy

    from airflow.dag_processing.dagbag import DagBag

    from fsdp_resilience.control import ladder
    from fsdp_resilience.control.backends import JobHandle, get_backend
    from fsdp_resilience.control.operators.spare_pool import SparePoolKeeper
    from fsdp_resilience.control.sensors.checkpoint_progress import CheckpointProgressSensor
    from fsdp_resilience.control.task_data import Outcome
    from fsdp_resilience.control.triggers.training_progress import TrainingProgressTrigger

    from control.support import REPO
    from control.support.dag_runs import XComs as _XComs
    from control.support.dag_runs import first_event as _first_event

    instances = make_asg("gpu-ng-spares", 5)
    for i, instance in enumerate(instances):
        add_gpu_node(cluster, f"gpu-{i}", instance)
    seen: dict[int, list[str]] = {}

    def scenario(launch_id: str, index: int, node: str):
        seen.setdefault(index, []).append(node)
        if index == 0:
            return 0
        if index == 1 and len(seen[1]) == 1:
            return LOSE_NODE  # the node of index 1 stops reporting once node 0 committed step 10
        return PARK  # the spare (index 2), and index 1's pod once the Job recreated it

    def refilled(cfg, launch_id):
        """Node 0 trains on until the pool is whole again: a spare_added record, and index 1's
        recreated pod parked as a spare."""
        wait_for(
            lambda: (
                [r for r in read_events(cfg.layout.events) if r["event"] == Event.SPARE_ADDED.value]
                and len(seen.get(1, [])) == 2
                and len(kubelet.parked.get(launch_id, [])) == 2
            ),
            timeout=300,
            what="the spare pool to be refilled",
        )

    conf = {
        "run_name": "spares-eks",
        "backend": "eks",
        "dataset": "c4",
        "nodes": 2,
        "spare_nodes": 1,
        "restart_mode": "layered",
        "procs_per_node": 2,
        "steps": 20,
        "checkpoint_interval": 5,
        "max_node_replacements": 1,
    }
    params = copy.deepcopy(DagBag(dag_folder=str(REPO / "dags")).get_dag("fsdp_training").params)
    params.update(conf)
    with TrainingPodPlayer(
        cluster, scenario, fail_at_step=10, asg="gpu-ng-spares", ccm=True, midway=refilled, threaded=True
    ) as kubelet:
        run = ladder.build_run_config(params.validate(), "manual__spares")  # validate_config
        launch = ladder.launch(run, launch_no=0)  # launch_training
        watch = CheckpointProgressSensor(task_id="watch_checkpoints", launch=launch)
        keeper = SparePoolKeeper(task_id="keep_spare_pool", launch=launch, poll_interval_s=1.0)
        context = {"ti": _XComs(validate_config=run, launch_training=launch)}

        async def keep_pool() -> dict:
            from airflow.sdk.exceptions import TaskDeferred

            try:
                return await asyncio.to_thread(keeper.execute, context)
            except TaskDeferred as deferred:
                trigger = deferred.trigger
            while True:
                # The trigger in a task of its own: it calls as the triggerer, the task as the worker.
                event = await asyncio.create_task(_first_event(trigger))
                try:
                    return await asyncio.to_thread(keeper.execute_complete, context, event)
                except TaskDeferred as deferred:
                    trigger = deferred.trigger

        async def side_by_side():
            watching = TrainingProgressTrigger(**watch._trigger_kwargs(), poll_interval_s=1.0)
            return await asyncio.wait_for(
                asyncio.gather(asyncio.create_task(_first_event(watching)), keep_pool()), timeout=480
            )

        try:
            outcome, kept = asyncio.run(side_by_side())
            outcome = Outcome.from_dict(watch.execute_complete(context, outcome))  # the watch's XCom
            # The watch reads success from the success policy being met; the Job controller writes
            # Complete once the pods are gone, on its own schedule: read it before the cancel below.
            job = wait_for(
                lambda: (
                    (j := cluster.job(NS, launch.handle["job_name"]))
                    and any(
                        c["type"] == "Complete" and c["status"] == "True" for c in j["status"].get("conditions") or []
                    )
                    and j
                ),
                timeout=120,
                what="the Job controller to mark the Job Complete",
            )
        finally:
            get_backend(**run.backend).cancel(JobHandle.from_dict(launch.handle))
    assert outcome.outcome == "success" and outcome.launch_id == "0", outcome
    climb, why = ladder.should_escalate(outcome, rung=1, max_replacements=1)
    assert not climb, why
    lost = seen[1][0]
    events = read_events(eks_env / "runs" / "spares-eks" / "events.jsonl")
    [added] = [r for r in events if r["event"] == Event.SPARE_ADDED.value]
    assert added["lost_node_id"] == lost and added["lost_node_rank"] == 1 and added["quarantined"] == [lost]
    assert added["node_rank"] == 1  # on EKS the Job recreates the lost index: it is the new spare
    # Survivors waiting for a node would wait for it: the backend had a place for it.
    coming = read_membership_deadline(eks_env / "runs" / "spares-eks" / "control", "0")
    assert coming is not None and coming.coming and "the pool keeper added a spare for node 1" in coming.why
    assert [s["lost_node_id"] for s in kept["spares_added"]] == [lost] and kept["state"] == "succeeded", kept
    # The lost node was cordoned and tainted, its instance replaced, and the node object deleted.
    assert lost in kubelet.deleted_nodes and len(asg_instances("gpu-ng-spares")) == 5
    node_patches = [r for r in cluster.requests if r.resource == "nodes" and r.verb == "patch"]
    # (A 409 retried is fine: the node lifecycle controller writes the lost node too.)
    assert {r.name for r in node_patches} == {lost} and [r.code for r in node_patches if r.code < 300] == [200]
    # The recreated pod of index 1 parked on a node other than the lost one, and exited 0 with the rest.
    assert seen[1][1] != lost and seen[2] and seen[0]
    standby = [r for r in events if r["event"] == "launch_begin" and r.get("standby")]
    assert sorted(r["node_rank"] for r in standby) == [1, 2]
    # One Job, never relaunched; it completed with every index (the spares' too).
    assert len([r for r in cluster.requests if r.resource == "jobs" and r.verb == "create"]) == 1
    assert job["status"]["failed"] == 1 and CheckpointCatalog(eks_env / "runs" / "spares-eks").latest().step == 20
