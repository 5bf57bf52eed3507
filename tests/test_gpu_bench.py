"""``scripts/gpu_bench.py`` runs end to end on the CPU before it ever meets a GPU.

Its dry run builds a tiny random Llama, decodes through the project's loop plain and
watermarked on both step paths (the fused kernel through Triton's interpreter), times
the step alone and decodes the texts: every section the GPU run has, with failures
fatal. A GPU's device time is scarce; a script that crashes on it wastes the loan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_benchmark_dry_run_completes(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--dry-run", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["interpreter"] and report["arch"] == "tiny"
    assert sorted(report["batches"]) == ["1", "2"]
    for row in report["batches"].values():
        decoding, alone = row["decoding"], row["step_alone"]
        for path in ("fused", "tensor"):
            assert decoding[path]["step_ms"] > 0 and 0.0 <= decoding[path]["bit_accuracy"] <= 1.0
            assert alone[f"{path}_us_per_row"] > 0
        assert decoding["plain"]["tokens_per_s"] > 0
        # the fused kernel and the tensor path agree, so both sample the same texts
        assert alone["fused_vs_tensor_max_abs_diff"] < 1e-12
        batch = decoding["fused_and_tensor_same_texts"].split("/")[1]
        assert decoding["fused_and_tensor_same_texts"] == f"{batch}/{batch}"
