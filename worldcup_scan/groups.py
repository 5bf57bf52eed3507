"""``worldcup scan --group-by COLUMN``: rows grouped by a column's value (an account,
a thread), each group read together (issue #44, item 3): one joint row per group.

A group's texts get the exact joint test of :func:`worldcup_core.collection.read_collection`
(a (context, token) repeated across the group counts once), model-free (a scan loads
no model). The key is chosen as ``POST /provenance/collection`` chooses it
(:func:`worldcup_core.collection.choose_key`: the bank screened on the group's texts,
the best few ``worldcup-v2`` keys tested exactly) and the verdict corrected for every
key tried (:func:`worldcup_core.assess.assess`). Rows without a value, and bad rows,
belong to no group and are counted, not scored.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.services.corpus import check_fields, discover, plan, read_part
from worldcup_core.assess import TestP, assess
from worldcup_core.collection import choose_key, read_collection
from worldcup_core.provenance import KeyBank
from worldcup_scan.run import output_format
from worldcup_scan.scanner import Scanner, ScanSpec

GROUP_COLUMNS = (
    "group_by",
    "group",
    "num_texts",
    "num_tokens",
    "num_units",
    "verdict",
    "is_watermarked",
    "p_value",
    "reason",
    "statistic",
    "tenant_id",
    "tenant_name",
    "key_version",
    "texts_watermarked_alone",
    "row_ids",
)


@dataclass
class GroupSummary:
    groups: int = 0
    rows: int = 0
    rows_without_group: int = 0
    bad_rows: int = 0
    watermarked_groups: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def format(self) -> str:
        return (
            f"{self.groups} groups from {self.rows} rows read together "
            f"({self.rows_without_group} rows without a group value, {self.bad_rows} bad rows); "
            f"{self.watermarked_groups} groups watermarked"
        )


def read_groups(
    inputs: tuple[str, ...], spec: ScanSpec
) -> tuple[dict[str, list[tuple[str, str]]], GroupSummary]:
    """Every input row with a value in ``spec.fields.group``, grouped by it:
    value -> [(row id, text)], in input order."""
    files = discover(inputs)
    check_fields(files, spec.fields)
    groups: dict[str, list[tuple[str, str]]] = defaultdict(list)
    summary = GroupSummary()
    for part in plan(files, 10_000):
        for row in read_part(part, spec.fields):
            summary.rows += 1
            if row.text is None:
                summary.bad_rows += 1
            elif row.group is None:
                summary.rows_without_group += 1
            else:
                groups[row.group].append((row.id, row.text))
    return dict(groups), summary


def scan_groups(
    inputs: tuple[str, ...], out: Path, spec: ScanSpec, scanner: Scanner | None = None
) -> GroupSummary:
    """Read each group together and write one joint row per group to ``out``."""
    if spec.fields.group is None:
        raise ValueError("scan_groups needs fields.group (--group-by)")
    fmt = output_format(out)
    scanner = scanner if scanner is not None else Scanner(spec)
    bank = scanner.bank if scanner.bank is not None else KeyBank(scanner.schemes)
    keys = spec.keys.keys
    groups, summary = read_groups(inputs, spec)
    rows = []
    for value in sorted(groups):
        members = groups[value]
        ids: list[list[int]] = scanner.tokenizer(
            [text for _, text in members], add_special_tokens=False
        ).input_ids
        rows.append(_group_row(spec.fields.group, value, members, ids, bank, keys, scanner))
    summary.groups = len(rows)
    summary.watermarked_groups = sum(bool(r["is_watermarked"]) for r in rows)
    _write(out, fmt, rows)
    return summary


def _group_row(
    column: str,
    value: str,
    members: list[tuple[str, str]],
    ids: list[list[int]],
    bank: KeyBank,
    keys: tuple[Any, ...],
    scanner: Scanner,
) -> dict[str, Any]:
    chosen, num_keys = choose_key(bank, ids, None)
    tried = max(num_keys, 1)
    searched = f"{num_keys} key versions"
    row: dict[str, Any] = {
        "group_by": column,
        "group": value,
        "num_texts": len(ids),
        "num_tokens": sum(len(t) for t in ids),
        "statistic": "model_free",
        "row_ids": json.dumps([rid for rid, _ in members]),
    }
    if chosen is None:
        a = assess([TestP("detect", None)], tried, searched, 0)
        row.update(num_units=0, tenant_id=None, tenant_name=None, key_version=None)
        row.update(texts_watermarked_alone=0)
    else:
        scheme = bank.schemes[chosen.index]
        # message-free and at each payload length, combined as the service combines them
        lengths = scanner.payload_lengths([chosen.index])
        result = read_collection(scheme.key, scheme.config, ids, lengths=lengths)
        a = assess(result.tests(), tried, searched, result.num_units)
        spec = keys[chosen.index]
        named = a.is_watermarked
        alone = [
            assess(result.text_tests(i), tried, searched).is_watermarked for i in range(len(ids))
        ]
        row.update(
            num_units=result.num_units,
            tenant_id=spec.tenant_id if named else None,
            tenant_name=spec.tenant_name if named else None,
            key_version=spec.version if named else None,
            texts_watermarked_alone=sum(alone),
        )
    row.update(
        verdict=a.verdict, is_watermarked=a.is_watermarked, p_value=a.p_value, reason=a.reason
    )
    return {c: row.get(c) for c in GROUP_COLUMNS}


def _write(out: Path, fmt: str, rows: list[dict[str, Any]]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if fmt == "jsonl":
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    elif fmt == "csv":
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            w = csv.DictWriter(f, GROUP_COLUMNS)
            w.writeheader()
            w.writerows(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(rows) if rows else pa.table({c: [] for c in GROUP_COLUMNS})
        pq.write_table(table, tmp)
    tmp.replace(out)
