"""What the sign-conditional registry test costs genuine answers (issue #45).

The registry test names an entry when the text's weighted agreement with the entry's
bits is too high for text written without the key (exact under H0,
:func:`worldcup_core.detector_weighted.entry_log_p`). A spoof written from payload-free
stolen counts is not such text: its tokens are extreme in either direction, so its
agreement with any entry is over-dispersed, and the exact test over-rejects random
entries (``tests/test_consistency.py``). The sign-conditional test
(:func:`sign_upper_log_sf` over :func:`entry_units`) asks the same question given every
unit's magnitude: valid under H0 and under any text whose units point at random bits,
however extreme. Taking the larger of the two p-values keeps both guarantees; this
study measures what that costs the issued entry of genuine answers.

``python -m worldcup_eval.entry_sign_study --genuine DIR [--sizes 2112 100000] [--out FILE]``
reads ``DIR/answers.jsonl`` (``python -m worldcup_eval.agreement_study --genuine DIR
--collect N`` writes it: chat answers under the forgery tenant's key, temperature 0.7,
128 new tokens, each with its registry payload ``bits``), weighs every answer by the
embedded model (as a generator replica does) and prints, per registry size, how many
issued entries each form of the test keeps below 1e-6 after the Bonferroni correction.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from worldcup_core.config import WatermarkConfig
from worldcup_core.detector_model import (
    level_weights,
    mixed_upper_log_sf,
    token_levels,
)
from worldcup_core.prf import (
    PRFV2,
    SCHEME_V2,
    ScoredTokensV2,
    WatermarkKey,
    gvalue_words,
    v2_group_bits,
    v2_gwords,
    v2_positions,
)
from worldcup_core.scoring import symbol_index
from worldcup_eval.forgery import ForgeryConfig, Tenant, clopper_pearson, read_jsonl

LEVEL = math.log(1e-6)
I64 = npt.NDArray[np.int64]


def entry_units(
    key: WatermarkKey,
    config: WatermarkConfig,
    token_ids: Sequence[int],
    bits: str,
    token_weights: npt.NDArray[np.floating] | None = None,
) -> I64:
    """Each scored (token, group) unit's signed agreement with the entry ``bits`` (pad
    bits 0): ``a = sum_l W_l (2 g_l - 1)`` with ``g_l`` read as agreeing with the unit's
    bit, so ``a`` is positive where the unit leans towards the entry. ``W`` are the
    token's level weights (``token_weights`` None: today's layer weights, level
    ``MODEL_FREE_LEVEL``); units of weight 0 are dropped. The registry test's
    agreement is ``(sum a + sum W) / 2`` over the same units."""
    k, m = config.groups, config.layers
    symbols = config.symbols_for(len(bits))
    ids = np.asarray(token_ids, dtype=np.int64)
    items = ScoredTokensV2.of(ids, config.context_width)
    if len(items) == 0:
        return np.zeros(0, dtype=np.int64)
    weights = np.full(len(ids), np.nan) if token_weights is None else np.asarray(token_weights)
    levels = token_levels(weights[items.indices])
    prf = PRFV2.of(key)
    g = np.asarray(
        v2_group_bits(
            v2_gwords(prf.gvalue_key, items.context, items.tokens, gvalue_words(k, m)), k, m
        ),
        dtype=np.int64,
    )  # (n, k, m): 1 favours bit 0
    w = level_weights(m)[levels]  # (n, m)
    d = 2 * np.einsum("nkm,nm->nk", g, w) - w.sum(axis=1)[:, None]  # (n, k): > 0 leans to 0
    sym = symbol_index(v2_positions(prf.position_key, items.context), symbols, SCHEME_V2)
    padded = bits + "0" * (symbols * k - len(bits))
    entry = (np.frombuffer(padded.encode("ascii"), dtype=np.uint8) - ord("0")).reshape(symbols, k)
    signed: I64 = np.where(entry[sym] == 0, d, -d).ravel()
    live: I64 = signed[w.sum(axis=1).repeat(k) > 0]
    return live


def sign_upper_log_sf(units: npt.NDArray[np.integer]) -> float:
    """``log P(sum a >= observed)`` for the units' signed agreements ``a`` when each
    unit's sign is a fair coin given its magnitude (exact; 0 for no units).

    This is the registry test *conditional on the magnitudes*: valid under H0 (flipping
    all of a unit's g-bits maps ``a`` to ``-a`` and leaves the law of the g-bits
    unchanged) and under any text whose units point at random bits however extreme
    they are, such as a spoof written from payload-free stolen counts
    (:mod:`worldcup_core.consistency`). The sum of ``|a|`` over the agreeing units is a
    sum of independent two-point laws ``{0, |a|}``, whose upper tail
    :func:`~worldcup_core.detector_model.mixed_upper_log_sf` gives at any depth."""
    a = np.asarray(units, dtype=np.int64)
    mags = np.abs(a[a != 0])
    if mags.size == 0:
        return 0.0
    score = int((int(a.sum()) + int(mags.sum())) // 2)  # sum of |a| over agreeing units
    values, counts = np.unique(mags, return_counts=True)
    laws = []
    for v in values.tolist():
        law = np.zeros(v + 1)
        law[0] = law[-1] = 0.5
        laws.append(law)
    return mixed_upper_log_sf(laws, counts.tolist(), score)


def score(key: Any, config: Any, tokens: list[int], bits: str, weights: Any) -> dict[str, float]:
    """log p of the entry ``bits``: exact and sign-conditional, model-weighted and not."""
    from worldcup_core.detector_weighted import entry_log_p

    out: dict[str, float] = {}
    for name, w in (("model", weights), ("model_free", None)):
        out[f"{name}/exact"] = entry_log_p(key, config, tokens, bits, w)
        out[f"{name}/sign"] = sign_upper_log_sf(entry_units(key, config, tokens, bits, w))
    return out


def kept(rows: list[dict[str, float]], size: int) -> dict[str, int]:
    """Per statistic, the entries below 1e-6 after the correction for ``size`` entries."""
    shift = math.log(size)
    out: dict[str, int] = {}
    for name in ("model", "model_free"):
        exact = [r[f"{name}/exact"] + shift < LEVEL for r in rows]
        both = [max(r[f"{name}/exact"], r[f"{name}/sign"]) + shift < LEVEL for r in rows]
        out[f"{name}/exact"] = sum(exact)
        out[f"{name}/exact and sign"] = sum(both)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m worldcup_eval.entry_sign_study", description=__doc__
    )
    ap.add_argument("--genuine", type=Path, required=True, help="a directory of genuine answers")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2112, 100_000])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not (args.genuine / "answers.jsonl").is_file():
        ap.error(f"--genuine {args.genuine}: no answers.jsonl")
    if any(s < 1 for s in args.sizes):
        ap.error("--sizes must be positive")
    import torch

    from worldcup_core.model_weights import model_token_weights, weights_model
    from worldcup_core.models import load_model

    torch.set_num_threads(args.threads)
    answers = read_jsonl(args.genuine / "answers.jsonl")
    config = ForgeryConfig("per-request", 1)
    scheme = Tenant(config).worldcup()
    lm = load_model(None)
    tokens = [list(a["tokens"]) for a in answers]
    weights = model_token_weights(weights_model(lm.model), tokens, pad_token_id=lm.pad_token_id)
    rows = [
        score(scheme.key, scheme.config, t, str(a["bits"]), w)
        for a, t, w in zip(answers, tokens, weights, strict=True)
    ]
    n = len(rows)
    out = sys.stdout
    out.write(f"{n} genuine answers; an issued entry kept below 1e-6 after x registry size\n")
    out.write(
        "| registry | statistic | exact test | exact and sign-conditional |\n|---|---|---|---|\n"
    )
    table: dict[str, Any] = {}
    for size in args.sizes:
        k = kept(rows, size)
        table[str(size)] = k
        for name in ("model", "model_free"):
            cells = []
            for form in ("exact", "exact and sign"):
                hits = k[f"{name}/{form}"]
                lo, hi = clopper_pearson(hits, n)
                cells.append(f"{hits}/{n} [{100 * lo:.1f}, {100 * hi:.1f}] %")
            out.write(f"| {size} | {name} | {cells[0]} | {cells[1]} |\n")
    med = {k: sorted(r[k] for r in rows)[n // 2] / math.log(10) for k in rows[0]} if rows else {}
    out.write("median log10 p: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()) + "\n")
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "kept": table, "answers": n}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
