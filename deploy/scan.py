"""The security scan of `make lint-deploy`: checkov over the rendered kit, the objects the EKS
backend creates, and the Dockerfiles. It fails on any finding that deploy/checkov-exceptions.yaml
does not list, and on any listed exception that no longer matches a finding.

    .venv-airflow/bin/python deploy/scan.py --checkov .venv-checkov/bin/checkov

checkov lives in its own virtual environment (its pins conflict with Airflow's); this script runs
in the control-plane one, which renders (kubectl's kustomize) and builds the backend's objects.
Everything is written to one temporary folder and scanned in one checkov run, so its graph checks
see the kit's NetworkPolicies next to the backend's pods. Offline: ``--skip-download``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent
REPO = DEPLOY.parent
sys.path.insert(0, str(DEPLOY))
from backend_objects import backend_objects, file_name  # noqa: E402
from render import kustomizations, output_name, render  # noqa: E402

EXCEPTIONS = DEPLOY / "checkov-exceptions.yaml"
DOCKERFILES = sorted((REPO / "images").glob("*/Dockerfile"))
FRAMEWORKS = ("kubernetes", "dockerfile")


@dataclass(frozen=True)
class Finding:
    check: str
    name: str
    resource: str
    file: str

    def __str__(self) -> str:
        return f"{self.check} {self.name}: {self.resource} ({self.file})"


@dataclass(frozen=True)
class AcceptedFinding:
    check: str
    resources: tuple[str, ...]
    reason: str

    def matches(self, finding: Finding) -> bool:
        return finding.check == self.check and any(fnmatch.fnmatchcase(finding.resource, g) for g in self.resources)


def load_exceptions(path: Path = EXCEPTIONS) -> list[AcceptedFinding]:
    """The accepted findings; each must name a check, at least one resource glob and a reason."""
    out = []
    for i, entry in enumerate((yaml.safe_load(path.read_text()) or {}).get("exceptions") or []):
        check, resources, reason = entry.get("check"), entry.get("resources"), (entry.get("reason") or "").strip()
        if not (isinstance(check, str) and check.startswith("CKV") and resources and reason):
            raise ValueError(f"{path.name} entry {i}: give check (a CKV id), resources (globs) and a reason: {entry}")
        out.append(AcceptedFinding(check, tuple(resources), reason))
    return out


def write_targets(root: Path, image: str | None = None) -> None:
    """What is scanned, as files under ``root``: kit/<kustomization>.yaml, backend/<object>.yaml,
    images/<name>/Dockerfile."""
    (root / "kit").mkdir(parents=True)
    for directory in kustomizations():
        (root / "kit" / output_name(directory)).write_text(yaml.safe_dump_all(render(directory), sort_keys=False))
    (root / "backend").mkdir()
    for obj in backend_objects(*([image] if image else [])):
        (root / "backend" / file_name(obj)).write_text(yaml.safe_dump(obj, sort_keys=False))
    for dockerfile in DOCKERFILES:
        target = root / dockerfile.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(dockerfile, target)


def run_checkov(checkov: str, root: Path) -> tuple[list[Finding], dict[str, Any]]:
    """Failed checks and per-framework summaries of one checkov run over ``root``."""
    cmd = [
        checkov,
        "--directory",
        str(root),
        "--framework",
        *FRAMEWORKS,
        "--output",
        "json",
        "--quiet",
        "--compact",
        "--skip-download",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        reports = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise SystemExit(
            f"checkov printed no JSON (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        ) from e
    findings, summaries = [], {}
    for report in reports if isinstance(reports, list) else [reports]:
        summaries[report.get("check_type", "?")] = report.get("summary", {})
        for failed in (report.get("results") or {}).get("failed_checks") or []:
            findings.append(
                Finding(
                    failed["check_id"], failed.get("check_name", ""), failed["resource"], failed.get("file_path", "")
                )
            )
    return findings, summaries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy/scan.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkov",
        default=str(REPO / ".venv-checkov" / "bin" / "checkov"),
        help="the checkov executable (default: .venv-checkov/bin/checkov)",
    )
    parser.add_argument("--keep", type=Path, metavar="DIR", help="write the scanned files to DIR and keep them")
    args = parser.parse_args(argv)
    if not Path(args.checkov).is_file() and not shutil.which(args.checkov):
        print(f"error: no checkov at {args.checkov}: `make .venv-checkov/.installed` builds it", file=sys.stderr)
        return 2
    accepted_findings = load_exceptions()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fsdp-scan-") as tmp:
        root = args.keep or Path(tmp) / "scan"
        if args.keep and root.exists():
            shutil.rmtree(root)
        write_targets(root)
        findings, summaries = run_checkov(args.checkov, root)
    unexpected = [f for f in findings if not any(e.matches(f) for e in accepted_findings)]
    stale = [e for e in accepted_findings if not any(e.matches(f) for f in findings)]
    for framework, summary in sorted(summaries.items()):
        print(
            f"checkov {framework}: {summary.get('passed', 0)} passed, {summary.get('failed', 0)} failed "
            f"({summary.get('resource_count', 0)} resources)"
        )
    accepted = len(findings) - len(unexpected)
    print(
        f"checkov: {accepted} finding(s) accepted by {EXCEPTIONS.relative_to(REPO)}, "
        f"{len(unexpected)} not, in {time.monotonic() - started:.1f}s"
    )
    for finding in unexpected:
        print(f"  FAILED {finding}")
    for exception in stale:
        print(
            f"  STALE  {exception.check} {list(exception.resources)}: matches no finding; remove it from "
            f"{EXCEPTIONS.name}"
        )
    return 1 if unexpected or stale else 0


if __name__ == "__main__":
    sys.exit(main())
