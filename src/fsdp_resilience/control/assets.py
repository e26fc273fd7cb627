"""The Assets the DAGs produce and consume (data-to-model, model-to-consumers)."""

from airflow.sdk import Asset

#: A staged, tokenized dataset (updated by stage_dataset; can schedule fsdp_training).
DATASET = Asset(name="fsdp_dataset", uri="file:///fsdp/dataset")
#: The newest committed checkpoint of a successful training run.
MODEL_CHECKPOINT = Asset(name="fsdp_model_checkpoint", uri="file:///fsdp/model-checkpoint")
#: The evaluation of that checkpoint.
MODEL_EVALUATION = Asset(name="fsdp_model_evaluation", uri="file:///fsdp/model-evaluation")
