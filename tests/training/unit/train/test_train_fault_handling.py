"""The worker's fault vocabulary (fsdp_resilience.training.train.fault_handling): signatures, the
exceptions that stop or roll back training, and the non-finite flags."""

from __future__ import annotations

import math

import torch

from fsdp_resilience.training.contract import FailureClass
from fsdp_resilience.training.train.fault_handling import (
    CHECKPOINT_FAULT,
    NonFiniteState,
    StopTraining,
    fault_signature,
    nonfinite_flags,
)


def test_a_fault_signature_is_the_exception_type_and_message():
    assert fault_signature(ValueError("bad batch")) == "builtins.ValueError: bad batch"
    assert len(fault_signature(RuntimeError("x" * 1000))) == len("builtins.RuntimeError: ") + 300


def test_stop_training_is_no_exception_the_wrapper_retries():
    stop = StopTraining(FailureClass.STORAGE_ERROR, "disk full")
    assert not isinstance(stop, Exception) and isinstance(stop, BaseException)
    assert str(stop) == "storage_error: disk full" and stop.failure is FailureClass.STORAGE_ERROR


def test_non_finite_state_carries_where_it_was_found():
    state = NonFiniteState(12, "NaN/inf loss at step 11", 5.0)
    assert (state.step, str(state), state.ts) == (12, "NaN/inf loss at step 11", 5.0)
    assert isinstance(state, Exception)
    assert CHECKPOINT_FAULT == "checkpoint"


def test_nonfinite_flags_mark_the_loss_and_the_gradient_norm():
    finite = torch.tensor(1.5)
    assert nonfinite_flags(finite, torch.tensor(2.0)).tolist() == [False, False]
    assert nonfinite_flags(torch.tensor(math.nan), torch.tensor(2.0)).tolist() == [True, False]
    assert nonfinite_flags(finite, torch.tensor(math.inf)).tolist() == [False, True]
