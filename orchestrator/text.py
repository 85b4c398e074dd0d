"""Text handling, the only place where text becomes token ids and back:
incremental detokenization, stop strings and chat-template turns."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class Detokenizer:
    """Turns a growing list of completion token ids into text deltas. Each step
    decodes only a short window (as vLLM does), holding back an incomplete
    multi-byte character until the next token completes it."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens  # special tokens are left out of the text
        self.ids: list[int] = []
        self.text = ""  # text emitted so far
        self._prefix = 0  # window start: ids before it are settled text
        self._read = 0  # ids before it have been emitted

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, decoded as the completion's text is."""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def full_text(self) -> str:
        return self.decode(self.ids) if self.tokenizer else ""

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        if self.tokenizer is None:
            return ""
        before = self.decode(self.ids[self._prefix:self._read])
        window = self.decode(self.ids[self._prefix:])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        delta = window[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


def reasoning_tokens(ids: list[int], decode, end: str, start: str = "") -> int:
    """How many of a completion's tokens are its reasoning, read as the HTTP
    API's reasoning parsers read its text: up to the token in which `end`
    first ends, or all of them where it never comes; none where `start` is set
    and the text, past leading whitespace, does not begin with it. `decode`
    gives the text of a list of ids (as the completion's text is decoded).
    A search by halves: O(log n) decodes."""
    if not ids or not end:
        return 0
    text = decode(ids)
    head = len(text) - len(text.lstrip())
    if start and not text.startswith(start, head):
        return 0
    after = head + len(start) if start else 0  # where the end is looked for
    if text.find(end, after) < 0:
        return len(ids)
    low, high = 1, len(ids)  # decode(ids[:high]) holds end; decode(ids[:low - 1]) does not
    while low < high:
        mid = (low + high) // 2
        if decode(ids[:mid]).find(end, after) >= 0:
            high = mid
        else:
            low = mid + 1
    return low


def find_stop(text: str, stops: list[str], search_from: int = 0) -> int:
    """Index in text where the earliest stop string starts, or -1."""
    hits = [i for i in (text.find(s, max(0, search_from - len(s))) for s in stops if s) if i >= 0]
    return min(hits) if hits else -1


def first_stop(text: str, stops) -> tuple[int, str] | None:
    """Where the earliest stop string in text begins, and which one (of two
    that begin there, the shorter: it ended first), or None."""
    at = find_stop(text, list(stops))
    if at < 0:
        return None
    return at, min((s for s in stops if s and text.startswith(s, at)), key=len)


def cut_at_stop(text: str, stops, include: bool = False) -> str:
    """text up to the earliest stop string (include: through its end; of two
    that begin there, the shorter), or all of it if none is in it."""
    hit = first_stop(text, stops)
    if hit is None:
        return text
    at, stop = hit
    return text[:at + len(stop)] if include else text[:at]


class ChatTemplate:
    """Renders turns with the model's chat template, so that a new turn becomes
    only the tokens that follow the committed ones."""

    SENTINEL = "\u2063TANDEM\u2063"

    def __init__(self, tokenizer, end_ids=()):
        self.tokenizer = tokenizer
        self.end_ids = set(end_ids)  # the tokens that end a reply (the model's EOS ids)

    @property
    def available(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
                continue_final_message: bool = False, variables: dict | None = None,
                template: str | None = None) -> str:
        """The template's text; ValueError with the template's words where it
        refuses the messages (roles out of order, say). `tools`: OpenAI's
        function tools, which the template shows the model.
        `continue_final_message`: the text ends with the last message's
        content (no generation prompt); `variables`: more for the template;
        `template`: a request's own template, in place of the tokenizer's."""
        from jinja2 import TemplateError, TemplateSyntaxError

        whose = "the request's" if template else "the model's"
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
                tools=tools, continue_final_message=continue_final_message, chat_template=template or None,
                **(variables or {}))
        except TemplateSyntaxError as err:
            raise _not_jinja(whose, err) from err
        except TemplateError as err:
            raise ValueError(f"{whose} chat template refused the messages: {err}") from err
        except ValueError as err:  # continue_final_message: the last message's content is not in the text
            raise ValueError(f"the chat template cannot continue the last message: {err}") from err
        except Exception as err:  # noqa: BLE001 (a request's template is the client's code: its fault, its error)
            if not template:
                raise
            raise ValueError(f"the request's chat template failed: {type(err).__name__}: {err}") from err

    def encode(self, text: str) -> list[int]:
        """A rendered text's token ids: the template wrote its special tokens itself."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def first_turn_text(self, messages: list[dict], tools: list[dict] | None = None,
                        continue_final_message: bool = False, variables: dict | None = None,
                        template: str | None = None) -> str:
        """A conversation as its first turn's prompt: with the assistant's
        prompt, or up to the end of its last message, which the reply continues."""
        return self._render(messages, True, tools, continue_final_message, variables, template)

    def first_turn(self, messages: list[dict], tools: list[dict] | None = None,
                   continue_final_message: bool = False, variables: dict | None = None,
                   template: str | None = None) -> list[int]:
        return self.encode(self.first_turn_text(messages, tools, continue_final_message, variables, template))

    def next_turn(self, history: list[dict], user: dict, ended_with: list[int]) -> list[int]:
        """Tokens after the committed ones for a new user turn. `history` ends with
        the assistant reply, whose generated ids end with `ended_with`."""
        before = self._render(history, add_generation_prompt=False)
        after = self._render([*history, user], add_generation_prompt=True)
        if not after.startswith(before):
            log.warning("chat template does not extend the previous turn; re-encoding the new turn")
        delta = after[len(before):] if after.startswith(before) else after
        # What the template puts after an assistant reply (e.g. "<|im_end|>\n"),
        # less what generation already produced (the end-of-turn token).
        probe = self._render([*history[:-1], {"role": "assistant", "content": self.SENTINEL}], False)
        closing = probe[probe.rfind(self.SENTINEL) + len(self.SENTINEL):]
        # Only a reply that ended with its end-of-turn token produced part of the
        # closing; one cut by max_tokens or a stop string did not, whatever its text.
        if ended_with and ended_with[-1] in self.end_ids:
            produced = self.tokenizer.decode(ended_with[-1:])
            if produced and closing.startswith(produced):
                closing = closing[len(produced):]
        return self.encode(closing + delta)


MAX_CHAT_TEMPLATE_CHARS = 65536  # a request's own template (ChatMessages.chat_template)


def chat_template_text(value: str) -> str:
    """The orchestrator's --chat-template: the text of the file it names, or,
    where it holds Jinja's delimiters and names no file, the template itself
    (as vLLM reads the flag). ValueError where it names no file and is no
    template, or the file cannot be read."""
    import os

    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--chat-template {value!r}: the file cannot be read: {err}") from err
    if any(mark in value for mark in ("{{", "{%", "{#")):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template (a template holds "
                     "'{{' or '{%')")


def check_chat_template(tokenizer, template: str) -> None:
    """ValueError where `template` is not valid Jinja, found by rendering one
    user message with it; a template that refuses that message (one that wants
    a system message first, say) passes: a request's messages may suit it."""
    from jinja2 import TemplateSyntaxError

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=True, chat_template=template)
    except TemplateSyntaxError as err:
        raise _not_jinja("the", err) from err
    except Exception:  # noqa: BLE001 (it compiled; what it does with this one message is not the check's)
        pass


def _not_jinja(whose: str, err) -> ValueError:
    return ValueError(f"{whose} chat template is not a valid Jinja template: {err} (line {err.lineno})")
