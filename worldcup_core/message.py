"""Message codec: a b-bit payload as ceil(b/k) symbols of 2^k values.

Bit ``p*k + j`` of the payload is carried by group ``j`` at position ``p``, so
group 0 is the most significant bit of a symbol, as in the paper's
``m_p = sum_j 2^{k-j} 1(s_j < s_bar_j)``. When k does not divide b the last
symbol is padded with zero bits; the decoder knows they are zero and drops
them from what it reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from worldcup_core.config import MAX_PAYLOAD_BITS


@dataclass(frozen=True)
class Payload:
    """A validated bit string.

    >>> Payload.from_bits("0110").to_symbols(2)
    (1, 2)
    >>> Payload.from_int(6, num_bits=4).bits
    '0110'
    """

    bits: str

    def __post_init__(self) -> None:
        if not 1 <= len(self.bits) <= MAX_PAYLOAD_BITS:
            raise ValueError(f"a payload has 1..{MAX_PAYLOAD_BITS} bits, got {len(self.bits)}")
        if set(self.bits) - {"0", "1"}:
            raise ValueError("payload bits must be a string of 0 and 1")

    @classmethod
    def from_bits(cls, bits: str) -> Payload:
        return cls(bits.strip())

    @classmethod
    def from_int(cls, value: int, num_bits: int) -> Payload:
        if not 1 <= num_bits <= MAX_PAYLOAD_BITS:
            raise ValueError(f"num_bits must be in 1..{MAX_PAYLOAD_BITS}, got {num_bits}")
        if not 0 <= value < 2**num_bits:
            raise ValueError(f"value {value} does not fit in {num_bits} bits")
        return cls(format(value, f"0{num_bits}b"))

    @classmethod
    def from_hex(cls, text: str, num_bits: int | None = None) -> Payload:
        cleaned = text.strip().lower().removeprefix("0x")
        if not cleaned or set(cleaned) - set("0123456789abcdef"):
            raise ValueError("hex payload must be hexadecimal digits")
        value = int(cleaned, 16)
        return cls.from_int(value, num_bits if num_bits is not None else 4 * len(cleaned))

    @classmethod
    def random(cls, num_bits: int, rng: np.random.Generator) -> Payload:
        return cls("".join(map(str, rng.integers(0, 2, size=num_bits))))

    @property
    def num_bits(self) -> int:
        return len(self.bits)

    def to_int(self) -> int:
        return int(self.bits, 2)

    def bit_array(self, groups: int) -> npt.NDArray[np.uint8]:
        """Bits padded to (symbols, groups)."""
        out: npt.NDArray[np.uint8] = bits_matrix([self.bits], groups)[0]
        return out

    def to_symbols(self, groups: int) -> tuple[int, ...]:
        weights = 1 << np.arange(groups - 1, -1, -1)
        return tuple(int(v) for v in self.bit_array(groups) @ weights)


def bits_matrix(messages: list[str], groups: int) -> npt.NDArray[np.uint8]:
    """Equal-length bit strings as an array (n, symbols, groups), zero-padded."""
    if not messages:
        return np.zeros((0, 0, groups), dtype=np.uint8)
    width = len(messages[0])
    if any(len(m) != width for m in messages):
        raise ValueError("all candidate messages must have the same number of bits")
    symbols = -(-width // groups)
    flat = np.zeros((len(messages), symbols * groups), dtype=np.uint8)
    raw = np.frombuffer("".join(messages).encode("ascii"), dtype=np.uint8).reshape(-1, width)
    flat[:, :width] = raw - ord("0")
    if flat.max(initial=0) > 1:
        raise ValueError("candidate messages must be strings of 0 and 1")
    return flat.reshape(len(messages), symbols, groups)
