"""Request and response models of /decode, /detect and /provenance."""

from __future__ import annotations

import re
from dataclasses import asdict
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from app.schemas.common import StrictModel, StrictRequest
from app.schemas.exposure import BITS_WITHHELD, DecodeVerdict, DetectVerdict
from worldcup_core.assess import Assessment, TestName, components
from worldcup_core.verdict import MIN_SCORED_SOURCE, MIN_SCORED_TOKENS, Reason, Verdict

VERDICT_DESCRIPTION = (
    "One decision per text and asker (worldcup_core.assess: the same for every route, the "
    "console, the CLI and scans): watermarked: p_value < 1e-6; not_watermarked: p_value "
    ">= 0.05 with at least min_scored_tokens scored tokens; inconclusive otherwise (see "
    "reason). verdict_statistic names the test it was taken from."
)

STATISTIC_DESCRIPTION = (
    "Which statistic the tests took. model: every scored token weighed by its "
    "informativeness under the served model (1 - sum p^2 of its filtered next-token "
    "distribution given the text before it), in every test (message-free, payload "
    "length known, registry, the decoder's per-bit evidence). The weights depend on the "
    "text and the model only, never on a key, so the p-values stay exact. model_free: no "
    "model is loaded (detector role, vLLM engine, WORLDCUP_DETECT_WITH_MODEL=false) or "
    "the key is worldcup-v1: every token counts by today's layer weights."
)

TEXT_DESCRIPTION = (
    "The text to score, at most the server's `WORLDCUP_MAX_TEXT_CHARS` characters (the "
    "schema states the limit). Text that is only whitespace is refused, as empty text is."
)
# a character that is not whitespace, as JSON Schema's (ECMA-262) \s counts whitespace,
# spelt out so that the schema's pattern and the server's check agree on every character
NOT_BLANK = r"[^\t\n\v\f\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]"
_NOT_BLANK = re.compile(NOT_BLANK)


def _not_blank(text: str) -> str:
    if _NOT_BLANK.search(text) is None:
        raise ValueError("only whitespace: there is nothing to score")
    return text


_TEXT_RULES = (
    Field(min_length=1, json_schema_extra={"pattern": NOT_BLANK}),
    AfterValidator(_not_blank),
)
Text = Annotated[str, *_TEXT_RULES, Field(description=TEXT_DESCRIPTION)]
BatchText = Annotated[str, *_TEXT_RULES]


EVIDENCE_DESCRIPTION = (
    "Per-token evidence (the console's heatmap) and per-bit confidence. The strongest "
    "oracle there is (it shows which tokens carry the watermark), so it is for analysts "
    "only: on /provenance the admin token, on /decode a `full` API key that also holds "
    "the `provenance` scope (403 `evidence_not_allowed` otherwise)."
)


DECODE_NUM_BITS = (
    "The payload length to decode at. Default: the length the tenant issued its registry "
    "entries at (the best-matching one where several), else the deployment's default."
)


class DecodeRequest(StrictRequest):
    text: Text
    num_bits: Annotated[int | None, Field(ge=1, le=64, description=DECODE_NUM_BITS)] = None
    key_version: Annotated[int | None, Field(ge=1, le=2**31 - 1)] = None
    evidence: bool = Field(False, description=EVIDENCE_DESCRIPTION)

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {"examples": [{"text": "The tide rolls in ...", "num_bits": 32}]},
    }


class BitConfidence(StrictModel):
    z: float
    p_value: float


class RegistryMatchOut(StrictModel):
    message_id: int | None = Field(
        description="The registry entry's id; null when the text matched a payload the "
        "client chose (client_payload)."
    )
    metadata: dict[str, Any]
    issued_at: datetime | None = Field(
        description="When the entry was issued; null for a client payload."
    )
    num_bits: int
    confidence: float = Field(description="Posterior of this entry among the registry.")
    p_value: float = Field(
        description="The registry test the verdict takes: the text's agreement with this "
        "entry (layer-weighted under worldcup-v2), exact, Bonferroni-corrected for the "
        "registry size."
    )
    exact: bool = Field(description="True if the decoded bits equal the entry's payload.")
    client_payload: bool = Field(
        default=False,
        description="True: the text matched a payload a client of this tenant chose "
        "(`payload` on /generate, `watermark.payload` on /v1), not a registry entry; such "
        "payloads are recorded as candidates so that their texts are never named as "
        "another user's entry.",
    )
    bits: str | None = Field(
        default=None,
        description="The client-chosen payload matched (client_payload only), to keys that "
        "may choose payloads (`fixed_payload`) or hold `provenance`; null otherwise.",
    )


class TokenEvidenceOut(StrictModel):
    index: int = Field(description="Token index in the text (tokenizer of this service).")
    text: str = Field(
        description="The characters of this token (with any whitespace before it); the "
        "pieces of all tokens concatenate to the text. A character split over several "
        "tokens is in the first piece."
    )
    scored: bool = Field(description="False for the first c tokens and repeated contexts.")
    position: int | None = Field(description="The message position this token votes on.")
    g_mean: list[float] | None = Field(description="Mean g per group; 0.5 is chance.")
    z: float | None = Field(
        description="Agreement of this token's g-values with the bits the other tokens of "
        "its cells point to (leave-one-out), standardised: mean 0 and variance 1 on text "
        "without this key's watermark. None when its cells have no other tokens."
    )


class BitEvidenceOut(StrictModel):
    index: int
    position: int = Field(description="Message position (index // groups).")
    group: int
    bit: Literal["0", "1", "?"]
    z: float = Field(description="|2 ones - trials| / sqrt(trials) of this bit's cell.")
    erased: bool = Field(description="No scored token fell on this position.")


class IslandOut(StrictModel):
    start: int = Field(description="First token of the stretch (index into tokens).")
    end: int = Field(description="Last token of the stretch (inclusive).")
    scored: int = Field(description="Tokens in it with a z.")
    z: float = Field(description="Its own z-test: the sum of its tokens' z over sqrt(scored).")
    mean_z: float = Field(description="Mean z of its tokens (0 on human text).")


class EvidenceOut(StrictModel):
    matched: bool = Field(
        description="False when no key matched (provenance): tokens then carry no marks."
    )
    groups: int
    num_bits: int
    tokens: list[TokenEvidenceOut]
    bits: list[BitEvidenceOut]
    islands: list[IslandOut] = Field(
        default_factory=list,
        description="Where the watermark is: stretches of tokens whose z stands out, in text "
        "order (worldcup_core.islands: the interval of largest z-test, split where a stretch "
        "inside it is significantly weaker; further islands significant on their own). "
        "Empty when no key matched.",
    )


COVERAGE_DESCRIPTION = (
    "How much of the text carries the watermark (computed whenever the verdict is "
    "watermarked, null otherwise): the share of the scored tokens that carry it: in the "
    "watermark's islands (worldcup_core.islands) or in stretches and segments that do not "
    "score significantly below it. attribution is 'whole' when the islands hold at least "
    "`threshold` of them, else 'part': then only the islands' tokens are the watermarked "
    "(issued) text, and the rest was written or edited by someone else (a quoted or "
    "piggybacked answer). The threshold is measured (SECURITY.md, Forgery and framing). "
    "When the answer names a registry entry issued with a fingerprint of its text, "
    "'whole' also needs issued_text_similarity at or above 0.92, and a text it finds verbatim "
    "(at or above 0.9988) is 'whole' whatever its share (worldcup_core.fingerprint)."
)


class CoverageSpan(StrictModel):
    start: int = Field(description="First token of the island (index into the text's tokens).")
    end: int = Field(description="Last token of the island (inclusive).")
    scored: int = Field(description="Scored tokens in it.")


class CoverageOut(StrictModel):
    share: float = Field(description="Scored tokens inside the islands over all scored tokens.")
    scored_tokens: int
    attribution: Literal["whole", "part"]
    threshold: float = Field(description="The least share for 'whole'.")
    islands: list[CoverageSpan]
    issued_text_similarity: float | None = Field(
        None,
        description="The submitted text's similarity to the text the named registry entry "
        "was issued with: the estimated cosine of their word 3-gram sets, from the keyed "
        "fingerprint recorded at issue (1.0: the same words, whatever the spacing and "
        "case; below 0.92 the whole text is not the issued one: attribution 'part'). "
        "Null when no entry is named or its entry has no fingerprint (issued before "
        "fingerprints were recorded).",
    )
    message: str


class TestOut(StrictModel):
    """One of the tests an answer combined into its verdict."""

    test: TestName = Field(
        description="detect (message-free), decode (payload length known) or registry "
        "(agreement with the tenant's issued entries)."
    )
    statistic: str = Field(description="What the test asks, in plain words.")
    num_bits: int | None = Field(description="The payload length it read (None: detect).")
    key_version: int | None = Field(description="The key version the data chose.")
    p_value: float | None = Field(
        description="This test alone, the best over the key versions searched, before "
        "any correction (the registry test's is already corrected for the registry's "
        "size). None: the test ran but had nothing to score (counted as 1)."
    )
    weight: float = Field(description="Its share of the level in the combination.")
    combined_p_value: float = Field(
        description="min(1, key versions × p_value / weight): what it gives the verdict. "
        "The answer's p_value is the smallest of these."
    )
    z_score: float = Field(
        description="Φ⁻¹(1 − p) of p_value Šidák-corrected for the key versions: about "
        "standard normal on text without the watermark (the message-free test's exactly)."
    )
    verdict_alone: Verdict = Field(
        description="The verdict of this test alone, corrected for the key versions "
        "only. The detect test's does not drift as the registry grows."
    )
    registry_size: int | None = Field(
        description="The registry test: the number of entries it was corrected for "
        "(its p grows with the registry, so a verdict can drift as entries are issued)."
    )
    decided: bool = Field(description="The test the verdict was taken from.")


DEPRECATED_ALIAS = "Deprecated alias (removed in the next release): use {}, the same number."


class _VerdictAnswer(StrictModel):
    """The verdict fields of an answer: one decision per text and asker
    (:func:`worldcup_core.assess.assess`), with the test it was taken from, its one
    p-value, and the tests it combined, nested."""

    verdict: Verdict = Field(description=VERDICT_DESCRIPTION)
    reason: Reason | None = Field(
        description="Why the verdict is inconclusive: too_short (fewer scored tokens than "
        "'not_watermarked' needs: see min_scored_tokens), some_evidence (between the "
        "levels) or no_agreement (a test's p fell below 1e-6 but the text's tokens do not "
        "agree within the test's cells, as a stolen-watermark spoof's do not, or the registry "
        "test's entry is not beyond what fair signs give its tokens' magnitudes: that test is "
        "capped at 1e-6; SECURITY.md, 'Forgery and framing'). None for the other verdicts."
    )
    tokens_needed: int | None = Field(
        description="For an inconclusive verdict, the scored tokens an answer would need: "
        "min_scored_tokens when too short, else the length at which evidence this strong "
        "per token would reach 1e-6. None otherwise."
    )
    min_scored_tokens: int = Field(
        description="'not_watermarked' is said from this many scored tokens on: "
        f"{MIN_SCORED_SOURCE}."
    )
    verdict_statistic: TestName = Field(
        description="The test that decided: detect (message-free), decode (payload length "
        "known) or registry (agreement with the tenant's issued entries)."
    )
    p_value: float = Field(
        description="The verdict's p-value, the only one that decides: the deciding test's, "
        "with every correction (weighted Bonferroni over the tests, Bonferroni over the "
        "key versions searched). watermarked below threshold."
    )
    threshold: float = Field(
        description="The fixed level of 'watermarked' and of is_watermarked: 1e-6."
    )
    keys_searched: str = Field(description="The key set the verdict searched, in words.")
    statistic: Literal["model", "model_free"] = Field(description=STATISTIC_DESCRIPTION)
    tests: list[TestOut] = Field(
        description="Every test combined into the verdict, each with its own p-value."
    )
    verdict_p_value: float = Field(description=DEPRECATED_ALIAS.format("p_value"), deprecated=True)
    verdict_threshold: float = Field(
        description=DEPRECATED_ALIAS.format("threshold"), deprecated=True
    )
    z_score: float = Field(
        description="Deprecated (removed in the next release): the message-free test's z, "
        "tests[test=detect].z_score; it does not decide the verdict.",
        deprecated=True,
    )
    coverage: CoverageOut | None = Field(None, description=COVERAGE_DESCRIPTION)


def verdict_fields(
    assessment: Assessment, statistic: Literal["model", "model_free"] = "model_free"
) -> dict[str, Any]:
    """The verdict fields of an answer, from its assessment and the statistic its
    tests took (:mod:`app.services.weights`)."""
    parts = [TestOut(**asdict(c)) for c in components(assessment)]
    return {
        "verdict": assessment.verdict,
        "reason": assessment.reason,
        "tokens_needed": assessment.tokens_needed,
        "min_scored_tokens": MIN_SCORED_TOKENS,
        "verdict_statistic": assessment.statistic,
        "p_value": assessment.p_value,
        "threshold": assessment.threshold,
        "keys_searched": assessment.keys_searched,
        "statistic": statistic,
        "tests": parts,
        "verdict_p_value": assessment.p_value,
        "verdict_threshold": assessment.threshold,
        "z_score": next((t.z_score for t in parts if t.test == "detect"), 0.0),
    }


REGISTRY_AMBIGUOUS_DESCRIPTION = (
    "Another registry entry fits the text almost as well as the best one (confidence "
    "below registry_min_confidence), so none is named although the registry test is "
    "below the watermarked level; a longer excerpt of the text may decide."
)
REGISTRY_WITHHELD_DESCRIPTION = (
    "A registry entry fits the text, but is not named: the text's watermark evidence "
    "sits in contexts this tenant's texts use often and is missing from its rare ones, "
    "the pattern of a stolen-watermark spoof (the spoof-artifact check; only where the "
    "deployment sets WORLDCUP_SPOOF_ARTIFACT_ACTION=withhold_entry). The verdict stands."
)
IS_WATERMARKED_DESCRIPTION = "Exactly verdict == 'watermarked' (p_value < threshold)."
SIGNIFICANCE_DESCRIPTION = DEPRECATED_ALIAS.format("threshold")


class DecodeResponse(_VerdictAnswer):
    bits: str | None = Field(
        description="The decoded payload, '0'/'1' per bit, '?' marking an erasure; "
        + BITS_WITHHELD
        + ". registry_match names whose text it is without them."
    )
    bit_confidence: list[BitConfidence] | None = Field(
        description="Per bit, in bit order; null as bits."
    )
    num_bits: int = Field(description="The payload length decoded at.")
    erasures: list[int] = Field(description="The bits too weak to read (indices).")
    is_watermarked: bool = Field(description=IS_WATERMARKED_DESCRIPTION)
    num_tokens: int
    num_scored_tokens: int
    key_version: int
    registry_match: RegistryMatchOut | None
    registry_expired: bool = Field(
        False,
        description="The text matches a registry entry past the tenant's registry "
        "retention: it was issued by this tenant, but its entry is gone.",
    )
    registry_ambiguous: bool = Field(False, description=REGISTRY_AMBIGUOUS_DESCRIPTION)
    registry_withheld: bool = Field(False, description=REGISTRY_WITHHELD_DESCRIPTION)
    evidence: EvidenceOut | None = None


class DetectRequest(StrictRequest):
    text: Text

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {"examples": [{"text": "Is this text watermarked?"}]},
    }


class DetectResponse(_VerdictAnswer):
    is_watermarked: bool = Field(description=IS_WATERMARKED_DESCRIPTION)
    num_tokens: int
    num_scored_tokens: int
    significance: float = Field(description=SIGNIFICANCE_DESCRIPTION, deprecated=True)
    key_version: int | None = Field(
        description="The key version that decided, when the verdict is watermarked."
    )


# --------------------------------------------------------------------------- bulk scans
class BatchItemError(StrictModel):
    code: str
    message: str


class DecodeBatchRequest(StrictRequest):
    texts: Annotated[list[BatchText], Field(min_length=1, max_length=10_000)] = Field(
        description="Up to the server's batch limit (default 1000) texts; each is decoded "
        "independently, and a bad text fails only its own item."
    )
    num_bits: Annotated[int | None, Field(ge=1, le=64, description=DECODE_NUM_BITS)] = None
    key_version: Annotated[int | None, Field(ge=1, le=2**31 - 1)] = None

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {"examples": [{"texts": ["First text ...", "Second ..."]}]},
    }


class DecodeBatchItem(StrictModel):
    index: int
    result: DecodeResponse | DecodeVerdict | None
    error: BatchItemError | None


class DecodeBatchResponse(StrictModel):
    results: list[DecodeBatchItem]
    num_watermarked: int
    num_errors: int


class DetectBatchRequest(StrictRequest):
    texts: Annotated[list[BatchText], Field(min_length=1, max_length=10_000)] = Field(
        description="Up to the server's batch limit (default 1000) texts."
    )

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {"examples": [{"texts": ["First text ...", "Second ..."]}]},
    }


class DetectBatchItem(StrictModel):
    index: int
    result: DetectResponse | DetectVerdict | None
    error: BatchItemError | None


class DetectBatchResponse(StrictModel):
    results: list[DetectBatchItem]
    num_watermarked: int
    num_errors: int


# --------------------------------------------------------------------------- provenance
class ProvenanceRequest(StrictRequest):
    text: Text
    include_token_scores: bool = Field(
        False, description="Per-token scores of the best key; admin token only (403 otherwise)."
    )
    evidence: bool = Field(False, description=EVIDENCE_DESCRIPTION)

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {"examples": [{"text": "Who was this text generated for?"}]},
    }


class ProvenanceCandidate(StrictModel):
    tenant_id: str
    tenant_name: str | None = Field(None, description="The tenant's name.")
    key_version: int
    p_value: float = Field(
        description="The message-free test of this key alone, before the correction for the "
        "search: not the answer's p_value, and no verdict on its own."
    )


class ProvenanceSuspect(StrictModel):
    """Whose key the evidence leans towards, when the verdict is inconclusive."""

    tenant_id: str
    tenant_name: str | None
    key_version: int


class ProvenanceMatch(StrictModel):
    tenant_id: str
    tenant_name: str | None
    key_version: int
    key_p_value: float = Field(description="This key alone, before the search correction.")
    bits: str = Field(description="The decoded payload under this key ('?' = erasure).")
    num_bits: int
    registry_entry: RegistryMatchOut | None
    registry_expired: bool = Field(
        False, description="The text matches an entry past the tenant's registry retention."
    )
    registry_ambiguous: bool = Field(False, description=REGISTRY_AMBIGUOUS_DESCRIPTION)
    registry_withheld: bool = Field(False, description=REGISTRY_WITHHELD_DESCRIPTION)


class TokenScore(StrictModel):
    index: int = Field(description="Token index in the text (tokenizer of this service).")
    g_mean: list[float] = Field(description="Mean g-value per group; 0.5 is chance.")


class ProvenanceResponse(_VerdictAnswer):
    found: bool
    message: str
    num_keys: int
    num_tenants: int
    num_tokens: int
    num_scored_tokens: int
    significance: float = Field(description=SIGNIFICANCE_DESCRIPTION, deprecated=True)
    match: ProvenanceMatch | None
    suspect: ProvenanceSuspect | None = Field(
        None,
        description="When the verdict is inconclusive: the tenant whose key the evidence "
        "leans towards (some evidence, not enough to say watermarked: nothing is attributed "
        "to it). The evidence block, for the admin, shows that key's tokens.",
    )
    candidates: list[ProvenanceCandidate]
    scan_seconds: float
    scan_ms_per_1000_keys: float | None
    screened: bool = Field(
        description="A cheap pass over every 4th token chose which keys got the full scan."
    )
    num_full_scans: int
    token_scores: list[TokenScore] | None = None
    evidence: EvidenceOut | None = None
