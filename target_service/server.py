"""gRPC face of the target service."""
from __future__ import annotations

import functools
import logging
import time

import torch

from tandem import cpu_kernels, multiplex, serving, telemetry
from tandem.batcher import CallBatcher
from tandem.distributions import decode_distributions
from tandem.lean import MAX_STATIC_ROWS, LeanRunner, unsupported
from tandem.logprobs import MAX_TOP_LOGPROBS
from tandem.model_service import CacheConfig, InvalidRequest, ModelServiceBase, inline_compute
from tandem.modeling import LoadedModel, ModelConfig, ModelRunner, load
from tandem.session_cache import SessionCacheStore
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from tandem.wire import sampling_from_proto
from target_service.relay import Relay, next_request
from target_service.verifier import PROMPT_CHUNK, Verifier, VerifyCall

log = logging.getLogger(__name__)
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


AMX_TREE_WIDTH = 4
AUTO_BATCH = 8  # --batch-verifies auto's batch on a CPU
GRAPHS = ("auto", "on", "off")


def target_runner(loaded: LoadedModel, device: str, graphs: str) -> ModelRunner | LeanRunner:
    """The runner of --graphs: on a GPU, a verify of up to MAX_STATIC_ROWS
    tokens replays a CUDA graph of the lean forward, captured once per block
    length and cache capacity (tandem/lean.py). A verify of 3+1 tokens of the
    default target is about 3.75 ms of kernels behind some 1,300 launches; on an
    H200 it took 6.19 ms replayed against 18.73 ms through Hugging Face's eager
    forward (bench/RESULTS.md). Longer feeds (a prompt) run the lean forward op
    by op. The lean forward verifies the block alone (no alternatives beside it).
    Off, and on a CPU: Hugging Face's forward, on the CPU kernels of
    tandem.cpu_kernels."""
    if graphs not in GRAPHS:
        raise ValueError(f"graphs must be one of {GRAPHS}, got {graphs!r}")
    gpu = torch.device(device).type == "cuda"
    reason = unsupported(loaded.model) if gpu else f"device {device} (CUDA graphs need a GPU)"
    if graphs == "on" and reason is not None:
        raise ValueError(f"--graphs on: {reason}")
    if graphs == "off" or reason is not None:
        if graphs == "auto" and gpu:
            log.info("verifies run Hugging Face's forward: the lean forward does not support %s", reason)
        return ModelRunner(loaded, device)
    log.info("verifies of up to %d tokens replay CUDA graphs of the lean forward", MAX_STATIC_ROWS)
    return LeanRunner(loaded, device, fused=False, graphs=True, static_rows=MAX_STATIC_ROWS)


def suggested_tree_width(model: ModelConfig, runner: ModelRunner) -> int:
    """ModelInfo.tree_width: AMX_TREE_WIDTH for bf16 on packed layers on a CPU
    with AMX, where a forward's cost barely grows with its rows (the default
    target on a 60-token cache, one thread: 1 / 4 / 8 tokens 270 / 276 / 280 ms;
    a block of 5 with 4 alternatives beside it 255-491 ms against 260-487 for
    the block alone, 24 pairs, bench/RESULTS.md); else 0: on other CPU kernels
    a verify's rows cost (FBGEMM or bf16w past 4-6 rows), and on a GPU it is
    not measured (one H200: 1 / 4 tokens 20.9 / 24.6 ms)."""
    if not runner.verifies_trees or model.device != "cpu":
        return 0
    if model.resolved_dtype == "bfloat16" and model.kernel == "packed" and cpu_kernels.amx_bf16():
        return AMX_TREE_WIDTH
    return 0


def auto_batch_verifies(model: ModelConfig, loaded: LoadedModel, runner) -> int:
    """--batch-verifies auto: AUTO_BATCH on a CPU, for a model the lean forward
    supports, where the target would not verify token trees (a lean target
    verifies the block alone, and on AMX the trees are what pays); else 1 (off).
    On a 2-core Zen 5 VM batching gave 1.10x one stream's tokens/s and 1.37x
    four's and eight's (bench/recorded/batch-probe-zen5-df674e6.json). On a GPU a
    lone verify replays a CUDA graph and a batch runs op by op: not measured,
    so off."""
    if model.device != "cpu":
        return 1
    if (reason := unsupported(loaded.model)) is not None:
        log.info("--batch-verifies auto: off (the lean forward does not support %s)", reason)
        return 1
    if suggested_tree_width(model, runner):
        log.info("--batch-verifies auto: off (verifies carry token trees here, which the lean forward does not)")
        return 1
    return AUTO_BATCH


class TargetServicer(ModelServiceBase, target_pb2_grpc.TargetServiceServicer):
    role = "target"

    def __init__(self, model: ModelConfig, cache: CacheConfig = CacheConfig(), graphs: str = "auto",
                 batch_verifies: int | None = None):
        """batch_verifies: --batch-verifies; None = auto (auto_batch_verifies)."""
        worker = serving.ModelWorker("target-model")
        info = worker.start_up(load, model)
        worker.inline = inline_compute(model.inline_compute, model.device)
        runner = worker.start_up(target_runner, info, model.device, graphs)
        if batch_verifies is None:
            batch_verifies = auto_batch_verifies(model, info, runner)
        if batch_verifies > 1 and not hasattr(runner, "forward_batch"):
            if (reason := unsupported(info.model)) is not None:
                raise ValueError(f"--batch-verifies needs the lean forward, which does not support {reason}")
            runner = LeanRunner(info, model.device, fused=False)
            log.info("verifies run the lean forward, so that up to %d sessions' blocks share one", batch_verifies)
        store = SessionCacheStore(runner.new_cache, cache.budget_mb * 2**20, cache.session_ttl_s)
        super().__init__(info, store, worker, model.chunk)
        self.verifier = Verifier(runner, store)
        self.batcher = (CallBatcher(worker, self.verifier.verify_batch, batch_verifies, lambda call: call.session_id,
                                    lambda call: call.priority, span="tandem.target.compute")
                        if batch_verifies > 1 else None)
        self.tree_width = suggested_tree_width(model, runner)
        self.block_only = not runner.verifies_trees
        self.relay = Relay()

    def _call(self, request) -> VerifyCall:
        self.check_session(request)
        vocab = self.info.vocab_size
        new_tokens = self.check_tokens(request.new_tokens, "new_tokens", vocab)
        draft_tokens = self.check_tokens(request.draft_tokens, "draft_tokens", vocab)
        try:
            sampling = sampling_from_proto(request.sampling, self.grammars)
        except ValueError as err:
            raise InvalidRequest(str(err)) from None
        self.check_context(request.prefix.length + len(new_tokens) + len(draft_tokens))
        draft_dists = None
        if not sampling.greedy and draft_tokens:
            k = len(draft_tokens)
            if len(request.draft_probs) != k or len(request.draft_distributions) != k:
                raise InvalidRequest(
                    f"sampling needs draft_probs and draft_distributions for each of the {k} draft tokens"
                )
            if not all(0 <= p <= 1 for p in request.draft_probs):  # NaN fails too
                raise InvalidRequest("draft_probs must lie in [0, 1]")
            try:
                draft_dists = decode_distributions(request.draft_distributions, request.draft_distribution_ids_i32)
            except ValueError as err:
                raise InvalidRequest(f"draft_distributions: {err}") from None
            if max(draft_tokens) >= draft_dists.shape[1]:
                raise InvalidRequest("a draft token lies outside its draft distribution's vocab_size")
        if request.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
        return VerifyCall(
            alternatives=self._alternatives(request, draft_tokens, sampling),
            logprobs=request.top_logprobs if request.return_logprobs else None,
            prompt_logprobs=request.top_logprobs if request.return_new_token_logprobs else None,
            session_id=request.session_id,
            prefix_len=request.prefix.length,
            prefix_fp=request.prefix.fingerprint,
            new_tokens=new_tokens,
            draft_tokens=draft_tokens,
            draft_probs=list(request.draft_probs),
            draft_dists=draft_dists,
            sampling=sampling,
            priority=request.priority,
        )

    def _alternatives(self, request, draft_tokens: list[int], sampling) -> tuple[tuple[int, int], ...]:
        """VerifyRequest.alternative_* as (position, token) pairs, checked."""
        positions, tokens = list(request.alternative_positions), list(request.alternative_tokens)
        if not positions and not tokens:
            return ()
        if len(positions) != len(tokens):
            raise InvalidRequest(f"{len(positions)} alternative_positions for {len(tokens)} alternative_tokens")
        if not sampling.greedy:
            raise InvalidRequest("alternatives are verified under greedy decoding only (temperature 0)")
        if len(set(positions)) != len(positions) or max(positions) >= len(draft_tokens):
            raise InvalidRequest(f"alternative_positions must be distinct positions of the {len(draft_tokens)} "
                                 f"draft tokens, got {positions}")
        tokens = self.check_tokens(tokens, "alternative_tokens", self.info.vocab_size)
        return tuple(zip(positions, tokens))

    def counts(self) -> dict[str, int]:
        batcher = self.batcher
        return dict(super().counts(), verify_batches=batcher.batches if batcher else 0,
                    batched_verifies=batcher.batched_calls if batcher else 0)

    async def VerifyStream(self, calls, context):
        """Verify calls multiplexed on one stream (tandem.multiplex)."""
        async for result in multiplex.serve_calls(calls, self.Verify, target_pb2.VerifyResult, common_pb2.CallError,
                                                  self.draining):
            yield result

    async def Verify(self, request, context):
        started = time.perf_counter()
        with telemetry.server_span(f"{SERVICE_NAME}/Verify", context) as span:
            call = await self.checked_call(context, request)
            if span.is_recording():
                span.set_attributes({"tandem.session_id": call.session_id, "tandem.prefix_length": call.prefix_len,
                                     "tandem.new_tokens": len(call.new_tokens), "tandem.k": len(call.draft_tokens)})
            if call.prompt_logprobs is None:
                call, fed = await self.prefill_ahead(context, call, self.verifier.feed)
            else:  # a scored prompt's chunks keep their rows' logits: at most PROMPT_CHUNK rows
                call, fed = await self.prefill_ahead(context, call, functools.partial(self.verifier.feed_scored, call),
                                                     chunk=min(self.prefill_chunk, PROMPT_CHUNK))
            def alone():
                return self.compute(self.verifier.verify, call, priority=call.priority,
                                    rows=len(call.new_tokens) + len(call.draft_tokens) + len(call.alternatives))

            if self.batcher is not None:
                outcome = await self.run_batched(context, self.batcher, call, alone)
            else:
                outcome = await self._mapped(context, alone())
            outcome = fed.onto(outcome, new_token_logprobs=fed.scores + outcome.new_token_logprobs)
            self.prefill_tokens += outcome.prefilled
            relay = request.relay
            if (call.draft_tokens and relay.draft_address and relay.num_tokens
                    and (outcome.accepted < len(call.draft_tokens) or relay.after_all_accepted)):
                self.relay.send(relay.draft_address,
                                next_request(request, outcome.accepted, outcome.next_token, outcome.more_tokens))
            if outcome.prefilled <= 1 and call.draft_tokens:  # as the orchestrator's verify_ms_p50
                telemetry.instruments().verify_compute.record(outcome.compute_ms * 1e-3)
            if span.is_recording():
                span.set_attributes({"tandem.accepted": outcome.accepted, "tandem.prefilled": outcome.prefilled,
                                     "tandem.cropped": outcome.cropped, "tandem.compute_ms": outcome.compute_ms})
            return target_pb2.VerifyReply(
                accepted=outcome.accepted,
                next_token=outcome.next_token,
                prefilled_tokens=outcome.prefilled,
                cropped_tokens=outcome.cropped,
                compute_ms=outcome.compute_ms,
                handler_ms=(time.perf_counter() - started) * 1e3,
                more_tokens=outcome.more_tokens,
                logprobs=_wire_logprobs(outcome.logprobs),
                new_token_logprobs=_wire_logprobs(outcome.new_token_logprobs),
            )


def _wire_logprobs(logprobs) -> list[target_pb2.TokenLogprobs]:
    return [target_pb2.TokenLogprobs(logprob=lp.logprob, top_tokens=lp.top_tokens, top_logprobs=lp.top_logprobs,
                                     rank=lp.rank)
            for lp in logprobs]


def build_server(address: str, model: ModelConfig, cache: CacheConfig = CacheConfig(), graphs: str = "auto",
                 batch_verifies: int | None = None, tls=None):
    """Returns (server, port, health, servicer); the caller starts the server.
    tls: a tandem.tls.ServerTls to serve with."""
    servicer = TargetServicer(model, cache, graphs, batch_verifies)

    def register(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return SERVICE_NAME

    server, port, health = serving.create_server(address, [register], tls.grpc_credentials() if tls else None)
    return server, port, health, servicer
