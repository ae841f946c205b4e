"""Seeds derived from a campaign's seed, stable across Python processes and machines (SHA-256, never
Python's salted ``hash()``): one function for the campaign's repetitions and order and for each
device's arrival and prompt streams."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (their ``repr``s, in order): the same parts give the same seed."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big") >> 1
