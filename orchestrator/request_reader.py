"""The Tandem API's request messages read into what Generation takes, checked
against the paired target model: its vocabulary, its tokenizer and chat
template, its end-of-sequence tokens. Every check fails with a ValueError
whose words the orchestrator sends back as INVALID_ARGUMENT."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from orchestrator.request_params import RequestParams
from orchestrator.text import MAX_CHAT_TEMPLATE_CHARS, ChatTemplate
from tandem.sampling import MAX_BAD_WORDS, MAX_GRAMMAR_AFTER, MAX_LOGIT_BIASES, SamplingParams
from tandem.structured import FORMATS, build_grammar
from tandem.v1 import common_pb2, tandem_pb2


MAX_REASONING_TAG = 64  # characters of reasoning.end and reasoning.start


@dataclass(frozen=True)
class RequestReader:
    """Reads requests for one pairing: `target` is the target service's
    ModelInfo, `tokenizer` None where there is none (token ids only)."""

    target: common_pb2.ModelInfo
    tokenizer: object | None
    template: ChatTemplate
    default_max_tokens: int
    trust_request_chat_template: bool = False  # a request may bring its own chat template
    priority_scheduling: bool = False  # --scheduling-policy priority: a request may give a priority other than 0

    def params(self, msg: tandem_pb2.GenerationParams, priority_floor: int | None = None) -> RequestParams:
        """priority_floor: the tenant's priority (--tenant-priority), the
        request's where it gives none (the caller has refused one below it)."""
        seed = msg.seed if msg.HasField("seed") else random.getrandbits(63)
        sampling = SamplingParams(
            temperature=msg.temperature if msg.HasField("temperature") else 0.0,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            top_k=msg.top_k if msg.HasField("top_k") else 0,
            seed=seed,
            logit_bias=self._logit_bias(msg.logit_bias),
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
            min_p=msg.min_p,
            allowed_ids=tuple(sorted(set(self.check_ids(list(msg.allowed_token_ids), "allowed_token_ids")))),
            bad_words=self._bad_words(msg.bad_words),
        )
        if msg.stop:
            self.need_tokenizer("a stop string")
        grammar, grammar_after = "", ()
        if msg.HasField("structured_output"):
            self.need_tokenizer("structured output")
            grammar = self._grammar(msg.structured_output)
            grammar_after = self._grammar_after(msg.structured_output.after)
            if not self.target.eos_token_ids and not msg.stop_token_ids:
                raise ValueError("structured output needs an end-of-sequence token to end a complete output, "
                                 "and the model has none: give stop_token_ids")
        reasoning_end, reasoning_end_ids, reasoning_start = "", (), ""
        if msg.HasField("reasoning"):
            reasoning_end, reasoning_end_ids, reasoning_start = self._reasoning(msg.reasoning)
        if msg.HasField("top_logprobs") and not msg.logprobs:
            raise ValueError("top_logprobs needs logprobs")
        priority = msg.priority if msg.HasField("priority") or priority_floor is None else priority_floor
        if priority and not self.priority_scheduling:
            raise ValueError(f"priority {priority} needs an orchestrator started with --scheduling-policy "
                             "priority: this one runs calls first come, first served (priority 0)")
        return RequestParams(
            sampling=sampling,
            max_tokens=msg.max_tokens if msg.HasField("max_tokens") else self.default_max_tokens,
            stop=tuple(msg.stop),
            include_stop=msg.include_stop_str_in_output,
            k=msg.num_draft_tokens if msg.HasField("num_draft_tokens") else 0,
            pipeline=msg.pipeline if msg.HasField("pipeline") else None,
            seeded=msg.HasField("seed"),
            logprobs=(msg.top_logprobs if msg.HasField("top_logprobs") else 0) if msg.logprobs else None,
            ignore_eos=msg.ignore_eos,
            echo=msg.echo,
            prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
            min_tokens=msg.min_tokens,
            stop_token_ids=frozenset(self.check_ids(list(msg.stop_token_ids), "stop_token_ids")),
            grammar=grammar,
            grammar_after=grammar_after,
            reasoning_end=reasoning_end,
            reasoning_end_ids=reasoning_end_ids,
            reasoning_start=reasoning_start,
            truncate_prompt_tokens=msg.truncate_prompt_tokens if msg.HasField("truncate_prompt_tokens") else None,
            skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
            priority=priority,
        )

    @staticmethod
    def _grammar(msg: tandem_pb2.StructuredOutput) -> str:
        kind = msg.WhichOneof("format")
        if kind is None:
            raise ValueError("structured_output names no format: one of " + ", ".join(FORMATS))
        if kind == "json_object" and not msg.json_object:
            raise ValueError("structured_output.json_object must be true")
        if kind == "choice":
            return build_grammar(kind, list(msg.choice.choices))
        return build_grammar(kind, None if kind == "json_object" else getattr(msg, kind))

    def _grammar_after(self, text: str) -> tuple[int, ...]:
        """structured_output.after as the tokenizer writes it alone (a special
        token such as Qwen3's "</think>" is one)."""
        if not text:
            return ()
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        if not 0 < len(ids) <= MAX_GRAMMAR_AFTER:
            raise ValueError(f"structured_output.after must be 1 to {MAX_GRAMMAR_AFTER} tokens, "
                             f"got {len(ids)} for {text[:40]!r}")
        return ids

    def _reasoning(self, msg: tandem_pb2.Reasoning) -> tuple[str, tuple[int, ...], str]:
        """reasoning's end (its text and token ids) and start."""
        self.need_tokenizer("reasoning")
        if not 0 < len(msg.end) <= MAX_REASONING_TAG:
            raise ValueError(f"reasoning.end must be 1 to {MAX_REASONING_TAG} characters, got {len(msg.end)}")
        if len(msg.start) > MAX_REASONING_TAG:
            raise ValueError(f"reasoning.start must be at most {MAX_REASONING_TAG} characters, got {len(msg.start)}")
        return msg.end, tuple(self.tokenizer.encode(msg.end, add_special_tokens=False)), msg.start

    def _bad_words(self, words) -> tuple[tuple[int, ...], ...]:
        """Each word's token sequences, as vLLM makes them (without special
        tokens): the word as it is, and after a space where that gives as many
        tokens with another first one (a tokenizer that marks word starts)."""
        if not words:
            return ()
        self.need_tokenizer("bad_words")
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"at most {MAX_BAD_WORDS} bad_words, got {len(words)}")
        sequences: list[tuple[int, ...]] = []
        for word in words:
            if not word.strip():
                raise ValueError("a bad word is empty")
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            for ids in (plain, spaced) if len(spaced) == len(plain) and spaced[:1] != plain[:1] else (plain,):
                if ids and ids not in sequences:
                    sequences.append(ids)
        return tuple(sequences)

    def _logit_bias(self, bias) -> tuple[tuple[int, float], ...]:
        if len(bias) > MAX_LOGIT_BIASES:
            raise ValueError(f"at most {MAX_LOGIT_BIASES} logit_bias entries, got {len(bias)}")
        self.check_ids(list(bias), "logit_bias token ids")
        return tuple(sorted(bias.items()))

    def check_ids(self, ids: list[int], what: str = "token ids") -> list[int]:
        vocab = self.target.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} outside [0, {vocab}): {bad[:5]}")
        return ids

    def messages(self, messages, own_template: str = "") -> list[dict]:
        """A conversation as the chat template takes it; ValueError with words
        where the template cannot render it. `own_template`: the request's
        own chat template (ChatMessages.chat_template), checked here."""
        self.need_tokenizer("a conversation")
        if own_template:
            if not self.trust_request_chat_template:
                raise ValueError("the request brings its own chat template, and this server runs only its own: "
                                 "start the orchestrator with --trust-request-chat-template to allow it")
            if len(own_template) > MAX_CHAT_TEMPLATE_CHARS:
                raise ValueError(f"the request's chat template is {len(own_template)} characters, over "
                                 f"{MAX_CHAT_TEMPLATE_CHARS}")
        elif not self.template.available:
            raise ValueError("the model has no chat template: send the prompt as text or token ids")
        if not messages:
            raise ValueError("the conversation has no messages")
        rendered = []
        for i, m in enumerate(messages):
            if not m.role:
                raise ValueError(f"message {i} has no role")
            message = {"role": m.role, "content": m.content}
            if m.tool_calls_json:
                message["tool_calls"] = template_calls(i, m.tool_calls_json)
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            if m.name:
                message["name"] = m.name
            rendered.append(message)
        return rendered

    def need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, and the model has none: send token ids")


def _json_field(text: str, field: str, kind: type, what: str):
    """A field of JSON text: its value, which must be a `kind` (`what` says
    so where it is not); None where the field is empty."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{field} is not valid JSON: {err}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{field} must be {what}")
    return value


def read_tools(text: str) -> list[dict] | None:
    """ChatMessages.tools_json, checked: OpenAI's function tools."""
    tools = _json_field(text, "tools_json", list, "a JSON list of tools")
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(function, dict) or tool.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise ValueError(f"tool {i} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    return tools or None


# apply_chat_template's own parameters, and what it gives the template itself: not a template variable.
_RESERVED = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                       "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                       "tokenizer_kwargs"})


def template_variables(text: str) -> dict | None:
    """ChatMessages.chat_template_kwargs_json, checked: a JSON object of
    variables for the chat template, none of apply_chat_template's own
    parameters."""
    variables = _json_field(text, "chat_template_kwargs_json", dict, "a JSON object of the template's variables")
    if variables is None:
        return None
    taken = sorted(_RESERVED & set(variables))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do")
    if not all(name.isidentifier() for name in variables):
        raise ValueError("chat_template_kwargs' names must be template variable names")
    return variables or None


def template_calls(index: int, text: str) -> list[dict]:
    """An assistant message's tool_calls_json, for the chat template: each
    call's arguments as an object where they are a JSON object's text (the
    templates write them out themselves), as vLLM gives them."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"message {index}: tool_calls_json is not valid JSON: {err}") from None
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise ValueError(f"message {index}: tool_calls_json must be a JSON list of calls")
    out = []
    for call in calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # the template gets the text as sent
        out.append({**call, "function": function})
    return out
