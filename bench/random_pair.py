"""A model with another model's architecture and random weights, for timing
where the real weights cannot go (a GPU machine with no network and a small
upload): the config and tokenizer files of a local model directory, weights
drawn by the model's own initializer with a fixed seed.

A forward costs what the real model's costs, for the same shapes and dtype. The
outputs are meaningless: two random models agree on almost no token, so a
speculative run on a random pair measures costs and overheads, never acceptance.

    python -m bench.random_pair --like ~/.cache/tandem/models/qwen2.5-coder-0.5b-instruct --out /tmp/draft
    python -m bench.random_pair --like CONFIG_DIR --out DIR --device cuda   # initialize on the GPU (fast)
"""
from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger("bench.random_pair")

# Files a model directory may hold besides the weights and config; copied when present.
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def build(like: Path, out: Path, seed: int = 0, dtype: str = "bfloat16", device: str = "cpu") -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (like / "config.json").is_file():
        raise FileNotFoundError(f"{like}: no config.json")
    config = AutoConfig.from_pretrained(like)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in COPIED:
        if (like / name).is_file():
            shutil.copy(like / name, out / name)
    log.info("%s: %s with random weights (%.0fM parameters, %s)", out, config.model_type,
             sum(p.numel() for p in model.parameters()) / 1e6, dtype)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.random_pair", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", type=Path, required=True, help="a model directory: its config and tokenizer files")
    parser.add_argument("--out", type=Path, required=True, help="where to save the random-weight model")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the initializer (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="(default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="where to initialize: cpu or cuda[:N] (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        build(args.like, args.out, args.seed, args.dtype, args.device)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
