"""Evaluate the newest committed checkpoint of a run on the held-out validation split.

    python -m training.evaluate --config RUN.json [--checkpoint step_00000100] [--device cpu]

Runs in one process, whatever world size saved the checkpoint: DCP reshards the FSDP shards into
a plain model on load. Writes ``<run_dir>/eval.json`` atomically and an ``eval`` event:

    {"checkpoint_id": "step_00000100", "step": 100, "val_loss": 1.93, "perplexity": 6.9,
     "batches": 8, "tokens": 8192, "saved_world_size": 2, "evaluated_at": 1764480000.0}
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

from training.contract import (
    CheckpointCatalog,
    CheckpointInfo,
    ConfigError,
    Event,
    EventLog,
    ExitCode,
    RunConfig,
    atomic_write_text,
)
from training.data import validation_batches
from training.model import build_model, cross_entropy_loss
from training.parallelize import choose_device


def pick_checkpoint(cfg: RunConfig, checkpoint_id: str | None) -> CheckpointInfo:
    catalog = CheckpointCatalog(cfg.run_dir)
    if checkpoint_id is None:
        latest = catalog.latest()
        if latest is None:
            raise ConfigError(f"no committed checkpoint in {cfg.layout.checkpoints}: train first "
                              "(torn checkpoints, without COMMITTED.json, are never evaluated)")
        return latest
    for info in catalog.committed():
        if info.checkpoint_id == checkpoint_id:
            return info
    raise ConfigError(f"{checkpoint_id} is not a committed checkpoint of run {cfg.run_id}; "
                      f"committed: {[c.checkpoint_id for c in catalog.committed()]}")


def empty_model(cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    """The run's model with uninitialised parameters on ``device`` (built on the meta device): what
    a checkpoint load fills. A random init would be wasted work, most of a large model's load time."""
    model = build_model(cfg.model, device="meta", max_seq_len=cfg.seq_len)
    model.to_empty(device=device)
    model.init_buffers()
    return model


def load_model(cfg: RunConfig, info: CheckpointInfo, device: torch.device) -> torch.nn.Module:
    """A plain (unsharded) model holding the checkpoint's weights; optimizer state is not read."""
    model = empty_model(cfg, device)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(info.path))
    set_model_state_dict(model, state["model"])
    return model.eval()


@torch.no_grad()
def validation_loss(model: torch.nn.Module, cfg: RunConfig, device: torch.device) -> tuple[float, int, int]:
    batches = validation_batches(cfg.dataset_dir, cfg.seq_len, cfg.batch_size, cfg.eval_batches,
                                 rank=0, world_size=1)
    total = 0.0
    for inputs, targets in batches:
        total += cross_entropy_loss(model(inputs.to(device)), targets.to(device)).item()
    return total / len(batches), len(batches), len(batches) * cfg.batch_size * cfg.seq_len


def evaluate(cfg: RunConfig, checkpoint_id: str | None = None, device: str | None = None) -> dict:
    info = pick_checkpoint(cfg, checkpoint_id)
    dev = choose_device(device or cfg.device)
    model = load_model(cfg, info, dev)
    loss, n_batches, n_tokens = validation_loss(model, cfg, dev)
    result = {"run_id": cfg.run_id, "checkpoint_id": info.checkpoint_id, "step": info.step,
              "val_loss": loss, "perplexity": math.exp(loss), "batches": n_batches, "tokens": n_tokens,
              "saved_world_size": info.world_size, "evaluated_at": time.time()}
    atomic_write_text(cfg.layout.eval_result, json.dumps(result, indent=2, sort_keys=True) + "\n")
    EventLog(cfg.layout.events, run_id=cfg.run_id, role="evaluate").emit(
        Event.EVAL, checkpoint_id=info.checkpoint_id, step=info.step, val_loss=loss, perplexity=math.exp(loss))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.evaluate",
                                     description="Evaluate the newest committed checkpoint of a run.")
    parser.add_argument("--config", required=True, help="the run's config JSON (e.g. RUN_DIR/run.json)")
    parser.add_argument("--checkpoint", default=None, help="a committed checkpoint id (default: the newest)")
    parser.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"),
                        help="default: the run config's device")
    args = parser.parse_args(argv)
    try:
        cfg = RunConfig.load(args.config)
        result = evaluate(cfg, args.checkpoint, args.device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    print(f"[evaluate] {result['checkpoint_id']} (step {result['step']}): val_loss {result['val_loss']:.4f}, "
          f"perplexity {result['perplexity']:.2f} -> {cfg.layout.eval_result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
