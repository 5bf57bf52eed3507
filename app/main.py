"""The FastAPI application: ``create_app(settings)`` and the lifespan that loads things once.

The lifespan loads the generation engine (``WORLDCUP_ENGINE``, see
:mod:`app.engines`; in the detector role only the tokenizer), connects the
store and starts the engine. On shutdown it flips readiness to 503, lets in-flight
generations drain up to ``drain_timeout_s`` and closes the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from app.api.deps import known_query_parameters
from app.api.errors import install_error_handlers
from app.api.middleware import BodySizeLimit, RequestContext, SingleAuthorization
from app.api.openapi import install_openapi
from app.api.routes import (
    admin,
    api_keys,
    detection,
    generate,
    health,
    openai,
    provenance,
    responses,
)
from app.console import ConsoleHeaders, install_console
from app.core.config import Role, Settings, get_settings
from app.core.logging import configure_logging
from app.core.metrics import Metrics
from app.core.security import KeyWrapper
from app.engines import Engine, load_engine
from app.services.cpu import CpuPool
from app.services.probes import ProbeAccountant, probe_secret
from app.services.registry import sweep_forever
from app.services.runtime import Runtime
from app.services.tenants import TenantService
from app.services.watermark import WatermarkService
from app.services.weights import ModelWeights
from app.stores.base import StoreUnavailable
from app.stores.factory import make_store
from worldcup_core import WatermarkConfig, __version__
from worldcup_core.models import load_tokenizer

logger = logging.getLogger("worldcup.app")


def _load(settings: Settings, metrics: Metrics) -> tuple[object, str, Engine | None]:
    """Blocking model work, run in a thread at startup."""
    if settings.role is Role.DETECTOR:
        return load_tokenizer(settings.model_path, settings.cache_dir), _model_id(settings), None
    engine, tokenizer, model_id = load_engine(settings, metrics)
    return tokenizer, model_id, engine


def _model_id(settings: Settings) -> str:
    from worldcup_core.models import EMBEDDED_MODEL_ID

    return settings.model_path or EMBEDDED_MODEL_ID


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        configure_logging(settings.log_level)
        store = make_store(settings)
        try:
            await store.ping()
        except StoreUnavailable as exc:
            logger.warning("store not reachable at startup: %s", exc)
        tokenizer, model_id, engine = await asyncio.to_thread(_load, settings, metrics)
        defaults = WatermarkConfig(
            groups=settings.groups,
            layers=settings.layers,
            alpha=settings.alpha,
            context_width=settings.context_width,
            version=settings.scheme,
        )
        cpu = CpuPool(
            settings.cpu_workers,
            settings.cpu_max_pending,
            max_pending_per_share=settings.cpu_max_pending_per_tenant,
            chunk_chars=settings.cpu_chunk_chars,
            fair=settings.cpu_fair,
        )
        tenants = TenantService(
            store,
            KeyWrapper(settings.master_key_bytes, settings.previous_master_keys),
            defaults,
            settings.cache_ttl_s,
        )
        runtime = Runtime(
            settings=settings,
            metrics=metrics,
            store=store,
            tenants=tenants,
            watermark=WatermarkService(
                store,
                tenants,
                cpu,
                settings.provenance_refresh_s,
                # detection's forward passes on the engine's model; None: model-free
                ModelWeights(engine.weigher if engine is not None else None),
            ),
            cpu=cpu,
            tokenizer=tokenizer,
            model_id=model_id,
            engine=engine,
            probes=ProbeAccountant(
                store,
                probe_secret(settings.master_key_bytes),
                metrics,
                settings.probe_window_s,
                settings.probe_budget_full,
                settings.probe_budget_verdict,
                tokenizer,
                settings.probe_full_answers,
            ),
        )
        try:  # else /ready writes it later
            runtime.marker = await store.ensure_marker(uuid.uuid4().hex)
        except StoreUnavailable as exc:  # down, or a Redis in the legacy key layout
            logger.warning("store marker not written: %s", exc)
        app.state.runtime = runtime
        if engine is not None:
            engine.start()
        runtime.warm = True
        sweeper = (
            asyncio.create_task(sweep_forever(store, settings.registry_sweep_interval_s))
            if settings.registry_sweep_interval_s > 0
            else None
        )
        logger.info(
            "ready",
            extra={
                "fields": {
                    "role": settings.role.value,
                    "model": model_id,
                    "engine": settings.engine,
                }
            },
        )
        try:
            yield
        finally:
            runtime.draining = True
            if sweeper is not None:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
            if engine is not None:
                drained = await engine.drain(settings.drain_timeout_s)
                if not drained:
                    logger.warning("drain timeout: cancelling unfinished generations")
                engine.stop()
            await store.close()
            cpu.close()

    app = FastAPI(
        title="WorldCup watermarking service",
        version=__version__,
        description=(
            "Multi-bit watermarking for LLM text. `/generate` embeds a payload, `/decode` "
            "recovers it (and the registry entry it came from), `/detect` tests for the "
            "watermark with a calibrated p-value. Tenants authenticate with "
            "`Authorization: Bearer <api key>`; admin endpoints take the admin token."
        ),
        lifespan=lifespan,
    )
    app.state.metrics = metrics
    install_error_handlers(app)
    install_openapi(app, settings)
    for module in (generate, detection, provenance, admin, api_keys, health, openai, responses):
        app.include_router(module.router, dependencies=[Depends(known_query_parameters)])
    install_console(app, dependencies=[Depends(known_query_parameters)])
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        max_batch_bytes=settings.max_batch_body_bytes,
        text_chars=settings.text_chars_limit,
    )
    app.add_middleware(SingleAuthorization)
    app.add_middleware(RequestContext, metrics=metrics)
    app.add_middleware(ConsoleHeaders)
    return app


def app_factory() -> FastAPI:
    """Entry point for ``uvicorn --factory app.main:app_factory``."""
    return create_app()
