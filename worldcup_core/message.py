"""Message codec: a b-bit payload as ceil(b/k) symbols of 2^k values.

Bit ``p*k + j`` of the payload is carried by group ``j`` at position ``p``, so
group 0 is the most significant bit of a symbol, as in the paper's
``m_p = sum_j 2^{k-j} 1(s_j < s_bar_j)``. When k does not divide b the last
symbol is padded with zero bits; the decoder knows they are zero and drops
them from what it reports.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from worldcup_core.config import MAX_PAYLOAD_BITS
from worldcup_core.prf import WatermarkKey

U64 = npt.NDArray[np.uint64]

TABLE_MAX_HALF = 16  # round functions tabulated up to this many bits per Feistel half
_TABLES: OrderedDict[tuple[bytes, int], npt.NDArray[np.uint32]] = OrderedDict()
_TABLES_MAX = 32  # 32 codecs' tables (1 MiB each at 32-bit payloads) per process
_TABLES_LOCK = threading.Lock()


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


class MessageIdCodec:
    """A keyed permutation between registry message ids and b-bit payloads.

        Sequential ids would make neighbouring payloads differ in a single bit, so a
        couple of bit errors would point at the wrong registry entry. Instead the
        payload is an 8-round Feistel permutation of the id over 2*ceil(b/2) bits
        (round function: keyed BLAKE2b on the subkey ``message-id``), cycle-walked
        into [0, 2^b): payloads look uniformly random, stay unique, and decode
        straight back to the id.

        >>> from worldcup_core.prf import WatermarkKey

    U64 = npt.NDArray[np.uint64]

    TABLE_MAX_HALF = 16  # round functions tabulated up to this many bits per Feistel half
    _TABLES: OrderedDict[tuple[bytes, int], npt.NDArray[np.uint32]] = OrderedDict()
    _TABLES_MAX = 32  # 32 codecs' tables (1 MiB each at 32-bit payloads) per process
    _TABLES_LOCK = threading.Lock()
        >>> codec = MessageIdCodec(WatermarkKey(bytes(32)), 16)
        >>> codec.message_id(codec.payload(42))
        42
    """

    ROUNDS = 8

    def __init__(self, key: WatermarkKey, num_bits: int) -> None:
        if not 1 <= num_bits <= MAX_PAYLOAD_BITS:
            raise ValueError(f"num_bits must be in 1..{MAX_PAYLOAD_BITS}, got {num_bits}")
        self.num_bits = num_bits
        self._half = (num_bits + 1) // 2
        self._mask = (1 << self._half) - 1
        self._hasher = hashlib.blake2b(key=key.subkey("message-id"), digest_size=8)
        # the table cache is keyed by a digest of the subkey, never the subkey itself
        self._table_id = hashlib.blake2b(key.subkey("message-id"), digest_size=16).digest()

    def __repr__(self) -> str:
        return f"MessageIdCodec(num_bits={self.num_bits})"

    @property
    def capacity(self) -> int:
        return 1 << self.num_bits

    def _round(self, i: int, x: int) -> int:
        h = self._hasher.copy()
        h.update(bytes([self.num_bits, i]) + x.to_bytes(8, "little"))
        return int.from_bytes(h.digest(), "little") & self._mask

    def _permute(self, value: int, inverse: bool) -> int:
        left, right = value >> self._half, value & self._mask
        rounds = range(self.ROUNDS - 1, -1, -1) if inverse else range(self.ROUNDS)
        for i in rounds:
            if inverse:
                left, right = right ^ self._round(i, left), left
            else:
                left, right = right, left ^ self._round(i, right)
        out: int = (left << self._half) | right
        return out

    def _walk(self, value: int, inverse: bool) -> int:
        out = self._permute(value, inverse)
        while out >= self.capacity:  # cycle-walking keeps it a permutation of [0, 2^b)
            out = self._permute(out, inverse)
        return out

    def payload(self, message_id: int) -> Payload:
        if not 0 <= message_id < self.capacity:
            raise ValueError(f"message id {message_id} does not fit in {self.num_bits} bits")
        return Payload.from_int(self._walk(message_id, inverse=False), self.num_bits)

    def message_id(self, payload: Payload) -> int:
        if payload.num_bits != self.num_bits:
            raise ValueError(f"expected a {self.num_bits}-bit payload, got {payload.num_bits}")
        return self._walk(payload.to_int(), inverse=True)

    # -- many ids at once -------------------------------------------------------
    def _round_table(self) -> npt.NDArray[np.uint32] | None:
        """Every round function value, (ROUNDS, 2^half), when the half is small enough
        to tabulate (payloads of up to 32 bits): built once per key and payload length
        (8 x 65 536 BLAKE2b calls at 32 bits, ~0.3 s), then each permutation is array
        look-ups. None for longer payloads (their halves are too wide to tabulate)."""
        if self._half > TABLE_MAX_HALF:
            return None
        cache_key = (self._table_id, self.num_bits)
        with _TABLES_LOCK:
            table = _TABLES.get(cache_key)
            if table is not None:
                _TABLES.move_to_end(cache_key)
                return table
        size = 1 << self._half
        table = np.empty((self.ROUNDS, size), dtype=np.uint32)
        for i in range(self.ROUNDS):
            table[i] = [self._round(i, x) for x in range(size)]
        with _TABLES_LOCK:
            _TABLES[cache_key] = table
            while len(_TABLES) > _TABLES_MAX:
                _TABLES.popitem(last=False)
        return table

    def _permute_many(self, values: U64, inverse: bool, table: npt.NDArray[np.uint32]) -> U64:
        half, mask = np.uint64(self._half), np.uint64(self._mask)
        left, right = values >> half, values & mask
        if inverse:
            for i in range(self.ROUNDS - 1, -1, -1):
                left, right = right ^ table[i][left], left
        else:
            for i in range(self.ROUNDS):
                left, right = right, left ^ table[i][right]
        out: U64 = (left << half) | right
        return out

    def _walk_many(self, values: U64, inverse: bool) -> U64:
        table = self._round_table()
        if table is None:
            return np.array([self._walk(int(v), inverse) for v in values.tolist()], dtype=np.uint64)
        out = self._permute_many(values, inverse, table)
        cap = np.uint64(self.capacity)
        todo = np.flatnonzero(out >= cap)
        while todo.size:  # cycle-walking, only for the values still outside [0, 2^b)
            out[todo] = self._permute_many(out[todo], inverse, table)
            todo = todo[out[todo] >= cap]
        return out

    def _checked(self, values: npt.ArrayLike, what: str) -> U64:
        arr = np.asarray(values)
        if arr.ndim != 1:
            raise ValueError(f"{what} must be a 1-d array")
        if arr.size and (arr.min() < 0 or int(arr.max()) >= self.capacity):
            raise ValueError(f"{what} must fit in {self.num_bits} bits")
        return arr.astype(np.uint64)

    def payload_ints(self, message_ids: npt.ArrayLike) -> U64:
        """The payloads of many ids as integers, equal to ``payload(i).to_int()`` each:
        array look-ups up to 32-bit payloads, the scalar rounds beyond."""
        return self._walk_many(self._checked(message_ids, "message ids"), inverse=False)

    def message_id_ints(self, payloads: npt.ArrayLike) -> U64:
        """The ids of many payloads given as integers, equal to ``message_id`` each."""
        return self._walk_many(self._checked(payloads, "payloads"), inverse=True)
