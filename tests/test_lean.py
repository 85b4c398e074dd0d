"""The draft's lean forward (tandem/lean.py) computes what Hugging Face's
forward computes, on its own preallocated cache, and falls back where it cannot."""
import threading
from dataclasses import replace

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM)

from draft_service.cheap import Int4Linear, quantize_int4
from draft_service.model_drafter import ModelDrafter
from tandem import i4w
from tandem.lean import MAX_STATIC_ROWS, LeanRunner, lean_runner, unsupported
from tandem.modeling import LoadedModel, ModelConfig, ModelRunner, load
from tandem.session_cache import SessionCacheStore
from tandem.static_kv import StaticKV
from tests.test_decoder import _propose_call


def _loaded(model) -> LoadedModel:
    return LoadedModel(model=model.eval(), tokenizer=None, model_id="test", tokenizer_fingerprint="",
                       vocab_size=model.config.vocab_size, max_context=512, eos_token_ids=())


def _tiny_llama() -> LoadedModel:
    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=0.2, rope_scaling={"rope_type": "linear", "factor": 2.0})
    return _loaded(LlamaForCausalLM(config))


def _same_steps(loaded: LoadedModel, chunks: list[list[int]], crop_after: int | None = None,
                atol: float = 1e-4, rtol: float = 1e-4) -> int:
    """Feeds the chunks through both runners, each on its own cache; the logits of
    every position and the last hidden state agree, and so does the greedy token
    wherever Hugging Face's top two logits are not a near-tie at bf16's rounding.
    Returns how many positions were clear of a near-tie."""
    hf, lean = ModelRunner(loaded, "cpu"), LeanRunner(loaded, "cpu")
    hf_kv, lean_kv = hf.new_cache(), lean.new_cache()
    clear_positions = 0
    for i, chunk in enumerate(chunks):
        expected = hf.forward(hf_kv, chunk, logits_to_keep=len(chunk))  # [T, vocab]
        got = lean.forward(lean_kv, chunk, logits_to_keep=len(chunk))
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
        top2 = expected.topk(2, dim=-1).values
        for position, clear in enumerate((top2[:, 0] - top2[:, 1] > 0.1).tolist()):
            clear_positions += clear
            assert not clear or int(got[position].argmax()) == int(expected[position].argmax()), (i, position)
        assert lean_kv.get_seq_length() == hf_kv.get_seq_length()
        if crop_after == i:
            hf_kv.crop(-2)
            lean_kv.crop(-2)
    probe = [5, 6]
    torch.testing.assert_close(lean.last_hidden(lean_kv, probe), hf.last_hidden(hf_kv, probe), atol=atol, rtol=rtol)
    return clear_positions


def test_lean_forward_equals_hugging_face_on_qwen2(tiny_models):
    """Prompt (a causal block), single steps, a catch-up block, and a crop: the
    tiny Qwen2 (grouped-query attention, q/k/v biases) on fp16-weight layers."""
    loaded = load(ModelConfig(tiny_models["other"], dtype="float32"))
    assert unsupported(loaded.model) is None
    _same_steps(loaded, [[4, 8, 15, 16, 23, 42, 7], [9], [11], [2, 3, 1], [17]], crop_after=3)


def test_lean_forward_equals_hugging_face_on_llama_with_scaled_rope():
    _same_steps(_tiny_llama(), [[1, 2, 3, 4, 5], [6], [7, 8], [9]], crop_after=1)


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_lean_forward_matches_hugging_face_in_bf16(tiny_models, quantize):
    """The draft as a CPU with AMX runs it (`--quantize auto`): bf16 activations
    and cache, int4 weights on aten's kernel, or bf16 ones. A 20-token prompt
    takes the int4 layers' int8 copies (more than 16 rows), steps and catch-ups
    the int4 kernel. The lean path computes the same ops in bf16, so logits
    agree to bf16's rounding and so does every greedy token that is not a near-tie."""
    loaded = load(ModelConfig(tiny_models["other"], dtype="bfloat16", linear="native"), pack=False)
    if quantize == "int4":
        loaded = replace(loaded, model=quantize_int4(loaded.model, kernel="aten"))
        assert any(isinstance(m, Int4Linear) for m in loaded.model.modules())
    prompt = [(7 * i + 3) % 60 + 1 for i in range(20)]
    clear = _same_steps(loaded, [prompt, [9], [11], [2, 3, 1], [17]], atol=3e-2, rtol=1e-2)
    assert clear >= 13  # of 26 positions


@pytest.mark.skipif(i4w.unavailable() is not None, reason=f"i4w kernel: {i4w.unavailable()}")
def test_lean_forward_matches_hugging_face_on_the_i4w_int4_kernel(tiny_models):
    """The draft as a CPU without AMX runs it (`--quantize
    auto`): float32, int4 weights on tandem/i4w.c. Both forwards call the same
    layers, so they agree but for where another attention path moves an
    activation across an int8 rounding boundary."""
    loaded = load(ModelConfig(tiny_models["other"], dtype="float32", linear="native"), pack=False)
    loaded = replace(loaded, model=quantize_int4(loaded.model, kernel="i4w"))
    assert {m.kernel for m in loaded.model.modules() if isinstance(m, Int4Linear)} == {"i4w"}
    prompt = [(7 * i + 3) % 60 + 1 for i in range(20)]
    clear = _same_steps(loaded, [prompt, [9], [11], [2, 3, 1], [17]], atol=1e-3, rtol=1e-3)
    assert clear >= 13  # of 26 positions


@pytest.mark.skipif(i4w.unavailable() is not None, reason=f"i4w kernel: {i4w.unavailable()}")
def test_the_fused_i4w_layers_match_the_per_op_path_and_keep_each_row_on_its_own(tiny_models):
    """With every projection int4 on the i4w kernel, feeds of up to 16 tokens
    run the layer stack in one C call (tandem_i4w_layers). It computes the
    per-op lean forward's function (another softmax: not bit for bit), and a
    token's hidden state is the same bits whether it was fed alone or with
    others, so a seeded sampled run cannot depend on how the draft was fed."""
    loaded = load(ModelConfig(tiny_models["other"], dtype="float32", linear="native"), pack=False)
    loaded = replace(loaded, model=quantize_int4(loaded.model, kernel="i4w"))
    torch.manual_seed(3)
    for layer in loaded.model.base_model.layers:  # the tiny model's norms are all ones: make each its own
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data.uniform_(0.5, 1.5)
    fused, per_op = lean_runner(loaded, "cpu", "auto"), lean_runner(loaded, "cpu", "aten")
    assert fused.fused is not None and per_op.fused is None
    prompt = [(7 * i + 3) % 60 + 1 for i in range(20)]  # > 16 tokens: the per-op path in both
    with torch.inference_mode():
        kv, reference_kv = fused.new_cache(), per_op.new_cache()
        for chunk in (prompt, [9], [11], [2, 3, 1], [17] * 16, [8]):
            got, expected = fused._hidden(kv, chunk), per_op._hidden(reference_kv, chunk)
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(kv.keys[:, :, :kv.length], reference_kv.keys[:, :, :kv.length],
                                       atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(kv.values[:, :, :kv.length], reference_kv.values[:, :, :kv.length],
                                       atol=2e-3, rtol=2e-3)
        together = fused._hidden(kv, [4, 5, 6, 7])
        kv.crop(-4)
        alone = torch.cat([fused._hidden(kv, [token]) for token in (4, 5, 6, 7)])
    assert torch.equal(together, alone)


def test_the_cache_grows_and_keeps_what_it_held(tiny_models):
    """200 tokens fit the first 256 positions; a 100-token catch-up doubles the
    cache and copies them over."""
    loaded = load(ModelConfig(tiny_models["other"], dtype="float32"))
    prompt = [(7 * i) % 120 + 1 for i in range(200)]
    _same_steps(loaded, [prompt, [3], [(5 * i) % 100 + 2 for i in range(100)], [8]])


def test_a_grown_cache_holds_zeros_past_its_length():
    """The graphed step attends over the whole capacity behind a mask, and a NaN
    in a masked position still makes the output NaN (seen on an H100: recycled
    GPU memory gave a sampled draft NaN probabilities): a cache's new positions
    are zeros, not whatever the allocator held."""
    kv = StaticKV(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    kv.reserve(10)
    kv.keys[:, :, :10] = 1.0
    kv.values[:, :, :10] = 2.0
    kv.length = 10
    kv.reserve(300)
    assert kv.keys.shape[2] == 512
    assert torch.all(kv.keys[:, :, :10] == 1.0) and torch.all(kv.values[:, :, :10] == 2.0)
    assert torch.count_nonzero(kv.keys[:, :, 10:]) == 0 and torch.count_nonzero(kv.values[:, :, 10:]) == 0


def test_static_kv_crops_as_dynamic_cache_does():
    """crop(-n) drops n tokens (never below none); the bytes are the capacity's."""
    kv = StaticKV(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    kv.reserve(10)
    assert kv.keys.shape == (2, 1, 256, 4)
    kv.length = 10
    kv.crop(-3)
    assert kv.get_seq_length() == 7
    with pytest.raises(ValueError):
        kv.crop(5)
    kv.crop(-9)
    assert kv.get_seq_length() == 0
    assert kv.nbytes() == 2 * 2 * 256 * 4 * 4


def test_unsupported_models_fall_back_or_are_refused():
    torch.manual_seed(0)
    gpt2 = _loaded(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)))
    assert "gpt2" in unsupported(gpt2.model)
    assert lean_runner(gpt2, "cpu", "auto") is None
    with pytest.raises(ValueError, match="not supported: model type 'gpt2'"):
        lean_runner(gpt2, "cpu", "on")
    llama = _tiny_llama()
    assert isinstance(lean_runner(llama, "cpu", "auto"), LeanRunner)
    assert lean_runner(llama, "cpu", "off") is None
    assert lean_runner(llama, "cpu", "on").graphs is False  # CUDA graphs on a CUDA device only
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        LeanRunner(llama, "cpu", graphs=True)
    with pytest.raises(ValueError, match="lean_step"):
        lean_runner(llama, "cpu", "fast")


@pytest.mark.parametrize("window", [None, 4])
def test_mistral_runs_lean_only_without_a_sliding_window(window):
    """Mistral configs carry a window for every layer and no layer_types; the
    lean forward attends to the whole cache, so a window that can bind is refused."""
    torch.manual_seed(3)
    config = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           sliding_window=window, initializer_range=0.2)
    mistral = _loaded(MistralForCausalLM(config))
    if window is None:
        assert unsupported(mistral.model) is None
        _same_steps(mistral, [[5, 9, 17, 33, 2, 71], [40], [8, 90, 12], [3]])
    else:
        assert "sliding-window attention (window 4)" == unsupported(mistral.model)
        assert lean_runner(mistral, "cpu", "auto") is None


def test_a_cancelled_lean_draft_stops_between_layers_and_its_cache_goes_on_exactly(tiny_models):
    """As test_decoder's test of the same name, on the lean forward: the third
    step is cancelled before its second layer; the next call on the session
    drafts exactly what an uncancelled draft would have."""
    loaded = load(ModelConfig(tiny_models["other"], dtype="float32"))
    runner = LeanRunner(loaded, "cpu")
    drafter = ModelDrafter(runner, SessionCacheStore(runner.new_cache))
    prompt = [4, 8, 15, 16, 23, 42]
    never = threading.Event()
    reference = drafter.propose(_propose_call("ref", [], prompt, 6), never).tokens
    assert len(reference) == 6

    check, calls, cancelled = runner.before_layer, [], threading.Event()

    def counting_check():
        calls.append(1)
        if len(calls) == 6:  # two layers a step: the third step's second layer
            cancelled.set()
        check()

    runner.before_layer = counting_check
    proposal = drafter.propose(_propose_call("s", [], prompt, 6), cancelled)
    runner.before_layer = check
    assert proposal.tokens == reference[:2]
    assert len(calls) == 6
    cache = drafter.store._sessions["s"]
    assert cache.kv_len == len(prompt) + 1 == cache.kv.get_seq_length()
    after = drafter.propose(_propose_call("s", prompt + reference[:1], reference[1:2], 4), never)
    assert after.tokens == reference[2:6]


def _static_steps_match_the_per_op_path(loaded: LoadedModel, device: str, graphs: bool) -> None:
    """Feeds of 1 to 4 tokens through the static forward on the runner's buffers
    (LeanRunner.static_block: the function a CUDA graph captures, with the
    position as a tensor and attention over the whole capacity behind a mask),
    eagerly or replayed from a graph, give the per-op path's hidden states and
    keys, also after a crop leaves stale keys past the position."""
    static = LeanRunner(loaded, device, fused=False, graphs=graphs, static_rows=MAX_STATIC_ROWS)
    per_op = LeanRunner(loaded, device, fused=False)
    prompt = [(7 * i + 3) % 60 + 1 for i in range(20)]
    with torch.inference_mode():
        kv, reference_kv = static.new_cache(), per_op.new_cache()
        static._hidden(kv, prompt)
        per_op._hidden(reference_kv, prompt)
        feeds = [[9], [11, 2, 3], [1], [17, 5], [8, 4, 6, 10], [12], [13, 14, 15]]
        for i, feed in enumerate(feeds):
            if i in (3, 5):
                kv.crop(-2)  # stale positions past the end
                reference_kv.crop(-2)
            got, expected = static._hidden(kv, feed).clone(), per_op._hidden(reference_kv, feed)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            assert kv.length == reference_kv.length
            torch.testing.assert_close(kv.keys[:, :, :kv.length], reference_kv.keys[:, :, :kv.length],
                                       atol=1e-4, rtol=1e-4)
        capacity = kv.keys.shape[2]
        assert sorted(static.banks[capacity].steps) == [1, 2, 3, 4] and kv.keys is static.banks[capacity].keys


def test_the_static_forward_matches_the_per_op_path(tiny_models):
    loaded = load(ModelConfig(tiny_models["other"], dtype="float32"))
    _static_steps_match_the_per_op_path(loaded, "cpu", graphs=False)
    _static_steps_match_the_per_op_path(_tiny_llama(), "cpu", graphs=False)


def _sessions_take_turns(runner: LeanRunner, reference: LeanRunner, device: str) -> None:
    """Three sessions take turns on the static runner's buffers; each gives what
    it gives alone on the per-op path, and one that grows past the capacity
    moves on to the next capacity's buffers."""
    with torch.inference_mode():
        caches = [runner.new_cache() for _ in range(3)]
        references = [reference.new_cache() for _ in range(3)]
        first = runner.new_cache().min_capacity
        prompts = [[(5 * i + s) % 60 + 1 for i in range(12 + 7 * s)] for s in range(3)]
        for kv, reference_kv, prompt in zip(caches, references, prompts):
            runner._hidden(kv, prompt)
            reference._hidden(reference_kv, prompt)
        for turn in range(6):
            for s, (kv, reference_kv) in enumerate(zip(caches, references)):
                feed = [(turn * 3 + s + j) % 50 + 2 for j in range(1 + (turn + s) % 3)]
                if s == 2 and turn == 3:  # past the first capacity: a prompt-sized feed, then steps on new buffers
                    feed = [(j * 11) % 50 + 2 for j in range(first - kv.length + 1)]
                got = runner._hidden(kv, feed).clone()
                torch.testing.assert_close(got, reference._hidden(reference_kv, feed), atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(kv.keys[:, :, :kv.length], reference_kv.keys[:, :, :kv.length],
                                           atol=1e-4, rtol=1e-4)
            held = [kv for kv in caches if kv.keys is runner.banks[first].keys]
            assert len(held) <= 1  # at most one cache runs on a bank's buffers; the others hold copies
        assert caches[2].keys.shape[2] == 2 * first and caches[2].keys is runner.banks[2 * first].keys
        assert caches[2].keys is not runner.banks[first].keys


def test_sessions_take_turns_on_the_static_buffers(tiny_models):
    """The static steps' buffers belong to the runner (one pair per capacity):
    a session moves its keys and values into them when it runs, and the session
    there before keeps a copy. Interleaved sessions stay each its own."""
    loaded = load(ModelConfig(tiny_models["other"], dtype="float32"))
    _sessions_take_turns(LeanRunner(loaded, "cpu", fused=False, static_rows=MAX_STATIC_ROWS),
                         LeanRunner(loaded, "cpu", fused=False), "cpu")


def test_a_lean_target_verifies_as_hugging_face_does(tiny_models):
    """The target service's verifier on the lean forward (the path --graphs
    replays on a GPU, here run eagerly on the CPU) gives the verdicts and the
    cache that Hugging Face's forward gives, block after block, with rejections."""
    from target_service.server import target_runner
    from target_service.verifier import Verifier, VerifyCall
    from tandem import fingerprint
    from tandem.sampling import SamplingParams

    loaded = load(ModelConfig(tiny_models["target"], dtype="float32"))
    assert isinstance(target_runner(loaded, "cpu", "auto"), ModelRunner)  # a CPU keeps its own kernels
    with pytest.raises(ValueError, match="CUDA graphs need a GPU"):
        target_runner(loaded, "cpu", "on")
    prompt = [3, 17, 29, 4, 8, 51, 2]
    with torch.inference_mode():
        reference = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0].tolist()
    outcomes = []
    for runner in (ModelRunner(loaded, "cpu"), LeanRunner(loaded, "cpu", fused=False, static_rows=MAX_STATIC_ROWS)):
        verifier = Verifier(runner, SessionCacheStore(runner.new_cache, 0, 60))
        committed, fed, verdicts = list(prompt), 0, []
        for round_ in range(40):
            k = 1 + round_ % 4
            if len(committed) + k + 1 > len(reference):
                break
            draft = reference[len(committed):len(committed) + k]
            wrong = round_ % (k + 2)  # a wrong token at that draft position, or none
            if wrong < k:
                draft[wrong] = (draft[wrong] + 1) % loaded.vocab_size
            prefix = committed[:fed]
            call = VerifyCall(session_id="s", prefix_len=fed,
                              prefix_fp=fingerprint.prefix_table(prefix)[-1] if prefix else fingerprint.EMPTY,
                              new_tokens=committed[fed:], draft_tokens=draft, draft_probs=[], draft_dists=None,
                              sampling=SamplingParams())
            outcome = verifier.verify(call)
            verdicts.append((outcome.accepted, outcome.next_token))
            fed = len(committed) + outcome.accepted
            committed += draft[:outcome.accepted] + [outcome.next_token]
        outcomes.append((verdicts, committed))
    (hf_verdicts, hf_committed), (lean_verdicts, lean_committed) = outcomes
    assert lean_verdicts == hf_verdicts
    assert lean_committed == hf_committed == reference[:len(hf_committed)]
    accepted = [a for a, _ in hf_verdicts]
    assert 0 in accepted and max(accepted) == 4 and len(accepted) >= 10


def test_each_feed_length_is_captured_once_and_under_the_process_wide_lock(tiny_models, monkeypatch):
    """torch.cuda.graph synchronizes the device as it begins, which spoils a
    capture under way in another thread (the tests' cluster runs both services
    in one process): a capture holds tandem.graphs' lock. The capture itself is faked
    here (a CPU has no CUDA graphs); the rest is the runner's own path."""
    import types

    from tandem import graphs

    loaded = load(ModelConfig(tiny_models["other"], dtype="float32"))
    runner = LeanRunner(loaded, "cpu", fused=False, static_rows=4)
    runner.graphs = True
    captured = []

    def capture(step):
        captured.append((step.tokens.shape[0], graphs.CAPTURE_LOCK.locked()))
        step.output = step._run()
        step.graph = types.SimpleNamespace(replay=lambda: None)

    monkeypatch.setattr(graphs.Step, "_capture", capture)
    with torch.inference_mode():
        for kv in (runner.new_cache(), runner.new_cache()):
            runner._hidden(kv, [1, 2, 3])
            runner._hidden(kv, [4])
            runner._hidden(kv, [5])
    assert captured == [(3, True), (1, True)]
    assert not graphs.CAPTURE_LOCK.locked()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphed_steps_match_the_per_op_path_on_a_gpu(tiny_models):
    """As above, replayed from CUDA graphs, in float32 on the GPU: sessions take
    turns on graphs captured once, and a cache that grows past its capacity
    moves on to the next capacity's buffers and graphs."""
    loaded = load(ModelConfig(tiny_models["other"], device="cuda", dtype="float32"))
    _static_steps_match_the_per_op_path(loaded, "cuda", graphs=True)
    runner = LeanRunner(loaded, "cuda", graphs=True, static_rows=MAX_STATIC_ROWS)
    _sessions_take_turns(runner, LeanRunner(loaded, "cuda", fused=False), "cuda")
    first = runner.new_cache().min_capacity
    graphs = {rows: step.graph for rows, step in runner.banks[first].steps.items()}
    assert graphs and all(g is not None for g in graphs.values())
    with torch.inference_mode():
        kv = runner.new_cache()
        runner._hidden(kv, [5] * 30)
        runner._hidden(kv, [6, 7])
        runner._hidden(kv, [8])
    assert {rows: step.graph for rows, step in runner.banks[first].steps.items()} == graphs  # none captured again
