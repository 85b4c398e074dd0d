"""Fill in the middle: a code model writes what goes between a prefix and a
suffix (OpenAI's completions `suffix`, an editor's completion at the cursor).
The prompt is the prefix and the suffix between the model's own sentinel
tokens, in the prefix-suffix-middle order every format below was trained on;
the completion is the middle. The format is read from the tokenizer's
vocabulary: a model whose vocabulary holds none of them cannot fill in."""
from __future__ import annotations

# name -> (prefix, suffix, middle) sentinels, each one token of the vocabulary.
FORMATS = {
    "qwen": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    "starcoder": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
    "santacoder": ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    "deepseek": ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),
}


# Tokens that end a middle where a vocabulary has them: the end of a text (Qwen2.5-Coder
# writes <|endoftext|> after the middle, which its instruct models' end of sequence is
# not), a next file or repository, padding, and any format's sentinel.
ENDS = ("<|endoftext|>", "<|file_sep|>", "<|repo_name|>", "<|fim_pad|>", "<file_sep>", "<reponame>", "<filename>",
        "<fim_pad>", "<|end_of_text|>", *(s for sentinels in FORMATS.values() for s in sentinels))


def detect(tokenizer) -> str | None:
    """The format whose three sentinels are tokens of the tokenizer's vocabulary, or None."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    return next((name for name, sentinels in FORMATS.items() if all(s in vocab for s in sentinels)), None)


def end_ids(tokenizer) -> frozenset[int]:
    """The token ids that end a filled-in middle (ENDS, where the vocabulary has them)."""
    vocab = tokenizer.get_vocab()
    return frozenset(vocab[token] for token in ENDS if token in vocab)


def prompt(fmt: str, prefix: str, suffix: str) -> str:
    """The prompt text whose completion is the middle."""
    before, after, middle = FORMATS[fmt]
    return f"{before}{prefix}{after}{suffix}{middle}"
