"""Tool calls on /v1/chat/completions (OpenAI's `tools` and `tool_choice`).

Parsing (`parse_tools`): `tools` is a list of `{"type": "function", "function": {"name",
"description"?, "parameters"?}}`; `tool_choice` is "none", "auto" (the default with tools),
"required" or `{"type": "function", "function": {"name": ...}}` (a name not in `tools` is a 400).

Rendering: a chat template that takes `tools` (it names them) renders them itself; otherwise the
frontend puts this documented system prompt in front of the conversation (after the caller's own
system message, if the first message is one):

    You can call functions. Their JSON schemas:
    [{"name": ..., "description": ..., "parameters": {...}}, ...]
    To call one, reply with only a JSON object {"name": <function name>, "arguments": <arguments object>}.

and an assistant message's earlier `tool_calls` are rendered in the same format, one per line.
With "none" the tools are not shown to the model.

Constraint: "required" and a named function constrain the reply with a JSON schema
(`call_schema`: `{"name": <const>, "arguments": <the function's parameters>}`, any of the tools
for "required"), so the reply is one valid call. "auto" is free text: a reply that is a call in the
format above (optionally inside `<tool_call>...</tool_call>`, as Hermes/Qwen-style templates ask)
becomes `tool_calls`; anything else is plain content. One call per reply (no parallel calls).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TAGGED = re.compile(r"^<tool_call>\s*(.*?)\s*</tool_call>$", re.S)


class ToolError(ValueError):
    """A bad `tools` or `tool_choice` (a 400 with this message)."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    """The tools a chat request offers and how it may use them."""

    tools: tuple[Tool, ...]
    choice: str  # auto | required | named
    named: str = ""  # the function, when choice == "named"

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def call_schema(self) -> str:
        """The JSON schema (text) a required/named reply must match."""
        def one(t: Tool) -> dict[str, Any]:
            return {"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                    "required": ["name", "arguments"], "additionalProperties": False}

        picked = [t for t in self.tools if self.choice == "required" or t.name == self.named]
        return json.dumps(one(picked[0]) if len(picked) == 1 else {"anyOf": [one(t) for t in picked]})

    def for_template(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in self.tools]


def _tool(i: int, raw: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise ToolError(f"{where} must be an object with type 'function'")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"{where}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise ToolError(f"{where}.function.description must be a string")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema object")
    return Tool(name, desc, params)


def parse_tools(body: dict[str, Any]) -> ToolPlan | None:
    """The request's ToolPlan, or None when no tool may be called (no tools, or tool_choice none)."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise ToolError("'tool_choice' needs 'tools'")
        return None
    if not isinstance(raw, list) or len(raw) > 128:
        raise ToolError("'tools' must be a list of at most 128 functions")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolError("'tools' names a function twice")
    if choice is None or choice == "auto":
        return ToolPlan(tools, "auto")
    if choice == "none":
        return None
    if choice == "required":
        return ToolPlan(tools, "required")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ToolError(f"'tool_choice' names function {name!r}, which is not in 'tools' "
                            f"(have: {', '.join(names)})")
        return ToolPlan(tools, "named", name)
    raise ToolError("'tool_choice' must be 'none', 'auto', 'required' or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def system_prompt(plan: ToolPlan) -> str:
    """The documented rendering for chat templates that take no tools."""
    specs = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in plan.tools]
    return ("You can call functions. Their JSON schemas:\n" + json.dumps(specs) + "\nTo call one, reply with only "
            'a JSON object {"name": <function name>, "arguments": <arguments object>}.')


def with_system_prompt(messages: list[dict[str, str]], plan: ToolPlan) -> list[dict[str, str]]:
    text = system_prompt(plan)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def render_calls(calls: Any) -> str:
    """An assistant message's earlier tool_calls, as text in the documented format."""
    if not isinstance(calls, list):
        raise ToolError("'tool_calls' must be a list")
    lines = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError("each tool call needs function.name")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as e:
            raise ToolError(f"tool call {fn['name']!r}: arguments are not JSON: {e}") from e
        lines.append(json.dumps({"name": fn["name"], "arguments": args}))
    return "\n".join(lines)


def parse_call(text: str, plan: ToolPlan) -> dict[str, Any] | None:
    """The OpenAI tool call a reply holds (`{"id", "type", "function": {"name", "arguments"}}`, the
    arguments as JSON text), or None when it is plain content."""
    s = text.strip()
    m = _TAGGED.match(s)
    if m:
        s = m.group(1)
    if not s.startswith("{"):
        return None
    try:
        obj = json.loads(s)
    except json.JSONDecodeError:
        return None
    names = {t.name for t in plan.tools}
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def may_be_call(text: str) -> bool:
    """Whether streamed text so far could still turn into a call (auto: hold it back until it can't)."""
    s = text.lstrip()
    return not s or s.startswith("{") or s.startswith("<tool_call>") or "<tool_call>".startswith(s)
