"""gRPC face of the draft service."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

from draft_service.cheap import (INT4_KERNELS, QUANTIZE, ReducedHead, auto_quantize, frequent_token_ids, int4_kernel,
                                 quantize_int4, quantize_int8)
from draft_service.drafters import NgramDrafter, Proposal, ProposeCall
from draft_service.model_drafter import ModelDrafter, NgramModelDrafter
from draft_service.prepared import Overtaken, Prepared, skip_held
from tandem import multiplex, serving, telemetry
from tandem.cpu_kernels import native_bf16, pack_linears
from tandem.distributions import encode_distributions
from tandem.batcher import CallBatcher
from tandem.lean import LEAN_STEP, lean_runner, unsupported
from tandem.model_service import INLINE_MAX_ROWS, CacheConfig, InvalidRequest, ModelServiceBase, inline_compute
from tandem.modeling import LoadedModel, ModelConfig, ModelRunner, load, load_identity
from tandem.session_cache import NullKV, SessionCacheStore
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from tandem.wire import sampling_from_proto

log = logging.getLogger(__name__)
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
MAX_DRAFT_TOKENS = 64
BACKENDS = ("model", "ngram", "ngram+model")


@dataclass(frozen=True)
class DraftOptions:
    """Which draft backend answers Propose."""

    backend: str = "model"  # "model", "ngram" (prompt lookup) or "ngram+model"
    vocab_subset: int = 0  # FR-Spec: score only the N most frequent tokens; 0 = all
    ngram_max: int = 4  # longest n-gram matched by prompt lookup
    quantize: str = "none"  # "int8" (dynamic, float32), "int4" (on int4_kernel's kernel), "auto": cheap.auto_quantize
    min_confidence: float = 0.0  # greedy: end a block after a token the draft gives less than this; 0 = never
    lean_step: str = "auto"  # tandem.lean: "on", "aten", "off", "auto" (for the models it supports)
    int4_kernel: str = "auto"  # Int4Linear's kernel under quantize="int4": "i4w", "aten", "auto": cheap.int4_kernel
    # greedy blocks of up to N sessions that queue drafted in lockstep; 1 = off; None = auto (auto_batch_drafts)
    batch_drafts: int | None = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.vocab_subset < 0 or self.ngram_max < 1:
            raise ValueError("vocab_subset must be >= 0 and ngram_max >= 1")
        if not 0 <= self.min_confidence < 1:
            raise ValueError(f"min_confidence must be in [0, 1), got {self.min_confidence}")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {QUANTIZE}, got {self.quantize!r}")
        if self.lean_step not in LEAN_STEP:
            raise ValueError(f"lean_step must be one of {LEAN_STEP}, got {self.lean_step!r}")
        if self.int4_kernel not in INT4_KERNELS:
            raise ValueError(f"int4_kernel must be one of {INT4_KERNELS}, got {self.int4_kernel!r}")
        if self.batch_drafts is not None and self.batch_drafts < 1:
            raise ValueError(f"batch_drafts must be >= 1, got {self.batch_drafts}")
        if (self.batch_drafts or 1) > 1 and self.backend != "model":
            raise ValueError(f"batch_drafts needs the model backend (prompt lookup runs no forward), "
                             f"not {self.backend!r}")

    @property
    def label(self) -> str:
        label = self.backend
        if self.backend != "ngram":
            label += f"/{self.quantize}" if self.quantize != "none" else ""
            label += f"({self.int4_kernel})" if self.quantize == "int4" and self.int4_kernel != "auto" else ""
            label += f"/vocab={self.vocab_subset}" if self.vocab_subset else ""
            label += f"/confidence>={self.min_confidence:g}" if self.min_confidence else ""
            label += f"/batch={self.batch_drafts}" if (self.batch_drafts or 1) > 1 else ""
        return label


AUTO_BATCH = 8  # --batch-drafts auto's batch on a CPU


def auto_batch_drafts(model: ModelConfig, options: DraftOptions, runner) -> int:
    """--batch-drafts auto: AUTO_BATCH on a CPU for the model backend on the
    lean step, else 1 (off). With the target's --batch-verifies auto, both
    batching gave 1.10x one stream's tokens/s and 1.37x four's and eight's on a
    2-core Zen 5 VM (bench/recorded/batch-probe-zen5-df674e6.json). On a GPU a
    lone step replays a CUDA graph and a batch runs op by op: not measured, so
    off."""
    if model.device != "cpu" or options.backend != "model":
        return 1
    if runner is None:
        log.info("--batch-drafts auto: off (the draft step is not the lean one)")
        return 1
    return AUTO_BATCH


def _special_ids(info) -> set[int]:
    special = set(info.eos_token_ids)
    if info.tokenizer is not None:
        special |= set(info.tokenizer.all_special_ids)
        special |= {i for i in getattr(info.tokenizer, "added_tokens_decoder", {})}
    return special


def _load_draft(model: ModelConfig, options: DraftOptions) -> tuple[LoadedModel, ReducedHead | None]:
    """The draft model made cheap as `options` say (resolved by DraftServicer:
    no "auto" left), and its reduced head if any."""
    info = load(model, pack=False)
    lm_head = info.model.get_output_embeddings().weight.detach()  # before quantization replaces it
    int4 = options.int4_kernel if options.quantize == "int4" else None
    if options.quantize == "int8":
        info = replace(info, model=quantize_int8(info.model))
    elif options.quantize == "int4":
        info = replace(info, model=quantize_int4(info.model, kernel=int4))
    elif model.packed:
        pack_linears(info.model, model.kernel)
    head = None
    if options.vocab_subset:
        ids = frequent_token_ids(info.vocab_size, options.vocab_subset, list(_special_ids(info)))
        head = ReducedHead(lm_head, ids, quantize=options.quantize, kernel=model.kernel, int4=int4)
        log.info("reduced draft head: %d of %d tokens", len(ids), info.vocab_size)
    return info, head


def queue_place(call: ProposeCall) -> int:
    """The call's place in the draft worker's queue, the lowest first: by its
    request's priority, and within one priority a draft the orchestrator
    waits for before a pre-draft (first_is_bonus_guess), which is
    speculative and runs beside its own verify."""
    return 2 * call.priority + call.first_is_bonus_guess


class DraftServicer(ModelServiceBase, draft_pb2_grpc.DraftServiceServicer):
    role = "draft"

    def __init__(self, model: ModelConfig, cache: CacheConfig = CacheConfig(), options: DraftOptions = DraftOptions()):
        if options.quantize == "auto" and options.backend != "ngram":
            options = replace(options, quantize=auto_quantize(model.device))
            log.info("--quantize auto: %s", options.quantize)
        if options.quantize == "int4" and options.backend != "ngram":
            options = replace(options, int4_kernel=int4_kernel(options.int4_kernel))  # the label names auto's choice
        self.backend = options.label
        budget = cache.budget_mb * 2**20
        if options.backend == "ngram":
            info = load_identity(model)
            store = SessionCacheStore(NullKV, budget, cache.session_ttl_s)
            inline = inline_compute(model.inline_compute, model.device, torch_compute=False)
            super().__init__(info, store, serving.ModelWorker("draft-ngram", inline=inline))
            self.drafter = NgramDrafter(store, info.vocab_size, options.ngram_max)
            self.prepared = Prepared(store, self._run_prepared)
            self.batcher = None
            return
        if options.quantize != "none" and model.device != "cpu":
            kernel = "fbgemm" if options.quantize == "int8" else "CPU int4 kernels"
            raise ValueError(f"--quantize {options.quantize} runs on the CPU only ({kernel}), not on {model.device}")
        int4 = options.int4_kernel if options.quantize == "int4" else None
        compute = {"int8": "float32", "int4": "bfloat16" if int4 == "aten" else "float32"}.get(options.quantize)
        if compute and model.resolved_dtype != compute:
            log.info("%s quantization computes in %s: loading the draft in %s", options.quantize, compute, compute)
            model = replace(model, dtype=compute, linear="native")
        if int4 == "aten" and not native_bf16():
            log.warning("--quantize int4 on a CPU without native bf16: its int4 kernel is slow here; "
                        "--quantize int8 (or auto) is faster")
        worker = serving.ModelWorker("draft-model")
        info, head = worker.start_up(_load_draft, model, options)
        worker.inline = inline_compute(model.inline_compute, model.device)
        runner = lean_runner(info, model.device, options.lean_step)
        batch_drafts = options.batch_drafts
        if batch_drafts is None:
            batch_drafts = auto_batch_drafts(model, options, runner)
        self.backend = replace(options, batch_drafts=batch_drafts).label  # names auto's choice
        if runner is None:
            if batch_drafts > 1:
                reason = unsupported(info.model) or f"--lean-step {options.lean_step}"
                raise ValueError(f"--batch-drafts needs the lean draft step, which is off here ({reason})")
            runner = ModelRunner(info, model.device)
        else:
            self.backend += "/lean+graphs" if runner.graphs else "/lean"
        store = SessionCacheStore(runner.new_cache, budget, cache.session_ttl_s)
        super().__init__(info, store, worker, model.chunk)
        if options.backend == "ngram+model":
            self.drafter = NgramModelDrafter(runner, store, head, options.ngram_max, options.min_confidence)
        else:
            self.drafter = ModelDrafter(runner, store, head, options.min_confidence)
        self.prepared = Prepared(store, self._run_prepared)
        self.batcher = None
        if batch_drafts > 1:
            self.batcher = CallBatcher(worker, self._propose_batch, batch_drafts,
                                       lambda item: item[0].session_id, lambda item: queue_place(item[0]),
                                       span="tandem.draft.compute")
            log.info("greedy blocks of up to %d sessions that queue are drafted in lockstep", batch_drafts)

    @property
    def feeds_ahead(self) -> bool:
        """Whether a long prefill runs in chunks: a drafter with a model (not
        the n-gram drafter alone)."""
        return getattr(self.drafter, "feed", None) is not None

    def _call(self, request) -> ProposeCall:
        self.check_session(request)
        new_tokens = self.check_tokens(request.new_tokens, "new_tokens", self.drafter.vocab_size)
        if not 1 <= request.num_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidRequest(f"num_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {request.num_tokens}")
        try:
            sampling = sampling_from_proto(request.sampling, self.grammars)
        except ValueError as err:
            raise InvalidRequest(str(err)) from None
        self.check_context(request.prefix.length + len(new_tokens) + request.num_tokens - 1)  # the last is not run
        return ProposeCall(
            session_id=request.session_id,
            prefix_len=request.prefix.length,
            prefix_fp=request.prefix.fingerprint,
            new_tokens=new_tokens,
            num_tokens=request.num_tokens,
            sampling=sampling,
            return_dists=request.return_distributions,
            first_is_bonus_guess=request.first_is_bonus_guess,
            alternatives=request.return_alternatives,
            priority=request.priority,
        )

    async def ProposeStream(self, calls, context):
        """Propose calls multiplexed on one stream (tandem.multiplex)."""
        async for result in multiplex.serve_calls(calls, self.Propose, draft_pb2.ProposeResult, common_pb2.CallError,
                                                  self.draining):
            yield result

    @staticmethod
    def _rows(call: ProposeCall) -> int | None:
        """The token rows a call computes, for the inline rule: None for a
        pre-draft (it starts with a bonus guess), which runs beside the verify,
        off the critical path, and stays on the model thread, where a cancel
        stops it between steps; a draft the orchestrator waits for may run inline."""
        return None if call.first_is_bonus_guess else len(call.new_tokens) + call.num_tokens - 1

    def _propose(self, call: ProposeCall, cancelled: threading.Event, noted: int | None) -> Proposal:
        """A Propose call's drafting, on the model worker; `noted`: a
        pre-draft's last_fresh on arrival (None for any other call)."""
        if noted is not None:
            self.prepared.check_not_overtaken(call, noted)
        return self.drafter.propose(call, cancelled)

    def _propose_batch(self, items: list[tuple[ProposeCall, threading.Event, int | None]]) -> list:
        """As _propose, for the calls drafted in lockstep (--batch-drafts)."""
        results: list = [None] * len(items)
        live = []
        for index, (call, cancelled, noted) in enumerate(items):
            try:
                if noted is not None:
                    self.prepared.check_not_overtaken(call, noted)
                live.append(index)
            except Overtaken as err:
                results[index] = err
        if live:
            drafted = self.drafter.propose_batch([items[index][:2] for index in live])
            for index, result in zip(live, drafted):
                results[index] = result
        return results

    def _propose_prepared(self, call: ProposeCall, cancelled: threading.Event) -> Proposal | None:
        held = skip_held(self.store, call)
        return None if held is None else self.drafter.propose(held, cancelled)

    async def _run_prepared(self, call: ProposeCall, cancelled: threading.Event) -> Proposal | None:
        """A Prepare's drafting, on the model worker like a Propose call's."""
        rows = self._rows(call)
        return await self.worker.run(self._propose_prepared, call, cancelled, cancelled=cancelled,
                                     span=f"tandem.{self.role}.compute", short=rows is not None and rows <= INLINE_MAX_ROWS,
                                     priority=queue_place(call))

    async def Prepare(self, requests, context):
        """Propose requests sent by the target on its verdicts (draft_service.prepared)."""
        received = 0
        async for request in requests:
            received += 1
            self.prepared.received += 1
            try:
                call = self._call(request)
            except InvalidRequest as err:
                log.debug("prepare ignored: %s", err)
                continue
            self.prepared.begin(call)
        return draft_pb2.PrepareSummary(received=received)

    async def ReleaseSession(self, request, context):
        self.prepared.release(request.session_id)
        return await super().ReleaseSession(request, context)

    async def ForkSession(self, request, context):
        self.prepared.release(request.session_id)  # a draft begun for the session's old cache
        return await super().ForkSession(request, context)

    def counts(self) -> dict[str, int]:
        batcher = self.batcher
        return dict(super().counts(), prepared=self.prepared.received, prepared_started=self.prepared.started,
                    prepared_used=self.prepared.used, predrafts_overtaken=self.prepared.overtaken,
                    draft_batches=batcher.batches if batcher else 0,
                    batched_drafts=batcher.batched_calls if batcher else 0)

    def batchable(self, call: ProposeCall) -> bool:
        """Whether the call may be drafted beside others (--batch-drafts): greedy
        only. A batched step's arithmetic is not a lone step's to the last bit,
        and a sampled call's draws must be, so that its seed gives the same
        tokens whatever else the service drafts; a greedy draft may move, and
        the target's verdict, hence the output, does not."""
        return self.batcher is not None and call.sampling.greedy

    async def Propose(self, request, context):
        started = time.perf_counter()
        with telemetry.server_span(f"{SERVICE_NAME}/Propose", context) as span:
            call = await self.checked_call(context, request)
            if span.is_recording():
                span.set_attributes({"tandem.session_id": call.session_id, "tandem.prefix_length": call.prefix_len,
                                     "tandem.new_tokens": len(call.new_tokens), "tandem.k": call.num_tokens,
                                     "tandem.bonus_guess": call.first_is_bonus_guess})
            taken = await self.prepared.take(call)
            if taken is not None:
                self.calls += 1
                proposal = taken.proposal
            else:
                # A pre-draft does not run after a fresh call of its session that
                # arrived after it on another history (draft_service.prepared.Overtaken).
                noted = self.prepared.last_fresh(call.session_id) if call.first_is_bonus_guess else None
                cancelled = threading.Event()
                context.add_done_callback(lambda _: cancelled.set())
                call, fed = await self.prefill_ahead(context, call, getattr(self.drafter, "feed", None),
                                                     queue_place(call))

                def alone(call=call):
                    return self.compute(self._propose, call, cancelled, noted, cancelled=cancelled,
                                        rows=self._rows(call), priority=queue_place(call))

                if self.batchable(call):
                    proposal = await self.run_batched(context, self.batcher, (call, cancelled, noted), alone)
                else:
                    proposal = await self._mapped(context, alone())
                proposal = fed.onto(proposal)
            self.prefill_tokens += proposal.prefilled
            if proposal.step_ms:
                telemetry.instruments().draft_step.record(proposal.step_ms * 1e-3)
            if span.is_recording():
                span.set_attributes({"tandem.drafted": len(proposal.tokens), "tandem.prefilled": proposal.prefilled,
                                     "tandem.cropped": proposal.cropped, "tandem.compute_ms": proposal.compute_ms,
                                     "tandem.prepared": taken is not None})
            distributions, distribution_ids = encode_distributions(proposal.dists)
            return draft_pb2.ProposeReply(
                tokens=proposal.tokens,
                token_probs=proposal.token_probs,
                distributions=distributions,
                distribution_ids_i32=distribution_ids,
                prefilled_tokens=proposal.prefilled,
                cropped_tokens=proposal.cropped,
                compute_ms=proposal.compute_ms,
                step_ms=proposal.step_ms,
                handler_ms=taken.handler_ms if taken is not None else (time.perf_counter() - started) * 1e3,
                prepared=taken is not None,
                alternatives=proposal.alternatives,
            )


def build_server(address: str, model: ModelConfig, cache: CacheConfig = CacheConfig(),
                 options: DraftOptions = DraftOptions(), tls=None):
    """Returns (server, port, health, servicer); the caller starts the server.
    tls: a tandem.tls.ServerTls to serve with."""
    servicer = DraftServicer(model, cache, options)

    def register(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
        return SERVICE_NAME

    server, port, health = serving.create_server(address, [register], tls.grpc_credentials() if tls else None)
    return server, port, health, servicer
