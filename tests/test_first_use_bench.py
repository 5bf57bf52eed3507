"""``worldcup bench first-use`` (issue #44 item 4): the everyday prompt set, the ELI5
set held out from the model-assisted statistic's tuning, and the same answers scored
under both statistics side by side, resumed from the answers kept under ``out_dir``."""

from __future__ import annotations

from pathlib import Path

from worldcup_cli.first_use_bench import (
    COLUMNS,
    _norm,
    everyday_prompts,
    prompt_set,
    prompts,
    run,
    structured_formats,
    table,
)
from worldcup_eval.model_weights_study import tuning_prompts


def test_everyday_set_has_100_distinct_non_empty_prompts() -> None:
    lines = everyday_prompts()
    assert len(lines) >= 100
    assert all(line.strip() for line in lines)
    assert len({_norm(line) for line in lines}) == len(lines)
    chosen, info = prompt_set("everyday", 100)
    assert chosen == lines[:100] and info["overlap"] == 0


def test_eli5_set_leaves_out_the_tuning_prompts() -> None:
    tuning = {_norm(p) for p in tuning_prompts()}
    chosen, info = prompt_set("eli5", 100)
    assert not tuning & {_norm(p) for p in chosen}
    assert info["overlap"] == 0
    # the committed file's first 20 prompts tuned the variant: left out, counted
    assert info["excluded"] == 20 == len(tuning & {_norm(p) for p in prompts()})
    assert chosen[: info["from_committed_file"]] == prompts()[20:100]


def test_both_statistics_on_the_same_answers_and_resume(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    said: list[str] = []
    kwargs = {
        "count": 3,
        "per_tenant": 2,
        "max_new_tokens": 12,
        "big_registry": 20,
        "prompt_set_name": "everyday",
        "out_dir": tmp_path,
        "progress": said.append,
        "model_path": str(tiny_model_dir),
    }
    result = run(**kwargs)  # type: ignore[arg-type]
    n = result["texts"]
    assert n == 3 and len(result["answers"]) == 3
    for column in COLUMNS:
        measured = result[column]
        assert measured["texts"] == n and measured["contradictions"] == 0
        # each app's answers state the statistic that app takes
        statistic = column.split(":")[1]
        assert measured["took"][statistic] + measured["errors"] == n
    assert sum(1 for line in (tmp_path / "answers.jsonl").open()) == 3
    text = table(result)
    assert "20 entries: model |" in text and "20 entries: model-free |" in text
    # a rerun reads the answers and measurements back: nothing generated again
    said.clear()
    again = run(**kwargs)  # type: ignore[arg-type]
    assert again["answers"] == result["answers"]
    assert again["big:model"] == result["big:model"]
    assert not any(line.startswith("generated 1/") for line in said)


def test_structured_set_answers_json_under_a_schema(tiny_model_dir: Path, tmp_path: Path) -> None:
    chosen, info = prompt_set("structured", 50)
    formats = structured_formats()
    assert len(chosen) == 50 and info["overlap"] == 0
    assert {f["json_schema"]["name"] for f in formats.values()} == {"review", "ticket", "event"}
    result = run(
        count=2,
        per_tenant=2,
        max_new_tokens=48,
        big_registry=20,
        prompt_set_name="structured",
        out_dir=tmp_path,
        progress=lambda _: None,
        model_path=str(tiny_model_dir),
    )
    answers = result["answers"]
    # through /v1/chat/completions, each a registry entry, its JSON checked
    assert sorted(a["message_id"] for a in answers) == [1, 2]
    assert all(isinstance(a["json_valid"], bool) for a in answers)
    assert result["json_valid"] == sum(a["json_valid"] for a in answers)
    # the grammar held: every answer opens a JSON object
    assert all(a["text"].lstrip().startswith("{") for a in answers)
    assert "JSON answers under a schema" in table(result)
