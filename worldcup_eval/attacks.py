"""Text attacks on watermarked output (paper, Appendix D), each seeded.

All attacks work on words, where a word is a maximal run of non-space
characters; each keeps the whitespace that followed it, so paragraphs and
line breaks survive. The attacked text is re-tokenised before detection.

* **Word deletion** (Word-D, ratio 0.2): ``round(0.2 * words)`` words chosen
  uniformly without replacement are removed.
* **Synonym substitution** (Word-S-Dict, ratio 0.2): as in the paper and
  MarkLLM, ``round(0.2 * words)`` words are replaced, chosen uniformly among
  the *eligible* words (a purely alphabetic core, not a function word, with at
  least one WordNet synonym); when fewer are eligible, all of them are
  replaced, and the achieved fraction is reported. A synonym is a lemma of
  one of the word's WordNet synsets (any part of speech, through WordNet's
  own morphology), single-word, lower-case (proper nouns are skipped),
  different from the word; punctuation around the word and its capitalisation
  are kept. Inflection is not restored ("dogs" may become "frump").
* **Copy-paste** (CP-3-30%): the watermarked words are cut at random into 3
  contiguous, non-empty segments and set inside human words (the true
  continuation of the same prompt): ``human, seg1, human, seg2, human, seg3,
  human``, with non-empty human text between segments and
  ``round(W * 0.3 / 0.7)`` human words in all, so human text is 30% of the
  result.
* **Paraphrase**: the generating instruct model itself rewrites the text
  through its chat template (:func:`paraphrase_prompt_ids`); generation is
  batched and cached by the harness like any other.

WordNet is read with nltk's ``WordNetCorpusReader`` straight from Debian's
``wordnet-base`` files (``/usr/share/wordnet``; ``WORLDCUP_WORDNET_DIR``
overrides). Debian ships the database without the tiny ``lexnames`` table,
which nltk requires, so the reader serves WordNet 3.0's fixed list of 45
lexicographer file names from memory; and it never maps synsets to nltk's own
downloadable WordNet (there is none here, and nothing is downloaded).
"""

from __future__ import annotations

import functools
import io
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from worldcup_eval.data import chat_prompt_ids

_WORD = re.compile(r"\S+\s*")
_CORE = re.compile(r"^([^A-Za-z]*)([A-Za-z]+)([^A-Za-z]*)$")

# WordNet 3.0 lexnames(5WN), in file-number order.
_LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute "
    "noun.body noun.cognition noun.communication noun.event noun.feeling noun.food noun.group "
    "noun.location noun.motive noun.object noun.person noun.phenomenon noun.plant "
    "noun.possession noun.process noun.quantity noun.relation noun.shape noun.state "
    "noun.substance noun.time verb.body verb.change verb.cognition verb.communication "
    "verb.competition verb.consumption verb.contact verb.creation verb.emotion verb.motion "
    "verb.perception verb.possession verb.social verb.stative verb.weather adj.ppl"
).split()
_WORDNET_FILES = ("index.noun", "index.verb", "index.adj", "index.adv", "data.noun", "data.adj")

# Function words are never substituted: WordNet lists odd senses for many of them.
STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before
    being below between both but by can could did do does doing down during each few for from
    further had has have having he her here hers herself him himself his how i if in into is it
    its itself just me more most my myself no nor not now of off on once only or other our ours
    ourselves out over own same she should so some such than that the their theirs them
    themselves then there these they this those through to too under until up very was we were
    what when where which while who whom why will with would you your yours yourself yourselves
    also said says say one two get got may might must shall us yet ever""".split()
)


@dataclass(frozen=True)
class AttackResult:
    text: str
    stats: dict[str, float] = field(default_factory=dict)
    layout: tuple[tuple[str, int], ...] = ()  # copy-paste: ("human" | "watermark", words)


def split_words(text: str) -> tuple[str, list[str]]:
    """Leading whitespace, then each word with the whitespace that follows it."""
    stripped = text.lstrip()
    return text[: len(text) - len(stripped)], _WORD.findall(stripped)


def _join(pieces: list[str]) -> str:
    out = []
    for i, piece in enumerate(pieces):
        if i + 1 < len(pieces) and piece == piece.rstrip():
            piece += " "  # a piece that ended its source text needs a separator here
        out.append(piece)
    return "".join(out)


def word_deletion(text: str, ratio: float, rng: np.random.Generator) -> AttackResult:
    """Delete ``round(ratio * words)`` words chosen uniformly at random."""
    lead, words = split_words(text)
    n = len(words)
    k = min(int(round(ratio * n)), n)
    drop = set(rng.choice(n, size=k, replace=False).tolist()) if k else set()
    kept = [w for i, w in enumerate(words) if i not in drop]
    return AttackResult(
        lead + _join(kept),
        {"words": n, "deleted": k, "deleted_fraction": k / n if n else 0.0},
    )


class WordNetMissing(RuntimeError):
    """The WordNet database files are not installed."""


def wordnet_dir() -> Path:
    return Path(os.environ.get("WORLDCUP_WORDNET_DIR", "/usr/share/wordnet"))


@functools.lru_cache(maxsize=4)
def load_wordnet(path: Path | None = None) -> Any:
    """nltk's WordNet reader over Debian's ``wordnet-base`` files (see the module docstring)."""
    root = (path or wordnet_dir()).resolve()
    missing = [f for f in _WORDNET_FILES if not (root / f).is_file()]
    if missing:
        raise WordNetMissing(
            f"WordNet database not found in {root} (missing {', '.join(missing)}): "
            "install it with `apt-get update && apt-get install -y wordnet-base` "
            "or set WORLDCUP_WORDNET_DIR"
        )
    import nltk.data
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    if str(root) not in [str(p) for p in nltk.data.path]:
        nltk.data.path.append(str(root))  # nltk only opens files under its data roots
    has_lexnames = (root / "lexnames").is_file()

    class DebianWordNet(WordNetCorpusReader):  # type: ignore[misc]
        def open(self, file: str) -> Any:
            if file == "lexnames" and not has_lexnames:
                return io.StringIO("".join(f"{i:02d}\t{n}\t0\n" for i, n in enumerate(_LEXNAMES)))
            return super().open(file)

        def map_wn(self, version: str = "wordnet") -> None:
            return None  # the loaded database is the reference; never map to another

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "multilingual functions are not available"
        return DebianWordNet(str(root), None)


class SynonymSubstitution:
    """Word-S-Dict over a WordNet reader; synonym lists are memoised per word."""

    def __init__(self, wordnet: Any) -> None:
        self.wordnet = wordnet
        self._memo: dict[str, tuple[str, ...]] = {}

    def synonyms(self, word: str) -> tuple[str, ...]:
        """Single-word, lower-case WordNet synonyms of ``word`` (lower-cased), sorted."""
        key = word.lower()
        if key not in self._memo:
            found: set[str] = set()
            if key not in STOPWORDS and len(key) > 1:
                for synset in self.wordnet.synsets(key):
                    for lemma in synset.lemma_names():
                        if lemma.isalpha() and lemma.islower() and lemma != key:
                            found.add(lemma)
            self._memo[key] = tuple(sorted(found))
        return self._memo[key]

    def __call__(self, text: str, ratio: float, rng: np.random.Generator) -> AttackResult:
        lead, words = split_words(text)
        parts: list[tuple[str, str, str] | None] = []
        for w in words:
            m = _CORE.match(w)
            parts.append((m.group(1), m.group(2), m.group(3)) if m else None)
        eligible = [i for i, p in enumerate(parts) if p is not None and self.synonyms(p[1])]
        k = min(int(round(ratio * len(words))), len(eligible))
        chosen = rng.choice(eligible, size=k, replace=False).tolist() if k else []
        out = list(words)
        for i in sorted(chosen):
            part = parts[i]
            assert part is not None
            pre, core, post = part
            options = self.synonyms(core)
            new = options[int(rng.integers(len(options)))]
            if core.isupper() and len(core) > 1:
                new = new.upper()
            elif core[0].isupper():
                new = new[0].upper() + new[1:]
            out[i] = pre + new + post
        n = len(words)
        return AttackResult(
            lead + "".join(out),
            {
                "words": n,
                "eligible": len(eligible),
                "replaced": k,
                "replaced_fraction": k / n if n else 0.0,
            },
        )


def copy_paste(
    watermarked: str,
    human: str,
    segments: int,
    human_fraction: float,
    rng: np.random.Generator,
) -> AttackResult:
    """CP-n-rho: ``segments`` watermarked pieces inside human text making ``human_fraction``."""
    _, wm = split_words(watermarked)
    _, hu = split_words(human)
    w = len(wm)
    segments = max(1, min(segments, w))
    want = int(round(w * human_fraction / (1.0 - human_fraction)))
    h = min(want, len(hu))
    hu = hu[:h]
    cuts = (
        sorted(rng.choice(np.arange(1, w), size=segments - 1, replace=False).tolist())
        if w > 1
        else []
    )
    bounds = [0, *cuts, w]
    wm_parts = [wm[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    gaps = [0] + [1] * (segments - 1) + [0]  # the text between segments is never empty
    spare = h - sum(gaps)
    if spare < 0:
        gaps = [0] * (segments + 1)
        spare = h
    gaps = [
        g + int(e)
        for g, e in zip(gaps, rng.multinomial(spare, [1.0 / len(gaps)] * len(gaps)), strict=True)
    ]
    pieces: list[str] = []
    layout: list[tuple[str, int]] = []
    start = 0
    for i, gap in enumerate(gaps):
        if gap:
            pieces += hu[start : start + gap]
            layout.append(("human", gap))
            start += gap
        if i < len(wm_parts):
            pieces += wm_parts[i]
            layout.append(("watermark", len(wm_parts[i])))
    total = w + h
    return AttackResult(
        _join(pieces).strip(),
        {
            "watermark_words": w,
            "human_words": h,
            "human_fraction": h / total if total else 0.0,
            "human_words_short": float(want - h),
        },
        tuple(layout),
    )


PARAPHRASE_INSTRUCTION = (
    "Paraphrase the following text. Keep its meaning and roughly its length, change the "
    "wording and sentence structure, and reply with the paraphrase only.\n\n"
)


def paraphrase_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The paraphrase request as the model's chat prompt (plain text without a template)."""
    return chat_prompt_ids(
        tokenizer,
        PARAPHRASE_INSTRUCTION + text.strip(),
        f"Original text:\n{text.strip()}\n\nParaphrased text:\n",
    )
