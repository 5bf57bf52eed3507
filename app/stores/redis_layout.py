"""Redis key layout (version 2), one that Redis Cluster accepts.

``p`` = prefix, ``t`` = tenant id, ``b`` = registry bucket (``(id - 1) // BUCKET_IDS``).
A ``{...}`` in a key is its hash tag: keys with the same tag live in the same
cluster slot, and every Lua script touches keys of one tag only.

Global indexes (each key its own slot; never in a script with other keys)::

    p:layout                  str   "2" (this layout; absent: the legacy one, see below)
    p:tenants                 set   tenant ids
    p:tenant-names            hash  name -> tenant id (uniqueness claim)
    p:apikey:<sha256>         str   tenant id (authentication lookup, uniqueness claim)
    p:keyhash:<sha256>        str   "tenant id key id" of an API key (lookup, claim)
    p:audit                   stream provenance audit log (one JSON field per entry)
    p:marker                  str   the service's marker (written at first start)
    p:case:<id>               str   CaseRecord JSON, expiring at retention
    p:cases:all               zset  case ids by creation time (every case)
    p:cases:t:<t>             zset  case ids of tenant t (``-`` for the admin's)
    p:cases:b:<batch>         zset  case ids of one console batch

One tenant (tag ``{t}``: one slot)::

    p:{t}:tenant              hash  TenantRecord fields
    p:{t}:creating            str   set while the tenant is being created (TTL)
    p:{t}:keys                hash  version -> KeyRecord JSON (wrapped key in base64)
    p:{t}:msgseq              str   last allocated message id (INCR)
    p:{t}:msgbits:<kv>        set   payload lengths issued under a key version
    p:{t}:msglive:<kv>:<bits> str   live entries of (key version, bits), counted at write time
    p:{t}:msgexp:<kv>:<bits>  str   entries of (key version, bits) the retention sweep deleted
    p:{t}:msgexpired          str   the retention watermark: every id below it is expired
    p:{t}:retention           str   registry retention in days (absent: keep forever)
    p:{t}:ratelimit           hash  token bucket (tokens, ts), expires when full
    p:{t}:ratelimit-op:<op>   str   one debit's decision, for its retry (TTL: the deadline + 1 s)
    p:{t}:apikeys             hash  key id -> ApiKeyRecord JSON
    p:{t}:apikeys-revoked     hash  key id -> revocation time
    p:{t}:probe:<k>:...       str/zset probe accounting of API key k (TTL); k =
                                        ``cpayload-v<kv>``: the recorded client-chosen
                                        payloads (app.stores.client_payloads)
    p:{t}:idem:<key>          str   IdempotencyRecord JSON, with a TTL
    p:{t}:response:<id>       str   a stored /v1/responses record, with a TTL
    p:{t}:ctxsketch:<kv>      str   the count-min sketch of the contexts of the texts
                                        issued under key version kv (one byte a counter,
                                        worldcup_core.context_sketch), 4 MiB once written

One registry bucket of a tenant (tag ``{t:b}``; ``BUCKET_IDS`` consecutive ids, so a
big tenant's registry spreads over slots, hence over shards)::

    p:{t:b}:msgs              hash  message id -> RegistryEntry JSON (``fingerprint``: hex)
    p:{t:b}:idx:<kv>:<bits>   zset  ids of the bucket issued under (key version, bits)

Legacy layout (before cluster support; read only by ``worldcup migrate-store``): the
global keys above under the same names, and the tenant's keys as ``p:t:<name>``
(``p:t:msgs`` one hash for the whole registry, ``p:t:msgidx:<kv>:<bits>`` its index).
"""

from __future__ import annotations

import re

from app.stores.base import check_tenant_id

LAYOUT_VERSION = "2"
BUCKET_IDS = 65_536  # ids per registry bucket: ~13 MB of entries at ~200 bytes each


def bucket_of(message_id: int) -> int:
    return (int(message_id) - 1) // BUCKET_IDS


def bucket_ids(bucket: int) -> range:
    """The message ids of one bucket."""
    return range(int(bucket) * BUCKET_IDS + 1, (int(bucket) + 1) * BUCKET_IDS + 1)


def glob_escape(text: str) -> str:
    """``text`` as a literal in a SCAN ``MATCH`` pattern (``*?[]\\`` escaped)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def check_prefix(prefix: str) -> str:
    if not prefix or any(c in prefix for c in ":{}") or any(c.isspace() for c in prefix):
        raise ValueError("prefix must be non-empty and contain no ':', '{', '}' or spaces")
    return prefix


class Layout:
    """Key names of one namespace (prefix)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = check_prefix(prefix)

    def g(self, *parts: object) -> str:
        """A global key (its own slot)."""
        return ":".join([self.prefix, *map(str, parts)])

    def t(self, tenant_id: str, *parts: object) -> str:
        """A key of one tenant: tag ``{tenant}``."""
        return ":".join([self.prefix, "{" + check_tenant_id(tenant_id) + "}", *map(str, parts)])

    def bucket(self, tenant_id: str, bucket: int, *parts: object) -> str:
        """A key of one registry bucket: tag ``{tenant:bucket}``."""
        tag = "{" + check_tenant_id(tenant_id) + ":" + str(int(bucket)) + "}"
        return ":".join([self.prefix, tag, *map(str, parts)])

    def msgs(self, tenant_id: str, bucket: int) -> str:
        return self.bucket(tenant_id, bucket, "msgs")

    def idx(self, tenant_id: str, bucket: int, key_version: int, num_bits: int) -> str:
        return self.bucket(tenant_id, bucket, "idx", int(key_version), int(num_bits))

    def legacy(self, tenant_id: str, *parts: object) -> str:
        """A tenant key of the legacy (pre-cluster) layout."""
        return ":".join([self.prefix, check_tenant_id(tenant_id), *map(str, parts)])
