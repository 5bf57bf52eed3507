"""``scripts/gpu_service_check.sh`` works on the CPU before it ever meets a GPU.

Its dry run builds a bundle here (the project wheel and the embedded model, in small
parts), verifies and reassembles it, installs it into a private target, starts
``worldcup serve`` and the plain baseline arm on the CPU, drives 1/2/4 concurrent
``/generate`` requests interleaved, decodes every text and times the step: every stage
the GPU run has. The bundle's parts are checked too: a corrupted or missing part is
fatal and named, never a silent install.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _check() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gpu_service_check", ROOT / "scripts" / "gpu_service_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parts_loads_and_sha256(tmp_path: Path) -> None:
    check = _check()
    stage, out = tmp_path / "stage", tmp_path / "bundle"
    (stage / "wheels").mkdir(parents=True)
    sizes = {"wheels/a.whl": 5000, "wheels/empty.whl": 0, "model.gguf": 12_345}
    for name, size in sizes.items():
        (stage / name).write_bytes(os.urandom(size))
    files = sorted(p for p in stage.rglob("*") if p.is_file())
    entries = check.split(files, stage, out, part_cap=4096, load_cap=10_000)
    (out / "manifest.json").write_text(json.dumps({"files": entries}))
    for load in out.glob("load-*"):
        assert sum(p.stat().st_size for p in load.iterdir()) <= 10_000
        assert all(p.stat().st_size <= 4096 for p in load.iterdir())
    assert len(list(out.glob("load-*"))) == 2
    check.verify(out, tmp_path / "files")
    for name in sizes:
        assert (tmp_path / "files" / name).read_bytes() == (stage / name).read_bytes()
    model = next(e for e in entries if e["name"] == "model.gguf")
    part = out / model["parts"][1]
    data = bytearray(part.read_bytes())
    data[7] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=r"sha256 mismatch after reassembly: model\.gguf"):
        check.verify(out, tmp_path / "again")
    part.unlink()
    load = model["parts"][1].split("/")[0]
    with pytest.raises(SystemExit, match=f"1 parts missing, in {load}"):
        check.verify(out, tmp_path / "again")


def test_the_bundle_carries_what_a_cuda_host_lacks() -> None:
    """The service's requirement closure, less what a PyTorch CUDA image ships."""
    check = _check()
    closure = check.service_closure()
    bundled = {name for name in closure if check.to_bundle(name)}
    assert {"fastapi", "uvicorn", "pydantic", "pydantic-settings", "redis", "gguf"} <= bundled
    assert not {"torch", "transformers", "numpy", "scipy", "numba"} & bundled
    assert not any(name.startswith("nvidia-") for name in bundled)


def test_the_dry_run_completes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_service_check.sh"), "--dry-run", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    report = json.loads((out / "report.json").read_text())
    assert report["device"] == "cpu" and report["dry_run"]
    assert sorted(report["levels"], key=int) == ["1", "2", "4"]
    for level, row in report["levels"].items():
        assert row["watermarked_tokens_per_s"] > 0 and row["plain_tokens_per_s"] > 0
        assert len(row["ratios"]) == report["rounds"]
        assert row["texts"] == int(level) * report["rounds"] == len(row["decodes"])
        for dec in row["decodes"]:
            assert 0.0 <= dec["p_value"] <= 1.0 and dec["message_id"] >= 1
    det = report["detect_batch"]  # every watermarked text through /detect/batch, timed
    assert det["texts"] == 7 * report["rounds"] and det["num_errors"] == 0
    assert det["texts_per_s"] > 0 and det["statistic"] == ["model"]
    assert "texts_scored" not in report["levels"]["1"]
    step = report["step"]
    assert step["1"]["eager_us"] > 0 and step["4"]["eager_us"] > 0
    table = (out / "report.md").read_text()
    assert "| concurrent | watermarked tok/s | plain tok/s |" in table
    assert "Device: cpu" in table and "`/detect/batch` over the 14 watermarked texts" in table
    assert not list(tmp_path.glob("gpu-check.*")), "the work folder was left behind"
