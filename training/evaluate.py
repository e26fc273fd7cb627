"""Evaluate the newest committed checkpoint of a run that verifies, on the held-out validation split.

    python -m training.evaluate --config RUN.json [--checkpoint step_00000100] [--device cpu]

Runs in one process, whatever world size saved the checkpoint: DCP reshards the FSDP shards into
a plain model on load. Writes ``<run_dir>/eval.json`` atomically and an ``eval`` event:

    {"checkpoint_id": "step_00000100", "step": 100, "val_loss": 1.93, "perplexity": 6.9,
     "batches": 8, "tokens": 8192, "saved_world_size": 2, "evaluated_at": 1764480000.0}

Nothing is used before it verifies. The model is built on the meta device and its bytes are read
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
import io
import json
import logging
import math
import os
import pickle
import re
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.distributed.checkpoint as dcp

from training.checkpoint import load_checkpoint
from training.contract import (
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
from training.data import validation_batches
from training.model import build_model, cross_entropy_loss
from training.parallelize import choose_device

#: sysexits EX_NOINPUT: no committed checkpoint verifies and loads (or the requested one does not).
EXIT_NO_VERIFIED_CHECKPOINT = 66

log = logging.getLogger(__name__)


class NoUsableCheckpoint(Exception):
    """Committed checkpoints exist, but none that was asked for verifies and loads."""


def empty_model(cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    """The run's model with uninitialised parameters on ``device`` (built on the meta device): what
    a checkpoint load fills. A random init would be wasted work, most of a large model's load time."""
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
    if (isinstance(digests, list) and len(digests) == marker.get("world_size")
            and all(isinstance(d, str) for d in digests)):
        try:
            read = read_model_bytes(info.path, _plan_direct_read(info.path, metadata, params), len(digests))
        except NotDirectlyReadable as e:
            log.info("%s: reading it with DCP (%s)", info.checkpoint_id, e)
        except Exception as e:  # noqa: BLE001 - e.g. an unreadable file: the file checksums decide
            log.warning("%s: the direct read failed (%s: %s): checking every file", info.checkpoint_id,
                        type(e).__name__, e)
        else:
            if read == digests:
                return "model digests"
            log.warning("%s: the model bytes read do not match the digests its commit recorded (%s, "
                        "recorded %s): checking every file", info.checkpoint_id, read, digests)
    reason = verify_checkpoint(info.path, marker)
    if reason is not None:
        raise UntrustedCheckpoint(reason)
    load_checkpoint(info, {"model": params})  # DCP loads in place: straight into the parameters
    return "file checksums"


def _quarantine(catalog: CheckpointCatalog, info: CheckpointInfo, reason: str, events: EventLog,
                phase: str) -> Path:
    moved_to = catalog.quarantine(info, reason, by="evaluate", phase=phase)
    events.emit(Event.CHECKPOINT_QUARANTINED, checkpoint_id=info.checkpoint_id, step=info.step,
                reason=reason, moved_to=str(moved_to))
    return moved_to


def load_verified(cfg: RunConfig, model: torch.nn.Module, checkpoint_id: str | None,
                  events: EventLog) -> CheckpointInfo:
    """Load a verified checkpoint into ``model`` (in place) and return which one.

    ``checkpoint_id=None``: the newest committed one that verifies and loads; those that fail
    are quarantined on the way, with a ``checkpoint_quarantined`` event each (as
    ``choose_checkpoint`` / ``restore_checkpoint`` do for a resume). Otherwise exactly that one;
    if it fails verification it is quarantined and this raises."""
    catalog = CheckpointCatalog(cfg.run_dir)
    params = model.state_dict()  # the parameters' own storage: the load writes into the model
    if checkpoint_id is None:
        if not catalog.committed():
            raise ConfigError(f"no committed checkpoint in {cfg.layout.checkpoints}: train first "
                              "(torn checkpoints, without COMMITTED.json, are never evaluated)")
        for info in reversed(catalog.committed()):
            try:
                load_into(info, params)
            except UntrustedCheckpoint as e:
                _quarantine(catalog, info, str(e), events, phase="verify")
                continue
            except _OtherModel as e:
                raise ConfigError(f"{info.checkpoint_id} does not fit model={cfg.model!r}: {e}; evaluate with "
                                  "the run's own config") from None
            except Exception as e:  # noqa: BLE001 - it verified: an unreadable checkpoint all the same
                _quarantine(catalog, info, f"load failed: {type(e).__name__}: {e}"[:2000], events, phase="load")
                continue
            for torn in catalog.torn():
                if torn.step > info.step:
                    events.emit(Event.CHECKPOINT_SKIP, checkpoint_id=torn.checkpoint_id, step=torn.step,
                                reason="no commit marker: the save did not finish on every rank")
            return info
        raise NoUsableCheckpoint(
            f"no committed checkpoint of run {cfg.run_id} verifies and loads; each was quarantined "
            f"under {cfg.layout.quarantine} with its reason (QUARANTINED.json)")
    info = next((c for c in catalog.committed() if c.checkpoint_id == checkpoint_id), None)
    if info is None:
        earlier = [q for q in catalog.quarantined() if q.get("checkpoint_id") == checkpoint_id]
        if earlier:
            raise NoUsableCheckpoint(f"{checkpoint_id} was quarantined ({earlier[-1].get('reason')}): "
                                     f"see {earlier[-1]['path']}")
        raise ConfigError(f"{checkpoint_id} is not a committed checkpoint of run {cfg.run_id}; "
                          f"committed: {[c.checkpoint_id for c in catalog.committed()]}")
    try:
        load_into(info, params)
    except UntrustedCheckpoint as e:
        moved_to = _quarantine(catalog, info, str(e), events, phase="verify")
        raise NoUsableCheckpoint(f"{checkpoint_id} fails verification ({e}); quarantined to {moved_to}") from None
    except Exception as e:  # it verified, so its bytes are as committed: most likely not this config's model
        raise NoUsableCheckpoint(f"{checkpoint_id} verifies but does not load into model={cfg.model!r}: "
                                 f"{type(e).__name__}: {str(e)[:300]}") from None
    return info


def load_model(cfg: RunConfig, checkpoint_id: str | None, device: torch.device,
               events: EventLog) -> tuple[torch.nn.Module, CheckpointInfo]:
    """A plain (unsharded) model holding a verified checkpoint's weights: built on the meta
    device, then loaded straight into its parameters. The optimizer state is never read."""
    model = empty_model(cfg, device)
    info = load_verified(cfg, model, checkpoint_id, events)
    return model.eval(), info


# --------------------------------------------------------------------------------------------
# Reading the model's bytes straight into its parameters
# --------------------------------------------------------------------------------------------

#: DCP stores each tensor as a ``torch.save`` zip archive inside a shard file; its header (the
#: pickle and the zip's local headers) and its central directory each fit in this many bytes.
_HEAD_BYTES = 4096
_SHARD_FILE = re.compile(r"__(\d+)_\d+\.distcp")


class NotDirectlyReadable(Exception):
    """A stored tensor the direct read does not handle (compressed, a view of a larger storage,
    another byte order, ...): DCP's general load reads the checkpoint instead."""


@dataclass
class _StoredChunk:
    """One stored chunk of a model tensor: where its bytes are and the view they land in."""
    fqn: str
    offsets: tuple[int, ...]
    file: str
    at: int  # first byte of the tensor's data in ``file``
    nbytes: int
    target: torch.Tensor  # the slice of the parameter the chunk fills
    owner: int  # the rank that saved it: its model digest covers these bytes


class _TensorRecord(pickle.Unpickler):
    """Unpickles the ``data.pkl`` of a ``torch.save``'d tensor into what it describes (storage
    dtype and size, offset, shape, strides) without touching any data or importing anything."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: (storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise NotDirectlyReadable(f"data.pkl refers to {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid  # ('storage', storage type name, key, location, numel)


_STORAGE_DTYPES = {"FloatStorage": torch.float32, "BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16,
                   "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ByteStorage": torch.uint8, "BoolStorage": torch.bool}


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _zip_records(tail: bytes, length: int) -> dict[str, tuple[int, int]]:
    """``{name: (offset of its local header, size)}`` of a stored (uncompressed) zip archive of
    ``length`` bytes whose last ``len(tail)`` bytes are ``tail``, from its central directory."""
    if len(tail) < 22 or tail[-22:-18] != b"PK\x05\x06":
        raise NotDirectlyReadable("no zip end record where it should be (a zip comment?)")
    cd_size, cd_offset = struct.unpack_from("<II", tail, len(tail) - 22 + 12)
    cd_end = length - 22
    if len(tail) >= 42 and tail[-42:-38] == b"PK\x06\x07":  # torch.save writes zip64 end records too
        cd_end, = struct.unpack_from("<Q", tail, len(tail) - 42 + 8)
    start = len(tail) - (length - cd_offset)
    if 0xFFFFFFFF in (cd_size, cd_offset) or start < 0 or cd_offset + cd_size != cd_end:
        raise NotDirectlyReadable("the zip's central directory is not in its last bytes")
    records, at = {}, start
    while at < start + cd_size:
        if tail[at:at + 4] != b"PK\x01\x02":
            raise NotDirectlyReadable("a damaged zip central directory")
        method, = struct.unpack_from("<H", tail, at + 10)
        csize, usize, nlen, xlen, clen = struct.unpack_from("<IIHHH", tail, at + 20)
        local, = struct.unpack_from("<I", tail, at + 42)
        if method != 0 or csize != usize or 0xFFFFFFFF in (usize, local):
            raise NotDirectlyReadable("a compressed or zip64 record")
        records[tail[at + 46: at + 46 + nlen].decode()] = (local, usize)
        at += 46 + nlen + xlen + clen
    return records


def _record_data(head: bytes, records: dict[str, tuple[int, int]], suffix: str) -> tuple[int, int]:
    """(offset of the data, size) of the record whose name ends with ``suffix``; its local
    header must be in ``head`` (the archive's first bytes)."""
    name = next((n for n in records if n.endswith(suffix)), None)
    if name is None:
        raise NotDirectlyReadable(f"no {suffix} record")
    local, size = records[name]
    if local + 30 > len(head) or head[local:local + 4] != b"PK\x03\x04":
        raise NotDirectlyReadable(f"the {suffix} record's header is not in the first {len(head)} bytes")
    nlen, xlen = struct.unpack_from("<HH", head, local + 26)
    return local + 30 + nlen + xlen, size


def _in_head(head: bytes, at: int, size: int, what: str) -> bytes:
    if at + size > len(head):
        raise NotDirectlyReadable(f"{what} is not in the first {len(head)} bytes")
    return head[at:at + size]


def _plan_direct_read(path: Path, metadata: Any, params: dict[str, torch.Tensor]) -> list[_StoredChunk]:
    """Where every stored chunk of the model's tensors is, and which slice of ``params`` (the
    model's own tensors, by state-dict key) it fills. Reads each tensor's header (~4 KB) and
    central directory; raises ``NotDirectlyReadable`` for anything but a plain stored tensor."""
    sizes = {(fqn, tuple(c.offsets)): tuple(c.sizes) for fqn, md in metadata.state_dict_metadata.items()
             if fqn.startswith("model.") for c in getattr(md, "chunks", ())}
    chunks, fds = [], {}
    try:
        for index, stored in metadata.storage_data.items():
            if not index.fqn.startswith("model."):
                continue
            offsets = tuple(index.offset or ())
            target = params.get(index.fqn[len("model."):])
            owner = _SHARD_FILE.fullmatch(stored.relative_path)
            if target is None or target.device.type != "cpu" or owner is None or stored.transform_descriptors:
                raise NotDirectlyReadable(f"{index.fqn} in {stored.relative_path}")
            shape = sizes[(index.fqn, offsets)]
            for dim, (start, n) in enumerate(zip(offsets, shape)):
                target = target.narrow(dim, start, n)
            fd = fds.get(stored.relative_path)
            if fd is None:
                fd = fds[stored.relative_path] = os.open(path / stored.relative_path, os.O_RDONLY)
            head = os.pread(fd, min(stored.length, _HEAD_BYTES), stored.offset)
            tail = os.pread(fd, min(stored.length, _HEAD_BYTES), stored.offset + max(0, stored.length - _HEAD_BYTES))
            records = _zip_records(tail, stored.length)
            byteorder = _in_head(head, *_record_data(head, records, "/byteorder"), "byteorder")
            if byteorder != sys.byteorder.encode():
                raise NotDirectlyReadable(f"{index.fqn} is stored {byteorder!r}-endian")
            pickled = _in_head(head, *_record_data(head, records, "/data.pkl"), "data.pkl")
            storage, offset, size, stride = _TensorRecord(io.BytesIO(pickled)).load()
            data_at, data_size = _record_data(head, records, f"/data/{storage[2]}")
            if (_STORAGE_DTYPES.get(storage[1]) != target.dtype or offset != 0 or size != tuple(target.shape)
                    or stride != _contiguous_strides(size) or data_size != target.numel() * target.element_size()
                    or data_at + data_size > stored.length):
                raise NotDirectlyReadable(f"{index.fqn}: stored as {storage[1]} {size} {stride} at {offset}, "
                                          f"the model's is {target.dtype} {tuple(target.shape)}")
            chunks.append(_StoredChunk(index.fqn, offsets, stored.relative_path, stored.offset + data_at,
                                       data_size, target, int(owner.group(1))))
    finally:
        for fd in fds.values():
            os.close(fd)
    return chunks


def _read_chunk(fd: int, chunk: _StoredChunk) -> memoryview:
    """Read ``chunk``'s bytes into its slice of the parameter; returns those bytes."""
    contiguous = chunk.target.is_contiguous()
    into = chunk.target if contiguous else torch.empty_like(chunk.target, memory_format=torch.contiguous_format)
    view = memoryview(into.view(-1).view(torch.uint8).numpy()) if chunk.nbytes else memoryview(b"")
    done = 0
    while done < chunk.nbytes:
        n = os.preadv(fd, [view[done:]], chunk.at + done)
        if n <= 0:
            raise OSError(f"{chunk.file} ends before byte {chunk.at + done}")
        done += n
    if not contiguous:
        chunk.target.copy_(into)
    return view


def read_model_bytes(path: Path, chunks: list[_StoredChunk], world_size: int) -> list[str]:
    """Read every chunk into the model and return each saved rank's model digest over the bytes
    read (CRC32C in (fqn, offset) order, as ``checkpoint_writer.model_digest`` took it at save).
    Reader threads fill the parameters while this thread checksums what has landed, in digest
    order (preadv and CRC32C both release the GIL)."""
    stray = next((c for c in chunks if c.owner >= world_size), None)
    if stray is not None:
        raise NotDirectlyReadable(f"{stray.file} is from rank {stray.owner} of a {world_size}-rank save")
    ordered = sorted(chunks, key=lambda c: (c.owner, c.fqn, c.offsets))
    fds = {name: os.open(path / name, os.O_RDONLY) for name in {c.file for c in chunks}}
    readers = max(1, min(4, (os.cpu_count() or 2) - 1))  # and one core to checksum
    pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="eval-read")
    digests = [0] * world_size
    try:
        landed = [pool.submit(_read_chunk, fds[c.file], c) for c in ordered]
        for chunk, future in zip(ordered, landed):
            digests[chunk.owner] = crc32c.crc32c(future.result(), digests[chunk.owner])
    finally:
        pool.shutdown(cancel_futures=True)  # waits for reads under way: only then close their files
        for fd in fds.values():
            os.close(fd)
    return [f"{d:08x}" for d in digests]


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
