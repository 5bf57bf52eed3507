"""Structured outputs: grammars compiled by xgrammar, applied before the watermark.

A request's structure (``response_format``, vLLM's ``structured_outputs`` /
``guided_*`` fields, or a forced tool call) becomes a :class:`GrammarSpec`. The
service compiles it with xgrammar (the grammar engine vLLM uses) for the
served tokenizer, off the event loop, so that an invalid schema or regex is a
400 before anything is allocated. Each choice then carries a
:class:`GrammarConstraint` (:class:`worldcup_core.generation.TokenConstraint`):

- the ``hf`` engine asks it for the grammar's allowed-token mask before every
  step (an xgrammar ``GrammarMatcher``), which the sampling pipeline
  (:mod:`worldcup_core.pipeline`) applies before the filters and the watermark,
  and tells it every sampled token;
- the ``vllm`` engine hands its ``spec`` to vLLM's own ``StructuredOutputsParams``
  (its xgrammar backend applies the bitmask before any logits processor, so
  again before the WorldCup step), and its ``banned`` ids to the processor.

Both engines read one table, :data:`GRAMMARS`, keyed by the spec's kind: how
xgrammar compiles it, what vLLM is given for it, and whether it masks raw
control characters. Either way the watermark chooses among the tokens the
grammar allows, never one it forbids. Nothing here matches JSON Schema by hand:
xgrammar compiles the schema into a grammar over the tokenizer's vocabulary.

JSON is generated without free whitespace (``any_whitespace=False``, compact
separators; vLLM: ``disable_any_whitespace``): a small model left free to emit
whitespace inside JSON can fill its token budget with it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import xgrammar as xgr

from app.core.errors import APIError

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
MAX_GRAMMAR_BYTES = 64 * 1024  # a schema, regex or grammar, serialised
SEPARATORS = (",", ":")  # as vLLM's xgrammar backend with disable_any_whitespace
ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match; ``param`` names the request field it came from."""

    kind: GrammarKind
    value: Any  # schema dict | None (json_object) | regex | [choices] | EBNF | structural tag
    param: str

    def canonical(self) -> str:
        return json.dumps([self.kind, self.value], sort_keys=True)


@dataclass(frozen=True)
class Grammar:
    """How one kind of spec reaches each engine."""

    compile: Callable[[xgr.GrammarCompiler, Any], xgr.CompiledGrammar]  # hf, and validation
    vllm: Callable[[Any], dict[str, Any]]  # vLLM's StructuredOutputsParams keywords
    printable: bool = False  # also mask tokens holding a raw control character (JSON)


def _json(compiler: xgr.GrammarCompiler, schema: Any) -> xgr.CompiledGrammar:
    """A JSON Schema in xgrammar's strict mode, as vLLM compiles every schema: properties
    and items the schema does not declare are not generated (``"strict": false`` in a
    ``response_format`` changes nothing)."""
    return compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=SEPARATORS
    )


def _choice_tag(choices: list[str]) -> dict[str, Any]:
    """``choice`` as xgrammar's structural tag (an "or" of constant strings)."""
    elements = [{"type": "const_string", "value": c} for c in choices]
    return {"type": "structural_tag", "format": {"type": "or", "elements": elements}}


GRAMMARS: dict[GrammarKind, Grammar] = {
    "json_schema": Grammar(_json, lambda schema: {"json": schema}, printable=True),
    # json_object: any object, the same on both engines
    "json_object": Grammar(
        lambda c, _: _json(c, ANY_OBJECT), lambda _: {"json": ANY_OBJECT}, printable=True
    ),
    "regex": Grammar(lambda c, v: c.compile_regex(v), lambda v: {"regex": v}),
    "choice": Grammar(
        lambda c, v: c.compile_structural_tag(_choice_tag(v)), lambda v: {"choice": list(v)}
    ),
    "grammar": Grammar(lambda c, v: c.compile_grammar(v), lambda v: {"grammar": v}),
    "structural_tag": Grammar(
        lambda c, v: c.compile_structural_tag(v), lambda v: {"structural_tag": json.dumps(v)}
    ),
}
"""Every grammar kind, by name: the one place both engines look a spec up."""


_compilers: dict[int, tuple[Any, xgr.GrammarCompiler]] = {}
_lock = threading.Lock()


def _compiler(tokenizer: Any) -> xgr.GrammarCompiler:
    """One compiler (with its grammar cache) per tokenizer."""
    with _lock:
        entry = _compilers.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer)
            entry = (tokenizer, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True))
            _compilers[id(tokenizer)] = entry
        return entry[1]


def compile_spec(tokenizer: Any, spec: GrammarSpec) -> xgr.CompiledGrammar:
    """Compile ``spec`` for ``tokenizer`` (cached); a 400 naming the field if invalid."""
    if len(spec.canonical().encode()) > MAX_GRAMMAR_BYTES:
        raise APIError(
            400, f"{spec.param} may serialise to at most {MAX_GRAMMAR_BYTES} bytes",
            "grammar_too_large", param=spec.param,
        )  # fmt: skip
    try:
        return GRAMMARS[spec.kind].compile(_compiler(tokenizer), spec.value)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError on bad input
        message = (
            str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        )
        raise APIError(
            400, f"{spec.param}: the grammar engine rejected it: {message}",
            "invalid_structured_output", param=spec.param,
        ) from None  # fmt: skip


_printable: dict[int, tuple[Any, torch.Tensor, tuple[int, ...]]] = {}


def _printable_tokens(info: xgr.TokenizerInfo) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tokens whose text holds no control character (below 0x20, or 0x7f), as a
    mask, and the others' ids.

    Compact JSON never needs one (inside a string a control character must be escaped
    as ``\\u00XX``, in printable characters), yet xgrammar's JSON grammar lets some
    through as raw string characters, and then the answer is not valid JSON (a strict
    parser such as Python's ``json.loads`` refuses it). So JSON specs also mask them."""
    with _lock:
        entry = _printable.get(id(info))
        if entry is None or entry[0] is not info:
            ok = [not any(b < 0x20 or b == 0x7F for b in t) for t in info.decoded_vocab]
            ok = (ok + [True] * info.vocab_size)[: info.vocab_size]  # padded ids: the grammar's
            mask = torch.tensor(ok, dtype=torch.bool)
            banned = tuple(int(i) for i in (~mask).nonzero().flatten().tolist())
            entry = (info, mask, banned)
            _printable[id(info)] = entry
        return entry[1], entry[2]


class GrammarConstraint:
    """One choice's grammar state (:class:`worldcup_core.generation.TokenConstraint`).

    Used by the generation thread only: ``allowed`` before a step, ``accept``
    after it. ``spec`` travels along for engines with their own backend (vLLM), and
    so does ``banned`` (JSON specs: the tokens with a control character), which the
    vLLM processor enforces as ``allowed`` does here: unless nothing else is left.
    """

    def __init__(self, spec: GrammarSpec, compiled: xgr.CompiledGrammar) -> None:
        self.spec = spec
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab = compiled.tokenizer_info.vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, self._vocab)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.printable: torch.Tensor | None = None
        self.banned: tuple[int, ...] = ()
        if GRAMMARS[spec.kind].printable:
            self.printable, self.banned = _printable_tokens(compiled.tokenizer_info)
        self.rejected = 0  # tokens the matcher refused (never expected: the mask forbids them)

    def __repr__(self) -> str:
        return f"GrammarConstraint({self.spec.kind}, terminated={self._matcher.is_terminated()})"

    def allowed(self) -> torch.Tensor | None:
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bits = (self._bitmask[0].unsqueeze(-1) >> self._shifts) & 1
        allowed = bits.bool().flatten()[: self._vocab]
        if self.printable is not None:
            strict = allowed & self.printable
            if bool(strict.any()):  # never leave the grammar without a token
                return strict
        return allowed

    def accept(self, token: int) -> None:
        if self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(int(token)):
            self.rejected += 1

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
