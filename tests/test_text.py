"""Stop strings in the stream: what the client sees never holds the beginning
of a stop string, across rounds; scripted services, real Redis."""
import asyncio

import pytest

from orchestrator.backends import DraftBlock, VerifyResult
from orchestrator.generation import EngineConfig, Generation, TurnOutcome, _short_of_stop
from orchestrator.request_params import RequestParams
from orchestrator.store import SessionStore
from orchestrator.text import cut_at_stop, first_stop
from tandem.sampling import SamplingParams
from tandem.v1 import tandem_pb2
from tests.conftest import REDIS_URL

ALPHABET = " abcdefghijklmnopqrstuvwxyzEND<>"


class CharTokenizer:
    """One character a token."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(ALPHABET[i] for i in ids)


class ScriptedProposer:
    async def propose(self, *args, **kwargs):
        return DraftBlock(tokens=[])


class ScriptedVerifier:
    """Commits the script's next character, one a round."""

    def __init__(self, script: str):
        self.ids = [ALPHABET.index(c) for c in script]

    async def verify(self, session_id, prefix, new_tokens, block, sampling):
        return VerifyResult(accepted=0, next_token=self.ids[prefix.length + len(new_tokens) - 1])


def _stream(script: str, stop: tuple[str, ...], max_tokens: int = 20, include_stop: bool = False):
    async def run():
        store = SessionStore(REDIS_URL)
        generation = Generation(ScriptedProposer(), ScriptedVerifier(script), store, CharTokenizer(), set(),
                                EngineConfig(pipeline=False))
        record = await store.create("t-stop")
        deltas, outcome, final = [], TurnOutcome(), None
        try:
            params = RequestParams(SamplingParams(), max_tokens=max_tokens, stop=stop, include_stop=include_stop)
            async for event in generation.run(record, [0], params, outcome):
                if event.HasField("delta"):
                    deltas.append(event.delta.text)
                else:
                    final = event.final
        finally:
            await store.delete("t-stop", record.session_id)
            await store.close()
        return deltas, outcome, final

    return asyncio.run(run())


def test_a_stop_string_split_across_rounds_is_never_streamed():
    deltas, outcome, final = _stream("hello ENDworld", stop=("END",))
    assert "".join(deltas) == outcome.text == "hello "
    assert all("E" not in delta for delta in deltas)
    assert final.usage.completion_tokens == 9  # "hello END": the stop's tokens are committed


def test_text_held_back_for_a_stop_that_does_not_come_is_sent_with_the_next_round():
    deltas, outcome, final = _stream("a <b <END", stop=("<END>",), max_tokens=9)
    assert "".join(deltas) == outcome.text == "a <b <END"  # finished by length: all of it
    # "<" is held back until "b" shows it starts no stop; "<EN" until the length ends the request
    assert deltas == ["a", " ", "", "<b", " ", "", "", "", "<END"]


@pytest.mark.parametrize("text, stops, expected", [
    ("hello EN", ("END",), "hello "),
    ("hello E", ("END", "Ex"), "hello "),
    ("hello", ("END",), "hello"),
    ("ab", ("abc", "b"), ""),  # "ab" could still become "abc"
    ("xEND", ("END",), "xEND"),  # a whole stop is the caller's to cut
    ("text", (), "text"),
])
def test_short_of_stop(text, stops, expected):
    assert _short_of_stop(text, stops) == expected


def test_include_stop_str_in_output_ends_the_text_with_the_stop_and_holds_nothing_back():
    deltas, outcome, final = _stream("hello ENDworld", stop=("END",), include_stop=True)
    assert "".join(deltas) == outcome.text == "hello END"
    assert deltas == list("hello END")  # one a round: "E" and "EN" are not held back
    assert final.usage.completion_tokens == 9 and final.finish_reason == tandem_pb2.FINISH_REASON_STOP
    deltas, outcome, _ = _stream("a <b <END", stop=("<END>",), max_tokens=9, include_stop=True)
    assert deltas == list("a <b <END") and outcome.text == "a <b <END"


@pytest.mark.parametrize("text, stops, include, expected", [
    ("say END now", ("END",), False, "say "),
    ("say END now", ("END",), True, "say END"),
    ("x ab abc", ("abc", "ab"), True, "x ab"),  # the first to begin
    ("xabcd", ("abcd", "abc"), True, "xabc"),  # of two that begin there, the shorter
    ("no stop", ("END",), True, "no stop"),
])
def test_cut_at_stop(text, stops, include, expected):
    assert cut_at_stop(text, stops, include) == expected


@pytest.mark.parametrize("text,stops,expected", [
    ("abc END def", ["END"], (4, "END")),
    ("abc END def", ["def", "END"], (4, "END")),  # the first to begin, whatever the list's order
    ("abc END def", ["END", "EN"], (4, "EN")),  # of two that begin there, the shorter: it ended first
    ("abc END def", ["", "xyz"], None),
])
def test_first_stop_is_the_one_the_text_is_cut_at(text, stops, expected):
    assert first_stop(text, stops) == expected
    if expected is not None:
        at, stop = expected
        assert cut_at_stop(text, stops) == text[:at] and cut_at_stop(text, stops, True) == text[:at + len(stop)]
