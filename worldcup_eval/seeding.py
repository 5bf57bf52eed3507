"""Every random choice of a run derives from its one seed and a label.

``rng_for(seed, "payload", 16, 7)`` is a numpy generator that depends on
nothing else: not on the order cells run in, not on how many prompts or
cells there are, not on an earlier interrupted run. That is what makes the
output a function of (config, seed) and lets cached work be reused.
"""

from __future__ import annotations

import hashlib

import numpy as np

from worldcup_core.prf import WatermarkKey


def _words(seed: int, labels: tuple[object, ...]) -> list[int]:
    digest = hashlib.sha256(repr((seed, *labels)).encode()).digest()
    return [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 32, 4)]


def rng_for(seed: int, *labels: object) -> np.random.Generator:
    """A generator determined by ``seed`` and ``labels`` alone."""
    return np.random.default_rng(np.random.SeedSequence(_words(seed, labels)))


def int_seed(seed: int, *labels: object) -> int:
    """A 63-bit integer seed (for per-row sampling) determined by ``seed`` and ``labels``."""
    w = _words(seed, labels)
    return w[0] | (w[1] & 0x7FFFFFFF) << 32


def eval_key(seed: int) -> WatermarkKey:
    """The run's watermark key: fixed by the seed, shared by every scheme.

    Schemes draw from domain-separated subkeys, so sharing a key never couples them.
    """
    return WatermarkKey(hashlib.sha256(f"worldcup-eval-key:{seed}".encode()).digest())
