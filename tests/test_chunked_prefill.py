"""Chunked prefill (ModelConfig.prefill_chunk, --prefill-chunk): a call with
more new tokens than the chunk runs all but its last chunk ahead of it, one
chunk a worker call, so that other sessions' calls queued meanwhile run
between two chunks. Over real gRPC against a real tiny target; the
end-to-end suites run every test cluster with a chunk of 6 tokens, so their
greedy outputs, equal to the target alone's, are checked through it too."""
import asyncio
import threading

import grpc
import pytest

from tandem import fingerprint
from tandem.model_service import CacheConfig
from tandem.modeling import ModelConfig
from tandem.serving import is_cache_miss
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.conftest import Cluster, reference_greedy

PROMPT = [(7 * i + 3) % 120 + 1 for i in range(30)]  # 30 tokens: 4 chunks of 6 ahead, then 6 with the block
CHUNK = 6


def _verify(session_id: str, new_tokens: list[int], prefix: list[int] = (), drafts=(5, 6)):
    return target_pb2.VerifyRequest(
        session_id=session_id, new_tokens=new_tokens, draft_tokens=list(drafts),
        prefix=common_pb2.PrefixRef(length=len(prefix), fingerprint=fingerprint.of(prefix)))


async def _target(model_dir: str, chunk: int):
    """Unbatched: the calls queue on the worker itself, where the tests watch them."""
    from target_service.server import build_server

    server, port, _, servicer = build_server(
        "127.0.0.1:0", ModelConfig(model_dir, dtype="float32", inline_compute="off", prefill_chunk=chunk),
        CacheConfig(budget_mb=0, session_ttl_s=0), batch_verifies=1)
    await server.start()
    return server, servicer, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def _hold(worker) -> threading.Event:
    """A call that holds the worker until the event is set (not counted in
    its queue_depth, which counts the calls of ModelWorker.run)."""
    gate, started = threading.Event(), threading.Event()
    worker.submit(lambda: (started.set(), gate.wait()))
    assert started.wait(30)
    return gate


def _log_checkouts(servicer) -> list[tuple[str, int]]:
    """(session, new tokens after the named prefix) of each checkout, in the
    order the worker runs them."""
    seen, checkout = [], servicer.store.checkout

    def logged(session_id, prefix_len, prefix_fp):
        cache, cropped = checkout(session_id, prefix_len, prefix_fp)
        seen.append((session_id, prefix_len))
        return cache, cropped

    servicer.store.checkout = logged
    return seen


async def _queued(worker, depth: int) -> None:
    for _ in range(500):
        if worker.queue_depth >= depth:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the worker's queue never reached {depth}")


def test_another_sessions_verify_runs_between_two_chunks_of_a_long_prefill(tiny_models):
    async def run(chunk: int):
        server, servicer, channel = await _target(tiny_models["target"], chunk)
        try:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            seen = _log_checkouts(servicer)
            gate = _hold(servicer.worker)
            long = asyncio.ensure_future(stub.Verify(_verify("long", PROMPT)))
            await _queued(servicer.worker, 1)  # the long call's first chunk (or all of it) behind the held call
            short = asyncio.ensure_future(stub.Verify(_verify("short", PROMPT[:3])))
            await _queued(servicer.worker, 2)
            gate.set()
            replies = await asyncio.gather(long, short)
            stats = await stub.GetStats(common_pb2.GetStatsRequest())
            assert (await stub.GetModelInfo(common_pb2.GetModelInfoRequest())).prefill_chunk == chunk
            return seen, replies, stats
        finally:
            await channel.close()
            await server.stop(None)

    seen, (long, short), stats = asyncio.run(run(CHUNK))
    # The first chunk was queued first; the short call next; then the rest.
    assert seen == [("long", 0), ("short", 0), ("long", 6), ("long", 12), ("long", 18), ("long", 24)]
    assert long.prefilled_tokens == len(PROMPT) and stats.prefill_tokens == len(PROMPT) + 3
    assert stats.calls == 2 and stats.prefill_chunks == 4  # the chunks are not calls of their own

    whole_seen, (whole, _), whole_stats = asyncio.run(run(0))  # chunking off: the long prefill runs in one call, first
    assert whole_seen == [("long", 0), ("short", 0)]
    assert whole_stats.prefill_chunks == 0
    assert (long.accepted, long.next_token) == (whole.accepted, whole.next_token)  # the same verdict
    assert long.prefilled_tokens == whole.prefilled_tokens


def test_a_session_evicted_between_two_chunks_is_a_cache_miss_and_a_cancel_leaves_a_prefix(tiny_models):
    async def run():
        server, servicer, channel = await _target(tiny_models["target"], CHUNK)
        try:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            gate = _hold(servicer.worker)
            long = asyncio.ensure_future(stub.Verify(_verify("gone", PROMPT)))
            await _queued(servicer.worker, 1)
            servicer.worker.submit(servicer.store.release, "gone")  # runs right after the first chunk
            gate.set()
            with pytest.raises(grpc.aio.AioRpcError) as missed:
                await long
            assert is_cache_miss(missed.value)  # FAILED_PRECONDITION, marked: the orchestrator re-syncs

            # Cancelled between chunks: the cache holds a prefix of the prompt,
            # which the next call names and extends.
            gate = _hold(servicer.worker)
            call = stub.Verify(_verify("cut", PROMPT))
            waiting = asyncio.ensure_future(call)
            await _queued(servicer.worker, 1)
            stopped, resume = threading.Event(), threading.Event()
            servicer.worker.submit(lambda: (stopped.set(), resume.wait()))  # holds the worker after the first chunk
            gate.set()
            await asyncio.to_thread(stopped.wait, 30)
            call.cancel()  # while the worker is held: the second chunk, if queued, never runs
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await asyncio.sleep(0.2)
            resume.set()
            await asyncio.sleep(0.2)
            held = await asyncio.to_thread(lambda: list(servicer.store.peek("cut").tokens))
            assert held == PROMPT[:CHUNK]
            reply = await stub.Verify(_verify("cut", PROMPT[len(held):], prefix=held))
            return reply, len(held)
        finally:
            await channel.close()
            await server.stop(None)

    reply, held = asyncio.run(run())
    assert reply.prefilled_tokens == len(PROMPT) - held


def test_a_scored_prompt_in_chunks_scores_every_token_as_a_whole_one_does(tiny_models):
    """prompt_logprobs: the chunks keep their rows' logits, and each scores
    the tokens after its first through the next chunk's first."""
    async def run(chunk: int):
        server, servicer, channel = await _target(tiny_models["target"], chunk)
        try:
            request = _verify("scored", PROMPT)
            request.return_new_token_logprobs, request.top_logprobs = True, 3
            reply = await target_pb2_grpc.TargetServiceStub(channel).Verify(request)
            return reply, servicer.prefill_chunks
        finally:
            await channel.close()
            await server.stop(None)

    (chunked, chunks), (whole, none) = asyncio.run(run(CHUNK)), asyncio.run(run(0))
    assert (chunks, none) == (4, 0)
    assert len(chunked.new_token_logprobs) == len(whole.new_token_logprobs) == len(PROMPT) - 1
    for a, b in zip(chunked.new_token_logprobs, whole.new_token_logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and a.rank == b.rank
        assert list(a.top_tokens) == list(b.top_tokens)
    assert (chunked.accepted, chunked.next_token) == (whole.accepted, whole.next_token)


async def _draft_run(model_dir: str, chunk: int, backend: str, prompt: list[int]):
    """One Propose of `prompt` on a fresh draft service: (the checkouts, the
    reply, the model's fed tokens in the session's cache after it)."""
    from draft_service.server import DraftOptions, build_server

    server, port, _, servicer = build_server(
        "127.0.0.1:0", ModelConfig(model_dir, dtype="float32", inline_compute="off", prefill_chunk=chunk),
        CacheConfig(budget_mb=0, session_ttl_s=0), DraftOptions(backend=backend, quantize="none"))
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        seen = _log_checkouts(servicer)
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        assert (await stub.GetModelInfo(common_pb2.GetModelInfoRequest())).prefill_chunk == chunk
        reply = await stub.Propose(draft_pb2.ProposeRequest(
            session_id="d", new_tokens=prompt, num_tokens=4, prefix=common_pb2.PrefixRef(length=0)))
        fed = await asyncio.to_thread(lambda: servicer.store.peek("d").kv_len)
        return seen, reply, fed
    finally:
        await channel.close()
        await server.stop(None)


@pytest.mark.parametrize("backend", ["model", "ngram+model"])
def test_a_drafts_long_prefill_runs_in_chunks_and_drafts_what_it_drafts_whole(tiny_models, backend):
    """PROMPT repeats no n-gram, so the n-gram + model draft's model drafts too."""
    seen, chunked, _ = asyncio.run(_draft_run(tiny_models["other"], CHUNK, backend, PROMPT))
    assert seen == [("d", at) for at in range(0, len(PROMPT), CHUNK)]
    whole_seen, whole, _ = asyncio.run(_draft_run(tiny_models["other"], 0, backend, PROMPT))
    assert whole_seen == [("d", 0)]
    assert list(chunked.tokens) == list(whole.tokens) and len(whole.tokens) == 4
    assert chunked.prefilled_tokens == whole.prefilled_tokens == len(PROMPT)


def test_the_ngram_and_model_draft_fills_its_model_in_chunks_while_lookup_drafts(tiny_models):
    """A prompt whose n-grams repeat: lookup drafts, and the model holds all but
    the last chunk (whole: nothing), so that a later miss catches up on one chunk."""
    prompt = [(i % 5) + 10 for i in range(30)]
    seen, chunked, fed = asyncio.run(_draft_run(tiny_models["other"], CHUNK, "ngram+model", prompt))
    assert seen == [("d", at) for at in range(0, len(prompt), CHUNK)] and fed == len(prompt) - CHUNK
    _, whole, whole_fed = asyncio.run(_draft_run(tiny_models["other"], 0, "ngram+model", prompt))
    assert whole_fed == 0
    assert list(chunked.tokens) == list(whole.tokens) == [10, 11, 12, 13]


def test_the_ngram_drafter_does_not_chunk_and_says_so(tiny_models):
    from draft_service.server import DraftOptions, DraftServicer

    def servicer(backend: str):
        return DraftServicer(ModelConfig(tiny_models["other"], dtype="float32", prefill_chunk=CHUNK),
                             CacheConfig(budget_mb=0, session_ttl_s=0), DraftOptions(backend=backend, quantize="none"))

    alone = servicer("ngram")
    assert not alone.feeds_ahead and alone.model_info().prefill_chunk == 0
    paired = servicer("ngram+model")
    assert paired.feeds_ahead and paired.model_info().prefill_chunk == CHUNK


def test_end_to_end_a_long_prompt_in_chunks_equals_the_target_alone(tiny_models):
    """A prompt of 10 chunks on both sides, greedy, pipelined and not."""
    prompt = [(11 * i + 5) % 127 for i in range(60)]
    expected = reference_greedy(tiny_models["target"], prompt, 24)
    cluster = Cluster(tiny_models["target"], tiny_models["other"], prefill_chunk=CHUNK)
    try:
        with cluster.client() as client:
            for pipeline in (True, False):
                result = client.generate(prompt_ids=prompt, max_tokens=24, temperature=0, pipeline=pipeline)
                assert result.token_ids == expected
    finally:
        cluster.stop()


def test_the_flag_takes_a_size_0_or_auto_which_depends_on_the_device():
    from tandem.modeling import CPU_PREFILL_CHUNK, GPU_PREFILL_CHUNK
    from tests.test_cli import COMMANDS

    for role in ("target", "draft"):
        parser = COMMANDS[f"tandem serve {role}"]
        assert parser.parse_args(["--model", "m", "--prefill-chunk", "64"]).prefill_chunk == 64
        assert parser.parse_args(["--model", "m", "--prefill-chunk", "0"]).prefill_chunk == 0
        assert parser.parse_args(["--model", "m"]).prefill_chunk is None  # auto
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "m", "--prefill-chunk", "-1"])
        help_text = " ".join(parser.format_help().split())
        assert f"auto = {CPU_PREFILL_CHUNK} on a CPU, {GPU_PREFILL_CHUNK} on a GPU" in help_text
    assert ModelConfig("m").chunk == CPU_PREFILL_CHUNK and ModelConfig("m", device="cuda").chunk == GPU_PREFILL_CHUNK
    assert ModelConfig("m", prefill_chunk=0).chunk == 0
    with pytest.raises(ValueError, match="prefill_chunk must be >= 0"):
        ModelConfig("m", prefill_chunk=-5)


def test_the_prefill_probe_runs_on_the_tiny_pair_with_the_same_tokens_on_both_sides(char_models, tmp_path):
    """bench.prefill_probe on the tiny pair: real processes, a chunked side and
    a whole side; both requests' tokens are the same on both, and the decoding
    stream's gaps while the long prompt ran are measured (its 400 tokens
    outlast the long request's few)."""
    import json

    from bench.prefill_probe import main

    out = tmp_path / "prefill_probe.json"
    assert main(["--target", char_models["target"], "--draft", char_models["draft"], "--draft-args", "", "--dtype", "float32",
                 "--chunk", "16", "--prompt-tokens", "200", "--long-tokens", "4", "--new-tokens", "400",
                 "--reps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical_passes"] == result["passes"] == 1
    assert list(result["modes"]) == ["chunk 16", "chunk 0 (whole)"]
    for run in (runs[0] for runs in result["runs"].values()):
        assert run["long_ttft_s"] > 0 and run["decode_gaps_during_long"] >= 1 and run["decode_tok_s"] > 0


def test_the_probes_forward_only_timing_covers_every_length_whole_and_in_chunks(tiny_models):
    from bench.prefill_probe import forward_only

    rows = forward_only(tiny_models["target"], lengths=(16, 32), chunks=(32, 8))["forward_only"]
    assert [(r["tokens"], r["chunk"]) for r in rows] == [(16, 16), (16, 8), (32, 32), (32, 8)]
    assert all(r["seconds"] > 0 and r["tok_s"] == r["tokens"] / r["seconds"] for r in rows)
