"""Evaluate the newest committed checkpoint of a run that verifies, on the held-out validation split.

    python -m training.evaluate --config RUN.json [--checkpoint step_00000100] [--device cpu]

Runs in one process, whatever world size saved the checkpoint: DCP reshards the FSDP shards into
a plain model on load. Writes ``<run_dir>/eval.json`` atomically and an ``eval`` event:

    {"checkpoint_id": "step_00000100", "step": 100, "val_loss": 1.93, "perplexity": 6.9,
     "batches": 8, "tokens": 8192, "saved_world_size": 2, "evaluated_at": 1764480000.0}

Nothing is loaded before it verifies (``contract.verify_checkpoint``: every file present, its
size and CRC32C as committed). Without ``--checkpoint``, a checkpoint that fails verification or
its load is quarantined (``checkpoints/quarantine/``, with the reason, and a
``checkpoint_quarantined`` event) and the newest earlier one that verifies is evaluated instead.
A ``--checkpoint`` that fails verification is quarantined too, and is an error: nothing else is
evaluated in its place.

Exit codes:
  0   evaluated
  2   bad config or arguments, or nothing committed yet (train first)
  66  (EX_NOINPUT) committed checkpoints exist but none verifies and loads, or the requested one
      does not; what failed and why is in checkpoints/quarantine/*/QUARANTINED.json
  74  (EX_IOERR) the run dir is full or read-only: eval.json cannot be written
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from training.checkpoint import choose_checkpoint, restore_checkpoint
from training.contract import (
    CheckpointCatalog,
    CheckpointInfo,
    ConfigError,
    Event,
    EventLog,
    ExitCode,
    RunConfig,
    atomic_write_text,
    storage_errno,
    verify_checkpoint,
)
from training.data import validation_batches
from training.model import build_model, cross_entropy_loss
from training.parallelize import choose_device

#: sysexits EX_NOINPUT: no committed checkpoint verifies and loads (or the requested one does not).
EXIT_NO_VERIFIED_CHECKPOINT = 66


class NoUsableCheckpoint(Exception):
    """Committed checkpoints exist, but none that was asked for verifies and loads."""


def empty_model(cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    """The run's model with uninitialised parameters on ``device`` (built on the meta device): what
    a checkpoint load fills. A random init would be wasted work, most of a large model's load time."""
    model = build_model(cfg.model, device="meta", max_seq_len=cfg.seq_len)
    model.to_empty(device=device)
    model.init_buffers()
    return model


def load_verified(cfg: RunConfig, state: dict, checkpoint_id: str | None, events: EventLog) -> CheckpointInfo:
    """Load a verified checkpoint into ``state`` (in place) and return which one.

    ``checkpoint_id=None``: the newest committed one that verifies and loads; those that fail are
    quarantined on the way (``choose_checkpoint``, ``restore_checkpoint``). Otherwise exactly
    that one; if it fails verification it is quarantined and this raises."""
    catalog = CheckpointCatalog(cfg.run_dir)
    if checkpoint_id is None:
        if not catalog.committed():
            raise ConfigError(f"no committed checkpoint in {cfg.layout.checkpoints}: train first "
                              "(torn checkpoints, without COMMITTED.json, are never evaluated)")
        chosen = choose_checkpoint(cfg.run_dir, events=events)
        loaded = restore_checkpoint(cfg.run_dir, state, chosen, events=events) if chosen is not None else None
        if loaded is None:
            raise NoUsableCheckpoint(
                f"no committed checkpoint of run {cfg.run_id} verifies and loads; each was quarantined "
                f"under {cfg.layout.quarantine} with its reason (QUARANTINED.json)")
        return loaded
    info = next((c for c in catalog.committed() if c.checkpoint_id == checkpoint_id), None)
    if info is None:
        earlier = [q for q in catalog.quarantined() if q.get("checkpoint_id") == checkpoint_id]
        if earlier:
            raise NoUsableCheckpoint(f"{checkpoint_id} was quarantined ({earlier[-1].get('reason')}): "
                                     f"see {earlier[-1]['path']}")
        raise ConfigError(f"{checkpoint_id} is not a committed checkpoint of run {cfg.run_id}; "
                          f"committed: {[c.checkpoint_id for c in catalog.committed()]}")
    reason = verify_checkpoint(info.path)
    if reason is not None:
        moved_to = catalog.quarantine(info, reason, by="evaluate")
        events.emit(Event.CHECKPOINT_QUARANTINED, checkpoint_id=info.checkpoint_id, step=info.step,
                    reason=reason, moved_to=str(moved_to))
        raise NoUsableCheckpoint(f"{checkpoint_id} fails verification ({reason}); quarantined to {moved_to}")
    try:
        dcp.load(state, checkpoint_id=str(info.path))
    except Exception as e:  # it verified, so its bytes are as committed: most likely not this config's model
        raise NoUsableCheckpoint(f"{checkpoint_id} verifies but does not load into model={cfg.model!r}: "
                                 f"{type(e).__name__}: {str(e)[:300]}") from None
    return info


def load_model(cfg: RunConfig, checkpoint_id: str | None, device: torch.device,
               events: EventLog) -> tuple[torch.nn.Module, CheckpointInfo]:
    """A plain (unsharded) model holding a verified checkpoint's weights; optimizer state is not
    read."""
    model = empty_model(cfg, device)
    state = {"model": get_model_state_dict(model)}
    info = load_verified(cfg, state, checkpoint_id, events)
    set_model_state_dict(model, state["model"])
    return model.eval(), info


@torch.no_grad()
def validation_loss(model: torch.nn.Module, cfg: RunConfig, device: torch.device) -> tuple[float, int, int]:
    batches = validation_batches(cfg.dataset_dir, cfg.seq_len, cfg.batch_size, cfg.eval_batches,
                                 rank=0, world_size=1)
    total = 0.0
    for inputs, targets in batches:
        total += cross_entropy_loss(model(inputs.to(device)), targets.to(device)).item()
    return total / len(batches), len(batches), len(batches) * cfg.batch_size * cfg.seq_len


def evaluate(cfg: RunConfig, checkpoint_id: str | None = None, device: str | None = None) -> dict:
    events = EventLog(cfg.layout.events, run_id=cfg.run_id, role="evaluate")
    dev = choose_device(device or cfg.device)
    model, info = load_model(cfg, checkpoint_id, dev, events)
    loss, n_batches, n_tokens = validation_loss(model, cfg, dev)
    result = {"run_id": cfg.run_id, "checkpoint_id": info.checkpoint_id, "step": info.step,
              "val_loss": loss, "perplexity": math.exp(loss), "batches": n_batches, "tokens": n_tokens,
              "saved_world_size": info.world_size, "evaluated_at": time.time()}
    atomic_write_text(cfg.layout.eval_result, json.dumps(result, indent=2, sort_keys=True) + "\n")
    events.emit(Event.EVAL, checkpoint_id=info.checkpoint_id, step=info.step, val_loss=loss,
                perplexity=math.exp(loss))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.evaluate",
                                     description="Evaluate the newest committed checkpoint of a run that verifies.")
    parser.add_argument("--config", required=True, help="the run's config JSON (e.g. RUN_DIR/run.json)")
    parser.add_argument("--checkpoint", default=None,
                        help="a committed checkpoint id (default: the newest that verifies)")
    parser.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"),
                        help="default: the run config's device")
    args = parser.parse_args(argv)
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
        print(f"error: cannot write to the run dir {cfg.run_dir}: {e.strerror or e}; free space or fix "
              "its mount, then evaluate again", file=sys.stderr)
        return int(ExitCode.STORAGE_ERROR)
    skipped = sorted({q.get("checkpoint_id") for q in CheckpointCatalog(cfg.run_dir).quarantined()} - before)
    if skipped:
        print(f"[evaluate] quarantined, failing verification or load: {', '.join(map(str, skipped))} "
              f"(see {cfg.layout.quarantine})", file=sys.stderr)
    print(f"[evaluate] {result['checkpoint_id']} (step {result['step']}): val_loss {result['val_loss']:.4f}, "
          f"perplexity {result['perplexity']:.2f} -> {cfg.layout.eval_result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
