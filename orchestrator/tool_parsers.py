"""Tool calls in a model's free text, for the HTTP API's tool_choice "auto"
(`tandem serve orchestrator --tool-call-parser`): the model writes its calls in
its own format, which is parsed out of the answer. The text itself is what the
target alone generates; parsing only reshapes it.

hermes: Qwen2.5's and Hermes' format, which their chat templates teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

one block a call, after any text of the answer's own (the content; text after
the calls is dropped, as vLLM's hermes parser does)."""
from __future__ import annotations

import json
import re
import uuid

PARSERS = ("hermes",)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)


def parse(text: str) -> tuple[str | None, list[dict] | None]:
    """(the content before the calls, or None if there is none; OpenAI's
    tool_calls, or None where the text holds no complete, well-formed call).
    A text whose blocks do not all parse is left as it is: (text, None)."""
    start = text.find(_OPEN)
    if start < 0:
        return text, None
    calls = []
    for block in _BLOCK.findall(text[start:]):
        try:
            call = json.loads(block)
            name, arguments = call["name"], call.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, None
        if not isinstance(name, str):
            return text, None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)}})
    if not calls:  # an opening tag without its closing one (cut by max_tokens, say)
        return text, None
    content = text[:start].strip()
    return content or None, calls


def sendable(text: str) -> int:
    """How much of a streamed answer's text may go out as content now: all of
    it before a call's opening tag, less an end that could begin one."""
    start = text.find(_OPEN)
    if start >= 0:
        return start
    for keep in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
