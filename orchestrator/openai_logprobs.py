"""Log probabilities as OpenAI's and vLLM's answers carry them: a chat
completion's, a completion's, and a prompt's (vLLM's prompt_logprobs)."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.v1 import tandem_pb2

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


def echoed_prompt_logprobs(prompt: tandem_pb2.PromptEcho) -> list:
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
