"""What the EKS backend says when the Kubernetes API refuses a request (kube_error)."""

from __future__ import annotations

import json

from fsdp_resilience.control.backends.eks import kube_error

NS = "fsdp-training"


def test_api_errors_say_what_to_do(tmp_path):
    from kubernetes.client import ApiException

    def api_exception(status, reason, message):
        e = ApiException(status=status, reason=reason)
        e.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status})
        return e

    forbidden = kube_error(
        api_exception(
            403,
            "Forbidden",
            "jobs.batch is forbidden: User "
            '"system:serviceaccount:airflow:airflow-triggerer" cannot create resource '
            '"jobs" in API group "batch" in the namespace "fsdp-training"',
        ),
        "create job llm-0-abc",
        NS,
    )
    text = str(forbidden)
    assert "identity system:serviceaccount:airflow:airflow-triggerer lacks the grant 'create' on jobs" in text
    assert "API group batch" in text and "deploy/base/rbac.yaml" in text and "access entry" in text
    missing = kube_error(api_exception(404, "Not Found", 'namespaces "fsdp-training" not found'), "create job x", NS)
    assert "namespace fsdp-training does not exist" in str(missing) and "deploy kit" in str(missing)
    invalid = kube_error(
        api_exception(422, "Unprocessable Entity", 'Service "7b" is invalid: metadata.name: ...'),
        "create service 7b",
        NS,
    )
    assert 'invalid (422): Service "7b" is invalid' in str(invalid)
