"""An OpenAI request body's generation parameters, checked, as Tandem's
GenerationParams, and the errors the HTTP API answers with as OpenAI words
them. Pure functions (orchestrator/openai_api.py builds the calls)."""
from __future__ import annotations

import json
import math

import grpc
from llguidance.gbnf_to_lark import gbnf_to_lark

from tandem.logprobs import MAX_TOP_LOGPROBS
from tandem.v1 import tandem_pb2

UINT64_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1

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


def number(body: dict, name: str, low: float, high: float, *, integer: bool = False, low_open: bool = False):
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


def flag(body: dict, name: str) -> bool:
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
        top = number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
        if not flag(body, "logprobs"):
            if top:
                raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
            return
    else:
        if body.get("top_logprobs") is not None:
            raise invalid("top_logprobs", "'top_logprobs' is a chat completion's: a completion takes 'logprobs': N")
        top = number(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
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


def generation_params(body: dict, max_tokens_names: tuple[str, ...], chat: bool) -> tandem_pb2.GenerationParams:
    for name, (no_ops, why) in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value not in no_ops:
            raise invalid(name, f"'{name}' is not supported: {why}")
    params = tandem_pb2.GenerationParams()
    _structured(body, params)
    for name in max_tokens_names:
        if (value := number(body, name, 1, INT32_MAX, integer=True)) is not None:
            params.max_tokens = value
    # OpenAI's defaults: temperature 1 and top_p 1. temperature 0 is greedy.
    temperature = number(body, "temperature", 0, 1e6)
    params.temperature = 1.0 if temperature is None else temperature
    if (top_p := number(body, "top_p", 0, 1, low_open=True)) is not None:
        params.top_p = top_p
    if (top_k := number(body, "top_k", -1, INT32_MAX, integer=True)) is not None:
        params.top_k = max(top_k, 0)  # vLLM's -1 means off, as 0 does here
    if (seed := number(body, "seed", 0, UINT64_MAX, integer=True)) is not None:
        params.seed = seed
    if (k := number(body, "num_draft_tokens", 0, INT32_MAX, integer=True)) is not None:
        params.num_draft_tokens = k
    if body.get("pipeline") is not None:
        params.pipeline = flag(body, "pipeline")
    params.ignore_eos = flag(body, "ignore_eos")
    for name in ("presence_penalty", "frequency_penalty"):
        if (penalty := number(body, name, -2, 2)) is not None:
            setattr(params, name, penalty)
    if (repetition := number(body, "repetition_penalty", 0, 1e6, low_open=True)) is not None:
        params.repetition_penalty = repetition
    if (min_p := number(body, "min_p", 0, 1)) is not None:
        params.min_p = min_p
    if (min_tokens := number(body, "min_tokens", 0, INT32_MAX, integer=True)) is not None:
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
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = body.get(name)
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise invalid(name, f"'{name}' must be a list of token ids")
            getattr(params, name).extend(ids)
    for name in ("stop", "bad_words"):
        texts = body.get(name)
        if isinstance(texts, str):
            texts = [texts]
        if texts is not None:
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise invalid(name, f"'{name}' must be a string or a list of strings")
            getattr(params, name).extend(t for t in texts if t)
    if flag(body, "include_stop_str_in_output"):
        params.include_stop_str_in_output = True
    # vLLM's: keep the prompt's last n tokens (-1: as many as fit beside max_tokens).
    if (truncate := number(body, "truncate_prompt_tokens", -1, INT32_MAX, integer=True)) is not None:
        if truncate == 0:
            raise invalid("truncate_prompt_tokens", "'truncate_prompt_tokens' must be -1 or >= 1, not 0")
        params.truncate_prompt_tokens = truncate
    # vLLM's (with --scheduling-policy priority): the request's calls queue by it, the lowest first.
    if (priority := number(body, "priority", -INT32_MAX - 1, INT32_MAX, integer=True)) is not None:
        params.priority = priority
    if body.get("skip_special_tokens") is not None:  # vLLM's; default true
        params.skip_special_tokens = flag(body, "skip_special_tokens")
    _logprobs(body, chat, params)
    return params
