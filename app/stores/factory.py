"""Pick the store backend from settings: Redis when a URL is set, else SQLite."""

from __future__ import annotations

from app.core.config import Settings
from app.stores.base import Store


def make_store(settings: Settings) -> Store:
    """Build (but do not connect) the configured store; call ``ping()`` to check it.

    Backends are imported lazily so a SQLite-only deployment never imports redis.
    """
    if settings.redis_url:
        from app.stores.redis import RedisStore

        return RedisStore(
            settings.redis_url,
            prefix=settings.redis_prefix,
            timeout_s=settings.store_timeout_s,
            cluster=settings.redis_cluster,
            wait_replicas=settings.redis_wait_replicas,
            wait_timeout_ms=settings.redis_wait_timeout_ms,
        )
    from app.stores.sqlite import SQLiteStore

    return SQLiteStore(settings.sqlite_path, timeout_s=settings.store_timeout_s)
