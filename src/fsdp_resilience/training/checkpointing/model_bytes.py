"""Reading a committed DCP checkpoint's model tensors straight into a model's parameters.

Evaluation needs the weights only, in one process. DCP's general load reads each stored tensor
with ``torch.load`` into a new tensor and copies it into the parameter; here each tensor's bytes
are located (from ``.metadata`` and its ``torch.save`` header, parsed without touching the data)
and read with ``os.preadv`` into the parameter itself, while the main thread computes each saved
rank's CRC32C over exactly the bytes read, for the caller to compare with the model digests the
commit recorded. A layout this does not handle raises ``NotDirectlyReadable``: load with DCP.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import re
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import torch

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


_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "BFloat16Storage": torch.bfloat16,
    "HalfStorage": torch.float16,
    "DoubleStorage": torch.float64,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


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
        (cd_end,) = struct.unpack_from("<Q", tail, len(tail) - 42 + 8)
    start = len(tail) - (length - cd_offset)
    if 0xFFFFFFFF in (cd_size, cd_offset) or start < 0 or cd_offset + cd_size != cd_end:
        raise NotDirectlyReadable("the zip's central directory is not in its last bytes")
    records, at = {}, start
    while at < start + cd_size:
        if tail[at : at + 4] != b"PK\x01\x02":
            raise NotDirectlyReadable("a damaged zip central directory")
        (method,) = struct.unpack_from("<H", tail, at + 10)
        csize, usize, nlen, xlen, clen = struct.unpack_from("<IIHHH", tail, at + 20)
        (local,) = struct.unpack_from("<I", tail, at + 42)
        if method != 0 or csize != usize or 0xFFFFFFFF in (usize, local):
            raise NotDirectlyReadable("a compressed or zip64 record")
        records[tail[at + 46 : at + 46 + nlen].decode()] = (local, usize)
        at += 46 + nlen + xlen + clen
    return records


def _record_data(head: bytes, records: dict[str, tuple[int, int]], suffix: str) -> tuple[int, int]:
    """(offset of the data, size) of the record whose name ends with ``suffix``; its local
    header must be in ``head`` (the archive's first bytes)."""
    name = next((n for n in records if n.endswith(suffix)), None)
    if name is None:
        raise NotDirectlyReadable(f"no {suffix} record")
    local, size = records[name]
    if local + 30 > len(head) or head[local : local + 4] != b"PK\x03\x04":
        raise NotDirectlyReadable(f"the {suffix} record's header is not in the first {len(head)} bytes")
    nlen, xlen = struct.unpack_from("<HH", head, local + 26)
    return local + 30 + nlen + xlen, size


def _in_head(head: bytes, at: int, size: int, what: str) -> bytes:
    if at + size > len(head):
        raise NotDirectlyReadable(f"{what} is not in the first {len(head)} bytes")
    return head[at : at + size]


def plan_direct_read(path: Path, metadata: Any, params: dict[str, torch.Tensor]) -> list[_StoredChunk]:
    """Where every stored chunk of the model's tensors is, and which slice of ``params`` (the
    model's own tensors, by state-dict key) it fills. Reads each tensor's header (~4 KB) and
    central directory; raises ``NotDirectlyReadable`` for anything but a plain stored tensor."""
    sizes = {
        (fqn, tuple(c.offsets)): tuple(c.sizes)
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith("model.")
        for c in getattr(md, "chunks", ())
    }
    chunks, fds = [], {}
    try:
        for index, stored in metadata.storage_data.items():
            if not index.fqn.startswith("model."):
                continue
            offsets = tuple(index.offset or ())
            target = params.get(index.fqn[len("model.") :])
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
            if (
                _STORAGE_DTYPES.get(storage[1]) != target.dtype
                or offset != 0
                or size != tuple(target.shape)
                or stride != _contiguous_strides(size)
                or data_size != target.numel() * target.element_size()
                or data_at + data_size > stored.length
            ):
                raise NotDirectlyReadable(
                    f"{index.fqn}: stored as {storage[1]} {size} {stride} at {offset}, "
                    f"the model's is {target.dtype} {tuple(target.shape)}"
                )
            chunks.append(
                _StoredChunk(
                    index.fqn,
                    offsets,
                    stored.relative_path,
                    stored.offset + data_at,
                    data_size,
                    target,
                    int(owner.group(1)),
                )
            )
    finally:
        for fd in fds.values():
            os.close(fd)
    return chunks


#: Each chunk is read in blocks of this many bytes, and each block is checksummed right after it
#: lands, while it is still in the CPU's cache: the read and the CRC32C are one pass over memory.
_BLOCK_BYTES = 1 << 20

#: CRC32C's polynomial, bit-reflected (as the crc32c package and iSCSI take it).
_CRC32C_POLY = 0x82F63B78


def _gf2_multiply(a: int, b: int) -> int:
    """a(x)·b(x) modulo the CRC32C polynomial, both bit-reflected (zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1


_X_POW_2K = [1 << 30]  # x^(2^k) mod P for k = 0, 1, ...: x^1, x^2, x^4, ...
for _ in range(63):
    _X_POW_2K.append(_gf2_multiply(_X_POW_2K[-1], _X_POW_2K[-1]))


def _x_pow_8n(n: int) -> int:
    """x^(8·n) mod P: what appending ``n`` bytes does to a CRC's register."""
    p, k = 1 << 31, 3  # x^0; 8·n = n·2^3
    while n:
        if n & 1:
            p = _gf2_multiply(_X_POW_2K[k], p)
        n >>= 1
        k += 1
    return p


_X_POW_8N: dict[int, int] = {}  # by length: a model's chunks come in few sizes


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of A+B from ``crc1`` = CRC32C(A), ``crc2`` = CRC32C(B) and ``len2`` = len(B)
    (zlib's ``crc32_combine``), so that chunks checksummed apart, in any order, give the digest
    the writer took over them in sequence."""
    power = _X_POW_8N.get(len2)
    if power is None:
        power = _X_POW_8N[len2] = _x_pow_8n(len2)
    return _gf2_multiply(power, crc1) ^ crc2


def _read_chunk(fd: int, chunk: _StoredChunk) -> int:
    """Read ``chunk``'s bytes into its slice of the parameter, block by block, and return the
    CRC32C of the bytes that landed there: each block is checksummed in the parameter's own memory
    right after it is read (still in cache), so the CRC is over exactly what the model will hold,
    and a file changed after the read cannot change what was checked."""
    contiguous = chunk.target.is_contiguous()
    into = chunk.target if contiguous else torch.empty_like(chunk.target, memory_format=torch.contiguous_format)
    if not chunk.nbytes:
        return 0
    data = into.view(-1).view(torch.uint8)
    # A new model's memory is not mapped yet: touching one byte a page first maps it in one
    # sweep, cheaper than the kernel faulting it in page by page in the middle of each read.
    data[:: mmap.PAGESIZE].zero_()
    view = memoryview(data.numpy())
    crc, done = 0, 0
    while done < chunk.nbytes:
        n = os.preadv(fd, [view[done : done + _BLOCK_BYTES]], chunk.at + done)
        if n <= 0:
            raise OSError(f"{chunk.file} ends before byte {chunk.at + done}")
        crc = crc32c.crc32c(view[done : done + n], crc)
        done += n
    if not contiguous:
        chunk.target.copy_(into)
    return crc


def read_model_bytes(path: Path, chunks: list[_StoredChunk], world_size: int) -> list[str]:
    """Read every chunk into the model and return each saved rank's model digest over the bytes
    read (CRC32C in (fqn, offset) order, as ``write_job.model_digest`` took it at save).

    Reader threads, one a core, each read a chunk and checksum it in the same pass (preadv and
    CRC32C both release the GIL, and this thread only waits); the chunks' CRCs are then combined
    in digest order (``crc32c_combine``). Nothing here decides whether the bytes are good: the caller compares the
    digests with those the commit recorded, and must not use the parameters unless they match."""
    fds: dict[str, int] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 2)), thread_name_prefix="eval-read")
    landed = []
    try:
        for chunk in chunks:
            if chunk.owner >= world_size:
                raise NotDirectlyReadable(f"{chunk.file} is from rank {chunk.owner} of a {world_size}-rank save")
            fd = fds.get(chunk.file)
            if fd is None:
                fd = fds[chunk.file] = os.open(path / chunk.file, os.O_RDONLY)
            landed.append((chunk, pool.submit(_read_chunk, fd, chunk)))
        digests = [0] * world_size
        for chunk, crc in sorted(landed, key=lambda pair: (pair[0].owner, pair[0].fqn, pair[0].offsets)):
            digests[chunk.owner] = crc32c_combine(digests[chunk.owner], crc.result(), chunk.nbytes)
    finally:
        pool.shutdown(cancel_futures=True)  # waits for reads under way: only then close their files
        for fd in fds.values():
            os.close(fd)
    return [f"{d:08x}" for d in digests]
