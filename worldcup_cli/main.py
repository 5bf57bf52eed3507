"""The ``worldcup`` command line: keygen, generate, decode, detect, bench.

Bad input gets one line on stderr and exit code 2, in every command: a path the
user named that cannot be read or written included (see :func:`_command`);
``--json`` prints one JSON object on stdout for scripts. Decoding and detection
read the text on stdin and need only the tokenizer, never the model weights.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from worldcup_cli.store_admin import store_app
from worldcup_core import (
    SCHEME_V2,
    Payload,
    SamplingConfig,
    Variant,
    WatermarkConfig,
    WatermarkKey,
    WorldCup,
)
from worldcup_core.assess import TestP, answer_tests, assess
from worldcup_core.config import MAX_PAYLOAD_BITS
from worldcup_core.detector_model import model_applies, model_decode_many
from worldcup_core.detector_weighted import verdict_log_p
from worldcup_core.scheme import WatermarkScheme
from worldcup_core.verdict import verdict_sentence

app = typer.Typer(
    help="WorldCup multi-bit watermarking for LLM text.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(store_app, name="store")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
KeyFileOpt = Annotated[
    Path, typer.Option("--key-file", help="File holding the 64-hex-character watermark key.")
]
KOpt = Annotated[int, typer.Option("--k", help="Groups of g-value families (bits per token).")]
LayersOpt = Annotated[int, typer.Option("--layers", help="Tournament layers m.")]
ContextWidthOpt = Annotated[
    int,
    typer.Option(
        "--context-width",
        help="Context width c: the preceding tokens that seed a step (the key version's "
        "own; the service gives new keys WORLDCUP_CONTEXT_WIDTH).",
    ),
]
AlphaOpt = Annotated[float, typer.Option("--alpha", help="Watermark strength alpha.")]
SchemeOpt = Annotated[str, typer.Option("--scheme", help="worldcup or a baseline (mpac, ...).")]
VersionOpt = Annotated[
    str,
    typer.Option(
        "--scheme-version",
        help="WorldCup's PRF and scoring: worldcup-v2 (default) or worldcup-v1 (texts "
        "issued with v1 keys).",
    ),
]
VariantOpt = Annotated[
    str, typer.Option("--variant", help="worldcup, no-entropy, no-subtraction, random-second.")
]
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", help="Local HF model directory or model id (default: embedded)."),
]


def fail(message: str) -> NoReturn:
    """One line, exit code 2: the contract for bad input."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def os_error_message(exc: OSError) -> str:
    """``cannot use PATH: reason`` for a path the user named (missing, a folder, no access)."""
    reason = exc.strerror or type(exc).__name__
    return f"cannot use {exc.filename}: {reason}" if exc.filename else reason


F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Every command's safety net: an OSError on a path the user gave (an output folder
    that does not exist, a directory where a file was expected, no permission) is one
    ``error:`` line and exit 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            fail(os_error_message(exc))

    return wrapper  # type: ignore[return-value]


def flowed_help(fn: Callable[..., Any]) -> str | None:
    """The docstring as help: each paragraph's lines joined, so the help wraps to the
    terminal instead of breaking where the source did."""
    doc = inspect.getdoc(fn)
    if not doc:
        return None
    return "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))


def _command(name: str | None = None, **kwargs: Any) -> Callable[[F], F]:
    """``app.command`` with :func:`user_errors` around the command."""

    def register(fn: F) -> F:
        app.command(name, **{"help": flowed_help(fn), **kwargs})(user_errors(fn))
        return fn

    return register


bench_app = typer.Typer(
    help="Benchmarks: `worldcup bench NAME` (NAME --help for its options).",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(bench_app, name="bench")


def deprecated_alias(old: str, new: str, fn: F) -> F:
    """``fn`` under its old name: one line on stderr names the new one, then it runs."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        typer.echo(
            f"warning: `worldcup {old}` is deprecated and goes in the next release; "
            f"use `worldcup {new}`",
            err=True,
        )
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _bench(name: str, **kwargs: Any) -> Callable[[F], F]:
    """``worldcup bench NAME``; the old top-level ``worldcup bench-NAME`` stays one
    release as a hidden alias that says it is deprecated."""

    def register(fn: F) -> F:
        kwargs.setdefault("help", flowed_help(fn))
        bench_app.command(name, **kwargs)(user_errors(fn))
        old = f"bench-{name}"
        alias = deprecated_alias(old, f"bench {name}", fn)
        app.command(old, hidden=True, **kwargs)(user_errors(alias))
        return fn

    return register


def _version(value: bool) -> None:
    if value:
        try:
            version = importlib.metadata.version("worldcup")
        except importlib.metadata.PackageNotFoundError:  # a source tree, not installed
            version = "unknown (not installed)"
        typer.echo(f"worldcup {version}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_version, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """WorldCup multi-bit watermarking for LLM text."""


def _read_key(path: Path) -> WatermarkKey:
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        fail(f"key file not found: {path}")
    except (OSError, UnicodeDecodeError):
        fail(f"key file is unreadable or not hex text: {path}")
    try:
        return WatermarkKey.from_hex(text)
    except ValueError as exc:
        fail(f"malformed key file {path}: {exc}")


def _scheme(
    key: WatermarkKey,
    scheme: str,
    k: int,
    layers: int,
    alpha: float,
    variant: str,
    version: str = SCHEME_V2,
    context_width: int = 2,
) -> Any:
    from worldcup_core.baselines import BASELINES, build_baseline

    try:
        if scheme == "worldcup":
            cfg = WatermarkConfig(
                groups=k,
                layers=layers,
                alpha=alpha,
                context_width=context_width,
                variant=Variant(variant),
                version=version,
            )
            return WorldCup(key, cfg)
        if scheme in BASELINES:
            return build_baseline(scheme, key)
    except ValueError as exc:
        fail(str(exc))
    known = ", ".join(sorted(BASELINES))
    fail(f"unknown scheme {scheme!r}; choose worldcup or a baseline: {known}")


def _stdin_text() -> str:
    data = sys.stdin.buffer.read()
    text = data.decode("utf-8", errors="replace")
    if not text.strip():
        fail("no text on stdin: pipe the text to decode or detect")
    return text


WithModelOpt = Annotated[
    bool,
    typer.Option(
        "--with-model",
        help="Load the model (--model, default: embedded) and weigh every scored token by "
        "its informativeness under it, as a service with the model loaded does (statistic "
        "'model'; worldcup-v2 keys). Default: the tokenizer only, statistic 'model_free'.",
    ),
]


def _token_weights(ids: list[int], model: str | None) -> Any:
    """The text's token weights under the model (one forward pass), as the service's (in
    its precision: ``WORLDCUP_WEIGHTS_DTYPE``, default ``auto``)."""
    from worldcup_core.model_weights import model_token_weights, weights_model
    from worldcup_core.models import ModelLoadError, load_model

    try:
        lm = load_model(model)
        weigher = weights_model(lm.model, os.environ.get("WORLDCUP_WEIGHTS_DTYPE", "auto"))
    except (ModelLoadError, ValueError) as exc:
        fail(str(exc))
    return model_token_weights(weigher, [ids], pad_token_id=lm.pad_token_id)[0]


def _tokenize(text: str, model: str | None) -> list[int]:
    from worldcup_core.models import ModelLoadError, load_tokenizer

    try:
        tokenizer = load_tokenizer(model)
    except ModelLoadError as exc:
        fail(str(exc))
    ids: list[int] = tokenizer(text, add_special_tokens=False).input_ids
    return ids


def _check_model(model: str | None) -> None:
    """A ``--model`` (or WORLDCUP_MODEL_PATH) that names nothing loadable fails here, in one
    line, not as a traceback from a server's startup; the embedded default always loads."""
    if not model:
        return
    from worldcup_core.models import ModelLoadError, resolve_model_dir

    try:
        resolve_model_dir(model, None, need_model=False)
    except ModelLoadError as exc:
        fail(str(exc))


def _emit(as_json: bool, payload: dict[str, Any], human: str) -> None:
    typer.echo(json.dumps(payload) if as_json else human)


@_command()
def keygen(
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the key here (mode 600).")
    ] = None,
) -> None:
    """Print a new random 32-byte watermark key as hex."""
    key = WatermarkKey.generate()
    if out is None:
        typer.echo(key.hex())
        return
    if out.exists():
        fail(f"refusing to overwrite existing key file {out}")
    fd = os.open(out, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        os.fchmod(fd, 0o600)  # 0600 whatever the umask
        f.write(key.hex() + "\n")
    typer.echo(f"wrote key {key.key_id} to {out}", err=True)


@_command()
def generate(
    key_file: KeyFileOpt,
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt text.")],
    bits: Annotated[str, typer.Option("--bits", help="Payload as a 0/1 string.")],
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap the prompt in the chat template.")
    ] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 128,
    min_new_tokens: Annotated[int, typer.Option("--min-new-tokens")] = 0,
    temperature: Annotated[float, typer.Option("--temperature")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k")] = 50,
    top_p: Annotated[float, typer.Option("--top-p")] = 0.95,
    no_repeat_ngram_size: Annotated[int, typer.Option("--no-repeat-ngram-size")] = 0,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    k: KOpt = 2,
    layers: LayersOpt = 30,
    context_width: ContextWidthOpt = 2,
    alpha: AlphaOpt = 1.2,
    variant: VariantOpt = "worldcup",
    scheme: SchemeOpt = "worldcup",
    scheme_version: VersionOpt = SCHEME_V2,
    model: ModelOpt = None,
    device: Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:1, ...")] = "cpu",
    dtype: Annotated[
        str, typer.Option("--dtype", help="auto, float32, bfloat16, float16")
    ] = "auto",
    as_json: JsonOpt = False,
    no_progress: Annotated[
        bool, typer.Option("--no-progress", help="No progress bar on stderr.")
    ] = False,
) -> None:
    """Generate text from a prompt with the payload embedded (progress on stderr)."""
    from worldcup_core.generation import GenerationRequest
    from worldcup_core.generation import generate as run_generation
    from worldcup_core.models import ModelLoadError, load_model

    key = _read_key(key_file)
    if no_progress:  # transformers' own weight-loading bar too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        payload = Payload.from_bits(bits)
        sampling = SamplingConfig(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            no_repeat_ngram_size=no_repeat_ngram_size,
            seed=seed,
        )
    except ValueError as exc:
        fail(str(exc))
    if not prompt.strip():
        fail("the prompt is empty")
    wm: WatermarkScheme = _scheme(
        key, scheme, k, layers, alpha, variant, scheme_version, context_width
    )
    try:
        lm = load_model(model, device=device, dtype=dtype)
    except ModelLoadError as exc:
        fail(str(exc))
    tok = lm.tokenizer
    if chat:
        if not getattr(tok, "chat_template", None):
            fail("this model has no chat template; drop --chat")
        prompt_ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
    else:
        prompt_ids = tok(prompt, add_special_tokens=False).input_ids
    start = time.perf_counter()
    with TokenProgress(not no_progress, max_new_tokens) as bar:
        (result,) = run_generation(
            lm.model,
            [GenerationRequest(list(prompt_ids), sampling, wm, payload)],
            lm.eos_token_ids,
            lm.pad_token_id,
            on_token=lambda _index, _token: bar.advance(),
        )
    seconds = time.perf_counter() - start
    text = tok.decode(result.token_ids, skip_special_tokens=True)
    out = {
        "text": text,
        "token_ids": result.token_ids,
        "bits": payload.bits,
        "num_tokens": len(result.token_ids),
        "finish_reason": result.finish_reason,
        "scheme": wm.version,
        "key_id": key.key_id,
        "model": lm.model_id,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(len(result.token_ids) / seconds, 2) if seconds else None,
    }
    _emit(as_json, out, text)


class TokenProgress:
    """Tokens generated out of ``--max-new-tokens``, with tokens/s and elapsed time, as a
    rich bar on stderr (stdout stays the text or the JSON object)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total
        self._progress: Any = None
        self._task: Any = None
        self._started = time.perf_counter()
        self.done = 0

    def __enter__(self) -> TokenProgress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("generate"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("tokens {task.fields[rate]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self._progress.start()
            self._task = self._progress.add_task("generate", total=self.total, rate="")
            self._started = time.perf_counter()
        return self

    def advance(self) -> None:
        self.done += 1
        if self._progress is not None:
            rate = self.done / max(time.perf_counter() - self._started, 1e-9)
            self._progress.update(self._task, advance=1, rate=f"{rate:.1f}/s")

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


@_command()
def decode(
    key_file: KeyFileOpt,
    num_bits: Annotated[int, typer.Option("--num-bits", help="Payload length in bits.")],
    k: KOpt = 2,
    layers: LayersOpt = 30,
    context_width: ContextWidthOpt = 2,
    variant: VariantOpt = "worldcup",
    scheme: SchemeOpt = "worldcup",
    scheme_version: VersionOpt = SCHEME_V2,
    list_size: Annotated[int, typer.Option("--list-size", help="Alternatives to list.")] = 5,
    model: ModelOpt = None,
    with_model: WithModelOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Recover the payload from text on stdin."""
    key = _read_key(key_file)
    if not 1 <= num_bits <= MAX_PAYLOAD_BITS:
        fail(f"--num-bits must be in 1..{MAX_PAYLOAD_BITS}, got {num_bits}")
    if list_size < 1:
        fail(f"--list-size must be >= 1, got {list_size}")
    wm: WatermarkScheme = _scheme(
        key, scheme, k, layers, 1.2, variant, scheme_version, context_width
    )
    ids = _tokenize(_stdin_text(), model)
    weighted = with_model and isinstance(wm, WorldCup) and model_applies(wm.config)
    if weighted:
        assert isinstance(wm, WorldCup)
        weights = _token_weights(ids, model)
        result = model_decode_many(wm.key, wm.config, [ids], num_bits, [weights], list_size)[0]
    else:
        result = wm.decode(ids, num_bits, list_size=list_size)
    det = result.detection
    out = {
        "statistic": "model" if weighted else "model_free",
        "bits": result.bits,
        "bit_confidence": [
            {"z": round(z, 3), "p_value": p}
            for z, p in zip(result.bit_z, result.bit_p_values, strict=True)
        ],
        "erasures": list(result.erasures),
        "p_value": det.p_value,
        "z_score": det.z_score,
        "is_watermarked": det.is_watermarked,
        "num_tokens": det.num_tokens,
        "num_scored_tokens": det.num_scored_tokens,
        "position_token_counts": list(result.position_token_counts),
        "alternatives": [asdict(a) for a in result.alternatives],
    }
    human = (
        f"bits {result.bits}  p={det.p_value:.3g}  z={det.z_score:.2f}  "
        f"scored {det.num_scored_tokens}/{det.num_tokens} tokens"
        + (f"  erasures {list(result.erasures)}" if result.erasures else "")
        + "\n"
        + bit_confidence_table(result.bits, result.bit_z, result.bit_p_values)
    )
    _emit(as_json, out, human)


def bit_confidence_table(
    bits: str, bit_z: Sequence[float], bit_p: Sequence[float], per_line: int = 4
) -> str:
    """Per-bit confidence, four bits a line: position, value (``?`` an erasure), the
    bit's z and its p-value. z is the evidence for the value shown, ``|agree -
    disagree| / sqrt(trials)`` over the g-value trials scored on that bit: never negative
    (the value carries the direction), 0 for an erasure."""
    cells = [
        f"{i:>3} {b}  z {z:5.2f}  p {p:<8.2g}"
        for i, (b, z, p) in enumerate(zip(bits, bit_z, bit_p, strict=True))
    ]
    rows = [" | ".join(cells[i : i + per_line]) for i in range(0, len(cells), per_line)]
    return "per-bit confidence (bit, value, z, p):\n" + "\n".join(r.rstrip() for r in rows)


CLI_DEFAULT_NUM_BITS = 32  # the service's default_num_bits


@_command()
def detect(
    key_file: KeyFileOpt,
    num_bits: Annotated[
        int | None, typer.Option("--num-bits", help="Payload length if known (more power).")
    ] = None,
    k: KOpt = 2,
    layers: LayersOpt = 30,
    context_width: ContextWidthOpt = 2,
    variant: VariantOpt = "worldcup",
    scheme: SchemeOpt = "worldcup",
    scheme_version: VersionOpt = SCHEME_V2,
    significance: Annotated[
        float,
        typer.Option(
            "--significance",
            help="Deprecated: carries no threshold. The verdict and is_watermarked use the "
            "fixed 1e-6 level (worldcup_core.assess).",
        ),
    ] = 0.01,
    model: ModelOpt = None,
    with_model: WithModelOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Is the text on stdin watermarked with this key? One verdict, as the service's for
    a tenant with this one key and no registry: the message-free test and the test at
    the payload length (--num-bits, else the service's default 32), weighted-Bonferroni
    combined (worldcup_core.assess). Model-free unless --with-model."""
    key = _read_key(key_file)
    if num_bits is not None and not 1 <= num_bits <= MAX_PAYLOAD_BITS:
        fail(f"--num-bits must be in 1..{MAX_PAYLOAD_BITS}, got {num_bits}")
    if not 0.0 < significance < 1.0:
        fail(f"--significance must be in (0, 1), got {significance}")
    wm: WatermarkScheme = _scheme(
        key, scheme, k, layers, 1.2, variant, scheme_version, context_width
    )
    ids = _tokenize(_stdin_text(), model)
    det = wm.detect(ids, num_bits=None, significance=significance)
    length = num_bits or CLI_DEFAULT_NUM_BITS
    weighted = with_model and isinstance(wm, WorldCup) and model_applies(wm.config)
    if isinstance(wm, WorldCup):  # the verdict's statistics, as the service's
        weights = [_token_weights(ids, model)] if weighted else None
        free = math.exp(float(verdict_log_p(wm, [ids], None, weights)[0]))
        known = math.exp(float(verdict_log_p(wm, [ids], length, weights)[0]))
    else:
        free, known = det.p_value, wm.detect(ids, num_bits=length).p_value
    tests = [TestP("detect", free), TestP("decode", known, length)]
    found = assess(tests, 1, "this key file (1 key)", det.num_scored_tokens)
    out = {  # the API's answer shape: one p-value, the tests nested (docs/api.md)
        "verdict": found.verdict,
        "reason": found.reason,
        "tokens_needed": found.tokens_needed,
        "verdict_statistic": found.statistic,
        "p_value": found.p_value,
        "threshold": found.threshold,
        "keys_searched": found.keys_searched,
        "statistic": "model" if weighted else "model_free",
        "is_watermarked": found.is_watermarked,
        "num_scored_tokens": det.num_scored_tokens,
        "num_tokens": det.num_tokens,
        "tests": answer_tests(found),
        "z_score": det.z_score,  # deprecated, as the API's: the message-free test's z
        "paper_z_score": det.paper_z_score,
    }
    sentence = verdict_sentence(
        found.verdict, found.statistic, found.p_value, det.num_scored_tokens
    )
    _emit(
        as_json,
        out,
        f"{sentence}  z={det.z_score:.2f}  scored {det.num_scored_tokens}/{det.num_tokens} tokens",
    )


QuickOpt = Annotated[bool, typer.Option("--quick", help="Fewer tokens and texts.")]


def bench_speed(quick: QuickOpt = False, as_json: JsonOpt = False) -> None:
    """Encoding overhead and decoding throughput, measured side by side."""
    from worldcup_cli.bench import format_bench, run_bench

    def progress(msg: str) -> None:
        typer.echo(msg, err=True)

    result = run_bench(quick=quick, progress=progress)
    _emit(as_json, result, format_bench(result))


bench_app.command("speed", help=flowed_help(bench_speed))(user_errors(bench_speed))


@bench_app.callback(invoke_without_command=True)
def _bench_group(
    ctx: typer.Context,
    quick: Annotated[bool, typer.Option("--quick", hidden=True)] = False,
    as_json: Annotated[bool, typer.Option("--json", hidden=True)] = False,
) -> None:
    """Benchmarks: `worldcup bench NAME` (NAME --help for its options)."""
    if ctx.invoked_subcommand is not None:
        if quick or as_json:
            name = ctx.invoked_subcommand
            fail(f"--quick and --json go after the benchmark's name: worldcup bench {name} ...")
        return
    # `worldcup bench --quick`, as before the group: the speed bench, for one release
    typer.echo(
        "warning: `worldcup bench` without a benchmark's name is deprecated and goes in the "
        "next release; use `worldcup bench speed`",
        err=True,
    )
    bench_speed(quick, as_json)


@_command("eval-merge")
def eval_merge(
    other: Annotated[Path, typer.Argument(help="results.json of a second run, same protocol.")],
    into: Annotated[Path, typer.Option("--into", help="The results.json to add to.")] = Path(
        "docs/results/results.json"
    ),
    schemes: Annotated[str, typer.Option("--schemes", help="Schemes whose cells to add.")] = "",
) -> None:
    """Add a second run's cells (a preset evaluated apart, from the same cache) to the
    one results file, after checking both runs measured the same thing."""
    from worldcup_eval.cache import write_text_atomic
    from worldcup_eval.merge import merge_results

    names = [s for s in schemes.split(",") if s]
    try:
        merged = merge_results(
            json.loads(into.read_text(encoding="utf-8")),
            json.loads(other.read_text(encoding="utf-8")),
            names,
        )
    except (OSError, ValueError, KeyError) as e:
        raise typer.BadParameter(str(e)) from None
    write_text_atomic(into, json.dumps(merged, indent=1, sort_keys=True) + "\n")
    typer.echo(f"added {merged['merged'][-1]['cells']} cells of {', '.join(names)} to {into}")


@_bench("decoding")
def bench_decoding(
    texts: Annotated[int, typer.Option(min=10, max=100_000, help="Texts to decode.")] = 10_000,
    as_json: JsonOpt = False,
) -> None:
    """Decode+detect throughput on one core, like for like: v1 and v2, one text a call
    (as POST /decode runs it) and 1000 texts a call (the bench's decoding part alone)."""
    from worldcup_cli.bench import (
        TEXT_TOKENS,
        default_data_dir,
        format_decoding_bench,
        load_human_texts,
        token_chunks,
    )
    from worldcup_cli.bench import bench_decoding as run
    from worldcup_core.models import load_tokenizer

    tokenizer = load_tokenizer()
    chunks = token_chunks(tokenizer, load_human_texts(default_data_dir()), TEXT_TOKENS)
    result = run(tokenizer, texts, chunks, scan_texts=texts // 4)
    _emit(as_json, result, format_decoding_bench(result))


@_bench("calibration")
def bench_calibration(
    texts: Annotated[int, typer.Option(min=100, max=10_000_000, help="Null samples.")] = 100_000,
    per_key: Annotated[int, typer.Option(min=1, help="Chunks per fresh random key.")] = 8,
    registry_size: Annotated[int, typer.Option(min=1, help="Issued entries per key.")] = 20,
    seed: Annotated[int | None, typer.Option(help="Key seed (default: OS randomness).")] = None,
    statistic: Annotated[
        str,
        typer.Option(
            help="model_free, or model: every chunk's tokens weighted by the embedded "
            "model (from the chunk alone, never the key), as the HF service scores."
        ),
    ] = "model_free",
    model_texts: Annotated[
        int,
        typer.Option(
            min=0,
            help="Also this many unwatermarked answers of the embedded model (T 0.7, "
            "ELI5 questions) as null texts, beside the human chunks.",
        ),
    ] = 0,
    joint: Annotated[
        int,
        typer.Option(min=0, help="Also this many null collections read together (0: none)."),
    ] = 0,
    joint_size: Annotated[int, typer.Option(min=2, help="Texts per collection.")] = 5,
    chunks_used: Annotated[
        int | None,
        typer.Option(
            "--chunks",
            min=10,
            help="Use only this many human chunks (drawn at random; every pair still has "
            "its own fresh key): fewer forward passes under --statistic model.",
        ),
    ] = None,
    joint_groups: Annotated[
        int,
        typer.Option(min=0, help="Of the collections, this many also search 20 users x 5 entries."),
    ] = 1000,
    threads: Annotated[
        int, typer.Option(min=1, help="torch threads (more oversubscribe a busy machine).")
    ] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Null calibration of the one verdict's p-value (worldcup_core.assess): human text
    (and unwatermarked model text) under many random keys, the tail rate of p < t against
    t, down to 1e-4, with SE; with --joint, the joint test of texts read together and
    its group search too."""
    import numpy as np
    from rich.console import Console
    from rich.progress import Progress

    from worldcup_cli.bench import default_data_dir
    from worldcup_cli.calibration_bench import (
        eli5_questions,
        human_chunks,
        joint_table,
        model_null_texts,
        null_joint_p_values,
        null_p_values,
        table,
        tail_rows,
    )
    from worldcup_core.models import load_model, load_tokenizer

    if statistic not in ("model_free", "model"):
        fail(f"--statistic: model_free or model, got {statistic!r}")
    data_dir = default_data_dir()
    started = time.perf_counter()
    lm = None
    if statistic == "model" or model_texts:
        import torch

        torch.set_num_threads(threads)
        lm = load_model(None)
    chunks = human_chunks(data_dir, lm.tokenizer if lm is not None else load_tokenizer())
    if chunks_used is not None and chunks_used < len(chunks):
        keep = np.random.default_rng(seed).choice(len(chunks), chunks_used, replace=False)
        chunks = [chunks[int(i)] for i in sorted(keep)]
    sources = {"human": len(chunks)}
    with Progress(console=Console(stderr=True), transient=True) as bar:
        if model_texts:
            assert lm is not None
            task = bar.add_task("unwatermarked model texts", total=model_texts)
            chunks += model_null_texts(
                lm,
                eli5_questions(data_dir),
                model_texts,
                progress=lambda n: bar.advance(task, n),
            )
            sources["model"] = model_texts
        weights = None
        if statistic == "model":
            assert lm is not None
            from worldcup_core.model_weights import model_token_weights, weights_model

            task = bar.add_task("model weights", total=len(chunks))
            weigher = weights_model(lm.model)  # as the service: bfloat16 where native
            weights = []
            for start in range(0, len(chunks), 64):
                weights += model_token_weights(
                    weigher, chunks[start : start + 64], pad_token_id=lm.pad_token_id
                )
                bar.advance(task, len(chunks[start : start + 64]))
        task = bar.add_task("null (text, key) pairs", total=texts)
        sample = null_p_values(
            chunks,
            texts,
            seed,
            per_key,
            registry_size,
            weights=weights,
            progress=lambda n: bar.advance(task, n),
        )
        together = None
        if joint:
            task = bar.add_task("null collections", total=joint)
            together = null_joint_p_values(
                chunks,
                joint,
                joint_size,
                seed=None if seed is None else seed + 1,
                weights=weights,
                progress=lambda n: bar.advance(task, n),
                searched=joint_groups,
            )
    result: dict[str, Any] = {
        "statistic": statistic,
        "null_texts": sources,
        "texts": len(sample.combined),
        "keys": sample.keys,
        **{
            name: tail_rows(values)
            for name, values in (
                ("verdict", sample.combined),
                ("detect", sample.detect),
                ("decode", sample.decode),
                ("registry", sample.registry),
            )
        },
    }
    text = f"statistic: {statistic}; null texts: {sources}\n" + table(sample)
    if together is not None:
        result["joint"] = {
            "collections": together.collections,
            "size": together.size,
            "groups": together.groups,
            "searched": len(together.group),
            "test": tail_rows(together.joint),
            "detect": tail_rows(together.detect),
            "decode": tail_rows(together.decode),
            "group": tail_rows(together.group) if len(together.group) else None,
        }
        text += "\n\n" + joint_table(together)
    result["seconds"] = round(time.perf_counter() - started, 1)
    _emit(as_json, result, text)


@_bench("first-use")
def bench_first_use(
    texts: Annotated[int, typer.Option(min=1, max=100, help="Prompts answered.")] = 100,
    per_tenant: Annotated[int, typer.Option(min=1, help="Answers (entries) per tenant.")] = 20,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 128,
    temperature: Annotated[float, typer.Option(min=0.05)] = 0.7,
    big_registry: Annotated[int, typer.Option(min=1, help="The large registry's size.")] = 100_000,
    prompt_set: Annotated[
        str,
        typer.Option(
            help="eli5 (held out from the statistic's tuning), everyday, or structured "
            "(JSON under a schema through /v1/chat/completions; give --max-new-tokens 256)."
        ),
    ] = "eli5",
    out_dir: Annotated[
        Path | None,
        typer.Option(help="Keep the store and answers here; a rerun resumes from them."),
    ] = None,
    generate: Annotated[
        bool, typer.Option(help="--no-generate: measure only the answers kept in --out-dir.")
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """What a new user's chat answers get from the service: the embedded model, the
    service default, through /generate and the bulk routes, at two registry sizes,
    the same answers under the model-assisted and the model-free statistic, with
    binomial SE."""
    from worldcup_cli.first_use_bench import COLUMNS, PROMPT_SETS, run, table

    if not generate and out_dir is None:
        fail("--no-generate measures the answers kept in --out-dir: give --out-dir")
    if prompt_set not in PROMPT_SETS:
        fail(f"--prompt-set: one of {', '.join(PROMPT_SETS)}, got {prompt_set!r}")
    result = run(
        texts,
        per_tenant,
        max_new_tokens,
        temperature,
        big_registry,
        prompt_set_name=prompt_set,
        out_dir=out_dir,
        generate=generate,
    )
    if out_dir is not None:  # the full result beside the answers, rows included
        (out_dir / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    for column in COLUMNS:
        result[column].pop("rows")
    _emit(as_json, result, table(result))


@_bench("collection")
def bench_collection(
    users: Annotated[int, typer.Option(min=1, help="Users whose answers are generated.")] = 30,
    per_user: Annotated[
        int, typer.Option(min=1, help="Answers per user: one collection each.")
    ] = 5,
    max_new_tokens: Annotated[int, typer.Option(min=2)] = 128,
    short_tokens: Annotated[
        int, typer.Option(min=1, help="The short collections: each answer's first tokens.")
    ] = 64,
    temperature: Annotated[float, typer.Option(min=0.05)] = 0.7,
    registry: Annotated[int, typer.Option(min=1, help="The tenant's registry size.")] = 100_000,
    registry_users: Annotated[
        int, typer.Option(min=1, help="The users the registry is spread over, evenly.")
    ] = 1000,
    human: Annotated[int, typer.Option(min=0, help="Human control collections.")] = 12,
    out_dir: Annotated[
        Path | None,
        typer.Option(help="Keep the store and answers here; a rerun resumes from them."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Many short answers of one user read together: each generated user's answers through
    /provenance/collection with group_by user_id, at full length and at 64 tokens, in one
    tenant whose registry holds --registry entries over --registry-users users; a human
    control; binomial SE and exact intervals."""
    from worldcup_cli.collection_bench import run, table

    if registry_users < users or registry % registry_users:
        fail("--registry must be a multiple of --registry-users, and --users at most it")
    if registry // registry_users < per_user:
        fail("each user's registry entries (--registry / --registry-users) must hold --per-user")
    if short_tokens >= max_new_tokens:
        fail("--short-tokens must be below --max-new-tokens")
    result = run(
        users,
        per_user,
        max_new_tokens,
        temperature,
        registry,
        registry_users,
        human,
        short_tokens,
        out_dir=out_dir,
    )
    if out_dir is not None:
        (out_dir / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    _emit(as_json, result, table(result))


def _numbers(text: str, kind: Callable[[str], Any], name: str) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(f"--{name}: a comma-separated list of numbers, got {text!r}")
    if not values:
        fail(f"--{name}: give at least one value")
    return values


@_bench("grid")
def bench_grid(
    texts: Annotated[int, typer.Option(min=1, max=100, help="Prompts answered per cell.")] = 40,
    temperatures: Annotated[
        str, typer.Option(help="Comma-separated sampling temperatures.")
    ] = "0.3,0.7,1.0",
    lengths: Annotated[
        str, typer.Option(help="Comma-separated lengths (tokens); one generation at the longest.")
    ] = "32,64,128,256",
    presets: Annotated[str, typer.Option(help="Comma-separated presets (frontier, paper).")] = (
        "frontier,paper"
    ),
    bimark: Annotated[bool, typer.Option(help="BiMark beside WorldCup.")] = True,
    unwatermarked: Annotated[
        bool, typer.Option(help="Unwatermarked answers too (self-perplexity only).")
    ] = True,
    big_registry: Annotated[int, typer.Option(min=1, help="The large registry's size.")] = 100_000,
    out: Annotated[Path, typer.Option(help="Results folder.")] = Path("docs/results/grid"),
    ppl_texts: Annotated[
        int, typer.Option(min=0, help="Answers per cell whose self-perplexity is measured.")
    ] = 20,
    model_texts: Annotated[
        int | None,
        typer.Option(min=1, help="Prompts per BiMark/unwatermarked cell (default: --texts)."),
    ] = None,
    report_only: Annotated[
        bool, typer.Option("--report-only", help="Re-render report.md and grid.png only.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Detection and decoding over temperatures x lengths for each WorldCup preset,
    through the service at two registry sizes, beside BiMark; writes results.json,
    report.md and grid.png to --out, resuming finished cells."""
    from worldcup_cli.grid_bench import PRESETS, render, run

    if report_only:
        path = out / "results.json"
        if not path.is_file():
            fail(f"--report-only: {path} does not exist; run without it first")
        result = json.loads(path.read_text(encoding="utf-8"))
    else:
        chosen = [p.strip() for p in presets.split(",") if p.strip()]
        unknown = sorted(set(chosen) - set(PRESETS))
        if unknown or not chosen:
            fail(f"--presets: choose from {', '.join(PRESETS)}; got {presets!r}")
        result = run(
            texts,
            _numbers(temperatures, float, "temperatures"),
            _numbers(lengths, int, "lengths"),
            chosen,
            ("bimark",) if bimark else (),
            unwatermarked,
            big_registry,
            out=out,
            ppl_texts=ppl_texts,
            model_texts=model_texts,
            progress=lambda line: typer.echo(line, err=True),
        )
    render(result, out)
    _emit(as_json, result, (out / "report.md").read_text(encoding="utf-8"))


@_bench("provenance")
def bench_provenance(
    keys: Annotated[int, typer.Option(min=1, max=100_000, help="Keys in the bank.")] = 1000,
    tokens: Annotated[int, typer.Option(min=8, max=4096, help="Tokens per text.")] = 256,
    texts: Annotated[int, typer.Option(min=1, max=100, help="Texts to time (median).")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Time a provenance search over many keys against a naive per-key loop (the loop is
    skipped above 10 000 keys)."""
    from worldcup_cli.bench import bench_provenance as run
    from worldcup_cli.bench import format_provenance_bench

    result = run(keys, tokens, texts, naive=keys <= 10_000)
    _emit(as_json, result, format_provenance_bench(result))


def _register_unavailable(name: str, extra: str, missing: str, bench: bool = False) -> None:
    """``name`` (``bench name`` with ``bench``) as a command that only says which extra
    it needs (exit 2): a missing optional part disables its own command, never the CLI."""
    full = f"bench {name}" if bench else name

    def unavailable(ctx: typer.Context) -> None:
        fail(
            f"`worldcup {full}` needs the {extra} extra ({missing} is not installed): "
            f"pip install 'worldcup[{extra}]'"
        )

    (_bench if bench else _command)(
        name,
        help=f"Unavailable: {missing} is missing (install the {extra} extra).",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(unavailable)


def _register_scan() -> None:
    """``scan`` and ``bench-scan`` live in worldcup_scan (a Ray worker imports it too) and
    write Parquet with pyarrow (the ``scan`` extra); without them both commands say so."""
    missing = None if importlib.util.find_spec("pyarrow") is not None else "pyarrow"
    try:
        from worldcup_scan.cli import bench_scan, scan
    except ImportError as exc:
        missing = exc.name or "worldcup_scan"
    if missing is not None:
        _register_unavailable("scan", "scan", missing)
        _register_unavailable("scan", "scan", missing, bench=True)
        return
    _command("scan")(scan)
    _bench("scan")(bench_scan)


_register_scan()


def bench_forgery(
    scenario: Annotated[
        str,
        typer.Option("--scenario", help="kgw (the anchor), per-request (the default) or fixed."),
    ],
    budget_tokens: Annotated[
        int, typer.Option("--budget-tokens", min=1, help="Generated tokens the attacker collects.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Results folder (a rerun resumes from it).")],
    accounts: Annotated[int, typer.Option(min=1, help="Colluding accounts.")] = 1,
    deltas: Annotated[
        str, typer.Option("--deltas", help="Comma-separated logit boosts of the spoofer.")
    ] = "2,4",
    best_of: Annotated[int, typer.Option(min=1, help="Oracle-filtered drafts per prompt.")] = 4,
    spoof_prompts: Annotated[int, typer.Option(min=1, help="Held-out spoof topics.")] = 40,
    piggyback: Annotated[int, typer.Option(min=0, help="Genuine answers edited.")] = 40,
    human_texts: Annotated[int, typer.Option(min=1, help="Human control texts.")] = 1000,
    batch_size: Annotated[int, typer.Option(min=1, help="Generation batch.")] = 48,
    seed: Annotated[int, typer.Option(help="Seed of keys, payloads and sampling.")] = 0,
    data_dir: Annotated[
        Path | None,
        typer.Option("--data-dir", help="Evaluation data (default: WORLDCUP_DATA_DIR)."),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Local HF model directory (default: embedded).")
    ] = None,
    threads: Annotated[int, typer.Option(min=1, help="Torch threads.")] = 1,
) -> None:
    """Watermark stealing, spoofing and piggybacking against one tenant (issue #45;
    python -m worldcup_eval.forgery): the spoofs and edits the production verdict
    accepts and the entries it names, with Clopper-Pearson intervals; resumable."""
    from worldcup_eval.forgery import SCENARIOS
    from worldcup_eval.forgery import main as run

    if scenario not in SCENARIOS:
        fail(f"--scenario must be one of {', '.join(SCENARIOS)}, got {scenario!r}")
    try:
        boosts = [float(d) for d in deltas.split(",") if d.strip()]
    except ValueError:
        fail(f"--deltas must be comma-separated numbers, got {deltas!r}")
    if not boosts:
        fail("--deltas names no boost")
    if out.exists() and not out.is_dir():
        fail(f"--out {out} exists and is not a folder")
    if data_dir is not None and not data_dir.is_dir():
        fail(f"--data-dir {data_dir} is not a folder")
    _check_model(model)
    argv = [
        "--scenario", scenario,
        "--budget-tokens", str(budget_tokens),
        "--out", str(out),
        "--accounts", str(accounts),
        "--deltas", *map(str, boosts),
        "--best-of", str(best_of),
        "--spoof-prompts", str(spoof_prompts),
        "--piggyback", str(piggyback),
        "--human-texts", str(human_texts),
        "--batch-size", str(batch_size),
        "--seed", str(seed),
        "--threads", str(threads),
    ]  # fmt: skip
    if data_dir is not None:
        argv += ["--data-dir", str(data_dir)]
    if model is not None:
        argv += ["--model", model]
    raise typer.Exit(run(argv))


def _register_forgery() -> None:
    """``bench forgery`` judges with the scanner (``scan`` extra) and the service's row
    type (``service`` extra); without them the command says which is missing."""
    missing = next((m for m in ("fastapi", "pyarrow") if importlib.util.find_spec(m) is None), None)
    if missing is not None:
        _register_unavailable("forgery", "service,scan", missing, bench=True)
        return
    _bench("forgery")(bench_forgery)


_register_forgery()


def _register_serve_ray() -> None:
    """``serve-ray``: the service on Ray Serve (worldcup_cli/serve_ray.py)."""
    from worldcup_cli.serve_ray import serve_ray

    _command("serve-ray")(serve_ray)


_register_serve_ray()


@_command()
def serve(
    host: Annotated[str | None, typer.Option("--host", help="Default: WORLDCUP_HOST.")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Default: WORLDCUP_PORT.")] = None,
) -> None:
    """Run the HTTP service (settings from WORLDCUP_* variables and .env)."""
    from pydantic import ValidationError

    try:
        from app.core.config import Settings
        from app.server import run
    except ImportError as exc:
        fail(f"the service extras are not installed ({exc.name}): pip install 'worldcup[service]'")
    try:
        settings = Settings()
    except ValidationError as exc:
        reasons = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        fail(f"invalid settings: {reasons}")
    _check_model(settings.model_path)
    if host is not None:
        settings.host = host
    if port is not None:
        settings.port = port
    run(settings)


@_command("migrate-store")
def migrate_store(
    source: Annotated[
        str, typer.Option("--from", envvar="WORLDCUP_REDIS_URL", help="The legacy Redis.")
    ],
    target: Annotated[
        str | None, typer.Option("--to", help="Target Redis (a cluster node); default: --from.")
    ] = None,
    to_cluster: Annotated[
        bool,
        typer.Option("--to-cluster", envvar="WORLDCUP_REDIS_CLUSTER", help="Target is a cluster."),
    ] = False,
    prefix: Annotated[str, typer.Option("--prefix", envvar="WORLDCUP_REDIS_PREFIX")] = "wc",
    delete_legacy: Annotated[
        bool, typer.Option("--delete-legacy", help="Delete the legacy keys after the copy.")
    ] = False,
) -> None:
    """Move a Redis store from the legacy key layout to the cluster layout (stop the API
    first; safe to re-run). See docs/operations.md."""
    import asyncio

    from redis.exceptions import RedisError

    from app.stores.base import StoreUnavailable
    from app.stores.redis_migrate import migrate_store as run_migration

    for option, url in (("--from", source), ("--to", target)):
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            fail(f"{option} must be a redis://, rediss:// or unix:// URL")
    try:
        report = asyncio.run(
            run_migration(
                source,
                prefix=prefix,
                target_url=target,
                target_cluster=to_cluster,
                delete_legacy=delete_legacy,
                progress=lambda msg: typer.echo(msg, err=True),
            )
        )
    except (RedisError, StoreUnavailable, OSError) as exc:
        fail(f"migration failed ({type(exc).__name__}); it is safe to re-run")
    if report.already_migrated:
        typer.echo("already in the current layout: nothing to do")
        return
    typer.echo(
        f"migrated {report.tenants} tenants, {report.entries} registry entries, "
        f"{report.keys_copied} tenant keys, {report.global_keys} global keys"
        + (f"; {report.legacy_deleted} legacy keys deleted" if delete_legacy else "")
    )


@_bench("service")
def bench_service(
    device: Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:1, ...")] = "cpu",
    detect_seconds: Annotated[
        float, typer.Option("--detect-seconds", help="Length of the /detect load.")
    ] = 10.0,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="hf: the full service bench. vllm: hf, vLLM plain and vLLM + WorldCup "
            "side by side (1/8/32 concurrent; needs the vllm extra: make setup-vllm).",
        ),
    ] = "hf",
    variants: Annotated[
        str,
        typer.Option(
            "--variants",
            help="With --engine vllm: which arms to run, comma-separated "
            "(also vllm-plain-unfiltered: plain with top-k/top-p off).",
        ),
    ] = "hf,vllm-plain,vllm-worldcup",
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats", help="With --engine vllm: interleaved waves per arm and level.", min=1
        ),
    ] = 3,
    fairness_only: Annotated[
        bool,
        typer.Option(
            "--fairness-only",
            help="Only the fair-shares part: another tenant's /detect under one tenant's "
            "bulk load, and /detect req/s, first-come-first-served pool against fair.",
        ),
    ] = False,
    rate_pairs: Annotated[
        int,
        typer.Option(
            "--rate-pairs",
            help="Fair shares: ABBA pairs of /detect req/s phases (FCFS pool, fair pool).",
            min=1,
        ),
    ] = 3,
    bulk_chars: Annotated[
        int,
        typer.Option(
            "--bulk-chars",
            help="Fair shares: characters per text of the bulk tenant's /decode/batch.",
            min=1,
        ),
    ] = 100_000,
    as_json: JsonOpt = False,
) -> None:
    """The HTTP service end to end: cold start, generation and detection throughput."""
    if engine not in ("hf", "vllm"):
        fail(f"--engine must be hf or vllm, got {engine!r}")
    if engine == "vllm":
        try:
            import vllm  # noqa: F401

            from worldcup_cli.engine_bench import format_engine_bench, run_engine_bench
        except ImportError as exc:
            fail(
                f"vLLM is not installed ({exc.name}): make setup-vllm, or pip install "
                "'worldcup[vllm]'"
            )
        chosen = tuple(v.strip() for v in variants.split(",") if v.strip())
        known = ("hf", "vllm-plain", "vllm-worldcup", "vllm-plain-unfiltered")
        if not chosen or set(chosen) - set(known):
            fail(f"--variants: a comma list of {', '.join(known)}; got {variants!r}")
        bench = run_engine_bench(
            device=device,
            variants=chosen,
            repeats=repeats,
            progress=lambda msg: typer.echo(msg, err=True),
        )
        _emit(as_json, bench, format_engine_bench(bench))
        return
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401

        from worldcup_cli.service_bench import format_service_bench, run_service_bench
    except ImportError as exc:
        fail(f"the service extras are not installed ({exc.name}): pip install 'worldcup[service]'")
    if detect_seconds <= 0:
        fail(f"--detect-seconds must be positive, got {detect_seconds}")

    def progress(msg: str) -> None:
        typer.echo(msg, err=True)

    result = run_service_bench(
        device=device,
        detect_seconds=detect_seconds,
        fairness_only=fairness_only,
        rate_pairs=rate_pairs,
        bulk_chars=bulk_chars,
        progress=progress,
    )
    _emit(as_json, result, format_service_bench(result))


@_bench("attack")
def bench_attack(
    model: Annotated[
        str | None, typer.Option("--model", help="Local HF model directory (default: embedded).")
    ] = None,
    max_queries: Annotated[
        int, typer.Option("--max-queries", help="Query cap per attack run.")
    ] = 4000,
    strategies: Annotated[
        str | None,
        typer.Option(
            "--strategies", help="Comma-separated subset of the strategies (default: all)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Removal attacks (greedy, salted, halves, windows, rank-then-delete, several keys,
    /provenance, verdict key) with and without probe budgets (the SECURITY.md table)."""
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401

        from worldcup_cli.attack_bench import format_attack_bench, run_attack_bench
    except ImportError as exc:
        fail(f"the service extras are not installed ({exc.name}): pip install 'worldcup[service]'")
    if max_queries <= 0:
        fail(f"--max-queries must be positive, got {max_queries}")
    _check_model(model)

    def progress(msg: str) -> None:
        typer.echo(msg, err=True)

    from worldcup_cli.attack_bench import STRATEGIES

    chosen = tuple(x.strip() for x in strategies.split(",")) if strategies else STRATEGIES
    if set(chosen) - set(STRATEGIES):
        fail(
            f"unknown strategies {sorted(set(chosen) - set(STRATEGIES))}; known: {list(STRATEGIES)}"
        )
    result = run_attack_bench(
        model=model, max_queries=max_queries, strategies=chosen, progress=progress
    )
    _emit(as_json, result, format_attack_bench(result))


@_bench("registry")
def bench_registry(
    redis_url: Annotated[
        str,
        typer.Option(
            "--redis-url",
            help="The Redis to fill (a key prefix of its own, deleted at the end).",
        ),
    ] = "redis://127.0.0.1:6379/0",
    sizes: Annotated[
        str, typer.Option("--sizes", help="Comma-separated registry sizes, ascending.")
    ] = "100,10000,100000,1000000",
    accuracy: Annotated[
        bool,
        typer.Option(
            "--accuracy/--no-accuracy",
            help="Also the list path's miss rate against the exhaustive match (simulated).",
        ),
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """Registry lookups over HTTP (/decode, /decode/batch, /provenance) at growing
    registry sizes on Redis: latency and its ratio to the smallest, memory per entry,
    fill rate; the codec's rate; the list path's miss rate."""
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401

        from worldcup_cli.registry_bench import (
            codec_rate,
            format_registry_bench,
            list_accuracy,
            memory_per_entry,
            run_registry_bench,
        )
    except ImportError as exc:
        fail(f"the service extras are not installed ({exc.name}): pip install 'worldcup[service]'")
    try:
        chosen = tuple(int(x) for x in sizes.split(",") if x.strip())
    except ValueError:
        fail(f"--sizes: comma-separated integers, got {sizes!r}")
    if not chosen or any(n < 10 for n in chosen) or list(chosen) != sorted(chosen):
        fail(f"--sizes: ascending sizes of at least 10, got {sizes!r}")
    from app.stores.base import StoreUnavailable
    from app.stores.redis import RedisStore

    async def ping() -> None:
        store = RedisStore(redis_url, prefix="wcbench", timeout_s=2.0)
        try:
            await store.ping()
        finally:
            await store.close()

    try:
        asyncio.run(ping())
    except (StoreUnavailable, ValueError) as exc:
        fail(f"the Redis at --redis-url is unreachable ({exc})")

    def progress(msg: str) -> None:
        typer.echo(msg, err=True)

    rate = codec_rate()
    progress(f"codec: {rate}")
    result = run_registry_bench(redis_url=redis_url, sizes=chosen, progress=progress)
    result["codec"] = rate
    progress("memory per entry, small and 4096-byte metadata (Redis and SQLite)")
    result["memory"] = memory_per_entry(redis_url)
    if accuracy:
        progress("list path against the exhaustive match (simulated texts)")
        result["accuracy"] = list_accuracy()
    human = format_registry_bench(result) + (
        f"\ncodec (32-bit): {rate['payload_ids_per_s']:,} ids/s payload, "
        f"{rate['message_id_ids_per_s']:,} ids/s message id (tables built in "
        f"{rate['table_build_s']} s; scalar {rate['scalar_us_per_id']} us/id)"
    )
    _emit(as_json, result, human)


@_command("eval")
def eval_(
    config: Annotated[
        Path | None, typer.Option("--config", help="TOML, JSON or YAML file with the settings.")
    ] = None,
    smoke: Annotated[
        bool, typer.Option("--smoke", help="Tiny preset for CI: 4 prompts, short lengths.")
    ] = False,
    prompts: Annotated[int | None, typer.Option("--prompts", help="Prompts per cell.")] = None,
    bits: Annotated[str | None, typer.Option("--bits", help="Payload lengths, e.g. 16,32.")] = None,
    lengths: Annotated[
        str | None, typer.Option("--lengths", help="Max new tokens, e.g. 128,256.")
    ] = None,
    schemes: Annotated[
        str | None,
        typer.Option("--schemes", help="unwatermarked,worldcup-k1,worldcup-k2,mpac"),
    ] = None,
    ablations: Annotated[
        str | None,
        typer.Option("--ablations", help="no-entropy,no-subtraction,random-second or none."),
    ] = None,
    ablation_bits: Annotated[str | None, typer.Option("--ablation-bits")] = None,
    ablation_lengths: Annotated[str | None, typer.Option("--ablation-lengths")] = None,
    attacks: Annotated[
        str | None,
        typer.Option("--attacks", help="deletion,synonym,copy-paste,paraphrase or none."),
    ] = None,
    attack_bits: Annotated[
        str | None, typer.Option("--attack-bits", help="Default: every --bits.")
    ] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size")] = None,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    out: Annotated[str | None, typer.Option("--out", help="Output folder (docs/results).")] = None,
    cache_dir: Annotated[
        str | None, typer.Option("--cache-dir", help="Default: <out>/cache.")
    ] = None,
    data_dir: Annotated[str | None, typer.Option("--data-dir")] = None,
    model: ModelOpt = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu, cuda, ...")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    scorer_model: Annotated[
        str | None, typer.Option("--scorer-model", help="Local HF dir for a second PPL scorer.")
    ] = None,
    report_only: Annotated[
        bool,
        typer.Option("--report-only", help="Generate nothing; report what is cached (PARTIAL)."),
    ] = False,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No progress bars.")] = False,
) -> None:
    """Evaluate the schemes as in the paper's Section 4: resumable, cached, deterministic."""
    try:
        from worldcup_eval import build_config, run_eval
    except ImportError as exc:
        fail(f"the eval extras are not installed ({exc.name}): pip install 'worldcup[eval]'")
    flags = {
        "prompts": prompts,
        "bits": bits,
        "lengths": lengths,
        "schemes": schemes,
        "ablations": ablations,
        "ablation_bits": ablation_bits,
        "ablation_lengths": ablation_lengths,
        "attacks": attacks,
        "attack_bits": attack_bits,
        "batch_size": batch_size,
        "seed": seed,
        "out": out,
        "cache_dir": cache_dir,
        "data_dir": data_dir,
        "model": model,
        "device": device,
        "dtype": dtype,
        "scorer_model": scorer_model,
    }
    try:
        cfg = build_config(smoke=smoke, config_file=config, overrides=flags)
    except OSError as exc:
        fail(os_error_message(exc))
    except UnicodeDecodeError:
        fail(f"--config {config} is not a UTF-8 text file (TOML, JSON or YAML)")
    except (ValueError, TypeError) as exc:
        fail(str(exc))
    from worldcup_core.models import ModelLoadError
    from worldcup_eval.attacks import WordNetMissing

    try:
        results = run_eval(cfg, report_only=report_only, progress=not no_progress)
    except (ModelLoadError, WordNetMissing, FileNotFoundError) as exc:
        fail(str(exc))
    status = "complete" if results["complete"] else f"PARTIAL ({len(results['missing'])} missing)"
    typer.echo(f"{cfg.out_dir / 'report.md'} ({status})")


def main() -> None:
    """Console entry point: usage errors become the same one-line form as ours (exit 2)."""
    try:
        code = app(standalone_mode=False, prog_name="worldcup")
    except typer.TyperException as exc:  # bad option values, missing options, unknown commands
        message = exc.format_message()
        if not message:  # bare `worldcup` or `worldcup bench`: the help was printed
            sys.exit(0)
        ctx = getattr(exc, "ctx", None)
        where = f"; see `{ctx.command_path} --help`" if ctx is not None else ""
        typer.echo(f"error: {' '.join(message.split()).rstrip('.')}{where}", err=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
