"""Running the fused Triton step on the CPU, for the tests: Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before ``worldcup_core._step_triton`` is imported
(``triton.jit`` reads it when a kernel is defined); the test modules that drive the
fused path call :func:`use_interpreter` at import, where no GPU is present.

The interpreter runs a kernel op by op in numpy. On top of that it re-patches the
whole ``triton.language`` namespace (a few ms) on *every* call of a ``@triton.jit``
helper (``tl.sum``, the SipHash round, ...), although the kernel's own patch is
still in force; in the fused step that was two thirds of the time.
:func:`fewer_patches` skips those repeats within one launch: the first call per
module still patches (what the interpreter needs), the rest reuse it. It relies on
the interpreter's ``_patch_lang``; if a Triton release renames it, the tests run at
the interpreter's own speed instead of failing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

KERNEL = "_step_kernel"


def use_interpreter() -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@contextlib.contextmanager
def fewer_patches() -> Iterator[None]:
    from triton.runtime import interpreter

    original: Callable[[Any], Any] | None = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope is None:
        yield
        return
    patched: set[int] = set()

    def patch_once(fn: Any) -> Any:
        if getattr(fn, "__name__", "") == KERNEL:  # a new launch: its patch is restored after
            patched.clear()
        key = id(fn.__globals__)
        if key in patched:
            return scope()
        patched.add(key)
        return original(fn)

    interpreter._patch_lang = patch_once
    try:
        yield
    finally:
        interpreter._patch_lang = original
