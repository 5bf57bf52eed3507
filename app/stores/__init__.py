"""Tenants, watermark keys, message registries and idempotency records."""
