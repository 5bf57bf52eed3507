"""Prometheus metrics. Labels are bounded: route templates, status codes, reasons.

Never a tenant, user or key label: those would leak who uses the service and
blow up cardinality.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class Metrics:
    """One registry per app instance, so tests can build apps side by side."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_duration = Histogram(
            "worldcup_request_duration_seconds",
            "HTTP request latency by route template and status code.",
            ["endpoint", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "worldcup_generate_time_to_first_token_seconds",
            "From accepting a generate request to its first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "worldcup_generate_inter_token_latency_seconds",
            "Time between consecutive tokens of one sequence.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "worldcup_generate_queue_time_seconds",
            "Time a generate request waited before joining the batch.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter(
            "worldcup_generated_tokens", "Tokens generated.", registry=r
        )
        self.rejections = Counter(
            "worldcup_request_rejections",
            "Requests refused before work started, by reason.",
            ["reason"],
            registry=r,
        )
        self.detections = Counter(
            "worldcup_detections",
            "Detect/decode verdicts (result: watermarked at the fixed p < 1e-6 of "
            "worldcup_core.assess, inconclusive, not_watermarked).",
            ["result"],
            registry=r,
        )
        self.probe_budget_exceeded = Counter(
            "worldcup_probe_budget_exceeded",
            "Detect/decode queries refused: over their text's probe budget, by detail level.",
            ["detail"],
            registry=r,
        )
        self.probe_full_answers_spent = Counter(
            "worldcup_probe_full_answers_spent",
            "Answers to a full key given as the verdict only: their text's full answers "
            "within the probe window were spent, by route.",
            ["route"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "worldcup_queue_depth", "Generate requests waiting for a batch slot.", registry=r
        )
        self.active_sequences = Gauge(
            "worldcup_active_sequences", "Sequences in the running batch.", registry=r
        )
        self.unwatermarked = Counter(
            "worldcup_unwatermarked_rows",
            "Rows the vLLM step could not watermark (a processor guard failed); "
            "their requests fail rather than return unwatermarked text.",
            registry=r,
        )
        self.watermark_faults = Counter(
            "worldcup_watermark_faults",
            "vLLM rows failed closed, by the processor guard that failed (placeholder, "
            "skipped_row, growth, shrink, outside_candidates, batch_layout).",
            ["reason"],
            registry=r,
        )
        self.voided_entries = Counter(
            "worldcup_registry_voided",
            "Registry entries voided because their generation could not be watermarked.",
            registry=r,
        )
        self.detection_batch = Histogram(
            "worldcup_detection_batch_seconds",
            "One batch of detection's forward passes (token weights), run between two "
            "generation steps.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        self.spoof_artifact = Counter(
            "worldcup_spoof_artifact_checks",
            "The spoof-artifact check on watermarked answers (app.services.artifact); it "
            "changes no verdict. route: detect (a tenant's /detect and /decode, batches "
            "included) or provenance (the admin's search). outcome: flagged (evidence in "
            "common contexts only), clear, one_group (nothing to compare) or unavailable "
            "(no counts).",
            ["route", "outcome"],
            registry=r,
        )
        self.statistic = Counter(
            "worldcup_detection_statistic",
            "Texts scored, by the statistic their answer took (model or model_free).",
            ["statistic"],
            registry=r,
        )
        self.batch_size = Histogram(
            "worldcup_generate_batch_size",
            "Rows per forward pass.",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
