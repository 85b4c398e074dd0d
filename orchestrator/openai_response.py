"""Generate's events as OpenAI's answers: a whole response, or the chunks of
a streamed one, with usage, log probabilities and tool calls. Pure
functions (orchestrator/openai_api.py reads the requests)."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from google.protobuf.json_format import MessageToDict

from orchestrator import reasoning_parsers, tool_parsers
from orchestrator.openai_api import Call
from tandem import wire
from tandem.v1 import tandem_pb2

FINISH_REASONS = {  # Tandem's finish reason -> OpenAI's
    tandem_pb2.FINISH_REASON_EOS: "stop",
    tandem_pb2.FINISH_REASON_STOP: "stop",
    tandem_pb2.FINISH_REASON_LENGTH: "length",
    tandem_pb2.FINISH_REASON_CONTEXT: "length",  # the context window is full
}


def _named_call(call: Call, text: str) -> list[dict] | None:
    """A named tool_choice's answer, its function's arguments, as OpenAI's
    tool_calls; None where they are not complete (cut by max_tokens)."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return None
    return [tool_parsers.openai_call(call.tool_name, text)]


def _required_calls(text: str) -> tuple[str | None, list[dict] | None]:
    """tool_choice "required"'s answer: (its content, its tool_calls). A whole
    list is calls alone; one cut short (by max_tokens, a stop string) is the
    calls of its complete objects, and the text after them as content."""
    calls, end, closed = tool_parsers.listed_calls(text)
    return (None if closed else text[end:]), (calls or None)


def new_id(chat: bool, request_id: str | None = None) -> str:
    """An answer's id: the request's id (the HTTP API's X-Request-Id) after
    OpenAI's prefix, or a new one."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex}"


def usage(call: Call, finals: list[tandem_pb2.Completion]) -> dict:
    """The usage of a request's choices: each prompt once, the completions'
    tokens summed (none when the choices hold the prompt alone), and of each
    prompt the tokens that every one of its choices found cached."""
    per_prompt = [finals[p * call.n: (p + 1) * call.n] for p in range(len(call.prompts))]
    prompt = sum(choices[0].usage.prompt_tokens for choices in per_prompt)
    completion = 0 if call.prompt_only else sum(final.usage.completion_tokens for final in finals)
    cached = sum(min(f.usage.cached_prompt_tokens for f in choices) for choices in per_prompt)
    counted = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": cached}}
    if call.reasoning_parser is not None:  # of the completion's tokens, the reasoning's (as OpenAI counts them)
        counted["completion_tokens_details"] = {"reasoning_tokens": sum(f.usage.reasoning_tokens for f in finals)}
    return counted


def speculation(final: tandem_pb2.Completion) -> dict:
    """The request's speculation stats (rounds, accepted tokens, k, ...), as
    the extension field "tandem" of a response."""
    return MessageToDict(final.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


LOWEST_LOGPROB = -9999.0  # in place of -inf, which JSON cannot carry (as vLLM does)


def _finite(value: float) -> float:
    return max(value, LOWEST_LOGPROB)


def _named(lp, as_ids: bool) -> str:
    """A token as the answer names it: decoded, or vLLM's "token_id:ID"
    (return_tokens_as_token_ids), which names a token that does not decode
    alone (a piece of a multi-byte character) exactly."""
    return f"token_id:{lp.token_id}" if as_ids else lp.token


def chat_logprobs(logprobs, as_ids: bool = False) -> dict:
    """A chat choice's "logprobs" for TokenLogprobs: each token with its
    UTF-8 bytes and its most likely alternatives."""
    def entry(lp) -> dict:
        token = _named(lp, as_ids)
        return {"token": token, "logprob": _finite(lp.logprob), "bytes": list(token.encode())}

    return {"content": [{**entry(lp), "top_logprobs": [entry(top) for top in lp.top_logprobs]} for lp in logprobs],
            "refusal": None}


def completion_logprobs(logprobs, offset: int = 0, most: int | None = None, as_ids: bool = False) -> dict:
    """A completion choice's "logprobs": the tokens, their log probabilities,
    for each a map of the `most` likely tokens (and the token itself) to theirs,
    and where each token starts in the completion's text, from `offset` (in
    the text, also where the tokens are named by id)."""
    answer = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in logprobs:
        top = None
        if lp.logprob is not None:  # None: a prompt's first token
            top = {_named(alt, as_ids): _finite(alt.logprob) for alt in lp.top_logprobs[:most]}
            top.setdefault(_named(lp, as_ids), _finite(lp.logprob))
        answer["tokens"].append(_named(lp, as_ids))
        answer["token_logprobs"].append(None if lp.logprob is None else _finite(lp.logprob))
        answer["top_logprobs"].append(top)
        answer["text_offset"].append(offset)
        offset += len(lp.token)
    return answer


@dataclass(frozen=True)
class _Unscored:
    """A prompt's first token: no position predicts it."""

    token: str
    token_id: int
    logprob: None = None
    top_logprobs: tuple = ()


def _prompt_logprobs(prompt: tandem_pb2.PromptEcho) -> list:
    return [_Unscored(prompt.first_token, prompt.token_ids[0] if prompt.token_ids else 0), *prompt.logprobs]


def vllm_prompt_logprobs(prompt: tandem_pb2.PromptEcho, most: int) -> list[dict | None]:
    """vLLM's "prompt_logprobs": null for the prompt's first token (no
    position predicts it), then for each token a map of its id, and of the
    `most` likeliest tokens' ids, to the log probability, the rank among
    the vocabulary (1: the likeliest) and the token decoded alone."""
    def entry(logprob: float, rank: int, token: str) -> dict:
        return {"logprob": _finite(logprob), "rank": rank or None, "decoded_token": token}

    answer: list[dict | None] = [None] if prompt.token_ids else []
    for lp in prompt.logprobs:
        scored = {str(lp.token_id): entry(lp.logprob, lp.rank, lp.token)}
        for place, alt in enumerate(lp.top_logprobs[:most], 1):
            scored.setdefault(str(alt.token_id), entry(alt.logprob, place, alt.token))
        answer.append(scored)
    return answer


def _echo_text(call: Call, index: int, prompt: tandem_pb2.PromptEcho) -> str:
    """Choice `index`'s prompt as it comes back: the text sent, or the
    server's decoding of the token ids sent."""
    sent = call.echo[index // call.n]
    return sent if sent is not None else prompt.text


def _choice_logprobs(call: Call, logprobs, offset: int = 0) -> dict | None:
    if not call.request.params.logprobs:
        return None
    return (chat_logprobs(logprobs, call.tokens_as_ids) if call.chat
            else completion_logprobs(logprobs, offset, call.request.params.top_logprobs, call.tokens_as_ids))


@dataclass
class Answer:
    """One choice's generation, collected from its events."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprobs, when the request asked
    final: tandem_pb2.Completion | None = None
    prompt: tandem_pb2.PromptEcho | None = None  # echo
    after_in_prompt: bool = False  # the prompt closed the reasoning: the answer is content alone

    def add(self, delta: tandem_pb2.TokenDelta) -> None:
        self.after_in_prompt |= delta.after_in_prompt
        self.text += delta.text
        self.ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.HasField("prompt"):
            self.prompt = delta.prompt


def response(call: Call, model: str, answers: list[Answer], request_id: str | None = None) -> dict:
    """The whole answer of a request that did not stream. "tandem": the
    speculation stats; with n > 1, a list of each choice's."""
    choices = []
    for index, answer in enumerate(answers):
        text, ids, logprobs = answer.text, answer.ids, answer.logprobs
        if call.prompt_only:
            text, ids, logprobs = "", [], []
        if call.echo:
            text = _echo_text(call, index, answer.prompt) + text
            logprobs = _prompt_logprobs(answer.prompt) + list(logprobs)
        choice = {"index": index, "finish_reason": _finish_reason(call, answer.final),
                  "stop_reason": _stop_reason(call, answer.final), "logprobs": _choice_logprobs(call, logprobs)}
        if call.chat:
            reasoning = None
            if call.reasoning_parser is not None:  # the content is what follows the reasoning, or None
                reasoning, text = reasoning_parsers.split(call.reasoning_parser, text, answer.after_in_prompt)
            content, calls = text, None
            if text is None:
                pass
            elif call.tool_name is not None:
                calls = _named_call(call, text)
                content = None if calls is not None else text
            elif call.tools_required:
                content, calls = _required_calls(text)
            elif call.tool_parser is not None:
                content, calls = tool_parsers.parse(call.tool_parser, text)
                calls = calls[:call.most_calls] if calls else calls
            choice["message"] = {"role": "assistant", "content": content}
            if call.reasoning_parser is not None:
                choice["message"]["reasoning_content"] = reasoning
            if calls is not None:
                choice["message"]["tool_calls"] = calls
                choice["finish_reason"] = _tools_finish_reason(call, choice["finish_reason"])
        else:
            choice["text"] = text
            choice.update(_prompt_fields(call, answer.prompt))  # vLLM's: a completion's, each choice its prompt's
        if call.return_token_ids:
            choice["token_ids"] = ids
        choices.append(choice)
    finals = [answer.final for answer in answers]
    stats = [speculation(final) for final in finals]
    answer = {"id": new_id(call.chat, request_id), "object": "chat.completion" if call.chat else "text_completion",
              "created": int(time.time()), "model": model, "choices": choices, "usage": usage(call, finals)}
    if call.chat:  # vLLM's: a chat completion's at its top level (every choice has the one prompt)
        answer.update(_prompt_fields(call, answers[0].prompt))
    return {**answer, "tandem": stats[0] if call.choices == 1 else stats}


def _prompt_fields(call: Call, prompt: tandem_pb2.PromptEcho | None) -> dict:
    """vLLM's "prompt_logprobs" and "prompt_token_ids" (with
    "return_token_ids"), where the request asked."""
    fields = {}
    if call.prompt_logprobs is not None:
        fields["prompt_logprobs"] = vllm_prompt_logprobs(prompt or tandem_pb2.PromptEcho(), call.prompt_logprobs)
    if call.return_token_ids:
        fields["prompt_token_ids"] = list(prompt.token_ids) if prompt is not None else None
    return fields


def _finish_reason(call: Call, final: tandem_pb2.Completion) -> str:
    return "length" if call.prompt_only else FINISH_REASONS.get(final.finish_reason, "stop")


def _stop_reason(call: Call, final: tandem_pb2.Completion) -> str | int | None:
    """vLLM's stop_reason: the stop string or the stop_token_ids token that
    ended the choice; None where something else did (an end-of-sequence token,
    max_tokens)."""
    return None if call.prompt_only else wire.stop_reason(final)


def _tools_finish_reason(call: Call, reason: str) -> str:
    """A complete answer that calls tools: "tool_calls" where the model chose
    them ("required", "auto"), "stop" where tool_choice named the function, as
    OpenAI answers a forced call."""
    return "tool_calls" if (call.tools_required or call.tool_parser) and reason == "stop" else reason


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
            choice["logprobs"] = _choice_logprobs(self.call, logprobs, self._offset[index])
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
            chunks.append(self._chunk([self._choice(index, _echo_text(self.call, index, delta.prompt), [], None,
                                                    _prompt_logprobs(delta.prompt))]))
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
        reason = _finish_reason(self.call, final)
        parser, chunks = self._parser(), []
        if self.call.reasoning_parser is not None:  # what it held back: an end that did not begin a tag
            chunks += self._reasoned(index, tandem_pb2.TokenDelta(), final=True)
            self._thought.pop(index, None)
        said, sent = self._said.pop(index, ""), self._sent.pop(index, 0)
        started = len(self._calls_sent.get(index, []))
        if parser == "required":
            reading = tool_parsers.read(parser, said)
            if reading.closed:
                reason = _tools_finish_reason(self.call, reason)
            content = None if reading.closed else said if not reading.calls else \
                said[reading.after:] if reading.calls[-1].end is not None else None
            if content:
                chunks.append(self._release(index, content))
        elif self.call.tool_name is not None and reason == "stop":
            reason = _tools_finish_reason(self.call, reason)
        elif parser is not None:
            _, calls = tool_parsers.parse(parser, said)
            calls = calls[:self.call.most_calls] if calls else calls
            if calls is not None:
                tool_calls = self._call_deltas(index, [tool_parsers.Begun(c["function"]["name"],
                                                                          c["function"]["arguments"])
                                                       for c in calls])
                if tool_calls:
                    chunks.append(self._release(index, None, tool_calls))
                reason = _tools_finish_reason(self.call, reason)
            elif not started and len(said) > sent:  # what was held back: a tag that never became a call
                chunks.append(self._release(index, said[sent:]))
        self._calls_sent.pop(index, None)
        ids, logprobs = self._held.pop(index, ([], []))
        closing = self._choice(index, None if self.call.tool_name is not None else "" if self.call.chat else None,
                               ids, reason, logprobs or None)
        closing["stop_reason"] = _stop_reason(self.call, final)
        return [*chunks, self._chunk([closing], tandem=speculation(final))]

    def usage(self, finals: list[tandem_pb2.Completion]) -> dict:
        """The last chunk, when the request asked (stream_options.include_usage)."""
        return self._chunk([], usage=usage(self.call, finals))
