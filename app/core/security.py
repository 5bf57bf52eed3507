"""API keys, constant-time token checks and encryption of watermark keys at rest.

Tenant watermark keys are stored wrapped with AES-256-GCM under the service
master key. The associated data binds each blob to its tenant and key version,
so a blob copied to another tenant or version (e.g. by someone with write
access to the store) fails to decrypt instead of silently being used.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "API_KEY_PREFIX",
    "KeyUnwrapError",
    "KeyWrapper",
    "hash_api_key",
    "new_api_key",
    "tokens_equal",
    "verify_api_key",
]

API_KEY_PREFIX = "wc_"
_NONCE_BYTES = 12
_TAG_BYTES = 16


def new_api_key() -> str:
    """A fresh tenant API key: 256 random bits, URL-safe, recognisable by its prefix."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """Hex SHA-256 of the key; only this is stored.

    A plain fast hash is enough here: API keys carry 256 bits of randomness, so
    there is nothing to brute-force and a slow password KDF (bcrypt, argon2)
    would only add latency to every request. The hash also makes the lookup
    index (hash -> tenant) safe to leak.
    """
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def verify_api_key(key: str, stored_hash: str) -> bool:
    """Constant-time comparison of ``hash_api_key(key)`` with a stored hash."""
    return hmac.compare_digest(
        hash_api_key(key).encode("ascii"), stored_hash.encode("utf-8", "surrogatepass")
    )


def tokens_equal(a: str, b: str) -> bool:
    """Constant-time equality for secrets such as the admin token.

    Both sides are hashed first so that neither the content nor the length of
    the expected token leaks through timing.
    """
    da = hashlib.sha256(a.encode("utf-8", "surrogatepass")).digest()
    db = hashlib.sha256(b.encode("utf-8", "surrogatepass")).digest()
    return hmac.compare_digest(da, db)


class KeyUnwrapError(Exception):
    """A wrapped key could not be decrypted (wrong master key, tampering, or moved blob)."""


def _aad(tenant_id: str, version: int) -> bytes:
    # The version is the last ':'-separated field and is an int, so the encoding is
    # unambiguous even if a tenant id contained ':'.
    return f"worldcup-key:v1:{tenant_id}:{int(version)}".encode()


class KeyWrapper:
    """Encrypts tenant watermark keys under the master key (AES-256-GCM).

    Blob format: ``nonce (12 bytes) || ciphertext || tag (16 bytes)``, with a
    fresh random nonce per wrap. The raw master key is not kept as an attribute
    and never appears in ``repr`` or error messages.

    Master-key rotation: ``previous`` holds old master keys that are still
    accepted for unwrapping (never for wrapping), so replicas can run with
    the new key while the stored blobs are re-encrypted one by one.
    """

    __slots__ = ("_aead", "_previous")

    def __init__(self, master_key: bytes, previous: tuple[bytes, ...] = ()) -> None:
        for key in (master_key, *previous):
            if len(key) != 32:
                raise ValueError("master key must be 32 bytes (AES-256)")
        self._aead = AESGCM(bytes(master_key))
        self._previous = tuple(AESGCM(bytes(k)) for k in previous)

    def __repr__(self) -> str:
        return "KeyWrapper(master_key=<redacted>)"

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("KeyWrapper cannot be pickled (it holds the master key)")

    def wrap(self, tenant_id: str, version: int, key_bytes: bytes) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, bytes(key_bytes), _aad(tenant_id, version))

    def unwrap(self, tenant_id: str, version: int, blob: bytes) -> bytes:
        if len(blob) < _NONCE_BYTES + _TAG_BYTES:
            raise KeyUnwrapError(
                f"wrapped key for tenant {tenant_id!r} version {version} is truncated"
            )
        nonce, ciphertext = bytes(blob[:_NONCE_BYTES]), bytes(blob[_NONCE_BYTES:])
        for aead in (self._aead, *self._previous):
            try:
                return aead.decrypt(nonce, ciphertext, _aad(tenant_id, version))
            except InvalidTag:
                continue
        raise KeyUnwrapError(
            f"cannot unwrap key for tenant {tenant_id!r} version {version}: wrong master "
            "key, tampered blob, or blob belongs to another tenant/version"
        )

    def is_current(self, tenant_id: str, version: int, blob: bytes) -> bool:
        """True if ``blob`` is already wrapped under the current master key."""
        if len(blob) < _NONCE_BYTES + _TAG_BYTES:
            return False
        try:
            self._aead.decrypt(
                bytes(blob[:_NONCE_BYTES]), bytes(blob[_NONCE_BYTES:]), _aad(tenant_id, version)
            )
        except InvalidTag:
            return False
        return True

    def rewrap_current(self, tenant_id: str, version: int, blob: bytes) -> bytes:
        """Re-encrypt a blob wrapped under any accepted key with the current key."""
        return self.wrap(tenant_id, version, self.unwrap(tenant_id, version, blob))

    def rewrap(self, target: KeyWrapper, tenant_id: str, version: int, blob: bytes) -> bytes:
        """Master-key rotation: decrypt ``blob`` with this (old) wrapper and re-encrypt it
        under ``target`` (the new one). The plaintext key never leaves this call."""
        return target.wrap(tenant_id, version, self.unwrap(tenant_id, version, blob))
