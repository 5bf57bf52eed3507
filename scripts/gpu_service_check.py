"""The GPU service check's Python half: build the offline bundle, verify it, drive the service.

``scripts/gpu_service_check.sh`` is the one command (see it for the flow). This file has
three subcommands; ``build`` and ``verify`` need nothing beyond the standard library, so
they run on a bare host before anything is installed:

* ``build --out DIR``: the bundle a CUDA host without network needs beside the script:
  the project's wheel, the wheels of the service's dependencies that such a host lacks
  (the service's requirement closure, less what a PyTorch CUDA image ships: torch,
  Triton, transformers, numpy, scipy, numba, ...), for CPython ``--python-version``
  (3.12: the device image's) on manylinux x86-64, pinned to the versions this checkout is
  tested with, and the embedded model (the SmolLM2 GGUF). Every file is cut into parts of
  at most ``--part-mib`` (64) MiB, grouped in ``load-N/`` folders of at most
  ``--load-mib`` MiB (what one transfer to the host may carry), with a ``manifest.json``
  of each file's size and sha256. ``--offline`` (the dry run): only the project wheel
  and the model, from this machine.
* ``verify --bundle DIR --into DIR2``: reassemble every file from its parts into
  ``DIR2`` and check its size and sha256; any missing part or mismatch is fatal, named.
* ``drive``: the measurement, on the installed service: ``worldcup serve`` (a subprocess,
  the HF engine on ``--device``, the embedded model) and, beside it, a baseline arm of the
  same app whose engine drops the watermark (never the service itself). At each level of
  ``--levels`` concurrent ``/generate`` requests, waves run interleaved, watermarked then
  plain then the other way round; tokens/s of each and their paired ratio; every
  watermarked text is decoded (``/decode``: p-value, bits, registry match). Then the
  fused v2 step alone, eager and replayed from a CUDA graph, at ``--step-batches``
  (on a CPU: the compiled path, no graph). Writes ``report.json`` and ``report.md`` to
  ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# what a CUDA PyTorch image ships (the device image's list, docs/benchmarks.md): the
# service's requirements the bundle does not carry. The host check (``drive``) names any
# requirement that is still missing after the install.
HOST_PROVIDES = frozenset(
    """torch triton numpy scipy numba llvmlite transformers tokenizers huggingface-hub
    safetensors hf-xet accelerate filelock fsspec jinja2 markupsafe sympy mpmath networkx
    typing-extensions packaging pyyaml regex requests urllib3 certifi idna
    charset-normalizer tqdm httpx httpcore h11 anyio prometheus-client uvloop click psutil
    typer rich shellingham markdown-it-py mdurl pygments setuptools annotated-doc
    sentencepiece tiktoken ninja""".split()
)
SKIP_PREFIXES = ("nvidia-", "cuda-")
MANYLINUX = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(4 * MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


# --------------------------------------------------------------------------- build
def service_closure() -> dict[str, str]:
    """name -> installed version of every distribution ``worldcup[service]`` needs here."""
    from packaging.requirements import Requirement

    todo: list[tuple[str, set[str]]] = [("worldcup", {"service"})]
    seen: dict[str, str] = {}
    while todo:
        name, extras = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        key = _norm(dist.metadata["Name"])
        if key in seen and not extras:
            continue
        seen[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            env = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(e) for e in env):
                continue
            if _norm(req.name) not in seen:
                todo.append((req.name, set(req.extras)))
    seen.pop("worldcup", None)
    return seen


def to_bundle(name: str) -> bool:
    key = _norm(name)
    return key not in HOST_PROVIDES and not key.startswith(SKIP_PREFIXES)


def build(out: Path, python_version: str, part_mib: int, load_mib: int, offline: bool) -> None:
    stage = out / ".stage"
    shutil.rmtree(out, ignore_errors=True)
    (stage / "wheels").mkdir(parents=True)
    (stage / "model").mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(stage / "wheels"), "."],
        cwd=ROOT,
        check=True,
    )
    pinned = {}
    if not offline:
        pinned = {n: v for n, v in service_closure().items() if to_bundle(n)}
        platforms = [a for p in MANYLINUX for a in ("--platform", p)]
        for name, version in sorted(pinned.items()):
            subprocess.run(
                [*pip, "download", "--no-deps", "--only-binary=:all:", "--implementation",
                 "cp", "--python-version", python_version, *platforms,
                 "-d", str(stage / "wheels"), f"{name}=={version}"],
                check=True,
            )  # fmt: skip
    from worldcup_core.models import embedded_gguf_path

    shutil.copy2(embedded_gguf_path(), stage / "model" / MODEL_NAME)
    files = sorted(p for p in stage.rglob("*") if p.is_file())
    manifest: dict[str, Any] = {
        "python_version": python_version,
        "offline": offline,
        "bundled": pinned,
        "part_mib": part_mib,
        "load_mib": load_mib,
        "files": split(files, stage, out, min(part_mib, load_mib) * MIB, load_mib * MIB),
    }
    manifest["loads"] = sorted(str(p.name) for p in out.glob("load-*"))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(stage)
    sizes = {p.name: sum(f.stat().st_size for f in p.iterdir()) // MIB for p in out.glob("load-*")}
    print(json.dumps({"bundle": str(out), "files": len(files), "loads_mib": sizes}))  # noqa: T201


def split(
    files: list[Path], stage: Path, out: Path, part_cap: int, load_cap: int
) -> list[dict[str, Any]]:
    """Cut ``files`` (under ``stage``) into parts of at most ``part_cap`` bytes, filling
    ``out/load-1``, ``load-2``, ... of at most ``load_cap`` bytes in turn; each file's
    manifest entry (name, size, sha256, parts)."""
    entries = []
    load, load_bytes = 1, 0
    for path in files:
        entry: dict[str, Any] = {
            "name": str(path.relative_to(stage)),
            "size": path.stat().st_size,
            "sha256": _sha256(path),
            "parts": [],
        }
        with path.open("rb") as f:
            index = 0
            while True:
                if load_bytes >= load_cap:
                    load, load_bytes = load + 1, 0
                chunk = f.read(min(part_cap, load_cap - load_bytes))
                if not chunk and index:
                    break
                part = Path(f"load-{load}") / f"{path.name}.part{index:03d}"
                (out / part).parent.mkdir(parents=True, exist_ok=True)
                (out / part).write_bytes(chunk)
                entry["parts"].append(str(part))
                load_bytes += len(chunk)
                index += 1
                if not chunk:  # an empty file: one empty part
                    break
        entries.append(entry)
    return entries


# --------------------------------------------------------------------------- verify
def verify(bundle: Path, into: Path) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    missing = [p for f in manifest["files"] for p in f["parts"] if not (bundle / p).is_file()]
    if missing:
        loads = sorted({p.split("/")[0] for p in missing})
        sys.exit(f"bundle incomplete: {len(missing)} parts missing, in {', '.join(loads)}")
    bad = []
    for entry in manifest["files"]:
        target = into / entry["name"]
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as f:
            for part in entry["parts"]:
                f.write((bundle / part).read_bytes())
        if target.stat().st_size != entry["size"] or _sha256(target) != entry["sha256"]:
            bad.append(entry["name"])
    if bad:
        sys.exit(f"sha256 mismatch after reassembly: {', '.join(bad)}")
    print(json.dumps({"verified": len(manifest["files"]), "into": str(into)}))  # noqa: T201


# --------------------------------------------------------------------------- drive
def missing_requirements() -> list[str]:
    """Requirements of ``worldcup[service]`` that no installed distribution satisfies."""
    from packaging.requirements import Requirement

    out = []
    for line in metadata.distribution("worldcup").requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": "service"}):
            continue
        if _norm(req.name) == "torch":
            continue  # the host's CUDA build, whatever its version
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(f"{req.name} (absent)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name} {have} (needs {req.specifier})")
    return out


class _Arm:
    def __init__(self, name: str, url: str, stop: Any) -> None:
        self.name, self.url, self.stop = name, url, stop
        self.auth: dict[str, str] = {}


def _settings_env(device: str, port: int, tmp: Path, token: str, batch: int) -> dict[str, str]:
    return {
        "WORLDCUP_ENV": "dev",
        "WORLDCUP_ENGINE": "hf",
        "WORLDCUP_DEVICE": device,
        "WORLDCUP_HOST": "127.0.0.1",
        "WORLDCUP_PORT": str(port),
        "WORLDCUP_SQLITE_PATH": str(tmp / f"{port}.sqlite3"),
        "WORLDCUP_REDIS_URL": "",
        "WORLDCUP_MASTER_KEY": "4e" * 32,
        "WORLDCUP_ADMIN_TOKEN": token,
        "WORLDCUP_MAX_BATCH_SIZE": str(batch),
        "WORLDCUP_MAX_QUEUE": "1024",
        "WORLDCUP_LOG_LEVEL": "WARNING",
        "WORLDCUP_REQUEST_TIMEOUT_S": "600",
        # a throughput check, not the abuse limits: it reads each of its texts three
        # times (a decode, two timed /detect/batch passes), and two short texts of one
        # prompt can be one text to the probe accounts, whose 4th query would be answered
        # as the verdict only (full_answers_spent: no statistic)
        "WORLDCUP_PROBE_FULL_ANSWERS": "0",
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, deadline_s: float, proc: Any = None) -> float:
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < deadline_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"worldcup serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {deadline_s} s")


def start_serve(device: str, tmp: Path, token: str, batch: int) -> _Arm:
    """``worldcup serve``, the real command, as the watermarked arm."""
    port = _free_port()
    env = {**os.environ, **_settings_env(device, port, tmp, token, batch)}
    log = (tmp / "serve.log").open("wb")
    proc = subprocess.Popen(  # noqa: S603
        [sys.executable, "-c", "from worldcup_cli.main import main; main()", "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()

    try:
        _wait_ready(url, 300, proc)
    except BaseException:
        stop()
        raise
    return _Arm("watermarked", url, stop)


def start_plain(device: str, tmp: Path, token: str, batch: int) -> _Arm:
    """The baseline: the same app, in this process, its engine dropping the scheme (every
    request sampled plain). A measurement arm only: the service never runs this way."""
    import dataclasses
    import threading

    import uvicorn

    port = _free_port()
    os.environ.update(_settings_env(device, port, tmp, token, batch))
    from app.core.config import Settings
    from app.main import create_app

    app = create_app(Settings(_env_file=None))  # type: ignore[call-arg]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url, 300)
    engine = app.state.runtime.engine
    submit = engine.submit
    engine.submit = lambda r: submit(dataclasses.replace(r, scheme=None, payload=None))

    def stop() -> None:
        server.should_exit = True
        thread.join(30)

    return _Arm("plain", url, stop)


def _tenant(arm: _Arm, token: str) -> None:
    import httpx

    r = httpx.post(
        f"{arm.url}/admin/tenants",
        # the check compares decoded bits with the issued ones, as analysts do
        json={"name": f"gpu-check-{arm.name}", "scopes": ["provenance"]},
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    r.raise_for_status()
    arm.auth = {"Authorization": f"Bearer {r.json()['api_key']}"}


PROMPTS = (
    "Write a short, surprising story about a lighthouse keeper and a fox.",
    "Describe an imaginary city built on the back of a giant turtle.",
    "Write a diary entry from a cat who has just moved to a new house.",
    "Invent five names for a new breakfast cereal and describe each one.",
)


def wave(arm: _Arm, level: int, tokens: int) -> tuple[float, list[dict[str, Any]]]:
    """``level`` concurrent /generate requests of exactly ``tokens`` new tokens: tokens/s
    over the wave's wall time, and the responses."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def one(i: int) -> dict[str, Any]:
        body = {
            "prompt": PROMPTS[i % len(PROMPTS)],
            "metadata": {"i": i},
            "max_new_tokens": tokens,
            "min_new_tokens": tokens,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 0.95,
        }
        r = httpx.post(f"{arm.url}/generate", json=body, headers=arm.auth, timeout=600)
        r.raise_for_status()
        return dict(r.json())

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=level) as pool:
        out = list(pool.map(one, range(level)))
    elapsed = time.perf_counter() - start
    return sum(g["num_tokens"] for g in out) / elapsed, out


def decode_all(arm: _Arm, texts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import httpx

    out = []
    for gen in texts:
        r = httpx.post(
            f"{arm.url}/decode", json={"text": gen["text"]}, headers=arm.auth, timeout=120
        )
        r.raise_for_status()
        dec = r.json()
        match = dec.get("registry_match") or {}
        out.append(
            {
                "message_id": gen["message_id"],
                "p_value": dec["p_value"],
                "bits_match": dec["bits"] == gen["payload"]["bits"],
                "registry_match": match.get("message_id") == gen["message_id"],
            }
        )
    return out


def detect_throughput(arm: _Arm, texts: list[dict[str, Any]]) -> dict[str, Any]:
    """``/detect/batch`` over every watermarked text, twice (the first warms): texts/s of
    the faster, and the statistic the answers took (``model`` when the engine's model
    weighed the tokens)."""
    import httpx

    bodies = [g["text"] for g in texts]
    seconds, answer = [], {}
    for _ in range(2):
        t = time.perf_counter()
        r = httpx.post(
            f"{arm.url}/detect/batch", json={"texts": bodies}, headers=arm.auth, timeout=600
        )
        r.raise_for_status()
        seconds.append(time.perf_counter() - t)
        answer = r.json()
    results = [item["result"] for item in answer["results"] if item["result"]]
    return {
        "texts": len(bodies),
        "seconds": [round(s, 3) for s in seconds],
        "texts_per_s": round(len(bodies) / min(seconds), 1),
        "statistic": sorted({str(res.get("statistic")) for res in results}),
        "num_watermarked": answer["num_watermarked"],
        "num_errors": answer["num_errors"],
    }


def step_timings(device: str, batches: list[int], repeats: int) -> dict[str, Any]:
    """The fused v2 step alone (the compiled loop on a CPU), eager and under a CUDA graph."""
    import numpy as np
    import torch

    from worldcup_core import Payload, WatermarkConfig, WatermarkKey, WorldCup
    from worldcup_core.batched import BatchedWorldCup, step_path

    dev = torch.device(device)
    rng = np.random.default_rng(0)
    scheme = WorldCup(WatermarkKey(rng.bytes(32)), WatermarkConfig())
    out: dict[str, Any] = {"path": str(step_path(dev))}

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn: Any) -> float:
        for _ in range(3):
            fn()
        sync()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            sync()
            ts.append((time.perf_counter() - t) * 1e6)
        return round(statistics.median(ts), 1)

    for batch in batches:
        rows = BatchedWorldCup(dev, capacity=batch)
        rows.reserve(batch, history=256)
        for slot in range(batch):
            rows.set_row(slot, scheme, Payload.random(16, rng))
        slots = torch.arange(batch, device=dev)
        for _ in range(8):
            rows.append(slots, torch.from_numpy(rng.integers(0, 49_000, batch)).to(dev))
        cand = torch.from_numpy(rng.integers(0, 49_000, (batch, 50))).to(dev)
        probs = torch.from_numpy(rng.dirichlet(np.full(50, 0.5), size=batch)).to(dev)

        def eager(rows: Any = rows, slots: Any = slots, cand: Any = cand, p: Any = probs) -> Any:
            return rows.step(slots, cand, p)

        row: dict[str, Any] = {"eager_us": timed(eager)}
        if dev.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    rows.step(slots, cand, probs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                rows.step(slots, cand, probs)
            row["graph_us"] = timed(graph.replay)
        else:
            row["graph_us"] = None  # no CUDA graph on a CPU
        row["eager_within_30us"] = row["eager_us"] <= 30.0 if dev.type == "cuda" else None
        out[str(batch)] = row
    return out


def drive(args: argparse.Namespace) -> None:
    import tempfile

    import torch

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "dry_run": args.dry_run,
        "levels": args.levels,
        "tokens": args.tokens,
        "rounds": args.rounds,
    }
    missing = missing_requirements()
    if missing:
        sys.exit(f"the host lacks what the service needs: {'; '.join(missing)}")
    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    token = "gpu-check-admin-" + os.urandom(8).hex()
    start = time.perf_counter()
    arms = [start_serve(args.device, tmp, token, max(args.levels))]
    try:
        arms.append(start_plain(args.device, tmp, token, max(args.levels)))
        report["start_s"] = round(time.perf_counter() - start, 1)
        for arm in arms:
            _tenant(arm, token)
            wave(arm, 1, 4)  # warm: the model's kernels, the allocator, the step's compile
        levels: dict[str, Any] = {}
        scored: list[dict[str, Any]] = []  # every watermarked text, for /detect/batch
        for level in args.levels:
            rates: dict[str, list[float]] = {"watermarked": [], "plain": []}
            texts: list[dict[str, Any]] = []
            for r in range(args.rounds):  # interleaved, the order alternating each round
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    rate, gens = wave(arm, level, args.tokens)
                    rates[arm.name].append(rate)
                    if arm.name == "watermarked":
                        texts += gens
            ratios = [w / p for w, p in zip(rates["watermarked"], rates["plain"], strict=True)]
            decodes = decode_all(arms[0], texts)
            levels[str(level)] = {
                "watermarked_tokens_per_s": round(statistics.median(rates["watermarked"]), 1),
                "plain_tokens_per_s": round(statistics.median(rates["plain"]), 1),
                "ratio": round(statistics.median(ratios), 3),
                "ratios": [round(x, 3) for x in ratios],
                "texts": len(decodes),
                "max_p_value": max(d["p_value"] for d in decodes),
                "median_p_value": statistics.median(d["p_value"] for d in decodes),
                "bits_match": sum(d["bits_match"] for d in decodes),
                "registry_match": sum(d["registry_match"] for d in decodes),
                "decodes": decodes,
            }
            scored += texts
            brief = {k: v for k, v in levels[str(level)].items() if k != "decodes"}
            print(json.dumps({"level": level, **brief}), flush=True)  # noqa: T201
        report["levels"] = levels
        try:
            report["detect_batch"] = detect_throughput(arms[0], scored)
        except Exception as exc:  # noqa: BLE001 - the report keeps what did run
            report["detect_batch"] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        for arm in arms:
            arm.stop()
    report["step"] = step_timings(args.device, args.step_batches, args.repeats)
    report["total_s"] = round(time.perf_counter() - start, 1)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    (out_dir / "report.md").write_text(markdown(report))
    print(markdown(report))  # noqa: T201


def markdown(report: dict[str, Any]) -> str:
    """The tables docs/benchmarks.md takes, with the card named."""
    lines = [
        f"Device: {report['device']} (torch {report['torch']}); {report['tokens']} new tokens "
        f"a request, {report['rounds']} interleaved rounds a level.",
        "",
        "| concurrent | watermarked tok/s | plain tok/s | ratio (median of pairs) | "
        "texts decoded to their bits / registry | largest p |",
        "|---|---|---|---|---|---|",
    ]
    for level, row in report.get("levels", {}).items():
        lines.append(
            f"| {level} | {row['watermarked_tokens_per_s']} | {row['plain_tokens_per_s']} | "
            f"{row['ratio']} | {row['bits_match']}/{row['texts']} / "
            f"{row['registry_match']}/{row['texts']} | {row['max_p_value']:.2g} |"
        )
    det = report.get("detect_batch", {})
    if "texts_per_s" in det:
        lines += [
            "",
            f"`/detect/batch` over the {det['texts']} watermarked texts: "
            f"{det['texts_per_s']} texts/s (statistic {', '.join(det['statistic'])}; "
            f"{det['num_watermarked']} watermarked, {det['num_errors']} errors).",
        ]
    elif det:
        lines += ["", f"`/detect/batch` failed: {det.get('error')}"]
    step = report.get("step", {})
    lines += ["", f"The v2 step alone ({step.get('path')} path), µs a step, median:", ""]
    lines += ["| batch | eager | CUDA graph | eager ≤ 30 µs |", "|---|---|---|---|"]
    for batch, row in step.items():
        if isinstance(row, dict):
            lines.append(
                f"| {batch} | {row['eager_us']} | {row['graph_us']} | {row['eager_within_30us']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, default=ROOT / "gpu-bundle")
    b.add_argument("--python-version", default="3.12")
    b.add_argument("--part-mib", type=int, default=64)
    b.add_argument("--load-mib", type=int, default=27)
    b.add_argument("--offline", action="store_true")
    v = sub.add_parser("verify")
    v.add_argument("--bundle", type=Path, required=True)
    v.add_argument("--into", type=Path, required=True)
    d = sub.add_parser("drive")
    d.add_argument("--device", default="cuda")
    d.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    d.add_argument("--tokens", type=int, default=128)
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--step-batches", type=int, nargs="+", default=[1, 64, 256])
    d.add_argument("--repeats", type=int, default=50)
    d.add_argument("--out", default="gpu-check-out")
    d.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.command == "build":
        if args.part_mib > 64:
            parser.error("--part-mib: at most 64")
        build(args.out, args.python_version, args.part_mib, args.load_mib, args.offline)
    elif args.command == "verify":
        verify(args.bundle, args.into)
    else:
        drive(args)


if __name__ == "__main__":
    main()
