"""The objects the EKS backend creates at run time, for one example launch on p5 nodes: the
training Job, its rendezvous Service and NetworkPolicy, and an evaluation Job. The kit's scanners
(checkov in ``make lint-deploy``) and the strict schema check see them next to the kit.

    python deploy/backend_objects.py --out DIR    # one YAML file per object
    python deploy/backend_objects.py --check      # validate at K8S_VERSIONS

The objects come from the backend's own builders (``fsdp_resilience.control.backends.eks``:
manifests.py and networking.py) with the default ``PodTemplateSettings`` (sized for p5.48xlarge,
EFA on), so what is scanned is what a real launch submits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from render import K8S_VERSIONS, KitError, object_name, validate  # noqa: E402

#: An image pinned by digest, as a deployment should pass it (FSDP_EKS_IMAGE).
EXAMPLE_IMAGE = "111122223333.dkr.ecr.us-west-2.amazonaws.com/fsdp-resilience/training@sha256:" + "0123456789abcdef" * 4
EXAMPLE_RUN = {
    "run_id": "7b-llama",
    "run_dir": "/fsx/runs/7b-llama",
    "dataset_dir": "/fsx/datasets/fineweb",
    "nodes": 4,
    "procs_per_node": 8,
}
#: The uid the API server would give the created Job (the Service and NetworkPolicy name it as owner).
EXAMPLE_JOB_UID = "5f0c7a2e-7d1b-4c3e-9a6f-2b8d4e1c0a93"


def backend_objects(image: str = EXAMPLE_IMAGE) -> list[dict[str, Any]]:
    """The training Job, its Service (and NetworkPolicy, where the backend makes one), its
    PodDisruptionBudget and an evaluation Job for ``EXAMPLE_RUN`` with the default pod settings."""
    from fsdp_resilience.control.backends import eks as m
    from fsdp_resilience.training.contract import RunConfig

    cfg = RunConfig(**EXAMPLE_RUN)
    settings = m.PodTemplateSettings(image=image)
    job = m.training_job(cfg, "0", settings, airflow_run_id="manual__2026-12-01T06:00:00+00:00")
    created = {**job, "metadata": {**job["metadata"], "uid": EXAMPLE_JOB_UID}}
    objects = [job, m.rendezvous_service(cfg, "0", settings, owner=created)]
    if hasattr(m, "rendezvous_network_policy"):
        objects.append(m.rendezvous_network_policy(cfg, "0", settings, owner=created))
    from fsdp_resilience.control.backends.eks.disruption import disruption_budget

    objects.append(disruption_budget(cfg, "0", settings, owner=created))
    objects.append(m.evaluation_job(cfg, settings, checkpoint_id="step_100"))
    return objects


def file_name(obj: dict[str, Any]) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy/backend_objects.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, metavar="DIR", help="write one YAML file per object to DIR")
    parser.add_argument(
        "--check", action="store_true", help=f"validate strictly against Kubernetes {' and '.join(K8S_VERSIONS)}"
    )
    parser.add_argument("--image", default=EXAMPLE_IMAGE, help="the training image (default: an example by digest)")
    args = parser.parse_args(argv)
    objects = backend_objects(args.image)
    try:
        if args.check:
            validate(objects)
            print(
                f"ok  backend objects ({', '.join(object_name(o) for o in objects)}) "
                f"valid for Kubernetes {' and '.join(K8S_VERSIONS)}"
            )
    except KitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for obj in objects:
            (args.out / file_name(obj)).write_text(yaml.safe_dump(obj, sort_keys=False))
    if not (args.out or args.check):
        sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
