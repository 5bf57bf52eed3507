"""The layout of the batched ``worldcup-v2`` step's slot tables, shared by its three paths.

:class:`~worldcup_core.batched.BatchedWorldCup` keeps one row of device tensors
per slot; the tensor path (torch), the CPU loops (:mod:`worldcup_core._step_jit`,
numba) and the fused GPU kernel (:mod:`worldcup_core._step_triton`, Triton) all
read the same tables, so the column numbers and the variant codes are named
once, here, and nowhere compared as bare integers.

* ``config`` (C, :data:`CONFIG_COLUMNS`) int64, one column per :class:`Column`;
* ``keys`` (C, 3, 2) int64: the SipHash subkeys (position, g-value, alt), each
  ``(k0, k1)`` as int64 bit patterns (:data:`POSITION_KEY`, :data:`GVALUE_KEY`,
  :data:`ALT_KEY`);
* ``bits`` (C, :data:`MAX_SYMBOLS`, :data:`~worldcup_core.prf.MAX_GROUPS`) uint8:
  the payload's symbol bits;
* ``alpha`` (C,), ``history`` (C, T) int64 and ``length`` (C,) int64.

>>> VariantCode.of(Variant.RANDOM_SECOND)
<VariantCode.RANDOM_SECOND: 3>
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final

from worldcup_core.config import MAX_PAYLOAD_BITS, Variant


class VariantCode(IntEnum):
    """Each :class:`~worldcup_core.config.Variant` as the integer the kernels branch on."""

    WORLDCUP = 0
    NO_ENTROPY = 1
    NO_SUBTRACTION = 2
    RANDOM_SECOND = 3
    NONDISTORTIONARY = 4

    @classmethod
    def of(cls, variant: Variant) -> VariantCode:
        return _CODES[variant]


_CODES: Final = {Variant(v.name.lower().replace("_", "-")): v for v in VariantCode}


class Column(IntEnum):
    """The columns of the ``config`` table."""

    GROUPS = 0  # k
    LAYERS = 1  # m
    WIDTH = 2  # c, the context width
    SYMBOLS = 3  # B, the payload's symbol count
    VARIANT = 4  # a VariantCode
    LIVE = 5  # 1 while a row occupies the slot


CONFIG_COLUMNS: Final = len(Column)
MAX_SYMBOLS: Final = MAX_PAYLOAD_BITS  # k = 1: one symbol per bit
POSITION_KEY: Final = 0
GVALUE_KEY: Final = 1
ALT_KEY: Final = 2
