"""A request's settings as the generation loop takes them (RequestParams,
checked on construction), and what they do to its prompt: the tokens
truncate_prompt_tokens keeps, and whether the prompt already closed the
reasoning a grammar waits for."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.logprobs import MAX_TOP_LOGPROBS
from tandem.sampling import SamplingParams

MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class RequestParams:
    """Per-request settings, checked on construction (ValueError → INVALID_ARGUMENT)."""

    sampling: SamplingParams
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    k: int = 0  # 0 = the server's policy
    pipeline: bool | None = None  # None = the server's setting
    seeded: bool = False  # the client chose the seed: the run must be reproducible
    logprobs: int | None = None  # None: none; n: each token's log probability and the n most likely tokens'
    ignore_eos: bool = False  # the model's end-of-sequence tokens do not end the request
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end it as a stop string does
    echo: bool = False  # the first delta carries the prompt
    prompt_logprobs: int | None = None  # and with it its tokens' log probabilities and the n likeliest
    priority: int = 0  # its calls' place in the model services' queues, the lowest first
    min_tokens: int = 0  # no end-of-sequence token (nor stop token id) among the first min_tokens
    grammar: str = ""  # structured output: the completion follows this llguidance grammar (tandem.structured)
    grammar_after: tuple[int, ...] = ()  # the grammar waits for these tokens (a reasoning's end: closed_in_prompt)
    include_stop: bool = False  # the text keeps the stop string that ended it (include_stop_str_in_output)
    # The completion's reasoning, counted in Usage.reasoning_tokens: its end's
    # text and token ids (closed_in_prompt), and the text that opens it where
    # the model opens it itself ("": it begins inside it).
    reasoning_end: str = ""
    reasoning_end_ids: tuple[int, ...] = ()
    reasoning_start: str = ""
    # Generate: keep the prompt's last n tokens; -1: as many as fit beside max_tokens (truncated)
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True  # special tokens are left out of the text

    def __post_init__(self):
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.k < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens == -1
                                                            or self.truncate_prompt_tokens >= 1):
            raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {self.truncate_prompt_tokens}")
        if self.grammar and self.ignore_eos:
            raise ValueError("structured output cannot be combined with ignore_eos: the end-of-sequence "
                             "token is what ends a complete output")
        if self.grammar and self.min_tokens:
            raise ValueError("structured output cannot be combined with min_tokens: an output complete "
                             "before min_tokens could not end")


def truncated(prompt: list[int], params: RequestParams, context: int) -> list[int]:
    """The prompt's last tokens that truncate_prompt_tokens keeps: n of them,
    or with -1 as many as fit in the context window beside max_tokens."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return prompt
    if keep == -1:
        keep = context - params.max_tokens
        if keep < 1:
            raise ValueError(f"max_tokens {params.max_tokens} leaves no room for a prompt in the context window "
                             f"of {context}")
    return prompt[-keep:]


def closed_in_prompt(prompt: list[int], after: tuple[int, ...], tokenizer, most_spaces: int = 8) -> bool:
    """Whether the prompt's text ends with `after`'s and then whitespace alone
    (in its last len(after) + `most_spaces` tokens): a chat template that
    closes the reasoning itself (Qwen3's with thinking off), so a grammar that
    waits for the reasoning's end applies from the first token, and the
    completion has no reasoning. By text, not
    by tokens: a template's text may merge the tag's last characters with what
    follows ("</think>\n" as "</", "think", ">\n")."""
    if not after:
        return False
    tail = tokenizer.decode(prompt[-(len(after) + most_spaces):])
    return tail.rstrip().endswith(tokenizer.decode(list(after)))
