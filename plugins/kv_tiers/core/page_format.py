"""Layer: plugin core (no SGLang import). The on-disk format of one KV page in the file store.

Every page file is a fixed 64-byte header followed by the raw payload. The header carries
what a reader needs to refuse a page instead of serving it:

    offset size field
    0      8    magic b"KLLMKVP1"
    8      2    format version (2: CRC-32C payloads; the store keeps each version in its own folder, and a page of another version met anyway is refused as foreign)
    10     2    flags (0)
    12     16   namespace digest: blake2b-128 of the store namespace (model, layout, rank, dtype)
    28     16   key digest: blake2b-128 of the page key the file was written for
    44     8    payload length in bytes
    52     4    CRC-32C (Castagnoli) of the payload
    56     4    CRC-32 of bytes 0..55 (the header itself)
    60     4    zero padding

A page is *foreign* when its namespace digest differs (written by another model, layout or
rank), *misplaced* when its key digest differs, *truncated* when the file is shorter than the
header says, and *corrupt* when a checksum does not match.
"""
from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass
from enum import Enum

import crc32c as _crc32c

MAGIC = b"KLLMKVP1"
VERSION = 2
HEADER_SIZE = 64
_STRUCT = struct.Struct("<8sHH16s16sQI")  # 56 bytes, followed by header CRC and padding
_TAIL = struct.Struct("<I4x")


class PageFault(str, Enum):
    """Why a page on disk was refused."""

    MISSING = "missing"
    TRUNCATED = "truncated"
    CORRUPT = "corrupt"
    FOREIGN = "foreign"
    MISPLACED = "misplaced"
    SIZE_MISMATCH = "size_mismatch"
    IO_ERROR = "io_error"


class PageError(Exception):
    """A page could not be served; `fault` says why."""

    def __init__(self, fault: PageFault, detail: str = "") -> None:
        super().__init__(f"{fault.value}: {detail}" if detail else fault.value)
        self.fault = fault


def digest16(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


@dataclass(frozen=True)
class PageHeader:
    namespace_digest: bytes
    key_digest: bytes
    payload_len: int
    payload_crc: int


def payload_parts(payload: bytes | memoryview | list[bytes | memoryview]) -> list[memoryview]:
    """A page's bytes as flat byte views: one buffer, or several whose concatenation is the page (a
    page read into or written from a host pool in place, where it lies in several strided blocks)."""
    parts = payload if isinstance(payload, list) else [payload]
    return [p if isinstance(p, memoryview) and p.format == "B" and p.ndim == 1 else memoryview(p).cast("B")
            for p in parts]


def encode_header(namespace_digest: bytes, key: str, payload: bytes | memoryview | list[bytes | memoryview]) -> bytes:
    return encode_record(namespace_digest, key, *crc_of(payload_parts(payload)))


#: parts at least this large are checksummed with the GIL released (`crc32c`'s gil_release_mode 1)
GIL_RELEASE_BYTES = 512 * 1024


def nbytes_of(data: bytes | memoryview) -> int:
    """Bytes in a page or part, given as bytes or as a memoryview of any format."""
    return data.nbytes if isinstance(data, memoryview) else len(data)


def crc32c(data: bytes | memoryview, crc: int = 0) -> int:
    """CRC-32C of `data` (continuing `crc`). The `crc32c` package computes it with the CPU's CRC
    instruction (2.4 us per 32 KiB page against 16 us for zlib's CRC-32 on this project's CPU
    machine). Small parts keep the GIL (`gil_release_mode` 0): a storage thread that released it
    once per 32 KiB page would then wait for the scheduler's thread to hand it back. Parts of
    `GIL_RELEASE_BYTES` or more release it: an 8B model's 2 MiB page takes about 0.1-0.15 ms, for
    which the scheduler's thread would otherwise wait at every page an L3 write checksums."""
    return _crc32c.crc32c(data, crc, 1 if nbytes_of(data) >= GIL_RELEASE_BYTES else 0)  # positional: a keyword costs ~0.4 us


def crc_of(parts: list[bytes | memoryview]) -> tuple[int, int]:
    """(total length, CRC-32C) of the concatenation of `parts` (a page held in several buffers)."""
    crc, n = 0, 0
    for part in parts:
        crc = crc32c(part, crc)
        n += nbytes_of(part)
    return n, crc


def encode_record(namespace_digest: bytes, key: str, length: int, crc: int) -> bytes:
    """A header for a payload of `length` bytes with CRC-32C `crc`, stored apart from the payload
    (the Mooncake store keeps it as a small object next to the page's K and V objects)."""
    head = _STRUCT.pack(MAGIC, VERSION, 0, namespace_digest, digest16(key), length, crc)
    return head + _TAIL.pack(zlib.crc32(head))


def decode_header(raw: bytes | memoryview) -> PageHeader:
    """Parse and check a header; raise PageError(TRUNCATED/CORRUPT) when it is not a valid one."""
    if len(raw) < HEADER_SIZE:
        raise PageError(PageFault.TRUNCATED, f"header has {len(raw)} of {HEADER_SIZE} bytes")
    head = bytes(raw[: _STRUCT.size])
    tail = bytes(raw[_STRUCT.size : HEADER_SIZE])
    (crc,) = _TAIL.unpack(tail)
    if zlib.crc32(head) != crc:
        raise PageError(PageFault.CORRUPT, "header checksum")
    if tail != _TAIL.pack(crc):  # the padding is written as zeros and checked by no CRC
        raise PageError(PageFault.CORRUPT, "header padding")
    magic, version, _flags, ns, kd, length, pcrc = _STRUCT.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise PageError(PageFault.FOREIGN, f"magic/version {magic!r}/{version}")
    return PageHeader(ns, kd, length, pcrc)


def check_page(header: PageHeader, namespace_digest: bytes, key: str,
               payload: bytes | memoryview | list[bytes | memoryview], expected_len: int | None = None) -> None:
    """Raise PageError unless `payload` (one buffer or the page's parts in order) is the intact page
    written for `key` in this namespace."""
    if header.namespace_digest != namespace_digest:
        raise PageError(PageFault.FOREIGN, "namespace differs")
    if header.key_digest != digest16(key):
        raise PageError(PageFault.MISPLACED, "key digest differs")
    if expected_len is not None and header.payload_len != expected_len:
        raise PageError(PageFault.SIZE_MISMATCH, f"page has {header.payload_len} bytes, reader wants {expected_len}")
    parts = payload_parts(payload)
    have = sum(p.nbytes for p in parts)
    if have < header.payload_len:
        raise PageError(PageFault.TRUNCATED, f"payload has {have} of {header.payload_len} bytes")
    crc, left = 0, header.payload_len
    for part in parts:
        if left <= 0:
            break
        crc = crc32c(part if part.nbytes <= left else part[:left], crc)
        left -= part.nbytes
    if crc != header.payload_crc:
        raise PageError(PageFault.CORRUPT, "payload checksum")


def check_record(header: PageHeader, namespace_digest: bytes, key: str, length: int, crc: int) -> None:
    """Raise PageError unless a payload of `length` bytes with CRC-32C `crc` is the page that the
    separately stored `header` describes (see `encode_record`)."""
    if header.namespace_digest != namespace_digest:
        raise PageError(PageFault.FOREIGN, "namespace differs")
    if header.key_digest != digest16(key):
        raise PageError(PageFault.MISPLACED, "key digest differs")
    if header.payload_len != length:
        raise PageError(PageFault.SIZE_MISMATCH, f"page has {header.payload_len} bytes, reader has {length}")
    if header.payload_crc != crc:
        raise PageError(PageFault.CORRUPT, "payload checksum")
