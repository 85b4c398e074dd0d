"""Python client of the public Tandem API (synchronous, streaming)."""
from __future__ import annotations

import json

from dataclasses import dataclass, field
from typing import Iterator

import grpc

from tandem.serving import CHANNEL_OPTIONS, KEEPALIVE_OPTIONS, OWN_CONNECTIONS
from tandem.wire import stop_reason
from tandem.v1 import tandem_pb2, tandem_pb2_grpc

FINISH_REASONS = {
    tandem_pb2.FINISH_REASON_EOS: "eos",
    tandem_pb2.FINISH_REASON_LENGTH: "length",
    tandem_pb2.FINISH_REASON_STOP: "stop",
    tandem_pb2.FINISH_REASON_CONTEXT: "context",
}


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str | int | None = None  # finish_reason "stop": the stop string or stop token id that ended it
    session_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # of prompt_tokens, those a parked session held (--prefix-cache)
    reasoning_tokens: int = 0  # of completion_tokens, the reasoning's (with reasoning=...)
    stats: tandem_pb2.SpeculationStats | None = None
    logprobs: list[tandem_pb2.TokenLogprob] = field(default_factory=list)  # one a token, when asked (logprobs=True)
    prompt: tandem_pb2.PromptEcho | None = None  # echo=True or prompt_logprobs=N: the prompt, scored if asked

    @property
    def acceptance_rate(self) -> float:
        s = self.stats
        return s.accepted_tokens / s.drafted_tokens if s and s.drafted_tokens else 0.0

    def as_dict(self) -> dict:
        from google.protobuf.json_format import MessageToDict

        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "session_id": self.session_id,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                      "cached_prompt_tokens": self.cached_prompt_tokens, "reasoning_tokens": self.reasoning_tokens},
            "stats": MessageToDict(self.stats, preserving_proto_field_name=True) if self.stats else {},
            "acceptance_rate": self.acceptance_rate,
            **({"logprobs": [MessageToDict(lp, preserving_proto_field_name=True,
                                           always_print_fields_with_no_presence=True) for lp in self.logprobs]}
               if self.logprobs else {}),
            **({"prompt": MessageToDict(self.prompt, preserving_proto_field_name=True)} if self.prompt else {}),
        }


def params_message(**kwargs) -> tandem_pb2.GenerationParams:
    """GenerationParams from keyword arguments; None values stay unset."""
    return tandem_pb2.GenerationParams(**{k: v for k, v in kwargs.items() if v is not None})


class TandemClient:
    def __init__(self, address: str, tenant: str | None = None, timeout_s: float | None = None,
                 api_key: str | None = None, tls: grpc.ChannelCredentials | None = None):
        """api_key: sent as "authorization: Bearer KEY", for a server run with
        --api-keys. tls: dial over TLS with these credentials
        (tandem.tls.channel_credentials), for a server run with --tls-cert."""
        options = [*CHANNEL_OPTIONS, *KEEPALIVE_OPTIONS, *OWN_CONNECTIONS]
        self.channel = grpc.insecure_channel(address, options=options) if tls is None \
            else grpc.secure_channel(address, tls, options=options)
        self.stub = tandem_pb2_grpc.TandemStub(self.channel)
        self.metadata = ((("x-tandem-tenant", tenant),) if tenant else ()) + (
            (("authorization", f"Bearer {api_key}"),) if api_key else ())
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, stream=False):
        return method(request, metadata=self.metadata, timeout=self.timeout_s)

    def generate_stream(self, prompt: str | None = None, prompt_ids: list[int] | None = None,
                        keep_session: bool = False, messages: list[dict] | None = None,
                        tools: list[dict] | None = None, continue_final_message: bool = False,
                        chat_template_kwargs: dict | None = None, suffix: str | None = None,
                        chat_template: str | None = None, **params) -> Iterator[tandem_pb2.GenerateEvent]:
        """Streams a completion of the prompt: text, token ids, or a conversation
        (`messages`, dicts with role and content, and OpenAI's tool_calls,
        tool_call_id and name where they have them, rendered by the server's
        chat template; `tools`, OpenAI's function tools, shown to the model by
        the template; `continue_final_message`, the reply continues the last
        message; `chat_template_kwargs`, more variables for the template;
        `chat_template`, a template of the request's own, for a server run
        with --trust-request-chat-template;
        `suffix`: fill in between the text prompt and it, in the model's
        fill-in-the-middle format)."""
        request = tandem_pb2.GenerateRequest(params=params_message(**params), keep_session=keep_session)
        if tools:
            request.messages.tools_json = json.dumps(tools)
        if continue_final_message:
            request.messages.continue_final_message = True
        if chat_template_kwargs:
            request.messages.chat_template_kwargs_json = json.dumps(chat_template_kwargs)
        if chat_template:
            request.messages.chat_template = chat_template
        if suffix is not None:
            request.fill.prefix, request.fill.suffix = prompt or "", suffix
            return self._call(self.stub.Generate, request)
        return self._call(self.stub.Generate, _with_input(request, prompt, prompt_ids, messages))

    def generate(self, *args, **kwargs) -> Result:
        return collect(self.generate_stream(*args, **kwargs))

    def create_session(self, system_prompt: str = "", ttl_seconds: int = 0) -> str:
        request = tandem_pb2.CreateSessionRequest(system_prompt=system_prompt, ttl_seconds=ttl_seconds)
        return self._call(self.stub.CreateSession, request).session_id

    def chat_stream(self, session_id: str, message: str | None = None, message_ids: list[int] | None = None,
                    **params) -> Iterator[tandem_pb2.GenerateEvent]:
        request = tandem_pb2.ChatRequest(session_id=session_id, params=params_message(**params))
        if message_ids is not None:
            request.user_token_ids.ids.extend(message_ids)
        else:
            request.user_message = message or ""
        return self._call(self.stub.Chat, request)

    def chat(self, *args, **kwargs) -> Result:
        return collect(self.chat_stream(*args, **kwargs))

    def delete_session(self, session_id: str) -> bool:
        return self._call(self.stub.DeleteSession, tandem_pb2.DeleteSessionRequest(session_id=session_id)).deleted

    def tokenize(self, text: str | None = None, messages: list[dict] | None = None,
                 token_ids: list[int] | None = None, add_special_tokens: bool | None = None,
                 chat_template: str | None = None) -> tandem_pb2.TokenizeReply:
        """Text or a conversation to token ids, as Generate encodes a prompt, or
        token ids to text (give one of the three; `chat_template`, as generate's)."""
        request = tandem_pb2.TokenizeRequest(add_special_tokens=add_special_tokens)
        if chat_template:
            request.messages.chat_template = chat_template
        return self._call(self.stub.Tokenize, _with_input(request, text, token_ids, messages))

    def server_info(self) -> tandem_pb2.ServerInfo:
        return self._call(self.stub.GetServerInfo, tandem_pb2.GetServerInfoRequest())


def _with_input(request, text: str | None, token_ids: list[int] | None, messages: list[dict] | None):
    """The request (a GenerateRequest or a TokenizeRequest: the same oneof)
    with its input set: the messages, else the token ids, else the text."""
    if messages is not None:
        for m in messages:
            message = request.messages.messages.add(role=m["role"], content=m.get("content") or "")
            if m.get("tool_calls"):
                message.tool_calls_json = json.dumps(m["tool_calls"])
            message.tool_call_id, message.name = m.get("tool_call_id", ""), m.get("name", "")
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        request.text = text or ""
    return request


def collect(events, on_delta=None) -> Result:
    result = Result()
    for event in events:
        if event.HasField("delta"):
            result.token_ids.extend(event.delta.token_ids)
            result.text += event.delta.text
            result.logprobs.extend(event.delta.logprobs)
            if event.delta.HasField("prompt"):
                result.prompt = event.delta.prompt
            if on_delta is not None:
                on_delta(event.delta)
        else:
            final = event.final
            result.finish_reason = FINISH_REASONS.get(final.finish_reason, "unspecified")
            result.stop_reason = stop_reason(final)
            result.session_id = final.session_id
            result.prompt_tokens = final.usage.prompt_tokens
            result.completion_tokens = final.usage.completion_tokens
            result.cached_prompt_tokens = final.usage.cached_prompt_tokens
            result.reasoning_tokens = final.usage.reasoning_tokens
            result.stats = final.stats
    return result
