"""The kit's example Karpenter v1 NodePool and EC2NodeClass (deploy/overlays/example-karpenter/
gpu-nodepool) against Karpenter's own v1 CRDs on the real apiserver: a server-side dry-run create
with strict field validation, so the CRDs' OpenAPI schemas and CEL rules judge them (a wrong value
is refused). The NodePool is checked against the control plane's Karpenter CRD; the EC2NodeClass
against the AWS provider's, fetched once from the Go module proxy (its module zip) and cached.
Also: the NodePool gives its nodes the pool label and GPU taint the backend's pods select and
tolerate, the NodeClass selects one subnet, and its nodeadm user data sets RLIMIT_MEMLOCK, the
same NodeConfig docs/deploy-on-eks.md gives for a managed node group's launch template."""

from __future__ import annotations

import copy
import email
import io
import os
import urllib.request
import zipfile
from pathlib import Path

import pytest
import yaml

from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings

from control.kube.cluster import ApiError, wait_for
from control.kube.control_plane import ControlPlaneUnavailable, built_or_skip
from control.support import REPO

sys_path_deploy = str(REPO / "deploy")
EXAMPLE = REPO / "deploy" / "overlays" / "example-karpenter" / "gpu-nodepool"
#: The AWS provider's release whose EC2NodeClass CRD the example is checked against.
AWS_PROVIDER = "github.com/aws/karpenter-provider-aws"
AWS_PROVIDER_VERSION = "v1.15.0"
CRD_FILE = "karpenter.k8s.aws_ec2nodeclasses.yaml"
CACHE = Path.home() / ".cache" / "fsdp-resilience" / f"karpenter-aws-crds-{AWS_PROVIDER_VERSION}"
MEMLOCK_2_63 = 2**63


def fetch_ec2nodeclass_crd() -> Path:
    """The EC2NodeClass CRD of AWS_PROVIDER_VERSION, from the Go module proxy's zip of the module
    (GOPROXY's first entry), cached; ControlPlaneUnavailable where the proxy cannot be reached."""
    path = CACHE / CRD_FILE
    if path.exists():
        return path
    proxy = (os.environ.get("GOPROXY") or "https://proxy.golang.org").split(",")[0].split("|")[0]
    if not proxy.startswith("http"):
        proxy = "https://proxy.golang.org"
    url = f"{proxy.rstrip('/')}/{AWS_PROVIDER}/@v/{AWS_PROVIDER_VERSION}.zip"
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            data = r.read()
    except OSError as e:
        raise ControlPlaneUnavailable(f"cannot fetch {url}: {e}") from e
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        crd = z.read(f"{AWS_PROVIDER}@{AWS_PROVIDER_VERSION}/pkg/apis/crds/{CRD_FILE}")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(crd)
    tmp.replace(path)
    return path


@pytest.fixture
def example() -> dict[str, dict]:
    """The example's objects by kind, as kustomize renders them."""
    import sys

    sys.path.insert(0, sys_path_deploy)
    from render import render

    return {o["kind"]: o for o in render(EXAMPLE)}


def dry_run_create(kube, path: str, obj: dict) -> dict:
    return kube.api("POST", path, obj, query={"dryRun": "All", "fieldValidation": "Strict"})


def test_the_example_nodepool_and_ec2nodeclass_pass_karpenters_v1_crds_on_the_apiserver(kube, example):
    crd_path = built_or_skip(fetch_ec2nodeclass_crd, f"the EC2NodeClass CRD of {AWS_PROVIDER}@{AWS_PROVIDER_VERSION}")
    crd = yaml.safe_load(crd_path.read_text())
    kube.apply([crd])
    wait_for(
        lambda: any(
            c["type"] == "Established" and c["status"] == "True"
            for c in (kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}")
                      .get("status", {}).get("conditions") or [])
        ),
        what="the EC2NodeClass CRD established",
    )  # fmt: skip
    pool, nodeclass = example["NodePool"], example["EC2NodeClass"]
    assert dry_run_create(kube, "/apis/karpenter.k8s.aws/v1/ec2nodeclasses", nodeclass)["metadata"]["name"] == "gpu"
    assert dry_run_create(kube, "/apis/karpenter.sh/v1/nodepools", pool)["metadata"]["name"] == "gpu"

    # The schemas judge for real: a value outside them is refused.
    wrong = copy.deepcopy(pool)
    wrong["spec"]["disruption"]["consolidationPolicy"] = "Never"
    with pytest.raises(ApiError) as e:
        dry_run_create(kube, "/apis/karpenter.sh/v1/nodepools", wrong)
    assert e.value.status == 422 and "consolidationPolicy" in str(e.value.body)
    wrong = copy.deepcopy(nodeclass)
    wrong["spec"]["amiSelectorTerms"] = [{"alias": "ubuntu@latest"}]
    with pytest.raises(ApiError) as e:
        dry_run_create(kube, "/apis/karpenter.k8s.aws/v1/ec2nodeclasses", wrong)
    assert e.value.status == 422 and "family is not supported" in str(e.value.body)


def nodeconfig_of(user_data: str) -> dict:
    """The nodeadm NodeConfig in a MIME multi-part user data (the part application/node.eks.aws)."""
    message = email.message_from_string(user_data)
    assert message.is_multipart(), "nodeadm reads a MIME multi-part document"
    (part,) = [p for p in message.walk() if p.get_content_type() == "application/node.eks.aws"]
    return yaml.safe_load(part.get_payload())


def test_the_example_pool_matches_what_the_backend_relies_on(example):
    pool, nodeclass = example["NodePool"], example["EC2NodeClass"]
    settings = PodTemplateSettings(image="registry.example/fsdp:1")
    template = pool["spec"]["template"]
    # Named as the nodeclaim admission policy expects; the pods' selector and toleration fit.
    assert pool["metadata"]["name"] == "gpu"
    assert settings.node_selector.items() <= template["metadata"]["labels"].items()
    assert [(t["key"], t["effect"]) for t in template["spec"]["taints"]] == [
        (t["key"], t["effect"]) for t in settings.tolerations
    ]
    (types,) = [r for r in template["spec"]["requirements"] if r["key"] == "node.kubernetes.io/instance-type"]
    assert types["values"] == [settings.instance_type]
    (capacity,) = [r for r in template["spec"]["requirements"] if r["key"] == "karpenter.sh/capacity-type"]
    assert "spot" not in capacity["values"]
    # Training nodes are never consolidated or expired.
    assert pool["spec"]["disruption"]["consolidationPolicy"] == "WhenEmpty"
    assert template["spec"]["expireAfter"] == "Never"
    # One subnet (EFA), the EFA security group, an AL2023 AMI.
    assert len(nodeclass["spec"]["subnetSelectorTerms"]) == 1 and "id" in nodeclass["spec"]["subnetSelectorTerms"][0]
    assert nodeclass["spec"]["amiSelectorTerms"][0]["alias"].startswith("al2023@")
    # memlock: containerd's base runtime spec, through nodeadm.
    config = nodeconfig_of(nodeclass["spec"]["userData"])
    assert config["apiVersion"] == "node.eks.aws/v1alpha1" and config["kind"] == "NodeConfig"
    rlimits = {r["type"]: r for r in config["spec"]["containerd"]["baseRuntimeSpec"]["process"]["rlimits"]}
    assert rlimits["RLIMIT_MEMLOCK"]["soft"] == rlimits["RLIMIT_MEMLOCK"]["hard"] == MEMLOCK_2_63
    assert float(MEMLOCK_2_63) == MEMLOCK_2_63  # exact through nodeadm's float64 merge
    assert "RLIMIT_NOFILE" in rlimits  # a list replaces the AMI's default list: keep its NOFILE
    # The same NodeConfig is what docs/deploy-on-eks.md gives a managed node group.
    docs = (REPO / "docs" / "deploy-on-eks.md").read_text()
    documented = [
        yaml.safe_load(block.split("\n", 1)[1])
        for block in docs.split("```")
        if block.startswith("yaml\n") and "kind: NodeConfig" in block and "MIME" not in block
    ]
    assert config in documented, "docs/deploy-on-eks.md should show the example's NodeConfig"
