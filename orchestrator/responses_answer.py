"""A Responses API request's answer (orchestrator/openai_responses.py reads
the request): the chat completion's answer as a Response object (Responses),
or its streamed chunks as the Response stream's events (ResponseEvents)."""
from __future__ import annotations

import copy
import time
import uuid

from orchestrator.openai_responses import ECHOED, conversation_id, stores, truncation


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": usage.get("completion_tokens_details",
                                                                   {}).get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}


def _message_item(text: str, status: str, logprobs: list | None = None) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _logprobs(choice: dict) -> list:
    """A chat choice's (or chunk's) token log probabilities, in the layout
    output_text takes them (the same: token, logprob, bytes, top_logprobs)."""
    return list((choice.get("logprobs") or {}).get("content") or [])


def _reasoning_item(text: str, status: str) -> dict:
    return {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def _ending(finish_reason: str | None) -> tuple[str, dict | None]:
    """(the Response's status, its incomplete_details) after a choice's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


class Responses:
    """One request's Response: whole (from a chat completion's answer) or
    streamed (`events`)."""

    def __init__(self, body: dict, model: str, keeper=None):
        self.id, self.created, self.model = f"resp_{uuid.uuid4().hex}", int(time.time()), model
        self.store = stores(body)
        self.truncation = truncation(body)
        self.keeper = keeper  # async (final Response) -> None: keeps it (responses_routes)
        self.echoed = {name: body.get(name) for name in ECHOED}
        self.echoed["tools"] = self.echoed["tools"] or []
        self.echoed["tool_choice"] = self.echoed["tool_choice"] or "auto"
        self.echoed["parallel_tool_calls"] = self.echoed["parallel_tool_calls"] is not False
        self.echoed["text"] = self.echoed["text"] or {"format": {"type": "text"}}
        self.echoed["reasoning"] = self.echoed["reasoning"] or {"effort": None, "summary": None}
        conversation = conversation_id(body)
        self.echoed["conversation"] = {"id": conversation} if conversation else None

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 incomplete: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.model, "output": output,
                "usage": usage, "store": self.store, "truncation": self.truncation, "background": False,
                **self.echoed}

    def whole(self, chat: dict) -> dict:
        """The Response of a chat completion's answer (openai_response.response)."""
        choice = chat["choices"][0]
        message = choice["message"]
        status, incomplete = _ending(choice["finish_reason"])
        calls = message.get("tool_calls") or []
        reasoning = message.get("reasoning_content")
        output = [_reasoning_item(reasoning, status)] if reasoning else []
        output += [_message_item(message["content"] or "", status, _logprobs(choice))] \
            if message.get("content") or not (calls or reasoning) else []
        output += [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
                   for c in calls]
        return {**self.response(status, output, _usage(chat.get("usage")), incomplete), "tandem": chat.get("tandem")}

    def events(self) -> ResponseEvents:
        return ResponseEvents(self)

    async def keep(self, final: dict) -> None:
        """What keeps the finished Response (its routes': stored unless
        "store": false, and its items added to its conversation)."""
        if self.keeper is not None:
            await self.keeper(final)


class ResponseEvents:
    """A streamed chat completion's chunks (openai_chunks.Chunks) as the
    Response stream's events: response.created, then each output item
    (a message's text deltas, a function call's argument deltas) added,
    grown and done in turn, then response.completed (or .incomplete)."""

    def __init__(self, responses: Responses):
        self.responses = responses
        self.sequence = 0
        self.output: list[dict] = []
        self.open = False  # the last item is still growing
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.stats: dict | None = None  # the speculation stats of the chat completion's last chunk

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **copy.deepcopy(fields)}
        self.sequence += 1
        return event

    def start(self) -> list[dict]:
        response = self.responses.response("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def chunk(self, chunk: dict) -> list[dict]:
        """The events of one chat completion chunk."""
        if chunk.get("usage") is not None:
            self.usage = _usage(chunk["usage"])
        if chunk.get("tandem") is not None:
            self.stats = chunk["tandem"]
        events = []
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(delta["content"], _logprobs(choice))
            for call in delta.get("tool_calls") or []:
                events += self._arguments(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def _add(self, item: dict) -> list[dict]:
        events = self._close("completed")
        self.output.append(item)
        self.open = True
        return [*events, self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def _add_message(self) -> list[dict]:
        item = _message_item("", "in_progress")
        return [*self._add(item), self._event("response.content_part.added", item_id=item["id"],
                                              output_index=len(self.output) - 1, content_index=0,
                                              part=item["content"][0])]

    def _reasoning(self, text: str) -> list[dict]:
        """Reasoning text: a reasoning item's, added with the first."""
        events = [] if self.open and self.output[-1]["type"] == "reasoning" else self._add(_reasoning_item("", "in_progress"))
        item = self.output[-1]
        item["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=len(self.output) - 1,
                                  content_index=0, delta=text))
        return events

    def _text(self, text: str, logprobs: list) -> list[dict]:
        events = [] if self.open and self.output[-1]["type"] == "message" else self._add_message()
        item = self.output[-1]
        item["content"][0]["text"] += text
        item["content"][0]["logprobs"] += logprobs
        events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=len(self.output) - 1,
                                  content_index=0, delta=text, logprobs=logprobs))
        return events

    def _arguments(self, call: dict) -> list[dict]:
        """A tool call's delta: its first (id and name) adds a function_call item."""
        events, arguments = [], call["function"].get("arguments") or ""
        if "id" in call:
            events += self._add(_call_item(call["id"], call["function"]["name"], "", "in_progress"))
        item = self.output[-1]
        if arguments:
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=len(self.output) - 1, delta=arguments))
        return events

    def _close(self, status: str) -> list[dict]:
        """The events that end the growing item, if one is."""
        if not self.open:
            return []
        self.open = False
        item, at = self.output[-1], len(self.output) - 1
        item["status"] = status
        if item["type"] == "reasoning":
            events = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                                  text=item["content"][0]["text"])]
        elif item["type"] == "message":
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                  text=part["text"], logprobs=part["logprobs"]),
                      self._event("response.content_part.done", item_id=item["id"], output_index=at,
                                  content_index=0, part=part)]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                  name=item["name"], arguments=item["arguments"])]
        return [*events, self._event("response.output_item.done", output_index=at, item=item)]

    def end(self) -> list[dict]:
        """The last events, after the answer's last chunk: the Response, whole."""
        events, final = self.closing()
        return [*events, self.done(final)]

    def closing(self) -> tuple[list[dict], dict]:
        """The events that close the output, and the final Response (which
        `done` sends; the gateway stores it first)."""
        status, incomplete = _ending(self.finish_reason)
        events = []
        if not self.output:  # nothing said: an empty message
            events += self._add_message()
        events += self._close(status)
        return events, {**self.responses.response(status, self.output, self.usage, incomplete), "tandem": self.stats}

    def done(self, final: dict) -> dict:
        return self._event(f"response.{final['status']}", response=final)

    def error(self, body: dict) -> list[dict]:
        """An error after the stream began (`body` is OpenAI's error body)."""
        error = body.get("error", {})
        return [self._event("error", code=error.get("code"), message=error.get("message", ""),
                            param=error.get("param"))]
