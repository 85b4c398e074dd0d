"""OpenAI's completions and chat completions, translated into the Tandem
API: a request body becomes a Call, its GenerateRequests and how to answer.
Pure functions. The parameters' checks are orchestrator/openai_params.py,
the answers orchestrator/openai_response.py, the HTTP server
orchestrator/http_gateway.py."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from orchestrator.openai_params import GUIDED, UINT64_MAX, flag, generation_params, invalid, number
from tandem.logprobs import MAX_TOP_LOGPROBS
from tandem.v1 import tandem_pb2

MAX_CHOICES = 16  # "n": each choice is a generation of its own
MAX_BATCH = 64  # a completion's prompts times n


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
    one_call: bool = False  # "parallel_tool_calls": false: at most one call ("auto" keeps the first)
    # streamed with include_usage: each chunk has its choice's usage so far (vLLM's
    # stream_options.continuous_usage_stats)
    continuous_usage: bool = False
    # chat: the answer's reasoning is read out of its text (orchestrator/reasoning_parsers.py)
    reasoning_parser: str | None = None
    # vLLM's "prompt_logprobs": each prompt token's log probability and rank, with this many likeliest
    # tokens at its position (a completion's choices, a chat completion's top level); None = not asked
    prompt_logprobs: int | None = None
    # vLLM's "return_tokens_as_token_ids": log probabilities name tokens "token_id:ID"; None = the server's default
    tokens_as_ids: bool | None = None

    @property
    def most_calls(self) -> int | None:
        """How many of an answer's calls go out: the first alone (one_call), or all (None)."""
        return 1 if self.one_call else None

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


def _common(body, chat: bool, prompts: list[tandem_pb2.GenerateRequest], echo=(), prompt_only=False) -> Call:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "'model' must be a string")
    stream = flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("stream_options", "'stream_options' must be an object")
    if options and not stream:
        raise invalid("stream_options", "'stream_options' needs 'stream': true")
    n = number(body, "n", 1, MAX_CHOICES, integer=True) or 1
    if len(prompts) * n > MAX_BATCH:
        raise invalid("prompt", f"at most {MAX_BATCH} choices a request: {len(prompts)} prompts times n = {n}")
    include_usage = flag(options, "include_usage")
    return_token_ids = flag(body, "return_token_ids")
    prompt_logprobs = _prompt_logprobs(body, stream)
    for request in prompts:
        params = request.params
        if prompt_logprobs is not None:  # the larger count where "echo" with "logprobs" asked too
            params.prompt_logprobs = max(prompt_logprobs, params.prompt_logprobs)
        if return_token_ids:  # with them the prompt's: the first delta brings them back
            params.echo = True
    return Call(prompts=tuple(prompts), chat=chat, stream=stream, include_usage=include_usage,
                return_token_ids=return_token_ids, model=model or None, n=n, echo=tuple(echo),
                prompt_only=prompt_only, continuous_usage=include_usage and flag(options, "continuous_usage_stats"),
                prompt_logprobs=prompt_logprobs,
                tokens_as_ids=None if body.get("return_tokens_as_token_ids") is None
                else flag(body, "return_tokens_as_token_ids"))


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    """vLLM's "prompt_logprobs": 0..20, not with "stream" (as vLLM: a
    streamed answer has no place for them; 0 streamed is taken and has none)."""
    value = body.get("prompt_logprobs")
    if value == -1:
        raise invalid("prompt_logprobs", f"'prompt_logprobs': -1 (the whole vocabulary) is not served: at most "
                                         f"{MAX_TOP_LOGPROBS} likeliest tokens a position")
    top = number(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    if top is None or not stream:
        return top
    if top:
        raise invalid("prompt_logprobs", "'prompt_logprobs' are not available when 'stream' is true: ask without "
                                         "streaming, or stream with 'echo' and 'logprobs' (a completion)")
    return None


def _is_ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def completion_call(body) -> Call:
    """POST /v1/completions. The prompt is text or a list of token ids, or a
    batch of either: a list of strings or of token id lists, each prompt a
    Generate call (and n of them), its choices at index p * n + i. "echo"
    returns each prompt before its completion, with "logprobs" its tokens'
    (the first's is null); "max_tokens": 0 with it, the prompt alone, as
    lm-evaluation-harness's loglikelihood requests ask. "suffix": the
    completion fills in between each text prompt and it (orchestrator/fim.py)."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    prompt = body.get("prompt")
    batch = [prompt]
    if isinstance(prompt, list) and prompt and not _is_ids(prompt) and all(isinstance(p, (str, list)) for p in prompt):
        batch = prompt  # several prompts
    echo = flag(body, "echo")
    prompt_only = echo and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    params = generation_params({**body, "max_tokens": 1} if prompt_only else body, ("max_tokens",), chat=False)
    if echo:
        params.echo = True
        if params.logprobs:
            params.prompt_logprobs = params.top_logprobs
    suffix = body.get("suffix")
    if suffix is not None:
        if not isinstance(suffix, str):
            raise invalid("suffix", "'suffix' must be a string")
        if echo:
            raise invalid("suffix", "'suffix' and 'echo' do not go together: a filled-in middle has no prompt "
                                    "to echo before it")
    prompts = []
    for i, one in enumerate(batch):
        request = tandem_pb2.GenerateRequest(params=params)
        if isinstance(one, str) and suffix is not None:
            request.fill.prefix, request.fill.suffix = one, suffix
        elif suffix is not None:
            raise invalid("suffix", "'suffix' needs text prompts: token ids have no place for it")
        elif isinstance(one, str):
            request.text = one
        elif _is_ids(one):
            request.token_ids.ids.extend(one)
        else:
            where = f"prompt[{i}]" if len(batch) > 1 else "prompt"
            raise invalid("prompt", f"'{where}' must be a string or a non-empty list of token ids")
        prompts.append(request)
    # Echoed: the text sent, or where the server may have cut it (truncate_prompt_tokens), its decoding.
    cut = params.HasField("truncate_prompt_tokens")
    texts = [one if isinstance(one, str) and not cut else None for one in batch] if echo else []
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


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _template_options(body: dict, messages: tandem_pb2.ChatMessages) -> None:
    """vLLM's chat template options: continue_final_message (with
    add_generation_prompt false, as vLLM asks), chat_template_kwargs and
    chat_template (a template of the request's own);
    OpenAI's reasoning_effort, one of the template's variables (a
    chat_template_kwargs of the same name wins)."""
    continues = flag(body, "continue_final_message")
    adds = body.get("add_generation_prompt")
    if adds is not None and not isinstance(adds, bool):
        raise invalid("add_generation_prompt", f"'add_generation_prompt' must be true or false, not {adds!r}")
    if continues and adds:
        raise invalid("add_generation_prompt", "'continue_final_message' continues the last message: send "
                                               "'add_generation_prompt': false with it")
    if adds is False and not continues:
        raise invalid("add_generation_prompt", "'add_generation_prompt': false is supported with "
                                               "'continue_final_message': true only (the reply continues the last "
                                               "message)")
    messages.continue_final_message = continues
    variables = body.get("chat_template_kwargs")
    if variables is not None and not isinstance(variables, dict):
        raise invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object of the chat "
                                              "template's variables")
    effort = body.get("reasoning_effort")
    if effort is not None:  # the template's variable of that name, as vLLM passes it (gpt-oss's reads it)
        if effort not in REASONING_EFFORTS:
            raise invalid("reasoning_effort", f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, "
                                              f"not {effort!r}")
        variables = {"reasoning_effort": effort, **(variables or {})}
    if variables is not None:
        messages.chat_template_kwargs_json = json.dumps(variables)
    template = body.get("chat_template")
    if template is not None:  # the orchestrator runs it only with --trust-request-chat-template
        if not isinstance(template, str) or not template:
            raise invalid("chat_template", "'chat_template' must be the text of a Jinja chat template")
        messages.chat_template = template


def chat_call(body, tool_parser: str | None = None) -> Call:
    """POST /v1/chat/completions: the whole conversation, rendered by the
    orchestrator with the model's chat template. tool_parser: the server's
    --tool-call-parser, which tool_choice "auto" needs."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list")
    if flag(body, "echo"):
        raise invalid("echo", "'echo' is a completion's parameter: a chat completion does not echo")
    tools, tool_name, required, parser = _tools(body, tool_parser)
    one_call = body.get("parallel_tool_calls") is not None and not flag(body, "parallel_tool_calls")
    if tool_name is not None or required:
        if any(body.get(name) is not None for name in ("response_format", "structured_outputs", *dict(GUIDED))):
            raise invalid("tool_choice", "a tool_choice that calls a tool constrains the answer itself: "
                                         "it takes no other structured output format")
    request = tandem_pb2.GenerateRequest(params=generation_params(body, ("max_tokens", "max_completion_tokens"), chat=True))
    if tool_name is not None:
        function = next(t["function"] for t in tools if t["function"]["name"] == tool_name)
        request.params.structured_output.json_schema = json.dumps(function.get("parameters") or {"type": "object"})
    elif required:
        request.params.structured_output.json_schema = json.dumps(_calls_schema(tools, one_call))
    if tools:
        request.messages.tools_json = json.dumps(tools)
    _template_options(body, request.messages)
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
                               tool_parser=parser, one_call=one_call)


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


def _calls_schema(tools: list[dict], one_call: bool = False) -> dict:
    """tool_choice "required": a JSON list of at least one call (exactly one
    with parallel_tool_calls false), each a tool's name and its parameters,
    as vLLM constrains it."""
    return {"type": "array", "minItems": 1, **({"maxItems": 1} if one_call else {}), "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                          "parameters": t["function"].get("parameters") or {"type": "object"}},
         "required": ["name", "parameters"], "additionalProperties": False}
        for t in tools]}}


def tokenize_request(body) -> tandem_pb2.TokenizeRequest:
    """vLLM's /tokenize body: "prompt" (text) or "messages" (with "tools", which
    the chat template shows the model), and "add_special_tokens"."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    request = tandem_pb2.TokenizeRequest()
    if body.get("messages") is not None:
        chat = {"messages": body["messages"]}
        chat.update({k: body[k] for k in ("continue_final_message", "add_generation_prompt", "chat_template_kwargs",
                                          "chat_template") if k in body})
        if body.get("tools"):
            chat.update(tools=body["tools"], tool_choice="none")
        request.messages.CopyFrom(chat_call(chat).request.messages)
    elif isinstance(body.get("prompt"), str):
        request.text = body["prompt"]
        if body.get("add_special_tokens") is not None:
            request.add_special_tokens = flag(body, "add_special_tokens")
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
