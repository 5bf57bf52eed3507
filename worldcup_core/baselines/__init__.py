"""Baselines run side by side with WorldCup through the same protocols."""

from worldcup_core.baselines.mpac import (
    MPAC,
    MPAC_VERSION,
    MPACConfig,
    MPACSequence,
    extract_mpac_evidence,
    mpac_z_score,
)

__all__ = [
    "MPAC",
    "MPAC_VERSION",
    "MPACConfig",
    "MPACSequence",
    "extract_mpac_evidence",
    "mpac_z_score",
]
