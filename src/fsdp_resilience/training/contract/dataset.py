"""The dataset layout (written by fsdp_resilience.training.prepare_data or the control plane's
staging, read by fsdp_resilience.training.data). Format "byte-tokens-v1": index.json +
little-endian uint16 token shards."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fsdp_resilience.training.contract.failures import ConfigError

DATASET_FORMAT = "byte-tokens-v1"
DATASET_INDEX = "index.json"
DATASET_TOKEN_DTYPE = "uint16"
DATASET_SPLITS = ("train", "val")
HOW_TO_PREPARE = "run python -m fsdp_resilience.training.prepare_data SRC DST"


class DatasetError(ConfigError):
    """The dataset folder is missing, damaged, or too small for the run: a config error."""


def read_dataset_index(dataset_dir: str | os.PathLike) -> dict[str, Any]:
    """The dataset's index.json, checked for format and for train and val shards."""
    path = Path(dataset_dir) / DATASET_INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"no dataset at {path} (index.json is missing); {HOW_TO_PREPARE}") from None
    except (OSError, ValueError) as e:
        raise DatasetError(f"dataset index {path} is unreadable or corrupt ({e}); {HOW_TO_PREPARE}") from None
    if (
        not isinstance(index, dict)
        or index.get("format") != DATASET_FORMAT
        or index.get("dtype") != DATASET_TOKEN_DTYPE
    ):
        raise DatasetError(f"{path} is not a {DATASET_FORMAT} dataset index; {HOW_TO_PREPARE}")
    for split in DATASET_SPLITS:
        if not isinstance(index.get(split), list) or not index[split]:
            raise DatasetError(f"{path} lists no {split} shards; {HOW_TO_PREPARE}")
    return index
