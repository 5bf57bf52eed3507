"""A candidate spoof-artifact test, measured (issue #45): sign consistency within cells.

Why it was a candidate. A stealing learner that has no payload labels (the service as
it is: payload bits only to analysts) learns counts averaged over payloads. At a
context it then favours tokens whose g-values are extreme in either family, and a spoof
built of them has cells whose tokens are each far from chance but point to different
bits. The message-free test, two-sided per (position, group) cell, counts that spread as
evidence: 5/40 such spoofs crossed the production verdict at 2·10⁵ tokens
(SECURITY.md). Genuine text instead has every token of a cell lean towards the cell's
one bit.

The test. Per token t of a cell, its signed evidence ``d_t = sum_l W_{t,l} (2 g_{t,l}
- 1)`` (the model-weighted layer weights of :mod:`worldcup_core.detector_model`). Under
H0 the g-bits are fair coins given the weights, so ``d_t`` is symmetric: given the
magnitudes ``|d_t|`` its sign is a fair coin, independent across tokens. The cell's
sum ``T = sum_t d_t`` then has, conditionally on the magnitudes, the law of a sum of
two-point laws {-|d_t|, +|d_t|}: its exact randomised two-sided p is uniform under H0,
whatever the magnitudes. Combined across cells with Lancaster's ν (as the model
statistic), the text's p stays exact. Magnitudes alone (the spoof's artifact) give no
evidence; only agreement within cells does.

``python -m worldcup_eval.sign_study --answers FILE [--spoofs FILE] [--count N]``
scores genuine answers (and spoofs) of a forgery run (:mod:`worldcup_eval.forgery`,
the tenant's key of its seed), by the model statistic and by this test, under the
tenant's key and, for the null, under another key.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from worldcup_core.config import WatermarkConfig
from worldcup_core.detector import slot_count
from worldcup_core.detector_model import (
    INFORMATIVENESS_POWER,
    chi2_isf_log,
    chi2_log_sf,
    lancaster_df,
    level_weights,
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

F64 = npt.NDArray[np.float64]
_FLOOR = math.log(1e-300)


def _signed_law(magnitudes: Sequence[int]) -> F64:
    """The law over 0..sum(a) of ``sum_t a_t [s_t = +1]``, fair signs."""
    law = np.array([1.0])
    for a in magnitudes:
        step = np.zeros(a + 1)
        step[0] = step[-1] = 0.5
        law = np.convolve(law, step)
    return law


def cell_sign_p(signed: Sequence[int], uniform: float) -> float:
    """The randomised two-sided p of a cell's signed token evidence, given its
    magnitudes: exactly Uniform(0, 1) when the signs are fair coins."""
    a = [abs(int(d)) for d in signed if d != 0]
    if not a:
        return 1.0
    total = sum(a)
    law = _signed_law(a)
    plus = (sum(int(d) for d in signed) + total) // 2  # the positive part of the sum
    dev = abs(2 * plus - total)
    devs = np.abs(2 * np.arange(total + 1) - total)
    strict = float(law[devs > dev].sum())
    equal = float(law[devs == dev].sum())
    return min(1.0, strict + uniform * equal)


def sign_log_p(
    key: WatermarkKey,
    config: WatermarkConfig,
    texts: Sequence[Sequence[int]],
    token_weights: Sequence[npt.NDArray[np.floating]],
    rng: np.random.Generator,
) -> F64:
    """log p of the sign-consistency test, message-free (the S slots), per text."""
    k, m = config.groups, config.layers
    symbols = slot_count(config)
    prf = PRFV2.of(key)
    table = level_weights(m)
    out = np.zeros(len(texts))
    for i, (text, weights) in enumerate(zip(texts, token_weights, strict=True)):
        ids = np.asarray(text, dtype=np.int64)
        items = ScoredTokensV2.of(ids, config.context_width)
        if len(items) == 0:
            continue
        levels = token_levels(np.asarray(weights)[items.indices], INFORMATIVENESS_POWER)
        context = list(items.context)
        words = v2_gwords(prf.gvalue_key, context, items.tokens, gvalue_words(k, m))
        bits = np.asarray(v2_group_bits(words, k, m), dtype=np.int64)  # (n, k, m)
        w = table[levels]  # (n, m)
        signed = np.einsum("nkm,nm->nk", 2 * bits - 1, w)
        sym = symbol_index(v2_positions(prf.position_key, context), symbols, SCHEME_V2)
        mass = np.bincount(sym, weights=w.sum(axis=1), minlength=symbols)
        live = [b for b in range(symbols) if mass[b] > 0]
        logs: list[float] = []
        dfs: list[int] = []
        for b, nu in zip(live, lancaster_df(mass[live]).tolist(), strict=True):
            for j in range(k):
                cell = signed[sym == b, j]
                if not np.any(cell):
                    continue
                p = cell_sign_p(cell.tolist(), float(rng.random()))
                logs.append(max(math.log(max(p, 1e-300)), _FLOOR))
                dfs.append(int(nu))
        if logs:
            stat = float(np.sum(chi2_isf_log(np.asarray(logs), np.asarray(dfs))))
            out[i] = float(chi2_log_sf(np.asarray([stat]), np.asarray([sum(dfs)]))[0])
    return out


def _rates(log10: F64) -> str:
    return (
        f"median log10 p {np.median(log10):7.2f}   p<1e-3 {np.mean(log10 < -3):5.0%}   "
        f"p<1e-6 {np.mean(log10 < -6):5.0%}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worldcup_eval.sign_study", description=__doc__)
    ap.add_argument("--answers", type=Path, required=True, help="a forgery run's answers.jsonl")
    ap.add_argument("--spoofs", type=Path, default=None, help="its spoofs-BUDGET.jsonl")
    ap.add_argument("--count", type=int, default=100, help="genuine answers scored")
    ap.add_argument("--tokens", type=int, default=128, help="each text's first N tokens")
    ap.add_argument("--seed", type=int, default=0, help="the forgery run's --seed")
    args = ap.parse_args(argv)
    import torch

    from worldcup_core.detector_model import model_log_p_many
    from worldcup_core.model_weights import weights_model, windowed_token_weights
    from worldcup_core.models import load_model
    from worldcup_eval.forgery import ForgeryConfig, Tenant, read_jsonl

    tenant = Tenant(ForgeryConfig("per-request", 1, seed=args.seed)).worldcup()
    other = Tenant(ForgeryConfig("per-request", 1, seed=args.seed + 1)).worldcup()
    lm = load_model(None)
    weigher = weights_model(lm.model)
    rng = np.random.default_rng(args.seed)
    sets: list[tuple[str, list[list[int]]]] = [
        ("genuine", [a["tokens"][: args.tokens] for a in read_jsonl(args.answers)[: args.count]])
    ]
    if args.spoofs is not None:
        by: dict[str, list[list[int]]] = {}
        for row in read_jsonl(args.spoofs):
            label = f"spoof {row['key'].rsplit('/', 2)[0]}"
            by.setdefault(label, []).append(row["tokens"][: args.tokens])
        sets += sorted(by.items())
    for name, texts in sets:
        with torch.inference_mode():
            weights = windowed_token_weights(weigher, texts, pad_token_id=lm.pad_token_id)
        for label, scheme in (("tenant key", tenant), ("another key", other)):
            full = model_log_p_many(scheme.key, scheme.config, texts, None, weights) / math.log(10)
            sign = sign_log_p(scheme.key, scheme.config, texts, weights, rng) / math.log(10)
            both = np.mean((full < -6) & (sign > -2))
            sys.stdout.write(
                f"{name} ({len(texts)}), {label}\n  model statistic: {_rates(full)}\n"
                f"  sign test:       {_rates(sign)}\n"
                f"  model p<1e-6 with sign p>1e-2: {both:.0%}\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
