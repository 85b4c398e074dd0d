"""The `tandem` command line's flags: the parser of every command (the services'
in tandem/serve_flags.py, the argparse types in tandem/cli_types.py), and the
flags turned into what the client and the configs take. Parsing only;
tandem/cli.py runs the commands."""
from __future__ import annotations

import argparse
import os

from tandem.cli_types import INT32_MAX, LOG_LEVELS, UINT64_MAX, bias, ids, int_in
from tandem.logprobs import MAX_TOP_LOGPROBS
from tandem.serve_flags import add_serve_commands

DEFAULT_ORCHESTRATOR = "127.0.0.1:50051"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Distributed, pipelined, lossless speculative decoding.")
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        default=os.environ.get("TANDEM_LOG_LEVEL", "INFO").upper(),
                        help="logging level (default: $TANDEM_LOG_LEVEL or INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    add_serve_commands(sub)

    gen = sub.add_parser("generate", help="stream a completion of a prompt")
    gen.add_argument("prompt", nargs="?", default=None, help="prompt text")
    gen.add_argument("--prompt-ids", type=ids, default=None, help="prompt as comma-separated token ids")
    gen.add_argument("--suffix", default=None,
                     help="fill in the middle: the completion goes between the prompt and this text, in the "
                          "model's fill-in-the-middle format (a code model's, such as Qwen2.5-Coder's)")
    gen.add_argument("--prompt-logprobs", type=int_in(0, MAX_TOP_LOGPROBS), default=None, metavar="N",
                     help="also score the prompt: each of its tokens' log probability after the first, and the "
                          f"N likeliest at each position (0..{MAX_TOP_LOGPROBS}; default: none)")
    _add_sampling_flags(gen)

    chat = sub.add_parser("chat", help="interactive multi-turn chat")
    chat.add_argument("--system", default="", help="system prompt (default: none)")
    _add_sampling_flags(chat)

    batch = sub.add_parser("batch", help="run a file of OpenAI batch requests against a server's HTTP API",
                           description="Runs a JSONL file of OpenAI batch requests ({custom_id, method, url, body} "
                                       "a line; url /v1/chat/completions, /v1/completions or /v1/responses) "
                                       "against a running Tandem server's HTTP API, and writes OpenAI's batch "
                                       "output lines ({id, custom_id, response: {status_code, request_id, body}, "
                                       "error}) in the input's order. Exits 1 if any request did not get a 200.")
    batch.add_argument("input", help="the requests, a JSONL file (- for stdin)")
    batch.add_argument("-o", "--output", default=None, help="where the results go (default: stdout)")
    batch.add_argument("--url", default=os.environ.get("TANDEM_HTTP_URL", "http://127.0.0.1:8000"),
                       help="the server's HTTP API (default: $TANDEM_HTTP_URL or %(default)s)")
    batch.add_argument("--concurrency", type=int_in(1, 1024), default=8,
                       help="requests in flight at once (default: %(default)s)")
    batch.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY") or None,
                       help="sent as 'Authorization: Bearer KEY' (default: $TANDEM_API_KEY, else none)")
    batch.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default: %(default)s)")
    batch.add_argument("--quiet", action="store_true", help="no progress bar on stderr")

    _add_ray_commands(sub)

    models = sub.add_parser("models", help="fetch and convert the default model pair")
    models.add_argument("--which", choices=["target", "draft", "both"], default="both",
                        help="which of the default pair to fetch and convert (default: %(default)s)")
    return parser



def _add_ray_commands(sub) -> None:
    from tandem.ray_cluster import PLACEMENTS

    ray_parser = sub.add_parser("ray", help="run Tandem's three services on a Ray cluster",
                                description="Places the target, the draft and the orchestrator on a Ray cluster "
                                            "as detached actors, each supervising its service's process; their "
                                            "addresses go to Redis (tandem:ray:NAME).")
    commands = ray_parser.add_subparsers(dest="ray_command", required=True)
    parsers = [commands.add_parser("up", help="start a deployment and print its addresses (JSON)"),
               commands.add_parser("status", help="a deployment's services: alive, addresses, restarts (JSON); "
                                                  "exit 3 if one is down"),
               commands.add_parser("down", help="stop a deployment's services and free their resources")]
    for p in parsers:
        p.add_argument("--name", default="tandem", help="the deployment's name (default: %(default)s)")
        p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"),
                       help="the Ray cluster (default: $RAY_ADDRESS or %(default)s, the one this node is in)")
        p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                       help="Redis, as every node reaches it: the sessions' store and the deployment's registry "
                            "(default: $REDIS_URL or %(default)s)")
    up = parsers[0]
    up.add_argument("--target-model", default="default-target", help="the target's --model (default: %(default)s)")
    up.add_argument("--draft-model", default="default-draft", help="the draft's --model (default: %(default)s)")
    for role, example in (("target", "--threads 1"), ("draft", "--quantize auto --vocab-subset 32768"),
                          ("orchestrator", "--http-port 8000 --api-keys FILE")):
        up.add_argument(f"--{role}-args", default="", metavar="ARGS",
                        help=f"more flags of 'tandem serve {role}', as one string (e.g. \"{example}\"; "
                             "default: none)")
    up.add_argument("--target-replicas", type=int_in(1, 64), default=1, metavar="N",
                    help="replicas of the target, each an actor with its own bundle; the orchestrator spreads "
                         "sessions over them (README: Replicas of the model services) (default: %(default)s)")
    up.add_argument("--draft-replicas", type=int_in(1, 64), default=1, metavar="N",
                    help="replicas of the draft, as --target-replicas (default: %(default)s)")
    up.add_argument("--gpus-per-service", default="auto", metavar="N|auto",
                    help="GPUs for each replica of the target and of the draft (fractions share one); auto: 1 "
                         "where the cluster has a GPU for each, else an equal share of one (0.5 for the two "
                         "services on one GPU), 0 without GPUs (CPU) (default: %(default)s)")
    up.add_argument("--cpus-per-service", type=float, default=1.0,
                    help="CPUs Ray reserves for the target and for the draft (default: %(default)s)")
    up.add_argument("--placement", choices=list(PLACEMENTS), default="spread",
                    help="how the target's and the draft's bundles spread over nodes; strict-spread needs two "
                         "nodes (default: %(default)s)")
    up.add_argument("--timeout", type=float, default=900.0,
                    help="seconds to wait for room and for each service to be ready (default: %(default)s)")


def _add_sampling_flags(p) -> None:
    p.add_argument("--address", default=os.environ.get("TANDEM_ADDRESS", DEFAULT_ORCHESTRATOR),
                   help="orchestrator address (default: $TANDEM_ADDRESS or %(default)s)")
    p.add_argument("--tenant", default=None,
                   help="tenant id sent as x-tandem-tenant (default: none sent; the server's tenant \"default\")")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY") or None,
                   help="the key of a server run with --api-keys, sent as 'authorization: Bearer KEY' "
                        "(default: $TANDEM_API_KEY, else none sent)")
    p.add_argument("--tls", action="store_true",
                   help="dial the orchestrator over TLS, checking its certificate against the system's roots")
    p.add_argument("--tls-ca", default=os.environ.get("TANDEM_TLS_CA", ""), metavar="FILE",
                   help="dial over TLS, checking the orchestrator's certificate against this CA (PEM; default: "
                        "$TANDEM_TLS_CA)")
    p.add_argument("--tls-cert", default="", metavar="FILE",
                   help="this client's certificate (PEM), for a server run with --tls-client-ca; with --tls-key "
                        "(default: none)")
    p.add_argument("--tls-key", default="", metavar="FILE",
                   help="the private key of --tls-cert (PEM; default: none)")
    p.add_argument("--max-tokens", type=int_in(1, INT32_MAX), default=None,
                   help="most tokens to generate (server default 128)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default: 1, off)")
    p.add_argument("--top-k", type=int_in(0, INT32_MAX), default=None,
                   help="keep the top-k tokens; 0 = off (default: 0)")
    p.add_argument("--seed", type=int_in(0, UINT64_MAX), default=None,
                   help="seed for reproducible sampling (default: a random one, reported in the stats)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--allowed-token-id", action="append", type=int_in(0, INT32_MAX), default=None, metavar="ID",
                   help="only these tokens may be generated (repeatable; vLLM's allowed_token_ids)")
    p.add_argument("--bad-word", action="append", default=None, metavar="WORD",
                   help="a word the completion may not hold (repeatable; vLLM's bad_words)")
    p.add_argument("--include-stop", action="store_true",
                   help="the text keeps the stop string that ended it (vLLM's include_stop_str_in_output)")
    p.add_argument("--stop-token-id", action="append", type=int_in(0, INT32_MAX), default=None, metavar="ID",
                   help="a token id that ends the generation (repeatable; default: none)")
    p.add_argument("--priority", type=int_in(-INT32_MAX - 1, INT32_MAX), default=None,
                   help="the request's place in the model services' queues, the lowest first (a server run "
                        "with --scheduling-policy priority; default: 0, or the tenant's --tenant-priority)")
    p.add_argument("--min-tokens", type=int_in(0, INT32_MAX), default=None,
                   help="no end-of-sequence token among the first N generated (default: 0)")
    p.add_argument("--logit-bias", action="append", type=bias, default=None, metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit (repeatable; default: none)")
    for name in ("presence", "frequency"):
        p.add_argument(f"--{name}-penalty", type=float, default=None,
                       help=f"OpenAI's {name}_penalty, in [-2, 2] (default: 0)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide the positive logits of tokens already in the sequence by this, > 0 (default: 1, off)")
    p.add_argument("--min-p", type=float, default=None,
                   help="sampling: drop tokens less likely than this times the likeliest (default: 0, off)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate past end-of-sequence tokens, to --max-tokens (for benchmarks)")
    p.add_argument("--k", type=int_in(0, INT32_MAX), default=None,
                   help="draft tokens per round (default: the server's policy)")
    p.add_argument("--pipeline", choices=["on", "off"], default=None, help="override the server's pipelining")
    p.add_argument("--logprobs", type=int_in(0, MAX_TOP_LOGPROBS), default=None, metavar="N",
                   help="report each token's log probability under the target model, and those of the N most "
                        f"likely tokens at its position (0..{MAX_TOP_LOGPROBS}; default: none)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", default=None, metavar="SCHEMA",
                     help="structured output: the completion is JSON that this schema accepts (the schema's JSON "
                          "text, or @FILE to read it from a file)")
    fmt.add_argument("--json-object", action="store_true", help="structured output: the completion is a JSON object")
    fmt.add_argument("--regex", default=None, help="structured output: the completion matches this regular expression")
    fmt.add_argument("--choice", action="append", default=None,
                     help="structured output: the completion is one of these strings (repeatable)")
    fmt.add_argument("--grammar", default=None, metavar="LARK",
                     help="structured output: the completion follows this Lark grammar (llguidance's dialect; "
                          "@FILE to read it from a file)")
    p.add_argument("--format-after", default=None, metavar="TEXT",
                   help="structured output applies only after this text (a reasoning model's end of reasoning, "
                        "such as '</think>'); the completion is free up to it (default: from the first token)")
    p.add_argument("--reasoning-end", default=None, metavar="TEXT",
                   help="count the completion's reasoning: its tokens up to the one in which this text ends "
                        "('</think>'), all of them where it never comes, none where the prompt ends with it "
                        "(default: not counted)")
    p.add_argument("--reasoning-start", default=None, metavar="TEXT",
                   help="with --reasoning-end: the completion reasons only where it begins with this text "
                        "(Qwen3's '<think>'; default: it begins inside its reasoning, as DeepSeek-R1's)")
    p.add_argument("--keep-special-tokens", action="store_true",
                   help="keep the tokenizer's special tokens (an end-of-sequence token, chat markers) in the text "
                        "(default: left out, as vLLM's skip_special_tokens)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, stats")
    p.add_argument("--timeout", type=float, default=None,
                   help="deadline of each request, seconds (default: none; a server that stops answering "
                        "is still detected, by keepalive pings, within about a minute)")


def sampling_kwargs(args) -> dict:
    return dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop, include_stop_str_in_output=args.include_stop or None, num_draft_tokens=args.k,
        allowed_token_ids=args.allowed_token_id, bad_words=args.bad_word,
        pipeline=switch(args.pipeline),
        logprobs=True if args.logprobs is not None else None, top_logprobs=args.logprobs,
        ignore_eos=args.ignore_eos or None, stop_token_ids=args.stop_token_id, min_tokens=args.min_tokens,
        logit_bias=dict(args.logit_bias) if args.logit_bias else None,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, min_p=args.min_p,
        structured_output=_structured_output(args),
        reasoning=_reasoning(args),
        skip_special_tokens=False if args.keep_special_tokens else None,
        priority=args.priority,
    )


def _reasoning(args) -> dict | None:
    if args.reasoning_start and not args.reasoning_end:
        raise SystemExit("tandem: --reasoning-start needs --reasoning-end")
    if not args.reasoning_end:
        return None
    return {"end": args.reasoning_end, **({"start": args.reasoning_start} if args.reasoning_start else {})}


def _from_file(value: str) -> str:
    """A flag's value, or the text of the file that @FILE names."""
    if value.startswith("@"):
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    return value


def _structured_output(args) -> dict | None:
    out = _format(args)
    if args.format_after:
        if out is None:
            raise SystemExit("tandem: --format-after needs a format (--json-schema, --json-object, --regex, "
                             "--choice or --grammar)")
        out["after"] = args.format_after
    return out


def _format(args) -> dict | None:
    if args.json_schema is not None:
        return {"json_schema": _from_file(args.json_schema)}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": {"choices": args.choice}}
    if args.grammar is not None:
        return {"lark": _from_file(args.grammar)}
    return None



def switch(value: str | None) -> bool | None:
    """An on|off|auto flag as the configs take it: True, False, None (auto or unset)."""
    return {"on": True, "off": False}.get(value)
