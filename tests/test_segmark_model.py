"""SegMark on the embedded SmolLM2: the shared generation loop, recovered from the text.

Apart from ``test_segmark.py`` so that file stays fast; marked ``model`` like the
other embedded-model tests.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from worldcup_core import Payload, SamplingConfig, WatermarkKey
from worldcup_core.baselines import SegMark
from worldcup_core.generation import GenerationRequest, generate
from worldcup_core.models import load_model

KEY = WatermarkKey(bytes(range(32)))


@pytest.mark.model
def test_round_trip_on_the_embedded_model(data_dir: Path) -> None:
    """SmolLM2 through ``generate`` (the loop every scheme shares), recovered from the text."""
    lm = load_model()
    with (data_dir / "cnn_dailymail_test.jsonl").open() as fh:
        articles = [json.loads(line)["article"] for _, line in zip(range(6), fh, strict=False)]
    rng = np.random.default_rng(2026)
    payloads = [Payload.random(16, rng) for _ in articles]
    scheme = SegMark(KEY)
    requests = [
        GenerationRequest(
            lm.tokenizer(article, add_special_tokens=False).input_ids[:40],
            SamplingConfig(max_new_tokens=128, min_new_tokens=128, seed=i),
            scheme,
            payload,
        )
        for i, (article, payload) in enumerate(zip(articles, payloads, strict=True))
    ]
    results = generate(lm.model, requests, lm.eos_token_ids, lm.pad_token_id)
    wrong_key = SegMark(WatermarkKey(hashlib.sha256(b"segmark-test:embedded-wrong").digest()))
    accuracies: list[float] = []
    p_values: list[float] = []
    for payload, res in zip(payloads, results, strict=True):
        text = lm.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        ids = lm.tokenizer(text, add_special_tokens=False).input_ids
        decoded = scheme.decode(ids, 16)
        agree = [a == b for a, b in zip(decoded.bits, payload.bits, strict=True)]
        accuracies.append(float(np.mean(agree)))
        p_values.append(decoded.detection.p_value)
        assert wrong_key.detect(ids, num_bits=16).p_value > 1e-3
    assert max(p_values) < 1e-2 and float(np.median(p_values)) < 1e-5, p_values
    assert np.mean(accuracies) >= 0.9, accuracies
