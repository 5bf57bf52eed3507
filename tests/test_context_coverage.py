"""worldcup_eval.context_coverage: the share of a new text's contexts a learner has seen."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from worldcup_eval.context_coverage import coverage, first_contexts, main


def test_contexts_are_counted_once_per_text() -> None:
    assert list(first_contexts([1, 2, 1, 2, 1, 2], 2)) == [(1, 2), (2, 1)]
    assert list(first_contexts([5], 2)) == []


def test_a_repeating_text_is_covered_and_a_random_one_is_not_at_wider_widths() -> None:
    cycle = [[1, 2, 3, 4, 5] * 8 for _ in range(20)]
    (row,) = coverage(cycle[:-2], cycle[-2:], 4, [10**6], [5])
    assert row["seen_5"] == 1.0  # every context recurs in every answer
    rng = random.Random(0)
    noise = [[rng.randrange(50) for _ in range(60)] for _ in range(200)]
    narrow, wide = (coverage(noise[:-20], noise[-20:], w, [10**6], [5])[0] for w in (1, 3))
    assert narrow["seen_5"] > 0.99 and wide["seen_5"] < 0.01, (narrow, wide)
    # the budget counts answer tokens read in order; a larger one covers at least as much
    rows = coverage(noise[:-20], noise[-20:], 2, [600, 6000], [1])
    assert rows[0]["tokens_read"] >= 600 and rows[0]["seen_1"] <= rows[1]["seen_1"]


def test_the_command_reads_a_run_and_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    answers = tmp_path / "answers.jsonl"
    rng = random.Random(1)
    lines = [json.dumps({"tokens": [rng.randrange(9) for _ in range(40)]}) for _ in range(30)]
    answers.write_text("\n".join(lines) + "\n")
    assert main([str(answers), "--held-out", "5", "--widths", "1", "2", "--budgets", "400"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("width 1") and set(json.loads(out[-1])) == {"1", "2"}
    with pytest.raises(SystemExit):
        main([str(answers), "--held-out", "30"])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.jsonl")])
