"""The batched v2 step's per-step host work ("glue") at batch 1, 64 and 256, on the CPU.

Per-step Python must not grow with the batch (issue #25): the slot tables live in
tensors, each step is a fixed sequence of calls whatever B. This measures it
directly: ``BatchedWorldCup.step`` with its kernel replaced by a stub that returns
at once, so what remains is the glue (slot index, dtype/contiguity checks, output
allocation, the launch call):

* ``compiled``: the CPU path's glue around the numba loop;
* ``fused``: the CUDA path's glue around the Triton launch (run here on CPU tensors;
  on a GPU add the launch itself, which ``scripts/gpu_bench.py`` times);
* ``fused, list slots``: the same with the slots given as a Python list (copied to the
  device each step: the one per-row cost a caller can avoid by passing a tensor);
* ``fused, preallocated out``: the same with the output buffer passed in (``out=``, as a
  CUDA-graph capture or a caller with a per-shape workspace does): the launch and
  nothing else;
* for reference, the full steps: ``compiled`` (the numba loop itself, which grows
  with B by design) and ``tensor`` (torch ops, whose count is fixed; their compute
  grows with B).

Every configuration is timed interleaved with the others, round after round in a
shuffled order, on one thread; the table gives medians in microseconds and the
256/1 ratio.

    .venv/bin/python scripts/step_glue_bench.py [--repeats 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from worldcup_core import Payload, WatermarkConfig, WatermarkKey, WorldCup, batched
from worldcup_core.batched import BatchedWorldCup, StepPath

BATCHES = (1, 64, 256)


def _stub(*args: Any) -> None:
    """A kernel that does nothing: the step's glue alone."""


class Case:
    """One configuration: a path, whether its kernel runs, how slots are given."""

    def __init__(
        self, name: str, path: StepPath, stubbed: bool, list_slots: bool, out: bool = False
    ) -> None:
        self.name, self.path, self.stubbed, self.list_slots = name, path, stubbed, list_slots
        self.out = out

    def __enter__(self) -> None:
        batched.FORCE_PATH = self.path
        self._saved = batched._compiled_kernel, batched._fused_kernel
        if self.stubbed:
            batched._compiled_kernel = lambda: _stub  # type: ignore[assignment]
            batched._fused_kernel = lambda: _stub  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        batched.FORCE_PATH = None
        batched._compiled_kernel, batched._fused_kernel = self._saved


CASES = [
    Case("compiled: glue (kernel stubbed)", StepPath.COMPILED, True, False),
    Case("fused: glue (launch stubbed)", StepPath.FUSED, True, False),
    Case("fused: glue, slots as a list", StepPath.FUSED, True, True),
    Case("fused: glue, preallocated out", StepPath.FUSED, True, False, out=True),
    Case("compiled: full step", StepPath.COMPILED, False, False),
    Case("tensor: full step", StepPath.TENSOR, False, False),
]


def batch_of(rows: int, n: int, rng: np.random.Generator) -> Callable[[Case], None]:
    """A batch of ``rows`` default-configured v2 rows past their first c tokens; returns
    a function that runs one step (slots as a tensor, or as a list)."""
    step = BatchedWorldCup("cpu", capacity=rows)
    for slot in range(rows):
        scheme = WorldCup(WatermarkKey(rng.bytes(32)), WatermarkConfig())
        step.set_row(slot, scheme, Payload.random(32, rng))
    slots = torch.arange(rows)
    for _ in range(8):
        step.append(slots, torch.from_numpy(rng.integers(0, 50_000, rows)))
    cand = torch.from_numpy(rng.integers(0, 50_000, (rows, n)))
    probs = torch.from_numpy(rng.dirichlet(np.full(n, 0.5), size=rows))
    listed = list(range(rows))
    buffer = torch.empty_like(probs)

    def run(case: Case) -> None:
        step.step(listed if case.list_slots else slots, cand, probs, buffer if case.out else None)

    return run


def measure(repeats: int, candidates: int) -> dict[str, dict[int, float]]:
    rng = np.random.default_rng(0)
    runs = {rows: batch_of(rows, candidates, rng) for rows in BATCHES}
    times: dict[str, dict[int, list[float]]] = {c.name: {b: [] for b in BATCHES} for c in CASES}
    for case in CASES:  # compile and warm every path first
        with case:
            for rows in BATCHES:
                runs[rows](case)
    order = [(case, rows) for case in CASES for rows in BATCHES]
    for _ in range(repeats):  # interleaved: every configuration once a round, shuffled
        for i in rng.permutation(len(order)):
            case, rows = order[i]
            with case:
                start = time.perf_counter_ns()
                runs[rows](case)
                times[case.name][rows].append((time.perf_counter_ns() - start) / 1e3)
    return {
        name: {rows: statistics.median(ts) for rows, ts in by_rows.items()}
        for name, by_rows in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--candidates", type=int, default=32, help="candidates per row")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    medians = measure(args.repeats, args.candidates)
    if args.json:
        print(json.dumps({"candidates": args.candidates, "median_us": medians}))  # noqa: T201
        return
    head = f"{'us per step (median)':34}" + "".join(f"{'B=' + str(b):>10}" for b in BATCHES)
    print(head + f"{'256/1':>8}")  # noqa: T201
    for name, by_rows in medians.items():
        cells = "".join(f"{by_rows[b]:10.1f}" for b in BATCHES)
        print(f"{name:34}{cells}{by_rows[256] / by_rows[1]:8.2f}")  # noqa: T201


if __name__ == "__main__":
    main()
