"""The tabulated binomial tails: the same p-values as the direct path, at a bounded cost.

A long text's cells hold hundreds of tokens; the table once computed every deep-tail
entry with a 512-term series, which took a minute and gigabytes on the first decode of
a 4 000-token text (and could take a server down). Now each row is a running log-sum.
"""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from worldcup_core.prf import WatermarkKey
from worldcup_core.scheme import WorldCup
from worldcup_core.scoring import BinomialTable, _two_sided_parts


@pytest.mark.parametrize("tau", [4, 8, 30])
def test_table_matches_the_direct_path(tau: int) -> None:
    table = BinomialTable(tau)
    rng = np.random.default_rng(tau)
    counts = rng.integers(1, 513, 4000)
    trials = counts * tau
    # every kind of cell: the centre, the tails and the deep tails (ones near 0 or trials)
    ones = np.concatenate(
        [rng.integers(0, trials + 1)[:2000], rng.integers(0, 3, 1000), trials[3000:] // 2]
    )
    strict, equal = table.parts(ones, counts)
    lo = np.minimum(ones, trials - ones)
    d_strict, d_equal = _two_sided_parts(lo, trials)
    assert np.array_equal(np.isfinite(strict), np.isfinite(d_strict))
    live = np.isfinite(d_strict)
    assert (strict[live] < -600).any()  # the deep tail is exercised
    rel = np.abs(strict[live] - d_strict[live]) / np.maximum(1.0, np.abs(d_strict[live]))
    assert rel.max() < 1e-9
    assert np.allclose(equal, d_equal, rtol=1e-12, atol=0.0)


def test_a_long_texts_first_decode_is_cheap() -> None:
    """4 000 tokens at 32 bits: the cells reach hundreds of tokens, the table its maximum."""
    wc = WorldCup(WatermarkKey(bytes(range(32))))
    ids = np.random.default_rng(7).integers(0, 49152, 4000).tolist()
    tracemalloc.start()
    start = time.process_time()
    result = wc.decode(ids, 32)
    cpu_s = time.process_time() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert result.detection.num_scored_tokens > 3900
    print(f"first decode of 4000 tokens: {cpu_s:.2f} s CPU, peak {peak / 1e6:.0f} MB")
    assert peak < 400e6  # was 8.4 GB
