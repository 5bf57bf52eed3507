"""Schemathesis fuzzing of the OpenAPI schema: the real app, the tiny model, real Redis.

Every operation in ``/openapi.json`` is fuzzed in-process over ASGI
(schemathesis starts the app's lifespan once: model, batcher, Redis store):

* positive (schema-valid) and negative (schema-violating) requests, with the
  admin token on ``/admin/*`` and ``/provenance*`` and a tenant API key
  elsewhere (negative mode also drops the credential now and then);
* ``/generate`` bodies bent into ones the server accepts (see ``servable``),
  since random bodies almost never pass its cross-field rules;
* path operations on a real (second) tenant: registry hits, key rotations;
* every authenticated operation without a credential, with a wrong one and
  with the other kind (admin token as an API key and the reverse): only
  401/403 (or 413, which is checked before auth) may come back.

Checks on every response: no 5xx, a documented status code and content type,
and a body that matches its declared schema (every error is the
``{"error": {"message", "type", "code"}}`` envelope). A streamed ``/generate``
is checked event by event (``event_stream_conformance``).

Redis must answer at 127.0.0.1:6379 (db 13); an unreachable Redis fails the
test. Every key goes under a random prefix and is deleted afterwards.

``WORLDCUP_FUZZ_EXAMPLES`` sets the examples per operation and mode (default
25; ``make fuzz`` runs 300). By default generation is derandomized (fixed seed,
no example database), so CI runs the same cases every time; ``make fuzz`` sets
``WORLDCUP_FUZZ_RANDOM=1`` for a fresh random seed per run, printed in the
report (replay it with ``WORLDCUP_FUZZ_SEED=<seed>``).

Every check schemathesis has runs on every response (see ``REPLACED``/``ADDED``):
a schema-valid request must be accepted (a 422 only for the few rules the schema
says it cannot state, ``UNSTATED_RULES``), a schema-violating one refused.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, seed, settings
from pydantic import TypeAdapter
from schemathesis import GenerationMode
from schemathesis.config._checks import (
    NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES,
    POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES,
)
from schemathesis.python import asgi as schemathesis_asgi
from schemathesis.specs.openapi.checks import (
    positive_data_acceptance,
)

from app.core.config import Settings
from app.main import create_app
from app.schemas.common import ErrorEnvelope
from app.schemas.generation import UNSTATED_RULES, GenerateResponse, PayloadIn
from app.schemas.openai.chat import ChatCompletionChunk
from app.schemas.openai.common import OPENAI_UNSTATED_RULES, OpenAIErrorEnvelope
from app.schemas.openai.completions import CompletionChunk
from app.schemas.openai.responses import RESPONSES_UNSTATED_RULES, ResponseStreamEvent

REDIS_URL = "redis://127.0.0.1:6379/13"
ADMIN_TOKEN = "fuzz-admin-token-0123456789abcdef"
MASTER_KEY = "cd" * 32
SERVED_MODEL = "fuzz-model"
EXAMPLES = int(os.environ.get("WORLDCUP_FUZZ_EXAMPLES", "25"))
# ``make fuzz``: a random seed per run (printed, to replay with WORLDCUP_FUZZ_SEED)
RANDOM = os.environ.get("WORLDCUP_FUZZ_RANDOM", "") == "1"
SEED = int(os.environ.get("WORLDCUP_FUZZ_SEED") or (secrets.randbits(32) if RANDOM else 0))
BAD_AUTH_EXAMPLES = max(5, EXAMPLES // 5)
ONLY = os.environ.get("WORLDCUP_FUZZ_ONLY", "/")  # a path prefix, to iterate on some routes
# a streamed /generate has at most max_new_tokens_limit (64) deltas + result + [DONE]
MAX_STREAM_EVENTS = 200
ONLY_REJECTED = (401, 403, 413)  # 413: the body limit is checked before auth


# --------------------------------------------------------------------------- fixtures
@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A fresh key prefix on a reachable Redis; every key under it is deleted afterwards."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        pytest.fail(
            f"Redis is not reachable at {REDIS_URL} ({type(exc).__name__}: {exc}); "
            "the fuzz test needs the real store",
            pytrace=False,
        )
    prefix = f"fuzz{secrets.token_hex(8)}"
    try:
        yield prefix
    finally:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
        left = list(client.scan_iter(match=f"{prefix}:*", count=500))
        client.close()
        assert not left, f"{len(left)} keys with prefix {prefix!r} left in Redis"


def make_settings(model_dir: Path, db_dir: Path, prefix: str) -> Settings:
    """Everything explicit: no ``.env``; settings a Settings version lacks are ignored."""
    values: dict[str, Any] = {
        "env": "prod",
        "model_path": str(model_dir),
        "master_key": MASTER_KEY,
        "master_key_file": None,
        "master_key_previous": None,
        "master_key_previous_file": None,
        "admin_token": ADMIN_TOKEN,
        "admin_token_file": None,
        "redis_url": REDIS_URL,
        "redis_prefix": prefix,
        "sqlite_path": db_dir / "unused.sqlite3",
        "device": "cpu",
        "log_level": "WARNING",
        "max_text_chars": 2000,
        "max_prompt_tokens": 64,
        "max_new_tokens_limit": 64,
        "max_body_bytes": 64 * 1024,
        "max_batch_texts": 16,
        "max_batch_body_bytes": 64 * 1024,
        "request_timeout_s": 60.0,
        "drain_timeout_s": 2.0,
        "rate_limit_per_s": 0,  # disabled: the fuzzer is one very busy tenant
        "served_model_name": SERVED_MODEL,
    }
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


# --------------------------------------------------------------------------- checks
def _content_type(response: Any) -> str:
    return str((response.headers.get("content-type") or [""])[0])


def sse_events(text: str) -> list[tuple[str | None, str]]:
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        event, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
            else:
                raise AssertionError(f"not an SSE line: {line!r}")
        events.append((event, "\n".join(data)))
    return events


def event_stream_conformance(ctx: Any, response: Any, case: Any) -> bool | None:
    """A streamed /generate: token deltas, then a result or an error event, then [DONE].

    The schema describes each event (OpenAPI 3.2 ``itemSchema``), which schemathesis'
    own ``response_schema_conformance`` checks; the ``data`` of an event is JSON that
    a JSON Schema validator does not parse (``contentSchema`` is an annotation), so
    this check parses it and validates every event against its model.
    """
    if not _content_type(response).startswith("text/event-stream"):
        return None
    assert response.status_code == 200, response.status_code
    events = sse_events(response.text)
    if str(case.operation.path) == "/v1/responses":
        return responses_stream_conformance(events)
    assert events and events[-1] == (None, "[DONE]"), events[-2:]
    if str(case.operation.path).startswith("/v1/"):
        return openai_stream_conformance(case, events[:-1])
    *deltas, (last_event, last_data) = events[:-1]
    for event, data in deltas:
        assert event is None, (event, data)
        delta = json.loads(data)
        assert set(delta) == {"token_id", "text"}, delta
        assert delta["token_id"] is None or isinstance(delta["token_id"], int), delta
        assert isinstance(delta["text"], str), delta
    assert last_event in ("result", "error"), (last_event, last_data)
    model = GenerateResponse if last_event == "result" else ErrorEnvelope
    model.model_validate_json(last_data, strict=True)
    return True


def openai_stream_conformance(case: Any, events: list[tuple[str | None, str]]) -> bool:
    """OpenAI's SSE: unnamed ``data:`` chunks (an error as ``{"error": ...}``), then [DONE]."""
    chunk = ChatCompletionChunk if "chat" in str(case.operation.path) else CompletionChunk
    for event, data in events:
        assert event is None, (event, data)
        body = json.loads(data)
        if "error" in body:
            OpenAIErrorEnvelope.model_validate(body, strict=True)
        else:
            chunk.model_validate(body, strict=True)
    return True


RESPONSE_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def responses_stream_conformance(events: list[tuple[str | None, str]]) -> bool:
    """The Responses API's SSE: every event named by its type, numbered from 0, opened by
    response.created and closed by response.completed/.incomplete or an error event."""
    assert events, "an empty stream"
    for number, (event, data) in enumerate(events):
        body = RESPONSE_EVENT.validate_json(data, strict=True)
        assert event == body.type and body.sequence_number == number, (event, data)
    assert events[0][0] == "response.created", events[0]
    assert events[-1][0] in ("response.completed", "response.incomplete", "error"), events[-1]
    return True


def valid_data_acceptance(ctx: Any, response: Any, case: Any) -> bool | None:
    """schemathesis' ``positive_data_acceptance``, except for a 422 whose code is one of
    the few rules the schema cannot state and says it cannot (``UNSTATED_RULES``); the
    ``/v1`` routes answer those with OpenAI's 400 instead of 422."""
    openai = str(case.operation.path).startswith("/v1/")
    if response.status_code == 422 or (openai and response.status_code == 400):
        try:
            code = json.loads(response.text)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        unstated = {**OPENAI_UNSTATED_RULES, **RESPONSES_UNSTATED_RULES}
        if code in UNSTATED_RULES or (openai and code in unstated):
            return None
    return positive_data_acceptance(ctx, response, case)


# A body over the server's byte limit is a 413 whatever it holds (the schema's
# description says so: a byte count of the whole body is no JSON Schema keyword).
BODY_LIMIT_IS_A_REFUSAL = {
    "negative_data_rejection": {
        "expected-statuses": [*NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES, "413"]
    },
    "positive_data_acceptance": {
        "expected-statuses": [*POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES, "413"]
    },
}

# Every built-in check of schemathesis (not_a_server_error, status_code_conformance,
# content_type_conformance, response_headers_conformance, response_schema_conformance,
# negative_data_rejection, positive_data_acceptance, missing_required_header,
# unsupported_method, ignored_auth, use_after_free, ...), with one replaced (a
# schema-valid request may get a 422 only for a rule the schema documents it cannot
# state) and one added (each streamed event's JSON data against its model).
REPLACED = [positive_data_acceptance]
ADDED = [event_stream_conformance, valid_data_acceptance]


# --------------------------------------------------------------------------- helpers
def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def needs_auth(operation: Any) -> bool:
    return bool(operation.definition.raw.get("security"))


def uses_admin_token(operation: Any) -> bool:
    return str(operation.path).startswith(("/admin/", "/provenance"))


def has_inputs(operation: Any) -> bool:
    """Negative mode needs something to break: a parameter or a body."""
    return bool(list(operation.iter_parameters()) or list(operation.body))


def servable(case: Any) -> Any:
    """Bend a schema-valid /generate body into one the server accepts, keeping the rest.

    Random bodies almost never satisfy the cross-field rules (exactly one of
    prompt/messages and of payload/metadata, a well-formed payload) and the
    server limits (64 prompt tokens, 64 new tokens), so without this hardly a
    fuzzed generation would run. Everything else (sampling parameters, seed,
    stream, metadata, the Idempotency-Key header) stays as generated.
    """
    body = case.body
    if not isinstance(body, dict):
        return case
    body = dict(body)
    if body.get("messages"):
        message = body["messages"][0]
        body["messages"] = [{**message, "content": str(message.get("content", ""))[:8]}]
        body.pop("prompt", None)
    else:
        body.pop("messages", None)
        body["prompt"] = (body.get("prompt") or "Tides")[:16]  # <= 4 tokens a character
    if body.get("metadata") is not None:
        body.pop("payload", None)
    else:
        body.pop("metadata", None)
        body.pop("num_bits", None)
        try:
            PayloadIn.model_validate(body.get("payload"))
        except ValueError:
            body["payload"] = {"bits": "1011"}
    body["max_new_tokens"] = 1 + int(body.get("max_new_tokens", 8)) % 16
    body["min_new_tokens"] = min(int(body.get("min_new_tokens", 0)), body["max_new_tokens"])
    case.body = body
    return case


def servable_openai(case: Any) -> Any:
    """Bend a schema-valid /v1 body into one the server runs: the served model, a short
    prompt, few tokens and choices; sampling, stop, stream and watermark stay fuzzed."""
    body = case.body
    if not isinstance(body, dict):
        return case
    body = {**body, "model": SERVED_MODEL}
    if str(case.operation.path) == "/v1/responses":
        body["input"] = "Tides" if isinstance(body.get("input"), str) else [
            {"role": "user", "content": "Tides"}
        ]  # fmt: skip
        body["instructions"] = None if body.get("instructions") is None else "Be brief."
        body.pop("previous_response_id", None)
        if isinstance(body.get("max_output_tokens"), int):
            body["max_output_tokens"] = 1 + body["max_output_tokens"] % 8
        body.setdefault("max_output_tokens", 4)
        case.body = body
        return case
    if "messages" in body or "chat" in str(case.operation.path):
        body["messages"] = [{"role": "user", "content": "Tides"}]
    else:
        body["prompt"] = "Tides"
    body["n"] = 1 + int(body.get("n") or 1) % 2
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int):
            body[field] = 1 + body[field] % 8
    body.setdefault("max_tokens", 4)
    case.body = body
    return case


class Fuzzer:
    """Sends cases through schemathesis' checks; counts per operation, run and status."""

    def __init__(self, schema: Any, admin: dict[str, str], tenant: dict[str, str]) -> None:
        self.schema, self.admin, self.tenant = schema, admin, tenant
        self.runs: dict[tuple[str, str], Counter[int]] = {}

    def credential(self, operation: Any) -> dict[str, str] | None:
        if not needs_auth(operation):
            return None
        return self.admin if uses_admin_token(operation) else self.tenant

    def send(
        self, case: Any, headers: dict[str, str] | None, run: str, expect: tuple[int, ...] | None
    ) -> Any:
        try:
            response = case.call_and_validate(
                headers=headers, additional_checks=ADDED, excluded_checks=REPLACED
            )
        except BaseException:
            meta = case.meta
            print(f"\nFAILED in run {run!r}: mode {meta.generation.mode if meta else None}")
            raise
        label = case.operation.label
        self.runs.setdefault((label, run), Counter())[response.status_code] += 1
        if expect is not None:
            assert response.status_code in expect, (
                f"{label} [{run}]: {response.status_code} not in {expect}: {response.text[:300]}"
            )
        return response

    def fuzz(
        self,
        operation: Any,
        run: str,
        headers: dict[str, str] | None,
        *,
        mode: GenerationMode = GenerationMode.POSITIVE,
        max_examples: int = EXAMPLES,
        expect: tuple[int, ...] | None = None,
        path_parameters: dict[str, Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters)
        if transform is not None:
            strategy = strategy.map(transform)

        @settings(
            max_examples=max_examples,
            deadline=None,
            derandomize=SEED == 0,  # CI: the same cases every time
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def run_case(case: Any) -> None:
            self.send(case, headers, run, expect)

        (run_case if SEED == 0 else seed(SEED)(run_case))()

    def explicit(
        self,
        method: str,
        path: str,
        headers: dict[str, str] | None,
        expect: tuple[int, ...] = (200, 201),
        **kw: Any,
    ) -> Any:
        case = self.schema[path][method].Case(**kw)
        return self.send(case, headers, "explicit", expect)

    def cases(self, label: str) -> int:
        return sum(sum(c.values()) for (lab, _), c in self.runs.items() if lab == label)

    def statuses(self, label: str) -> Counter[int]:
        total: Counter[int] = Counter()
        for (lab, _), counter in self.runs.items():
            if lab == label:
                total.update(counter)
        return total

    def report(self, labels: list[str], elapsed: float) -> str:
        total = sum(self.cases(label) for label in labels)
        lines = [f"schemathesis: {total} cases over {len(labels)} operations in {elapsed:.1f}s"]
        for label in labels:
            statuses = dict(sorted(self.statuses(label).items()))
            lines.append(f"  {label:<54} {self.cases(label):>5}  {statuses}")
            for (lab, run), counter in sorted(self.runs.items()):
                if lab == label:
                    lines.append(f"      {run:<20} {sum(counter.values()):>5}  {dict(counter)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- the test
def test_fuzz_openapi_schema(
    tiny_model_dir: Path, tmp_path: Path, redis_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.perf_counter()
    with capsys.disabled():
        print(f"\nschemathesis seed {SEED} (replay: WORLDCUP_FUZZ_SEED={SEED})")
    app = create_app(make_settings(tiny_model_dir, tmp_path, redis_prefix))
    config = schemathesis.Config.from_dict(
        {"seed": SEED, "max-stream-events": MAX_STREAM_EVENTS, "checks": BODY_LIMIT_IS_A_REFUSAL}
    )
    try:
        # loading the schema over ASGI starts the app's lifespan (model, batcher, store)
        schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
        operations = [result.ok() for result in schema.get_all_operations()]
        admin = bearer(ADMIN_TOKEN)
        tenant_key = create_tenant(schema, admin, "fuzz-tenant")[1]
        fuzzer = Fuzzer(schema, admin, bearer(tenant_key))
        # path operations act on a second tenant, so admin fuzzing (key rotations,
        # scope changes) never alters the tenant whose key the other routes use
        target_id, target_key = create_tenant(schema, admin, "fuzz-target")

        seeded_cases(fuzzer, target_id, bearer(target_key))
        for operation in operations:
            if not operation.path.startswith(ONLY):
                continue
            auth = fuzzer.credential(operation)
            fuzzer.fuzz(operation, "positive", auth)
            if has_inputs(operation):
                fuzzer.fuzz(operation, "negative", auth, mode=GenerationMode.NEGATIVE)
            if operation.label == "POST /generate":
                fuzzer.fuzz(operation, "servable", auth, transform=servable)
            if operation.label in (
                "POST /v1/chat/completions",
                "POST /v1/completions",
                "POST /v1/responses",
            ):
                fuzzer.fuzz(operation, "servable", auth, transform=servable_openai)
            if "{tenant_id}" in operation.path:
                # a real tenant: registry hits for small message ids, real key rotations
                fuzzer.fuzz(operation, "tenant", auth, path_parameters={"tenant_id": target_id})
            if auth is not None:
                other = fuzzer.tenant if auth is fuzzer.admin else fuzzer.admin
                wrong = bearer("wrong-" + "0f" * 16)
                for run, headers in (("no auth", None), ("wrong auth", wrong), ("other", other)):
                    fuzzer.fuzz(
                        operation,
                        run,
                        headers,
                        max_examples=BAD_AUTH_EXAMPLES,
                        expect=ONLY_REJECTED,
                    )
    finally:
        schemathesis_asgi.shutdown_lifespans()  # drain, close the store before the cleanup

    operations = [op for op in operations if op.path.startswith(ONLY)]
    labels = sorted(op.label for op in operations)
    report = f"seed {SEED}: " + fuzzer.report(labels, time.perf_counter() - started)
    with capsys.disabled():
        print("\n" + report)

    # a run that silently tested nothing must fail
    with_inputs = [op.label for op in operations if has_inputs(op)]
    assert ONLY != "/" or (len(labels) >= 9 and len(with_inputs) >= 6), report
    for label in labels:
        assert fuzzer.cases(label) >= 1, report
    for label in with_inputs:
        assert fuzzer.cases(label) >= 2 * EXAMPLES, report  # positive + negative at least
    for operation in operations:
        if needs_auth(operation):
            assert fuzzer.statuses(operation.label)[401] >= BAD_AUTH_EXAMPLES, report
    total = sum(fuzzer.cases(label) for label in labels)
    assert total >= 2 * EXAMPLES * len(with_inputs), report


def create_tenant(schema: Any, admin: dict[str, str], name: str) -> tuple[str, str]:
    # the explicit calls choose payloads: the tenant holds the fixed_payload grant
    case = schema["/admin/tenants"]["POST"].Case(body={"name": name, "scopes": ["fixed_payload"]})
    response = case.call_and_validate(
        headers=admin, additional_checks=ADDED, excluded_checks=REPLACED
    )
    assert response.status_code == 201, response.text
    return response.json()["tenant_id"], response.json()["api_key"]


def seeded_cases(fuzzer: Fuzzer, target_id: str, target: dict[str, str]) -> None:
    """Success paths random data rarely reaches, validated against their 2xx schemas."""
    tenant, admin = fuzzer.tenant, fuzzer.admin
    body = {"prompt": "Write about tides.", "max_new_tokens": 24, "seed": 1, "metadata": {"u": 1}}
    retry = {**tenant, "Idempotency-Key": "fuzz-seed-1"}
    generated = fuzzer.explicit("POST", "/generate", retry, body=body)
    message_id = generated.json()["message_id"]
    assert isinstance(message_id, int), generated.text
    replayed = fuzzer.explicit("POST", "/generate", retry, body=body)  # the stored response
    assert replayed.json() == generated.json()
    streamed = {
        "messages": [{"role": "user", "content": "Hi!"}],
        "payload": {"bits": "1011"},
        "max_new_tokens": 8,
        "stream": True,
        "seed": 2,
    }
    fuzzer.explicit("POST", "/generate", tenant, body=streamed)
    # the lowest temperature the schema allows still samples; far below it, a 422
    # (a float32 overflow there once failed the whole batch with a 500)
    low = {"prompt": "Tides.", "payload": {"bits": "1"}, "max_new_tokens": 4, "top_k": 296}
    fuzzer.explicit("POST", "/generate", tenant, body={**low, "temperature": 0.01})
    fuzzer.explicit("POST", "/generate", tenant, (422,), body={**low, "temperature": 2e-89})
    text = generated.json()["text"] or "some text"
    fuzzer.explicit("POST", "/decode", tenant, body={"text": text, "num_bits": 32})
    fuzzer.explicit("POST", "/detect", tenant, body={"text": text})
    # registry entries of the target tenant (message ids 1 and 2), for the admin routes
    for n in (1, 2):
        entry = fuzzer.explicit("POST", "/generate", target, body={**body, "metadata": {"n": n}})
        path = {"tenant_id": target_id, "message_id": entry.json()["message_id"]}
        registry = "/admin/tenants/{tenant_id}/registry/{message_id}"
        fuzzer.explicit("GET", registry, admin, path_parameters=path)
    rotate = "/admin/tenants/{tenant_id}/rotate-key"
    fuzzer.explicit("POST", rotate, admin, path_parameters={"tenant_id": target_id})
    for public in ("/health", "/ready", "/version"):
        fuzzer.explicit("GET", public, None)
    # the OpenAI routes: a streamed chat with usage, a completion, the model list
    chat = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": 6,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "watermark": {"metadata": {"u": 2}},
    }
    fuzzer.explicit("POST", "/v1/chat/completions", tenant, body=chat)
    plain = {"model": SERVED_MODEL, "prompt": ["Tides", "Waves"], "max_tokens": 4, "stop": "."}
    fuzzer.explicit("POST", "/v1/completions", tenant, body=plain)
    fuzzer.explicit("GET", "/v1/models", tenant)
    # the Responses API: a stored response, a follow-up to it, a streamed one, and GET
    first = {"model": SERVED_MODEL, "input": "Tides", "instructions": "Be brief.",
             "max_output_tokens": 4, "watermark": {"metadata": {"u": 3}}}  # fmt: skip
    created = fuzzer.explicit("POST", "/v1/responses", tenant, body=first).json()
    follow = {"model": SERVED_MODEL, "previous_response_id": created["id"], "stream": True,
              "input": [{"role": "user", "content": [{"type": "input_text", "text": "More"}]}],
              "max_output_tokens": 4}  # fmt: skip
    fuzzer.explicit("POST", "/v1/responses", tenant, body=follow)
    path = {"response_id": created["id"]}
    fuzzer.explicit("GET", "/v1/responses/{response_id}", tenant, path_parameters=path)
    fuzzer.explicit("GET", "/v1/models/{model}", tenant, path_parameters={"model": SERVED_MODEL})


# --------------------------------------------------------------------------- found bugs
def test_full_registry_keeps_decode_working(
    tiny_model_dir: Path, tmp_path: Path, redis_prefix: str
) -> None:
    app = create_app(make_settings(tiny_model_dir, tmp_path, redis_prefix))
    with TestClient(app, raise_server_exceptions=False) as client:
        created = client.post("/admin/tenants", json={"name": "full"}, headers=bearer(ADMIN_TOKEN))
        assert created.status_code == 201, created.text
        key = bearer(created.json()["api_key"])
        # one-bit payloads: message id 1 fits, id 2 does not (registry_full)
        body = {"prompt": "Tides.", "max_new_tokens": 2, "metadata": {"n": 1}, "num_bits": 1}
        statuses = [client.post("/generate", json=body, headers=key).status_code for _ in range(2)]
        assert statuses == [200, 409], statuses
        decoded = client.post("/decode", json={"text": "Some text.", "num_bits": 1}, headers=key)
        assert decoded.status_code == 200, decoded.text
        # the refused allocation wrote nothing: the registry still holds only id 1
        registry = f"/admin/tenants/{created.json()['tenant_id']}/registry"
        assert client.get(f"{registry}/1", headers=bearer(ADMIN_TOKEN)).status_code == 200
        missing = client.get(f"{registry}/2", headers=bearer(ADMIN_TOKEN))
        assert missing.status_code == 404, missing.text
