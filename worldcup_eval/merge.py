"""Cells of another run of the same protocol, added to a ``results.json``.

A preset evaluated in a second, smaller run (``worldcup eval --bits 32 --schemes
...``, from the same cache) belongs in the one results file beside the main grid.
:func:`merge_results` adds its cells only when the two runs measured the same
thing: the same model, key, prompts and length, and every cell the two runs share
equal apart from its report-time decoding time. The merge is recorded under
``merged`` (the second run's command, configuration and commit).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

SECTIONS = ("main", "ablation", "curves", "robustness")
SAME_PROTOCOL = ("model", "key_id", "generated_length", "prompts", "prompts_by_dataset")
VOLATILE = ("timing",)  # measured at report time: differs between runs


def _cell_id(section: str, cell: dict[str, Any]) -> tuple[Any, ...]:
    return (
        section,
        cell.get("scheme"),
        cell.get("bits"),
        cell.get("length"),
        cell.get("role"),
        cell.get("attack"),
    )


def _stable(cell: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cell.items() if k not in VOLATILE}


def merge_results(
    into: dict[str, Any], other: dict[str, Any], schemes: Sequence[str]
) -> dict[str, Any]:
    """``into`` with ``other``'s cells of ``schemes`` added (a new dict; both unchanged).

    Raises ValueError when the runs differ in protocol, when a cell both hold differs,
    when ``into`` already has a cell of ``schemes``, or when ``other`` has none.
    """
    if not schemes:
        raise ValueError("name the schemes whose cells to add")
    for field in SAME_PROTOCOL:
        if into["protocol"].get(field) != other["protocol"].get(field):
            raise ValueError(f"the runs differ in protocol.{field}: not the same measurement")
    wanted = set(schemes)
    ours = {_cell_id(s, c): c for s in SECTIONS for c in into.get(s, [])}
    out = copy.deepcopy(into)
    added = 0
    for section in SECTIONS:
        for cell in other.get(section, []):
            key = _cell_id(section, cell)
            if cell.get("scheme") in wanted:
                if key in ours:
                    raise ValueError(f"{section} already holds {key[1:]}")
                out.setdefault(section, []).append(copy.deepcopy(cell))
                added += 1
            elif key in ours and _stable(ours[key]) != _stable(cell):
                raise ValueError(f"the runs disagree on the shared cell {key}")
    if not added:
        raise ValueError(f"the other run has no cell of {sorted(wanted)}")
    encoding = [e for e in other["timing"]["encoding"] if e["scheme"] in wanted]
    out["timing"]["encoding"] = [*out["timing"]["encoding"], *copy.deepcopy(encoding)]
    out["merged"] = [
        *out.get("merged", []),
        {
            "schemes": sorted(wanted),
            "cells": added,
            "command": other["environment"].get("command"),
            "git_commit": other["environment"].get("git_commit"),
            "config": other["config"],
        },
    ]
    return out
