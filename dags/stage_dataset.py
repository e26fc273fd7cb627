"""Stage a dataset for training and announce it: data-to-model.

validate_source -> stage -> verify_dataset (outlet: the fsdp_dataset Asset)

On the local backend, staging turns a folder of text files into byte-level token shards under the
data root (``python -m training.prepare_data``, run in the training environment). On EKS it will
import the S3 prefix into FSx for Lustre with a data repository task. Training can be scheduled on
the ``fsdp_dataset`` Asset (see README: "Scheduling").
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from airflow.sdk import Param, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException

from fsdp_resilience import settings
from fsdp_resilience.assets import DATASET
from training.contract import ConfigError, read_dataset_index

PARAMS = {
    "source": Param("stdlib", type="string", minLength=1,
                    description='A folder of text files, or "stdlib" for the Python standard library sources.'),
    "dataset": Param("python-stdlib", type="string", pattern=r"^[a-z0-9][-a-z0-9_.]{0,62}$",
                     description="Name of the staged dataset (a folder under the data root)."),
    "max_bytes": Param(8 << 20, type="integer", minimum=1024, maximum=1 << 40,
                       description="Read at most this many bytes of text."),
    "val_fraction": Param(0.05, type="number", exclusiveMinimum=0, maximum=0.5,
                          description="Share of files held out for validation."),
    "backend": Param("local", enum=["local", "eks"], description="Where the data is staged."),
}


@dag(dag_id="stage_dataset", schedule=None, catchup=False, params=PARAMS, tags=["data", "fsdp"], doc_md=__doc__)
def stage_dataset():
    @task
    def validate_source() -> dict:
        params = get_current_context()["params"]
        if params["backend"] != "local":
            raise AirflowFailException("staging to FSx for Lustre needs the EKS backend, which is not built yet; "
                                       "use backend=local")
        source = params["source"]
        if source == "stdlib":
            import sysconfig
            source = sysconfig.get_paths()["stdlib"]
        if not Path(source).is_dir():
            raise AirflowFailException(f"source {source} is not a folder on this machine; give a folder of text files")
        return {"source": source, "dst": str(settings.data_root() / params["dataset"]),
                "max_bytes": params["max_bytes"], "val_fraction": params["val_fraction"]}

    @task
    def stage(plan: dict) -> dict:
        # prepare_data needs numpy: run it in the training environment, not in Airflow's.
        out = subprocess.run([settings.training_python(), "-m", "training.prepare_data", plan["source"], plan["dst"],
                              "--max-bytes", str(plan["max_bytes"]), "--val-fraction", str(plan["val_fraction"])],
                             cwd=settings.REPO, capture_output=True, text=True)
        print(out.stdout + out.stderr)
        if out.returncode != 0:
            raise AirflowFailException(f"prepare_data failed: {out.stderr.strip()}")
        return plan

    @task(outlets=[DATASET])
    def verify_dataset(plan: dict) -> dict:
        try:
            index = read_dataset_index(plan["dst"])
        except ConfigError as e:
            raise AirflowFailException(str(e)) from None
        summary = {"dataset": Path(plan["dst"]).name, "path": plan["dst"],
                   "train_tokens": sum(s["tokens"] for s in index["train"]),
                   "val_tokens": sum(s["tokens"] for s in index["val"]), "sha256": index.get("sha256")}
        get_current_context()["outlet_events"][DATASET].extra = summary
        return summary

    verify_dataset(stage(validate_source()))


stage_dataset()
