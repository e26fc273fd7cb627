"""Reads of the EKS backend that stay cheap on a cluster of 1,000 nodes and a launch of 500 pods.

Lists go in pages (``limit``/``continue``, PAGE_SIZE objects a page), so the apiserver never
builds one answer of every pod or node at once, and each list is filtered on the server (a label
selector: the launch's pods, the pool's nodes). The answer is kept as the API's JSON: the
clients' typed models would deserialize every field of every pod into objects only for
``sanitize_for_serialization`` to turn them back into the JSON the backend reads (most of the
triggerer's CPU per poll at 500 pods).

``read_job_async`` is what the triggerer reads between sleeps: the Job and its pods, two requests
(one more per WATCH_PAGE_SIZE pods past the first page), and ``GET /version`` once per
VERSION_TTL_S (completion.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from fsdp_resilience.control.backends.base import JobNotFoundError
from fsdp_resilience.control.backends.eks.constants import LABEL_JOB

#: Objects per page of a list: the apiserver's own pagers use 500.
PAGE_SIZE = 500
#: The watch's page of a launch's pods: a launch of up to 1,000 nodes (the sizes users run) is one
#: request, so a poll costs the same requests whatever the size; past that, a page per 1,000.
WATCH_PAGE_SIZE = 1000
_JSON = {"Accept": "application/json"}


def _pages(label_selector: str | None, field_selector: str | None, token: str | None, limit: int) -> list:
    query: list[tuple[str, Any]] = [("limit", limit)]
    if label_selector:
        query.append(("labelSelector", label_selector))
    if field_selector:
        query.append(("fieldSelector", field_selector))
    if token:
        query.append(("continue", token))
    return query


def _call_args(path: str, query: list) -> dict[str, Any]:
    return {
        "resource_path": path,
        "method": "GET",
        "query_params": query,
        "header_params": dict(_JSON),
        "response_types_map": {200: "object"},  # the JSON as parsed, no typed model
        "auth_settings": ["BearerToken"],
        "_return_http_data_only": True,
    }


def list_all(
    api_client, path: str, *, label_selector: str | None = None, field_selector: str | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every item of the list at ``path`` (e.g. ``/api/v1/nodes``), page by page (``limit``
    objects, default PAGE_SIZE), through a kubernetes ``ApiClient``; an ApiException as the
    client raises it."""
    items: list[dict[str, Any]] = []
    token = None
    while True:
        query = _pages(label_selector, field_selector, token, limit or PAGE_SIZE)
        page = api_client.call_api(**_call_args(path, query))
        items += page.get("items") or []
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            return items


async def list_all_async(
    api_client, path: str, *, label_selector: str | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """``list_all`` through a kubernetes_asyncio ``ApiClient``."""
    items: list[dict[str, Any]] = []
    token = None
    while True:
        query = _pages(label_selector, None, token, limit or PAGE_SIZE)
        page = await api_client.call_api(**_call_args(path, query))
        items += page.get("items") or []
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            return items


async def read_job_async(
    kubeconfig: contextlib.AbstractContextManager[str | None] | None,
    kubernetes_conn_id: str | None,
    namespace: str,
    job_name: str,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Job ``job_name`` and its pods as JSON, through ``AsyncKubernetesHook``: what the triggerer
    reads between sleeps. ``kubeconfig``: the EKS kubeconfig (with a cluster name; entered off the
    event loop), else None: the Kubernetes connection ``kubernetes_conn_id``."""
    job, pods, _ = await read_launch_async(kubeconfig, kubernetes_conn_id, namespace, job_name, None)
    return job, pods


async def read_launch_async(
    kubeconfig: contextlib.AbstractContextManager[str | None] | None,
    kubernetes_conn_id: str | None,
    namespace: str,
    job_name: str,
    version_key: str | None,
) -> tuple[dict[str, Any], list[dict[str, Any]], tuple[int, int] | None]:
    """``read_job_async``, and the server's (major, minor) for connection ``version_key``: kept
    (completion.kept_version), else read on the same connection once per VERSION_TTL_S and kept
    (None: no key, or it could not be read). Without it, a launch with spares would read the run's
    whole event log at every poll (completion.status_as_read)."""
    import asyncio

    import aiohttp
    import yaml
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook
    from kubernetes_asyncio import client as async_client

    from fsdp_resilience.control.backends.eks.client import kube_error
    from fsdp_resilience.control.backends.eks.completion import cached_version, kept_version

    with contextlib.ExitStack() as stack:
        if kubeconfig is not None:  # EksHook is synchronous (boto3): build the kubeconfig off the loop
            config_file = await asyncio.to_thread(kubeconfig.__enter__)
            stack.push(kubeconfig.__exit__)
            # The async hook reads a kubeconfig from its connection or a dict, not from a path.
            config = yaml.safe_load(Path(config_file).read_text())
            hook = AsyncKubernetesHook(conn_id=None, kubernetes_conn_id=None, config_dict=config)
        else:
            hook = AsyncKubernetesHook(conn_id=kubernetes_conn_id)
        doing = f"read job {job_name}"
        try:
            async with hook.get_conn() as api:
                try:
                    job = await api.call_api(**_call_args(f"/apis/batch/v1/namespaces/{namespace}/jobs/{job_name}", []))
                except async_client.ApiException as e:
                    if e.status == 404:
                        raise JobNotFoundError(f"no job {job_name} in namespace {namespace}") from None
                    raise
                doing = f"list the pods of job {job_name}"
                pods = await list_all_async(
                    api,
                    f"/api/v1/namespaces/{namespace}/pods",
                    label_selector=f"{LABEL_JOB}={job_name}",
                    limit=WATCH_PAGE_SIZE,
                )
                version = kept_version(version_key) if version_key else None
                if version_key and version is None:
                    with contextlib.suppress(async_client.ApiException, aiohttp.ClientError, OSError):
                        info = await api.call_api(**_call_args("/version", []))
                        version = cached_version(version_key, lambda: info)
        except (async_client.ApiException, aiohttp.ClientError, OSError) as e:
            raise kube_error(e, doing, namespace) from e
    return job, pods, version
