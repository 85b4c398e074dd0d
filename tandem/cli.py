"""The `tandem` command line: its commands. Flags and environment variables are read here and in
tandem/cli_flags.py (the parser) only."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile

# Idle OpenMP threads spin about a millisecond before they sleep, unless the
# environment sets a policy: long enough to bridge the gaps between a forward's
# parallel regions, short enough to leave the cores to the other service soon
# after a forward ends. libgomp's default spins about 3 ms; PASSIVE (Tandem's
# default until 2026-11-25) sleeps at once, and every region then wakes its
# threads: on a 2-core Zen 5 VM a two-thread verify of 4 tokens took 106-115 ms
# PASSIVE against 80-89 ms spinning, and Tandem sequential on the whole
# machine (2 threads each) did 12.78 tok/s PASSIVE, 15.32 with
# GOMP_SPINCOUNT=300000 and 15.75 with 30000. One thread a service (the pinned
# nodes) makes no OpenMP pool, so there the setting changes nothing.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "30000"

from tandem.cli_flags import build_parser, sampling_kwargs, switch  # noqa: E402 (after the OpenMP setting)


def _serve(args) -> None:
    from tandem import serving, telemetry
    from tandem.launch import die_with_parent

    die_with_parent()

    address = f"{args.host}:{args.port}"
    try:
        observability = telemetry.setup(telemetry_config(args))
    except OSError as err:
        raise StartupError(f"metrics on {args.host}:{args.metrics_port}: {err}") from err

    async def run():
        try:
            server, port, health, servicer, name, draining = await build()
        except Exception as err:  # bad flags, a model that cannot be loaded, a busy port, a peer or Redis down
            logging.getLogger("tandem").debug("start-up failed", exc_info=True)
            raise StartupError(_words(err)) from err
        await server.start()
        http = await _start_http(args, port, public) if args.role == "orchestrator" and args.http_port is not None \
            else None
        serving.freeze_startup_objects()
        stop = serving.stop_on_signals()
        await serving.set_serving(health, [name], True)
        logging.getLogger("tandem").info("%s serving on %s:%d", args.role, args.host, port)
        print(f"READY {args.role} {args.host}:{port}", flush=True)
        await serving.run_until_signalled(server, health, [name], draining=draining, stop=stop)
        if http is not None:
            runner, gateway = http
            await runner.cleanup()
            await gateway.close()
        if public.get("socket"):
            shutil.rmtree(os.path.dirname(public["socket"]), ignore_errors=True)
        if args.role == "target":
            await servicer.relay.close()

    public = {}  # the orchestrator's TLS, and where its in-process HTTP gateway dials it

    async def build():
        if args.role == "orchestrator":
            # The flags are checked before orchestrator.server brings in torch and transformers (seconds).
            from orchestrator.config import OrchestratorConfig, PrefixCacheConfig, QuotaConfig
            from orchestrator.policy import KPolicyConfig
            from orchestrator.text import chat_template_text

            if args.discover:  # the model services of a Ray deployment (tandem.ray_cluster)
                from tandem.ray_cluster import discover

                found = discover(args.redis_url, args.discover, args.wait)
                args.draft, args.target = found["draft"], found["target"]
                logging.getLogger("tandem").info("discovered %s: target %s, draft %s", args.discover, args.target,
                                                 args.draft)

            config = OrchestratorConfig(
                draft_address=args.draft, target_address=args.target, redis_url=args.redis_url,
                tokenizer=args.tokenizer,
                policy=KPolicyConfig(k=args.k, k_min=args.k_min, k_max=args.k_max, adaptive=args.adaptive_k == "on"),
                pipeline=switch(args.pipeline), prefill_overlap=switch(args.prefill_overlap),
                default_max_tokens=args.max_tokens, session_ttl_s=args.session_ttl,
                response_ttl_s=args.response_ttl,
                service_transport=args.service_transport, draft_fallback=args.draft_fallback == "on",
                service_timeout_s=args.service_timeout, replica_load_s=args.replica_load_interval,
                max_concurrent_requests=args.max_concurrent_requests,
                relay=args.relay == "on", relay_address=args.relay_address, tree_width=args.tree_width,
                prefix_cache=PrefixCacheConfig(sessions=args.prefix_cache, ttl_s=args.prefix_cache_ttl),
                api_keys_file=args.api_keys,
                quotas=QuotaConfig(max_requests=args.tenant_max_requests,
                                   tokens_per_minute=args.tenant_tokens_per_minute),
                service_tls_ca=args.service_tls_ca, service_tls_cert=args.service_tls_cert,
                service_tls_key=args.service_tls_key, service_tls_server_name=args.service_tls_server_name,
                chat_template=chat_template_text(args.chat_template) if args.chat_template else "",
                trust_request_chat_template=args.trust_request_chat_template,
                scheduling_policy=args.scheduling_policy,
                tenant_priorities=dict(args.tenant_priority or ()),
            )
            public["tls"] = _server_tls(args)
            if public["tls"] is not None and args.http_port is not None:
                # Behind TLS, the gateway dials a Unix socket of this process's own (its
                # directory is the user's alone), not the TLS port, whose name it cannot check.
                public["socket"] = os.path.join(tempfile.mkdtemp(prefix="tandem-orchestrator-"), "grpc.sock")
            _keep_torch_out()
            from orchestrator.server import build_server

            server, port, health, servicer = build_server(address, config, public["tls"], public.get("socket", ""))
            await servicer.connect(wait_s=args.wait)
            name = "tandem.v1.Tandem"
            draining = None
        else:
            from tandem.model_service import CacheConfig
            from tandem.modeling import ModelConfig

            model = ModelConfig(model=args.model, device=args.device, dtype=args.dtype, threads=args.threads,
                                linear=args.linear, inline_compute=args.inline_compute,
                                prefill_chunk=args.prefill_chunk)
            cache = CacheConfig(budget_mb=args.cache_mb, session_ttl_s=args.session_ttl)
            if args.role == "target":
                if args.graphs == "on" and not model.device.startswith("cuda"):
                    raise ValueError(f"--graphs on needs a CUDA device, not {model.device}")
                from target_service.server import SERVICE_NAME as name, build_server

                server, port, health, servicer = build_server(address, model, cache, graphs=args.graphs,
                                                              batch_verifies=args.batch_verifies,
                                                              tls=_server_tls(args))
            else:
                from draft_service.server import SERVICE_NAME as name, DraftOptions, build_server

                options = DraftOptions(backend=args.backend, vocab_subset=args.vocab_subset, ngram_max=args.ngram_max,
                                       quantize=args.quantize, min_confidence=args.min_confidence,
                                       lean_step=args.lean_step, int4_kernel=args.int4_kernel,
                                       batch_drafts=args.batch_drafts)
                server, port, health, servicer = build_server(address, model, cache, options, tls=_server_tls(args))
            draining = servicer.draining
        return server, port, health, servicer, name, draining

    try:
        asyncio.run(run())
    finally:
        observability.shutdown()  # flushes the spans not exported yet


def telemetry_config(args):
    """The service's traces and metrics. The orchestrator's HTTP API serves its
    metrics at /metrics whenever they are on; a --metrics-port equal to
    --http-port turns them on with that /metrics as their only server."""
    from tandem import telemetry

    alone = getattr(args, "http_port", None) is not None and args.metrics_port == args.http_port != 0
    return telemetry.TelemetryConfig(
        service_name=os.environ.get("OTEL_SERVICE_NAME") or telemetry.SERVICE_NAMES[args.role],
        traces=args.otel_traces, metrics_port=0 if alone else args.metrics_port, metrics_host=args.host,
        http_metrics=alone,
    )


async def _start_http(args, grpc_port: int, public: dict):
    """The HTTP API in this process, dialling the orchestrator's own gRPC port
    (behind TLS, its Unix socket), over TLS where the gRPC API is."""
    from orchestrator.http_gateway import Gateway, start

    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    dial = f"unix:{public['socket']}" if public.get("socket") else f"{host}:{grpc_port}"
    gateway = Gateway(dial, args.served_model_name, args.tool_call_parser, tuple(args.allowed_origins or ()),
                      args.reasoning_parser, args.return_tokens_as_token_ids)
    tls = public.get("tls")
    try:
        runner, port = await start(gateway, args.host, args.http_port, tls.ssl_context() if tls else None)
    except OSError as err:
        await gateway.close()
        raise StartupError(f"the HTTP API on {args.host}:{args.http_port}: {err}") from err
    print(f"HTTP {args.host}:{port}", flush=True)
    return runner, gateway


def _keep_torch_out() -> None:
    """The orchestrator runs no model, yet transformers' tokenizers import torch
    wherever it is installed: on an AMX Xeon VM the orchestrator was ready in
    5.85-6.16 s holding 394 MB with it, and 1.87-2.16 s and 95 MB without.
    Marked absent, torch stays out, and transformers loads tokenizers only
    (tests/test_orchestrator_process.py)."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # an import of it fails; find_spec finds nothing
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found"


class StartupError(Exception):
    """A service could not start: bad flags, a model that cannot be loaded, a busy port."""


def _words(err: Exception) -> str:
    """An exception as one line for a person: its message, and its type where
    the message alone would not say what failed."""
    text = str(err).strip() or type(err).__name__
    if getattr(err, "for_people", False):  # its message names what failed and what to do
        return text
    if isinstance(err, (ValueError, OSError, StartupError)) and type(err).__module__ == "builtins":
        return text
    return f"{text} ({type(err).__name__}; --log-level DEBUG shows where)"


def _print_logprobs(title: str, logprobs) -> None:
    """A table on stderr: each token, its log probability, its rank (1: the
    target's likeliest), the likeliest there."""
    print(f"\n{title}:", file=sys.stderr)
    for lp in logprobs:
        top = "  ".join(f"{t.token!r} {t.logprob:.3f}" for t in lp.top_logprobs)
        print(f"{lp.token_id:>8} {lp.token!r:<16} {lp.logprob:9.4f} {'#' + str(lp.rank) if lp.rank else '':>7}"
              + (f"   top: {top}" if top else ""), file=sys.stderr)


def _print_result(result, args) -> None:
    if args.json:
        print(json.dumps(result.as_dict()))
        return
    if result.prompt is not None and result.prompt.logprobs:
        _print_logprobs("prompt", result.prompt.logprobs)
    if result.logprobs:
        _print_logprobs("completion", result.logprobs)
    s = result.stats
    reused = f", {result.cached_prompt_tokens} prompt tokens reused" if result.cached_prompt_tokens else ""
    if getattr(args, "reasoning_end", None):
        reused += f", {result.reasoning_tokens} of reasoning"
    print(
        f"\n[{result.finish_reason}{'' if result.stop_reason is None else ' ' + repr(result.stop_reason)}] "
        f"{result.completion_tokens} tokens, {s.rounds} rounds, "
        f"acceptance {result.acceptance_rate:.2f}, {s.total_ms / 1e3:.1f}s "
        f"({result.completion_tokens / max(s.total_ms / 1e3, 1e-9):.1f} tok/s){reused}",
        file=sys.stderr,
    )


def _server_tls(args):
    """The service's TLS (--tls-cert, --tls-key, --tls-client-ca), or None."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together: the certificate and its private key")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: client certificates are asked for over TLS")
    if not args.tls_cert:
        return None
    from tandem.tls import ServerTls

    return ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca)


def _client_tls(args):
    """The client's TLS (--tls, --tls-ca, --tls-cert and --tls-key), or None: plaintext."""
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return None
    from tandem.tls import channel_credentials

    try:
        return channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as err:
        raise SystemExit(f"tandem: {err}") from err


def _generate(args) -> int:
    from tandem.client import TandemClient, collect

    if (args.prompt is None) == (args.prompt_ids is None):
        print("tandem generate: give a prompt or --prompt-ids (one of them)", file=sys.stderr)
        return 2
    if args.suffix is not None and args.prompt is None:
        print("tandem generate: --suffix needs a text prompt (the text before the middle)", file=sys.stderr)
        return 2
    with TandemClient(args.address, tenant=args.tenant, timeout_s=args.timeout, api_key=args.api_key,
                      tls=_client_tls(args)) as client:
        stream = client.generate_stream(args.prompt, args.prompt_ids, prompt_logprobs=args.prompt_logprobs,
                                        suffix=args.suffix, **sampling_kwargs(args))
        show = None if args.json else (lambda d: print(d.text or "", end="", flush=True))
        result = collect(stream, on_delta=show)
    _print_result(result, args)
    return 0


def _chat(args) -> int:
    from tandem.client import TandemClient, collect

    with TandemClient(args.address, tenant=args.tenant, timeout_s=args.timeout, api_key=args.api_key,
                      tls=_client_tls(args)) as client:
        session = client.create_session(system_prompt=args.system)
        print(f"session {session}; an empty line or Ctrl-D ends the chat", file=sys.stderr)
        try:
            while True:
                try:
                    message = input("you> ")
                except EOFError:
                    break
                if not message.strip():
                    break
                if not args.json:
                    print("assistant> ", end="", flush=True)
                show = None if args.json else (lambda d: print(d.text or "", end="", flush=True))
                result = collect(client.chat_stream(session, message, **sampling_kwargs(args)), on_delta=show)
                _print_result(result, args)
        finally:
            client.delete_session(session)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import grpc

    try:
        if args.command == "serve":
            _serve(args)
            return 0
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "ray":
            from tandem import ray_cluster

            try:
                return {"up": ray_cluster.up, "status": ray_cluster.status,
                        "down": ray_cluster.down}[args.ray_command](args)
            except ray_cluster.NoCluster as err:
                print(f"tandem ray {args.ray_command}: {err}", file=sys.stderr)
                return 2
        if args.command == "batch":
            from tandem.batch import main as run_batch

            return run_batch(args)
        if args.command == "models":
            from tandem.default_models import main as fetch

            return fetch(["--which", args.which]) or 0
    except grpc.RpcError as err:
        print(f"tandem: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except StartupError as err:
        print(f"tandem serve {args.role}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
