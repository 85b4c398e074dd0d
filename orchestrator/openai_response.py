"""Generate's events as OpenAI's answers: a whole response, with usage, log
probabilities and tool calls, and the parts of a choice that a streamed
answer's chunks share with it (orchestrator/openai_chunks.py). Pure functions
(orchestrator/openai_api.py reads the requests)."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from google.protobuf.json_format import MessageToDict

from orchestrator import reasoning_parsers, tool_parsers
from orchestrator.openai_api import Call
from orchestrator.openai_logprobs import (chat_logprobs, completion_logprobs, echoed_prompt_logprobs,
                                          vllm_prompt_logprobs)
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


def echo_text(call: Call, index: int, prompt: tandem_pb2.PromptEcho) -> str:
    """Choice `index`'s prompt as it comes back: the text sent, or the
    server's decoding of the token ids sent."""
    sent = call.echo[index // call.n]
    return sent if sent is not None else prompt.text


def choice_logprobs(call: Call, logprobs, offset: int = 0) -> dict | None:
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
            text = echo_text(call, index, answer.prompt) + text
            logprobs = echoed_prompt_logprobs(answer.prompt) + list(logprobs)
        choice = {"index": index, "finish_reason": choice_finish_reason(call, answer.final),
                  "stop_reason": choice_stop_reason(call, answer.final), "logprobs": choice_logprobs(call, logprobs)}
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
                choice["finish_reason"] = tools_finish_reason(call, choice["finish_reason"])
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


def choice_finish_reason(call: Call, final: tandem_pb2.Completion) -> str:
    return "length" if call.prompt_only else FINISH_REASONS.get(final.finish_reason, "stop")


def choice_stop_reason(call: Call, final: tandem_pb2.Completion) -> str | int | None:
    """vLLM's stop_reason: the stop string or the stop_token_ids token that
    ended the choice; None where something else did (an end-of-sequence token,
    max_tokens)."""
    return None if call.prompt_only else wire.stop_reason(final)


def tools_finish_reason(call: Call, reason: str) -> str:
    """A complete answer that calls tools: "tool_calls" where the model chose
    them ("required", "auto"), "stop" where tool_choice named the function, as
    OpenAI answers a forced call."""
    return "tool_calls" if (call.tools_required or call.tool_parser) and reason == "stop" else reason
