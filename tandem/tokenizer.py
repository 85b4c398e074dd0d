"""A model's tokenizer and the fingerprint that tells whether two models share
one. Both model services and the orchestrator use it; it imports no torch, so
that the orchestrator, which runs no model, can load its tokenizer without
torch (tandem.cli keeps torch out of the orchestrator's process)."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from transformers import AutoTokenizer

log = logging.getLogger(__name__)


def load_tokenizer(path: str):
    """The model's tokenizer, or None for a model saved without one."""
    local = Path(path)
    if local.is_dir() and not any(local.glob("tokenizer*")) and not any(local.glob("vocab*")):
        log.info("no tokenizer files in %s: token ids only", path)
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        log.info("no tokenizer at %s (%s): token ids only", path, err.__class__.__name__)
        return None
    return tokenizer if len(tokenizer) > 1 else None


def tokenizer_fingerprint(tokenizer, vocab_size: int) -> str:
    """Equal for two models whose token ids mean the same text."""
    if tokenizer is None:
        identity = {"vocab_size": vocab_size}
    else:
        identity = {
            "vocab": sorted(tokenizer.get_vocab().items()),
            "special": sorted(map(str, tokenizer.all_special_tokens)),
        }
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()
