"""Reasoning in a model's answer, for the HTTP API's chat completions and
Responses (`tandem serve orchestrator --reasoning-parser NAME`): the text
between the model's <think> and </think> becomes `reasoning_content` (a
Response's reasoning item), the rest the answer's content, as vLLM's parsers
of the same names read it. The text itself is what the target alone
generates; parsing only reshapes it.

deepseek_r1: DeepSeek-R1's template opens the reasoning in the prompt, so the
answer starts inside it (a <think> it writes anyway is dropped); everything up
to </think> is reasoning, and an answer without </think> is reasoning alone.

qwen3: Qwen3 opens its reasoning itself, with <think>, where thinking is on;
an answer that does not start with <think> is content alone (thinking off).

Streamed, `progress` says how much of the text so far is reasoning that may
go out, holding back an end that could begin a tag."""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.tool_parsers import before_tag

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def opens_itself(parser: str) -> bool:
    """Whether the model opens its reasoning itself, with <think> (else its
    answer begins inside the reasoning, opened by the template)."""
    return parser == "qwen3"


@dataclass(frozen=True)
class Progress:
    """An answer's text so far, read for reasoning: the reasoning that may go
    out (text[reasoning_start:reasoning_end]), and where the content starts
    (None while the reasoning goes on, or while it is not known whether it
    does: `undecided`)."""
    reasoning_start: int = 0
    reasoning_end: int = 0
    content_start: int | None = None
    undecided: bool = False


def progress(parser: str, text: str, final: bool = False, closed: bool = False) -> Progress:
    """`final`: the answer is whole, nothing is held back. `closed`: the
    prompt closed the reasoning itself (TokenDelta.after_in_prompt), so the
    answer is content alone."""
    if closed:
        return Progress(content_start=0)
    head = len(text) - len(text.lstrip())
    opened = text.startswith(START, head)
    if not opened and not final and START.startswith(text[head:]):  # it may yet open: hold it all
        return Progress(undecided=True)
    if opens_itself(parser) and not opened:
        return Progress(content_start=0)
    start = head + len(START) if opened else 0
    end = text.find(END, start)
    if end >= 0:
        return Progress(start, end, end + len(END))
    return Progress(start, len(text) if final else max(start, before_tag(text, END)))


def split(parser: str, text: str, closed: bool = False) -> tuple[str | None, str | None]:
    """A whole answer as (reasoning, content); None where there is none."""
    read = progress(parser, text, final=True, closed=closed)
    reasoning = text[read.reasoning_start:read.reasoning_end] if read.content_start != 0 else None
    content = text[read.content_start:] if read.content_start is not None else None
    return reasoning or None, content or None
