"""``worldcup bench collection`` (issue #44 item 4): the plumbing on a tiny run (the tiny
model, two users, a small registry). Each user's answers are registry entries under the
user's ``user_id``; the registry is filled to its size over its users; each collection
names its own user and never another; human sets are not watermarked and name nobody;
a rerun resumes from the kept answers and measurements."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from worldcup_cli.collection_bench import (
    bench_prompts,
    bench_seeds,
    clopper_pearson,
    run,
    table,
)


def test_clopper_pearson_is_exact_at_the_edges() -> None:
    lo, hi = clopper_pearson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 10))
    lo, hi = clopper_pearson(10, 10)
    assert hi == 1.0 and lo == pytest.approx(0.025 ** (1 / 10))
    lo, hi = clopper_pearson(5, 10)
    assert lo < 0.5 < hi and lo == pytest.approx(1 - hi)


def test_prompts_alternate_the_two_sets_and_grow_by_prefix() -> None:
    ten, twenty = bench_prompts(10), bench_prompts(20)
    assert twenty[:10] == ten and len(set(twenty)) == 20
    assert bench_seeds(20) == [0] * 20


def test_a_set_that_runs_out_starts_over_under_other_seeds() -> None:
    n = 260  # the everyday set holds 100 held-out requests: it starts over at the 201st prompt
    prompts, seeds = bench_prompts(n), bench_seeds(n)
    assert prompts[:200] == bench_prompts(200) and seeds[:200] == [0] * 200
    assert len(set(prompts[:200])) == 200 and prompts[200] == prompts[0]
    # a prompt asked again is sampled under another seed, whatever its place among a user's
    # answers (the seed is that place plus the prompt's round), so no two answers share both
    asked = [(p, s + i % 5) for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))]
    assert len(set(asked)) == n


def test_tiny_run(
    tiny_model_dir: Path, tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLDCUP_DATA_DIR", str(data_dir))
    said: list[str] = []
    kwargs = {
        "users": 2,
        "per_user": 3,
        "max_new_tokens": 40,
        "short_tokens": 12,
        "registry": 40,
        "registry_users": 4,
        "human": 2,
        "out_dir": tmp_path,
        "progress": said.append,
        "model_path": str(tiny_model_dir),
    }
    result = run(**kwargs)  # type: ignore[arg-type]
    # the registry: 40 entries, 10 per user; the generated answers are their users' entries
    with sqlite3.connect(tmp_path / "db.sqlite3") as c:
        metas = [json.loads(m) for (m,) in c.execute("SELECT metadata FROM messages")]
    assert len(metas) == 40
    assert Counter(m["user_id"] for m in metas) == {f"user-000{u}": 10 for u in range(4)}
    assert sum(not m.get("filled") for m in metas) == 6
    assert sum(1 for _ in (tmp_path / "answers.jsonl").open()) == 6
    for tokens in ("40", "12"):
        m = result[tokens]
        assert m["collections"] == 2 and m["wrong_user"]["k"] == 0
        assert m["single_watermarked"]["n"] == 6
        for row in m["rows"]:
            # the group search runs under a watermarked joint verdict only (a short cut
            # of the tiny model's answers may fall short of it under some keys)
            searched = (4, 40) if row["verdict"] == "watermarked" else (0, 0)
            assert (row["values_searched"], row["entries_searched"]) == searched, row
            assert row["named"] in (None, row["user"])
        assert m["seconds_per_collection"]["median"] > 0
    # the tiny model's answers carry a strong watermark: whole answers (3 x 40 tokens: the
    # user's p 1e-12 to 1e-16 in 3 runs, where 3 x 24 gave 1e-7: flaky) name their user
    assert result["40"]["watermarked"]["k"] == 2 and result["40"]["right_user"]["k"] == 2
    short = [r["num_tokens"] for r in result["12"]["rows"]]
    assert all(n <= 3 * 13 for n in short) and all(n > 0 for n in short)
    h = result["human"]
    assert h["collections"] == 2 and h["watermarked"]["k"] == 0
    assert all(r["named"] is None for r in h["rows"])
    text = table(result)
    assert "3 × 12 tokens" in text and "human texts (control)" in text
    # a rerun reads everything back: nothing generated or measured again
    said.clear()
    again = run(**kwargs)  # type: ignore[arg-type]
    assert again["40"] == result["40"] and again["answers"] == result["answers"]
    assert not any(s.startswith(("generated", "filled", "40 tokens")) for s in said)
    # the registry is filled for two users: a third would change it
    with pytest.raises(ValueError, match="filled for 2 users"):
        run(**{**kwargs, "users": 3})  # type: ignore[arg-type]
