"""Layer: plugin core (no SGLang import). The on-disk format of one KV page in the file store.

Every page file is a fixed 64-byte header followed by the raw payload. The header carries
what a reader needs to refuse a page instead of serving it:

    offset size field
    0      8    magic b"KLLMKVP1"
    8      2    format version (1)
    10     2    flags (0)
    12     16   namespace digest: blake2b-128 of the store namespace (model, layout, rank, dtype)
    28     16   key digest: blake2b-128 of the page key the file was written for
    44     8    payload length in bytes
    52     4    CRC-32 of the payload
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

MAGIC = b"KLLMKVP1"
VERSION = 1
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


def encode_header(namespace_digest: bytes, key: str, payload: bytes | memoryview) -> bytes:
    return encode_record(namespace_digest, key, *crc_of([payload]))


# zlib.crc32 releases the GIL for inputs above 5 KiB; a storage thread that does so once per page
# must then wait for the scheduler's thread to hand it back (while a request waits for its prefetch
# that thread spins, yielding once per loop). Slices below that size keep the GIL through the CRC:
# one GIL round trip fewer per page read or written, for a few microseconds of holding it.
_CRC_SLICE = 4096


def crc32(data: bytes | memoryview, crc: int = 0) -> int:
    """CRC-32 of `data` (continuing `crc`), computed without releasing the GIL."""
    view = memoryview(data).cast("B")
    for i in range(0, len(view), _CRC_SLICE):
        crc = zlib.crc32(view[i : i + _CRC_SLICE], crc)
    return crc


def crc_of(parts: list[bytes | memoryview]) -> tuple[int, int]:
    """(total length, CRC-32) of the concatenation of `parts` (a page held in several buffers)."""
    crc, n = 0, 0
    for part in parts:
        crc = crc32(part, crc)
        n += memoryview(part).nbytes
    return n, crc


def encode_record(namespace_digest: bytes, key: str, length: int, crc: int) -> bytes:
    """A header for a payload of `length` bytes with CRC-32 `crc`, stored apart from the payload
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


def check_page(header: PageHeader, namespace_digest: bytes, key: str, payload: bytes | memoryview,
               expected_len: int | None = None) -> None:
    """Raise PageError unless `payload` is the intact page written for `key` in this namespace."""
    if header.namespace_digest != namespace_digest:
        raise PageError(PageFault.FOREIGN, "namespace differs")
    if header.key_digest != digest16(key):
        raise PageError(PageFault.MISPLACED, "key digest differs")
    if expected_len is not None and header.payload_len != expected_len:
        raise PageError(PageFault.SIZE_MISMATCH, f"page has {header.payload_len} bytes, reader wants {expected_len}")
    if len(payload) < header.payload_len:
        raise PageError(PageFault.TRUNCATED, f"payload has {len(payload)} of {header.payload_len} bytes")
    if crc32(memoryview(payload).cast("B")[: header.payload_len]) != header.payload_crc:
        raise PageError(PageFault.CORRUPT, "payload checksum")


def check_record(header: PageHeader, namespace_digest: bytes, key: str, length: int, crc: int) -> None:
    """Raise PageError unless a payload of `length` bytes with CRC-32 `crc` is the page that the
    separately stored `header` describes (see `encode_record`)."""
    if header.namespace_digest != namespace_digest:
        raise PageError(PageFault.FOREIGN, "namespace differs")
    if header.key_digest != digest16(key):
        raise PageError(PageFault.MISPLACED, "key digest differs")
    if header.payload_len != length:
        raise PageError(PageFault.SIZE_MISMATCH, f"page has {header.payload_len} bytes, reader has {length}")
    if header.payload_crc != crc:
        raise PageError(PageFault.CORRUPT, "payload checksum")
