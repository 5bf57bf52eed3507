"""The agreement gate: a text is called watermarked only when its tokens agree within cells.

**Why** (issue #45, SECURITY.md "Forgery and framing"). A stealing attacker who cannot see
payloads learns (context, token) counts averaged over them. At a context it then favours
the tokens that won tournaments under *either* bit: tokens whose g-values are extreme,
each far from chance, but pointing to different bits within one cell. Every test of the
verdict is two-sided per cell or takes the best of many entries, so such a spread
(over-dispersion) counts as evidence: 5 of 40 stolen spoofs crossed the verdict at
2·10⁵ answer tokens. Genuine text differs in one way a spoof without the key cannot
copy: every token of a cell leans towards the cell's one bit.

**The statistic.** Per cell (position, group) let ``d_t = sum_l W_{t,l} (2 g_{t,l} - 1)``
be token t's signed evidence (the weights of the test: model-assisted or layer
weights). The within-cell agreement is

    U = sum_cells sum_{t < u} d_t d_u = sum_cells (S_c^2 - sum_t d_t^2) / 2,

``S_c`` the cell's sum. If the signs are fair coins given the magnitudes ``|d_t|`` (a
text without the key's watermark, *and* a spoof whose tokens point to random bits),
``U`` has mean 0 and variance ``V = sum_cells sum_{t<u} d_t^2 d_u^2``; genuine text has
``U`` of the order of the magnitudes themselves. ``z = U / sqrt(V)``.

**The gate** (:func:`gate_log_p`). A test's p below the verdict's level stands only
where ``z >= AGREEMENT_Z_MIN``; otherwise it is raised to the level (``1e-6``), so the
verdict is "inconclusive" and no entry is named. The gate only ever raises a p-value, and
only below the verdict's level: every test stays valid (exact or conservative) under H0,
and the calibration at 1e-2 .. 1e-4 is untouched. The line was chosen on genuine answers
only (no spoof was looked at): :data:`AGREEMENT_SOURCE`.

Each test is gated in its own cells: the message-free test in the S slots, a test at a
payload length in that length's positions (where a genuine text's tokens share a bit, so
the agreement there is larger). ``worldcup-v1`` keys and the ablation variants keep their
statistics ungated.

**The sign gate on naming an entry** (:func:`sign_gated`). The registry test also knows
the entry's bits, so it can ask the agreement question exactly: given every (token,
group) unit's magnitude, is the text's agreement with *this entry* beyond what fair
signs give (:func:`worldcup_core.detector_model.sign_upper_log_sf`)? That p is valid
under H0 and under any text whose units point at random bits however extreme they are,
such as a payload-free spoof at any budget. A registry test below the verdict's level
stands only where that p, Bonferroni-corrected for the registry's size, is at most
:data:`SIGN_GATE_LEVEL`: by the union bound over the entries, such a text then names
an entry with probability at most 1 %, whatever its strength. (As the test itself it
would cost too much: the magnitudes hold most of a genuine text's evidence;
``python -m worldcup_eval.entry_sign_study``.)
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
import numpy.typing as npt

from worldcup_core.verdict import VERDICT_WATERMARKED_BELOW

F64 = npt.NDArray[np.float64]

AGREEMENT_Z_MIN: Final = 2.0
AGREEMENT_SOURCE: Final = (
    "258 genuine chat answers of the embedded model (temperature 0.7, 128 new tokens, the "
    "service default, per-request registry payloads, about 2 000 registry entries; "
    "python -m worldcup_eval.agreement_study): at 2.0 the gate took the verdict from 0 of "
    "the 201 the model-assisted verdict called watermarked and 1 of the 166 model-free; "
    "at 2.5 from 14 and 5. No spoof was looked at to choose it"
)
GATED_LOG_P: Final = math.log(VERDICT_WATERMARKED_BELOW)


SIGN_GATE_LEVEL: Final = 1e-2
SIGN_GATE_SOURCE: Final = (
    "176 genuine chat answers of the embedded model (temperature 0.7, 128 new tokens, per-"
    "request registry payloads; python -m worldcup_eval.entry_sign_study): of the issued "
    "entries the model-assisted registry test keeps below 1e-6, the gate at 1e-2 took 0 of "
    "137 at 2 112 entries and 1 of 116 at 10^5 (at 1e-4: 8 and 11; at 5e-2: 0 and 0); cut to "
    "64 tokens, 0 of 59 and 3 of 37. No spoof was looked at to choose it"
)


def sign_gated(log_p: float, sign_log_p: float, registry_size: int) -> float:
    """A registry test's uncorrected ``log_p`` with the sign gate: raised to the verdict's
    level where it is below it and the sign-conditional p of the same entry, times
    ``registry_size``, is above :data:`SIGN_GATE_LEVEL`."""
    corrected = sign_log_p + math.log(max(registry_size, 1))
    if log_p < GATED_LOG_P and corrected > math.log(SIGN_GATE_LEVEL):
        return GATED_LOG_P
    return log_p


def agreement_z(cell_sums: F64, dsq: F64, dquad: F64) -> F64:
    """Per text, ``z = U / sqrt(V)`` from its cells: ``cell_sums`` (texts, cells, ...) the
    cells' sums of ``d_t``, ``dsq`` and ``dquad`` their sums of ``d_t^2`` and ``d_t^4``
    (same shape). 0 where no cell holds two tokens with evidence."""
    n = cell_sums.shape[0]
    flat = (n, -1)
    u = ((cell_sums**2 - dsq) / 2.0).reshape(flat).sum(axis=1)
    v = ((dsq**2 - dquad) / 2.0).reshape(flat).sum(axis=1)
    out = np.zeros(n)
    live = v > 0
    out[live] = u[live] / np.sqrt(v[live])
    return out


def pooled_z(cell_sums: F64, dsq: F64, dquad: F64) -> float:
    """One ``z`` over every cell of every text (a collection read together)."""
    return float(agreement_z(cell_sums.reshape(1, -1), dsq.reshape(1, -1), dquad.reshape(1, -1))[0])


def gate_log_p(log_p: F64, z: F64) -> F64:
    """``log_p`` with every value below the verdict's level raised to it where the
    agreement ``z`` is below :data:`AGREEMENT_Z_MIN` (see the module docstring)."""
    lp = np.asarray(log_p, dtype=np.float64)
    out: F64 = np.where((lp < GATED_LOG_P) & (np.asarray(z) < AGREEMENT_Z_MIN), GATED_LOG_P, lp)
    return out


def gated(log_p: float, z: float) -> float:
    """:func:`gate_log_p` of one value."""
    return float(gate_log_p(np.array([log_p]), np.array([z]))[0])
