"""The flags of `tandem serve target|draft|orchestrator`: each service's parser,
and the model, TLS and telemetry flags they share. Parsing only; tandem/cli.py
runs the services."""
from __future__ import annotations

import os

from orchestrator import reasoning_parsers, tool_parsers
from tandem.cli_types import INT32_MAX, auto_or, int_in, tenant_priority

DEFAULT_TARGET = "127.0.0.1:50052"
DEFAULT_DRAFT = "127.0.0.1:50053"


def add_serve_commands(sub) -> None:
    """`tandem serve` and its three roles, under the top-level subparsers `sub`."""
    serve = sub.add_parser("serve", help="start a service").add_subparsers(dest="role", required=True)
    target = serve.add_parser("target", help="the target model service")
    _add_model_flags(target, "default-target", 50052)
    target.add_argument("--graphs", default="auto", choices=["auto", "on", "off"],
                        help="on a GPU, run a verify of up to 16 tokens by replaying a CUDA graph of the lean forward "
                             "(tandem/lean.py: a plain loop over the layers on a preallocated KV cache; Qwen2, Llama, "
                             "Mistral), captured once per block length and cache capacity; off = Hugging Face's "
                             "forward; auto = on for a supported model on a GPU, off on a CPU (default: %(default)s)")
    target.add_argument("--batch-verifies", type=auto_or(int_in(1, 256)), default=None, metavar="N|auto",
                        help="verify calls of up to N sessions that queue while a verify runs go through one "
                             "forward together (the weights read once for all): more tokens/s under concurrent "
                             "requests, no wait for a lone one. Needs the lean forward (Qwen2, Llama, Mistral), "
                             "which the target then runs on a CPU too; 1 = off; auto = 8 on a CPU where the lean "
                             "forward runs the model and verifies carry no token trees (AMX), else off "
                             "(default: auto)")
    draft = serve.add_parser("draft", help="the draft service")
    _add_model_flags(draft, "default-draft", 50053)
    draft.add_argument("--backend", default="model", choices=["model", "ngram", "ngram+model"],
                       help="draft backend: a model, prompt lookup (n-gram), or n-gram first then the model "
                            "(default: %(default)s)")
    draft.add_argument("--vocab-subset", type=int, default=0,
                       help="score only the N most frequent tokens in the draft head (FR-Spec); 0 = full vocabulary "
                            "(default: %(default)s; the demo, the benchmarks and the k8s CPU overlay use 32768)")
    draft.add_argument("--ngram-max", type=int, default=4,
                       help="longest n-gram matched by prompt lookup (default: %(default)s)")
    draft.add_argument("--quantize", default="none", choices=["none", "int8", "int4", "auto"],
                       help="quantize the draft's linear layers (CPU only): int8 = dynamic int8, computes in "
                            "float32, and its per-forward activation scales make a seeded sampled run differ "
                            "between --pipeline on and off (greedy output does not); int4 = 4-bit weights in "
                            "groups of 32, on the kernel --int4-kernel names; auto = int4 on a CPU with AVX512-VNNI, "
                            "AVX2 or AMX, else int8 "
                            "(default: %(default)s)")
    draft.add_argument("--int4-kernel", default="auto", choices=["auto", "i4w", "aten"],
                       help="the kernel of --quantize int4: i4w = tandem/i4w.c (AVX512-VNNI or AVX2, int8 "
                            "activations, the draft's layers in one C call), aten = aten's CPU int4 kernel (bf16 "
                            "activations, fast only with native bf16); auto = i4w wherever it runs, else aten "
                            "(default: %(default)s)")
    draft.add_argument("--min-confidence", type=float, default=0.0,
                       help="greedy: end a draft block after a token the draft gives a probability below this "
                            "(Hugging Face's assistant_confidence_threshold); 0 = never (default: %(default)s)")
    draft.add_argument("--lean-step", default="auto", choices=["auto", "on", "aten", "off"],
                       help="run the draft model's forward as a plain loop over its layers on a preallocated KV "
                            "cache instead of Hugging Face's forward (Qwen2, Llama, Mistral): same function, "
                            "less Python per step; auto = on when the model is supported: on a CPU its layers in one C call "
                            "when every projection is int4 on tandem/i4w.c, on a GPU a feed of up to 16 "
                            "tokens (a step, or the tokens a verify accepted) replays a CUDA graph; aten = the lean "
                            "forward without either (default: %(default)s)")
    draft.add_argument("--batch-drafts", type=auto_or(int_in(1, 256)), default=None, metavar="N|auto",
                       help="greedy Propose calls of up to N sessions that queue while a draft runs are drafted in "
                            "lockstep, each step one forward for all (the weights read once): more tokens/s under "
                            "concurrent requests, no wait for a lone one. Sampled calls run alone (a seed's draws "
                            "stay bit-exact). Needs the model backend and the lean step; 1 = off; auto = 8 on a CPU "
                            "where both hold, else off (default: auto)")
    orch = serve.add_parser("orchestrator", help="the public API server")
    orch.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    orch.add_argument("--port", type=int, default=50051, help="port to bind (default: %(default)s)")
    orch.add_argument("--http-port", type=int_in(0, 65535), default=None,
                      help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                           "/v1/models, /health, and /metrics while --metrics-port turns metrics on) on this port "
                           "of --host; 0 picks one (default: off)")
    _add_tls_flags(orch, "the gRPC API, and the HTTP API of --http-port,",
                   "The hops to the model services are TLS with --service-tls-ca")
    orch.add_argument("--service-tls-ca", default=os.environ.get("TANDEM_SERVICE_TLS_CA", ""), metavar="FILE",
                      help="dial the draft and the target over TLS (services run with --tls-cert), checking their "
                           "certificates against this CA (PEM; default: $TANDEM_SERVICE_TLS_CA, else plaintext)")
    orch.add_argument("--service-tls-cert", default=os.environ.get("TANDEM_SERVICE_TLS_CERT", ""), metavar="FILE",
                      help="with --service-tls-ca: the orchestrator's client certificate, for services run with "
                           "--tls-client-ca (mutual TLS); with --service-tls-key (default: $TANDEM_SERVICE_TLS_CERT, "
                           "else none)")
    orch.add_argument("--service-tls-key", default=os.environ.get("TANDEM_SERVICE_TLS_KEY", ""), metavar="FILE",
                      help="the private key of --service-tls-cert (default: $TANDEM_SERVICE_TLS_KEY, else none)")
    orch.add_argument("--service-tls-server-name", default="", metavar="NAME",
                      help="the name the services' certificates must hold, where it is not the host of --draft and "
                           "--target (an IP address, say) (default: those hosts)")
    orch.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                      help="web origins (https://chat.example.com, or * for any) whose pages may call the HTTP "
                           "API from a browser: CORS headers and preflights on every route (default: none)")
    orch.add_argument("--served-model-name", default="",
                      help="the model id the HTTP API lists and requests name (default: the target model's id)")
    orch.add_argument("--tool-call-parser", choices=tool_parsers.PARSERS, default=None,
                      help="the HTTP API's tool_choice 'auto' (OpenAI's default with tools): parse the model's tool "
                           "calls out of its answers in this format, as vLLM's parser of the name does (hermes: "
                           "Qwen2.5's and Hermes' <tool_call> blocks; llama3_json: Llama 3.1/3.2's JSON calls; "
                           "mistral: Mistral's [TOOL_CALLS] list; pythonic: Llama 3.2/4's [f(x=1)] list) "
                           "(default: none, and 'auto' is refused)")
    orch.add_argument("--discover", default="", metavar="NAME",
                      help="take --draft and --target from the Ray deployment NAME's registry in Redis "
                           "(tandem ray up), waiting up to --wait for them (default: off)")
    orch.add_argument("--reasoning-parser", choices=reasoning_parsers.PARSERS, default=None,
                      help="the HTTP API's chat answers and Responses: the model's <think>...</think> text goes "
                           "out apart, as reasoning_content (a reasoning item), as vLLM's parser of the name reads "
                           "it (deepseek_r1: the answer starts inside the reasoning; qwen3: where it opens with "
                           "<think>) (default: none, all of it is content)")
    orch.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                      help="fcfs: the model services run calls in arrival order, and a request's priority other "
                           "than 0 is refused; priority: each request's calls queue on the services by its "
                           "priority (the HTTP API's and GenerationParams' priority), the lowest first, ties in "
                           "arrival order, as vLLM's flag; a running call is never pre-empted, and a busy "
                           "service can starve the later priorities (default: %(default)s)")
    orch.add_argument("--tenant-priority", action="append", type=tenant_priority, default=None,
                      metavar="TENANT=N",
                      help="with --scheduling-policy priority: the tenant's requests' priority where they give "
                           "none, and the earliest they may ask for (earlier is PERMISSION_DENIED); * names "
                           "every tenant not named, e.g. '*=0' keeps all but the named ones from jumping the "
                           "queue (repeat the flag; default: none, any priority may be asked for)")
    orch.add_argument("--return-tokens-as-token-ids", action="store_true",
                      help="the HTTP API's log probabilities name each token 'token_id:ID' in place of its text, "
                           "as vLLM's flag (a token that does not decode alone, a piece of a multi-byte "
                           "character, is then exact); a request's return_tokens_as_token_ids wins "
                           "(default: the tokens' text)")
    orch.add_argument("--chat-template", default=os.environ.get("TANDEM_CHAT_TEMPLATE", ""), metavar="FILE|TEXT",
                      help="the Jinja chat template that renders conversations, in place of the tokenizer's: a "
                           "file, or the template's text (as vLLM's flag); for a model without one, or to fix "
                           "one (default: $TANDEM_CHAT_TEMPLATE, else the tokenizer's)")
    orch.add_argument("--trust-request-chat-template", action="store_true",
                      help="let a request bring its own chat template (the HTTP API's chat_template, gRPC's "
                           "ChatMessages.chat_template), which the orchestrator then renders: only where the "
                           "clients are trusted (default: such requests are refused)")
    orch.add_argument("--draft", default=DEFAULT_DRAFT, metavar="HOST:PORT[,HOST:PORT...]",
                      help="draft service address, or its replicas' addresses, comma-separated: each session's "
                           "calls go to one replica, the others take its sessions while it is down "
                           "(default: %(default)s)")
    orch.add_argument("--target", default=DEFAULT_TARGET, metavar="HOST:PORT[,HOST:PORT...]",
                      help="target service address, or its replicas' addresses, comma-separated, as --draft "
                           "(default: %(default)s)")
    orch.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                      help="Redis for sessions (default: $REDIS_URL or %(default)s)")
    orch.add_argument("--tokenizer", default="", help="tokenizer path or hub id; default the target's; 'none' = ids only")
    orch.add_argument("--k", type=int, default=4,
                      help="draft tokens per round, and the adaptive start (default: %(default)s)")
    orch.add_argument("--k-min", type=int, default=1, help="adaptive k lower bound (default: %(default)s)")
    orch.add_argument("--k-max", type=int, default=8, help="adaptive k upper bound (default: %(default)s)")
    orch.add_argument("--adaptive-k", choices=["on", "off"], default="on",
                      help="choose k per session from measurements (default: %(default)s)")
    orch.add_argument("--pipeline", choices=["on", "off", "auto"], default="on",
                      help="draft the next block during verification; auto: per request, whichever of on and off "
                           "the step costs measured so far expect to be faster here (a verify runs slower beside a "
                           "pre-draft on some CPUs); a request's own pipeline field wins (default: %(default)s)")
    orch.add_argument("--prefill-overlap", choices=["auto", "on", "off"], default="auto",
                      help="on: a turn's first round: the target prefills the prompt and decodes one token while "
                           "the draft prefills the prompt beside it (pipelined: and pre-drafts after it); off: the "
                           "draft prefills and drafts first, then the target verifies its block with the prompt; "
                           "auto: on, unless the services run on one machine's CPUs with more torch threads than "
                           "CPUs between them (a seeded sampled request: on) (default: %(default)s)")
    orch.add_argument("--relay", choices=["on", "off"], default="off",
                      help="each verify asks the target to send the draft the call that drafts the next block "
                           "the moment its verdict is known, so that after a rejection the draft starts one hop "
                           "and the orchestrator's work earlier; the target dials the draft at --relay-address. "
                           "Off by default: on two pinned cores it cut the overhead of a round after a rejection "
                           "by 0.35-1.25 ms, but tokens/s was not shown to rise (README) (default: %(default)s)")
    orch.add_argument("--tree-width", type=auto_or(int_in(0, 16)), default="auto", metavar="{auto,0..16}",
                      help="greedy requests: verify the draft's runner-up for each of a block's first N tokens "
                           "beside the block, in the same forward (a token tree one level off it); where the "
                           "target's token at the first rejection is that runner-up, the round commits one token "
                           "more. Costs the target N more rows a verify, so it pays where a verify's cost barely "
                           "grows with its rows; auto = the width the target suggests: 4 for bf16 on packed layers "
                           "with AMX, else 0 (off); a target on --linear bf16dot, on a GPU with --graphs, or "
                           "batching verifies (--batch-verifies, on by default on a CPU but where the target "
                           "suggests a width) verifies the block alone, and then no alternatives are drafted, whatever N "
                           "(a warning says so) (default: %(default)s)")
    orch.add_argument("--relay-address", default="",
                      help="the draft service's address as the target reaches it (default: --draft)")
    orch.add_argument("--service-transport", choices=["stream", "unary"], default="stream",
                      help="model calls on one long-lived stream per service, or one rpc each (default: %(default)s)")
    orch.add_argument("--service-timeout", type=float, default=120.0,
                      help="deadline of each call to a model service, seconds; a prompt's prefill must fit in it "
                           "(default: %(default)s)")
    orch.add_argument("--replica-load-interval", type=float, default=1.0, metavar="SECONDS",
                      help="with replicas of a service: how often this orchestrator shares its sessions on "
                           "each replica with the other orchestrators through Redis, and reads theirs, by which "
                           "new sessions are placed; 0: never, each orchestrator then counts only its own "
                           "sessions (default: %(default)s)")
    orch.add_argument("--draft-fallback", choices=["on", "off"], default="on",
                      help="while the draft service is unavailable, decode on the target alone (same output, "
                           "one token a round) and call the draft again after a backoff; off: such requests fail "
                           "with UNAVAILABLE (default: %(default)s)")
    orch.add_argument("--max-tokens", type=int, default=128,
                      help="default max_tokens of a request (default: %(default)s)")
    orch.add_argument("--max-concurrent-requests", type=int, default=128,
                      help="Generate and Chat requests served at once; more are refused with RESOURCE_EXHAUSTED "
                           "at once; 0 = no limit (default: %(default)s)")
    orch.add_argument("--session-ttl", type=int, default=3600,
                      help="idle session lifetime, seconds (default: %(default)s)")
    orch.add_argument("--response-ttl", type=int_in(1, 2**32 - 1), default=7 * 24 * 3600, metavar="SECONDS",
                      help="how long a stored response is kept in Redis: each Response of the HTTP API's "
                           "/v1/responses with \"store\": true (the default), which a later request continues by "
                           "its previous_response_id (default: %(default)s, 7 days)")
    orch.add_argument("--prefix-cache", type=int_in(0, 1_000_000), default=32, metavar="N",
                      help="a Generate without keep_session (and every HTTP request) ends by parking its session, "
                           "caches and all, instead of deleting it; a later one of the same tenant whose prompt "
                           "starts with the same tokens takes it over (the next turn of a conversation resent "
                           "whole, say), or starts from a copy of its caches of a shorter shared beginning (a "
                           "system prompt), and prefills only the rest (usage: cached_prompt_tokens). Keeps at "
                           "most N parked sessions, the oldest dropped first; 0 = off (default: %(default)s)")
    orch.add_argument("--prefix-cache-ttl", type=int_in(1, 10_000_000), default=600, metavar="SECONDS",
                      help="how long a session stays parked for --prefix-cache (default: %(default)s)")
    orch.add_argument("--tenant-max-requests", type=int_in(0, 1_000_000), default=0, metavar="N",
                      help="Generate and Chat requests each tenant may run at once, counted in Redis across "
                           "every orchestrator replica; more are refused with RESOURCE_EXHAUSTED (HTTP 429); "
                           "0 = no limit (default: %(default)s)")
    orch.add_argument("--tenant-tokens-per-minute", type=int_in(0, 10**12), default=0, metavar="N",
                      help="tokens each tenant may commit a minute (prompts as prefilled, and generated tokens; "
                           "a prefix reused by --prefix-cache is free), across replicas; a request whose tenant "
                           "is past it is refused with RESOURCE_EXHAUSTED and the seconds to wait, one admitted "
                           "runs to its end; 0 = no limit (default: %(default)s)")
    orch.add_argument("--api-keys", default=os.environ.get("TANDEM_API_KEYS_FILE", ""), metavar="FILE",
                      help="require an API key on every call that touches sessions (gRPC metadata "
                           "'authorization: Bearer KEY'; HTTP: the Authorization header): FILE has one "
                           "'TENANT KEY' line a key, and the key decides the caller's tenant. Without it the "
                           "x-tandem-tenant metadata is trusted as sent (default: $TANDEM_API_KEYS_FILE, else none)")
    orch.add_argument("--wait", type=float, default=600,
                      help="seconds to wait for the model services at start; with --draft-fallback on, at most "
                           "30 s for the draft once the target answers (default: %(default)s)")
    _add_telemetry_flags(orch, http_api=True)


def _add_model_flags(p, default_model: str, default_port: int) -> None:
    p.add_argument("--model", default=default_model,
                   help="local directory, hub id, or default-target / default-draft (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="weights and compute dtype; auto = bfloat16 on GPUs; on CPUs with AMX bfloat16 on packed "
                        "layers; on other CPUs float32 on bf16-held weights (--linear bf16w) where that kernel "
                        "builds, else on fp16-weight layers where FBGEMM has them (faster than native bf16 without "
                        "AMX too), else bfloat16 with native bf16, else float32 (see --linear) "
                        "(default: %(default)s)")
    p.add_argument("--linear", default="auto", choices=["auto", "native", "packed", "fp16", "bf16w", "bf16dot"],
                   help="linear kernels (CPU): bf16w = float32 on weights held in bf16 (tandem/bf16w.c, built "
                        "once with the system C compiler; CPUs with AVX-512 or AVX2), for layers whose weights are "
                        "bf16 values (others fp16); bf16dot = the same layers with their inputs rounded to bf16, "
                        "on the CPU's bf16 dot product (tandem/bf16dot.c; AVX512-BF16): a verify of a few tokens "
                        "costs little more than one, but the output is no longer float32's; fp16 = FBGEMM on "
                        "weights stored in fp16, float32 only, for layers whose weights convert exactly (others "
                        "packed); packed = oneDNN with weights reordered at load, float32, or bfloat16 on CPUs with "
                        "native bf16; native = nn.Linear; "
                        "auto = bf16w where it builds, else fp16 where it applies, else packed "
                        "where it applies (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads; 0 = torch's default on a CPU, 1 on a GPU (its host work is kernel launches) "
                        "(default: %(default)s)")
    p.add_argument("--inline-compute", default="auto", choices=["auto", "on", "off"],
                   help="run short calls (up to 16 token rows: draft steps, a verify; not a prefill or a pre-draft) on the "
                        "server's event loop when the model thread is idle, saving two thread hops a call; "
                        "auto = on for a CPU model on one torch thread, and for the n-gram drafter (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=auto_or(int_in(0, INT32_MAX)), default=None, metavar="N|auto",
                   help="chunked prefill: a call with more new tokens than N (a long prompt or turn) runs them N "
                        "at a time, one model-thread call each, and other sessions' queued calls run between two "
                        "chunks, so that a long prompt holds up their rounds for one chunk's time; 0 = a prefill "
                        "runs whole; auto = 256 on a CPU, 2048 on a GPU (default: auto)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=default_port, help="port to bind; 0 picks one (default: %(default)s)")
    p.add_argument("--cache-mb", type=int, default=4096,
                   help="KV cache budget for all sessions, MiB; 0 = unbounded (default: %(default)s)")
    p.add_argument("--session-ttl", type=float, default=3600,
                   help="drop caches idle this many seconds; 0 = never (default: %(default)s)")
    _add_tls_flags(p, "this service's gRPC API", "The orchestrator dials it with --service-tls-ca")
    _add_telemetry_flags(p)


def _add_tls_flags(p, what: str, more: str) -> None:
    """--tls-cert, --tls-key and --tls-client-ca of a server (tandem.tls.ServerTls)."""
    p.add_argument("--tls-cert", default=os.environ.get("TANDEM_TLS_CERT", ""), metavar="FILE",
                   help=f"serve {what} over TLS with this certificate chain (PEM; with --tls-key). {more} "
                        "(default: $TANDEM_TLS_CERT, else no TLS)")
    p.add_argument("--tls-key", default=os.environ.get("TANDEM_TLS_KEY", ""), metavar="FILE",
                   help="the private key of --tls-cert (PEM; default: $TANDEM_TLS_KEY, else none)")
    p.add_argument("--tls-client-ca", default=os.environ.get("TANDEM_TLS_CLIENT_CA", ""), metavar="FILE",
                   help="with --tls-cert: require client certificates signed by this CA (mutual TLS; default: "
                        "$TANDEM_TLS_CLIENT_CA, else none)")


def _add_telemetry_flags(p, http_api: bool = False) -> None:
    """--otel-traces and --metrics-port; `http_api`: the command has --http-port, whose /metrics they reach."""
    from tandem.telemetry import TRACE_EXPORTERS

    env = os.environ.get("OTEL_TRACES_EXPORTER", "none")
    p.add_argument("--otel-traces", choices=TRACE_EXPORTERS, default=env if env in TRACE_EXPORTERS else "none",
                   help="export OpenTelemetry spans: none; console (stderr); otlp (OTLP/HTTP to "
                        "$OTEL_EXPORTER_OTLP_ENDPOINT, default http://localhost:4318). The sampler follows "
                        "$OTEL_TRACES_SAMPLER (default: parent-based, always on) "
                        "(default: $OTEL_TRACES_EXPORTER or %(default)s)")
    also = ("; while metrics are on, the HTTP API (--http-port) serves them at its /metrics too, and a PORT "
            "equal to --http-port serves them there alone, with no second port; while off, its /metrics answers 404"
            if http_api else "")
    p.add_argument("--metrics-port", type=int_in(0, 65535), default=0, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (HOST is --host); 0 = off"
                        f"{also} (default: %(default)s)")
