"""Function tools as the model sees them: the prompt that shows the tools, the grammars
that force or allow a call, and a call's text (``<tool_call>{...}</tool_call>``),
written into earlier turns and parsed back out of a reply.

The embedded model's chat template has no tool syntax of its own, so tools are
shown in a system text and a call is JSON between two tags.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
ToolMode = Literal["named", "required", "auto"]

_TOOL_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


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
    """The system text that shows the model its tools."""
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


def call_text(name: str, arguments: str) -> str:
    """An earlier turn's call as the model would have written it."""
    return f'{TOOL_OPEN}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{TOOL_CLOSE}'


def parse_calls(
    mode: ToolMode, text: str, named: str | None = None
) -> tuple[str | None, list[tuple[str, Any]]]:
    """The content and the (name, arguments) calls of a reply, by its tool mode; text
    that does not parse as a call stays content. ``named``: the forced tool's name."""
    if mode == "named":
        assert named is not None
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [(named, text)]
    if mode == "required":
        try:
            obj = json.loads(text)
            return None, [(str(obj["name"]), obj["arguments"])]
        except (ValueError, KeyError, TypeError):
            return text, []
    calls: list[tuple[str, Any]] = []
    rest: list[str] = []
    position = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
            found = (str(obj["name"]), obj["arguments"])
        except (ValueError, KeyError, TypeError):
            continue
        rest.append(text[position : match.start()])
        position = match.end()
        calls.append(found)
    rest.append(text[position:])
    content = "".join(rest).strip()
    return (content or None) if calls else text, calls
