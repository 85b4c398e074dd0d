"""OpenAI's completions and chat completions, translated to and from the Tandem
API: a request body becomes one GenerateRequest, and Generate's events become
OpenAI's responses and stream chunks. Pure functions; the HTTP server is
orchestrator/http_gateway.py."""
from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass, field

import grpc
from google.protobuf.json_format import MessageToDict
from llguidance.gbnf_to_lark import gbnf_to_lark

from orchestrator import tool_parsers
from tandem.logprobs import MAX_TOP_LOGPROBS
from tandem.v1 import tandem_pb2

UINT64_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1
MAX_CHOICES = 16  # "n": each choice is a generation of its own
MAX_BATCH = 64  # a completion's prompts times n

FINISH_REASONS = {  # Tandem's finish reason -> OpenAI's
    tandem_pb2.FINISH_REASON_EOS: "stop",
    tandem_pb2.FINISH_REASON_STOP: "stop",
    tandem_pb2.FINISH_REASON_LENGTH: "length",
    tandem_pb2.FINISH_REASON_CONTEXT: "length",  # the context window is full
}

# A gRPC status -> (HTTP status, OpenAI error type).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (503, "service_unavailable_error"),  # a model pair that cannot serve
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}

# OpenAI parameters that Tandem does not serve: refused unless they hold their
# no-op value. best_of would change what is sampled, and Tandem samples
# exactly the target's distribution after the processing it applies alike on
# both services (tandem.distributions).
CHANGES_SAMPLING = ("Tandem samples exactly the target model's distribution, after logit_bias, min_tokens, "
                    "the penalties, a structured output's grammar, temperature, min_p, top_k and top_p only")
UNSUPPORTED = {
    "best_of": ((1,), CHANGES_SAMPLING),
    "suffix": (("",), "there is no insertion mode"),
    "functions": (([],), "use 'tools' (OpenAI's deprecated 'functions' are not served)"),
    "function_call": (("none",), "use 'tool_choice' (OpenAI's deprecated 'function_call' is not served)"),
}


class ApiError(Exception):
    """An error as OpenAI reports it: an HTTP status, and a body
    {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    @classmethod
    def from_rpc(cls, err: grpc.aio.AioRpcError) -> "ApiError":
        status, type_ = HTTP_STATUS.get(err.code(), (500, "internal_error"))
        return cls(status, err.details() or err.code().name, type_, code=err.code().name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class Call:
    """One request, translated: what to send, and how to answer."""

    prompts: tuple[tandem_pb2.GenerateRequest, ...]  # one a prompt (a batch of completions), each with the params
    chat: bool  # /v1/chat/completions, else /v1/completions
    stream: bool
    include_usage: bool  # streamed: a last chunk with the usage (stream_options.include_usage)
    return_token_ids: bool  # each choice (and chunk) also carries its token ids
    model: str | None  # as the client named it; None = not named
    n: int = 1  # choices a prompt: one Generate call each
    echo: tuple[str | None, ...] = ()  # "echo": each prompt's text as sent (None: token ids, the server decodes)
    prompt_only: bool = False  # "echo" with "max_tokens": 0: the choices hold the prompt alone
    tool_name: str | None = None  # tool_choice names this function: the answer is its call's arguments
    tools_required: bool = False  # tool_choice "required": the answer is a list of calls
    tool_parser: str | None = None  # tool_choice "auto": the calls are parsed out of the text (tool_parsers)

    @property
    def request(self) -> tandem_pb2.GenerateRequest:
        """The first prompt's call (all share the params)."""
        return self.prompts[0]

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def requests(self) -> list[tandem_pb2.GenerateRequest]:
        """The Generate call of each choice, choice p * n + i being prompt p's
        i-th. With a seed, the i-th choice of a prompt samples with seed + i
        (mod 2**64), so that a prompt's choices differ and each is reproducible."""
        calls = []
        for prompt in self.prompts:
            for i in range(self.n):
                request = tandem_pb2.GenerateRequest()
                request.CopyFrom(prompt)
                if i and request.params.HasField("seed"):
                    request.params.seed = (request.params.seed + i) % (UINT64_MAX + 1)
                calls.append(request)
        return calls


def _number(body: dict, name: str, low: float, high: float, *, integer: bool = False, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or (not integer and not math.isfinite(value)):
        raise invalid(name, f"'{name}' must be {'an integer' if integer else 'a finite number'}, not {value!r}")
    if value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise invalid(name, f"'{name}' must be in {bounds}, not {value!r}")
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, f"'{name}' must be true or false, not {value!r}")
    return value


def _logprobs(body: dict, chat: bool, params: tandem_pb2.GenerationParams) -> None:
    """OpenAI's log probabilities: a chat completion's "logprobs": true with
    "top_logprobs": 0..20; a completion's "logprobs": 0..20, the top tokens
    beside each token's own (OpenAI takes 0..5, vLLM up to 20)."""
    if chat:
        top = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
        if not _flag(body, "logprobs"):
            if top:
                raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
            return
    else:
        if body.get("top_logprobs") is not None:
            raise invalid("top_logprobs", "'top_logprobs' is a chat completion's: a completion takes 'logprobs': N")
        top = _number(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
        if top is None:
            return
    params.logprobs = True
    params.top_logprobs = top or 0


# Structured output as OpenAI (response_format) and vLLM (structured_outputs,
# and the older guided_*) ask for it: (parameter, its key, the format it is).
GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
          ("guided_grammar", "lark"))
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark",
                   "json_object": "json_object"}


def _structured(body: dict, params: tandem_pb2.GenerationParams) -> None:
    """response_format, structured_outputs or guided_* into
    params.structured_output (at most one format); the grammar is compiled by
    the orchestrator, which answers INVALID_ARGUMENT if it does not."""
    asked: list[tuple[str, str, object]] = []  # (parameter, format, spec)
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            asked.append(("response_format", "json_object", True))
        elif kind == "json_schema":
            schema = fmt.get("json_schema")
            if not isinstance(schema, dict) or not isinstance(schema.get("schema", {}), (dict, bool)):
                raise invalid("response_format", "'response_format.json_schema' must be an object with a 'schema'")
            asked.append(("response_format", "json_schema", schema.get("schema", {})))
        elif kind != "text":
            raise invalid("response_format", "'response_format.type' must be 'text', 'json_object' or 'json_schema'")
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise invalid("structured_outputs", "'structured_outputs' must be an object")
        for key, value in outputs.items():
            if key in STRUCTURED_KEYS and value not in (None, False):
                asked.append(("structured_outputs", STRUCTURED_KEYS[key], value))
    for name, kind in GUIDED:
        if body.get(name) is not None:
            asked.append((name, kind, body[name]))
    if body.get("guided_json_object"):
        asked.append(("guided_json_object", "json_object", True))
    if not asked:
        return
    if len(asked) > 1:
        raise invalid(asked[1][0], "give one structured output format: " + ", ".join(a[0] for a in asked))
    name, kind, spec = asked[0]
    out = params.structured_output
    if kind == "json_object":
        out.json_object = True
    elif kind == "json_schema":
        if isinstance(spec, str):
            out.json_schema = spec
        elif isinstance(spec, (dict, bool)):
            out.json_schema = json.dumps(spec)
        else:
            raise invalid(name, f"'{name}' must be a JSON schema")
    elif kind == "choice":
        if not isinstance(spec, list) or not all(isinstance(c, str) for c in spec):
            raise invalid(name, f"'{name}' must be a list of strings")
        out.choice.choices.extend(spec)
    else:
        if not isinstance(spec, str):
            raise invalid(name, f"'{name}' must be a string")
        if kind == "lark" and "::=" in spec:  # GBNF (llama.cpp's, vLLM's examples): into Lark
            try:
                spec = gbnf_to_lark(spec)
            except Exception as err:  # noqa: BLE001 (the converter's words go back to the client)
                raise invalid(name, f"'{name}' is not a grammar llguidance reads: {err}") from None
        setattr(out, kind, spec)


def _params(body: dict, max_tokens_names: tuple[str, ...], chat: bool) -> tandem_pb2.GenerationParams:
    for name, (no_ops, why) in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value not in no_ops:
            raise invalid(name, f"'{name}' is not supported: {why}")
    params = tandem_pb2.GenerationParams()
    _structured(body, params)
    for name in max_tokens_names:
        if (value := _number(body, name, 1, INT32_MAX, integer=True)) is not None:
            params.max_tokens = value
    # OpenAI's defaults: temperature 1 and top_p 1. temperature 0 is greedy.
    temperature = _number(body, "temperature", 0, 1e6)
    params.temperature = 1.0 if temperature is None else temperature
    if (top_p := _number(body, "top_p", 0, 1, low_open=True)) is not None:
        params.top_p = top_p
    if (top_k := _number(body, "top_k", -1, INT32_MAX, integer=True)) is not None:
        params.top_k = max(top_k, 0)  # vLLM's -1 means off, as 0 does here
    if (seed := _number(body, "seed", 0, UINT64_MAX, integer=True)) is not None:
        params.seed = seed
    if (k := _number(body, "num_draft_tokens", 0, INT32_MAX, integer=True)) is not None:
        params.num_draft_tokens = k
    if body.get("pipeline") is not None:
        params.pipeline = _flag(body, "pipeline")
    params.ignore_eos = _flag(body, "ignore_eos")
    for name in ("presence_penalty", "frequency_penalty"):
        if (penalty := _number(body, name, -2, 2)) is not None:
            setattr(params, name, penalty)
    if (repetition := _number(body, "repetition_penalty", 0, 1e6, low_open=True)) is not None:
        params.repetition_penalty = repetition
    if (min_p := _number(body, "min_p", 0, 1)) is not None:
        params.min_p = min_p
    if (min_tokens := _number(body, "min_tokens", 0, INT32_MAX, integer=True)) is not None:
        params.min_tokens = min_tokens
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise invalid("logit_bias", "'logit_bias' must be an object of token ids to numbers")
        for key, value in bias.items():
            if not str(key).lstrip("-").isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise invalid("logit_bias", f"'logit_bias' maps token ids to numbers, not {key!r}: {value!r}")
            if not -100 <= value <= 100:
                raise invalid("logit_bias", f"'logit_bias' values must be in [-100, 100], not {value!r}")
            params.logit_bias[int(key)] = float(value)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise invalid("stop_token_ids", "'stop_token_ids' must be a list of token ids")
        params.stop_token_ids.extend(ids)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise invalid("stop", "'stop' must be a string or a list of strings")
        params.stop.extend(s for s in stop if s)
    _logprobs(body, chat, params)
    return params


def _common(body, chat: bool, prompts: list[tandem_pb2.GenerateRequest], echo=(), prompt_only=False) -> Call:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "'model' must be a string")
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("stream_options", "'stream_options' must be an object")
    if options and not stream:
        raise invalid("stream_options", "'stream_options' needs 'stream': true")
    n = _number(body, "n", 1, MAX_CHOICES, integer=True) or 1
    if len(prompts) * n > MAX_BATCH:
        raise invalid("prompt", f"at most {MAX_BATCH} choices a request: {len(prompts)} prompts times n = {n}")
    return Call(prompts=tuple(prompts), chat=chat, stream=stream, include_usage=_flag(options, "include_usage"),
                return_token_ids=_flag(body, "return_token_ids"), model=model or None, n=n, echo=tuple(echo),
                prompt_only=prompt_only)


def _is_ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def completion_call(body) -> Call:
    """POST /v1/completions. The prompt is text or a list of token ids, or a
    batch of either: a list of strings or of token id lists, each prompt a
    Generate call (and n of them), its choices at index p * n + i. "echo"
    returns each prompt before its completion, with "logprobs" its tokens'
    (the first's is null); "max_tokens": 0 with it, the prompt alone, as
    lm-evaluation-harness's loglikelihood requests ask."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    prompt = body.get("prompt")
    batch = [prompt]
    if isinstance(prompt, list) and prompt and not _is_ids(prompt) and all(isinstance(p, (str, list)) for p in prompt):
        batch = prompt  # several prompts
    echo = _flag(body, "echo")
    prompt_only = echo and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    params = _params({**body, "max_tokens": 1} if prompt_only else body, ("max_tokens",), chat=False)
    if echo:
        params.echo = True
        if params.logprobs:
            params.prompt_logprobs = params.top_logprobs
    prompts = []
    for i, one in enumerate(batch):
        request = tandem_pb2.GenerateRequest(params=params)
        if isinstance(one, str):
            request.text = one
        elif _is_ids(one):
            request.token_ids.ids.extend(one)
        else:
            where = f"prompt[{i}]" if len(batch) > 1 else "prompt"
            raise invalid("prompt", f"'{where}' must be a string or a non-empty list of token ids")
        prompts.append(request)
    texts = [one if isinstance(one, str) else None for one in batch] if echo else []
    return _common(body, False, prompts, texts, prompt_only)


def _content(i: int, content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"messages[{i}].content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"messages[{i}].content", "a message's 'content' must be a string or a list of text parts")


def chat_call(body, tool_parser: str | None = None) -> Call:
    """POST /v1/chat/completions: the whole conversation, rendered by the
    orchestrator with the model's chat template. tool_parser: the server's
    --tool-call-parser, which tool_choice "auto" needs."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list")
    if _flag(body, "echo"):
        raise invalid("echo", "'echo' is a completion's parameter: a chat completion does not echo")
    tools, tool_name, required, parser = _tools(body, tool_parser)
    if tool_name is not None or required:
        if any(body.get(name) is not None for name in ("response_format", "structured_outputs", *dict(GUIDED))):
            raise invalid("tool_choice", "a tool_choice that calls a tool constrains the answer itself: "
                                         "it takes no other structured output format")
    request = tandem_pb2.GenerateRequest(params=_params(body, ("max_tokens", "max_completion_tokens"), chat=True))
    if tool_name is not None:
        function = next(t["function"] for t in tools if t["function"]["name"] == tool_name)
        request.params.structured_output.json_schema = json.dumps(function.get("parameters") or {"type": "object"})
    elif required:
        request.params.structured_output.json_schema = json.dumps(_calls_schema(tools))
    if tools:
        request.messages.tools_json = json.dumps(tools)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            raise invalid(f"messages[{i}]", "each message must be an object with a 'role'")
        added = request.messages.messages.add(role=message["role"], content=_content(i, message.get("content")))
        if message.get("tool_calls"):
            if not isinstance(message["tool_calls"], list):
                raise invalid(f"messages[{i}].tool_calls", "'tool_calls' must be a list of calls")
            added.tool_calls_json = json.dumps(message["tool_calls"])
        for name in ("tool_call_id", "name"):
            if message.get(name) is not None:
                if not isinstance(message[name], str):
                    raise invalid(f"messages[{i}].{name}", f"'{name}' must be a string")
                setattr(added, name, message[name])
    return dataclasses.replace(_common(body, True, [request]), tool_name=tool_name, tools_required=required,
                               tool_parser=parser)


def _tools(body: dict, tool_parser: str | None = None) -> tuple[list[dict], str | None, bool, str | None]:
    """"tools" and "tool_choice": (the tools, the function a call is forced
    to, whether one is required, the parser of "auto"'s calls). "auto", OpenAI's default where tools are
    given, needs the model's own tool-call format parsed out of free text
    (--tool-call-parser): without a parser it is refused, as vLLM does."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "'tool_choice' needs 'tools'")
        return [], None, False, None
    if not isinstance(tools, list):
        raise invalid("tools", "'tools' must be a list of tools")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise invalid(f"tools[{i}]", "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise invalid(f"tools[{i}].function.parameters", "'parameters' must be a JSON schema (an object)")
        names.append(function["name"])
    if (choice is None or choice == "auto") and tool_parser is None:
        raise invalid("tool_choice", "tool_choice 'auto' (the default with tools) needs the model's tool-call "
                                     "format parsed from free text: start the server with --tool-call-parser, "
                                     "or send 'required', a named function, or 'none'")
    if choice is None or choice == "auto":
        return tools, None, False, tool_parser
    if choice in ("none", "required"):
        return tools, None, choice == "required", None
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise invalid("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                     "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in names:
        raise invalid("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return tools, name, False, None


def _calls_schema(tools: list[dict]) -> dict:
    """tool_choice "required": a JSON list of at least one call, each a tool's
    name and its parameters, as vLLM constrains it."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                          "parameters": t["function"].get("parameters") or {"type": "object"}},
         "required": ["name", "parameters"], "additionalProperties": False}
        for t in tools]}}


def tool_calls(call: Call, text: str) -> list[dict] | None:
    """The answer's text as OpenAI's tool_calls; None where it is not a
    complete call (cut by max_tokens)."""
    if call.tool_name is not None:
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return None
        return [tool_parsers.openai_call(call.tool_name, text)]
    try:
        return [tool_parsers.openai_call(c["name"], c["parameters"]) for c in json.loads(text)]
    except (json.JSONDecodeError, KeyError, TypeError):  # a list cut short (by a stop string, say)
        return None


def tokenize_request(body) -> tandem_pb2.TokenizeRequest:
    """vLLM's /tokenize body: "prompt" (text) or "messages" (with "tools", which
    the chat template shows the model), and "add_special_tokens"."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    request = tandem_pb2.TokenizeRequest()
    if body.get("messages") is not None:
        chat = {"messages": body["messages"]}
        if body.get("tools"):
            chat.update(tools=body["tools"], tool_choice="none")
        request.messages.CopyFrom(chat_call(chat).request.messages)
    elif isinstance(body.get("prompt"), str):
        request.text = body["prompt"]
        if body.get("add_special_tokens") is not None:
            request.add_special_tokens = _flag(body, "add_special_tokens")
    else:
        raise invalid("prompt", "give 'prompt' (a string) or 'messages'")
    return request


def detokenize_request(body) -> tandem_pb2.TokenizeRequest:
    """vLLM's /detokenize body: "tokens", a list of token ids."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid("tokens", "'tokens' must be a list of token ids")
    request = tandem_pb2.TokenizeRequest()
    request.token_ids.ids.extend(tokens)
    return request


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(call: Call, finals: list[tandem_pb2.Completion]) -> dict:
    """The usage of a request's choices: each prompt once, the completions'
    tokens summed (none when the choices hold the prompt alone), and of each
    prompt the tokens that every one of its choices found cached."""
    per_prompt = [finals[p * call.n: (p + 1) * call.n] for p in range(len(call.prompts))]
    prompt = sum(choices[0].usage.prompt_tokens for choices in per_prompt)
    completion = 0 if call.prompt_only else sum(final.usage.completion_tokens for final in finals)
    cached = sum(min(f.usage.cached_prompt_tokens for f in choices) for choices in per_prompt)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def speculation(final: tandem_pb2.Completion) -> dict:
    """The request's speculation stats (rounds, accepted tokens, k, ...), as
    the extension field "tandem" of a response."""
    return MessageToDict(final.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


LOWEST_LOGPROB = -9999.0  # in place of -inf, which JSON cannot carry (as vLLM does)


def _finite(value: float) -> float:
    return max(value, LOWEST_LOGPROB)


def chat_logprobs(logprobs) -> dict:
    """A chat choice's "logprobs" for TokenLogprobs: each token with its
    UTF-8 bytes and its most likely alternatives."""
    def entry(lp) -> dict:
        return {"token": lp.token, "logprob": _finite(lp.logprob), "bytes": list(lp.token.encode())}

    return {"content": [{**entry(lp), "top_logprobs": [entry(top) for top in lp.top_logprobs]} for lp in logprobs],
            "refusal": None}


def completion_logprobs(logprobs, offset: int = 0) -> dict:
    """A completion choice's "logprobs": the tokens, their log probabilities,
    for each a map of the most likely tokens (and the token itself) to theirs,
    and where each token starts in the completion's text, from `offset`."""
    answer = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in logprobs:
        top = None
        if lp.logprob is not None:  # None: a prompt's first token
            top = {alt.token: _finite(alt.logprob) for alt in lp.top_logprobs}
            top.setdefault(lp.token, _finite(lp.logprob))
        answer["tokens"].append(lp.token)
        answer["token_logprobs"].append(None if lp.logprob is None else _finite(lp.logprob))
        answer["top_logprobs"].append(top)
        answer["text_offset"].append(offset)
        offset += len(lp.token)
    return answer


@dataclass(frozen=True)
class _Unscored:
    """A prompt's first token: no position predicts it."""

    token: str
    logprob: None = None
    top_logprobs: tuple = ()


def _prompt_logprobs(prompt: tandem_pb2.PromptEcho) -> list:
    return [_Unscored(prompt.first_token), *prompt.logprobs]


def _echo_text(call: Call, index: int, prompt: tandem_pb2.PromptEcho) -> str:
    """Choice `index`'s prompt as it comes back: the text sent, or the
    server's decoding of the token ids sent."""
    sent = call.echo[index // call.n]
    return sent if sent is not None else prompt.text


def _choice_logprobs(call: Call, logprobs, offset: int = 0) -> dict | None:
    if not call.request.params.logprobs:
        return None
    return chat_logprobs(logprobs) if call.chat else completion_logprobs(logprobs, offset)


@dataclass
class Answer:
    """One choice's generation, collected from its events."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprobs, when the request asked
    final: tandem_pb2.Completion | None = None
    prompt: tandem_pb2.PromptEcho | None = None  # echo

    def add(self, delta: tandem_pb2.TokenDelta) -> None:
        self.text += delta.text
        self.ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.HasField("prompt"):
            self.prompt = delta.prompt


def response(call: Call, model: str, answers: list[Answer]) -> dict:
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
                  "logprobs": _choice_logprobs(call, logprobs)}
        if call.chat:
            content, calls = text, None
            if call.tool_name is not None or call.tools_required:
                calls = tool_calls(call, text)
                content = None if calls is not None else text
            elif call.tool_parser is not None:
                content, calls = tool_parsers.parse(call.tool_parser, text)
            choice["message"] = {"role": "assistant", "content": content}
            if calls is not None:
                choice["message"]["tool_calls"] = calls
                choice["finish_reason"] = _tools_finish_reason(call, choice["finish_reason"])
        else:
            choice["text"] = text
        if call.return_token_ids:
            choice["token_ids"] = ids
        choices.append(choice)
    finals = [answer.final for answer in answers]
    stats = [speculation(final) for final in finals]
    return {"id": new_id(call.chat), "object": "chat.completion" if call.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": usage(call, finals),
            "tandem": stats[0] if call.choices == 1 else stats}


def _finish_reason(call: Call, final: tandem_pb2.Completion) -> str:
    return "length" if call.prompt_only else FINISH_REASONS.get(final.finish_reason, "stop")


def _tools_finish_reason(call: Call, reason: str) -> str:
    """A complete answer that calls tools: "tool_calls" where the model chose
    them ("required", "auto"), "stop" where tool_choice named the function, as
    OpenAI answers a forced call."""
    return "tool_calls" if (call.tools_required or call.tool_parser) and reason == "stop" else reason


class Chunks:
    """The chunks of one streamed answer: for each choice (its index), deltas
    as rounds commit them, then one with its finish reason and its stats;
    after every choice's, the usage if asked."""

    def __init__(self, call: Call, model: str):
        self.call, self.model = call, model
        self.id, self.created = new_id(call.chat), int(time.time())
        self._role_sent: set[int] = set()  # choices whose first chunk went out
        self._calls: dict[int, str] = {}  # tool_choice "required": each choice's text, sent as calls at its end
        self._call_ids: dict[int, str] = {}  # a named tool_choice: each choice's call id
        self._said: dict[int, str] = {}  # tool_choice "auto": each choice's text so far
        self._sent: dict[int, int] = {}  # and how much of it went out as content
        self._offset = [0] * call.choices  # where each choice's next token starts in its text (text_offset)

    def _chunk(self, choices: list[dict], **more) -> dict:
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
        if self.call.return_token_ids and ids is not None:
            choice["token_ids"] = ids
        return choice

    def delta(self, index: int, delta: tandem_pb2.TokenDelta) -> list[dict]:
        """The chunks of a delta of choice `index`: with echo, the prompt's
        first (it comes with the choice's first delta)."""
        chunks = []
        if self.call.echo and delta.HasField("prompt"):
            chunks.append(self._chunk([self._choice(index, _echo_text(self.call, index, delta.prompt), [], None,
                                                    _prompt_logprobs(delta.prompt))]))
        if self.call.chat and self.call.tools_required:  # the calls go out whole, once the list is complete
            self._calls[index] = self._calls.get(index, "") + delta.text
            return chunks
        if self.call.chat and self.call.tool_parser is not None:  # content up to a call's opening tag
            said = self._said[index] = self._said.get(index, "") + delta.text
            sent, ready = self._sent.get(index, 0), tool_parsers.sendable(self.call.tool_parser, said)
            if ready > sent:
                self._sent[index] = ready
                chunks.append(self._chunk([self._choice(index, said[sent:ready], list(delta.token_ids), None,
                                                        delta.logprobs)]))
            return chunks
        if not self.call.prompt_only:
            chunks.append(self._chunk([self._choice(index, delta.text, list(delta.token_ids), None, delta.logprobs)]))
        return chunks

    def final(self, index: int, final: tandem_pb2.Completion) -> list[dict]:
        """The choice's last chunks: with tool_choice "required", its calls (or,
        cut short, its text), then the one with the finish reason and stats."""
        reason = _finish_reason(self.call, final)
        chunks = []
        if self.call.chat and self.call.tools_required:
            text = self._calls.pop(index, "")
            calls = tool_calls(self.call, text)
            choice = self._choice(index, None if calls is not None else text, None, None)
            if calls is not None:
                choice["delta"]["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                reason = _tools_finish_reason(self.call, reason)
            chunks.append(self._chunk([choice]))
        elif self.call.tool_name is not None and reason == "stop":
            reason = _tools_finish_reason(self.call, reason)
        elif self.call.chat and self.call.tool_parser is not None:
            said, sent = self._said.pop(index, ""), self._sent.pop(index, 0)
            _, calls = tool_parsers.parse(self.call.tool_parser, said)
            if calls is not None:
                choice = self._choice(index, None, None, None)
                choice["delta"]["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                chunks.append(self._chunk([choice]))
                reason = _tools_finish_reason(self.call, reason)
            elif len(said) > sent:  # what was held back: a tag that never became a call
                chunks.append(self._chunk([self._choice(index, said[sent:], None, None)]))
        closing = self._choice(index, None if self.call.tool_name is not None else "" if self.call.chat else None,
                               [], reason)
        return [*chunks, self._chunk([closing], tandem=speculation(final))]

    def usage(self, finals: list[tandem_pb2.Completion]) -> dict:
        """The last chunk, when the request asked (stream_options.include_usage)."""
        return self._chunk([], usage=usage(self.call, finals))
