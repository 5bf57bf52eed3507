"""Reading a corpus: JSONL, CSV and Parquet files, split into resumable parts.

The reader of ``worldcup scan`` (:mod:`worldcup_scan`) and of the console's batch
uploads (:mod:`app.services.cases`, in memory: :func:`read_bytes`). It sits beside
the console's service, which imports it sideways, and below the scan, which runs
without the web stack: it imports nothing but the standard library. Parquet needs
``pyarrow`` (the ``scan`` extra), imported only when a Parquet file is read.

A *part* is a row range of one file, located by a byte offset (JSONL, CSV) or
a row group (Parquet), so any worker can read it without reading what comes
before it. Bad rows (malformed JSON, a missing or non-string field, invalid
UTF-8, empty text) become rows with an ``error``, never an exception.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv"}
FORMATS |= {".parquet": "parquet", ".pq": "parquet"}

csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long documents are normal in a corpus


class InputError(ValueError):
    """The inputs cannot be scanned at all (no files, unknown format, unreadable file)."""


@dataclass(frozen=True)
class Part:
    """Rows ``[start, stop)`` of one input file."""

    path: str
    fmt: str
    file_index: int
    start: int
    stop: int
    offset: int  # byte offset of row ``start`` (JSONL, CSV); row group (Parquet)
    group_start: int = 0  # Parquet: the row group's first row (file-wide)

    @property
    def name(self) -> str:
        return f"part-{self.file_index:05d}-{self.start:010d}"

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class RawRow:
    id: str
    source: str
    row: int
    text: str | None  # None when the row is bad
    error: str | None
    group: str | None = None  # the --group-by column's value (Fields.group), if any


@dataclass(frozen=True)
class Fields:
    text: str = "text"
    id: str | None = None
    max_chars: int = 1_000_000
    group: str | None = None  # a column whose value groups rows (``worldcup scan --group-by``)


def discover(inputs: Sequence[str]) -> list[tuple[str, str]]:
    """Files (path, format) named by paths, globs or directories; sorted, deduplicated."""
    found: list[str] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found += sorted(
                str(p) for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FORMATS
            )
        elif path.is_file():
            found.append(item)
        else:
            matches = sorted(glob.glob(item, recursive=True))
            files = [m for m in matches if Path(m).is_file()]
            if not files:
                raise InputError(f"no input matches {item!r}")
            found += files
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for f in found:
        key = str(Path(f).resolve())
        if key in seen:
            continue
        seen.add(key)
        fmt = FORMATS.get(Path(f).suffix.lower())
        if fmt is None:
            raise InputError(f"unknown input format {f!r}: use .jsonl, .csv or .parquet")
        out.append((f, fmt))
    if not out:
        raise InputError("no input files found")
    return out


def plan(files: Sequence[tuple[str, str]], part_rows: int) -> list[Part]:
    """Split every file into parts of at most ``part_rows`` rows (one pass over each file)."""
    if part_rows < 1:
        raise InputError("part size must be positive")
    parts: list[Part] = []
    for index, (path, fmt) in enumerate(files):
        try:
            if fmt == "jsonl":
                parts += _plan_lines(path, index, part_rows)
            elif fmt == "csv":
                parts += _plan_csv(path, index, part_rows)
            else:
                parts += _plan_parquet(path, index, part_rows)
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    return parts


def _plan_lines(path: str, index: int, part_rows: int) -> list[Part]:
    with open(path, "rb") as f:
        return _plan_lines_in(f, path, index, part_rows)


def _plan_lines_in(f: IO[bytes], path: str, index: int, part_rows: int) -> list[Part]:
    parts, offset, start, row = [], 0, 0, 0
    pos = 0
    for line in f:
        if row - start == part_rows:
            parts.append(Part(path, "jsonl", index, start, row, offset))
            start, offset = row, pos
        pos += len(line)
        row += 1
    if row > start:
        parts.append(Part(path, "jsonl", index, start, row, offset))
    return parts


def _csv_lines(f: IO[bytes], pos: list[int]) -> Iterator[str]:
    """Decoded lines for csv.reader; ``pos[0]`` is the byte offset consumed so far."""
    for line in f:
        pos[0] += len(line)
        yield line.decode("utf-8", errors="surrogateescape")


def _plan_csv(path: str, index: int, part_rows: int) -> list[Part]:
    with open(path, "rb") as f:
        return _plan_csv_in(f, path, index, part_rows)


def _plan_csv_in(f: IO[bytes], path: str, index: int, part_rows: int) -> list[Part]:
    parts: list[Part] = []
    pos = [0]
    reader = csv.reader(_csv_lines(f, pos))
    if next(reader, None) is None:
        return parts
    start, row, offset = 0, 0, pos[0]
    for _ in reader:
        row += 1
        if row - start == part_rows:
            parts.append(Part(path, "csv", index, start, row, offset))
            start, offset = row, pos[0]
    if row > start:
        parts.append(Part(path, "csv", index, start, row, offset))
    return parts


def _plan_parquet(path: str, index: int, part_rows: int) -> list[Part]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends for a bad file
        raise InputError(f"{path} is not a readable Parquet file: {exc}") from None
    parts, first = [], 0
    for group in range(meta.num_row_groups):
        n = meta.row_group(group).num_rows
        for s in range(0, n, part_rows):
            parts.append(
                Part(path, "parquet", index, first + s, first + min(n, s + part_rows), group, first)
            )
        first += n
    return parts


# ---------------------------------------------------------------------------- fields

FIELD_CHECK_ROWS = 50  # JSONL rows looked at per file before a scan starts


def check_fields(files: Sequence[tuple[str, str]], fields: Fields) -> None:
    """Fail fast when a file has no ``fields.text`` (or ``fields.id``) column at all.

    CSV headers and Parquet schemas name their columns; a JSONL file fails when none of
    its first :data:`FIELD_CHECK_ROWS` JSON objects has the field. A field missing from
    some rows only is not an error here: those rows get ``missing_field`` as before.
    """
    for path, fmt in files:
        try:
            columns = _columns(path, fmt)
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
        _check_columns(path, columns, fields)


def _check_columns(path: str, columns: dict[str, None] | None, fields: Fields) -> None:
    if columns is None:  # empty, or no JSON object among the first rows
        return
    wanted = [(fields.text, "--text-field"), *([(fields.id, "--id-field")] if fields.id else [])]
    wanted += [(fields.group, "--group-by")] if fields.group else []
    for name, flag in wanted:
        if name not in columns:
            shown = ", ".join(repr(c) for c in list(columns)[:20]) or "none"
            raise InputError(f"{flag} {name!r} is not a field of {path} (it has: {shown})")


def _columns(path: str, fmt: str) -> dict[str, None] | None:
    """The field names a file offers (ordered), or None when there is nothing to judge."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return dict.fromkeys(pq.ParquetFile(path).schema_arrow.names)
        except Exception as exc:  # pyarrow's ArrowInvalid and friends
            raise InputError(f"{path} is not a readable Parquet file: {exc}") from None
    with open(path, "rb") as f:
        return _columns_in(f, fmt)


def _columns_in(f: IO[bytes], fmt: str) -> dict[str, None] | None:
    """The field names of a JSONL or CSV stream, read from its start."""
    if fmt == "csv":
        header = next(csv.reader(_csv_lines(f, [0])), None)
        return None if header is None else dict.fromkeys(header)
    seen: dict[str, None] = {}
    objects = 0
    for _, line in zip(range(FIELD_CHECK_ROWS), f, strict=False):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            objects += 1
            seen |= dict.fromkeys(record)
    return seen if objects else None


# ---------------------------------------------------------------------------- reading


def read_part(part: Part, fields: Fields) -> list[RawRow]:
    """The rows of one part; a file that vanished or changed becomes error rows."""
    try:
        if part.fmt == "parquet":
            return _read_parquet(part, fields)
        with open(part.path, "rb") as f:
            return list(_READ[part.fmt](f, part, fields))
    except Exception as exc:  # the file changed or vanished since planning
        message = f"unreadable: {type(exc).__name__}"
        return [
            RawRow(f"{part.path}:{r}", part.path, r, None, message)
            for r in range(part.start, part.stop)
        ]


def _row(part: Part, row: int, record: Any, fields: Fields) -> RawRow:
    """Validate one decoded record (a dict, or an error message string)."""
    fallback = f"{part.path}:{row}"
    if isinstance(record, str):
        return RawRow(fallback, part.path, row, None, record)
    rid = fallback
    if fields.id is not None:
        value = record.get(fields.id)
        if value is not None and not isinstance(value, dict | list):
            rid = str(value)
    group = None
    if fields.group is not None:
        value = record.get(fields.group)
        if value is not None and not isinstance(value, dict | list) and str(value) != "":
            group = str(value)
    if fields.text not in record or record[fields.text] is None:
        return RawRow(rid, part.path, row, None, f"missing_field: no {fields.text!r}")
    text = record[fields.text]
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            return RawRow(rid, part.path, row, None, "non_utf8: text is not valid UTF-8")
    if not isinstance(text, str):
        return RawRow(rid, part.path, row, None, f"not_a_string: {fields.text!r} is not text")
    try:
        text.encode("utf-8")  # lone surrogates: undecodable bytes of a CSV, or JSON escapes
    except UnicodeEncodeError:
        return RawRow(rid, part.path, row, None, "non_utf8: text is not valid UTF-8")
    if not text.strip():
        return RawRow(rid, part.path, row, None, "empty: the text is empty")
    if len(text) > fields.max_chars:
        return RawRow(rid, part.path, row, None, f"too_long: over {fields.max_chars} characters")
    return RawRow(rid, part.path, row, text, None, group)


def _read_jsonl(f: IO[bytes], part: Part, fields: Fields) -> Iterator[RawRow]:
    f.seek(part.offset)
    for row in range(part.start, part.stop):
        line = f.readline()
        try:
            decoded = line.decode("utf-8")
        except UnicodeDecodeError:  # keep the row's id if the rest of the line parses
            try:
                record = json.loads(line.decode("utf-8", errors="surrogateescape"))
            except ValueError:
                record = None
            if isinstance(record, dict):
                yield _row(part, row, record, fields)
            else:
                yield _row(part, row, "non_utf8: the line is not valid UTF-8", fields)
            continue
        if not decoded.strip():
            yield _row(part, row, "empty: blank line", fields)
            continue
        try:
            record = json.loads(decoded)
        except ValueError:
            yield _row(part, row, "malformed_json: the line is not JSON", fields)
            continue
        if not isinstance(record, dict):
            yield _row(part, row, "not_an_object: the line is not a JSON object", fields)
            continue
        yield _row(part, row, record, fields)


def _read_csv(f: IO[bytes], part: Part, fields: Fields) -> Iterator[RawRow]:
    f.seek(0)
    header = next(csv.reader(_csv_lines(f, [0])), [])
    f.seek(part.offset)
    reader = csv.reader(_csv_lines(f, [0]))
    for row in range(part.start, part.stop):
        values = next(reader, None)
        if values is None:
            yield _row(part, row, "unreadable: the file ended early", fields)
            continue
        yield _row(part, row, dict(zip(header, values, strict=False)), fields)


_READ = {"jsonl": _read_jsonl, "csv": _read_csv}
_PLAN_IN = {"jsonl": _plan_lines_in, "csv": _plan_csv_in}


def read_bytes(name: str, data: bytes, fields: Fields) -> list[RawRow]:
    """Every row of one JSONL or CSV file held in memory (an upload), as :func:`plan`,
    :func:`check_fields` and :func:`read_part` read a file on disk: ``name`` gives the
    format and stands for the path in row ids and messages. An :class:`InputError` for
    another format or a missing field; bad rows become rows with an ``error``."""
    fmt = FORMATS.get(Path(name).suffix.lower())
    if fmt not in _READ:
        raise InputError(f"unknown upload format {name!r}: use .jsonl or .csv")
    _check_columns(name, _columns_in(io.BytesIO(data), fmt), fields)
    # one part: a file has no more rows than bytes
    parts = _PLAN_IN[fmt](io.BytesIO(data), name, 0, max(1, len(data)))
    f = io.BytesIO(data)
    return [row for part in parts for row in _READ[fmt](f, part, fields)]


def _read_parquet(part: Part, fields: Fields) -> list[RawRow]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(part.path)
    names = pf.schema_arrow.names
    wanted = (fields.text, fields.id, fields.group)
    columns = [c for c in dict.fromkeys(wanted) if c is not None and c in names]
    table = pf.read_row_group(part.offset, columns=columns)
    lo = part.start - part.group_start
    table = table.slice(lo, len(part))
    cols = {name: table.column(name).to_pylist() for name in columns}
    return [
        _row(part, part.start + i, {name: cols[name][i] for name in columns}, fields)
        for i in range(table.num_rows)
    ]
