"""Layer: core (no SGLang import). Containment of requests that crash the instances serving them.

A request whose instance drops the connection with no answer may be the reason it dropped (a
token id SGLang does not check, a shape that trips a kernel). The ledger remembers such requests
by a fingerprint of their body: the first crash allows one retry elsewhere (the instance may have
died for another reason), a second crash of the same request on another instance puts it in
quarantine, and an identical request is then refused without reaching any instance until the
quarantine ends. Fingerprints are computed only once something crashed, so the common path pays
nothing.
"""
from __future__ import annotations

import collections
import hashlib
import time


def fingerprint(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=16).digest()


class PoisonLedger:
    """Crash records keyed by request fingerprint; bounded (oldest records go first)."""

    def __init__(self, quarantine_s: float = 600.0, max_records: int = 4096) -> None:
        self.quarantine_s = quarantine_s
        self.max_records = max_records
        self._crashes: collections.OrderedDict[bytes, tuple[set[str], float]] = collections.OrderedDict()
        self._quarantined: dict[bytes, float] = {}
        """fingerprint -> time the quarantine ends."""

    def __bool__(self) -> bool:
        return bool(self._crashes) or bool(self._quarantined)

    def crashed(self, fp: bytes, url: str, now: float | None = None) -> int:
        """Record that the request `fp` was on `url` when it dropped; returns how many distinct
        instances it has crashed so far. Two or more puts it in quarantine."""
        now = time.monotonic() if now is None else now
        urls, _ = self._crashes.pop(fp, (set(), now))
        urls.add(url)
        self._crashes[fp] = (urls, now)
        while len(self._crashes) > self.max_records:
            self._crashes.popitem(last=False)
        if len(urls) >= 2 and self.quarantine_s > 0:
            self._quarantined[fp] = now + self.quarantine_s
        return len(urls)

    def crash_count(self, fp: bytes) -> int:
        rec = self._crashes.get(fp)
        return len(rec[0]) if rec else 0

    def quarantined(self, fp: bytes, now: float | None = None) -> bool:
        until = self._quarantined.get(fp)
        if until is None:
            return False
        if (time.monotonic() if now is None else now) >= until:
            del self._quarantined[fp]
            self._crashes.pop(fp, None)
            return False
        return True
