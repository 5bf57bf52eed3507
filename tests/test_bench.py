"""The bench's decoding part on random ids: no model, no data, a few seconds."""

from __future__ import annotations

import json

import pytest

from worldcup_cli.bench import bench_decoding


def test_bench_decoding_shape_and_rates() -> None:
    result = bench_decoding(None, num_texts=40, scan_texts=5)
    json.dumps(result)  # JSON-serialisable as run_bench's output must be
    assert result["source"] == "random"
    assert result["text_tokens"] == 256
    assert result["num_bits"] == 16
    assert result["torch_threads"] == 1
    assert result["from_text"] is None  # needs a tokenizer
    assert 0 <= result["flagged_watermarked"] <= result["distinct_texts"]
    for key, count in (
        ("from_ids", 40),
        ("scan_detect", 5),
        ("from_ids_v2_one_per_call", 4),
        ("from_ids_v1_one_per_call", 4),
        ("from_ids_v1_batched", 4),
    ):
        rate = result[key]
        assert rate["texts"] == count
        assert rate["texts_per_s"] > 0
        assert rate["ms_per_text"] > 0
    # the speedups compare v2 with v1 at the same number of texts a call
    one = result["from_ids_v2_one_per_call"]["texts_per_s"]
    assert result["v2_speedup_one_per_call"] == pytest.approx(
        one / result["from_ids_v1_one_per_call"]["texts_per_s"], rel=0.01
    )
    batched = result["from_ids"]["texts_per_s"] / result["from_ids_v1_batched"]["texts_per_s"]
    assert result["v2_speedup_batched"] == pytest.approx(batched, rel=0.01)


def test_bench_decoding_given_chunks() -> None:
    chunks = [list(range(i, i + 64)) for i in range(3)]
    result = bench_decoding(None, num_texts=7, chunks=chunks, text_tokens=64)
    assert result["source"] == "human"
    assert result["distinct_texts"] == 3
    assert result["from_ids"]["texts"] == 7
    assert result["scan_detect"]["texts"] == 7


def test_bench_provenance_small() -> None:
    from worldcup_cli.bench import bench_provenance, format_provenance_bench

    result = bench_provenance(num_keys=20, text_tokens=64, texts=1)
    json.dumps(result)
    assert result["identical_p_values"] is True  # the bank and the loop agree exactly
    assert result["search_ms_per_1000_keys"] > 0 and result["speedup_vs_loop"] > 0
    assert "ms/1000 keys" in format_provenance_bench(result)


def test_bench_encoding_pairs_wall_and_cpu_time() -> None:
    """Plain and watermarked runs interleave; both ratios come from the same runs."""
    from worldcup_cli.bench import bench_encoding
    from worldcup_core.models import load_tokenizer, tiny_random_model

    loaded = tiny_random_model(load_tokenizer())
    prompt = loaded.tokenizer("The tide came in", add_special_tokens=False).input_ids
    result = bench_encoding(loaded, [prompt, prompt], batch_size=2, new_tokens=6, repeats=2)
    json.dumps(result)
    assert len(result["plain_cpu_seconds"]) == len(result["watermarked_cpu_seconds"]) == 2
    assert all(s > 0 for s in result["plain_cpu_seconds"] + result["watermarked_cpu_seconds"])
    assert 0.0 < result["ratio_cpu"] < 10.0 and 0.0 < result["ratio"] < 10.0
    cpu = result["plain_cpu_seconds"], result["watermarked_cpu_seconds"]
    paired = [p / w for p, w in zip(*cpu, strict=True)]
    # the median of the two pairs' ratios (the seconds above are rounded to 1 ms)
    assert result["ratio_cpu_paired"] == pytest.approx(sum(paired) / 2, rel=0.05)
    wall = result["plain_seconds"], result["watermarked_seconds"]
    paired_wall = [p / w for p, w in zip(*wall, strict=True)]
    assert result["ratio_wall_paired"] == pytest.approx(sum(paired_wall) / 2, rel=0.05)
    assert result["reweight_us_per_token"] > 0  # the batched v2 step was timed


def test_engine_bench_ratio_is_paired_per_repeat() -> None:
    """The vLLM ratio pairs each repeat's waves: a repeat run under heavy load (both arms
    slow) must not move it, where a ratio of medians would."""
    import pytest

    from worldcup_cli.engine_bench import _level_summary, paired_ratio

    def wave(tps: float) -> dict[str, object]:
        return {
            "concurrency": 8,
            "tokens_per_s": tps,
            "ttft_median_s": 1.0,
            "per_sequence_tokens_per_s": tps / 8,
        }

    plain = [wave(100.0), wave(20.0), wave(100.0)]  # the second repeat ran under load
    marked = [wave(96.0), wave(19.2), wave(97.0)]
    assert paired_ratio(marked, plain) == 0.96
    # pairs 0.99, 0.9, 0.833: median 0.9, where the ratio of the medians (50/60) is 0.833
    assert (
        paired_ratio([wave(99.0), wave(18.0), wave(50.0)], [wave(100.0), wave(20.0), wave(60.0)])
        == 0.9
    )
    summary = _level_summary(plain)
    assert summary["tokens_per_s"] == 100.0 and summary["repeats"] == 3
    assert summary["tokens_per_s_each"] == [100.0, 20.0, 100.0]
    with pytest.raises(ValueError):
        paired_ratio(marked, plain[:2])
