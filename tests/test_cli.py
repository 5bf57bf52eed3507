"""CLI contract: bad input is one line on stderr and exit code 2; --json is parseable."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from worldcup_cli.main import app
from worldcup_core import Payload, SamplingConfig, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.generation import GenerationRequest, generate
from worldcup_core.models import load_tokenizer, tiny_random_model

runner = CliRunner()


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "key.hex"
    path.write_text(WatermarkKey(bytes(range(32))).hex() + "\n")
    return path


def _assert_one_line_error(result: object, needle: str) -> None:
    assert result.exit_code == 2, result.output  # type: ignore[attr-defined]
    err = result.stderr.strip()  # type: ignore[attr-defined]
    assert err.startswith("error: ") and "\n" not in err and needle in err, err
    assert "Traceback" not in result.output  # type: ignore[attr-defined]


def test_keygen_prints_a_fresh_32_byte_key(tmp_path: Path) -> None:
    first, second = runner.invoke(app, ["keygen"]), runner.invoke(app, ["keygen"])
    assert first.exit_code == 0 and len(bytes.fromhex(first.stdout.strip())) == 32
    assert first.stdout != second.stdout
    out = tmp_path / "k.hex"
    assert runner.invoke(app, ["keygen", "--out", str(out)]).exit_code == 0
    assert (out.stat().st_mode & 0o777) == 0o600
    WatermarkKey.from_hex(out.read_text())
    _assert_one_line_error(runner.invoke(app, ["keygen", "--out", str(out)]), "overwrite")


@pytest.mark.parametrize(
    ("content", "needle"),
    [("zz", "64 hex characters"), ("g" * 64, "hexadecimal"), ("", "64 hex characters")],
)
def test_malformed_key_file(tmp_path: Path, content: str, needle: str) -> None:
    bad = tmp_path / "bad.hex"
    bad.write_text(content)
    result = runner.invoke(app, ["detect", "--key-file", str(bad)], input="some text")
    _assert_one_line_error(result, needle)


def test_missing_key_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["detect", "--key-file", str(tmp_path / "nope")], input="x")
    _assert_one_line_error(result, "not found")


@pytest.mark.parametrize(
    ("bits", "needle"), [("0120", "0 and 1"), ("1" * 65, "1..64"), ("", "1..64")]
)
def test_bad_payload_bits(key_file: Path, bits: str, needle: str) -> None:
    args = ["generate", "--key-file", str(key_file), "--bits", bits, "--prompt", "hi"]
    _assert_one_line_error(runner.invoke(app, args), needle)


def test_empty_text_and_bad_numbers(key_file: Path) -> None:
    _assert_one_line_error(
        runner.invoke(app, ["detect", "--key-file", str(key_file)], input="  \n"), "no text"
    )
    _assert_one_line_error(
        runner.invoke(app, ["decode", "--key-file", str(key_file), "--num-bits", "65"], input="x"),
        "--num-bits",
    )
    _assert_one_line_error(
        runner.invoke(
            app, ["decode", "--key-file", str(key_file), "--num-bits", "8", "--k", "9"], input="x"
        ),
        "groups",
    )
    _assert_one_line_error(
        runner.invoke(app, ["detect", "--key-file", str(key_file), "--scheme", "kgw"], input="x"),
        "unknown scheme",
    )


def test_decode_and_detect_json_on_watermarked_text(key_file: Path) -> None:
    tokenizer = load_tokenizer()
    tiny = tiny_random_model(tokenizer)
    payload = Payload("1100101001011100")
    scheme = WorldCup(WatermarkKey.from_hex(key_file.read_text()))
    prompt = tokenizer("A test prompt", add_special_tokens=False).input_ids
    req = GenerationRequest(
        prompt, SamplingConfig(max_new_tokens=96, min_new_tokens=96, seed=2), scheme, payload
    )
    (res,) = generate(tiny.model, [req], tiny.eos_token_ids, tiny.pad_token_id)
    text = tokenizer.decode(res.token_ids, skip_special_tokens=True)

    det = runner.invoke(app, ["detect", "--key-file", str(key_file), "--json"], input=text)
    assert det.exit_code == 0, det.output
    verdict = json.loads(det.stdout)
    assert set(verdict) >= {"p_value", "tests", "is_watermarked", "num_scored_tokens"}
    assert verdict["p_value"] == min(t["combined_p_value"] for t in verdict["tests"])
    assert verdict["is_watermarked"] and verdict["p_value"] < 1e-6
    assert verdict["verdict"] == "watermarked"  # worldcup_core.verdict, as the API's

    dec = runner.invoke(
        app, ["decode", "--key-file", str(key_file), "--num-bits", "16", "--json"], input=text
    )
    decoded = json.loads(dec.stdout)
    assert len(decoded["bits"]) == 16 and len(decoded["bit_confidence"]) == 16
    assert sum(a == b for a, b in zip(decoded["bits"], payload.bits, strict=True)) >= 14

    human = runner.invoke(app, ["detect", "--key-file", str(key_file)], input=text)
    assert human.exit_code == 0 and human.stdout.startswith("Watermarked (p = ")

    # without --json decode prints each bit's confidence too (the README promises it)
    plain = runner.invoke(
        app, ["decode", "--key-file", str(key_file), "--num-bits", "16"], input=text
    )
    lines = plain.stdout.splitlines()
    assert plain.exit_code == 0 and lines[0].startswith(f"bits {decoded['bits']}")
    assert lines[1].startswith("per-bit confidence") and len(lines) == 2 + 16 // 4
    cells = [c.split() for line in lines[2:] for c in line.split(" | ")]
    assert [int(c[0]) for c in cells] == list(range(16))
    assert "".join(c[1] for c in cells) == decoded["bits"]
    zs = [entry["z"] for entry in decoded["bit_confidence"]]
    assert [float(c[3]) for c in cells] == pytest.approx(zs, abs=0.006)
    # as docs/cli.md says: z is the evidence for the value shown, never a signed value
    assert all(z >= 0 for z in zs) and max(zs) > 1 and "+" not in "".join(lines[2:])


def test_a_key_of_another_context_width_is_read_at_its_own(key_file: Path) -> None:
    """``--context-width`` is the key version's own (the service's WORLDCUP_CONTEXT_WIDTH
    for new keys): a text written at c = 3 is watermarked read at 3 and not at 2."""
    tokenizer = load_tokenizer()
    tiny = tiny_random_model(tokenizer)
    key = WatermarkKey.from_hex(key_file.read_text())
    scheme = WorldCup(key, WatermarkConfig(context_width=3))
    prompt = tokenizer("A test prompt", add_special_tokens=False).input_ids
    req = GenerationRequest(
        prompt,
        SamplingConfig(max_new_tokens=96, min_new_tokens=96, seed=2),
        scheme,
        Payload("1100101001011100"),
    )
    (res,) = generate(tiny.model, [req], tiny.eos_token_ids, tiny.pad_token_id)
    text = tokenizer.decode(res.token_ids, skip_special_tokens=True)
    base = ["detect", "--key-file", str(key_file), "--json"]
    wide = runner.invoke(app, [*base, "--context-width", "3"], input=text)
    assert wide.exit_code == 0, wide.output
    assert json.loads(wide.stdout)["verdict"] == "watermarked"
    narrow = runner.invoke(app, base, input=text)
    assert narrow.exit_code == 0 and json.loads(narrow.stdout)["verdict"] == "not_watermarked"
    _assert_one_line_error(
        runner.invoke(app, [*base, "--context-width", "9"], input=text), "context_width"
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["decode", "--key-file", "k", "--num-bits", "abc"], "--num-bits"),
        (["detect"], "Missing option '--key-file'; see `"),
        (["nosuch"], "No such command"),
    ],
)
def test_usage_errors_are_one_line_with_exit_2(args: list[str], needle: str) -> None:
    """Through the real console entry point, not CliRunner: what a shell user sees."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "worldcup_cli.main", *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and needle in err, err


def test_bench_decoding_reports_v1_and_v2_like_for_like() -> None:
    result = runner.invoke(app, ["bench", "decoding", "--texts", "20", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    for key in ("from_ids_v2_one_per_call", "from_ids_v1_one_per_call", "from_ids_v1_batched"):
        assert out[key]["texts"] == 2 and out[key]["texts_per_s"] > 0
    assert out["from_ids"]["texts"] == 20
    assert out["v2_speedup_one_per_call"] > 0 and out["v2_speedup_batched"] > 0


# ------------------------------------------------------------------ every command's bad input


def _run_main(monkeypatch: pytest.MonkeyPatch, capsys: Any, args: list[str], stdin: bytes) -> Any:
    """``worldcup ARGS`` through the console entry point, in process: exit code, stdout,
    stderr."""
    import io
    import sys

    from worldcup_cli.main import main

    monkeypatch.setattr(sys, "argv", ["worldcup", *args])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def _bad_input_cases(tmp: Path) -> list[tuple[str, list[str], bytes, str]]:
    """(command, args, stdin, what the one line must say): bad paths, bad files and empty
    input for every command ({key} is a good key file, {dir} a folder, {bin} binary junk,
    {empty} an empty file, {miss} a path in a folder that does not exist)."""
    return [
        ("keygen", ["--out", "{miss}/k.hex"], b"", "No such file or directory"),
        ("keygen", ["--out", "{dir}"], b"", "refusing to overwrite"),
        (
            "generate",
            ["--key-file", "{miss}/k", "--bits", "01", "--prompt", "hi"],
            b"",
            "not found",
        ),
        ("generate", ["--key-file", "{dir}", "--bits", "01", "--prompt", "hi"], b"", "unreadable"),
        ("generate", ["--key-file", "{bin}", "--bits", "01", "--prompt", "hi"], b"", "unreadable"),
        ("generate", ["--key-file", "{key}", "--bits", "01", "--prompt", " "], b"", "empty"),
        (
            "generate",
            ["--key-file", "{key}", "--bits", "01", "--prompt", "hi", "--model", "{miss}"],
            b"",
            "not a local Hugging Face model",
        ),
        ("decode", ["--key-file", "{empty}", "--num-bits", "8"], b"text", "64 hex characters"),
        ("decode", ["--key-file", "{key}", "--num-bits", "8"], b"", "no text on stdin"),
        ("decode", ["--key-file", "{key}", "--num-bits", "8"], b"  \n\t", "no text on stdin"),
        ("detect", ["--key-file", "{bin}"], b"text", "unreadable"),
        ("detect", ["--key-file", "{key}"], b"", "no text on stdin"),
        ("detect", ["--key-file", "{key}", "--model", "{dir}"], b"text", "not a local"),
        ("bench speed", ["--quick", "--nosuch"], b"", "No such option"),
        ("bench provenance", ["--keys", "0"], b"", "--keys"),
        ("bench decoding", ["--texts", "1"], b"", "--texts"),
        ("bench calibration", ["--texts", "1"], b"", "--texts"),
        ("bench first-use", ["--texts", "0"], b"", "--texts"),
        ("bench collection", ["--users", "0"], b"", "--users"),
        ("bench grid", ["--presets", "nosuch"], b"", "--presets"),
        ("bench grid", ["--temperatures", "warm"], b"", "--temperatures"),
        ("eval-merge", ["{bin}", "--into", "{miss}/results.json"], b"", "No such file"),
        ("eval-merge", ["{bin}", "--into", "{bin}"], b"", "Invalid value"),
        (
            "scan",
            ["{miss}/x.jsonl", "--out", "{tmp}/o.jsonl", "--key-file", "{key}"],
            b"",
            "no input",
        ),
        ("scan", ["{bin}", "--out", "{tmp}/o.jsonl", "--key-file", "{key}"], b"", "input format"),
        (
            "scan",
            ["{empty}.jsonl", "--out", "{tmp}/o.jsonl", "--key-file", "{key}"],
            b"",
            "no rows",
        ),
        (
            "scan",
            ["{tmp}/junk.parquet", "--out", "{tmp}/o.jsonl", "--key-file", "{key}"],
            b"",
            "Parquet",
        ),
        ("scan", ["{tmp}/t.jsonl", "--out", "{dir}.jsonl", "--key-file", "{key}"], b"", "folder"),
        ("scan", ["{tmp}/t.jsonl", "--out", "{tmp}/o.txt", "--key-file", "{key}"], b"", "format"),
        ("scan", ["{tmp}/t.jsonl", "--out", "{tmp}/o.jsonl", "--key-file", "{bin}"], b"", "key"),
        ("bench scan", ["--keys", "abc"], b"", "comma-separated"),
        ("serve", ["--port", "abc"], b"", "--port"),
        ("serve-ray", ["--replicas", "3:1"], b"", "MIN:MAX"),
        ("bench service", ["--detect-seconds", "0"], b"", "positive"),
        ("migrate-store", ["--from", "redis://127.0.0.1:1/0"], b"", "migration failed"),
        ("store backup", ["--out", "{tmp}/b.json", "--redis-url", "http://x"], b"", "redis://"),
        ("store restore", ["--from", "{miss}/b.json"], b"", "no such file"),
        ("bench attack", ["--model", "{miss}"], b"", "not a local Hugging Face model"),
        (
            "bench forgery",
            ["--scenario", "nosuch", "--budget-tokens", "10", "--out", "{tmp}/f"],
            b"",
            "--scenario",
        ),
        (
            "bench forgery",
            ["--scenario", "kgw", "--budget-tokens", "10", "--out", "{bin}"],
            b"",
            "not a folder",
        ),
        (
            "bench forgery",
            ["--scenario", "kgw", "--budget-tokens", "10", "--out", "{tmp}/f", "--deltas", "x"],
            b"",
            "--deltas",
        ),
        (
            "bench forgery",
            ["--scenario", "kgw", "--budget-tokens", "0", "--out", "{tmp}/f"],
            b"",
            "--budget-tokens",
        ),
        ("bench registry", ["--sizes", "abc"], b"", "--sizes"),
        ("bench registry", ["--redis-url", "redis://127.0.0.1:1/0"], b"", "unreachable"),
        ("eval", ["--config", "{miss}/c.toml"], b"", "No such file or directory"),
        ("eval", ["--config", "{dir}"], b"", "Is a directory"),
        ("eval", ["--config", "{bin}"], b"", "not a UTF-8 text file"),
        (
            "eval",
            ["--smoke", "--report-only", "--data-dir", "{miss}", "--out", "{tmp}/ev"],
            b"",
            "data",
        ),
    ]


def _visible_commands(group: Any, prefix: str = "") -> set[str]:
    """Every command a user is shown, groups walked (``bench speed``); hidden aliases out."""
    out: set[str] = set()
    for name, command in group.commands.items():
        if command.hidden:
            continue
        if hasattr(command, "commands"):
            out |= _visible_commands(command, f"{prefix}{name} ")
        else:
            out.add(prefix + name)
    return out


def test_every_command_answers_bad_input_with_one_error_line(
    tmp_path: Path, key_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Each command, fed bad paths, bad files and empty input, prints one ``error:`` line
    and exits 2, never a traceback; a new command without a case here fails the test."""
    import typer.main

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder.with_suffix(".jsonl")).mkdir()
    (tmp_path / "junk.bin").write_bytes(b"\x00\xff\xfe\x80 not text")
    (tmp_path / "junk.parquet").write_text("not parquet", encoding="utf-8")
    (tmp_path / "empty").write_text("", encoding="utf-8")
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    (tmp_path / "t.jsonl").write_text('{"text": "hello"}\n', encoding="utf-8")
    names = {
        "{key}": str(key_file),
        "{dir}": str(folder),
        "{bin}": str(tmp_path / "junk.bin"),
        "{empty}": str(tmp_path / "empty"),
        "{miss}": str(tmp_path / "missing" / "deeper"),
        "{tmp}": str(tmp_path),
    }
    monkeypatch.setenv("WORLDCUP_REDIS_URL", "")
    monkeypatch.setenv("WORLDCUP_SQLITE_PATH", "")
    cases = _bad_input_cases(tmp_path)
    for command, args, stdin, needle in cases:
        concrete = command.split()
        for arg in args:
            for mark, value in names.items():
                arg = arg.replace(mark, value)
            concrete.append(arg)
        code, out, err = _run_main(monkeypatch, capsys, concrete, stdin)
        lines = err.strip().splitlines()
        assert code == 2, (concrete, code, err)
        assert len(lines) == 1 and lines[0].startswith("error: "), (concrete, err)
        assert needle in lines[0], (concrete, lines[0])
        assert "Traceback" not in out + err and out == "", (concrete, out)
    commands = _visible_commands(typer.main.get_command(app))
    assert commands == {c for c, *_ in cases}, commands ^ {c for c, *_ in cases}
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.jsonl.parts").exists()


def test_benchmarks_are_one_group_and_the_old_names_still_run(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """`worldcup bench` alone is the group's help; each old `bench-NAME` is a hidden alias
    of `bench NAME` (same options) that says so in one line on stderr, for one release;
    `worldcup bench --quick --json`, the old speed bench, still runs it."""
    import typer.main

    import worldcup_cli.bench

    root = typer.main.get_command(app)
    group = root.commands["bench"]  # type: ignore[attr-defined]
    aliases = {n: c for n, c in root.commands.items() if n.startswith("bench-")}  # type: ignore[attr-defined]
    assert {n.removeprefix("bench-") for n in aliases} == set(group.commands) - {"speed"}
    for name, alias in aliases.items():
        new = group.commands[name.removeprefix("bench-")]
        assert alias.hidden and not new.hidden
        assert [p.opts for p in alias.params] == [p.opts for p in new.params]

    code, out, err = _run_main(monkeypatch, capsys, ["bench"], b"")
    assert code == 0 and "speed" in out and "registry" in out and "bench-" not in out
    code, out, err = _run_main(monkeypatch, capsys, [], b"")
    assert code == 0 and "bench-" not in out
    code, out, err = _run_main(monkeypatch, capsys, ["bench", "nosuch"], b"")
    assert code == 2 and err == "error: No such command 'nosuch'; see `worldcup bench --help`\n"

    code, out, err = _run_main(monkeypatch, capsys, ["bench-grid", "--presets", "x"], b"")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2, err
    assert lines[0].startswith("warning: `worldcup bench-grid` is deprecated")
    assert "use `worldcup bench grid`" in lines[0] and lines[1].startswith("error: --presets")

    calls: list[bool] = []

    def fake_run_bench(quick: bool, progress: Any) -> dict[str, Any]:
        calls.append(quick)
        return {"quick": quick}

    monkeypatch.setattr(worldcup_cli.bench, "run_bench", fake_run_bench)
    monkeypatch.setattr(worldcup_cli.bench, "format_bench", str)
    for args, warned in (
        (["bench", "speed", "--quick", "--json"], False),
        (["bench", "--quick", "--json"], True),
    ):
        code, out, err = _run_main(monkeypatch, capsys, args, b"")
        assert code == 0 and json.loads(out) == {"quick": True}, (args, err)
        assert ("use `worldcup bench speed`" in err) is warned, err
    assert calls == [True, True]


def test_version(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    import importlib.metadata

    code, out, err = _run_main(monkeypatch, capsys, ["--version"], b"")
    assert code == 0 and err == ""
    assert out.strip() == f"worldcup {importlib.metadata.version('worldcup')}"


def test_generate_shows_progress_on_stderr_and_keeps_stdout_clean(
    key_file: Path, tiny_model_dir: Path
) -> None:
    """A progress bar (tokens of --max-new-tokens) on stderr; stdout is the JSON alone."""
    args = ["generate", "--key-file", str(key_file), "--bits", "0110", "--prompt", "Hello"]
    args += ["--max-new-tokens", "6", "--min-new-tokens", "6", "--json"]
    result = runner.invoke(app, [*args, "--model", str(tiny_model_dir)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["num_tokens"] == 6 and out["bits"] == "0110"
    assert "generate" in result.stderr and "6/6" in result.stderr, result.stderr
    quiet = runner.invoke(app, [*args, "--model", str(tiny_model_dir), "--no-progress"])
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.stderr


def test_detect_calls_a_short_text_inconclusive_too_short(key_file: Path) -> None:
    """A 1-word text is no evidence of absence: inconclusive (too_short), as the API says."""
    for as_json in (True, False):
        args = ["detect", "--key-file", str(key_file)] + (["--json"] if as_json else [])
        out = runner.invoke(app, args, input="Hello")
        assert out.exit_code == 0, out.output
        if as_json:
            said = json.loads(out.stdout)
            assert (said["verdict"], said["reason"]) == ("inconclusive", "too_short")
            assert said["tokens_needed"] >= 66 > said["num_scored_tokens"]
        else:
            assert out.stdout.startswith("Inconclusive: too short"), out.stdout


def test_bench_forgery_help_names_the_attack_options(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """`worldcup bench forgery` is the attack of worldcup_eval.forgery, with its options."""
    code, out, err = _run_main(monkeypatch, capsys, ["bench", "forgery", "--help"], b"")
    assert code == 0 and err == "", err
    for option in ("--scenario", "--budget-tokens", "--out", "--accounts", "--deltas"):
        assert option in out, (option, out)
