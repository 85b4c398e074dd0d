"""What prefix reuse (--prefix-cache) saves a stateless multi-turn chat: two
orchestrators in front of the same two model services, one with the prefix
cache on (the default) and one with it off, each sent the same conversations
through the OpenAI-compatible HTTP API, which resends the whole conversation
every turn, each chat after the same system prompt. Side by side in one run,
alternating which goes first.

For each turn it records the client's time to the first streamed token and to
the last, the prompt's tokens and how many of them were reused, and the
tokens each service prefilled. Greedy, so both sides must give the same
replies.

    python -m bench.prefix_probe                  # the default pair, 3 chats x 4 turns x 64 tokens
    python -m bench.prefix_probe --turns 6 --new-tokens 96

With --choices N it sends instead, for each chat, one request of N greedy
choices of its first turn, after a system prompt of its own: the
prompt is in no parked session, so the side with the cache copies it from
the first choice while that one runs (PrefixCache.share), where the other
prefills it N times. It records the time to the first choice's first token
and to the last choice's, and the tokens the target prefilled over all
choices.

Writes bench/results/prefix_probe.json."""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import urllib.request
from pathlib import Path

from bench.common import RESULTS, cut, machine, model_flags, pair_flags, pair_record, parse_args, write
from tandem.launch import Deployment, Service, free_port

log = logging.getLogger("bench.prefix_probe")
SIDES = ("cache_on", "cache_off")
# What a chat backend puts before every conversation: the same for all, so a
# chat's first turn can start from a copy of another chat's caches of it.
SYSTEM = (
    "You are the coding assistant of a software company. Answer in English, briefly and precisely. "
    "When you write code, use Python 3.11 unless the user asks for another language, follow PEP 8, "
    "add type hints, and keep functions short. Prefer the standard library to third-party packages. "
    "Explain what the code does in one or two sentences after it, not before. If a question is "
    "ambiguous, state the assumption you make and answer it. Never invent APIs: if you are not sure "
    "that a function exists, say so. Do not repeat the question. Do not apologize. When the user asks "
    "for a change, show only the parts of the code that change, with enough context to find them."
)
CHATS = {
    "stack": ["Write a Python class for a stack with push, pop and peek.",
              "Add a method that returns the size.", "Now make pop raise a clear error when empty.",
              "Write two unit tests for it.", "Add type hints.", "Summarize the class in one sentence."],
    "csv": ["How do I read a CSV file in Python?", "And write one back with a new column?",
            "What if the file is large?", "Show it with pandas instead.", "How do I skip the header?",
            "Which is faster?"],
    "sql": ["Write a SQL query for the ten largest orders.", "Join it with the customers table.",
            "Only orders from 2024.", "Group them by country.", "Add the average order size.",
            "Explain the query briefly."],
}


def _chunks(base: str, body: dict, timeout_s: float):
    """A streamed chat completion's chunks, as they come."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        for line in reply:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                yield chunk


def _turn(base: str, messages: list[dict], new_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": new_tokens, "temperature": 0}
    start, first, ids, text, stats, usage = time.perf_counter(), None, [], "", {}, {}
    for chunk in _chunks(base, body, 900):
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            if choice.get("token_ids") and first is None:
                first = time.perf_counter() - start
            ids += choice.get("token_ids", [])
            text += choice.get("delta", {}).get("content") or ""
            stats = chunk.get("tandem", stats)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "first_token_s": first, "ids": ids, "text": text,
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "target_prefill_tokens": stats.get("target_prefill_tokens", 0),
            "draft_prefill_tokens": stats.get("draft_prefill_tokens", 0),
            "cache_misses": stats.get("cache_misses", 0)}


def _choices(base: str, messages: list[dict], new_tokens: int, n: int) -> dict:
    body = {"messages": messages, "max_tokens": new_tokens, "temperature": 0, "n": n}
    start, firsts, ids, stats, usage = time.perf_counter(), {}, {i: [] for i in range(n)}, {}, {}
    for chunk in _chunks(base, body, 1800):
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            if choice.get("token_ids"):
                firsts.setdefault(choice["index"], time.perf_counter() - start)
                ids[choice["index"]] += choice["token_ids"]
            if "tandem" in chunk and choice.get("finish_reason"):
                stats[choice["index"]] = chunk["tandem"]
    return {"wall_s": time.perf_counter() - start, "first_token_s": min(firsts.values()),
            "last_first_token_s": max(firsts.values()), "ids": [ids[i] for i in range(n)],
            "prompt_tokens": usage["prompt_tokens"],
            "target_prefill_tokens": sum(s.get("target_prefill_tokens", 0) for s in stats.values()),
            "draft_prefill_tokens": sum(s.get("draft_prefill_tokens", 0) for s in stats.values())}


def run_choices(bases: dict[str, str], chats: dict[str, list[str]], n: int, new_tokens: int,
                system: str = "") -> dict:
    rows = {side: [] for side in SIDES}
    for side in SIDES:  # warm-up: a request each, of a prompt of its own
        _choices(bases[side], [{"role": "user", "content": f"Say hello ({side})."}], 8, 2)
    for index, (name, users) in enumerate(chats.items()):
        # A system prompt no earlier request began with: nothing parked holds it.
        messages = [{"role": "system", "content": f"Request {index}: {name}. {system}".strip()},
                    {"role": "user", "content": users[0]}]
        for side in SIDES if index % 2 == 0 else SIDES[::-1]:
            row = _choices(bases[side], messages, new_tokens, n)
            rows[side].append({"chat": name, **row})
            log.info("%s %s: %d choices, first token %.2f s, the last choice's %.2f s, target prefilled %d "
                     "(prompt %d)", side, name, n, row["first_token_s"], row["last_first_token_s"],
                     row["target_prefill_tokens"], row["prompt_tokens"])
    summary = {side: {
        "first_token_s_p50": statistics.median(r["first_token_s"] for r in side_rows),
        "last_first_token_s_p50": statistics.median(r["last_first_token_s"] for r in side_rows),
        "wall_s_total": sum(r["wall_s"] for r in side_rows),
        "tok_s": sum(len(i) for r in side_rows for i in r["ids"]) / sum(r["wall_s"] for r in side_rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in side_rows),
        "target_prefill_tokens": sum(r["target_prefill_tokens"] for r in side_rows),
        "requests": len(side_rows),
    } for side, side_rows in rows.items()}
    on, off = summary["cache_on"], summary["cache_off"]
    return {
        "choices": n,
        "modes": summary,
        "identical": sum(a["ids"] == b["ids"] for a, b in zip(rows["cache_on"], rows["cache_off"])),
        # Of each request, which choices were the same on both sides.
        "identical_choices": [[x == y for x, y in zip(a["ids"], b["ids"])]
                              for a, b in zip(rows["cache_on"], rows["cache_off"])],
        "wall_off_over_on": off["wall_s_total"] / on["wall_s_total"],
        "last_first_token_off_over_on": off["last_first_token_s_p50"] / on["last_first_token_s_p50"],
        "runs": rows,
    }


def run(bases: dict[str, str], chats: dict[str, list[str]], turns: int, new_tokens: int, system: str = "") -> dict:
    rows = {side: [] for side in SIDES}
    for side in SIDES:  # warm-up: a turn each, on a conversation of its own
        _turn(bases[side], [{"role": "user", "content": f"Say hello ({side})."}], 8)
    for index, (name, users) in enumerate(chats.items()):
        order = SIDES if index % 2 == 0 else SIDES[::-1]
        for side in order:
            messages = [{"role": "system", "content": system}] if system else []
            for turn, user in enumerate(users[:turns]):
                messages.append({"role": "user", "content": user})
                row = _turn(bases[side], messages, new_tokens)
                messages.append({"role": "assistant", "content": row["text"]})
                rows[side].append({"chat": name, "turn": turn, **row})
                log.info("%s %s turn %d: first token %.2f s, %d of %d prompt tokens cached", side, name, turn,
                         row["first_token_s"], row["cached_tokens"], row["prompt_tokens"])
    summary = {}
    for side, side_rows in rows.items():
        later = [r for r in side_rows if r["turn"] > 0]
        summary[side] = {
            "first_token_s_p50_later_turns": statistics.median(r["first_token_s"] for r in later),
            "first_token_s_p50_first_turn": statistics.median(r["first_token_s"] for r in side_rows if r["turn"] == 0),
            "wall_s_total": sum(r["wall_s"] for r in side_rows),
            "tok_s": sum(len(r["ids"]) for r in side_rows) / sum(r["wall_s"] for r in side_rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in side_rows),
            "cached_tokens": sum(r["cached_tokens"] for r in side_rows),
            "target_prefill_tokens": sum(r["target_prefill_tokens"] for r in side_rows),
            "cache_misses": sum(r["cache_misses"] for r in side_rows),
            "requests": len(side_rows),
        }
    on, off = summary["cache_on"], summary["cache_off"]
    identical = sum(a["ids"] == b["ids"] for a, b in zip(rows["cache_on"], rows["cache_off"]))
    return {
        "modes": summary,
        "identical": identical,
        "first_token_later_turns_off_over_on": off["first_token_s_p50_later_turns"] / on["first_token_s_p50_later_turns"],
        "wall_off_over_on": off["wall_s_total"] / on["wall_s_total"],
        "runs": {side: [{k: v for k, v in r.items() if k not in ("ids", "text")} for r in side_rows]
                 for side, side_rows in rows.items()},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_flags(parser)
    parser.add_argument("--chats", default=",".join(CHATS), help="conversations (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=4, help="user turns per conversation, at most 6 "
                                                             "(default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per reply (default: %(default)s)")
    parser.add_argument("--system", choices=["shared", "none"], default="shared",
                        help="shared: every chat opens with the same system prompt of about 150 tokens; "
                             "none: with the model's default (default: %(default)s)")
    parser.add_argument("--choices", type=int, default=0, metavar="N",
                        help="send each chat's first turn once, as one request of N greedy choices, instead "
                             "of the conversations (above); 0 = the conversations (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_probe.json", help="JSON output path")
    args = parse_args(parser, argv)
    chats = {name: CHATS[name] for name in args.chats.split(",")}
    ports = {side: free_port() for side in SIDES}
    target = Service("target", model_flags(args, "target"), threads=args.threads)
    draft = Service("draft", model_flags(args, "draft"), threads=args.threads)
    with Deployment(target, draft, ["--http-port", str(ports["cache_on"])]) as deployment:
        off = Service("orchestrator", ["--target", target.address, "--draft", draft.address,
                                       "--http-port", str(ports["cache_off"]), "--prefix-cache", "0"])
        try:
            off.start(deployment.log_dir)
            off.wait_ready(120)
            bases = {side: f"http://127.0.0.1:{port}" for side, port in ports.items()}
            if args.choices:
                result = run_choices(bases, chats, args.choices, args.new_tokens,
                                     SYSTEM if args.system == "shared" else "")
            else:
                result = run(bases, chats, args.turns, args.new_tokens, SYSTEM if args.system == "shared" else "")
        finally:
            off.stop()
    result.update(**pair_record(args), new_tokens=args.new_tokens,
                  turns=0 if args.choices else args.turns, system=args.system, machine=machine())
    write(args.out, result)
    if args.choices:
        print(f"{'side':<10} {'first token p50':>16} {'last choice':>12} {'tok/s':>7} {'target prefill':>15}")
        for side, row in result["modes"].items():
            print(f"{side:<10} {row['first_token_s_p50']:14.2f} s {row['last_first_token_s_p50']:10.2f} s "
                  f"{row['tok_s']:7.2f} {row['target_prefill_tokens']:>15}")
        print(f"whole run, off over on: {cut(result['wall_off_over_on']):.2f}x (cut); same choices: "
              f"{result['identical']}/{result['modes']['cache_on']['requests']}")
        return 0
    print(f"{'side':<10} {'TTFT p50, turn 1':>17} {'later turns':>12} {'tok/s':>7} {'cached/prompt':>15} "
          f"{'target prefill':>15}")
    for side, row in result["modes"].items():
        print(f"{side:<10} {row['first_token_s_p50_first_turn']:15.2f} s {row['first_token_s_p50_later_turns']:10.2f} s "
              f"{row['tok_s']:7.2f} {row['cached_tokens']:>7}/{row['prompt_tokens']:<7} {row['target_prefill_tokens']:>15}")
    print(f"time to first token of later turns, off over on: {cut(result['first_token_later_turns_off_over_on']):.2f}x; "
          f"whole run: {cut(result['wall_off_over_on']):.2f}x (cut); same replies: "
          f"{result['identical']}/{result['modes']['cache_on']['requests']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
