"""API key hashing, constant-time comparison and AES-GCM wrapping of watermark keys."""

from __future__ import annotations

import os
import pickle

import pytest

from app.core.security import (
    KeyUnwrapError,
    KeyWrapper,
    hash_api_key,
    new_api_key,
    tokens_equal,
    verify_api_key,
)

MASTER = bytes(range(32))
SECRET_KEY = os.urandom(32)


def test_wrap_unwrap_round_trip() -> None:
    w = KeyWrapper(MASTER)
    blob = w.wrap("t_a", 1, SECRET_KEY)
    assert len(blob) == 12 + len(SECRET_KEY) + 16
    assert SECRET_KEY not in blob
    assert w.unwrap("t_a", 1, blob) == SECRET_KEY


def test_nonces_differ() -> None:
    w = KeyWrapper(MASTER)
    blobs = {w.wrap("t_a", 1, SECRET_KEY) for _ in range(50)}
    assert len(blobs) == 50
    assert len({b[:12] for b in blobs}) == 50


@pytest.mark.parametrize(("tenant", "version"), [("t_b", 1), ("t_a", 2), ("t_a:1", 1), ("", 1)])
def test_blob_bound_to_tenant_and_version(tenant: str, version: int) -> None:
    w = KeyWrapper(MASTER)
    blob = w.wrap("t_a", 1, SECRET_KEY)
    with pytest.raises(KeyUnwrapError) as info:
        w.unwrap(tenant, version, blob)
    assert SECRET_KEY.hex() not in str(info.value)
    assert info.value.__cause__ is None


@pytest.mark.parametrize("position", [0, 11, 12, 30, -1])
def test_tampering_is_detected(position: int) -> None:
    w = KeyWrapper(MASTER)
    blob = bytearray(w.wrap("t_a", 1, SECRET_KEY))
    blob[position] ^= 0x01
    with pytest.raises(KeyUnwrapError):
        w.unwrap("t_a", 1, bytes(blob))


def test_truncated_blob_and_wrong_master_key() -> None:
    w = KeyWrapper(MASTER)
    blob = w.wrap("t_a", 1, SECRET_KEY)
    with pytest.raises(KeyUnwrapError):
        w.unwrap("t_a", 1, blob[:20])
    with pytest.raises(KeyUnwrapError):
        KeyWrapper(os.urandom(32)).unwrap("t_a", 1, blob)


def test_master_key_length_is_checked() -> None:
    for bad in (b"", b"x" * 16, b"x" * 33):
        with pytest.raises(ValueError):
            KeyWrapper(bad)


def test_repr_and_pickle_hide_master_key() -> None:
    w = KeyWrapper(MASTER)
    text = repr(w) + str(w)
    assert MASTER.hex() not in text
    assert repr(MASTER) not in text
    assert "redacted" in text
    with pytest.raises(TypeError):
        pickle.dumps(w)


def test_rewrap_with_new_master_key() -> None:
    old, new = KeyWrapper(MASTER), KeyWrapper(os.urandom(32))
    blob = old.wrap("t_a", 3, SECRET_KEY)
    rewrapped = old.rewrap(new, "t_a", 3, blob)
    assert rewrapped != blob
    assert new.unwrap("t_a", 3, rewrapped) == SECRET_KEY
    with pytest.raises(KeyUnwrapError):
        old.unwrap("t_a", 3, rewrapped)
    with pytest.raises(KeyUnwrapError):  # rewrap never changes the binding
        new.unwrap("t_b", 3, rewrapped)
    with pytest.raises(KeyUnwrapError):  # a blob the old key cannot open is refused
        new.rewrap(old, "t_a", 3, blob)


def test_api_keys() -> None:
    key = new_api_key()
    assert key.startswith("wc_")
    assert len(key) >= 3 + 43
    assert new_api_key() != key
    digest = hash_api_key(key)
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert key not in digest
    assert hash_api_key(key) == digest  # deterministic: usable as a lookup index
    assert verify_api_key(key, digest)
    assert not verify_api_key(key + "x", digest)
    assert not verify_api_key(key, digest.upper())
    assert not verify_api_key(key, "")
    assert not verify_api_key(key, "é" * 64)  # non-ASCII stored value: False, not TypeError


def test_tokens_equal() -> None:
    assert tokens_equal("admin-token", "admin-token")
    assert not tokens_equal("admin-token", "admin-tokem")
    assert not tokens_equal("admin-token", "admin")
    assert not tokens_equal("", "x")
    assert tokens_equal("ünïcode", "ünïcode")
