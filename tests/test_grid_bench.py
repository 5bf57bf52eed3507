"""``worldcup bench grid`` without a model: the prefix helper on the real tokenizer,
and the report and plot rendered from a small synthetic results.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from worldcup_cli.grid_bench import metric_table, prefix, reaches, render, report, share_se
from worldcup_cli.main import app


def test_prefix_cuts_at_token_boundaries(smollm2_tokenizer: Any) -> None:
    text = "Tides rise and fall twice a day because the Moon pulls on the oceans of the Earth."
    ids = smollm2_tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > 10
    cut, cut_ids = prefix(smollm2_tokenizer, text, 10)
    assert cut_ids == ids[:10]
    assert text.startswith(cut) and len(cut) < len(text)
    # the cut text reads back as the same 10 tokens (what the service scores)
    assert smollm2_tokenizer(cut, add_special_tokens=False).input_ids == ids[:10]
    # an answer that ended before the length counts at its own length
    whole, whole_ids = prefix(smollm2_tokenizer, text, 10_000)
    assert whole == text and whole_ids == ids


def test_share_se() -> None:
    assert share_se(36, 40) == pytest.approx((0.9 * 0.1 / 40) ** 0.5)
    assert share_se(40, 40) == 0.0 and share_se(0, 0) == 0.0


def _measured(watermarked: int, named: int | None, p: float) -> dict[str, Any]:
    return {
        "watermarked": watermarked,
        "named": named,
        "detect_alone": watermarked // 2,
        "bit_accuracy": 0.8125,
        "bit_accuracy_se": 0.0312,
        "median_verdict_p": p,
        "contradictions": None if named is None else 1,
    }


def synthetic() -> dict[str, Any]:
    cells = []
    for scheme in ("frontier", "bimark"):
        for t in (0.3, 1.0):
            for length in (32, 256):
                hits = 36 if length == 256 else 10
                named = None if scheme == "bimark" else hits - 1
                cells.append(
                    {
                        "scheme": scheme,
                        "temperature": t,
                        "length": length,
                        "n": 40,
                        "reached": 40 if length == 32 else 31,
                        "median_tokens": float(length),
                        "small": _measured(hits, named, 3e-9),
                        "big": _measured(hits - 2, None if named is None else named - 2, 4e-7),
                    }
                )
    return {
        "settings": {
            "texts": 40,
            "temperatures": [0.3, 1.0],
            "lengths": [32, 256],
            "presets": ["frontier"],
            "baselines": ["bimark"],
            "per_tenant": 20,
            "big_registry": 100_000,
            "max_new_tokens": 256,
            "top_k": 50,
            "top_p": 0.95,
            "no_repeat_ngram_size": 4,
            "num_bits": 32,
            "threshold": 1e-6,
            "ppl_texts": 20,
        },
        "cells": cells,
        "quality": [
            {"scheme": "frontier", "temperature": 0.3, "median_ppl": 2.5, "n": 20},
            {"scheme": "none", "temperature": 0.3, "median_ppl": 2.25, "n": 20},
        ],
        "generate_seconds": {"frontier-t0.3": 170.0},
        "runtime_s": 600.0,
    }


def test_tables_show_the_measured_figures() -> None:
    result = synthetic()
    small = metric_table(result, "small", "watermarked").splitlines()
    # 36/40 = 90 % ± 4.7, 10/40 = 25 % ± 6.8
    assert "| WorldCup frontier (k=1, m=30, α=0.6) | 0.3 | 25 ± 7 | 90 ± 5 |" in small
    big = metric_table(result, "big", "watermarked")
    assert "| 0.3 | 20 ± 6 | 85 ± 6 |" in big  # 8/40 and 34/40
    named = metric_table(result, "big", "named")
    assert "| BiMark (own p; no registry) | 1 | no registry | no registry |" in named
    assert "| 1 | 40/40 (32) | 31/40 (256) |" in metric_table(result, "small", "reached")
    # 36/40 at 256 tokens reaches 90 %; 34/40 with the big registry does not
    assert "| WorldCup frontier (k=1, m=30, α=0.6) | 256 tokens | 256 tokens |" in reaches(
        result, "small"
    )
    assert "| not by 256 | not by 256 |" in reaches(result, "big")
    text = report(result)
    assert "Answers whose /detect and /decode contradict each other: 4." in text
    assert "| unwatermarked | 2.25 | - |" in text
    assert "81.2 ± 3.1" in text and "4e-07" in text


def test_report_only_renders_from_results_json(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text(json.dumps(synthetic()), encoding="utf-8")
    out = CliRunner().invoke(app, ["bench", "grid", "--report-only", "--out", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "report.md").read_text(encoding="utf-8") == report(synthetic())
    assert (tmp_path / "grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = CliRunner().invoke(
        app, ["bench", "grid", "--report-only", "--out", str(tmp_path / "none")]
    )
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_render_writes_both_files(tmp_path: Path) -> None:
    render(synthetic(), tmp_path / "grid")
    assert (tmp_path / "grid" / "grid.png").stat().st_size > 1000
    assert "## Registry filled to 100 000 entries" in (tmp_path / "grid" / "report.md").read_text(
        encoding="utf-8"
    )


def test_the_published_grid_table_is_the_one_results_json_gives() -> None:
    """The grid's "what a chat answer gets" table (docs/evaluation.md, which the README
    links to) is regenerated from the committed grid."""
    import json
    from pathlib import Path

    from worldcup_cli.grid_bench import readme_table

    root = Path(__file__).resolve().parents[1]
    results = json.loads((root / "docs/results/grid/results.json").read_text(encoding="utf-8"))
    table = readme_table(results)
    assert table.count("\n") == 6 and "WorldCup frontier" in table and "BiMark" in table
    assert table in (root / "docs/evaluation.md").read_text(encoding="utf-8")
    assert "docs/evaluation.md#power-where-users-are" in (root / "README.md").read_text(
        encoding="utf-8"
    )


def test_the_verdicts_absence_line_is_the_grids() -> None:
    """worldcup_core.verdict.MIN_SCORED_TOKENS is derived from measured power, not
    chosen: recomputed here from the committed grid results."""
    import json
    from pathlib import Path

    from worldcup_cli.grid_bench import absence_line
    from worldcup_core.verdict import MIN_SCORED_TOKENS

    path = Path(__file__).resolve().parents[1] / "docs" / "results" / "grid" / "results.json"
    result = json.loads(path.read_text(encoding="utf-8"))
    assert absence_line(result) == MIN_SCORED_TOKENS
    # cooler sampling needs more than the grid measured: no line at all at 0.7
    with pytest.raises(ValueError, match="never reaches"):
        absence_line(result, temperature=0.7)
