"""Turn a folder of text files into byte-token shards: ``python -m fsdp_resilience.training.prepare_data SRC DST``.

    python -m fsdp_resilience.training.prepare_data SRC DST [--val-fraction 0.05] [--shard-tokens 16777216]
        [--extensions .py,.txt,.md,.rst] [--max-bytes N]

Walks SRC recursively in sorted order (skipping hidden folders, __pycache__ and site-/
dist-packages, so pointing it at the stdlib takes the stdlib only), keeps files with one of
the extensions that read as text (no NUL byte), and makes every byte a token, with byte 0
(which no kept file contains) after each file as a document separator. Whole files are held out for
validation: those whose stable hash of their path relative to SRC falls below val-fraction (at
least one file). ``--max-bytes`` caps the text read (the last file is cut at the cap).

The dataset format (``byte-tokens-v1``, read by src/fsdp_resilience/training/data.py)::

    DST/index.json      {"format": "byte-tokens-v1", "dtype": "uint16", "vocab_size": 256,
                         "separator": 0,
                         "train": [{"file": "train_00000.bin", "tokens": N}, ...],
                         "val":   [{"file": "val_00000.bin", "tokens": M}, ...],
                         "source": "/abs/SRC", "created_at": "2025-...Z",
                         "files": {"train": n, "val": m}, "sha256": "<of all tokens>",
                         "params": {...the arguments...}}
    DST/train_00000.bin raw little-endian uint16 tokens (a numpy memmap), <= shard-tokens each
    DST/val_00000.bin

index.json is written last, atomically: a folder without it is not a dataset (a crash while
writing leaves shards only, which the next run overwrites). Re-running on a DST that already
holds the identical dataset is a no-op; a DST holding anything else is refused (exit 2).

Imports numpy and the standard library only (no torch), so it starts fast.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from fsdp_resilience.training.contract import (
    DATASET_FORMAT,
    DATASET_INDEX,
    DATASET_SPLITS,
    DATASET_TOKEN_DTYPE,
    atomic_write_text,
)

FORMAT = DATASET_FORMAT
INDEX_FILE = DATASET_INDEX
TOKEN_DTYPE = DATASET_TOKEN_DTYPE
VOCAB_SIZE = 256
SEPARATOR = 0
SPLITS = DATASET_SPLITS
DEFAULT_EXTENSIONS = ".py,.txt,.md,.rst"
DEFAULT_SHARD_TOKENS = 16 * 1024 * 1024
# Installed third-party packages are not the corpus (the stdlib folder holds site-packages).
SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})


class PrepareError(Exception):
    """Why the dataset cannot be prepared; the message says what to do. Exit code 2."""


@dataclass
class Corpus:
    """The token streams of both splits, in memory (tens of MB for the stdlib)."""

    tokens: dict[str, bytearray] = field(default_factory=lambda: {s: bytearray() for s in SPLITS})
    files: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SPLITS})

    def fingerprint(self) -> str:
        h = hashlib.sha256(FORMAT.encode())
        for split in SPLITS:
            h.update(f"|{split}:{len(self.tokens[split])}|".encode())
            h.update(self.tokens[split])
        return h.hexdigest()


def path_fraction(relpath: str) -> float:
    """A stable number in [0, 1) for a relative path (not Python's salted hash())."""
    digest = hashlib.sha1(relpath.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def text_files(src: Path, extensions: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(posix path relative to src, path) of candidate files, in a deterministic order."""
    out = []
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not (d.startswith(".") or d in SKIPPED_DIRS))
        for name in sorted(files):
            if name.lower().endswith(extensions):
                path = Path(root) / name
                out.append((path.relative_to(src).as_posix(), path))
    return out


def read_corpus(src: Path, extensions: tuple[str, ...], val_fraction: float, max_bytes: int | None) -> Corpus:
    # Read first, then split: the hold-out rule may need to move one file between splits.
    docs: list[tuple[str, bytes]] = []
    total = 0
    for rel, path in text_files(src, extensions):
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable (permissions, a dangling link): not part of the corpus
        if not data or b"\0" in data:
            continue  # empty, or binary
        if max_bytes is not None:
            data = data[: max_bytes - total]
        docs.append((rel, data))
        total += len(data)
    if not docs:
        raise PrepareError(
            f"no text files with extensions {', '.join(extensions)} under {src}; "
            "point SRC at a folder of text (or change --extensions)"
        )
    if len(docs) < 2:
        raise PrepareError(
            f"only one text file under {src}: at least two are needed so a whole file can be held out for validation"
        )

    fractions = [path_fraction(rel) for rel, _ in docs]
    in_val = [f < val_fraction for f in fractions]
    if not any(in_val):  # small corpora: hold out the file with the lowest hash
        in_val[min(range(len(docs)), key=fractions.__getitem__)] = True
    if all(in_val):
        in_val[max(range(len(docs)), key=fractions.__getitem__)] = False

    corpus = Corpus()
    for (_, data), val in zip(docs, in_val):
        split = "val" if val else "train"
        corpus.tokens[split] += data
        corpus.tokens[split].append(SEPARATOR)
        corpus.files[split] += 1
    return corpus


def read_existing_index(dst: Path) -> dict | None:
    try:
        index = json.loads((dst / INDEX_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # present but unreadable: some other (or a damaged) dataset
    return index if isinstance(index, dict) else {}


def is_shard_or_temp(name: str) -> bool:
    shard = name.endswith(".bin") and name.startswith(tuple(f"{s}_" for s in SPLITS))
    return shard or name.startswith(f".{INDEX_FILE}.tmp")


def check_destination(dst: Path, fingerprint: str) -> bool:
    """True when dst already holds exactly this dataset; raises when it holds anything else."""
    if dst.exists() and not dst.is_dir():
        raise PrepareError(f"DST {dst} exists and is not a folder")
    if not dst.exists():
        return False
    index = read_existing_index(dst)
    if index is None:
        others = sorted(p.name for p in dst.iterdir() if not is_shard_or_temp(p.name))
        if others:
            raise PrepareError(
                f"DST {dst} is not empty and is not a dataset (it holds {', '.join(others[:5])}); "
                "choose an empty or new folder"
            )
        return False  # empty, or shards left by an interrupted run: overwrite them
    if index.get("sha256") == fingerprint and index.get("format") == FORMAT:
        return True
    raise PrepareError(
        f"DST {dst} already holds a different dataset (source {index.get('source', '?')}); "
        "remove it or choose another folder"
    )


def write_split(dst: Path, split: str, tokens: bytearray, shard_tokens: int) -> list[dict]:
    entries = []
    view = memoryview(tokens)
    for i, start in enumerate(range(0, len(tokens), shard_tokens)):
        name = f"{split}_{i:05d}.bin"
        chunk = np.frombuffer(view[start : start + shard_tokens], dtype=np.uint8).astype("<u2")
        with open(dst / name, "wb") as f:
            f.write(chunk.tobytes())
            f.flush()
            os.fsync(f.fileno())
        entries.append({"file": name, "tokens": int(chunk.size)})
    return entries


def prepare(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    val_fraction: float = 0.05,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    extensions: str = DEFAULT_EXTENSIONS,
    max_bytes: int | None = None,
) -> dict:
    """Build the dataset; returns its index (with "unchanged": True if it was already there)."""
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if not src.is_dir():
        raise PrepareError(f"SRC {src} does not exist or is not a folder; point it at a folder of text files")
    if not 0.0 < val_fraction <= 0.5:
        raise PrepareError(f"--val-fraction={val_fraction} must be in (0, 0.5]")
    if shard_tokens < 1024:
        raise PrepareError(f"--shard-tokens={shard_tokens} must be at least 1024")
    if max_bytes is not None and max_bytes < 1:
        raise PrepareError(f"--max-bytes={max_bytes} must be positive")
    names = [e.strip().lower() for e in extensions.split(",") if e.strip()]
    exts = tuple(sorted({e if e.startswith(".") else f".{e}" for e in names}))
    if not exts:
        raise PrepareError("--extensions is empty; give e.g. .py,.txt")

    corpus = read_corpus(src, exts, val_fraction, max_bytes)
    fingerprint = corpus.fingerprint()
    if check_destination(dst, fingerprint):
        return {**read_existing_index(dst), "unchanged": True}

    dst.mkdir(parents=True, exist_ok=True)
    for stale in dst.iterdir():  # shards of an interrupted run; none may outlive the new index
        if is_shard_or_temp(stale.name):
            stale.unlink()
    index = {
        "format": FORMAT,
        "dtype": TOKEN_DTYPE,
        "vocab_size": VOCAB_SIZE,
        "separator": SEPARATOR,
        **{split: write_split(dst, split, corpus.tokens[split], shard_tokens) for split in SPLITS},
        "files": dict(corpus.files),
        "sha256": fingerprint,
        "source": str(src),
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "params": {
            "val_fraction": val_fraction,
            "shard_tokens": shard_tokens,
            "extensions": list(exts),
            "max_bytes": max_bytes,
        },
    }
    atomic_write_text(dst / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_resilience.training.prepare_data", description=__doc__.split("\n")[0]
    )
    parser.add_argument("src", help="folder of text files (walked recursively)")
    parser.add_argument("dst", help="dataset folder to create (must be empty, new, or hold this dataset)")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="share of files held out (default 0.05)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    parser.add_argument(
        "--extensions", default=DEFAULT_EXTENSIONS, help=f"comma-separated (default {DEFAULT_EXTENSIONS})"
    )
    parser.add_argument("--max-bytes", type=int, default=None, help="stop after this many bytes of text")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    try:
        index = prepare(
            args.src,
            args.dst,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
            extensions=args.extensions,
            max_bytes=args.max_bytes,
        )
    except PrepareError as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    train_tokens = sum(e["tokens"] for e in index["train"])
    val_tokens = sum(e["tokens"] for e in index["val"])
    files = index.get("files", {})
    state = "unchanged (already prepared)" if index.get("unchanged") else f"{len(index['train'])} train shard(s)"
    print(
        f"prepare_data: {args.dst}: {files.get('train', 0) + files.get('val', 0)} files "
        f"({files.get('val', 0)} held out), {train_tokens:,} train + {val_tokens:,} val tokens, {state}, "
        f"{seconds:.2f}s ({(train_tokens + val_tokens) / 1e6 / max(seconds, 1e-9):.1f} M tokens/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
