"""Sampling parameters. Their processing of logits into probabilities is in
tandem/distributions.py; this module needs no torch, so that the orchestrator
runs without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


# Temperatures below this decode greedily, as in vLLM: dividing float32 logits
# by a much smaller one overflows, and the softmax of the result is NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


MAX_LOGIT_BIAS = 100.0  # OpenAI's range of a logit bias: [-100, 100]
MAX_LOGIT_BIASES = 300  # and how many a request may give
MAX_PENALTY = 2.0  # OpenAI's range of presence_penalty and frequency_penalty: [-2, 2]
MAX_ALLOWED_IDS = 4096  # allowed_ids a request may give (each call to both services carries them)
MAX_BAD_WORDS = 128  # bad word token sequences a request may give
MAX_BAD_WORD_TOKENS = 64  # and the tokens of each
MAX_GRAMMAR_AFTER = 16  # tokens of the text a grammar waits for (grammar_after)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below GREEDY_BELOW_TEMPERATURE) is greedy. top_p 1 and
    top_k 0 switch those filters off.

    logit_bias: (token id, bias) pairs added to the logits first, under greedy
    decoding too; suppress_ids: tokens that cannot come at an absolute position
    below suppress_before (a request's min_tokens keeps its end-of-sequence
    tokens out until then). Both define the distribution that draft and target
    apply alike (tandem.distributions.adjust_logits), so the output is exactly
    what the target alone gives with them.

    presence_penalty and frequency_penalty (OpenAI's): a token's logit is
    lowered by presence_penalty if it came among the tokens generated before
    the position (from absolute position penalty_start on: the request's
    completion, not its prompt), and by frequency_penalty times how often.
    repetition_penalty (vLLM's and Hugging Face's; 1 = off) divides a positive
    logit, and multiplies a negative one, of every token already in the
    sequence, prompt included. min_p (sampling only; 0 = off) drops the tokens
    less likely than min_p times the likeliest, after temperature.

    allowed_ids (vLLM's allowed_token_ids): only these tokens may come, the
    rest at -inf. bad_words (vLLM's, as token sequences): where the completion
    (from penalty_start on) ends with all but the last token of one, its last
    token is at -inf. A draft that scores none of the tokens a mask allows
    (a reduced head) ends its block there (masks_tokens).

    grammar (structured output; tandem/structured.py): an llguidance grammar
    that the tokens from absolute position grammar_start on must follow, with
    grammar_end_ids ending it once it is complete (tandem/grammar.py masks the
    rest at -inf). With grammar_after (a reasoning model's end of reasoning),
    the grammar waits for their text: it applies from the position after the
    token in which that text first ends, counting from grammar_start
    (tandem.grammar.GrammarMasks.begins); the positions before are free. On a model service, masks is its tandem.grammar.GrammarMasks
    (tandem.wire.sampling_from_proto binds it); it is not part of the value."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    suppress_ids: tuple[int, ...] = ()
    suppress_before: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_start: int = 0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    grammar: str = ""
    grammar_start: int = 0
    grammar_end_ids: tuple[int, ...] = ()
    grammar_after: tuple[int, ...] = ()
    allowed_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    masks: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
                raise ValueError(f"logit_bias: token {token}'s bias must be in [-100, 100], got {bias}")
        if any(token < 0 for token in self.suppress_ids):
            raise ValueError("suppress_ids must be token ids (>= 0)")
        if not 0 < self.repetition_penalty < float("inf"):  # NaN fails too
            raise ValueError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:  # NaN fails too
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if len(self.allowed_ids) > MAX_ALLOWED_IDS or any(token < 0 for token in self.allowed_ids):
            raise ValueError(f"allowed_token_ids: at most {MAX_ALLOWED_IDS} token ids (>= 0), got "
                             f"{len(self.allowed_ids)}")
        if len(self.grammar_after) > MAX_GRAMMAR_AFTER or any(token < 0 for token in self.grammar_after):
            raise ValueError(f"grammar_after: at most {MAX_GRAMMAR_AFTER} token ids (>= 0), got "
                             f"{list(self.grammar_after)[:MAX_GRAMMAR_AFTER + 1]}")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} token sequences, got {len(self.bad_words)}")
        for word in self.bad_words:
            if not 0 < len(word) <= MAX_BAD_WORD_TOKENS or any(token < 0 for token in word):
                raise ValueError(f"bad_words: each is 1 to {MAX_BAD_WORD_TOKENS} token ids (>= 0), got {list(word)[:8]}")

    @property
    def adjusts(self) -> bool:
        """Whether the logits are changed before they are used (a bias, a
        suppression, a penalty, a grammar)."""
        return (bool(self.logit_bias) or bool(self.suppress_ids and self.suppress_before)
                or self.penalizes or self.repetition_penalty != 1.0 or bool(self.grammar)
                or bool(self.allowed_ids) or bool(self.bad_words))

    @property
    def masks_tokens(self) -> bool:
        """Whether a mask may leave none of the tokens a narrower draft scores
        (a grammar, allowed_ids): the draft then ends its block."""
        return bool(self.grammar or self.allowed_ids)

    @property
    def penalizes(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE
