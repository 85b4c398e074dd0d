"""The orchestrator's start-up half: pairs the draft and target services, loads
the tokenizer and chat template that go with them, and builds the Generation
that serves requests. A draft service that answers late is paired in the
background while the target serves alone (--draft-fallback)."""
from __future__ import annotations

import asyncio
import logging

import grpc

from orchestrator import fim
from orchestrator.backends import ServiceUnavailable
from orchestrator.config import MAX_TREE_WIDTH
from orchestrator.generation import EngineConfig, Generation
from orchestrator.request_reader import RequestReader
from orchestrator.text import ChatTemplate, check_chat_template
from tandem import placement
from tandem.tokenizer import load_tokenizer, tokenizer_fingerprint
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)
DRAFT_GRACE_S = 30.0  # at start, how long the draft service may lag the target before serving without it
PAIR_POLL_S = 2.0  # then, how often to ask it again


class PairingError(RuntimeError):
    """The services, the tokenizer or the chat template do not go together;
    the message says which, so start-up prints it as it is."""
    for_people = True


class Pairing:
    """Mixed into OrchestratorServicer, whose config, proposer, verifier and
    store it uses; it sets what pairing learns: target_info, draft_info,
    tokenizer, template, fim_format, fim_ends, reader, generation and
    pair_error."""

    async def connect(self, wait_s: float = 0.0) -> None:
        """Checks Redis and pairs the two model services (retrying up to wait_s).
        Raises PairingError when their tokenizers differ.

        With draft_fallback, a draft service that has not answered by then (nor
        within DRAFT_GRACE_S of the target) does not hold the orchestrator back:
        requests decode on the target alone, and a background task pairs the
        draft once it answers."""
        await self.store.ping()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        self.target_info = await self._model_info(self.verifier, "target", deadline)
        try:
            draft = await self._model_info(self.proposer, "draft", min(deadline, loop.time() + DRAFT_GRACE_S)
                                           if self.config.draft_fallback else deadline)
        except ServiceUnavailable as err:
            if not self.config.draft_fallback:
                raise
            log.warning("draft service unavailable (%s): serving on the target alone until it answers", err)
            draft = None
        if draft is not None and (mismatch := self._mismatch(draft)):
            self.pair_error = mismatch
            raise PairingError(mismatch)
        target = self.target_info
        self._load_tokenizer(target)
        self.reader = RequestReader(target, self.tokenizer, self.template, self.config.default_max_tokens,
                                    self.config.trust_request_chat_template,
                                    self.config.scheduling_policy == "priority")
        self.generation = Generation(
            self.proposer, self.verifier, self.store, self.tokenizer, set(target.eos_token_ids),
            EngineConfig(self.config.policy, self.config.pipeline, target.max_context, self.config.draft_fallback,
                         self.config.prefill_overlap, self._tree_width(target)),
        )
        self.pair_error = None
        if draft is None:
            self.generation.breaker.pause()
            if self._pairing is not None:
                self._pairing.cancel()
            self._pairing = asyncio.create_task(self._pair_draft_later())
        else:
            self._paired(draft)
            log.info("paired draft %s (%s) with target %s", draft.model_id, draft.backend, target.model_id)

    @staticmethod
    async def _model_info(client, role: str, deadline: float):
        while True:
            try:
                return await client.model_info()
            except ValueError as err:  # replicas that serve different models
                raise PairingError(str(err)) from None
            except ServiceUnavailable as err:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                log.info("waiting for the %s service (%s)", role, err)
                await asyncio.sleep(1.0)

    def _mismatch(self, draft) -> str | None:
        """Why `draft` cannot be paired with the target, or None."""
        target = self.target_info
        if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
            return (f"draft {draft.model_id!r} and target {target.model_id!r} do not share a tokenizer "
                    f"(fingerprints {draft.tokenizer_fingerprint[:12]} vs {target.tokenizer_fingerprint[:12]})")
        if draft.wire_version != target.wire_version:
            return (f"the draft service speaks wire version {draft.wire_version} and the target service "
                    f"{target.wire_version} (ModelInfo.wire_version): run the same Tandem release on both")
        return None

    async def _pair_draft_later(self) -> None:
        """Asks the draft service for its model every PAIR_POLL_S until it
        answers with one that matches the target, then lets rounds draft."""
        refused = None
        while True:
            await asyncio.sleep(PAIR_POLL_S)
            try:
                draft = await self.proposer.model_info()
                mismatch = self._mismatch(draft)
            except (ServiceUnavailable, grpc.aio.AioRpcError) as err:
                log.debug("draft service not answering yet: %s", err)
                continue
            except ValueError as err:  # its replicas serve different models
                mismatch = str(err)
            if mismatch:
                if mismatch != refused:
                    log.error("not drafting: %s; serving on the target alone", mismatch)
                    refused = mismatch
                continue
            self._paired(draft)
            self.generation.breaker.resume()
            log.warning("paired draft %s (%s) with target %s: drafting again", draft.model_id, draft.backend,
                        self.target_info.model_id)
            return

    def _paired(self, draft) -> None:
        """Takes `draft` as the paired draft service."""
        self.draft_info = draft
        self.generation.draft_max_context = draft.max_context
        self.generation.cores_shared = shared = placement.shared_cores(draft, self.target_info)
        if shared and self.config.prefill_overlap is None:
            log.info("prefill overlap off (auto): %s", shared)

    def _load_tokenizer(self, target) -> None:
        source = self.config.tokenizer or target.model_id
        if source == "none":
            if self.config.chat_template:
                raise PairingError("--chat-template needs a tokenizer: --tokenizer none serves token ids only")
            return
        from tandem.default_models import resolve_model

        tokenizer = load_tokenizer(resolve_model(source))
        if tokenizer is None and target.tokenizer_fingerprint != tokenizer_fingerprint(None, target.vocab_size):
            # The target has a tokenizer, and this machine could not load it (the
            # target's --model names a directory on another node, say).
            raise PairingError(f"the target model has a tokenizer, and none could be loaded from {source!r} here: "
                               "give --tokenizer (a directory or hub id with the target's tokenizer), "
                               "or --tokenizer none to serve token ids only")
        if tokenizer is not None and tokenizer_fingerprint(tokenizer, target.vocab_size) != target.tokenizer_fingerprint:
            raise PairingError(f"tokenizer {source!r} does not match the target model's")
        if self.config.chat_template:
            if tokenizer is None:
                raise PairingError(f"--chat-template needs a tokenizer, and the target model {source!r} has none")
            try:
                check_chat_template(tokenizer, self.config.chat_template)
            except ValueError as err:
                raise PairingError(f"--chat-template: {err}") from err
            tokenizer.chat_template = self.config.chat_template
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer, target.eos_token_ids)
        self.fim_format = fim.detect(tokenizer)
        self.fim_ends = fim.end_ids(tokenizer) if self.fim_format else frozenset()  # the vocabulary read once

    def _tree_width(self, target: common_pb2.ModelInfo) -> int:
        """--tree-width, or auto's: the target's suggestion. 0 where the target
        verifies the block alone (ModelInfo.block_only): alternatives sent to
        it would be drafted for nothing."""
        if target.block_only:
            if self.config.tree_width:
                log.warning("--tree-width %d: the target verifies the block alone (its lean forward, which batches "
                            "verifies or replays CUDA graphs, has no token trees), so no alternatives are drafted; "
                            "start the target with --batch-verifies 1 (and on a GPU --graphs off) for trees",
                            self.config.tree_width)
            return 0
        if self.config.tree_width is not None:
            return self.config.tree_width
        return min(target.tree_width, MAX_TREE_WIDTH)
