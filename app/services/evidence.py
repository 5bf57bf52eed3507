"""The per-token evidence block of /provenance and /decode (the console's heatmap).

The numbers come from :func:`worldcup_core.evidence.text_evidence`; this module
only adds what the service knows: which characters of the text each token covers
(the tokenizer's offsets) and the decoder's per-bit confidence. Nothing here is
key material.
"""

from __future__ import annotations

from app.schemas.watermark import (
    BitEvidenceOut,
    CoverageOut,
    CoverageSpan,
    EvidenceOut,
    IslandOut,
    TokenEvidenceOut,
)
from app.stores.base import RegistryEntry
from worldcup_core import WatermarkKey, WorldCup
from worldcup_core.decoder import DecodeResult
from worldcup_core.evidence import text_evidence
from worldcup_core.fingerprint import (
    FINGERPRINT_BYTES,
    SIMILARITY_THRESHOLD,
    VERBATIM_SIMILARITY,
    fingerprint_similarity,
    text_fingerprint,
)
from worldcup_core.islands import Coverage, locate_islands


def unmatched_evidence(pieces: list[str], groups: int, num_bits: int) -> EvidenceOut:
    """No key matched: the text's tokens, with no marks."""
    return EvidenceOut(
        matched=False,
        groups=groups,
        num_bits=num_bits,
        tokens=[
            TokenEvidenceOut(index=i, text=p, scored=False, position=None, g_mean=None, z=None)
            for i, p in enumerate(pieces)
        ],
        bits=[],
    )


def evidence_block(
    scheme: WorldCup, ids: list[int], pieces: list[str], decoded: DecodeResult
) -> EvidenceOut:
    """Marks of every token under ``scheme`` and the bits of ``decoded`` (CPU work:
    call it in a worker)."""
    num_bits, groups = decoded.num_bits, scheme.config.groups
    marks = {m.index: m for m in text_evidence(scheme, ids, num_bits)}
    tokens = []
    for i, piece in enumerate(pieces):
        mark = marks.get(i)
        z = mark.z if mark is not None else None
        tokens.append(
            TokenEvidenceOut(
                index=i,
                text=piece,
                scored=mark is not None,
                position=mark.position if mark is not None else None,
                g_mean=[round(g, 4) for g in mark.g_mean] if mark is not None else None,
                z=round(z, 3) if z is not None else None,
            )
        )
    erased = set(decoded.erasures)
    bits = [
        BitEvidenceOut(
            index=i,
            position=i // groups,
            group=i % groups,
            bit=bit,  # type: ignore[arg-type]  # decoder bits are '0', '1' or '?'
            z=round(decoded.bit_z[i], 4),
            erased=i in erased,
        )
        for i, bit in enumerate(decoded.bits)
    ]
    islands = [
        IslandOut(
            start=i.start,
            end=i.end,
            scored=i.scored,
            z=round(i.z, 3),
            mean_z=round(i.mean_z, 3),
        )
        for i in locate_islands([t.z for t in tokens])
    ]
    return EvidenceOut(
        matched=True, groups=groups, num_bits=num_bits, tokens=tokens, bits=bits, islands=islands
    )


def issued_similarity(key: WatermarkKey, entry: RegistryEntry | None, text: str) -> float | None:
    """The text's similarity to the one ``entry`` was issued with (``key``: the entry's
    key version), from the fingerprint recorded at issue; None without one."""
    if entry is None or entry.fingerprint is None or len(entry.fingerprint) != FINGERPRINT_BYTES:
        return None
    return fingerprint_similarity(entry.fingerprint, text_fingerprint(key, text))


def coverage_out(cov: Coverage, named: bool, similarity: float | None = None) -> CoverageOut:
    """An answer's ``coverage`` (``named``: the answer names a registry entry or
    client payload, which then holds for the islands only when ``part``;
    ``similarity``: the text's to the named entry's issued text, if fingerprinted).
    ``whole`` needs both the statistical coverage and, when there is one, the
    fingerprint: a text that differs from the issued one is never claimed whole. A text
    the fingerprint finds verbatim is the issued one whatever its coverage says."""
    pct = f"{100 * cov.share:.0f} %"
    differs = similarity is not None and similarity < SIMILARITY_THRESHOLD
    verbatim = similarity is not None and similarity >= VERBATIM_SIMILARITY
    attribution = "whole" if verbatim else "part" if differs else cov.attribution
    if verbatim and cov.attribution != "whole":
        assert similarity is not None
        message = (
            f"it is the issued text (its fingerprint matches: about {100 * similarity:.0f} % "
            f"similar); the watermark's evidence sits in {pct} of its scored tokens (stretches "
            "the model wrote almost deterministically carry none)"
        )
    elif cov.attribution == "whole" and not differs:
        message = f"the watermark spans the text ({pct} of its scored tokens)"
        if similarity is not None:
            message += f" and it is the issued text (about {100 * similarity:.0f} % similar)"
    elif cov.attribution == "whole":
        assert similarity is not None
        message = (
            f"the watermark spans the text ({pct} of its scored tokens), but the text "
            f"differs from the issued one (about {100 * max(similarity, 0.0):.0f} % similar "
            f"by word 3-grams, below {100 * SIMILARITY_THRESHOLD:.0f} %): the whole text is "
            "not the issued one; parts of it were rewritten, added or removed by someone else"
        )
    else:
        what = "the named entry's text" if named else "watermarked"
        message = (
            f"only part of the text carries the watermark ({pct} of its scored tokens, in "
            f"{len(cov.islands)} stretch(es)): only those tokens are {what}; the rest was "
            "written or edited by someone else, so the whole text is not the issued one"
        )
        if similarity is not None:
            message += f" (about {100 * max(similarity, 0.0):.0f} % similar to it)"
    return CoverageOut(
        share=round(cov.share, 4),
        scored_tokens=cov.scored,
        attribution=attribution,  # type: ignore[arg-type]  # 'whole' or 'part'
        threshold=cov.threshold,
        islands=[CoverageSpan(start=i.start, end=i.end, scored=i.scored) for i in cov.islands],
        issued_text_similarity=None if similarity is None else round(similarity, 4),
        message=message,
    )
