"""End to end with the real embedded SmolLM2: generate, then recover from the *text*.

Both scheme versions: v2 generates through the batched step (every row in one
call), v1 row by row; each must recover its payload from the detokenised text.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from worldcup_core import Payload, SamplingConfig, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.generation import GenerationRequest, generate
from worldcup_core.models import LoadedModel, load_model

pytestmark = pytest.mark.model

NUM_PROMPTS = 10


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module", params=["worldcup-v1", "worldcup-v2"])
def version(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def generations(smollm2: LoadedModel, data_dir: Path, version: str) -> list[tuple[Payload, str]]:
    tok = smollm2.tokenizer
    with (data_dir / "cnn_dailymail_test.jsonl").open() as fh:
        articles = [json.loads(line)["article"] for line in fh][:NUM_PROMPTS]
    rng = np.random.default_rng(2026)
    payloads = [Payload.random(16, rng) for _ in articles]
    scheme = WorldCup(WatermarkKey(bytes(range(32))), WatermarkConfig(version=version))
    requests = [
        GenerationRequest(
            tok(article, add_special_tokens=False).input_ids[:40],
            SamplingConfig(max_new_tokens=128, min_new_tokens=64, seed=i),
            scheme,
            payload,
        )
        for i, (article, payload) in enumerate(zip(articles, payloads, strict=True))
    ]
    results = generate(smollm2.model, requests, smollm2.eos_token_ids, smollm2.pad_token_id)
    return [
        (p, tok.decode(r.token_ids, skip_special_tokens=True))
        for p, r in zip(payloads, results, strict=True)
    ]


def _ids(smollm2: LoadedModel, text: str) -> list[int]:
    ids: list[int] = smollm2.tokenizer(text, add_special_tokens=False).input_ids
    return ids


def test_payload_survives_detokenisation(
    smollm2: LoadedModel, generations: list[tuple[Payload, str]], version: str
) -> None:
    scheme = WorldCup(WatermarkKey(bytes(range(32))), WatermarkConfig(version=version))
    accuracies = []
    for payload, text in generations:
        decoded = scheme.decode(_ids(smollm2, text), 16)
        accuracies.append(
            np.mean([a == b for a, b in zip(decoded.bits, payload.bits, strict=True)])
        )
        assert decoded.detection.p_value < 1e-6
        assert scheme.detect(_ids(smollm2, text)).p_value < 1e-6  # length unknown
    assert np.mean(accuracies) >= 0.95, accuracies


def test_wrong_key_sees_chance_bits_and_no_watermark(
    smollm2: LoadedModel, generations: list[tuple[Payload, str]], version: str
) -> None:
    wrong = WorldCup(WatermarkKey(bytes(range(1, 33))), WatermarkConfig(version=version))
    correct, total, p_values = 0, 0, []
    for payload, text in generations:
        decoded = wrong.decode(_ids(smollm2, text), 16)
        correct += sum(a == b for a, b in zip(decoded.bits, payload.bits, strict=True))
        total += 16
        p_values.append(decoded.detection.p_value)
    assert stats.binomtest(correct, total, 0.5).pvalue > 0.001
    assert min(p_values) > 1e-3 and float(np.median(p_values)) > 0.05, p_values


def test_cache_makes_the_second_load_skip_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    import worldcup_core.models as models

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached weights should have been used")

    monkeypatch.setattr(models, "_convert_embedded", no_conversion)
    again = models.load_model()
    assert again.model.config.vocab_size == 49152


def test_cli_generate_then_decode(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from worldcup_cli.main import app

    runner = CliRunner()
    key_file = tmp_path / "key.hex"
    key_file.write_text(WatermarkKey(bytes(range(32))).hex())
    bits = "1011001110001111"
    gen = runner.invoke(
        app,
        [
            "generate", "--key-file", str(key_file), "--bits", bits, "--prompt",
            "Write a short story about a lighthouse keeper.", "--chat",
            "--max-new-tokens", "96", "--min-new-tokens", "96", "--seed", "4", "--json",
        ],
    )  # fmt: skip
    assert gen.exit_code == 0, gen.output
    out = json.loads(gen.stdout)
    assert out["bits"] == bits and out["num_tokens"] == 96 and out["text"]
    dec = runner.invoke(
        app,
        ["decode", "--key-file", str(key_file), "--num-bits", "16", "--json"],
        input=out["text"],
    )
    assert dec.exit_code == 0, dec.output
    decoded = json.loads(dec.stdout)
    assert sum(a == b for a, b in zip(decoded["bits"], bits, strict=True)) >= 13
    assert decoded["p_value"] < 1e-4
    assert set(decoded) >= {"bits", "bit_confidence", "erasures", "p_value"}
