"""Generate's events as the chunks of a streamed OpenAI answer (Chunks), with
tool calls and reasoning sent as the parsers read them. Pure functions and
state (orchestrator/openai_response.py makes a whole answer)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from orchestrator import reasoning_parsers, tool_parsers
from orchestrator.openai_api import Call
from orchestrator.openai_logprobs import echoed_prompt_logprobs
from orchestrator.openai_response import (choice_finish_reason, choice_logprobs, choice_stop_reason, echo_text,
                                          new_id, speculation, tools_finish_reason, usage)
from tandem.v1 import tandem_pb2


@dataclass
class _Thought:
    """A streamed choice's answer as the reasoning parser has read it: its
    text, the reasoning sent, the content passed on, and the token ids and
    log probabilities not sent yet."""
    text: str = ""
    closed: bool = False  # the prompt closed the reasoning (TokenDelta.after_in_prompt)
    reasoned: int = 0
    fed: int = 0
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)


class Chunks:
    """The chunks of one streamed answer: for each choice (its index), deltas
    as rounds commit them, then one with its finish reason and its stats;
    after every choice's, the usage if asked.

    Where the text is held back (tool calls in the making), so are its token
    ids and log probabilities: they go out with the choice's next chunk."""

    def __init__(self, call: Call, model: str, request_id: str | None = None):
        self.call, self.model = call, model
        self.id, self.created = new_id(call.chat, request_id), int(time.time())
        self._role_sent: set[int] = set()  # choices whose first chunk went out
        self._call_ids: dict[int, str] = {}  # a named tool_choice: each choice's call id
        self._said: dict[int, str] = {}  # "required" and "auto": each choice's text so far
        self._sent: dict[int, int] = {}  # "auto": how much of it went out as content
        self._calls_sent: dict[int, list[str]] = {}  # "required" and "auto": each call's arguments sent so far
        self._held: dict[int, tuple[list[int], list]] = {}  # token ids and log probabilities not sent yet
        self._offset = [0] * call.choices  # where each choice's next token starts in its text (text_offset)
        self._counted = [[0, 0] for _ in range(call.choices)]  # each choice's prompt and completion tokens so far
        self._thought: dict[int, _Thought] = {}  # with a reasoning parser: each choice's answer read so far
        self._prompt_ids: dict[int, list[int]] = {}  # return_token_ids: each choice's prompt, not sent yet

    def _chunk(self, choices: list[dict], **more) -> dict:
        if self.call.chat and choices and choices[0]["index"] in self._prompt_ids:  # vLLM's, at the top level
            more["prompt_token_ids"] = self._prompt_ids.pop(choices[0]["index"])
        if self.call.continuous_usage and choices and "usage" not in more:
            prompt, completion = self._counted[choices[0]["index"]]
            more["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
        return {"id": self.id, "object": "chat.completion.chunk" if self.call.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, **more}

    def _choice(self, index: int, text: str | None, ids: list[int] | None, finish_reason: str | None,
                logprobs=None) -> dict:
        choice = {"index": index, "finish_reason": finish_reason, "logprobs": None}
        if logprobs is not None:
            choice["logprobs"] = choice_logprobs(self.call, logprobs, self._offset[index])
            self._offset[index] += sum(len(lp.token) for lp in logprobs)
        if self.call.chat:
            delta = {}
            if index not in self._role_sent:
                delta["role"] = "assistant"
                self._role_sent.add(index)
            if text is not None and self.call.tool_name is not None and finish_reason is None:
                # A named tool_choice: the text is the call's arguments, streamed as they come.
                if index not in self._call_ids:
                    self._call_ids[index] = tool_parsers.call_id()
                    delta["tool_calls"] = [{"index": 0, "id": self._call_ids[index], "type": "function",
                                            "function": {"name": self.call.tool_name, "arguments": text}}]
                else:
                    delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
            elif text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
            if index in self._prompt_ids:  # vLLM's, on a completion's choice
                choice["prompt_token_ids"] = self._prompt_ids.pop(index)
        if self.call.return_token_ids and ids is not None:
            choice["token_ids"] = ids
        return choice

    def _hold(self, index: int, delta: tandem_pb2.TokenDelta) -> str:
        """Keeps the delta's token ids and log probabilities until the choice's
        next chunk; returns the choice's text so far."""
        ids, logprobs = self._held.setdefault(index, ([], []))
        ids.extend(delta.token_ids)
        logprobs.extend(delta.logprobs)
        said = self._said[index] = self._said.get(index, "") + delta.text
        return said

    def _release(self, index: int, text: str | None, tool_calls: list[dict] | None = None) -> dict:
        """A chunk of the choice with what was held back, and OpenAI's tool_calls deltas."""
        ids, logprobs = self._held.pop(index, ([], []))
        choice = self._choice(index, text, ids, None, logprobs or None)
        if tool_calls:
            choice["delta"]["tool_calls"] = tool_calls
        return self._chunk([choice])

    def _call_deltas(self, index: int, calls: list[tool_parsers.Begun]) -> list[dict]:
        """What of the choice's calls has not gone out, as OpenAI streams
        them: a call's first delta with its id and name, then its arguments
        as the model writes them (each delta what follows the last)."""
        sent, deltas = self._calls_sent.setdefault(index, []), []
        for i, call in enumerate(calls):
            if i == len(sent):
                sent.append(call.arguments)
                deltas.append({"index": i, "id": tool_parsers.call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > len(sent[i]) and call.arguments.startswith(sent[i]):
                deltas.append({"index": i, "function": {"arguments": call.arguments[len(sent[i]):]}})
                sent[i] = call.arguments
        return deltas

    def _parser(self) -> str | None:
        """The format of the choices' calls: tool_choice "required"'s list or
        the server's parser ("auto"); None where the answer is not read for calls."""
        if not self.call.chat:
            return None
        return "required" if self.call.tools_required else self.call.tool_parser

    def delta(self, index: int, delta: tandem_pb2.TokenDelta) -> list[dict]:
        """The chunks of a delta of choice `index`: with echo, the prompt's
        first (it comes with the choice's first delta)."""
        chunks = []
        counted = self._counted[index]
        counted[0] = delta.prompt_tokens or counted[0]
        counted[1] += len(delta.token_ids)
        if self.call.return_token_ids and delta.HasField("prompt"):  # vLLM's: with the choice's next chunk
            self._prompt_ids[index] = list(delta.prompt.token_ids)
        if self.call.echo and delta.HasField("prompt"):
            chunks.append(self._chunk([self._choice(index, echo_text(self.call, index, delta.prompt), [], None,
                                                    echoed_prompt_logprobs(delta.prompt))]))
        if self.call.reasoning_parser is not None:
            chunks += self._reasoned(index, delta)
        else:
            chunks += self._content(index, delta)
        return chunks

    def _reasoned(self, index: int, delta: tandem_pb2.TokenDelta, final: bool = False) -> list[dict]:
        """The delta read for reasoning first: its reasoning goes out as
        `reasoning_content` (with the delta's token ids and log
        probabilities), the content after it on as a delta of its own.
        `final`: the answer is whole, nothing is held back."""
        thought = self._thought.setdefault(index, _Thought())
        thought.closed |= delta.after_in_prompt
        thought.text += delta.text
        thought.ids.extend(delta.token_ids)
        thought.logprobs.extend(delta.logprobs)
        read = reasoning_parsers.progress(self.call.reasoning_parser, thought.text, final, thought.closed)
        chunks = []
        if read.content_start != 0 and not read.undecided:
            piece = thought.text[read.reasoning_start + thought.reasoned:read.reasoning_end]
            if piece:
                thought.reasoned += len(piece)
                choice = self._choice(index, None, thought.ids, None, thought.logprobs or None)
                choice["delta"]["reasoning_content"] = piece
                chunks.append(self._chunk([choice]))
                thought.ids, thought.logprobs = [], []
        if read.content_start is not None:
            content = thought.text[read.content_start:]
            piece, thought.fed = content[thought.fed:], len(content)
            if piece or thought.ids:
                chunks += self._content(index, tandem_pb2.TokenDelta(text=piece, token_ids=thought.ids,
                                                                     logprobs=thought.logprobs))
                thought.ids, thought.logprobs = [], []
        return chunks

    def _content(self, index: int, delta: tandem_pb2.TokenDelta) -> list[dict]:
        """The chunks of a delta of the answer's content."""
        chunks = []
        parser = self._parser()
        if parser is not None:  # content up to a call's opening tag ("auto"), calls as they are written
            said, text = self._hold(index, delta), None
            if parser != "required":
                sent, ready = self._sent.get(index, 0), tool_parsers.sendable(parser, said)
                if ready > sent:
                    self._sent[index], text = ready, said[sent:ready]
            tool_calls = self._call_deltas(index, tool_parsers.read(parser, said).calls[:self.call.most_calls])
            if text or tool_calls:
                chunks.append(self._release(index, text, tool_calls))
            return chunks
        if not self.call.prompt_only:
            chunks.append(self._chunk([self._choice(index, delta.text, list(delta.token_ids), None, delta.logprobs)]))
        return chunks

    def final(self, index: int, final: tandem_pb2.Completion) -> list[dict]:
        """The choice's last chunks: what the stream held back, then the one
        with the finish reason and stats. Held back: with "auto", calls of a
        format read whole (pythonic), or text that never became a call; with
        "required" cut short, the text after its last complete call. A call
        that went out stays, even where the answer then breaks off (OpenAI's
        streams do the same: its arguments end where the model stopped)."""
        self._counted[index] = [final.usage.prompt_tokens, final.usage.completion_tokens]
        reason = choice_finish_reason(self.call, final)
        parser, chunks = self._parser(), []
        if self.call.reasoning_parser is not None:  # what it held back: an end that did not begin a tag
            chunks += self._reasoned(index, tandem_pb2.TokenDelta(), final=True)
            self._thought.pop(index, None)
        said, sent = self._said.pop(index, ""), self._sent.pop(index, 0)
        started = len(self._calls_sent.get(index, []))
        if parser == "required":
            reading = tool_parsers.read(parser, said)
            if reading.closed:
                reason = tools_finish_reason(self.call, reason)
            content = None if reading.closed else said if not reading.calls else \
                said[reading.after:] if reading.calls[-1].end is not None else None
            if content:
                chunks.append(self._release(index, content))
        elif self.call.tool_name is not None and reason == "stop":
            reason = tools_finish_reason(self.call, reason)
        elif parser is not None:
            _, calls = tool_parsers.parse(parser, said)
            calls = calls[:self.call.most_calls] if calls else calls
            if calls is not None:
                tool_calls = self._call_deltas(index, [tool_parsers.Begun(c["function"]["name"],
                                                                          c["function"]["arguments"])
                                                       for c in calls])
                if tool_calls:
                    chunks.append(self._release(index, None, tool_calls))
                reason = tools_finish_reason(self.call, reason)
            elif not started and len(said) > sent:  # what was held back: a tag that never became a call
                chunks.append(self._release(index, said[sent:]))
        self._calls_sent.pop(index, None)
        ids, logprobs = self._held.pop(index, ([], []))
        closing = self._choice(index, None if self.call.tool_name is not None else "" if self.call.chat else None,
                               ids, reason, logprobs or None)
        closing["stop_reason"] = choice_stop_reason(self.call, final)
        return [*chunks, self._chunk([closing], tandem=speculation(final))]

    def usage(self, finals: list[tandem_pb2.Completion]) -> dict:
        """The last chunk, when the request asked (stream_options.include_usage)."""
        return self._chunk([], usage=usage(self.call, finals))
