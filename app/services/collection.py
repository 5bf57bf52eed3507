"""What POST /provenance/collection does: many texts declared to share a source (an
account's posts), read together (issue #44, item 3).

**Who may ask, and what it costs.** As ``/provenance`` (:mod:`app.services.provenance`):
the admin token, or a tenant key with the ``provenance`` scope; each text counts
against the tenant's probe budget (route ``provenance/collection``), one query per
text, and a refused text is left out of the joint test (its own answer says so);
every query is audited before the answer is sent.

**Which key.** The search is ``/provenance``'s: every tenant's every key version in
the :class:`~worldcup_core.provenance.KeyBank`. The set's texts, concatenated, are
screened by :meth:`KeyBank.search`; its best few ``worldcup-v2`` keys get the exact
joint test (:func:`worldcup_core.collection.joint_log_p`), and the smallest is
corrected for every key in the bank, as ``/provenance`` corrects its own
(:func:`worldcup_core.assess.assess`, Bonferroni over the keys searched: the union
bound covers any data-dependent choice among them).

**The joint test** is exact under H0 (the texts written without the key), with each
(context, token) counted once across the set, model-weighted where the served model
is loaded and model-free otherwise (``statistic`` says which). Under the chosen key it
runs message-free and at each payload length the key has issued entries at (each text
read in its own payload's cells), and these combine as a single text's tests do
(:meth:`worldcup_core.collection.CollectionResult.tests`, weighted Bonferroni; the
answer's ``tests`` list them). Each text's own answer combines its own tests alike.

**The group** (``group_by``): the registry entries issued under the deciding key
version, grouped by the metadata field's value, searched by
:func:`worldcup_core.collection.group_search` and corrected for the number of
distinct values searched. A value is named only when the joint verdict is
``watermarked`` and its corrected p is below the same level.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from app.core.errors import APIError
from app.schemas.collection import (
    CollectionGroup,
    CollectionRequest,
    CollectionResponse,
    CollectionText,
    CollectionVerdict,
)
from app.schemas.watermark import BatchItemError, verdict_fields
from app.services.intake import check_text, take_batch
from app.services.provenance import Investigator, audit_query
from app.services.runtime import Runtime
from app.stores.base import Store
from worldcup_core import WorldCup
from worldcup_core.assess import Assessment, TestP, assess
from worldcup_core.collection import (
    Chosen,
    CollectionResult,
    choose_key,
    read_collection,
)
from worldcup_core.message import MessageIdCodec
from worldcup_core.prf import ScoredTokensV2
from worldcup_core.provenance import KeyBank
from worldcup_core.verdict import VERDICT_WATERMARKED_BELOW, verdict_sentence

ROUTE = "provenance/collection"
GROUP_ENTRIES_LIMIT = 200_000  # registry entries read for a group search, at most
GROUP_READ_IDS = 20_000  # entries read at once (a few round trips; bounded memory)


async def registry_groups(
    store: Store, scheme: WorldCup, tenant_id: str, version: int, field: str
) -> tuple[dict[str, list[str]], int, str | None]:
    """The payloads issued under this key version, grouped by the metadata ``field``'s
    value (entries without it, or with a list or object there, belong to no group):
    (groups, entries read, why nothing was searched or None)."""
    lengths = await store.registry_bit_lengths(tenant_id, version)
    listed: list[tuple[int, list[int]]] = []
    for bits in lengths:
        codec = MessageIdCodec(scheme.key, bits)
        ids = [i for i in await store.message_ids(tenant_id, version, bits) if i < codec.capacity]
        listed.append((bits, ids))
    total = sum(len(ids) for _, ids in listed)
    if total > GROUP_ENTRIES_LIMIT:
        limit = GROUP_ENTRIES_LIMIT
        why = f"the registry holds {total} entries; a group search reads at most {limit}"
        return {}, 0, why
    groups: dict[str, list[str]] = defaultdict(list)
    for bits, ids in listed:
        values: list[str] = []
        kept: list[int] = []
        for start in range(0, len(ids), GROUP_READ_IDS):
            chunk = ids[start : start + GROUP_READ_IDS]
            entries = await store.registry_entries(tenant_id, chunk)
            for message_id, entry in zip(chunk, entries, strict=True):
                if entry is None or entry.key_version != version:
                    continue
                value = entry.metadata.get(field)
                if value is None or isinstance(value, dict | list):
                    continue
                values.append(str(value))
                kept.append(message_id)
        if not kept:
            continue
        # the payloads at once (array look-ups up to 32 bits), as ``codec.payload`` each
        payloads = MessageIdCodec(scheme.key, bits).payload_ints(np.asarray(kept, dtype=np.int64))
        for value, payload in zip(values, payloads.tolist(), strict=True):
            groups[value].append(format(payload, f"0{bits}b"))
    if not groups:
        return {}, total, f"no registry entry under this key holds the metadata field {field!r}"
    return dict(groups), total, None


def _group_answer(
    field: str,
    result: CollectionResult | None,
    entries: int,
    why: str | None,
    joint: Assessment,
) -> CollectionGroup:
    if result is None or result.groups_searched == 0 or result.group_p_value is None:
        return CollectionGroup(
            field=field,
            value=None,
            may_name=False,
            p_value=None,
            values_searched=0,
            entries_searched=entries,
            message=why or "no key was chosen, so no registry was searched",
        )
    p = result.group_p_value
    may_name = joint.is_watermarked and p < VERDICT_WATERMARKED_BELOW
    searched = result.groups_searched
    if may_name:
        message = f"{field} {result.best_group!r} best explains the set, of {searched} values"
    elif not joint.is_watermarked:
        message = "no value is named: the joint verdict is not watermarked"
    else:
        message = (
            f"no value is named: the best of {searched} values has p {p:.3g} after the "
            f"correction, not below {VERDICT_WATERMARKED_BELOW:g}"
        )
    return CollectionGroup(
        field=field,
        value=result.best_group if may_name else None,
        may_name=may_name,
        p_value=p,
        values_searched=searched,
        entries_searched=entries,
        message=message,
    )


async def read_together(
    runtime: Runtime, who: Investigator, body: CollectionRequest
) -> CollectionResponse | CollectionVerdict:
    """The joint verdict of ``body.texts``, the tenant and key that decided, the group
    that best explains them (``group_by``) and each text's own answer."""
    texts = body.texts
    limit = runtime.settings.max_batch_texts
    if len(texts) > limit:
        raise APIError(
            422,
            f"{len(texts)} texts in one collection; the limit is {limit}",
            "batch_too_large",
        )
    for text in texts:  # one text over the limit refuses the set, before any budget is spent
        check_text(runtime, text)
    # in full only if every text may be, and only then does each spend a full answer: a
    # set holding one text past its full answers would give that text's p-value by
    # another road, and the set's verdict spends none of the others'
    batch = await take_batch(runtime, who.principal, ROUTE, texts, together=True)
    good, ids, errors = batch.good, batch.ids, batch.errors
    full = all(batch.full)
    if not good:
        first = next(iter(errors.values()))
        raise APIError(429, first.message, first.code)
    watermark = runtime.watermark
    bank, refs = await watermark.key_bank()
    weights = await watermark.weights.of(ids)
    chosen, num_keys = await watermark.offload(lambda: choose_key(bank, ids, weights))
    num_tenants = len({t for t, _ in refs})
    keys = f"every tenant's key versions ({num_keys} keys, {num_tenants} tenants)"
    tried = max(num_keys, 1)
    result: CollectionResult | None = None
    tenant_id: str | None = None
    version: int | None = None
    entries, why = 0, None
    if chosen is not None:
        scheme = bank.schemes[chosen.index]
        tenant_id, version = refs[chosen.index]
        # the joint test at every payload length the key has issued entries at, beside
        # the message-free one, combined as a single text's tests are
        issued = await runtime.store.registry_bit_lengths(tenant_id, version)
        lengths = issued or [runtime.settings.default_num_bits]
        result = await watermark.offload(
            lambda: read_collection(
                scheme.key, scheme.config, ids, None, weights, None, lengths=lengths
            )
        )
        # a value is named only under a watermarked joint verdict: the group search (its
        # exact sign-flip guard is costly on sets with no watermark) runs only then
        named_possible = assess(result.tests(version), tried, keys).is_watermarked
        if body.group_by is not None and not named_possible:
            why = "not searched: the joint verdict is not watermarked, so no value is named"
        elif body.group_by is not None:
            found_groups, entries, why = await registry_groups(
                runtime.store, scheme, tenant_id, version, body.group_by
            )
            if found_groups:
                result = await watermark.offload(
                    lambda: read_collection(
                        scheme.key, scheme.config, ids, None, weights, found_groups, lengths=lengths
                    )
                )
    num_units = result.num_units if result is not None else 0
    tests = result.tests(version) if result is not None else [TestP("detect", None)]
    joint = assess(tests, tried, keys, num_units)
    statistic = result.statistic if result is not None else "model_free"
    group = (
        _group_answer(body.group_by, result, entries, why, joint)
        if body.group_by is not None
        else None
    )
    found = joint.is_watermarked and tenant_id is not None
    tenant = await runtime.store.get_tenant(tenant_id) if found and tenant_id else None
    await audit_query(
        runtime,
        who,
        {
            "collection": True,
            "found": found,
            "tenant_id": tenant_id if found else None,
            "key_version": version if found else None,
            "p_value": joint.p_value,
            "verdict": joint.verdict,
            "statistic": statistic,
            "num_texts": len(good),
            "num_keys": num_keys,
            "group_by": body.group_by,
            "group_value": group.value if group is not None else None,
        },
        full,
    )
    if not full:
        return CollectionVerdict(
            verdict=joint.verdict,
            tenant_id=tenant_id if found else None,
            group_value=group.value if group is not None else None,
            detail_reason=who.detail_reason,
        )
    per_text = _per_text(texts, good, ids, errors, result, bank, chosen, tried, keys)
    message = (
        f"watermarked for tenant {tenant.name!r}, the {len(good)} texts read together"
        if found and tenant is not None
        else verdict_sentence(joint.verdict, joint.statistic, joint.p_value, joint.num_scored)
    )
    if chosen is None and num_keys > 0:
        message += " (no worldcup-v2 key could read the set: collections need worldcup-v2)"
    return CollectionResponse(
        **verdict_fields(joint, statistic),
        found=found,
        message=message,
        tenant_id=tenant_id if found else None,
        tenant_name=tenant.name if tenant is not None else None,
        key_version=version if found else None,
        num_keys=num_keys,
        num_tenants=num_tenants,
        num_texts=len(good),
        num_tokens=sum(len(t) for t in ids),
        num_units=num_units,
        group=group,
        texts=per_text,
    )


def _per_text(
    texts: list[str],
    good: list[int],
    ids: list[list[int]],
    errors: dict[int, BatchItemError],
    result: CollectionResult | None,
    bank: KeyBank,
    chosen: Chosen | None,
    tried: int,
    keys: str,
) -> list[CollectionText]:
    """Each text's own answer: its own test under the key the set chose, corrected for
    the keys searched (the same correction as the joint test's)."""
    out: dict[int, CollectionText] = {
        i: CollectionText(index=i, verdict=None, p_value=None, num_units=0, error=e)
        for i, e in errors.items()
    }
    width = bank.schemes[chosen.index].config.context_width if chosen is not None else None
    kept = chosen.kept if chosen is not None else (0,) * len(ids)
    for pos, (index, text_ids) in enumerate(zip(good, ids, strict=True)):
        own = np.asarray(text_ids, dtype=np.int64)
        scored = len(ScoredTokensV2.of(own, width)) if width is not None else 0
        own_tests = [TestP("detect", None)] if result is None else result.text_tests(pos)
        a = assess(own_tests, tried, keys, scored)
        out[index] = CollectionText(
            index=index,
            verdict=a.verdict,
            p_value=a.p_value,
            reason=a.reason,
            tokens_needed=a.tokens_needed,
            num_tokens=len(text_ids),
            num_scored_tokens=scored,
            num_units=kept[pos],
            error=None,
        )
    return [out[i] for i in range(len(texts))]
