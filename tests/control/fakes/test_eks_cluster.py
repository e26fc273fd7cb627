"""The EKS cluster as the tests have it: nodes of the GPU pool as EKS shows them (kwok nodes on the
real control plane), node groups as Auto Scaling groups in moto, and TrainingPodPlayer, which
plays a training pod's part on the run dir with the run contract (checkpoints committed by node 0,
events, the exit code a scenario picks, through kwok)."""

from __future__ import annotations

from fsdp_resilience.training.contract import CheckpointCatalog, ExitCode, read_events

from control.fakes.eks_cluster import (
    GPU_TAINT,
    MONITORING_AGENT_CONDITIONS,
    NS,
    POOL,
    TrainingPodPlayer,
    add_gpu_node,
    asg_instances,
    backend_for,
    make_asg,
    run_config,
    wait_for,
)


def test_a_gpu_node_looks_like_a_p5_of_the_pool(cluster):
    node = add_gpu_node(cluster, "gpu-0", "i-0123")
    assert POOL.items() <= node["metadata"]["labels"].items()
    assert GPU_TAINT in node["spec"]["taints"]
    assert node["status"]["allocatable"]["nvidia.com/gpu"] in (8, "8")
    assert node["spec"]["providerID"].endswith("/i-0123")
    assert node["status"]["allocatable"]["vpc.amazonaws.com/efa"] == "32"
    assert node["metadata"]["labels"]["topology.kubernetes.io/zone"] == "us-west-2a"
    conditions = {c["type"]: c["status"] for c in cluster.node("gpu-0")["status"]["conditions"]}
    assert {t: "True" for t in MONITORING_AGENT_CONDITIONS}.items() <= conditions.items()
    assert conditions["Ready"] == "True"


def test_a_node_group_is_an_auto_scaling_group(aws):
    instances = make_asg("fake-group", 3)
    assert len(instances) == 3 and instances == asg_instances("fake-group")


def _final_events(cfg) -> list[dict]:
    return read_events(cfg.layout.events, "final")


def test_the_kubelet_plays_a_launch_that_succeeds_and_one_that_fails(cluster, tmp_path):
    for i in range(2):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    cfg = run_config(tmp_path, run_id="played", steps=20, checkpoint_interval=5)

    def scenario(launch_id: str, index: int, node: str) -> int | None:
        if launch_id == "0":
            return 0
        # launch 1: node 0 gives up; node 1 keeps running until the Job's failure stops its pod
        return int(ExitCode.RESTARTS_EXHAUSTED) if index == 0 else None

    with TrainingPodPlayer(cluster, scenario, fail_at_step=10):
        handle = backend.submit(cfg, "0")
        wait_for(lambda: backend.status(handle).state == "succeeded", 60, "launch 0 to succeed")
        assert [c.step for c in CheckpointCatalog(cfg.run_dir).committed()] == [5, 10, 15, 20]
        assert [e["exit_code"] for e in _final_events(cfg)] == [0, 0]

        handle = backend.submit(cfg, "1")
        status = wait_for(lambda: (s := backend.status(handle)).state == "failed" and s, 60, "launch 1 to fail")
        assert status.failure_class == "restarts_exhausted"
    finals = [e for e in _final_events(cfg) if e.get("launch_id") == "1"]
    assert {e["failure_class"] for e in finals} == {"restarts_exhausted"}
    assert cluster.pods(NS, handle.job_name)
