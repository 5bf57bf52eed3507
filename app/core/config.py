"""Service settings: one pydantic-settings class, ``WORLDCUP_`` prefix.

Secrets (the master key that wraps tenant watermark keys, and the admin token)
come from the environment or from ``*_FILE`` paths (Docker/Kubernetes
secrets). The app refuses to start with a missing or placeholder secret unless
``WORLDCUP_ENV=dev``, where a random per-process secret is generated instead.
"""

from __future__ import annotations

import secrets
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import Field, PrivateAttr, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worldcup_core.config import SERVICE_CONTEXT_WIDTH, SERVICE_PRESET, WATERMARK_PRESETS

PLACEHOLDERS = {"", "changeme", "change-me", "changethis", "placeholder", "secret", "example"}


class Role(StrEnum):
    GENERATOR = "generator"  # loads the model: /generate, /decode, /detect
    DETECTOR = "detector"  # tokenizer only: /decode, /detect (no GPU needed)


class Environment(StrEnum):
    DEV = "dev"
    PROD = "prod"


# JSON spells one character in at most 12 bytes (a surrogate pair: \uXXXX\uXXXX), and
# a request's other fields take at most BODY_HEADROOM bytes beside its one long string.
JSON_BYTES_PER_CHAR = 12
BODY_HEADROOM = 8 * 1024


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="WORLDCUP_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        hide_input_in_errors=True,  # a validation error must not print the secrets
    )

    env: Environment = Environment.PROD
    role: Role = Role.GENERATOR
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    log_level: str = "INFO"
    debug_log_prompts: bool = False

    # engine: "hf" (our batching loop, the embedded default) or "vllm" (needs the
    # [vllm] extra; see docs/vllm.md)
    engine: Literal["hf", "vllm"] = "hf"
    # vLLM only (WORLDCUP_ENGINE=vllm); max_batch_size is its max_num_seqs
    vllm_max_model_len: Annotated[int, Field(ge=16)] | None = None  # None: the model's
    vllm_tensor_parallel_size: Annotated[int, Field(ge=1)] = 1
    vllm_gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    vllm_enforce_eager: bool | None = None  # None: eager on CPU, CUDA graphs on GPU
    vllm_cpu_kv_cache_gib: Annotated[int, Field(ge=1)] = 1  # VLLM_CPU_KVCACHE_SPACE
    # which distribution /v1 logprobs report on vLLM, where it is engine-wide: "sampled"
    # (vLLM's processed_logprobs, the watermarked q) or "model" (raw_logprobs); a request
    # whose logprobs_mode names the other one gets a 400
    vllm_logprobs_mode: Literal["sampled", "model"] = "sampled"
    # vLLM's model runner, each with its processor: "v1" (the legacy runner, pinned: the
    # only one the pinned vLLM has run live with the processor), "v2" (Model Runner V2,
    # opt-in until it has run live on a GPU), "auto" (v2 where vLLM can run it, i.e. with
    # Triton; see docs/vllm.md)
    vllm_model_runner: Literal["auto", "v1", "v2"] = "v1"

    # model
    model_path: str | None = None  # None: the embedded SmolLM2
    device: str = "cpu"
    dtype: str = "auto"
    # the model id of the OpenAI routes (default: the model's short name)
    served_model_name: Annotated[str | None, Field(min_length=1, max_length=256)] = None
    cache_dir: Path | None = None

    # store: Redis when a URL is set, otherwise embedded SQLite
    redis_url: str | None = None
    redis_prefix: str = "wc"
    # Redis Cluster: WORLDCUP_REDIS_URL names any one node (redis-py's cluster client)
    redis_cluster: bool = False
    # replicas that must acknowledge each registry write (WAIT) before /generate answers;
    # unset: 1 in cluster mode, 0 on a single Redis (docs/operations.md)
    redis_wait_replicas: Annotated[int, Field(ge=0, le=16)] | None = None
    redis_wait_timeout_ms: Annotated[int, Field(ge=1, le=60_000)] = 500
    sqlite_path: Path = Path("worldcup.sqlite3")
    store_timeout_s: Annotated[float, Field(gt=0)] = 2.0

    # secrets
    master_key: SecretStr | None = None  # 64 hex chars (AES-256)
    master_key_file: Path | None = None
    # During a master-key rotation: the old key, still accepted for unwrapping
    # until POST /admin/master-key/rewrap has re-encrypted every stored key.
    master_key_previous: SecretStr | None = None
    master_key_previous_file: Path | None = None
    admin_token: SecretStr | None = None
    admin_token_file: Path | None = None

    # watermark defaults (per key version, frozen at creation)
    # the scheme of new key versions; existing versions keep theirs (decode dispatches)
    scheme: Literal["worldcup-v1", "worldcup-v2"] = "worldcup-v2"
    # k, m and alpha of new key versions: a named preset (worldcup_core.config
    # WATERMARK_PRESETS; "paper" reproduces the paper), or these three set one by one.
    # The default is the service preset, chosen from the measured frontier (README).
    watermark_preset: Literal["frontier", "paper"] | None = None
    groups: Annotated[int, Field(ge=1, le=8)] = WATERMARK_PRESETS[SERVICE_PRESET].groups
    layers: Annotated[int, Field(ge=1, le=64)] = WATERMARK_PRESETS[SERVICE_PRESET].layers
    alpha: Annotated[float, Field(ge=0, le=10)] = WATERMARK_PRESETS[SERVICE_PRESET].alpha
    # the context width c of new key versions: how many preceding tokens seed a step.
    # Wider contexts make watermark stealing far sparser for the same budget (SECURITY.md,
    # "Forgery and framing"); every key version keeps its own, so texts issued under
    # another width decode as before.
    context_width: Annotated[int, Field(ge=1, le=8)] = SERVICE_CONTEXT_WIDTH
    default_num_bits: Annotated[int, Field(ge=1, le=64)] = 32
    # Deprecated (issue 35): carries no threshold and changes no answer. Every verdict,
    # is_watermarked and registry naming use the fixed 1e-6 of worldcup_core.assess; the
    # value only reaches the scorer's per-test DetectionResult, which no answer shows.
    significance: Annotated[float, Field(gt=0, lt=1)] = 0.01
    # A registry match is reported only above this posterior: neighbouring
    # entries can differ in one or two bits, and naming the wrong recipient is
    # worse than naming none (the soak run saw 2 such mix-ups in 322 at 16 bits).
    registry_min_confidence: Annotated[float, Field(ge=0, le=1)] = 0.95

    # detection's forward passes (issue #44): with an engine that offers them (hf, vllm),
    # every test weighs each token by its informativeness under the served model;
    # false, or the detector role: model-free (every answer says which). vllm reads them
    # from its prompt log-probs (top 64), at most min(weights_batch_texts,
    # max_batch_size // 2) texts and weights_batch_tokens tokens at once, in windows of
    # weights_max_tokens, and while generation runs one at a time, each followed by
    # generation's turn (weights_time_share; app/engines/vllm.py); the rest are hf's.
    # The hf engine runs them in batches of at most weights_batch_texts texts and
    # weights_batch_tokens padded tokens, between two generation steps, at
    # most weights_max_pending texts queued; texts longer than weights_max_tokens are
    # read in windows of that many tokens (capped at the model's context). While both
    # wait, detection takes weights_time_share of the engine thread's time, generation
    # the rest (app/engines/hf.py). weights_dtype: the forward passes' precision; auto
    # is a bfloat16 copy of the model where the device computes bfloat16 natively (AMX
    # or AVX512-BF16 CPUs, CUDA), else the model's own (worldcup_core/model_weights.py)
    detect_with_model: bool = True
    weights_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    weights_batch_texts: Annotated[int, Field(ge=1, le=256)] = 8
    weights_batch_tokens: Annotated[int, Field(ge=16)] = 1024
    weights_time_share: Annotated[float, Field(gt=0, lt=1)] = 0.5
    weights_max_pending: Annotated[int, Field(ge=1)] = 256
    weights_max_tokens: Annotated[int, Field(ge=16)] = 2048

    # serving limits
    max_batch_size: Annotated[int, Field(ge=1, le=256)] = 8
    max_queue: Annotated[int, Field(ge=1)] = 64
    max_new_tokens_limit: Annotated[int, Field(ge=1)] = 1024
    max_prompt_tokens: Annotated[int, Field(ge=1)] = 1536
    request_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    # a text of max_text_chars fits in any JSON spelling (see text_chars_limit)
    max_body_bytes: Annotated[int, Field(ge=1024)] = JSON_BYTES_PER_CHAR * 100_000 + BODY_HEADROOM
    max_text_chars: Annotated[int, Field(ge=1)] = 100_000
    idempotency_ttl_s: Annotated[int, Field(ge=1)] = 86_400
    # how long /v1/responses keeps a response for previous_response_id and GET
    responses_ttl_s: Annotated[int, Field(ge=1)] = 7 * 86_400
    drain_timeout_s: Annotated[float, Field(ge=0)] = 30.0
    cache_ttl_s: Annotated[float, Field(ge=0)] = 5.0  # tenant and key-version lookups

    # CPU work (tokenising, scoring, decoding) runs in a bounded thread pool, off
    # the event loop; beyond cpu_max_pending admitted requests (or one tenant's
    # cpu_max_pending_per_tenant) a request gets 503 at once. Tenants get fair
    # (round-robin) shares of the workers, batches run in chunks of about
    # cpu_chunk_chars characters; cpu_fair=false is the old first-come-first-served pool
    cpu_workers: Annotated[int, Field(ge=1, le=64)] = 4
    cpu_max_pending: Annotated[int, Field(ge=1)] = 64
    cpu_max_pending_per_tenant: Annotated[int, Field(ge=1)] = 32
    cpu_chunk_chars: Annotated[int, Field(ge=1)] = 16_000
    cpu_fair: bool = True

    # probe budgets: scoring queries about one text (by containment, SECURITY.md) per
    # tenant, all its keys together, within the window (verdict keys, full keys); beyond
    # them 429 probe_budget_exceeded; 0 = off. A day's window: the defaults are chosen
    # so that no strategy of `worldcup bench attack` removes a watermark in one day
    probe_window_s: Annotated[float, Field(gt=0)] = 86400.0
    probe_budget_verdict: Annotated[int, Field(ge=0)] = 20
    probe_budget_full: Annotated[int, Field(ge=0)] = 30
    # a `full` key's first probe_full_answers queries about one text within the window
    # are answered in full; later ones, as a verdict key's (`detail_reason`:
    # full_answers_spent), so a p-value is not an oracle to climb (SECURITY.md, the
    # patient oracle attacker). 0 = off: every answer in full
    probe_full_answers: Annotated[int, Field(ge=0)] = 3

    # client-chosen payloads (`payload` on /generate, `watermark.payload` on /v1): only
    # for keys holding the `fixed_payload` scope, granted to the tenant by an admin, and
    # each payload at most fixed_payload_repeats generations per key version within
    # fixed_payload_window_s (429 payload_repeats_exceeded). Many texts under one payload
    # are what a watermark-stealing attacker learns from (SECURITY.md, Forgery and framing)
    fixed_payload_repeats: Annotated[int, Field(ge=1)] = 16
    fixed_payload_window_s: Annotated[float, Field(gt=0)] = 30 * 86400.0
    # sealed (the default): each text under a chosen payload gets a registry entry that
    # records the chosen bits and carries the entry's keyed payload, so the chooser never
    # learns the carried bits. False: the text carries the chosen bits themselves (same
    # seed, same text; the releases before), recorded as a registry candidate: only for
    # deployments whose every fixed_payload key is trusted (SECURITY.md)
    seal_client_payloads: bool = True
    # count the contexts of every watermarked text returned, per tenant and key version,
    # in a count-min sketch in the store (worldcup_core.context_sketch; 4 MiB per tenant
    # key version once written): the memory of the spoof-artifact check, which reports
    # on every "watermarked" answer in the worldcup_spoof_artifact_checks_total metric
    # (it does not change verdicts: SECURITY.md, Forgery and framing). False: nothing is
    # counted, and the check reports "no_counts"
    count_contexts: bool = True
    # what a "flagged" check does: "count" (default: the metric only, no answer changes)
    # or "withhold_entry" (the verdict stands, but no registry entry is named: the
    # answer says registry_withheld). A gate an operator turns on once the metric shows
    # its cost on the deployment's own tenants (docs/operations.md)
    spoof_artifact_action: Literal["count", "withhold_entry"] = "count"

    # bulk scans and provenance
    max_batch_texts: Annotated[int, Field(ge=1, le=10_000)] = 1000
    max_batch_body_bytes: Annotated[int, Field(ge=1024)] = 16 * 1_048_576
    provenance_refresh_s: Annotated[float, Field(ge=0)] = 30.0
    # registry retention: how often the sweep runs (0: never; POST /admin/registry/sweep)
    registry_sweep_interval_s: Annotated[float, Field(ge=0)] = 3600.0

    # console cases (saved checks): forgotten after this many days (0 = kept until
    # deleted); a console batch upload holds at most console_batch_limit texts
    console_case_retention_days: Annotated[float, Field(ge=0)] = 90.0
    console_batch_limit: Annotated[int, Field(ge=1, le=1000)] = 200

    # per-tenant token bucket, shared by every replica through the store; 0 disables
    rate_limit_per_s: Annotated[float, Field(ge=0)] = 50.0
    rate_limit_burst: Annotated[int, Field(ge=1)] = 1000

    @model_validator(mode="after")
    def _apply_watermark_preset(self) -> Self:
        if self.watermark_preset is None:
            return self
        preset = WATERMARK_PRESETS[self.watermark_preset]
        named = {"groups": preset.groups, "layers": preset.layers, "alpha": preset.alpha}
        for field, value in named.items():
            if field in self.model_fields_set and getattr(self, field) != value:
                raise ValueError(
                    f"WORLDCUP_WATERMARK_PRESET={self.watermark_preset} sets {field}={value}; "
                    f"WORLDCUP_{field.upper()}={getattr(self, field)} contradicts it"
                )
            setattr(self, field, value)
        return self

    @model_validator(mode="after")
    def _check_spoof_artifact_gate(self) -> Self:
        if self.spoof_artifact_action == "withhold_entry" and not self.count_contexts:
            raise ValueError(
                "WORLDCUP_SPOOF_ARTIFACT_ACTION=withhold_entry needs "
                "WORLDCUP_COUNT_CONTEXTS=true (without counts no text is ever checked)"
            )
        return self

    @model_validator(mode="after")
    def _check_redis_cluster(self) -> Self:
        if self.redis_cluster and not self.redis_url:
            raise ValueError("WORLDCUP_REDIS_CLUSTER=true needs WORLDCUP_REDIS_URL (any node)")
        return self

    _throwaway: set[str] = PrivateAttr(default_factory=set)

    @model_validator(mode="after")
    def _load_secrets(self) -> Self:
        self.master_key = self._secret("master_key", self.master_key, self.master_key_file)
        self.admin_token = self._secret("admin_token", self.admin_token, self.admin_token_file)
        if _hex_key(self.master_key) is None:
            raise ValueError("WORLDCUP_MASTER_KEY must be 64 hex characters (32 bytes)")
        if self.master_key_previous_file is not None or self.master_key_previous is not None:
            previous = self._secret(
                "master_key_previous", self.master_key_previous, self.master_key_previous_file
            )
            if _hex_key(previous) is None:
                raise ValueError(
                    "WORLDCUP_MASTER_KEY_PREVIOUS must be 64 hex characters (32 bytes)"
                )
            self.master_key_previous = previous
        return self

    def _secret(self, name: str, value: SecretStr | None, path: Path | None) -> SecretStr:
        if path is not None:
            try:
                value = SecretStr(path.read_text(encoding="utf-8").strip())
            except OSError as exc:
                raise ValueError(
                    f"cannot read WORLDCUP_{name.upper()}_FILE: {exc.strerror}"
                ) from None
        raw = value.get_secret_value().strip() if value is not None else ""
        if raw.lower() in PLACEHOLDERS or raw.lower().startswith("changeme"):
            if self.env is not Environment.DEV:
                raise ValueError(
                    f"WORLDCUP_{name.upper()} is missing or a placeholder; set a real secret "
                    f"(or WORLDCUP_{name.upper()}_FILE), or WORLDCUP_ENV=dev for a throwaway one"
                )
            raw = secrets.token_hex(32)
            self._throwaway.add(name)
        return SecretStr(raw)

    @property
    def throwaway_secrets(self) -> frozenset[str]:
        """The secrets drawn at random for this process (dev mode): no other process
        shares them, so replicas cannot run on them (see app/serve.py)."""
        return frozenset(self._throwaway)

    @property
    def master_key_bytes(self) -> bytes:
        key = _hex_key(self.master_key)
        assert key is not None
        return key

    @property
    def previous_master_keys(self) -> tuple[bytes, ...]:
        key = _hex_key(self.master_key_previous)
        return () if key is None else (key,)

    @property
    def body_chars(self) -> int:
        """The longest string a body of ``max_body_bytes`` holds in any JSON spelling
        beside the request's other fields: no string limit may exceed it, or a string
        just over its limit would meet the body limit (413) before its own (422)."""
        return max(1, (self.max_body_bytes - BODY_HEADROOM) // JSON_BYTES_PER_CHAR)

    @property
    def text_chars_limit(self) -> int:
        """A text's limit as published and enforced: ``max_text_chars``, within the body."""
        return min(self.max_text_chars, self.body_chars)


def _hex_key(value: SecretStr | None) -> bytes | None:
    if value is None:
        return None
    try:
        key = bytes.fromhex(value.get_secret_value())
    except ValueError:
        return None
    return key if len(key) == 32 else None


@lru_cache
def get_settings() -> Settings:
    return Settings()
