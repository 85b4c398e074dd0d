"""Conversions between sampling parameters and the wire messages of tandem.v1
(without torch: the orchestrator uses them; distributions are in
tandem/distributions.py)."""
from __future__ import annotations

from tandem.sampling import SamplingParams
from tandem.v1 import common_pb2

# What the model calls' messages mean (ModelInfo.wire_version): raised when a
# field's meaning changes in a way an older reader would misread rather than
# ignore. 1: the first, whose draft distributions' sparse form was repeated
# numbers (Distribution fields 2 and 3); its services report none, which reads
# as 0. 2: that form as packed bytes (fields 5 and 6). 3: the rows of a
# block over the same ids send them once, in the enclosing message
# (Distribution.shared_ids).
WIRE_VERSION = 3


def sampling_from_proto(msg: common_pb2.SamplingParams, masks=None) -> SamplingParams:
    """Raises ValueError on out-of-range values. masks: the service's
    tandem.grammar.GrammarMasks, which a request with a grammar needs (it is
    compiled here: ValueError if it does not compile, GrammarUnavailable
    without a tokenizer)."""
    if msg.grammar:
        if masks is None:
            raise ValueError("structured output is not served here")
        masks.check(msg.grammar)
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p != 0 else 1.0,
        top_k=msg.top_k,
        seed=msg.seed,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        suppress_ids=tuple(msg.suppress_tokens),
        suppress_before=msg.suppress_before,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        penalty_start=msg.penalty_start,
        repetition_penalty=msg.repetition_penalty or 1.0,
        min_p=msg.min_p,
        grammar=msg.grammar,
        grammar_start=msg.grammar_start,
        grammar_end_ids=tuple(msg.grammar_end_ids),
        grammar_after=tuple(msg.grammar_after),
        masks=masks if msg.grammar else None,
        allowed_ids=tuple(msg.allowed_tokens),
        bad_words=tuple(tuple(word.ids) for word in msg.bad_words),
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed,
        logit_bias=dict(params.logit_bias), suppress_tokens=params.suppress_ids,
        suppress_before=params.suppress_before, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, penalty_start=params.penalty_start,
        repetition_penalty=params.repetition_penalty, min_p=params.min_p,
        grammar=params.grammar, grammar_start=params.grammar_start, grammar_end_ids=params.grammar_end_ids,
        grammar_after=params.grammar_after,
        allowed_tokens=params.allowed_ids, bad_words=[common_pb2.TokenSequence(ids=word) for word in params.bad_words],
    )


def stop_reason(final) -> str | int | None:
    """A Completion's stop reason, as vLLM's stop_reason: the stop string or
    stop token that ended it, None where something else did."""
    which = final.WhichOneof("stop_reason")
    return getattr(final, which) if which else None
