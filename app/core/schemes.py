"""A stored key version's :class:`~worldcup_core.WorldCup`, built in one place.

The service (:mod:`app.services.tenants`) and the offline scan
(:mod:`worldcup_scan.keys`) both turn a key record's parameters and its unwrapped
secret into a scheme; they do it here, so a new parameter is added once.
"""

from __future__ import annotations

from typing import Protocol

from worldcup_core import WatermarkConfig, WatermarkKey, WorldCup


class KeyShape(Protocol):
    """The parameters a key version was issued under (a ``KeyRecord``, a ``KeySpec``)."""

    @property
    def groups(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def alpha(self) -> float: ...
    @property
    def context_width(self) -> int: ...
    @property
    def scheme(self) -> str: ...


def watermark_config(shape: KeyShape) -> WatermarkConfig:
    return WatermarkConfig(
        groups=shape.groups,
        layers=shape.layers,
        alpha=shape.alpha,
        context_width=shape.context_width,
        version=shape.scheme,
    )


def watermark_scheme(secret: bytes, shape: KeyShape) -> WorldCup:
    """The scheme of one key version: its secret under the parameters it was issued with."""
    return WorldCup(WatermarkKey(secret), watermark_config(shape))
