"""Structured outputs: grammars compiled by xgrammar, applied before the watermark.

A request's structure (``response_format``, vLLM's ``structured_outputs`` /
``guided_*`` fields, or a forced tool call) becomes a :class:`GrammarSpec`. The
service compiles it with xgrammar (the grammar engine vLLM uses) for the
served tokenizer, off the event loop, so that an invalid schema or regex is a
400 before anything is allocated. Then:

- on the ``hf`` engine each choice gets a :class:`GrammarConstraint` (an
  xgrammar ``GrammarMatcher``): before every step it hands the sampling
  pipeline (:mod:`worldcup_core.pipeline`) the grammar's allowed-token mask,
  which is applied before the filters and the watermark, and it is told every
  sampled token;
- on the ``vllm`` engine the spec becomes vLLM's own ``StructuredOutputsParams``
  (its xgrammar backend applies the bitmask before any logits processor, so
  again before the WorldCup step).

Either way the watermark chooses among the tokens the grammar allows, never
one it forbids. Nothing here matches JSON Schema by hand: xgrammar compiles
the schema into a grammar over the tokenizer's vocabulary.

JSON is generated without free whitespace (``any_whitespace=False``, compact
separators; vLLM: ``disable_any_whitespace``): a small model left free to emit
whitespace inside JSON can fill its token budget with it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

import torch
import xgrammar as xgr

from app.core.errors import APIError

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
MAX_GRAMMAR_BYTES = 64 * 1024  # a schema, regex or grammar, serialised

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


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


def json_schema_of(spec: GrammarSpec) -> Any:
    """The JSON Schema a json_schema/json_object spec compiles (the same on both engines).

    Compiled in xgrammar's strict mode, as vLLM compiles every schema: properties and
    items the schema does not declare are not generated (``"strict": false`` in a
    ``response_format`` changes nothing); ``json_object`` is any object."""
    return ANY_OBJECT if spec.kind == "json_object" else spec.value


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


def structural_tag_json(spec: GrammarSpec) -> dict[str, Any]:
    """``choice`` as xgrammar's structural tag (an "or" of constant strings)."""
    elements = [{"type": "const_string", "value": c} for c in spec.value]
    return {"type": "structural_tag", "format": {"type": "or", "elements": elements}}


def compile_spec(tokenizer: Any, spec: GrammarSpec) -> xgr.CompiledGrammar:
    """Compile ``spec`` for ``tokenizer`` (cached); a 400 naming the field if invalid."""
    if len(spec.canonical().encode()) > MAX_GRAMMAR_BYTES:
        raise APIError(
            400, f"{spec.param} may serialise to at most {MAX_GRAMMAR_BYTES} bytes",
            "grammar_too_large", param=spec.param,
        )  # fmt: skip
    compiler = _compiler(tokenizer)
    try:
        if spec.kind in ("json_schema", "json_object"):
            return compiler.compile_json_schema(
                json.dumps(json_schema_of(spec)), any_whitespace=False, separators=SEPARATORS
            )
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_structural_tag(structural_tag_json(spec))
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.value)
        return compiler.compile_structural_tag(spec.value)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError on bad input
        message = (
            str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        )
        raise APIError(
            400, f"{spec.param}: the grammar engine rejected it: {message}",
            "invalid_structured_output", param=spec.param,
        ) from None  # fmt: skip


_printable: dict[int, tuple[Any, torch.Tensor]] = {}


def _printable_tokens(info: xgr.TokenizerInfo) -> torch.Tensor:
    """The tokens whose text holds no control character (below 0x20, or 0x7f).

    Compact JSON never needs one (inside a string a control character must be escaped
    as ``\\u00XX``, in printable characters), yet xgrammar's JSON grammar lets some
    through as raw string characters, and then the answer is not valid JSON (a strict
    parser such as Python's ``json.loads`` refuses it). So JSON specs also mask them."""
    with _lock:
        entry = _printable.get(id(info))
        if entry is None or entry[0] is not info:
            ok = [not any(b < 0x20 or b == 0x7F for b in t) for t in info.decoded_vocab]
            ok = (ok + [True] * info.vocab_size)[: info.vocab_size]  # padded ids: the grammar's
            entry = (info, torch.tensor(ok, dtype=torch.bool))
            _printable[id(info)] = entry
        return entry[1]


class GrammarConstraint:
    """One choice's grammar state (:class:`worldcup_core.generation.TokenConstraint`).

    Used by the generation thread only: ``allowed`` before a step, ``accept``
    after it. ``spec`` travels along for engines with their own backend (vLLM), and
    so does ``printable`` (JSON specs: the tokens without a control character), which
    the vLLM processor enforces the same way (:func:`app.engines.vllm.json_bans`).
    """

    def __init__(self, spec: GrammarSpec, compiled: xgr.CompiledGrammar) -> None:
        self.spec = spec
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab = compiled.tokenizer_info.vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, self._vocab)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.printable = (
            _printable_tokens(compiled.tokenizer_info)
            if spec.kind in ("json_schema", "json_object")
            else None
        )
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


# --------------------------------------------------------------------------- tools
def tool_call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """``tool_choice: "required"``: one call to any of ``tools``, as
    ``{"name": ..., "arguments": {...}}``."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["name"]},
                    "arguments": parameters(t),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def auto_tool_tag(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """``tool_choice: "auto"``: free text, in which ``<tool_call>`` opens one call
    whose name and arguments the grammar then constrains (xgrammar's triggered tags)."""
    tags = [
        {
            "type": "tag",
            "begin": f'{TOOL_OPEN}{{"name": {json.dumps(t["name"])}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": parameters(t)},
            "end": f"}}{TOOL_CLOSE}",
        }
        for t in tools
    ]
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": [TOOL_OPEN], "tags": tags},
    }


def tool_prompt(tools: list[dict[str, Any]], choice: str) -> str:
    """The system text that shows the model its tools (the embedded model's chat
    template has no tool syntax of its own)."""
    lines = ["You can call these functions:"]
    for t in tools:
        entry = {"name": t["name"], "parameters": parameters(t)}
        if t.get("description"):
            entry["description"] = t["description"]
        lines.append(json.dumps(entry))
    if choice == "auto":
        lines.append(
            f'To call one, write {TOOL_OPEN}{{"name": <name>, "arguments": <JSON object>}}'
            f"{TOOL_CLOSE}; otherwise answer in plain text."
        )
    else:
        lines.append('Answer with the call as JSON: {"name": <name>, "arguments": <object>}.')
    return "\n".join(lines)
