"""worldcup_eval.merge: a second run's preset cells join the one results file only
when both runs measured the same thing."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from worldcup_cli.main import app
from worldcup_eval.merge import merge_results

PROTOCOL = {
    "model": {"model": "m", "config": "c", "dtype": "float32"},
    "key_id": "k",
    "generated_length": 256,
    "prompts": 100,
    "prompts_by_dataset": {"cnn": 50, "eli5": 50},
}


def _cell(scheme: str, acc: float, ms: float) -> dict[str, Any]:
    return {
        "scheme": scheme,
        "bits": 32,
        "length": 128,
        "role": "main",
        "bit_accuracy": acc,
        "timing": {"ms": ms},
    }


def _run(cells: list[dict[str, Any]], command: str) -> dict[str, Any]:
    return {
        "protocol": copy.deepcopy(PROTOCOL),
        "config": {"bits": [32]},
        "main": cells,
        "ablation": [],
        "curves": [{"scheme": c["scheme"], "bits": 32, "points": [1]} for c in cells],
        "robustness": [],
        "timing": {"encoding": [{"scheme": c["scheme"], "bits": 32} for c in cells]},
        "environment": {"command": command, "git_commit": "abc"},
    }


MAIN = _run([_cell("worldcup-k1", 0.94, 1.0)], "worldcup eval")
SECOND = _run(
    [_cell("worldcup-k1", 0.94, 2.5), _cell("worldcup-k1-nondistortionary", 0.93, 2.0)],
    "worldcup eval --bits 32",
)


def test_the_preset_cells_are_added_and_the_merge_recorded() -> None:
    before = copy.deepcopy(MAIN)
    out = merge_results(MAIN, SECOND, ["worldcup-k1-nondistortionary"])
    assert MAIN == before  # inputs untouched
    assert [c["scheme"] for c in out["main"]] == ["worldcup-k1", "worldcup-k1-nondistortionary"]
    assert out["main"][0]["timing"] == {"ms": 1.0}  # the main run's own cell is kept
    assert [c["scheme"] for c in out["curves"]][-1] == "worldcup-k1-nondistortionary"
    assert out["timing"]["encoding"][-1]["scheme"] == "worldcup-k1-nondistortionary"
    assert out["merged"] == [
        {
            "schemes": ["worldcup-k1-nondistortionary"],
            "cells": 2,
            "command": "worldcup eval --bits 32",
            "git_commit": "abc",
            "config": {"bits": [32]},
        }
    ]


def test_another_protocol_is_refused() -> None:
    other = copy.deepcopy(SECOND)
    other["protocol"]["key_id"] = "another"
    with pytest.raises(ValueError, match="protocol.key_id"):
        merge_results(MAIN, other, ["worldcup-k1-nondistortionary"])


def test_a_shared_cell_that_differs_is_refused() -> None:
    other = copy.deepcopy(SECOND)
    other["main"][0]["bit_accuracy"] = 0.5
    with pytest.raises(ValueError, match="disagree"):
        merge_results(MAIN, other, ["worldcup-k1-nondistortionary"])


def test_cells_already_there_or_absent_are_refused() -> None:
    with pytest.raises(ValueError, match="already holds"):
        merge_results(MAIN, SECOND, ["worldcup-k1"])
    with pytest.raises(ValueError, match="no cell"):
        merge_results(MAIN, SECOND, ["worldcup-k2"])


def test_the_cli_writes_the_merged_file(tmp_path: Path) -> None:
    into, other = tmp_path / "results.json", tmp_path / "second.json"
    into.write_text(json.dumps(MAIN))
    other.write_text(json.dumps(SECOND))
    args = ["eval-merge", str(other), "--into", str(into)]
    result = CliRunner().invoke(app, [*args, "--schemes", "worldcup-k1-nondistortionary"])
    assert result.exit_code == 0, result.output
    written = json.loads(into.read_text())
    assert written["merged"][0]["cells"] == 2 and len(written["main"]) == 2
