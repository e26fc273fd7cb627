"""Stage a dataset for training and announce it: data-to-model.

validate_source -> choose_staging -> prepare_shards | import_to_fsx -> verify_dataset
                                                                      (outlet: the fsdp_dataset Asset)

backend=local: staging turns a folder of text files under FSDP_SOURCE_ROOT (default
<FSDP_RUNS_ROOT>/sources), or the Python standard library's sources ("stdlib"), into byte-level
token shards under the data root (``python -m fsdp_resilience.training.prepare_data``, run in the training
environment). Nothing outside those two roots is read or written, whatever the params say.

backend=eks: the source is the ``s3://`` URI of an already-prepared dataset (index.json and the
shards that prepare_data writes) under a data repository association of the FSx for Lustre file
system that the training pods mount. Staging is an import data repository task for that prefix
(deferrable: the wait holds no worker slot); verify_dataset then reads the index through the
workers' FSx mount. Set ``FSDP_FSX_FILE_SYSTEM_ID`` (and ``FSDP_FSX_MOUNT_PATH``, default /fsx;
``FSDP_AWS_CONN_ID``, default aws_default) in the workers' and triggerer's environment.

Training can be scheduled on the ``fsdp_dataset`` Asset (see docs/dags.md: "Scheduling").
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from airflow.sdk import Param, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException

from fsdp_resilience.control import ladder, settings
from fsdp_resilience.control.assets import DATASET
from fsdp_resilience.control.backends import BackendError, get_backend
from fsdp_resilience.control.operators.fsx import FsxDataRepositoryTaskOperator
from fsdp_resilience.training.contract import ConfigError, read_dataset_index

PARAMS = {
    "source": Param(
        "stdlib",
        type="string",
        minLength=1,
        maxLength=1024,
        title="Source",
        description='backend=local: "stdlib" (the Python standard library sources), or a folder of text '
        "files under FSDP_SOURCE_ROOT (its name, or its path there). backend=eks: the s3:// "
        "URI of a prepared dataset (index.json and shards from python -m "
        "fsdp_resilience.training.prepare_data) under a data repository association.",
    ),
    "dataset": Param(
        "python-stdlib",
        type="string",
        pattern=ladder.NAME_PATTERN,
        title="Dataset name",
        description="backend=local: name of the staged dataset (a folder under the data root). "
        "backend=eks: unused; the dataset is the folder the association maps the URI to.",
    ),
    "max_bytes": Param(
        8 << 20,
        type="integer",
        minimum=1024,
        maximum=1 << 40,
        title="Max bytes",
        description="backend=local: read at most this many bytes of text.",
    ),
    "val_fraction": Param(
        0.05,
        type="number",
        exclusiveMinimum=0,
        maximum=0.5,
        title="Validation fraction",
        description="backend=local: share of files held out for validation.",
    ),
    "backend": Param(
        None,
        type=["null", "string"],
        enum=[None, *settings.BACKENDS],
        title="Backend",
        description="Where the data is staged: local folders, or FSx for Lustre on EKS. Empty: the "
        "deployment's FSDP_DEFAULT_BACKEND (default local).",
    ),
}

#: The plan's fields, as templates for the FSx import (rendered when import_to_fsx runs).
_PLAN = "ti.xcom_pull(task_ids='validate_source')"


def _local_plan(params: dict) -> dict:
    source = params["source"]
    if source.startswith("s3://"):
        raise AirflowFailException(f"source {source} is in S3: staging from S3 needs backend=eks")
    try:
        # Only the standard library or a folder under the source root is read; only a folder under
        # the data root is written (".." and symlinks out are refused).
        if source == "stdlib":
            import sysconfig

            source = sysconfig.get_paths()["stdlib"]
        else:
            source = str(settings.under_root(settings.source_root(), source, what="source"))
        dst = settings.under_root(settings.data_root(), params["dataset"], what="dataset")
    except ValueError as e:
        raise AirflowFailException(
            f"{e} (FSDP_SOURCE_ROOT={settings.source_root()}, FSDP_DATA_ROOT={settings.data_root()})"
        ) from None
    if not Path(source).is_dir():
        raise AirflowFailException(
            f"source {source} is not a folder; put the text files in a folder under "
            f"FSDP_SOURCE_ROOT={settings.source_root()} and give its name"
        )
    try:  # prepare_data runs in the training environment: a deployment without one says so now
        get_backend(**settings.backend_config("local")).check_training_environment()
    except BackendError as e:
        raise AirflowFailException(str(e)) from None
    return {
        "backend": "local",
        "source": source,
        "dst": str(dst),
        "max_bytes": params["max_bytes"],
        "val_fraction": params["val_fraction"],
    }


def _fsx_plan(params: dict) -> dict:
    from fsdp_resilience.control import fsx
    from fsdp_resilience.control.hooks.fsx import FsxHook

    source = params["source"]
    try:
        if not source.startswith("s3://"):
            raise fsx.FsxStagingError(
                f"source {source!r} is not an s3:// URI; with backend=eks give the S3 prefix "
                "of a prepared dataset, e.g. s3://my-bucket/datasets/c4/"
            )
        fsx.normalize_s3_uri(source)
        file_system_id, conn_id = fsx.file_system_id(), settings.aws_conn_id()
        hook = FsxHook(aws_conn_id=conn_id)
        hook.get_file_system(file_system_id)
        _, fs_path = hook.resolve_path(file_system_id, source)
    except fsx.FsxStagingError as e:
        if e.retryable:
            raise
        raise AirflowFailException(str(e)) from None
    # A dataset is a folder: import the prefix with a trailing "/" so s3://b/c4/ leaves s3://b/c4-old/ alone.
    return {
        "backend": "eks",
        "source": source,
        "import_path": fsx.normalize_s3_uri(source) + "/",
        "file_system_id": file_system_id,
        "aws_conn_id": conn_id,
        "fs_path": fs_path,
        "dst": str(fsx.local_path(fs_path)),
    }


@dag(dag_id="stage_dataset", schedule=None, catchup=False, params=PARAMS, tags=["data", "fsdp"], doc_md=__doc__)
def stage_dataset():
    @task
    def validate_source() -> dict:
        params = get_current_context()["params"]
        try:
            backend = settings.backend_name(params["backend"])
        except ValueError as e:
            raise AirflowFailException(str(e)) from None
        return _local_plan(params) if backend == "local" else _fsx_plan(params)

    @task.branch
    def choose_staging(plan: dict) -> str:
        return "prepare_shards" if plan["backend"] == "local" else "import_to_fsx"

    @task
    def prepare_shards(plan: dict) -> None:
        # prepare_data needs numpy: run it in the training environment, not in Airflow's.
        out = subprocess.run(
            [
                settings.training_python(),
                "-m",
                "fsdp_resilience.training.prepare_data",
                plan["source"],
                plan["dst"],
                "--max-bytes",
                str(plan["max_bytes"]),
                "--val-fraction",
                str(plan["val_fraction"]),
            ],
            cwd=settings.REPO,
            capture_output=True,
            text=True,
        )
        print(out.stdout + out.stderr)
        if out.returncode != 0:
            raise AirflowFailException(f"prepare_data failed: {out.stderr.strip()}")

    import_to_fsx = FsxDataRepositoryTaskOperator(
        task_id="import_to_fsx",
        kind="import",
        file_system_id=f"{{{{ {_PLAN}['file_system_id'] }}}}",
        paths=[f"{{{{ {_PLAN}['import_path'] }}}}"],
        aws_conn_id=f"{{{{ {_PLAN}['aws_conn_id'] }}}}",
    )

    @task(outlets=[DATASET], trigger_rule="none_failed_min_one_success")
    def verify_dataset(plan: dict) -> dict:
        dst = Path(plan["dst"])
        try:
            index = read_dataset_index(dst)
        except ConfigError as e:
            raise AirflowFailException(str(e)) from None
        # Every shard the index lists must be there, whole: on FSx this reads imported metadata
        # only, so it catches a partial import or a prefix that holds another dataset's index.
        for split in ("train", "val"):
            for entry in index[split]:
                try:
                    shard, tokens = dst / entry["file"], int(entry["tokens"])
                except (KeyError, TypeError, ValueError):
                    raise AirflowFailException(
                        f"bad shard entry {entry!r} in {dst / 'index.json'}; "
                        f"prepare the dataset again from {plan['source']}"
                    ) from None
                if not shard.is_file() or shard.stat().st_size < 2 * tokens:
                    raise AirflowFailException(
                        f"shard {shard} listed in {dst / 'index.json'} is missing or short; "
                        f"stage the dataset again from {plan['source']}"
                    )
        summary = {
            "dataset": dst.name,
            "path": str(dst),
            "source": plan["source"],
            "backend": plan["backend"],
            "train_tokens": sum(s["tokens"] for s in index["train"]),
            "val_tokens": sum(s["tokens"] for s in index["val"]),
            "sha256": index.get("sha256"),
        }
        if "fs_path" in plan:  # where training pods find it: their FSx mount + this path
            summary["fs_path"] = plan["fs_path"]
        get_current_context()["outlet_events"][DATASET].extra = summary
        return summary

    plan = validate_source()
    choose_staging(plan) >> [prepare_shards(plan), import_to_fsx] >> verify_dataset(plan)


stage_dataset()
