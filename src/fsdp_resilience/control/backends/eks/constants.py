"""The names the EKS backend gives what it creates and reads on the cluster: labels, annotations,
the quarantine taint, the pods' container, env, ports, volumes and devices, and the Kubernetes
range the objects are built for. Shared by the object builders, the status readers and the node
logic, so each name is defined once.
"""

from __future__ import annotations

import re

#: The supported EKS range is OLDEST_SUPPORTED_K8S..NEWEST_SUPPORTED_K8S (1.30-1.37). The floor
#: is the deploy kit's: its ValidatingAdmissionPolicies (node writes, NodeClaim deletes, the
#: training namespace's pod rules) use admissionregistration.k8s.io/v1, GA and served from 1.30.
#: The objects manifests.py builds need 1.29: the Jobs rely on podFailurePolicy (beta and on by default
#: since 1.26, GA in 1.31) and the DisruptionTarget pod condition, but up to 1.28 the schema wants
#: ``onPodConditions`` on every rule, exit-code rules included; and from 1.29 a Job with a
#: podFailurePolicy replaces a failed pod only once it has fully terminated (podReplacementPolicy),
#: so two pods never hold the same index and hostname at once.
OLDEST_SUPPORTED_K8S = "1.30"
#: The newest Kubernetes the objects and the kit are validated against, and the version of the
#: control plane the EKS tests run on (tests/control/kube; also emulating 1.35, the oldest minor in
#: EKS standard support on 2026-12-03).
NEWEST_SUPPORTED_K8S = "1.37"

#: The one container of every pod; the Job's podFailurePolicy rules refer to it by name.
CONTAINER = "trainer"
LABEL_RUN = "fsdp-resilience/run-id"  # value: the run id (a DNS-1123 label, so a valid label value)
LABEL_LAUNCH = "fsdp-resilience/launch-id"  # value: label_value(launch id); exact id in an annotation
LABEL_JOB = "fsdp-resilience/job-name"  # on pods: the Job's name; the Service selects by it
LABEL_AIRFLOW_RUN = "fsdp-resilience/airflow-run-id"  # value: label_value(dag run id); exact in an annotation
LABEL_COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = {"app.kubernetes.io/managed-by": "fsdp-resilience", "app.kubernetes.io/name": "fsdp-training"}

COMPONENT_TRAINING = "training"
COMPONENT_EVALUATION = "evaluation"
#: Annotations carry the exact ids, which label values may not hold (``:``, ``+``, > 63 chars).
ANNOTATION_LAUNCH = LABEL_LAUNCH
ANNOTATION_AIRFLOW_RUN = LABEL_AIRFLOW_RUN
#: The evaluation Job's name is ``job_name_for(run_id, "eval-<checkpoint id>")`` (``EVAL_LAUNCH_ID``
#: alone when no checkpoint is named).
EVAL_LAUNCH_ID = "eval"

#: The name of the container port (and Service port) the rendezvous store listens on.
RDZV_PORT_NAME = "rdzv"
SHM_VOLUME = "dshm"
FSX_VOLUME = "fsx"
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"

TRAINING_COMMAND = ["python", "-m", "fsdp_resilience.training.launch"]
#: The env the data plane reads (src/fsdp_resilience/training/launch/config.py and contract/).
#: settings.env may not override these: they are what makes a pod a node of this launch.
CONFIG_ENV = "TRAINING_RUN_CONFIG"
LAUNCH_ID_ENV = "TRAINING_LAUNCH_ID"
NODE_ID_ENV = "TRAINING_NODE_ID"
RDZV_HOST_ENV = "TRAINING_RDZV_HOST"
#: The pod's UID (downward API metadata.uid): the launch lock tells a recreated pod's predecessor
#: by it (contract.POD_UID_ENV).
POD_UID_ENV = "TRAINING_POD_UID"
#: The launch's incarnation, its Job's UID (downward API, the label the Job controller puts on its
#: pods): whether a launch ended is read from its own incarnation's records (contract.LAUNCH_UID_ENV).
LAUNCH_UID_ENV = "TRAINING_LAUNCH_UID"
#: The label the Job controller (Kubernetes >= 1.27) sets to the Job's UID on every pod it creates.
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"
RESERVED_ENV = frozenset({CONFIG_ENV, LAUNCH_ID_ENV, NODE_ID_ENV, RDZV_HOST_ENV, POD_UID_ENV, LAUNCH_UID_ENV})

#: libfabric over EFA, as the AWS EFA-on-EKS guides set it up (only when the pods get EFA devices).
EFA_ENV = {
    # Use the EFA provider, never a silent fallback to TCP sockets (which still "works", slowly).
    "FI_PROVIDER": "efa",
    # The launcher, workers and data loaders fork; without this a child can corrupt the parent's
    # RDMA-registered memory.
    "FI_EFA_FORK_SAFE": "1",
}
#: GPUDirect RDMA: the NIC reads and writes GPU memory without a host copy. Only on the instance
#: families whose EFA devices support it (DEVICE_RDMA_FAMILIES): elsewhere (g5, g6e...) libfabric
#: refuses to start with it set. An instance type not listed gets no setting, and libfabric decides.
DEVICE_RDMA_ENV = {"FI_EFA_USE_DEVICE_RDMA": "1"}
#: EC2 instance families (the part of the type before the '.') with EFA device RDMA to the GPUs.
DEVICE_RDMA_FAMILIES = frozenset({"p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "p6-b300", "p6e-gb200"})
#: Node label with the EC2 instance type (set by the kubelet on EKS; Karpenter selects by it too).
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
#: Node label with the availability zone (the kubelet sets it from the cloud provider on EKS).
#: EFA traffic stays within one subnet, so within one zone: a launch's pods share one (a required
#: pod affinity on it), and PodTemplateSettings.zone pins them to a given one.
ZONE_LABEL = "topology.kubernetes.io/zone"
#: On the training pods: Karpenter neither consolidates nor drifts a node while such a pod runs on
#: it (it still replaces a node whose instance is gone or interrupted).
DO_NOT_DISRUPT_ANNOTATION = "karpenter.sh/do-not-disrupt"

#: The computed /dev/shm (PodTemplateSettings.shm_size None) is the estimate times this margin:
#: the estimate's own allowances (NCCL, libfabric) are round figures, and a full /dev/shm fails a
#: checkpoint hours into a run. The size is a cap, not a reservation, so the margin costs nothing
#: until it is used.
SHM_MARGIN = 1.25
#: The evaluation pod's /dev/shm: one process, no async checkpoint, no NCCL peers.
EVAL_SHM_SIZE = "8Gi"
#: Memory (GiB) of the GPU instance types the pods are sized for, from EC2's instance type pages;
#: an instance type not listed is not checked.
NODE_MEMORY_GIB = {
    "p4d.24xlarge": 1152,
    "p4de.24xlarge": 1152,
    "p5.4xlarge": 256,
    "p5.48xlarge": 2048,
    "p5e.48xlarge": 2048,
    "p5en.48xlarge": 2048,
}
#: The share of an instance's memory a pod can have: the kernel's own (MemTotal is a few percent
#: below the nominal size), the kubelet's kube-reserved and eviction threshold (on EKS AL2023 about
#: 1.4 GiB for a p5), and the daemonsets (device plugins, CNI, node agents).
NODE_ALLOCATABLE_FRACTION = 0.95
#: NCCL behaviour the restart layers rely on (only when the pods get GPUs).
NCCL_ENV = {
    # NCCL's bootstrap traffic goes over the pod's network interface, never loopback or a bridge.
    "NCCL_SOCKET_IFNAME": "^lo,docker",
    # NCCL errors (a dead EFA link, a peer gone) reach the pod log that diagnose() reads,
    # without INFO's volume.
    "NCCL_DEBUG": "WARN",
    # A NCCL error or timeout aborts the communicator and fails the rank instead of hanging it,
    # so NVRx's restart layers see the fault (ft_launcher also defaults it to 1).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}

#: A valid label value (also what node_selector values must be).
LABEL_VALUE_FORMAT = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_VALUE_MAX = 63

# What the backend writes on Jobs, nodes and Auto Scaling groups.
#: Tainted on a node taken out of service (with ``spec.unschedulable``), so nothing of ours lands
#: there again even if someone uncordons it by hand; its value says why (a label value).
QUARANTINE_TAINT = "fsdp-resilience/quarantined"
#: The full reason and time, on the node.
QUARANTINE_ANNOTATION = "fsdp-resilience/quarantine-reason"
#: On a node returned to service (return_nodes): when, by whom, why, and the quarantine it ended.
RETURN_ANNOTATION = "fsdp-resilience/return-reason"
#: On a Job the control plane stopped: the verdict (failure class, message) and its nodes.
CANCEL_ANNOTATION = "fsdp-resilience/cancel"
#: On a Job the backend suspended because its training nodes succeeded (a cluster without the
#: Job's successPolicy, where the spare indices keep it from completing): when and why.
SUCCEEDED_ANNOTATION = "fsdp-resilience/succeeded"
#: Auto Scaling groups whose instances the backend may terminate carry this tag = "true" (the
#: deploy kit's IAM policy allows TerminateInstanceInAutoScalingGroup only on them).
MANAGED_ASG_TAG = "fsdp-resilience/managed"
