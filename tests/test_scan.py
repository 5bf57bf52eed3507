"""Issue 13: corpus scans (``worldcup scan``), locally and on Ray.

One corpus of a few hundred rows in JSONL, CSV and Parquet: texts watermarked
under three tenants (several key versions, one of them a ``worldcup-v1`` key)
with registry entries, copy-paste mixes of watermarked and human text, human
text from the evaluation data, and empty and malformed rows. Keys come from a
SQLite store through the master key, as in a deployment.
"""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy import stats
from typer.testing import CliRunner

from app.core.security import KeyWrapper
from app.services.corpus import Fields, InputError, discover, plan, read_bytes, read_part
from app.stores.base import KeyRecord, TenantRecord
from app.stores.sqlite import SQLiteStore
from worldcup_cli.main import app as cli_app
from worldcup_core import WatermarkKey
from worldcup_core.message import MessageIdCodec
from worldcup_scan.bench import watermarked_ids, word_tokens
from worldcup_scan.keys import (
    KeySourceError,
    KeySpec,
    ScanKeys,
    StoreSession,
    keys_from_files,
    open_store,
)
from worldcup_scan.run import ScanOptions, ScanStateError, run_scan
from worldcup_scan.scanner import COLUMNS, Scanner, ScanSpec

MASTER = bytes(range(32))
NUM_BITS = 16
ALPHA = 0.01
# (tenant name, [(version, scheme)]): beta's version 1 predates v2
TENANTS = [
    ("alpha", [(1, "worldcup-v2"), (2, "worldcup-v2")]),
    ("beta", [(1, "worldcup-v1"), (2, "worldcup-v2")]),
    ("gamma", [(1, "worldcup-v2")]),
]


def _secret(name: str, version: int) -> bytes:
    return bytes([len(name) * 7 + version]) * 16 + name.encode().ljust(16, b"-")


def _read(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return list(pq.read_table(path).to_pylist())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any, data_dir: Path) -> Any:
    """The store (SQLite), the corpus files, and what each row truly is."""
    root = tmp_path_factory.mktemp("scan")
    db = root / "store.sqlite3"
    store = SQLiteStore(db)
    wrapper = KeyWrapper(MASTER)
    rng = np.random.default_rng(13)
    vocab = word_tokens(smollm2_tokenizer)
    truth: dict[str, dict[str, Any]] = {}
    marked: list[tuple[str, str]] = []  # (id, text)

    async def build() -> None:
        for name, versions in TENANTS:
            tenant_id = f"tid-{name}"
            for version, scheme in versions:
                record = KeyRecord(
                    tenant_id,
                    version,
                    wrapper.wrap(tenant_id, version, _secret(name, version)),
                    time.time(),
                    groups=2,
                    layers=30,
                    alpha=1.2,
                    scheme=scheme,
                )
                if version == 1:
                    await store.create_tenant(
                        TenantRecord(tenant_id, name, f"hash-{name}", time.time()), record
                    )
                else:
                    await store.add_key_version(record)
                spec = KeySpec(tenant_id, name, version, _secret(name, version), scheme=scheme)
                for j in range(4):
                    meta = {"user": f"{name}-v{version}-{j}"}
                    entry = await store.allocate_message(
                        tenant_id, version, NUM_BITS, meta, time.time()
                    )
                    payload = MessageIdCodec(WatermarkKey(spec.secret), NUM_BITS).payload(
                        entry.message_id
                    )
                    ids = watermarked_ids(spec.worldcup(), payload, 160, vocab, rng)
                    rid = f"wm-{name}-{version}-{j}"
                    marked.append((rid, smollm2_tokenizer.decode(ids)))
                    truth[rid] = {
                        "tenant_id": tenant_id,
                        "version": version,
                        "message_id": entry.message_id,
                        "metadata": meta,
                    }
        await store.close()

    asyncio.run(build())
    human: list[str] = []
    for name, field in (
        ("cnn_dailymail_test.jsonl", "article"),
        ("eli5_longform_qa.jsonl", "outputs"),
    ):
        with open(data_dir / name, encoding="utf-8") as f:
            taken = 0
            for line in f:
                value = json.loads(line).get(field) or ""
                text = " ".join(map(str, value)) if isinstance(value, list) else str(value)
                if len(text) > 400 and taken < 110:
                    human.append(text[:900])
                    taken += 1
    assert len(human) >= 200
    rows: list[dict[str, Any]] = []
    for i, text in enumerate(human[:200]):
        rows.append({"id": f"human-{i}", "text": text})
        truth[f"human-{i}"] = {"human": True}
    for i, (rid, text) in enumerate(marked[:8]):  # copy-paste: a human paragraph on each side
        mix_id = f"mix-{rid}"
        rows.append(
            {"id": mix_id, "text": f"{human[200 + i][:300]}\n\n{text}\n\n{human[-i - 1][:300]}"}
        )
        truth[mix_id] = dict(truth[rid], mix=True)
    rows += [{"id": rid, "text": text} for rid, text in marked]
    order = np.random.default_rng(5).permutation(len(rows))
    rows = [rows[i] for i in order]
    thirds = len(rows) // 3
    jsonl, csv_path, parquet = (
        root / "in" / "a.jsonl",
        root / "in" / "b.csv",
        root / "in" / "c.parquet",
    )
    jsonl.parent.mkdir()
    with open(jsonl, "wb") as f:
        for row in rows[:thirds]:
            f.write((json.dumps(row) + "\n").encode())
        f.write(b'{"id": "bad-empty", "text": "   "}\n')
        f.write(b'{"id": "bad-missing", "body": "no text field"}\n')
        f.write(b'{"id": "bad-json", "text": \n')
        f.write(b'{"id": "bad-utf8", "text": "caf\xe9 au lait"}\n')
        f.write(b'["bad", "array"]\n')
        f.write(b'{"id": "bad-number", "text": 42}\n')
    with open(csv_path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "text"])
        for row in rows[thirds : 2 * thirds]:
            w.writerow([row["id"], row["text"]])  # multi-line fields are quoted
        w.writerow(["bad-csv-empty", ""])
    table = pa.table(
        {
            "id": [r["id"] for r in rows[2 * thirds :]] + ["bad-null"],
            "text": [r["text"] for r in rows[2 * thirds :]] + [None],
        }
    )
    pq.write_table(table, parquet, row_group_size=40)
    bad = {"bad-empty", "bad-missing", "bad-utf8", "bad-number", "bad-csv-empty", "bad-null"}
    return {"root": root, "db": db, "inputs": root / "in", "truth": truth, "bad": bad}


def _session(db: Path) -> StoreSession:
    return StoreSession(open_store(str(db)), MASTER)


@pytest.fixture(scope="module")
def local_scan(corpus: Any) -> Any:
    """The CLI, local engine, 2 processes, provenance over the store, with registry data."""
    out = corpus["root"] / "local.jsonl"
    env = {"WORLDCUP_MASTER_KEY": MASTER.hex()}
    args = ["scan", str(corpus["inputs"]), "--out", str(out), "--id-field", "id"]
    args += ["--store", f"sqlite://{corpus['db']}", "--with-registry", "--workers", "2"]
    args += ["--part-rows", "25", "--no-progress", "--json", "--actor", "analyst-7"]
    result = CliRunner().invoke(cli_app, args, env=env)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    return out, summary, result.output


def test_scan_attributes_every_watermarked_row(corpus: Any, local_scan: Any) -> None:
    out, summary, _ = local_scan
    rows = {r["id"]: r for r in _read(out)}
    truth = corpus["truth"]
    assert set(truth) | corpus["bad"] <= set(rows)
    for rid, t in truth.items():
        row = rows[rid]
        if t.get("human"):
            continue
        assert row["error"] is None and row["is_watermarked"], rid
        assert row["p_value"] < 1e-6, rid
        assert (row["tenant_id"], row["key_version"]) == (t["tenant_id"], t["version"]), rid
        assert row["message_id"] == t["message_id"], rid
        assert json.loads(row["registry_metadata"]) == t["metadata"], rid
        issued = dt.datetime.fromisoformat(row["registry_issued_at"])  # ISO-8601, as the API
        assert row["registry_issued_at"].endswith("Z") and issued.tzinfo is not None
        assert abs((dt.datetime.now(dt.UTC) - issued).total_seconds()) < 3600
        assert len(row["bits"]) == NUM_BITS
    hits = sum(1 for t in truth.values() if not t.get("human"))
    human = [rows[rid] for rid, t in truth.items() if t.get("human")]
    false_positives = sum(bool(r["is_watermarked"]) for r in human)
    scored = [r for r in rows.values() if r["error"] is None]
    assert all(r["is_watermarked"] == (r["verdict"] == "watermarked") for r in scored)
    # at most what the verdict's level allows (one-sided, fails by chance < 1e-6)
    assert false_positives <= stats.binom.ppf(1 - 1e-6, len(human), 1e-6)
    assert summary["hits"] == hits + false_positives
    assert summary["texts"] == len(rows) and summary["files"] == 3
    assert summary["hits_per_tenant"]["alpha"] >= 8 and summary["hits_per_tenant"]["gamma"] >= 4
    # the verdict's p on human text: conservative (weighted Bonferroni) at each level,
    # and not merely quiet (its exact components' uniformity: tests/test_assess.py)
    p = np.array([r["p_value"] for r in human])
    for t in (0.5, 0.1, 0.02):
        assert np.mean(p < t) <= t + 4 * np.sqrt(t / len(p)), t
    assert np.mean(p < 0.5) >= 0.1


def test_scan_reports_bad_rows_without_crashing(corpus: Any, local_scan: Any) -> None:
    out, summary, _ = local_scan
    rows = _read(out)
    by_id = {r["id"]: r for r in rows}
    expected = {
        "bad-empty": "empty",
        "bad-missing": "missing_field",
        "bad-utf8": "non_utf8",
        "bad-number": "not_a_string",
        "bad-csv-empty": "empty",
        "bad-null": "missing_field",
    }
    for rid, code in expected.items():
        assert by_id[rid]["error"].startswith(code + ":"), by_id[rid]
        assert by_id[rid]["is_watermarked"] is None and by_id[rid]["p_value"] is None
    anonymous = [r for r in rows if r["error"] and r["id"].startswith(str(corpus["inputs"]))]
    codes = sorted(r["error"].split(":")[0] for r in anonymous)
    assert codes == ["malformed_json", "not_an_object"]  # no id field: path:row
    assert summary["errors"] == 8
    good = [r for r in rows if r["error"] is None]
    assert all(r["num_scored_tokens"] > 0 and r["short_text"] is False for r in good)


def test_scan_is_audited_and_keeps_secrets_out(corpus: Any, local_scan: Any) -> None:
    out, summary, output = local_scan
    session = _session(corpus["db"])
    try:
        (record,) = session._run(session.store.audit_log(1))
    finally:
        session.close()
    assert record.action == "scan" and record.actor == "analyst-7"
    assert record.outcome["num_texts"] == summary["texts"]
    assert record.outcome["num_hits"] == summary["hits"]
    assert record.outcome["num_errors"] == 8 and record.outcome["num_files"] == 3
    assert record.outcome["hits_per_tenant"] == summary["hits_per_tenant"]
    assert abs(record.at - time.time()) < 600
    audit = json.dumps(record.outcome)
    body = out.read_text(encoding="utf-8")
    for name, versions in TENANTS:
        for version, _ in versions:
            secret = _secret(name, version)
            for blob in (audit, body, output):
                assert secret.hex() not in blob and secret.decode("latin-1") not in blob
    assert MASTER.hex() not in body + output + audit
    assert "committee" not in audit and "human-" not in audit  # no texts, no document ids
    assert not Path(str(out) + ".parts").exists()


def test_ray_engine_gives_identical_output(corpus: Any, local_scan: Any) -> None:
    out_local, _, _ = local_scan
    session = _session(corpus["db"])
    try:
        spec = ScanSpec(session.load_keys(), "provenance", Fields("text", "id"), ALPHA)
        out = corpus["root"] / "ray.parquet"
        options = ScanOptions(
            (str(corpus["inputs"]),),
            out,
            engine="ray",
            workers=2,
            part_rows=25,
            with_registry=True,
            progress=False,
        )
        summary = run_scan(options, spec, session)
    finally:
        session.close()
    assert _read(out) == _read(out_local)
    assert summary.parts_resumed == 0 and summary.texts_scanned == summary.texts


def test_resume_after_a_crash_skips_finished_parts(corpus: Any, local_scan: Any) -> None:
    out_local, _, _ = local_scan
    session = _session(corpus["db"])
    out = corpus["root"] / "resumed.jsonl"
    try:
        spec = ScanSpec(session.load_keys(), "provenance", Fields("text", "id"), ALPHA)
        options = ScanOptions(
            (str(corpus["inputs"]),),
            out,
            workers=1,
            part_rows=25,
            with_registry=True,
            progress=False,
        )
        first: list[str] = []

        def crash(part: Any, finished: int) -> None:
            first.append(part.name)
            if finished == 4:
                raise KeyboardInterrupt  # the scan dies half-way

        with pytest.raises(KeyboardInterrupt):
            run_scan(options, spec, session, on_part=crash)
        state = Path(str(out) + ".parts")
        done = {p.name.removesuffix(".parquet") for p in state.glob("part-*.parquet")}
        assert done == set(first) and len(done) == 4 and not out.exists()
        second: list[str] = []
        summary = run_scan(options, spec, session, on_part=lambda p, _n: second.append(p.name))
    finally:
        session.close()
    assert set(second).isdisjoint(done) and len(second) == summary.parts - 4
    assert summary.parts_resumed == 4 and summary.texts_scanned < summary.texts
    assert _read(out) == _read(out_local)


def test_changed_inputs_refuse_to_resume_stale_parts(tmp_path: Path) -> None:
    src = tmp_path / "one.jsonl"
    src.write_text('{"text": "a short line of text for the scan"}\n', encoding="utf-8")
    key = tmp_path / "k.key"
    key.write_text(WatermarkKey(bytes(32)).hex(), encoding="ascii")
    spec = ScanSpec(keys_from_files([key]), "detect")
    out = tmp_path / "out.parquet"
    state = Path(str(out) + ".parts")
    state.mkdir()
    (state / "manifest.json").write_text('{"version": 0}', encoding="utf-8")
    options = ScanOptions((str(src),), out, progress=False)
    with pytest.raises(ScanStateError, match="--restart"):
        run_scan(options, spec)
    options = ScanOptions((str(src),), out, restart=True, progress=True)  # the bar, too
    summary = run_scan(options, spec)
    assert summary.texts == 1 and summary.errors == 0 and summary.hits == 0
    (row,) = _read(out)
    assert row["short_text"] is True and row["num_scored_tokens"] < 64
    # as the API: a short row is inconclusive (too_short), never not_watermarked
    assert (row["verdict"], row["reason"], row["tokens_needed"]) == (
        "inconclusive",
        "too_short",
        66,
    )
    assert not state.exists()


def test_detect_mode_scans_one_tenant(corpus: Any, smollm2_tokenizer: Any) -> None:
    """Detect mode (one tenant's versions, Bonferroni as /detect), in process."""
    session = _session(corpus["db"])
    try:
        keys = session.load_keys("beta")
    finally:
        session.close()
    assert [k.version for k in keys.keys] == [1, 2] and keys.keys[0].scheme == "worldcup-v1"
    scanner = Scanner(ScanSpec(keys, "detect", Fields("text", "id"), ALPHA), smollm2_tokenizer)
    files = discover([str(corpus["inputs"])])
    rows = [r for part in plan(files, 50) for r in read_part(part, Fields("text", "id"))]
    results = {r["id"]: r for r in scanner.scan_rows(rows)}
    for rid, t in corpus["truth"].items():
        r = results[rid]
        if t.get("tenant_id") == "tid-beta":
            assert r["is_watermarked"] and r["key_version"] == t["version"], rid
            assert r["message_id"] == t["message_id"], rid
        elif not t.get("human"):
            assert not r["is_watermarked"], rid  # another tenant's text is not beta's
    assert "secret" not in repr(keys) and _secret("beta", 1).hex() not in repr(keys.keys)


def test_an_entry_too_close_to_another_is_flagged_not_named(
    corpus: Any, smollm2_tokenizer: Any, local_scan: Any
) -> None:
    """As the API's ``registry_ambiguous``: where the registry test may name an entry
    but the posterior is under ``registry_min_confidence``, the row names none and
    says so. A bar no posterior reaches turns every named entry into such a row."""
    session = _session(corpus["db"])
    try:
        keys = session.load_keys("beta")
    finally:
        session.close()
    files = discover([str(corpus["inputs"])])
    rows = [r for part in plan(files, 50) for r in read_part(part, Fields("text", "id"))]
    results = {}
    for bar in (0.95, 1.5):
        spec = ScanSpec(keys, "detect", Fields("text", "id"), ALPHA, registry_min_confidence=bar)
        results[bar] = {r["id"]: r for r in Scanner(spec, smollm2_tokenizer).scan_rows(rows)}
    named = [rid for rid, r in results[0.95].items() if r["message_id"] is not None]
    assert len(named) >= 8  # beta's texts, and the copy-pastes of them
    for rid, r in results[0.95].items():
        assert r["registry_ambiguous"] is (False if r["error"] is None else None), rid
    for rid, r in results[1.5].items():
        assert r["message_id"] is None, rid
        assert r["verdict"] == results[0.95][rid]["verdict"], rid  # the verdict is unchanged
        assert bool(r["registry_ambiguous"]) is (rid in named), rid
    out, summary, _ = local_scan  # the CLI's summary counts them (none at the default bar)
    assert summary["unnamed_entries"] == sum(bool(r["registry_ambiguous"]) for r in _read(out))
    assert summary["expired_entries"] == 0  # no retention in the shared store


def test_an_entry_past_the_retention_reads_as_expired(corpus: Any, tmp_path: Path) -> None:
    """As the API's ``registry_expired``: a text whose entry the retention sweep deleted
    names no entry and says so, its verdict unchanged; the newer entries are still
    named; the summary counts the expired ones."""
    import sqlite3

    db = tmp_path / "store.sqlite3"
    with sqlite3.connect(corpus["db"]) as src, sqlite3.connect(db) as dst:
        src.backup(dst)

    async def expire() -> int:  # alpha's ids 1-4 (v1) and 5-6 (v2) go; 7-8 stay
        store = SQLiteStore(db)
        try:
            kept = await store.registry_entry("tid-alpha", 7)
            assert kept is not None
            return await store.expire_registry("tid-alpha", kept.issued_at)
        finally:
            await store.close()

    assert asyncio.run(expire()) == 6
    session = _session(db)
    try:
        keys = session.load_keys("alpha")
    finally:
        session.close()
    assert keys.expired_below == {"tid-alpha": 7}
    files = discover([str(corpus["inputs"])])
    rows = [r for part in plan(files, 50) for r in read_part(part, Fields("text", "id"))]
    alpha = tmp_path / "alpha.jsonl"
    alpha.write_text(
        "".join(
            json.dumps({"id": r.id, "text": r.text}) + "\n"
            for r in rows
            if r.id is not None and r.id.startswith("wm-alpha-")
        ),
        encoding="utf-8",
    )
    out = tmp_path / "out.jsonl"
    spec = ScanSpec(keys, "detect", Fields("text", "id"), ALPHA)
    summary = run_scan(ScanOptions((str(alpha),), out, progress=False), spec)
    found = {r["id"]: r for r in _read(out)}
    truth = corpus["truth"]
    assert len(found) == 8 and summary.expired_entries == 6, summary
    for rid, r in found.items():
        gone = truth[rid]["message_id"] < 7
        assert r["verdict"] == "watermarked" and r["key_version"] == truth[rid]["version"], rid
        assert r["registry_expired"] is gone and not r["registry_ambiguous"], rid
        assert r["message_id"] == (None if gone else truth[rid]["message_id"]), rid
    assert "6 with an entry past the registry's retention" in summary.format()


def test_parts_read_exactly_the_rows_of_each_file(tmp_path: Path) -> None:
    """Byte offsets (JSONL, CSV with quoted multi-line fields) and row groups (Parquet)."""
    texts = [
        f'row {i}\nsecond line, with "quotes"' if i % 3 == 0 else f"row {i}" for i in range(53)
    ]
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8"
    )
    with open(tmp_path / "b.csv", "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "other"])
        w.writerows([t, i] for i, t in enumerate(texts))
    pq.write_table(pa.table({"text": texts}), tmp_path / "c.parquet", row_group_size=7)
    files = discover([str(tmp_path / "*.*")])
    assert [fmt for _, fmt in files] == ["jsonl", "csv", "parquet"]
    for size in (1, 5, 53, 100):
        parts = plan(files, size)
        for index in range(3):
            got = [r.text for p in parts if p.file_index == index for r in read_part(p, Fields())]
            assert got == texts, (size, index)


def test_an_upload_in_memory_reads_as_the_same_file_on_disk(tmp_path: Path) -> None:
    """The console's uploads are read in memory (no temporary file): the same rows,
    texts and per-row errors as the scan's reader gives for that file on disk."""
    jsonl = [
        json.dumps({"text": "first", "id": "a"}),
        "",
        "not json",
        json.dumps({"text": "  "}),
        json.dumps({"other": 1}),
        json.dumps([1, 2]),
        json.dumps({"text": "x" * 41}),
        json.dumps({"text": "two\nlines"}),
    ]
    out = io.StringIO()
    csv.writer(out).writerows([["text", "n"], ["plain", 1], ['multi\nline, "quoted"', 2], ["", 3]])
    uploads = {
        "up.jsonl": "\n".join(jsonl).encode() + b'\n{"text": "bad \xff byte"}\n',
        "up.csv": out.getvalue().encode() + b"bad \xff byte,4\r\n",
    }
    fields = Fields(max_chars=40)
    for name, data in uploads.items():
        (tmp_path / name).write_bytes(data)
        disk = [r for p in plan(discover([str(tmp_path / name)]), 3) for r in read_part(p, fields)]
        memory = read_bytes(name, data, fields)
        assert len(memory) == len(disk) >= 4
        assert [(r.row, r.text, r.error) for r in memory] == [
            (r.row, r.text, r.error) for r in disk
        ]
        assert {r.source for r in memory} == {name} and memory[-1].id == f"{name}:{len(disk) - 1}"
        assert any(r.error for r in memory) and any(r.text for r in memory)
        with pytest.raises(InputError, match=f"'body' is not a field of {name}"):
            read_bytes(name, data, Fields(text="body"))
    with pytest.raises(InputError, match="use .jsonl or .csv"):
        read_bytes("up.parquet", b"PAR1", fields)


def test_cli_usage_errors_are_one_line(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello"}\n', encoding="utf-8")
    runner = CliRunner()
    cases = [
        (["scan", str(src), "--out", "o.parquet"], "no keys"),
        (["scan", str(tmp_path / "nope*.jsonl"), "--out", "o.parquet", "--key-file", "x"], "key"),
        (["scan", str(src), "--out", "o.parquet", "--mode", "both"], "--mode"),
        (["scan", str(src), "--out", "o.parquet", "--store", str(tmp_path / "none.db")], "store"),
        (["scan", str(src), "--out", "o.jsonl", "--with-model", "--group-by", "u"], "model-free"),
        (["scan", str(src), "--out", "o.jsonl", "--with-model", "--model", str(tmp_path)], "model"),
    ]
    env = {"WORLDCUP_REDIS_URL": "", "WORLDCUP_SQLITE_PATH": "", "WORLDCUP_MASTER_KEY": "00" * 32}
    for args, needle in cases:
        result = runner.invoke(cli_app, args, env=env)
        assert result.exit_code == 2, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines
    key = tmp_path / "k.key"
    key.write_text("zz", encoding="ascii")
    result = runner.invoke(
        cli_app, ["scan", str(src), "--out", "o.parquet", "--key-file", str(key)]
    )
    assert result.exit_code == 2 and "malformed key file" in result.output
    assert os.environ.get("WORLDCUP_MASTER_KEY") != "00" * 32  # the runner's env did not leak


def test_key_files_label_the_output(tmp_path: Path) -> None:
    keys = []
    for name in ("one.key", "two.key"):
        (tmp_path / name).write_text(WatermarkKey.generate().hex() + "\n", encoding="ascii")
        keys.append(tmp_path / name)
    loaded = keys_from_files(keys, num_bits=8)
    assert [k.tenant_id for k in loaded.keys] == ["one.key", "two.key"]
    assert loaded.num_bits == 8 and "KeySpec" in repr(loaded.keys[0])
    assert loaded.keys[0].secret.hex() not in repr(loaded) + repr(loaded.keys)
    same = ScanKeys(loaded.keys, {}, 8)
    assert same.fingerprint() == loaded.fingerprint()
    assert ScanKeys(loaded.keys[:1], {}, 8).fingerprint() != loaded.fingerprint()
    # --context-width: the width the key versions were issued with (a store's carry theirs)
    wide = keys_from_files(keys, num_bits=8, context_width=4)
    assert {k.context_width for k in loaded.keys} == {2}
    assert {k.worldcup().config.context_width for k in wide.keys} == {4}
    with pytest.raises(KeySourceError, match="context_width"):
        keys_from_files(keys, context_width=9)


def test_bench_scan_prints_rates_for_one_and_two_workers_on_both_engines() -> None:
    args = ["bench", "scan", "--texts", "20", "--keys", "100", "--engine-keys", "20", "--json"]
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    runs = {(e["engine"], e["workers"]): e for e in report["engines"]}
    assert set(runs) == {("local", 1), ("local", 2), ("ray", 1), ("ray", 2)}
    for run in runs.values():
        assert run["texts_per_s"] > 0 and run["identical_output"] is True
    per_core = report["per_core"]
    assert per_core["tokenize_ms"] > 0 and per_core["detect_texts_per_s"] > 0
    assert [p["keys"] for p in per_core["provenance"]] == [100]
    from worldcup_scan.bench import format_scan_bench

    text = format_scan_bench(report)
    for engine in ("local", "ray"):
        for workers in (1, 2):
            assert f"{engine:<5} {workers} worker(s): " in text


def test_killed_scan_resumes_to_the_same_output(corpus: Any, local_scan: Any) -> None:
    """SIGKILL the CLI half-way, rerun it: finished parts are kept, the output is the same."""
    out_local, _, _ = local_scan
    out = corpus["root"] / "killed.jsonl"
    state = Path(str(out) + ".parts")
    cmd = [str(Path(sys.executable).parent / "worldcup"), "scan", str(corpus["inputs"])]
    cmd += ["--out", str(out), "--id-field", "id", "--store", str(corpus["db"])]
    cmd += ["--with-registry", "--workers", "1", "--part-rows", "3", "--no-progress", "--json"]
    env = dict(os.environ, WORLDCUP_MASTER_KEY=MASTER.hex())
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if state.is_dir() and len(list(state.glob("part-*.parquet"))) >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the scan finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(state.glob("part-*.parquet")))
    assert done >= 3 and not out.exists()
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert summary["parts_resumed"] == done  # nothing finished was scanned again
    assert summary["texts_scanned"] == summary["texts"] - 3 * done  # first parts: 3 rows each
    assert _read(out) == _read(out_local)


def _key_file(tmp_path: Path) -> Path:
    key = tmp_path / "k.key"
    key.write_text(WatermarkKey.generate().hex() + "\n", encoding="ascii")
    return key


def test_out_suffix_names_the_format(tmp_path: Path) -> None:
    """``--out`` writes what its suffix says (.jsonl, .csv, .parquet): the same rows in
    each; any other suffix is refused before anything is scanned or written."""
    src = tmp_path / "in.jsonl"
    texts = ["The first text of the corpus.", "A second, different one.", "Third."]
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    key = _key_file(tmp_path)
    runner = CliRunner()
    base = ["--key-file", str(key), "--workers", "1", "--no-progress", "--num-bits", "8"]
    got = {}
    for suffix in (".jsonl", ".csv", ".parquet"):
        out = tmp_path / f"o{suffix}"
        result = runner.invoke(cli_app, ["scan", str(src), "--out", str(out), *base])
        assert result.exit_code == 0, result.output
        got[suffix] = out
    names = [n for n, _ in COLUMNS]
    with open(got[".csv"], encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == names
        csv_rows = list(reader)
    json_rows = _read(got[".jsonl"])
    assert got[".parquet"].read_bytes()[:4] == b"PAR1"
    assert pq.read_table(got[".parquet"]).to_pylist() == json_rows
    assert [r["id"] for r in csv_rows] == [r["id"] for r in json_rows]
    assert [float(r["p_value"]) for r in csv_rows] == [r["p_value"] for r in json_rows]
    for bad in ("o.txt", "o.json", "o"):
        result = runner.invoke(cli_app, ["scan", str(src), "--out", str(tmp_path / bad), *base])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert "unknown output format" in lines[0] and ".csv" in lines[0], lines
        assert not (tmp_path / bad).exists() and not (tmp_path / f"{bad}.parts").exists()


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_a_wrong_text_field_fails_fast(tmp_path: Path, fmt: str) -> None:
    """A field no row has is one error line, naming the fields there are, before any part
    is scanned (not a finished scan with every row ``missing_field``)."""
    rows = [{"id": str(i), "body": f"text number {i}"} for i in range(200)]
    src = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif fmt == "csv":
        with open(src, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, ["id", "body"])
            writer.writeheader()
            writer.writerows(rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "o.jsonl"
    args = ["scan", str(src), "--out", str(out), "--key-file", str(_key_file(tmp_path))]
    for flags, needle in (
        (["--text-field", "text"], "--text-field 'text'"),
        (["--text-field", "body", "--id-field", "uid"], "--id-field 'uid'"),
    ):
        result = CliRunner().invoke(cli_app, [*args, *flags, "--no-progress"])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert needle in lines[0] and "'body'" in lines[0] and "'id'" in lines[0], lines[0]
        assert not out.exists() and not Path(f"{out}.parts").exists()
    result = CliRunner().invoke(cli_app, [*args, "--text-field", "body", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert len(_read(out)) == len(rows)
