"""Text quality that does not ask the generator: a repetition and diversity profile.

Self-perplexity scores a text with the model that wrote it, which rewards the
model's own habits. These measures look only at the words:

* ``distinct-n``: distinct word n-grams over all word n-grams of one text
  (1.0: no n-gram repeats; lower: the text repeats itself);
* ``repetition``: the share of word 3-grams that already occurred earlier in the text.

Words are lower-cased runs of letters, digits and apostrophes, so the measure does
not depend on any tokenizer. Texts with fewer than n words give no value.

>>> distinct_n("the cat sat on the cat sat".split(), 2)
0.6666666666666666
>>> repetition("a b c a b c".split(), 3)
0.25
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_WORD = re.compile(r"[a-z0-9']+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(tokens: Sequence[str], n: int) -> float | None:
    grams = ngrams(tokens, n)
    return len(set(grams)) / len(grams) if grams else None


def repetition(tokens: Sequence[str], n: int = 3) -> float | None:
    grams = ngrams(tokens, n)
    if not grams:
        return None
    seen: set[tuple[str, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)
