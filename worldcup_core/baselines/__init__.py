"""Baselines run side by side with WorldCup through the same protocols.

``BASELINES`` maps a scheme name to its constructor from a watermark key: the
evaluation and the CLI select a baseline by that name and nothing else, so a new
baseline is one module plus one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from worldcup_core.baselines import bimark, mpac, segmark, stealthink, xmark
from worldcup_core.baselines.bimark import (
    BIMARK_VERSION,
    BiMark,
    BiMarkConfig,
    BiMarkSequence,
    bimark_reweight,
    extract_bimark_evidence,
)
from worldcup_core.baselines.mpac import (
    MPAC,
    MPAC_VERSION,
    MPACConfig,
    MPACSequence,
    extract_mpac_evidence,
    mpac_z_score,
)
from worldcup_core.baselines.segmark import (
    SEGMARK_VERSION,
    SegMark,
    SegMarkConfig,
    SegMarkSequence,
    extract_segmark_evidence,
    rs_code_for,
)
from worldcup_core.baselines.stealthink import (
    STEALTHINK_VERSION,
    StealthInk,
    StealthInkConfig,
    StealthInkSequence,
    extract_stealthink_evidence,
    stealthink_reweight,
)
from worldcup_core.baselines.xmark import (
    XMARK_VERSION,
    XMark,
    XMarkConfig,
    XMarkSequence,
    extract_xmark_evidence,
)
from worldcup_core.prf import WatermarkKey

if TYPE_CHECKING:
    from worldcup_core.scheme import WatermarkScheme

BASELINES: dict[str, Callable[[WatermarkKey], WatermarkScheme]] = {
    "mpac": MPAC,
    "bimark": BiMark,
    "segmark": SegMark,
    "stealthink": StealthInk,
    "xmark": XMark,
}

# One line per baseline: its settings as the evaluation report states them.
BASELINE_SETTINGS: dict[str, str] = {
    "mpac": mpac.SETTINGS,
    "bimark": bimark.SETTINGS,
    "segmark": segmark.SETTINGS,
    "stealthink": stealthink.SETTINGS,
    "xmark": xmark.SETTINGS,
}


def describe_settings(name: str) -> str:
    """The settings line of baseline ``name`` (each module's ``SETTINGS``)."""
    try:
        return BASELINE_SETTINGS[name]
    except KeyError:
        known = ", ".join(sorted(BASELINE_SETTINGS))
        raise ValueError(f"unknown baseline {name!r}; known: {known}") from None


# The strength knob of each baseline that has one (an equal-strength comparison turns
# it): the logit bias delta of the green-list schemes, BiMark's base scaling factor.
STRENGTH: dict[str, str] = {
    "mpac": "delta",
    "segmark": "delta",
    "xmark": "delta",
    "bimark": "base_delta",
}


def build_baseline(name: str, key: WatermarkKey, strength: float | None = None) -> WatermarkScheme:
    """The baseline called ``name`` under ``key``, at its paper setting or with its
    ``STRENGTH`` parameter set to ``strength``; ``ValueError`` names the known ones."""
    if name not in BASELINES:
        known = ", ".join(sorted(BASELINES))
        raise ValueError(f"unknown baseline {name!r}; known: {known}")
    if strength is None:
        return BASELINES[name](key)
    configs: dict[str, Callable[[float], object]] = {
        "mpac": lambda s: MPAC(key, MPACConfig(delta=s)),
        "segmark": lambda s: SegMark(key, SegMarkConfig(delta=s)),
        "xmark": lambda s: XMark(key, XMarkConfig(delta=s)),
        "bimark": lambda s: BiMark(key, BiMarkConfig(base_delta=s)),
    }
    if name not in configs:
        raise ValueError(f"baseline {name!r} has no strength setting")
    return cast("WatermarkScheme", configs[name](strength))


__all__ = [
    "BASELINES",
    "BASELINE_SETTINGS",
    "BIMARK_VERSION",
    "STRENGTH",
    "BiMark",
    "BiMarkConfig",
    "BiMarkSequence",
    "MPAC",
    "MPAC_VERSION",
    "MPACConfig",
    "MPACSequence",
    "SEGMARK_VERSION",
    "STEALTHINK_VERSION",
    "SegMark",
    "SegMarkConfig",
    "SegMarkSequence",
    "StealthInk",
    "StealthInkConfig",
    "StealthInkSequence",
    "XMARK_VERSION",
    "XMark",
    "XMarkConfig",
    "XMarkSequence",
    "bimark_reweight",
    "build_baseline",
    "describe_settings",
    "extract_bimark_evidence",
    "extract_mpac_evidence",
    "extract_segmark_evidence",
    "extract_stealthink_evidence",
    "extract_xmark_evidence",
    "mpac_z_score",
    "rs_code_for",
    "stealthink_reweight",
]
