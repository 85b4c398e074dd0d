"""What structured output costs: one deployment of the pair, the same chat
requests sent with and without a format (a JSON schema, a regex, a list of
choices), greedy, alternating, side by side in one run; and, in this process,
the grammar masks' own cost on the target's tokenizer (tandem.grammar); and
the target alone under each format (Hugging Face's generate on one thread, as
the target service runs), against Tandem's constrained answers.

For each request: tokens/s, the draft's acceptance, and whether a constrained
answer is complete and valid (it parses and has the schema's keys; it matches
the regex; it is one of the choices). Constrained and free answers are
different texts, so their tokens/s compare what a user gets, not the same
tokens.

    python -m bench.structured_probe                # the default pair, 3 reps
    python -m bench.structured_probe --reps 1 --new-tokens 64

Writes bench/results/structured_probe.json."""
from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import time
from pathlib import Path

from bench.common import RESULTS, cut, machine, pair_deployment, pair_flags, pair_record, parse_args, write
import torch

from tandem.client import TandemClient

log = logging.getLogger("bench.structured_probe")

BOOK = {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                         "year": {"type": "integer"}, "summary": {"type": "string"}},
        "required": ["title", "author", "year", "summary"], "additionalProperties": False}
FRAMEWORK = {"type": "object", "properties": {"name": {"type": "string"}, "first_release": {"type": "integer"},
                                              "good_for": {"type": "string"}},
             "required": ["name", "first_release", "good_for"], "additionalProperties": False}
FRAMEWORKS = {"type": "object", "properties": {"frameworks": {"type": "array", "items": FRAMEWORK,
                                                              "minItems": 4, "maxItems": 4}},
              "required": ["frameworks"], "additionalProperties": False}
TASKS = {
    "book-json": ("Give me a JSON object describing the novel Moby-Dick: title, author, year and a "
                  "two-sentence summary.", "json_schema", BOOK),
    "frameworks-json": ("Name four Python web frameworks, as a JSON object with a 'frameworks' list: each "
                        "with its name, year of first release and what it is good for.", "json_schema", FRAMEWORKS),
    "date-regex": ("On what date did Apollo 11 land on the Moon? Answer as YYYY-MM-DD only.",
                   "regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    "typed-choice": ("Is Python statically typed or dynamically typed? Answer in one word.",
                     "choice", ["statically", "dynamically"]),
}


def _format(kind: str, spec) -> dict:
    if kind == "json_schema":
        return {"json_schema": json.dumps(spec)}
    if kind == "choice":
        return {"choice": {"choices": spec}}
    return {kind: spec}


def valid(kind: str, spec, text: str) -> bool:
    if kind == "json_schema":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        return isinstance(value, dict) and set(spec["required"]) <= set(value)
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    return text in spec


def _request(client: TandemClient, ids: list[int], new_tokens: int, structured: dict | None) -> dict:
    start = time.perf_counter()
    result = client.generate(prompt_ids=ids, max_tokens=new_tokens, temperature=0.0, structured_output=structured)
    wall = time.perf_counter() - start
    stats = result.stats
    return {"wall_s": wall, "tokens": len(result.token_ids), "text": result.text, "ids": result.token_ids,
            "first_token_s": stats.first_token_ms / 1e3, "generation_s": stats.total_ms / 1e3,
            "finish_reason": result.finish_reason, "drafted": stats.drafted_tokens,
            "accepted": stats.accepted_tokens, "rounds": stats.rounds}


def chat_ids(tokenizer) -> dict[str, list[int]]:
    """Each task's prompt as the chat template renders it."""
    return {name: tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                add_generation_prompt=True, return_dict=False)
            for name, (prompt, _, _) in TASKS.items()}


def run(address: str, prompts: dict[str, list[int]], new_tokens: int, reps: int) -> dict:
    runs: dict[str, list[dict]] = {"free": [], "constrained": []}
    with TandemClient(address, timeout_s=900) as client:
        for name, (_, kind, spec) in TASKS.items():  # warm-up: each grammar compiled once on both services
            _request(client, prompts[name], 4, _format(kind, spec))
        for rep in range(reps):
            for name, (_, kind, spec) in TASKS.items():
                order = ("free", "constrained") if rep % 2 == 0 else ("constrained", "free")
                for way in order:
                    row = _request(client, prompts[name], new_tokens,
                                   _format(kind, spec) if way == "constrained" else None)
                    row.update(task=name, rep=rep, valid=valid(kind, spec, row["text"].strip()))
                    runs[way].append(row)
                    log.info("%s %s: %d tokens in %.2f s, %d/%d accepted, valid %s: %r", name, way, row["tokens"],
                             row["wall_s"], row["accepted"], row["drafted"], row["valid"], row["text"][:60])
    summary = {}
    for way, rows in runs.items():
        drafted = sum(r["drafted"] for r in rows)
        summary[way] = {
            "tok_s": sum(r["tokens"] for r in rows) / sum(r["wall_s"] for r in rows),
            # after the first token: the decoding rounds, without the prompt's prefill
            "decode_tok_s": sum(r["tokens"] - 1 for r in rows) / sum(r["generation_s"] - r["first_token_s"]
                                                                     for r in rows),
            "acceptance_rate": sum(r["accepted"] for r in rows) / drafted if drafted else None,
            "tokens_per_round": sum(r["tokens"] for r in rows) / max(1, sum(r["rounds"] for r in rows)),
            "valid": sum(r["valid"] for r in rows), "complete": sum(r["finish_reason"] == "eos" for r in rows),
            "requests": len(rows),
        }
    return {"modes": summary, "runs": runs,
            "constrained_vs_free_tok_s": summary["constrained"]["tok_s"] / summary["free"]["tok_s"],
            "constrained_vs_free_decode_tok_s": summary["constrained"]["decode_tok_s"] / summary["free"]["decode_tok_s"]}


def target_alone(target: str, prompts: dict[str, list[int]], new_tokens: int) -> dict:
    """Hugging Face's generate on the target alone, on this process's one
    thread, in the dtype and kernels the target service runs (bench.hf_baselines.load_hf),
    each task under its format (tandem.grammar's masks as a logits processor)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from bench.hf_baselines import load_hf, resolve_dtype
    from tandem.default_models import resolve_model
    from tandem.grammar import GrammarMasks, apply_masks
    from tandem.structured import build_grammar
    from tandem.tokenizer import load_tokenizer

    path = resolve_model(target)
    model = load_hf(path, resolve_dtype("auto"))
    masks = GrammarMasks(load_tokenizer(path), model.config.vocab_size)
    ends = model.generation_config.eos_token_id
    ends = [ends] if isinstance(ends, int) else list(ends)

    class Masked(LogitsProcessor):
        def __init__(self, grammar: str, start: int):
            self.grammar, self.start = grammar, start

        def __call__(self, input_ids, scores):
            tokens = input_ids[0].tolist()
            scores = scores.float()
            apply_masks(scores, masks.mask_rows(self.grammar, ends, self.start, len(tokens), 1, tokens))
            return scores

    rows = []
    for name, (_, kind, spec) in TASKS.items():
        grammar = build_grammar(kind, spec)
        masks.check(grammar)
        ids = torch.tensor([prompts[name]])
        processors = LogitsProcessorList([Masked(grammar, ids.shape[1])])
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                           logits_processor=processors)  # warm-up
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, logits_processor=processors)
            wall = time.perf_counter() - start
        tokens = out[0, ids.shape[1]:].tolist()
        rows.append({"task": name, "wall_s": wall, "tokens": len(tokens), "ids": tokens})
        log.info("%s target alone: %d tokens in %.2f s", name, len(tokens), wall)
    return {"tok_s": sum(r["tokens"] for r in rows) / sum(r["wall_s"] for r in rows), "runs": rows}


def mask_costs(target: str, reps: int = 20) -> dict:
    """The masks of one row (a draft step) and of five (a verify of 4), along a
    valid JSON answer of BOOK, on the target's tokenizer: median ms per call."""
    from tandem.default_models import resolve_model
    from tandem.grammar import GrammarMasks
    from tandem.structured import build_grammar
    from tandem.tokenizer import load_tokenizer
    from transformers import AutoConfig

    path = resolve_model(target)
    tokenizer = load_tokenizer(path)
    masks = GrammarMasks(tokenizer, AutoConfig.from_pretrained(path).vocab_size)
    grammar = build_grammar("json_schema", BOOK)
    start = time.perf_counter()
    masks.check(grammar)
    first = time.perf_counter() - start
    answer = tokenizer.encode(json.dumps({"title": "Moby-Dick; or, The Whale", "author": "Herman Melville",
                                          "year": 1851}))
    ends = [tokenizer.eos_token_id]
    costs = {}
    for rows in (1, 5):
        times = []
        for _ in range(reps):
            for at in range(0, len(answer) - rows + 1):
                t = time.perf_counter()
                masks.mask_rows(grammar, ends, 0, at, rows, answer)
                times.append((time.perf_counter() - t) * 1e3)
        costs[f"rows_{rows}_ms_p50"] = statistics.median(times)
        costs[f"rows_{rows}_ms_p90"] = sorted(times)[int(0.9 * len(times))]
    return {"first_grammar_s": first, **costs, "answer_tokens": len(answer)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.structured_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_flags(parser)
    parser.add_argument("--new-tokens", type=int, default=160, help="most tokens per request (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="passes over the tasks (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS / "structured_probe.json", help="JSON output path")
    args = parse_args(parser, argv)
    torch.set_num_threads(1)
    costs = mask_costs(args.target)
    log.info("masks: %s", costs)
    deployment = pair_deployment(args, ["--prefix-cache", "0"])
    from tandem.default_models import resolve_model
    from tandem.tokenizer import load_tokenizer

    prompts = chat_ids(load_tokenizer(resolve_model(args.target)))
    with deployment:
        result = run(deployment.address, prompts, args.new_tokens, args.reps)
    alone = target_alone(args.target, prompts, args.new_tokens)  # the services are down: the cores are free
    first_pass = [r for r in result["runs"]["constrained"] if r["rep"] == 0]
    tandem_tok_s = sum(r["tokens"] for r in first_pass) / sum(r["wall_s"] for r in first_pass)
    result.update(target_alone_constrained=alone, constrained_vs_target_alone_tok_s=tandem_tok_s / alone["tok_s"],
                  identical_to_target_alone=sum(r["ids"] == a["ids"] for r, a in zip(first_pass, alone["runs"])))
    result.update(masks=costs, **pair_record(args),
                  new_tokens=args.new_tokens, machine=machine())
    write(args.out, result)
    print(f"{'mode':<12} {'tok/s':>7} {'decode':>7} {'alpha':>6} {'tok/round':>9} {'valid':>6} {'eos':>5}")
    for way, row in result["modes"].items():
        print(f"{way:<12} {row['tok_s']:7.2f} {row['decode_tok_s']:7.2f} {row['acceptance_rate'] or 0:6.3f} "
              f"{row['tokens_per_round']:9.2f} {row['valid']:>3}/{row['requests']} {row['complete']:>2}/{row['requests']}")
    print(f"constrained, Tandem's first pass over the target alone (one core), tok/s: "
          f"{cut(result['constrained_vs_target_alone_tok_s']):.2f}x (cut); identical "
          f"{result['identical_to_target_alone']}/{len(TASKS)}")
    print(f"constrained over free, tok/s: {cut(result['constrained_vs_free_tok_s']):.2f}x, after the first token "
          f"{cut(result['constrained_vs_free_decode_tok_s']):.2f}x (cut); masks: "
          f"1 row {costs['rows_1_ms_p50']:.3f} ms, 5 rows {costs['rows_5_ms_p50']:.3f} ms (p50), "
          f"first grammar {costs['first_grammar_s']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
