"""The run contract: what the control plane (Airflow) and the data plane (training) agree on.

This package is the seam between the two planes. It imports only the standard library (and
``crc32c``, late, to checksum files), so the Airflow image can use it without torch. Its modules:

- ``failures``: exit codes and failure classes (``ExitCode``, ``FailureClass``) and the failure rules;
- ``config``: the validated run configuration (``RunConfig``, ``FaultDrill``; JSON round-trip, clear
  errors on bad values), with ``timeouts``: the restart layers' timeouts;
- ``rundir``: the run-dir layout (``RunDir``) and the stop, membership and final records;
- ``checkpoints`` and ``checkpoint_catalog``: the checkpoint layout and commit protocol
  (``CheckpointCatalog``);
- ``dataset``: the dataset index;
- ``events``: the events-log schema (``Event``, one TypedDict per kind in ``EVENT_TYPES``, ``EventLog``);
- ``files``: durable writes; ``version``: ``CONTRACT_VERSION``;
- ``reference``: writes docs/reference/ from all of the above.

Every public name is importable from the package itself. Change it deliberately: both planes,
and runs already on disk, depend on it.
"""

from fsdp_resilience.training.contract.checkpoint_catalog import CheckpointCatalog
from fsdp_resilience.training.contract.checkpoints import (
    CHECKPOINT_PREFIX,
    CHECKSUM_ALGORITHM,
    COMMIT_MARKER,
    QUARANTINE_DIR,
    QUARANTINE_RECORD,
    SUMS_DIR,
    CheckpointInfo,
    checkpoint_files,
    checkpoint_step,
    checksum_share,
    file_checksum,
    parse_commit_marker,
    read_commit_marker,
    read_rank_sums,
    verify_checkpoint,
    write_rank_sums,
)
from fsdp_resilience.training.contract.config import (
    DEVICES,
    FAULT_DRILLS,
    FAULT_KINDS,
    MAX_SPARE_NODES,
    MAX_SPARE_REFILLS,
    MODEL_PRESETS,
    RESTART_MODE_LAYERS,
    RESTART_MODES,
    FaultDrill,
    RunConfig,
)
from fsdp_resilience.training.contract.dataset import (
    DATASET_FORMAT,
    DATASET_INDEX,
    DATASET_SPLITS,
    DATASET_TOKEN_DTYPE,
    HOW_TO_PREPARE,
    DatasetError,
    read_dataset_index,
)
from fsdp_resilience.training.contract.events import (
    EVENT_TYPES,
    HEALTH_CHECKS,
    LAUNCH_UID_ENV,
    NODE_ID_ENV,
    POD_UID_ENV,
    Event,
    EventLog,
    EventRecord,
    node_id,
    read_events,
)
from fsdp_resilience.training.contract.failures import (
    FAILURE_PRIORITY,
    FINAL_FAILURES,
    LAUNCH_ENDING_FAILURES,
    REPLACEABLE_FAILURES,
    STOP_CLASSES,
    STORAGE_ERRNOS,
    WHAT_TO_DO,
    ConfigError,
    ExitCode,
    FailureClass,
    exit_code_for,
    failure_class_for_exit,
    most_telling_failure,
    storage_errno,
    what_to_do,
)
from fsdp_resilience.training.contract.files import atomic_write_text, probe_writable
from fsdp_resilience.training.contract.rundir import (
    RunDir,
    declare_stop,
    final_status,
    launch_ended_by,
    read_stop,
    record_membership,
)
from fsdp_resilience.training.contract.timeouts import (
    DEFAULT_GLOO_COLLECTIVE_TIMEOUT_S,
    DERIVED_SECTIONS,
    DERIVED_TIMEOUT_MARGIN_S,
    NCCL_TIMEOUT_MARGIN_S,
    DerivedTimeouts,
    RestartTimeouts,
)
from fsdp_resilience.training.contract.version import CONTRACT_VERSION

__all__ = [
    "CHECKPOINT_PREFIX",
    "CHECKSUM_ALGORITHM",
    "COMMIT_MARKER",
    "CONTRACT_VERSION",
    "CheckpointCatalog",
    "CheckpointInfo",
    "ConfigError",
    "DATASET_FORMAT",
    "DATASET_INDEX",
    "DATASET_SPLITS",
    "DATASET_TOKEN_DTYPE",
    "DEFAULT_GLOO_COLLECTIVE_TIMEOUT_S",
    "DERIVED_SECTIONS",
    "DERIVED_TIMEOUT_MARGIN_S",
    "DEVICES",
    "DatasetError",
    "DerivedTimeouts",
    "EVENT_TYPES",
    "HEALTH_CHECKS",
    "Event",
    "EventLog",
    "EventRecord",
    "ExitCode",
    "FAILURE_PRIORITY",
    "FAULT_DRILLS",
    "FAULT_KINDS",
    "FINAL_FAILURES",
    "FailureClass",
    "FaultDrill",
    "HOW_TO_PREPARE",
    "MAX_SPARE_NODES",
    "MAX_SPARE_REFILLS",
    "MODEL_PRESETS",
    "NCCL_TIMEOUT_MARGIN_S",
    "NODE_ID_ENV",
    "POD_UID_ENV",
    "LAUNCH_UID_ENV",
    "LAUNCH_ENDING_FAILURES",
    "launch_ended_by",
    "QUARANTINE_DIR",
    "QUARANTINE_RECORD",
    "REPLACEABLE_FAILURES",
    "RESTART_MODES",
    "RESTART_MODE_LAYERS",
    "RestartTimeouts",
    "RunConfig",
    "RunDir",
    "STOP_CLASSES",
    "STORAGE_ERRNOS",
    "SUMS_DIR",
    "WHAT_TO_DO",
    "atomic_write_text",
    "checkpoint_files",
    "checkpoint_step",
    "checksum_share",
    "declare_stop",
    "exit_code_for",
    "failure_class_for_exit",
    "file_checksum",
    "final_status",
    "most_telling_failure",
    "node_id",
    "parse_commit_marker",
    "probe_writable",
    "read_commit_marker",
    "read_dataset_index",
    "read_events",
    "read_rank_sums",
    "read_stop",
    "record_membership",
    "storage_errno",
    "verify_checkpoint",
    "what_to_do",
    "write_rank_sums",
]
