"""The SQLite store's schema, and the migrations that bring an older file up to it.

``SCHEMA`` is idempotent (``IF NOT EXISTS``) and runs on every open; :func:`migrate`
then adds what a file written by an older release lacks, in one write transaction.
"""

from __future__ import annotations

import sqlite3

from app.stores.base import SKETCH_WIDTH_LOG2_BEFORE

__all__ = ["SCHEMA", "migrate"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    tenant_id    TEXT PRIMARY KEY,
    name         TEXT NOT NULL UNIQUE,
    api_key_hash TEXT NOT NULL UNIQUE,
    created_at   REAL NOT NULL,
    scopes       TEXT NOT NULL DEFAULT '[]'
);
CREATE TABLE IF NOT EXISTS keys (
    tenant_id     TEXT NOT NULL REFERENCES tenants(tenant_id),
    version       INTEGER NOT NULL,
    wrapped_key   BLOB NOT NULL,
    created_at    REAL NOT NULL,
    groups        INTEGER NOT NULL,
    layers        INTEGER NOT NULL,
    alpha         REAL NOT NULL,
    context_width INTEGER NOT NULL,
    scheme        TEXT NOT NULL DEFAULT 'worldcup-v1',
    sketch_width_log2 INTEGER NOT NULL DEFAULT 20,
    PRIMARY KEY (tenant_id, version)
);
CREATE TABLE IF NOT EXISTS messages (
    tenant_id   TEXT NOT NULL,
    message_id  INTEGER NOT NULL,
    key_version INTEGER NOT NULL,
    num_bits    INTEGER NOT NULL,
    metadata    TEXT NOT NULL,
    issued_at   REAL NOT NULL,
    fingerprint BLOB,
    PRIMARY KEY (tenant_id, message_id)
);
CREATE INDEX IF NOT EXISTS messages_by_key
    ON messages (tenant_id, key_version, num_bits, message_id);
CREATE TABLE IF NOT EXISTS registry_counts (
    tenant_id   TEXT NOT NULL,
    key_version INTEGER NOT NULL,
    num_bits    INTEGER NOT NULL,
    live        INTEGER NOT NULL DEFAULT 0,
    expired     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, key_version, num_bits)
);
CREATE TABLE IF NOT EXISTS registry_state (
    tenant_id      TEXT PRIMARY KEY,
    retention_days REAL,
    expired_below  INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS idempotency (
    tenant_id   TEXT NOT NULL,
    key         TEXT NOT NULL,
    body_hash   TEXT NOT NULL,
    status_code INTEGER NOT NULL,
    response    TEXT NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (tenant_id, key)
);
CREATE INDEX IF NOT EXISTS idempotency_expiry ON idempotency (expires_at);
CREATE TABLE IF NOT EXISTS responses (
    tenant_id   TEXT NOT NULL,
    response_id TEXT NOT NULL,
    record      TEXT NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (tenant_id, response_id)
);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires_at);
CREATE TABLE IF NOT EXISTS api_keys (
    tenant_id  TEXT NOT NULL,
    key_id     TEXT NOT NULL,
    key_hash   TEXT NOT NULL UNIQUE,
    record     TEXT NOT NULL,
    revoked_at REAL,
    PRIMARY KEY (tenant_id, key_id)
);
CREATE TABLE IF NOT EXISTS probe_bands (
    tenant_id  TEXT NOT NULL,
    key_id     TEXT NOT NULL,
    band       TEXT NOT NULL,
    cluster_id TEXT NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (tenant_id, key_id, band)
);
CREATE TABLE IF NOT EXISTS probe_clusters (
    tenant_id  TEXT NOT NULL,
    key_id     TEXT NOT NULL,
    cluster_id TEXT NOT NULL,
    sketch     BLOB NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (tenant_id, key_id, cluster_id)
);
CREATE TABLE IF NOT EXISTS probe_hits (
    tenant_id  TEXT NOT NULL,
    key_id     TEXT NOT NULL,
    cluster_id TEXT NOT NULL,
    at         REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS probe_hits_by_cluster ON probe_hits (tenant_id, key_id, cluster_id, at);
CREATE INDEX IF NOT EXISTS probe_bands_expiry ON probe_bands (expires_at);
CREATE INDEX IF NOT EXISTS probe_clusters_expiry ON probe_clusters (expires_at);
CREATE TABLE IF NOT EXISTS audit (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS cases (
    case_id    TEXT PRIMARY KEY,
    tenant_id  TEXT,
    batch_id   TEXT,
    created_at REAL NOT NULL,
    expires_at REAL,
    record     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS cases_by_tenant ON cases (tenant_id, created_at);
CREATE INDEX IF NOT EXISTS cases_by_batch ON cases (batch_id, created_at);
CREATE INDEX IF NOT EXISTS cases_expiry ON cases (expires_at);
CREATE TABLE IF NOT EXISTS context_counters (
    tenant_id   TEXT NOT NULL,
    key_version INTEGER NOT NULL,
    cell        INTEGER NOT NULL,
    count       INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, key_version, cell)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS marker (
    id    INTEGER PRIMARY KEY CHECK (id = 1),
    value TEXT NOT NULL
);
"""


def migrate(conn: sqlite3.Connection) -> None:
    """Bring a file written by an older release up to the current schema.

    Run it inside a ``BEGIN IMMEDIATE`` transaction: otherwise another process sharing
    the file could allocate between the check for counters and the count (a message
    counted twice, or a UNIQUE conflict that fails the open).
    """
    columns = {row["name"] for row in conn.execute("PRAGMA table_info(keys)")}
    if "scheme" not in columns:  # key versions created before scheme worldcup-v2 existed
        conn.execute("ALTER TABLE keys ADD COLUMN scheme TEXT NOT NULL DEFAULT 'worldcup-v1'")
    if "sketch_width_log2" not in columns:  # versions created before the width was recorded
        conn.execute(
            "ALTER TABLE keys ADD COLUMN sketch_width_log2 INTEGER NOT NULL"
            f" DEFAULT {SKETCH_WIDTH_LOG2_BEFORE}"
        )
    columns = {row["name"] for row in conn.execute("PRAGMA table_info(messages)")}
    if "voided" not in columns:  # void_message: the row stays, so its id is never reused
        conn.execute("ALTER TABLE messages ADD COLUMN voided TEXT")
    if "fingerprint" not in columns:  # the issued text's fingerprint (issue #45)
        conn.execute("ALTER TABLE messages ADD COLUMN fingerprint BLOB")
    counted = conn.execute("SELECT 1 FROM registry_counts LIMIT 1").fetchone()
    if counted is None:  # a registry written before the counters existed: count it once
        conn.execute(
            "INSERT INTO registry_counts (tenant_id, key_version, num_bits, live)"
            " SELECT tenant_id, key_version, num_bits, COUNT(*) FROM messages"
            " WHERE voided IS NULL GROUP BY tenant_id, key_version, num_bits"
        )
