"""Evaluate the newest committed checkpoint of a run that verifies, on the held-out validation split.

    python -m fsdp_resilience.training.evaluate --config RUN.json [--checkpoint step_00000100] [--device cpu]

Runs in one process, whatever world size saved the checkpoint: DCP reshards the FSDP shards into
a plain model on load. Writes ``<run_dir>/eval.json`` atomically and an ``eval`` event:

    {"checkpoint_id": "step_00000100", "step": 100, "val_loss": 1.93, "perplexity": 6.9,
     "batches": 8, "tokens": 8192, "saved_world_size": 2, "evaluated_at": 1764480000.0}

Nothing is used before it verifies. The model is built without initialising it and its bytes are read
straight into its parameters; before they are read, the commit marker, every file's size and the
CRC32C of ``.metadata`` are checked (``contract.verify_checkpoint``), and after, the bytes read are
checked against the model digests the commit recorded (a CRC32C of each rank's model tensors).
So every byte loaded is verified, and the optimizer state, which evaluation does not need, is not
read at all (a resume checks it: ``resume.choose_checkpoint``). If that path does not apply or the
digests differ, every file's CRC32C is checked and DCP loads (``load_into``).

Without ``--checkpoint``, a checkpoint that fails verification or its load is quarantined
(``checkpoints/quarantine/``, with the reason, and a ``checkpoint_quarantined`` event) and the
newest earlier one that verifies is evaluated instead. A ``--checkpoint`` that fails verification
is quarantined too, and is an error: nothing else is evaluated in its place.

Exit codes:
  0   evaluated
  2   bad config or arguments, or nothing committed yet (train first)
  66  (EX_NOINPUT) committed checkpoints exist but none verifies and loads, or the requested one
      does not; what failed and why is in checkpoints/quarantine/*/QUARANTINED.json
  74  (EX_IOERR) the run dir is full or read-only: eval.json cannot be written
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.overrides import TorchFunctionMode

from fsdp_resilience.training.checkpointing.model_bytes import NotDirectlyReadable, plan_direct_read, read_model_bytes
from fsdp_resilience.training.checkpointing.resume import load_checkpoint
from fsdp_resilience.training.contract import (
    CheckpointCatalog,
    CheckpointInfo,
    ConfigError,
    Event,
    EventLog,
    ExitCode,
    RunConfig,
    atomic_write_text,
    read_commit_marker,
    storage_errno,
    verify_checkpoint,
)
from fsdp_resilience.training.data import validation_batches
from fsdp_resilience.training.model import GPT, PRESETS, build_model, cross_entropy_loss
from fsdp_resilience.training.parallelize import choose_device

#: sysexits EX_NOINPUT: no committed checkpoint verifies and loads (or the requested one does not).
EXIT_NO_VERIFIED_CHECKPOINT = 66

log = logging.getLogger(__name__)


class NoUsableCheckpoint(Exception):
    """Committed checkpoints exist, but none that was asked for verifies and loads."""


class _SkipInitialisers(TorchFunctionMode):
    """While active, parameter initialisers do nothing: ``torch.nn.init``'s (those that dispatch
    torch functions: ``normal_``, ``uniform_``, ``constant_``, ``kaiming_uniform_``, what
    ``nn.Linear`` and ``nn.Embedding`` call; of the others only their random fills) and the
    in-place random fills. For a model whose every parameter a checkpoint is about to fill, which
    ``_other_model`` makes sure of before anything is read."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped = {getattr(torch.nn.init, n) for n in dir(torch.nn.init) if n.endswith("_") and n[0] != "_"}
        self.skipped |= {getattr(torch.Tensor, n) for n in ("normal_", "uniform_", "log_normal_", "exponential_")}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.skipped:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor):
                return tensor
        return func(*args, **kwargs)


def empty_model(cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    """The run's model with uninitialised parameters on ``device``: what a checkpoint load fills.
    A random init would be wasted work, most of a large model's load time.

    On the CPU it is built there with its initialisers skipped (``_SkipInitialisers``): building
    on the meta device instead runs torch's Python meta kernels, whose first call in a process
    imports ``torch._dynamo`` (about 1.3 s here, more than the whole load), which evaluation
    never needs otherwise. Elsewhere it is built on the meta device and ``to_empty``'d."""
    if device.type == "cpu":
        if cfg.model not in PRESETS:
            return build_model(cfg.model)  # raises: the preset's error
        with torch.device(device), _SkipInitialisers():
            model = GPT(dataclasses.replace(PRESETS[cfg.model], max_seq_len=cfg.seq_len))
    else:
        model = build_model(cfg.model, device="meta", max_seq_len=cfg.seq_len)
        model.to_empty(device=device)
    model.init_buffers()
    return model


class UntrustedCheckpoint(Exception):
    """The checkpoint fails verification: quarantine it."""


class _OtherModel(Exception):
    """The checkpoint verifies but holds another model than the one being loaded."""


def _other_model(metadata: Any, params: dict[str, torch.Tensor]) -> str | None:
    """Why a checkpoint with ``metadata`` cannot fill ``params`` (a key it lacks, or a tensor of
    another shape), or None."""
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in params if f"model.{k}" not in saved)
    if missing:
        return f"it has no model.{missing[0]}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}"
    for key, tensor in params.items():
        size = getattr(saved[f"model.{key}"], "size", None)
        if size is not None and tuple(size) != tuple(tensor.shape):
            return f"it holds model.{key} of shape {tuple(size)}, this model's is {tuple(tensor.shape)}"
    return None


def load_into(info: CheckpointInfo, params: dict[str, torch.Tensor]) -> str:
    """Verify checkpoint ``info`` and load its model tensors into ``params`` (the model's own
    tensors, by state-dict key) in place; returns how the loaded bytes were verified.

    What is verified, before anything is trusted: the commit marker, every file's size, and the
    CRC32C of ``.metadata`` (what says where each tensor is). The model's bytes are then read
    straight into the parameters, and checked against the model digests the commit recorded (a
    CRC32C of each rank's model tensors, taken from the very bytes it wrote): every byte loaded is
    verified, and the optimizer state, which evaluation never reads, is not read at all. The
    model is only handed out once its digests match. Where that path does not apply (no digests in
    the marker, a tensor stored in a layout the direct read does not handle, a GPU model) or the
    digests differ, every file's CRC32C is checked (``verify_checkpoint``) and DCP loads: the
    file checksums are what decides whether a checkpoint is damaged.

    Raises ``UntrustedCheckpoint`` (quarantine it), ``_OtherModel``, or the load's own error."""
    marker = read_commit_marker(info.path)
    reason = verify_checkpoint(info.path, marker, checksum=[".metadata"])
    if reason is not None:
        raise UntrustedCheckpoint(reason)
    metadata = dcp.FileSystemReader(str(info.path)).read_metadata()
    why = _other_model(metadata, params)
    if why is not None:
        raise _OtherModel(why)
    digests = marker.get("model_crc32c")
    if (
        isinstance(digests, list)
        and len(digests) == marker.get("world_size")
        and all(isinstance(d, str) for d in digests)
    ):
        try:
            read = read_model_bytes(info.path, plan_direct_read(info.path, metadata, params), len(digests))
        except NotDirectlyReadable as e:
            log.info("%s: reading it with DCP (%s)", info.checkpoint_id, e)
        except Exception as e:  # noqa: BLE001 - e.g. an unreadable file: the file checksums decide
            log.warning(
                "%s: the direct read failed (%s: %s): checking every file", info.checkpoint_id, type(e).__name__, e
            )
        else:
            if read == digests:
                return "model digests"
            log.warning(
                "%s: the model bytes read do not match the digests its commit recorded (%s, "
                "recorded %s): checking every file",
                info.checkpoint_id,
                read,
                digests,
            )
    reason = verify_checkpoint(info.path, marker)
    if reason is not None:
        raise UntrustedCheckpoint(reason)
    load_checkpoint(info, {"model": params})  # DCP loads in place: straight into the parameters
    return "file checksums"


def _quarantine(catalog: CheckpointCatalog, info: CheckpointInfo, reason: str, events: EventLog, phase: str) -> Path:
    moved_to = catalog.quarantine(info, reason, by="evaluate", phase=phase)
    events.emit(
        Event.CHECKPOINT_QUARANTINED,
        checkpoint_id=info.checkpoint_id,
        step=info.step,
        reason=reason,
        moved_to=str(moved_to),
    )
    return moved_to


def load_verified(
    cfg: RunConfig, model: torch.nn.Module, checkpoint_id: str | None, events: EventLog
) -> CheckpointInfo:
    """Load a verified checkpoint into ``model`` (in place) and return which one.

    ``checkpoint_id=None``: the newest committed one that verifies and loads; those that fail
    are quarantined on the way, with a ``checkpoint_quarantined`` event each (as
    ``choose_checkpoint`` / ``restore_checkpoint`` do for a resume). Otherwise exactly that one;
    if it fails verification it is quarantined and this raises."""
    catalog = CheckpointCatalog(cfg.run_dir)
    params = model.state_dict()  # the parameters' own storage: the load writes into the model
    if checkpoint_id is None:
        if not catalog.committed():
            raise ConfigError(
                f"no committed checkpoint in {cfg.layout.checkpoints}: train first "
                "(torn checkpoints, without COMMITTED.json, are never evaluated)"
            )
        for info in reversed(catalog.committed()):
            try:
                load_into(info, params)
            except UntrustedCheckpoint as e:
                _quarantine(catalog, info, str(e), events, phase="verify")
                continue
            except _OtherModel as e:
                raise ConfigError(
                    f"{info.checkpoint_id} does not fit model={cfg.model!r}: {e}; evaluate with the run's own config"
                ) from None
            except Exception as e:  # noqa: BLE001 - it verified: an unreadable checkpoint all the same
                _quarantine(catalog, info, f"load failed: {type(e).__name__}: {e}"[:2000], events, phase="load")
                continue
            for torn in catalog.torn():
                if torn.step > info.step:
                    events.emit(
                        Event.CHECKPOINT_SKIP,
                        checkpoint_id=torn.checkpoint_id,
                        step=torn.step,
                        reason="no commit marker: the save did not finish on every rank",
                    )
            return info
        raise NoUsableCheckpoint(
            f"no committed checkpoint of run {cfg.run_id} verifies and loads; each was quarantined "
            f"under {cfg.layout.quarantine} with its reason (QUARANTINED.json)"
        )
    info = next((c for c in catalog.committed() if c.checkpoint_id == checkpoint_id), None)
    if info is None:
        earlier = [q for q in catalog.quarantined() if q.get("checkpoint_id") == checkpoint_id]
        if earlier:
            raise NoUsableCheckpoint(
                f"{checkpoint_id} was quarantined ({earlier[-1].get('reason')}): see {earlier[-1]['path']}"
            )
        raise ConfigError(
            f"{checkpoint_id} is not a committed checkpoint of run {cfg.run_id}; "
            f"committed: {[c.checkpoint_id for c in catalog.committed()]}"
        )
    try:
        load_into(info, params)
    except UntrustedCheckpoint as e:
        moved_to = _quarantine(catalog, info, str(e), events, phase="verify")
        raise NoUsableCheckpoint(f"{checkpoint_id} fails verification ({e}); quarantined to {moved_to}") from None
    except Exception as e:  # it verified, so its bytes are as committed: most likely not this config's model
        raise NoUsableCheckpoint(
            f"{checkpoint_id} verifies but does not load into model={cfg.model!r}: {type(e).__name__}: {str(e)[:300]}"
        ) from None
    return info


def load_model(
    cfg: RunConfig, checkpoint_id: str | None, device: torch.device, events: EventLog
) -> tuple[torch.nn.Module, CheckpointInfo]:
    """A plain (unsharded) model holding a verified checkpoint's weights: built on the meta
    device, then loaded straight into its parameters. The optimizer state is never read."""
    model = empty_model(cfg, device)
    info = load_verified(cfg, model, checkpoint_id, events)
    return model.eval(), info


@torch.no_grad()
def validation_loss(model: torch.nn.Module, cfg: RunConfig, device: torch.device) -> tuple[float, int, int]:
    batches = validation_batches(cfg.dataset_dir, cfg.seq_len, cfg.batch_size, cfg.eval_batches, rank=0, world_size=1)
    total = 0.0
    for inputs, targets in batches:
        total += cross_entropy_loss(model(inputs.to(device)), targets.to(device)).item()
    return total / len(batches), len(batches), len(batches) * cfg.batch_size * cfg.seq_len


def evaluate(cfg: RunConfig, checkpoint_id: str | None = None, device: str | None = None) -> dict:
    events = EventLog(cfg.layout.events, run_id=cfg.run_id, role="evaluate")
    dev = choose_device(device or cfg.device)
    model, info = load_model(cfg, checkpoint_id, dev, events)
    loss, n_batches, n_tokens = validation_loss(model, cfg, dev)
    result = {
        "run_id": cfg.run_id,
        "checkpoint_id": info.checkpoint_id,
        "step": info.step,
        "val_loss": loss,
        "perplexity": math.exp(loss),
        "batches": n_batches,
        "tokens": n_tokens,
        "saved_world_size": info.world_size,
        "evaluated_at": time.time(),
    }
    atomic_write_text(cfg.layout.eval_result, json.dumps(result, indent=2, sort_keys=True) + "\n")
    events.emit(Event.EVAL, checkpoint_id=info.checkpoint_id, step=info.step, val_loss=loss, perplexity=math.exp(loss))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_resilience.training.evaluate",
        description="Evaluate the newest committed checkpoint of a run that verifies.",
    )
    parser.add_argument("--config", required=True, help="the run's config JSON (e.g. RUN_DIR/run.json)")
    parser.add_argument(
        "--checkpoint", default=None, help="a committed checkpoint id (default: the newest that verifies)"
    )
    parser.add_argument(
        "--device", default=None, choices=("auto", "cpu", "cuda"), help="default: the run config's device"
    )
    args = parser.parse_args(argv)
    # What torch and this package imported lives as long as this process: frozen, the collector
    # never scans it again. Otherwise the first full collection, which the load's allocations
    # trigger, scans all of it (about 0.1 s on 2 cores, in the middle of the read).
    gc.freeze()
    try:
        cfg = RunConfig.load(args.config)
        before = {q.get("checkpoint_id") for q in CheckpointCatalog(cfg.run_dir).quarantined()}
        result = evaluate(cfg, args.checkpoint, args.device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    except NoUsableCheckpoint as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_VERIFIED_CHECKPOINT
    except OSError as e:
        if storage_errno(e) is None:
            raise
        print(
            f"error: cannot write to the run dir {cfg.run_dir}: {e.strerror or e}; free space or fix "
            "its mount, then evaluate again",
            file=sys.stderr,
        )
        return int(ExitCode.STORAGE_ERROR)
    skipped = sorted({q.get("checkpoint_id") for q in CheckpointCatalog(cfg.run_dir).quarantined()} - before)
    if skipped:
        print(
            f"[evaluate] quarantined, failing verification or load: {', '.join(map(str, skipped))} "
            f"(see {cfg.layout.quarantine})",
            file=sys.stderr,
        )
    print(
        f"[evaluate] {result['checkpoint_id']} (step {result['step']}): val_loss {result['val_loss']:.4f}, "
        f"perplexity {result['perplexity']:.2f} -> {cfg.layout.eval_result}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
