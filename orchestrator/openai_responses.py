"""OpenAI's Responses API (POST /v1/responses) on top of the chat completions
translation: a request becomes a chat completion's body (openai_api.chat_call),
and its answer, whole or streamed, becomes a Response object or the Response
stream's events (orchestrator/responses_answer.py). So everything a chat
completion does (greedy equal to the target alone, sampling, structured
output, tools, prefix reuse) holds here too.

A request may continue a stored response (`previous`: its conversation's
items, orchestrator/responses_routes.py): the messages are those items, then
its own `input`. `conversation` and `background` are refused."""
from __future__ import annotations

from orchestrator.openai_api import Call, chat_call
from orchestrator.openai_params import flag, invalid

# Passed to the chat completion as they are (OpenAI's and vLLM's sampling parameters).
PASSED = ("model", "temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "logit_bias", "stop", "parallel_tool_calls", "stream", "user", "priority")
REFUSED = {
    "prompt": "Tandem keeps no prompt templates; send the prompt as 'input'",
}
LOGPROBS = "message.output_text.logprobs"  # `include`: each output token's log probability
# Echoed in the Response as the request gave them.
ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "temperature", "top_p",
          "tool_choice", "tools", "text", "user", "top_logprobs", "previous_response_id", "reasoning")


def responses_call(body, tool_parser: str | None = None, previous: list[dict] = ()) -> Call:
    """The chat completion that answers a Responses request; `previous`: the
    items of the stored response it continues (previous_items)."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise invalid(name, f"'{name}' is not supported: {why}")
    if flag(body, "background"):
        raise invalid("background", "'background' is not supported: Tandem runs a response while its request waits")
    stores(body)
    truncation(body)
    chat = {name: body[name] for name in PASSED if name in body}
    chat["messages"] = _messages(body, previous)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list):
            raise invalid("tools", "'tools' must be a list of tools")
        chat["tools"] = [_tool(i, tool) for i, tool in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise invalid("text", "'text' must be an object, as {\"format\": {\"type\": \"json_schema\", ...}}")
        if text.get("format") is not None:
            chat["response_format"] = _format(text["format"])
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid("reasoning", "'reasoning' must be an object, as {\"effort\": \"low\"}")
        if reasoning.get("effort") is not None:  # the chat template's variable (openai_api._template_options)
            chat["reasoning_effort"] = reasoning["effort"]
    include = body.get("include") or []
    if not isinstance(include, list):
        raise invalid("include", "'include' must be a list")
    if LOGPROBS in include or body.get("top_logprobs") is not None:
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    if flag(chat, "stream"):
        chat["stream_options"] = {"include_usage": True}  # the last event's Response has the usage
    return chat_call(chat, tool_parser)


def stores(body: dict) -> bool:
    """`store`: true (OpenAI's default) keeps the Response."""
    value = body.get("store")
    if value is None:
        return True
    if not isinstance(value, bool):
        raise invalid("store", f"'store' must be true or false, not {value!r}")
    return value


def truncation(body: dict) -> str:
    """`truncation`: "disabled" (OpenAI's default: a conversation past the
    context window is a 400) or "auto" (its oldest turns are dropped)."""
    value = body.get("truncation") or "disabled"
    if value not in ("auto", "disabled"):
        raise invalid("truncation", f"'truncation' must be 'auto' or 'disabled', not {value!r}")
    return value


def conversation_id(body: dict) -> str | None:
    """`conversation`: a conversation's id, or {"id": ...}; not with previous_response_id."""
    value = body.get("conversation") if isinstance(body, dict) else None
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise invalid("conversation", "'conversation' must be a conversation's id, or {\"id\": ...}")
    if body.get("previous_response_id") is not None:
        raise invalid("conversation", "'conversation' and 'previous_response_id' cannot both be given: a "
                                      "response continues one or the other")
    return value


def previous_id(body: dict) -> str | None:
    value = body.get("previous_response_id") if isinstance(body, dict) else None
    if value is not None and (not isinstance(value, str) or not value):
        raise invalid("previous_response_id", "'previous_response_id' must be a response's id (a string)")
    return value


def _messages(body: dict, previous: list[dict] = ()) -> list[dict]:
    """`instructions`, the previous response's items and `input` as a chat
    completion's messages (a previous response's instructions are not carried
    over, as OpenAI does)."""
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", "'instructions' must be a string")
        messages.append({"role": "system", "content": instructions})
    _add_items(messages, list(previous), "previous_response_id")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("input", "'input' must be a string or a non-empty list of items")
    _add_items(messages, items, "input")
    return messages


def check_items(items, param: str) -> list:
    """Input items (as `input` takes them) that could become a chat
    completion's messages; an ApiError at `param` where one could not."""
    if not isinstance(items, list):
        raise invalid(param, f"'{param}' must be a list of items")
    _add_items([], items, param)
    return items


def _add_items(messages: list[dict], items: list, param: str) -> None:
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(f"{param}[{i}].role", "a message's 'role' must be 'user', 'assistant', 'system' "
                                                    "or 'developer'")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(f"{param}[{i}].content", item.get("content"))})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise invalid(f"{param}[{i}].{name}", f"a function_call's '{name}' must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls of the answer before
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":  # an earlier answer's reasoning: not shown to the model again
            continue
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"{param}[{i}].call_id", "a function_call_output's 'call_id' must be a string")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(f"{param}[{i}].output", item.get("output"))})
        else:
            raise invalid(f"{param}[{i}]", f"input items of type {kind!r} are not supported: give messages "
                                           "(text), function_call, function_call_output and reasoning items")


def _text(param: str, content) -> str:
    """A message's content: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise invalid(f"{param}[{j}]", "content parts must be text ({\"type\": \"input_text\", "
                                               "\"text\": ...}); images and files are not supported")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(param, "content must be a string or a list of text parts")


def _tool(i: int, tool) -> dict:
    """A Responses function tool ({"type": "function", "name", "parameters",
    ...}) as a chat completion's ({"type": "function", "function": {...}})."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise invalid(f"tools[{i}]", f"only function tools are supported, not {kind!r}")
    if isinstance(tool.get("function"), dict):  # already a chat completion's
        return tool
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                             if tool.get(k) is not None}}


def _tool_choice(choice):
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name", (choice.get("function") or {}).get("name"))  # flat, or as chat completions write it
        if isinstance(name, str):
            return {"type": "function", "function": {"name": name}}
    raise invalid("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                 "{\"type\": \"function\", \"name\": ...}")


def _format(fmt) -> dict:
    """text.format as a chat completion's response_format."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema", "a json_schema format needs a 'schema' (an object)")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise invalid("text.format", "'text.format.type' must be 'text', 'json_object' or 'json_schema'")
