"""Structured output's grammars, without torch (the orchestrator builds and
checks them; the services compile them: tandem/grammar.py).

A request's format (a JSON schema, any JSON object, a regular expression, a
list of choices, a Lark grammar) becomes one llguidance grammar text, which
travels in SamplingParams.grammar to both services."""
from __future__ import annotations

import json

import llguidance

MAX_GRAMMAR_CHARS = 1 << 20  # a grammar's text, as sent; larger ones are refused
MAX_CHOICES = 1024
FORMATS = ("json_schema", "json_object", "regex", "choice", "lark")


def build_grammar(kind: str, spec: object = None) -> str:
    """The llguidance grammar of a format: kind is one of FORMATS; spec the
    JSON schema (its text or a dict), the regex, the choices (a list of
    strings) or the Lark text (json_object takes none). ValueError, with the
    compiler's words, where it is not a valid one."""
    if kind == "json_schema":
        schema = spec
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ValueError(f"json_schema is not valid JSON: {err}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("json_schema must be a JSON object (a schema)")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema if isinstance(schema, dict) else {})
        if schema is False:
            raise ValueError("json_schema false accepts nothing")
    elif kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    elif kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise ValueError("regex must be a non-empty string")
        grammar = llguidance.LLMatcher.grammar_from_regex(spec)
    elif kind == "choice":
        choices = list(spec or ())
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} choices, got {len(choices)}")
        # Lark string literals take JSON's escapes.
        grammar = llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    elif kind == "lark":
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError("lark must be a non-empty grammar")
        grammar = llguidance.LLMatcher.grammar_from_lark(spec)
    else:
        raise ValueError(f"unknown structured output format {kind!r}: one of {', '.join(FORMATS)}")
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the {kind} grammar is {len(grammar)} characters, over {MAX_GRAMMAR_CHARS}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {kind}: {error.strip()}")
    return grammar
