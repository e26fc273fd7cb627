"""The dataset index (fsdp_resilience.training.contract.dataset): checked for format and shards."""

import json

import pytest

from fsdp_resilience.training.contract.dataset import (
    DATASET_FORMAT,
    DATASET_INDEX,
    DATASET_TOKEN_DTYPE,
    DatasetError,
    read_dataset_index,
)
from fsdp_resilience.training.contract.failures import ConfigError


def _index(folder, **changes):
    index = {
        "format": DATASET_FORMAT,
        "dtype": DATASET_TOKEN_DTYPE,
        "train": ["train_000.bin"],
        "val": ["val_000.bin"],
        **changes,
    }
    (folder / DATASET_INDEX).write_text(json.dumps(index))
    return index


def test_a_good_index_is_returned(tmp_path):
    index = _index(tmp_path)
    assert read_dataset_index(tmp_path) == index


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"format": "other"}, "is not a byte-tokens-v1 dataset index"),
        ({"dtype": "uint32"}, "is not a byte-tokens-v1 dataset index"),
        ({"val": []}, "lists no val shards"),
        ({"train": "train_000.bin"}, "lists no train shards"),
    ],
)
def test_a_bad_index_is_a_dataset_error_that_says_how_to_prepare(tmp_path, changes, needle):
    _index(tmp_path, **changes)
    with pytest.raises(DatasetError, match=needle) as err:
        read_dataset_index(tmp_path)
    assert "prepare_data" in str(err.value) and isinstance(err.value, ConfigError)


def test_a_missing_or_corrupt_index_is_named(tmp_path):
    with pytest.raises(DatasetError, match="index.json is missing"):
        read_dataset_index(tmp_path)
    (tmp_path / DATASET_INDEX).write_text("{not json")
    with pytest.raises(DatasetError, match="unreadable or corrupt"):
        read_dataset_index(tmp_path)
