"""Alternatives verified beside a block (--tree-width): the target's forward of a
one-level token tree, the path a verdict keeps, and end to end the output still
equals the target alone while rounds take alternatives."""
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_service.drafters import ProposeCall
from draft_service.model_drafter import ModelDrafter
from tandem.modeling import ModelConfig, ModelRunner, load
from tandem.sampling import SamplingParams
from tandem.session_cache import SessionCacheStore
from tests.conftest import DEVICE, Cluster, reference_greedy

PROMPTS = ([3, 1, 4, 1, 5, 9, 2, 6], [10, 20, 30, 40, 50, 60, 10, 20], list(range(5, 45, 2)))


def _runner(model_dir: str) -> ModelRunner:
    return ModelRunner(load(ModelConfig(model_dir, dtype="float32")), "cpu")


def test_forward_tree_gives_each_row_what_its_own_sequence_gives(tiny_models):
    runner = _runner(tiny_models["target"])
    prompt, block = [3, 1, 4, 1, 5, 9], [7, 8, 9, 10]
    alternatives = [(0, 20), (1, 21), (3, 23)]

    def fresh():
        cache = runner.new_cache()
        runner.forward(cache, prompt, 1)
        return cache

    tree_cache = fresh()
    chain, after = runner.forward_tree(tree_cache, [2] + block, len(block), alternatives)
    reference = runner.forward_block(fresh(), [2] + block, len(block))
    torch.testing.assert_close(chain, reference, atol=1e-4, rtol=0)
    assert tree_cache.get_seq_length() == len(prompt) + 1 + len(block) + len(alternatives)
    for i, (position, token) in enumerate(alternatives):
        own = runner.forward_block(fresh(), [2] + block[:position] + [token], position + 1)[-1]
        torch.testing.assert_close(after[i], own, atol=1e-4, rtol=0)
        # Keep the path through alternative i: the cache then decodes as one fed that path.
        kept = fresh()
        runner.forward_tree(kept, [2] + block, len(block), alternatives)
        keep = len(prompt) + 1 + position + 1
        runner.keep_path(kept, keep, moved_from=len(prompt) + 1 + len(block) + i)
        path = fresh()
        runner.forward(path, [2] + block[:position] + [token], 1)
        assert kept.get_seq_length() == path.get_seq_length() == keep
        torch.testing.assert_close(runner.forward(kept, [11], 1), runner.forward(path, [11], 1), atol=1e-4, rtol=0)


def test_the_draft_ranks_a_runner_up_for_each_token_it_proposes(tiny_models, near_draft):
    runner = _runner(near_draft)
    drafter = ModelDrafter(runner, SessionCacheStore(runner.new_cache))
    call = ProposeCall("s", 0, 0, [3, 1, 4, 1, 5], 4, SamplingParams(), False, False, alternatives=True)
    proposal = drafter.propose(call, cancelled=threading.Event())
    assert len(proposal.alternatives) == len(proposal.tokens) == 4
    history = [3, 1, 4, 1, 5]
    model = AutoModelForCausalLM.from_pretrained(near_draft, dtype=torch.float32).eval()
    for token, runner_up in zip(proposal.tokens, proposal.alternatives):
        with torch.inference_mode():
            logits = model(torch.tensor([history])).logits[0, -1]
        assert [token, runner_up] == logits.topk(2).indices.tolist()
        history.append(token)
    unasked = drafter.propose(ProposeCall("t", 0, 0, [3, 1, 4, 1, 5], 4, SamplingParams(), False, False),
                              cancelled=threading.Event())
    assert unasked.tokens == proposal.tokens and unasked.alternatives == []


@pytest.mark.parametrize("relay", [False, True])
def test_rounds_take_alternatives_and_stay_exact(tiny_models, near_draft, relay):
    cluster = Cluster(tiny_models["target"], near_draft, tree_width=4, relay=relay, target_graphs="off",
                      target_batch=1)  # Hugging Face's forward: the lean one verifies no trees
    try:
        with cluster.client() as client:
            assert client.server_info().tree_width == 4
            hits = rounds = committed = 0
            for prompt in PROMPTS:
                for pipeline in (False, True):
                    result = client.generate(prompt_ids=prompt, max_tokens=32, num_draft_tokens=4, pipeline=pipeline)
                    assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 32)
                    hits += result.stats.alternative_hits
                    rounds += result.stats.rounds
                    committed += len(result.token_ids)
            # Each alternative taken commits two tokens where the block alone would commit one.
            assert hits > 0, "no round took an alternative"
            assert committed <= rounds * 5 + hits  # at most k + 1 a round, one more with an alternative
            # A chat's second turn goes on from the caches the alternatives' rounds left.
            session = client.create_session()
            first = client.chat(session, message_ids=PROMPTS[0], max_tokens=20, num_draft_tokens=4)
            second = client.chat(session, message_ids=[7, 7, 7], max_tokens=20, num_draft_tokens=4)
            client.delete_session(session)
            assert second.stats.cache_misses == 0
            history = PROMPTS[0] + first.token_ids + [7, 7, 7]
            assert second.token_ids == reference_greedy(tiny_models["target"], history, 20)
            # Sampling verifies the block alone: no alternatives are sent.
            sampled = client.generate(prompt_ids=PROMPTS[0], max_tokens=16, temperature=1.0, seed=5)
            assert sampled.stats.alternative_hits == 0 and len(sampled.token_ids) == 16
    finally:
        cluster.stop()


def test_the_target_suggests_a_width_only_where_wide_verifies_cost_little(monkeypatch):
    from target_service.server import AMX_TREE_WIDTH, suggested_tree_width
    from tandem import cpu_kernels

    class Runner:
        verifies_trees = True

    for name in ("packed_available", "native_bf16", "amx_bf16"):
        monkeypatch.setattr(cpu_kernels, name, lambda: True)
    amx = ModelConfig("m", dtype="bfloat16")
    assert amx.kernel == "packed" and suggested_tree_width(amx, Runner()) == AMX_TREE_WIDTH > 0
    assert suggested_tree_width(ModelConfig("m", dtype="float32", linear="fp16"), Runner()) == 0
    assert suggested_tree_width(ModelConfig("m", dtype="bfloat16", linear="native"), Runner()) == 0
    Runner.verifies_trees = False  # attends row by row
    assert suggested_tree_width(amx, Runner()) == 0
    Runner.verifies_trees = True
    monkeypatch.setattr(cpu_kernels, "amx_bf16", lambda: False)  # native bf16 without AMX
    assert suggested_tree_width(amx, Runner()) == 0


def test_auto_width_follows_the_target(tiny_models):
    """--tree-width auto takes the width the target's ModelInfo suggests: 4 for a
    bf16 target on a CPU with AMX (packed layers), else 0; a float32 target, or
    one on a GPU: 0."""
    from tandem import cpu_kernels

    for dtype in ("bfloat16", "float32"):
        cluster = Cluster(tiny_models["target"], tiny_models["target"], dtype=dtype, tree_width=None)
        try:
            with cluster.client() as client:
                amx = (DEVICE == "cpu" and dtype == "bfloat16" and cpu_kernels.amx_bf16()
                       and cpu_kernels.packed_available())
                assert cluster.target.tree_width == (4 if amx else 0)
                assert client.server_info().tree_width == cluster.target.tree_width
                assert len(client.generate(prompt_ids=PROMPTS[0], max_tokens=12).token_ids) == 12
        finally:
            cluster.stop()


def test_a_target_that_verifies_the_block_alone_gets_no_alternatives(tiny_models, near_draft, caplog):
    """A target batching verifies (--batch-verifies 2: the lean forward, no token
    trees) says so in ModelInfo.block_only; the orchestrator then drafts no
    alternatives though --tree-width asked for 4, warns, and reports width 0,
    and the output still equals the target alone. With --batch-verifies 1 on
    Hugging Face's forward the same target verifies trees."""
    for batch, block_only in ((2, True), (1, False)):
        with caplog.at_level("WARNING", logger="orchestrator.pairing"):
            cluster = Cluster(tiny_models["target"], near_draft, tree_width=4, target_graphs="off",
                              target_batch=batch)
        try:
            with cluster.client() as client:
                assert cluster.target.model_info().block_only is block_only
                assert client.server_info().tree_width == (0 if block_only else 4)
                warned = [r for r in caplog.records if "--tree-width 4" in r.getMessage()]
                assert bool(warned) is block_only
                result = client.generate(prompt_ids=PROMPTS[1], max_tokens=24, num_draft_tokens=4)
                assert result.token_ids == reference_greedy(tiny_models["target"], PROMPTS[1], 24)
                if block_only:
                    assert result.stats.alternative_hits == 0
        finally:
            cluster.stop()
        caplog.clear()
