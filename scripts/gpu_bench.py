"""Scheme v2's watermark against plain sampling on a GPU, with a random-initialised model.

No weights are needed: the model has a real architecture (Llama-3-8B's shape, bf16) and
random weights, so step times are true and the text is noise. One run reports, at each
batch size (default 1, 8, 64, 256):

* decoding through the project's loop (``worldcup_core.generation.generate``): plain, then
  watermarked on the fused Triton kernel and on the tensor path, then plain again (ms a
  step, tokens/s, watermarked/plain); the bit accuracy and the largest p-value of the
  watermarked texts; whether both paths sampled the same tokens;
* the step alone (``BatchedWorldCup.step`` on realistic rows): the tensor path, the fused
  kernel, and the fused kernel replayed from a CUDA graph, in us a step and a row, and the
  largest difference between the fused and the tensor path's q.

On a GPU (one prepared command, ~4-5 minutes on an H100 from an idle start; writes the
JSON report to --out as well as stdout, so the device tool brings it back):

    PYTHONUNBUFFERED=1 python3 scripts/gpu_bench.py --out "$OUT/gpu_bench.json"

On the CPU, to check the script before its first GPU run (a tiny model, two batch sizes,
a few tokens, Triton's interpreter for the fused kernel; every failure is fatal):

    .venv/bin/python scripts/gpu_bench.py --dry-run

On the GPU each section's failure is recorded in the report (``"error"``) and the run goes
on, so one broken part costs no other figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # worldcup_core from the checkout

if "--dry-run" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the CPU runs the kernel

import numpy as np  # noqa: E402
import torch  # noqa: E402

from worldcup_core import batched  # noqa: E402
from worldcup_core.batched import BatchedWorldCup, StepPath, warm_up  # noqa: E402
from worldcup_core.config import SamplingConfig, WatermarkConfig  # noqa: E402
from worldcup_core.generation import GenerationRequest, generate  # noqa: E402
from worldcup_core.message import Payload  # noqa: E402
from worldcup_core.prf import WatermarkKey  # noqa: E402
from worldcup_core.sampling import filter_logits_torch  # noqa: E402
from worldcup_core.scheme import WorldCup  # noqa: E402

ARCH: dict[str, dict[str, int]] = {
    "llama8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    },
    "llama1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128256,
    },
}
EOS, PAD, PROMPT = 128001, 128002, 64
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WATERMARKED = {"fused": StepPath.FUSED, "tensor": StepPath.TENSOR}


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


@contextmanager
def step_path(path: StepPath | None) -> Iterator[None]:
    saved = batched.FORCE_PATH
    batched.FORCE_PATH = path
    try:
        yield
    finally:
        batched.FORCE_PATH = saved


class Report:
    """The JSON report; sections that fail record their error (or raise, when strict)."""

    def __init__(self, strict: bool, out: Path | None) -> None:
        self.data: dict[str, Any] = {}
        self.strict, self.out = strict, out

    def section(self, key: str, into: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> None:
        start = time.perf_counter()
        try:
            into[key] = fn()
        except Exception as exc:
            if self.strict:
                raise
            into[key] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        into[key]["seconds"] = round(time.perf_counter() - start, 1)
        self.save()

    def save(self) -> None:
        if self.out is not None:
            self.out.write_text(json.dumps(self.data, indent=1))


def build(arch: str, lm_scale: float) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **ARCH[arch],
        max_position_embeddings=4096,
        rope_theta=500000.0,
        bos_token_id=128000,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32
    torch.set_default_dtype(dtype)
    with DEV:
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    # The init's logits are nearly flat; scaling lm_head sets how many candidates survive
    # top-k 50 / top-p 0.95 (reported as live_candidates), i.e. the watermark's work.
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_scale)
    return model.eval()


def prompts(batch: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 120000, size=PROMPT).tolist() for _ in range(batch)]


def run_loop(
    model: Any, batch: int, tokens: int, scheme: WorldCup | None, payloads: list[Payload]
) -> tuple[float, float, list[list[int]]]:
    """(ms a step, tokens/s, the texts) through the project's decoding loop."""
    requests = []
    for i, prompt in enumerate(prompts(batch, seed=1)):
        sampling = SamplingConfig(max_new_tokens=tokens, min_new_tokens=tokens, seed=1000 + i)
        payload = payloads[i] if scheme is not None else None
        requests.append(GenerationRequest(prompt, sampling, scheme, payload))
    sync()
    start = time.perf_counter()
    results = generate(model, requests, [EOS], PAD)
    sync()
    seconds = time.perf_counter() - start
    texts = [r.token_ids for r in results]
    return seconds / tokens * 1e3, sum(map(len, texts)) / seconds, texts


def bit_stats(
    scheme: WorldCup, payloads: list[Payload], texts: list[list[int]], bits: int
) -> tuple[float, float]:
    """Mean bit accuracy and the largest detection p-value of ``texts``."""
    decoded = scheme.decode_many(texts, bits)
    accuracy = [
        np.mean([a == b for a, b in zip(d.bits, p.bits, strict=True)])
        for d, p in zip(decoded, payloads, strict=False)
    ]
    return float(np.mean(accuracy)), float(max(d.detection.p_value for d in decoded))


def decoding(
    model: Any, batch: int, tokens: int, scheme: WorldCup, payloads: list[Payload], bits: int
) -> dict[str, Any]:
    plain_ms, plain_tps, _ = run_loop(model, batch, tokens, None, payloads)
    row: dict[str, Any] = {}
    texts: dict[str, list[list[int]]] = {}
    for name, path in WATERMARKED.items():
        with step_path(path):
            ms, tps, texts[name] = run_loop(model, batch, tokens, scheme, payloads)
        accuracy, worst_p = bit_stats(scheme, payloads[:batch], texts[name], bits)
        row[name] = {
            "step_ms": round(ms, 3),
            "tokens_per_s": round(tps, 1),
            "bit_accuracy": round(accuracy, 4),
            "max_p": worst_p,
        }
    again_ms, again_tps, _ = run_loop(model, batch, tokens, None, payloads)
    plain = (plain_ms + again_ms) / 2  # plain before and after the watermarked runs
    row["plain"] = {
        "step_ms": round(plain, 3),
        "tokens_per_s": round((plain_tps + again_tps) / 2, 1),
        "drift": round(again_ms / plain_ms, 3),
    }
    for name in WATERMARKED:
        row[name]["vs_plain_tokens_per_s"] = round(
            row[name]["tokens_per_s"] / row["plain"]["tokens_per_s"], 4
        )
        row[name]["added_step_pct"] = round(100 * (row[name]["step_ms"] / plain - 1), 2)
    same = sum(a == b for a, b in zip(texts["fused"], texts["tensor"], strict=True))
    row["fused_and_tensor_same_texts"] = f"{same}/{batch}"
    return row


def step_rows(model: Any, batch: int, scheme: WorldCup, payloads: list[Payload]) -> Any:
    """A batch of ``batch`` v2 rows past their first c tokens, and realistic candidates:
    the model's own filtered distribution (top-k 50, top-p 0.95) after a prompt."""
    rows = BatchedWorldCup(DEV, capacity=batch)
    rows.reserve(batch, history=512)
    for slot in range(batch):
        rows.set_row(slot, scheme, payloads[slot])
    slots = torch.arange(batch, device=DEV)
    rng = np.random.default_rng(5)
    for _ in range(16):
        rows.append(slots, torch.from_numpy(rng.integers(1000, 120000, batch)).to(DEV))
    with torch.inference_mode():
        ids = torch.tensor(prompts(batch, seed=3), device=DEV)
        logits = model(input_ids=ids).logits[:, -1, :]
        cand, probs = filter_logits_torch(logits, [1.0] * batch, [50] * batch, [0.95] * batch)
    width = int((probs > 0).sum(dim=1).max())
    return rows, slots, cand[:, :width].contiguous(), probs[:, :width].contiguous()


def time_us(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def step_alone(
    model: Any, batch: int, scheme: WorldCup, payloads: list[Payload], repeats: int
) -> dict[str, Any]:
    rows, slots, cand, probs = step_rows(model, batch, scheme, payloads)
    out: dict[str, Any] = {
        "live_candidates": round(float((probs > 0).sum(dim=1).float().mean()), 1)
    }
    q: dict[str, torch.Tensor] = {}
    for name, path in WATERMARKED.items():
        with step_path(path):
            q[name] = rows.step(slots, cand, probs)
            us = time_us(lambda: rows.step(slots, cand, probs), repeats)
        out[f"{name}_us"] = round(us, 1)
        out[f"{name}_us_per_row"] = round(us / batch, 2)
    out["fused_vs_tensor_max_abs_diff"] = float((q["fused"] - q["tensor"]).abs().max())
    if DEV.type != "cuda":
        out["fused_graph_us"] = "skipped: no CUDA device"
        return out
    with step_path(StepPath.FUSED):  # the fused step replayed from a CUDA graph
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                rows.step(slots, cand, probs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = rows.step(slots, cand, probs)
        graph.replay()
        sync()
        out["fused_graph_equals_eager"] = bool(torch.equal(replayed, q["fused"]))
        us = time_us(graph.replay, repeats)
    out["fused_graph_us"] = round(us, 1)
    out["fused_graph_us_per_row"] = round(us / batch, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama8b", choices=sorted(ARCH))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per text")
    parser.add_argument("--bits", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50, help="timed calls of the step alone")
    parser.add_argument("--lm-scale", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU check: tiny model, batches 1 and 2, 3 tokens, 2 repeats, failures fatal",
    )
    args = parser.parse_args()
    if args.dry_run:
        args.arch, args.batches, args.tokens, args.repeats = "tiny", [1, 2], 3, 2
    report = Report(strict=args.dry_run, out=args.out)
    import triton

    report.data.update(
        device=torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
        torch=torch.__version__,
        triton=triton.__version__,
        interpreter=os.environ.get("TRITON_INTERPRET") == "1",
        arch=args.arch,
        tokens=args.tokens,
        bits=args.bits,
        default_path=str(batched.step_path(DEV)),
    )
    start = time.perf_counter()
    model = build(args.arch, args.lm_scale)
    report.data["build_s"] = round(time.perf_counter() - start, 1)
    scheme = WorldCup(WatermarkKey.from_hex("11" * 32), WatermarkConfig())  # v2, k=2, m=30
    rng = np.random.default_rng(7)
    payloads = [Payload.random(args.bits, rng) for _ in range(max(args.batches))]
    with step_path(StepPath.FUSED):
        report.data["warm_up_s"] = round(warm_up(DEV), 1)  # the kernel's compiles
    run_loop(model, 2, 4, None, payloads)  # the model's kernels and the allocator
    for path in WATERMARKED.values():
        with step_path(path):
            run_loop(model, 2, 4, scheme, payloads)
    report.data["batches"] = {}
    for batch in args.batches:
        row: dict[str, Any] = {}
        report.data["batches"][str(batch)] = row
        report.section(
            "decoding",
            row,
            lambda b=batch: decoding(model, b, args.tokens, scheme, payloads, args.bits),
        )
        report.section(
            "step_alone", row, lambda b=batch: step_alone(model, b, scheme, payloads, args.repeats)
        )
        print(json.dumps({"batch": batch, **row}), flush=True)  # noqa: T201
    report.data["total_s"] = round(time.perf_counter() - start, 1)
    report.save()
    print(json.dumps(report.data, indent=1))  # noqa: T201


if __name__ == "__main__":
    main()
