"""CLI contract: bad input is one line on stderr and exit code 2; --json is parseable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from worldcup_cli.main import app
from worldcup_core import Payload, SamplingConfig, WatermarkKey, WorldCup
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
    assert set(verdict) >= {"p_value", "z_score", "is_watermarked", "num_scored_tokens"}
    assert verdict["is_watermarked"] and verdict["p_value"] < 1e-6

    dec = runner.invoke(
        app, ["decode", "--key-file", str(key_file), "--num-bits", "16", "--json"], input=text
    )
    decoded = json.loads(dec.stdout)
    assert len(decoded["bits"]) == 16 and len(decoded["bit_confidence"]) == 16
    assert sum(a == b for a, b in zip(decoded["bits"], payload.bits, strict=True)) >= 14

    human = runner.invoke(app, ["detect", "--key-file", str(key_file)], input=text)
    assert human.exit_code == 0 and human.stdout.startswith("WATERMARKED")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["decode", "--key-file", "k", "--num-bits", "abc"], "--num-bits"),
        (["detect"], "--key-file"),
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
    result = runner.invoke(app, ["bench-decoding", "--texts", "20", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    for key in ("from_ids_v2_one_per_call", "from_ids_v1_one_per_call", "from_ids_v1_batched"):
        assert out[key]["texts"] == 2 and out[key]["texts_per_s"] > 0
    assert out["from_ids"]["texts"] == 20
    assert out["v2_speedup_one_per_call"] > 0 and out["v2_speedup_batched"] > 0
