"""Tool calls in a model's free text, for the HTTP API's tool_choice "auto"
(`tandem serve orchestrator --tool-call-parser NAME`): the model writes its
calls in its own format, which is parsed out of the answer. The text itself is
what the target alone generates; parsing only reshapes it. The formats are
those vLLM's parsers of the same names read:

hermes: Qwen2.5's and Hermes' format, which their chat templates teach, one
block a call, after any text of the answer's own (the content; text after the
calls is dropped, as vLLM's hermes parser does):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

llama3_json: Llama 3.1 and 3.2's JSON calls, the whole answer, separated by
";" (the <|python_tag|> before them is a special token, gone from the text):

    {"name": "get_weather", "parameters": {"city": "Oslo"}}

mistral: Mistral's [TOOL_CALLS] and a JSON list of calls. [TOOL_CALLS] is a
special token, so the text usually holds only the list, which must then be
the whole answer; where the tag is in the text, what precedes it is content:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]

pythonic: Llama 3.2's and Llama 4's Python list of calls, the whole answer,
keyword arguments of literal values:

    [get_weather(city="Oslo"), get_time(zone="CET")]

A text that does not hold complete, well-formed calls is left as it is: its
content, no calls.

Streamed, `read` follows the JSON formats' calls (and tool_choice "required"'s
list) as they are written, for each call's arguments to go out as they grow;
a call's arguments are the model's own JSON text, in whole answers too. The
pythonic format's calls go out one by one, each whole once its closing
parenthesis is written (its arguments are Python, written out as JSON)."""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(_HERMES_OPEN) + r"(.*?)" + re.escape(_HERMES_CLOSE), re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_TAG = "[TOOL_CALLS]"
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
_DECODER = json.JSONDecoder()


def parse(parser: str, text: str) -> tuple[str | None, list[dict] | None]:
    """(the content before the calls, or None if there is none; OpenAI's
    tool_calls, or None where the text holds no complete, well-formed call)."""
    found = _PARSE[parser](text)
    if found is None:
        return text, None
    content, calls = found
    content = content.strip()
    written = read(parser, text).whole  # the arguments as the model wrote them, as a stream sends them
    if [c.name for c in written] == [name for name, _ in calls]:
        calls = [(name, c.arguments) for (name, _), c in zip(calls, written)]
    return content or None, [openai_call(name, arguments) for name, arguments in calls]


def sendable(parser: str, text: str) -> int:
    """How much of a streamed answer's text may go out as content now: none
    of the calls, nor an end of the text that could begin them."""
    if parser == "hermes":
        return before_tag(text, _HERMES_OPEN)
    if parser == "mistral":
        if _opens(text, "[", _MISTRAL_TAG):
            return 0
        return before_tag(text, _MISTRAL_TAG)
    opener = {"llama3_json": ("{", _PYTHON_TAG), "pythonic": ("[", _PYTHON_START)}[parser]
    return 0 if _opens(text, *opener) else len(text)


def call_id() -> str:
    """A new tool call's id, as OpenAI's look."""
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_call(name: str, arguments) -> dict:
    """One of OpenAI's tool_calls; arguments as JSON text, or a value to write as it."""
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments, ensure_ascii=False)}}


def listed_calls(text: str) -> tuple[list[dict], int, bool]:
    """tool_choice "required"'s answer, a JSON list of {"name", "parameters"}
    objects (its grammar allows nothing else), read as far as it is complete:
    (OpenAI's tool_calls of its complete objects, where the text after the
    last of them starts, whether the list is closed). Cut short, the calls
    before the cut stand."""
    reading = read("required", text)
    whole = reading.whole
    return [openai_call(c.name, c.arguments) for c in whole], reading.after if whole or reading.closed else 0, \
        reading.closed


@dataclass
class Begun:
    """A call as far as the text has it: its name, its arguments as the model
    writes them (their JSON text, which only grows), and where its object
    ends (None while it is open)."""
    name: str
    arguments: str
    end: int | None = None


@dataclass
class Reading:
    """The calls of an answer so far: those begun (a name, and arguments begun
    or the object closed), the text after the last closed one (`after`), and
    whether the calls are closed (the list's bracket; for formats without one,
    every begun call's object)."""
    calls: list[Begun] = field(default_factory=list)
    after: int = 0
    closed: bool = False

    @property
    def whole(self) -> list[Begun]:
        return [c for c in self.calls if c.end is not None]


def read(parser: str, text: str) -> Reading:
    """The calls of a streamed answer as far as they go, for their arguments
    to go out as the model writes them ("required" is tool_choice's list).
    The pythonic format's calls are Python: each is read whole, once closed."""
    if parser == "hermes":
        reading, at = Reading(), text.find(_HERMES_OPEN)
        while at >= 0:
            at = _skip_space(text, at + len(_HERMES_OPEN))
            close = text.find(_HERMES_CLOSE, at)
            begun = _read_object(text[:close] if close >= 0 else text, at, "arguments")
            if begun is None:
                break
            reading.calls.append(begun)
            if begun.end is None or close < 0:
                break
            reading.after = close + len(_HERMES_CLOSE)
            at = text.find(_HERMES_OPEN, reading.after)
        reading.closed = bool(reading.calls) and reading.calls[-1].end is not None
        return reading
    if parser == "llama3_json":
        at = _skip_space(text, 0)
        if text.startswith(_PYTHON_TAG, at):
            at = _skip_space(text, at + len(_PYTHON_TAG))
        return _read_calls(text, at, "parameters", ";", None)
    if parser == "mistral":
        tag = text.find(_MISTRAL_TAG)
        at = _skip_space(text, tag + len(_MISTRAL_TAG) if tag >= 0 else 0)
        return _read_calls(text, at + 1, "arguments", ",", "]") if text.startswith("[", at) else Reading()
    if parser == "required":
        at = _skip_space(text, 0)
        return _read_calls(text, at + 1, "parameters", ",", "]") if text.startswith("[", at) else Reading()
    if parser == "pythonic":
        return _read_pythonic(text)
    return Reading()


def _read_pythonic(text: str) -> Reading:
    """The pythonic list's calls that are closed so far, each whole: a scan
    of brackets outside string literals finds where each element ends, and
    `_python_call` reads it. A text that stops being such a list stops the
    reading (the whole answer's parse then decides)."""
    at = _skip_space(text, 0)
    if text.startswith(_PYTHON_START, at):
        at = _skip_space(text, at + len(_PYTHON_START))
    reading = Reading(after=at)
    if not text.startswith("[", at):
        return reading
    start, depth, quote, i = _skip_space(text, at + 1), 0, "", at + 1
    while i < len(text):
        char = text[i]
        if quote:  # inside a string literal: its closing quote, past escapes
            if char == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i += len(quote)
                quote = ""
                continue
        elif char in "'\"":
            quote = char * 3 if text.startswith(char * 3, i) else char
            i += len(quote)
            continue
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth < 0:  # the list's own bracket
                reading.closed, reading.after = char == "]" and bool(reading.calls), i + 1
                break
            if depth == 0:
                call = _python_call(text[start:i + 1]) if char == ")" else None
                if call is None:
                    break
                reading.calls.append(Begun(call[0], json.dumps(call[1], ensure_ascii=False), i + 1))
                reading.after = i + 1
                start = _skip_space(text, i + 1)
                if start < len(text) and text[start] not in ",]":
                    break
                if text.startswith(",", start):
                    start = _skip_space(text, start + 1)
        i += 1
    return reading


def _read_calls(text: str, at: int, arguments_key: str, separator: str, closer: str | None) -> Reading:
    """Call objects from text[at] on, apart by `separator`, up to `closer`
    (None: the end of the text)."""
    reading = Reading(after=at)
    at = _skip_space(text, at)
    while at < len(text):
        if closer is not None and text.startswith(closer, at):
            reading.closed, reading.after = True, at + 1
            return reading
        if not text.startswith("{", at):
            break
        begun = _read_object(text, at, arguments_key)
        if begun is None:
            break
        reading.calls.append(begun)
        if begun.end is None:
            break
        reading.after = at = _skip_space(text, begun.end)
        if text.startswith(separator, at):
            at = _skip_space(text, at + 1)
        elif closer is not None and not text.startswith(closer, at):
            break
    reading.closed = closer is None and bool(reading.calls) and reading.calls[-1].end is not None
    return reading


def _read_object(text: str, at: int, arguments_key: str) -> Begun | None:
    """The call whose JSON object opens at text[at], as far as the text goes:
    its name and arguments once the name is read and the arguments begun.
    None before then, or if it is not a call ({"name": a string,
    arguments_key or "arguments": an object or a string}, as `_call` reads a
    whole one). Whether the text is JSON at all only the whole answer tells."""
    name = arguments = None

    def so_far() -> Begun | None:
        return Begun(name, arguments) if isinstance(name, str) and isinstance(arguments, str) else None

    if not text.startswith("{", at):
        return None
    at = _skip_space(text, at + 1)
    while not text.startswith("}", at):
        try:
            if not text.startswith('"', at):
                raise ValueError
            key, at = json.decoder.scanstring(text, at + 1)
            at = _skip_space(text, at)
            if not text.startswith(":", at):
                raise ValueError
        except ValueError:
            return so_far()
        starts = at = _skip_space(text, at + 1)
        takes = key == arguments_key or (key == "arguments" and arguments is None)
        try:
            value, at = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:  # in the making
            if takes and isinstance(name, str) and text.startswith("{", starts):
                return Begun(name, text[starts:])
            return so_far()
        if key == "name":
            name = value
        elif takes:
            arguments = value if isinstance(value, str) else text[starts:at] if isinstance(value, dict) else False
        at = _skip_space(text, at)
        if text.startswith(",", at):
            at = _skip_space(text, at + 1)
        elif not text.startswith("}", at):
            return so_far()
    if not isinstance(name, str) or arguments is False:
        return None
    return Begun(name, "{}" if arguments is None else arguments, at + 1)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def before_tag(text: str, tag: str) -> int:
    """All of the text before the tag, less an end that could begin it."""
    start = text.find(tag)
    if start >= 0:
        return start
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


def _opens(text: str, bracket: str, tag: str) -> bool:
    """Whether the answer so far could be the start of calls that are the whole
    answer: it starts (after blank space) with the bracket, the tag, or a part of the tag."""
    head = text.lstrip()
    return not head or head.startswith((bracket, tag)) or tag.startswith(head)


def _call(value, arguments_key: str = "arguments") -> tuple[str, object] | None:
    """(name, arguments) of a JSON call object, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if not isinstance(arguments, (dict, str)):
        return None
    return value["name"], arguments


def _hermes(text: str):
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return None
    calls = []
    for block in _HERMES_BLOCK.findall(text[start:]):
        try:
            call = _call(json.loads(block))
        except json.JSONDecodeError:
            return None
        if call is None:
            return None
        calls.append(call)
    return (text[:start], calls) if calls else None  # no calls: an opening tag cut off (by max_tokens, say)


def _llama3_json(text: str):
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        call = _call(value, "parameters")
        if call is None:
            return None
        calls.append(call)
        rest = body[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return None  # text after a call that is not another call
        at = len(body) - len(rest)
    return "", calls


def _mistral(text: str):
    start = text.find(_MISTRAL_TAG)
    content, body = (text[:start], text[start + len(_MISTRAL_TAG):]) if start >= 0 else ("", text)
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, list) or not value:
        return None
    calls = [_call(item) for item in value]
    return None if None in calls else (content, calls)


def _pythonic(text: str):
    body = text.strip().removeprefix(_PYTHON_START).removesuffix(_PYTHON_END).strip()
    if not body.startswith("["):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = [_call_node(element) for element in tree.elts]
    return None if None in calls else ("", calls)


def _python_call(text: str) -> tuple[str, dict] | None:
    """One element of the pythonic list, `name(key=literal, ...)`, or None."""
    try:
        return _call_node(ast.parse(text.strip(), mode="eval").body)
    except SyntaxError:
        return None


def _call_node(node) -> tuple[str, dict] | None:
    """A call of a plain name by keyword arguments of literal values, or None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
        return None
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        json.dumps(arguments, allow_nan=False)  # values JSON has (not a set, bytes or NaN)
    except (ValueError, TypeError):
        return None
    return None if None in arguments else (node.func.id, arguments)  # None: **kwargs


_PARSE = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral, "pythonic": _pythonic}
assert set(_PARSE) == set(PARSERS)
