"""Where a grammar that waits for a text begins (tandem.grammar_after): kept
searches, extended and cut back as a session's calls come, answer what a
search from scratch answers, the fewest tokens whose text holds the text."""
import random

from tandem.grammar_after import AfterText

PIECES = [b"", b"<", b"/", b"</", b"think", b">", b">\n", b"t", b"hink", b"a", b"ab", b" ", b"</think>", b"x<"]


def decode(ids: list[int]) -> bytes:
    return b"".join(PIECES[i] for i in ids)


def from_scratch(after: list[int], start: int, tokens: list[int], before: int) -> int | None:
    wanted = decode(after)
    span = tokens[start:before]
    for n in range(1, len(span) + 1):
        if wanted in decode(span[:n]):
            return start + n
    return None


def test_kept_searches_answer_as_a_search_from_scratch():
    rng = random.Random(5)
    afters = [[3, 4, 5], [12], [1, 2, 4, 6]]  # "</think>" in three writings, and "</think>\n"
    for trial in range(300):
        searches = AfterText(decode)
        sessions = [[rng.randrange(len(PIECES)) for _ in range(4)] for _ in range(3)]
        after = afters[trial % len(afters)]
        for _ in range(40):
            tokens = rng.choice(sessions)
            move = rng.random()
            if move < 0.6:  # a round commits a few tokens
                tokens += [rng.randrange(len(PIECES)) for _ in range(rng.randint(1, 4))]
            elif move < 0.8 and len(tokens) > 5:  # rejected drafts, cut back
                del tokens[rng.randint(4, len(tokens) - 1):]
            before = rng.randint(2, len(tokens))
            start = 2 if trial % 2 else 0
            assert searches.begins(after, start, tokens, before) == from_scratch(after, start, tokens, before), (
                trial, tokens, before)


def test_the_text_may_span_tokens_and_end_inside_one():
    searches = AfterText(decode)
    # "</" "think" ">\n": the text ends inside the last token; the grammar begins after it.
    assert searches.begins([12], 0, [9, 3, 4, 6, 9], 5) == 4
    # "x<" "/" "t" "hink" ">": it begins inside the first.
    assert searches.begins([12], 0, [13, 2, 7, 8, 5], 5) == 5
    assert searches.begins([12], 0, [13, 2, 7, 8], 4) is None
    assert searches.begins([], 3, [1, 2], 2) == 3
