"""A request's one output constraint: from ``response_format``, vLLM's
``structured_outputs`` / ``guided_*`` fields, or the chat's ``tools`` with
``tool_choice``, as a :class:`~app.engines.grammar.GrammarSpec` (a 400 for two).

What the engines do with the spec is :mod:`app.engines.grammar`'s; how a tool call
looks to the model is :mod:`.tools`'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from app.core.errors import APIError
from app.engines.grammar import GrammarSpec
from app.schemas.openai.chat import ChatCompletionRequest, NamedToolChoice
from app.schemas.openai.common import SamplingRequest
from app.services.openai.tools import ToolMode, auto_tool_tag, parameters, tool_call_schema

# the constraints whose value is the grammar spec as given, in vLLM's order of precedence:
# ``structured_outputs.<kind>`` and the older ``guided_<kind>``
PLAIN_SPECS: tuple[Literal["regex", "choice", "grammar"], ...] = ("regex", "choice", "grammar")


@dataclass(frozen=True)
class Structure:
    """The output constraint of a request, and how its tools may be called."""

    spec: GrammarSpec | None = None
    tool_mode: ToolMode | None = None
    tool_name: str | None = None  # tool_mode "named"


def bad(param: str, message: str, code: str = "invalid_request") -> APIError:
    return APIError(400, message, code, param=param)


def one_constraint(specs: list[GrammarSpec], tools: Structure | None = None) -> Structure:
    """The request's one output constraint, from whichever field gave it (a 400 for two):
    ``specs`` from :func:`format_specs`, ``tools`` the chat's :func:`tool_use`."""
    tools = tools or Structure()
    if tools.spec is not None:
        specs = [*specs, tools.spec]
    if len(specs) > 1:
        raise bad(
            specs[1].param, f"give one output constraint; {specs[0].param} is already one",
            "conflicting_fields",
        )  # fmt: skip
    return Structure(specs[0] if specs else None, tools.tool_mode, tools.tool_name)


def format_specs(body: SamplingRequest) -> list[GrammarSpec]:
    """The specs of ``response_format``, ``structured_outputs`` and ``guided_*``."""
    specs: list[GrammarSpec] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        specs.append(GrammarSpec("json_object", None, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        specs.append(GrammarSpec("json_schema", schema, "response_format"))
    so = body.structured_outputs
    if so is not None:
        plain = [(k, getattr(so, k)) for k in PLAIN_SPECS if getattr(so, k) is not None]
        if so.json_ is not None:
            specs.append(_json_spec(so.json_, "structured_outputs.json"))
        elif plain:  # the first of regex, choice, grammar
            kind, value = plain[0]
            specs.append(GrammarSpec(kind, value, f"structured_outputs.{kind}"))
        elif so.json_object:
            specs.append(GrammarSpec("json_object", None, "structured_outputs.json_object"))
        elif so.structural_tag is not None:
            param = "structured_outputs.structural_tag"
            tag = _json_value(so.structural_tag, param)
            specs.append(GrammarSpec("structural_tag", tag, param))
    if body.guided_json is not None:
        specs.append(_json_spec(body.guided_json, "guided_json"))
    for kind in PLAIN_SPECS:
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            specs.append(GrammarSpec(kind, value, f"guided_{kind}"))
    return specs


def tool_use(body: ChatCompletionRequest) -> Structure:
    """How the chat's ``tools`` may be called (``tool_choice``), and the grammar that
    forces a call (named, required) or lets one open (auto)."""
    tools = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise bad("tool_choice", "tool_choice needs tools", "tool_choice_needs_tools")
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad("tools", "tool names must be unique", "duplicate_tool_names")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise bad(
                "tool_choice", f"tool_choice names '{name}', which is not in tools",
                "unknown_tool",
            )  # fmt: skip
        tool = tools[names.index(name)]
        return Structure(GrammarSpec("json_schema", parameters(tool), "tools"), "named", name)
    if choice == "required":
        return Structure(GrammarSpec("json_schema", tool_call_schema(tools), "tools"), "required")
    if choice == "auto":
        return Structure(GrammarSpec("structural_tag", auto_tool_tag(tools), "tools"), "auto")
    return Structure()


def _json_value(value: Any, param: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise bad(param, f"{param} is not valid JSON", "invalid_json") from None
    return value


def _json_spec(value: Any, param: str) -> GrammarSpec:
    schema = _json_value(value, param)
    if not isinstance(schema, dict | bool):
        raise bad(param, f"{param} must be a JSON Schema object", "invalid_json")
    return GrammarSpec("json_schema", schema, param)
