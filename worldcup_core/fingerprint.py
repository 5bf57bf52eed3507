"""The issued-text fingerprint: an exact check that a text is the one the service issued.

The watermark's coverage (:mod:`worldcup_core.islands`) is statistical: a text with a
third of it rewritten can still look watermarked from end to end. So when the service
issues a registered text it also records a keyed fingerprint of that text, and an
answer that names the entry claims the *whole* text only if the submitted text is
about as similar to the issued one as :data:`SIMILARITY_THRESHOLD` (issue #45).

Decisions (stored fingerprints depend on them; ``tests/test_fingerprint.py`` locks a
test vector, so any change needs a new label and a way to tell the two apart):

* **Normalisation.** Unicode NFKC, then ``casefold``; the words are the ``\\w+`` runs.
  Whitespace, punctuation and case do not count.
* **Shingles.** The set of word 3-grams (words joined by one space); a text of fewer
  than three words has its words as shingles. A repeated shingle counts once.
* **Keyed hash.** Each shingle is hashed with 128-bit BLAKE2b keyed with the subkey
  ``K_fingerprint = WatermarkKey.subkey("issued-text-fingerprint")`` (domain-separated
  from every other use of the key), so without the key the fingerprint says nothing
  about the text, nor can anyone test a guess of it.
* **SimHash** (Charikar, 2002): bit ``i`` of the fingerprint is set when more than half
  of the shingles' hashes have bit ``i`` set. Two texts' fingerprints differ in a bit
  with probability ``theta / pi``, ``theta`` the angle between their shingle sets, so
  ``cos(pi * hamming / 128)`` estimates the sets' cosine ``|A & B| / sqrt(|A| |B|)``.

Measured on ELI5 human answers cut to 100 words (``tests/test_fingerprint.py``): a 30 %
contiguous rewrite has a cosine of about 0.67 and 30 % scattered word replacements
about 0.34; the estimate's noise is that of 128 coin flips. See
:data:`SIMILARITY_THRESHOLD` for the numbers it was chosen from.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from typing import Final

import numpy as np

from worldcup_core.prf import WatermarkKey

FINGERPRINT_BITS: Final = 128
FINGERPRINT_BYTES: Final = FINGERPRINT_BITS // 8
SHINGLE_WORDS: Final = 3
SUBKEY_LABEL: Final = "issued-text-fingerprint"
# The least estimated similarity at which a text counts as the issued one as a whole
# (hamming distance 16 or less). Over 200 random edits of each of 5 ELI5 answers of
# ~95 words (1000 a kind, each under its own key; tests/test_fingerprint.py): a 30 %
# contiguous rewrite max 0.904 (mean 0.66, none at or above), 30 % scattered
# replacements max 0.67 (mean 0.33); a 5 % contiguous rewrite stays at or above it in
# 59 %, 5 % scattered replacements (cosine 0.84) in 9 %. 0.9 kept 75 % of the former
# but lets a 30 % rewrite through at 5e-4 to 1.4e-3 a text (binomial tail at a cosine of
# 0.67-0.70); at 0.92 that is 8e-5 to 3e-4.
SIMILARITY_THRESHOLD: Final = 0.92
# At or above this (hamming distance 2 or less) the text is the issued one, verbatim up to
# case, whitespace and punctuation: then the answer claims the whole text even where the
# watermark's statistical coverage is low (a T 0.7 answer's low-entropy stretches carry no
# evidence). A 30 % rewrite (cosine about 0.67) or an inserted quarter (about 0.89) reaches
# it with probability below 1e-6 (binomial tail of 128 bits).
VERBATIM_SIMILARITY: Final = math.cos(math.pi * 2 / FINGERPRINT_BITS)

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """The text's words after NFKC normalisation and case folding."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def shingles(text: str) -> set[str]:
    """The set of the text's word 3-grams (its words if it has fewer than three)."""
    w = words(text)
    if len(w) < SHINGLE_WORDS:
        return set(w)
    return {" ".join(w[i : i + SHINGLE_WORDS]) for i in range(len(w) - SHINGLE_WORDS + 1)}


def fingerprint_key(key: WatermarkKey) -> bytes:
    """The 32-byte subkey the fingerprint's hashes are keyed with."""
    return key.subkey(SUBKEY_LABEL)


def text_fingerprint(key: WatermarkKey, text: str) -> bytes:
    """The 128-bit keyed SimHash of the text's shingles (16 bytes; all zero for a text
    without words)."""
    secret = fingerprint_key(key)
    items = sorted(shingles(text))
    if not items:
        return bytes(FINGERPRINT_BYTES)
    digests = b"".join(
        hashlib.blake2b(s.encode(), key=secret, digest_size=FINGERPRINT_BYTES).digest()
        for s in items
    )
    bits = np.unpackbits(np.frombuffer(digests, dtype=np.uint8).reshape(len(items), -1), axis=1)
    ones = bits.sum(axis=0, dtype=np.int64)
    return np.packbits(2 * ones > len(items)).tobytes()


def _check(fp: bytes) -> int:
    if not isinstance(fp, bytes) or len(fp) != FINGERPRINT_BYTES:
        raise ValueError(f"a fingerprint is exactly {FINGERPRINT_BYTES} bytes")
    return int.from_bytes(fp, "big")


def hamming(a: bytes, b: bytes) -> int:
    """How many of the two fingerprints' bits differ."""
    return (_check(a) ^ _check(b)).bit_count()


def fingerprint_similarity(a: bytes, b: bytes) -> float:
    """The estimated cosine of the two texts' shingle sets, ``cos(pi * hamming / 128)``:
    1.0 for equal fingerprints, about 0 for unrelated texts (or another key)."""
    return math.cos(math.pi * hamming(a, b) / FINGERPRINT_BITS)
