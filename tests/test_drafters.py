"""Draft backends: prompt lookup, the reduced head, int8 and int4 quantization, and end
to end with each of them the output still equals the target alone."""
from dataclasses import replace

import pytest

from draft_service.cheap import int4_kernel
from draft_service.ngram import lookup
from draft_service.server import DraftOptions
from tests.conftest import DEVICE, Cluster, reference_greedy


def test_lookup_proposes_the_continuation_of_a_repeated_pattern():
    history = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert lookup(history, 2) == [4, 5]
    assert lookup([7, 8, 7, 8, 7], 4) == [8, 7, 8, 7]  # repeats on the extended history
    assert lookup([1, 2, 3], 3) == []  # no earlier occurrence of any suffix
    assert lookup([5, 6, 1, 5, 6, 2, 5, 6], 1) == [2]  # the most recent occurrence wins


REPEATING = [10, 20, 30, 40, 50, 60, 10, 20, 30, 40, 50, 60, 10, 20]


@pytest.mark.parametrize("options", [
    DraftOptions(backend="ngram"),
    DraftOptions(backend="ngram+model", vocab_subset=64),
    DraftOptions(backend="model", vocab_subset=100),
    DraftOptions(backend="model", vocab_subset=100, lean_step="off"),  # Hugging Face's forward
    DraftOptions(backend="model", quantize="int8", vocab_subset=100),
    DraftOptions(backend="model", quantize="int4", vocab_subset=100),  # i4w where it runs
    DraftOptions(backend="model", quantize="int4", int4_kernel="aten", vocab_subset=100),
])
def test_backends_stay_lossless_end_to_end(tiny_models, options):
    """Greedy output equals the target alone with every backend; a seeded sampled
    run gives the same tokens with the pipeline on or off, except with an int8
    draft: its activations are quantized with one scale per forward, so a token
    drafted inside a two-token catch-up gets slightly other probabilities than
    drafted alone, and the pipeline chunks the draft's input differently. (The
    rejection rule keeps the target's distribution whatever the draft's,
    test_e2e_sampling.) An int4 draft quantizes weights only (aten's kernel)
    or activations one token at a time (tandem/i4w.c), so it keeps the seeded
    equality."""
    if options.quantize != "none" and DEVICE != "cpu":
        pytest.skip("quantized drafts run on the CPU only")
    cluster = Cluster(tiny_models["target"], tiny_models["target"], draft_options=options)
    try:
        with cluster.client() as client:
            lean = options.backend != "ngram" and options.lean_step != "off"
            suffix = ("/lean" if DEVICE == "cpu" else "/lean+graphs") if lean else ""
            if options.quantize == "int4" and options.int4_kernel == "auto":  # the service names its choice
                options = replace(options, int4_kernel=int4_kernel())
            if options.batch_drafts is None:  # auto: batched on a CPU, on the lean step of a model
                options = replace(options, batch_drafts=8 if lean and options.backend == "model" and DEVICE == "cpu"
                                  else 1)
            assert client.server_info().draft_backend == options.label + suffix
            for prompt in (REPEATING, [3, 1, 4, 1, 5, 9, 2, 6], list(range(5, 45, 2))):  # the last > 16 tokens
                for pipeline in (False, True):
                    result = client.generate(prompt_ids=prompt, max_tokens=24, num_draft_tokens=3, pipeline=pipeline)
                    assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 24)
            if options.quantize == "int8":
                return
            for seed in (3, 4):
                sampled = [client.generate(prompt_ids=REPEATING, max_tokens=16, temperature=1.0, seed=seed,
                                           num_draft_tokens=3, pipeline=p).token_ids for p in (False, True)]
                assert sampled[0] == sampled[1]
    finally:
        cluster.stop()


def test_ngram_drafts_are_accepted_on_repetitive_output(tiny_models):
    """With the tiny target's own greedy output as the history, lookup hits."""
    cycle = reference_greedy(tiny_models["target"], REPEATING, 40)
    prompt = REPEATING + cycle  # the continuation repeats what the history holds
    cluster = Cluster(tiny_models["target"], tiny_models["target"], draft_options=DraftOptions(backend="ngram"))
    try:
        with cluster.client() as client:
            result = client.generate(prompt_ids=prompt, max_tokens=20, num_draft_tokens=4)
        assert result.token_ids == reference_greedy(tiny_models["target"], prompt, 20)
        assert result.stats.accepted_tokens > 0
    finally:
        cluster.stop()


def test_confidence_stop_ends_blocks_early_and_stays_lossless(tiny_models):
    """A draft that doubts its tokens stops early (blocks shorter than k), and the
    output is still the target alone's, pipelined or not."""
    prompt = [3, 9, 27, 81, 16, 48]
    reference = reference_greedy(tiny_models["target"], prompt, 30)
    cluster = Cluster(tiny_models["target"], tiny_models["other"], k=6,
                      draft_options=DraftOptions(min_confidence=0.9))
    try:
        with cluster.client() as client:
            for pipeline in (False, True):
                result = client.generate(prompt_ids=prompt, max_tokens=30, pipeline=pipeline, num_draft_tokens=6)
                assert result.token_ids == reference
                assert result.stats.drafted_tokens < 6 * result.stats.rounds  # some blocks were cut short
    finally:
        cluster.stop()


def test_int8_draft_has_one_weight_scale_per_output_channel(tiny_models):
    """Every linear layer of an int8 draft is int8 with a scale per output
    channel (one per tensor cost the default draft 3 points of agreement, see
    draft_service/cheap.py), and computes the float32 layer up to that rounding."""
    import torch
    from transformers import AutoModelForCausalLM

    from draft_service.cheap import quantize_int8

    model = AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32).eval()
    references = {name: module.weight.detach().clone()
                  for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    quantized = dict(quantize_int8(model).named_modules())
    for name, weight in references.items():
        layer = quantized[name]
        assert isinstance(layer, torch.ao.nn.quantized.dynamic.Linear), (name, type(layer))
        qweight = layer.weight()
        assert qweight.qscheme() == torch.per_channel_affine
        scales = qweight.q_per_channel_scales()
        assert scales.shape == (weight.shape[0],)
        # each row's scale fits that row: rounding error within half a step of its own scale
        error = (qweight.dequantize() - weight).abs().amax(dim=1)
        assert torch.all(error <= scales * 0.5 + 1e-7)
        assert scales.max() > 1.5 * scales.min()  # rows differ, so one scale per tensor would not fit them all


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_draft_is_refused_off_the_cpu(tiny_models, quantize):
    """fbgemm's int8 and aten's int4 CPU kernels run on the CPU only: a GPU draft
    service asked for them fails at start with words, before loading anything."""
    from draft_service.server import DraftServicer
    from tandem.modeling import ModelConfig

    with pytest.raises(ValueError, match="CPU only"):
        DraftServicer(ModelConfig(tiny_models["target"], device="cuda:0"), options=DraftOptions(quantize=quantize))


def _group_dequantized(weight, group):
    """The test's own reference: each group of `group` input channels rounded to
    16 levels between its min and max."""
    import torch

    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // group, group)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    return (torch.round((groups - low) / step) * step + low).reshape(rows, cols), step


def _int4_kernels():
    from tandem import i4w

    runs = pytest.mark.skipif(i4w.unavailable() is not None, reason=f"i4w kernel: {i4w.unavailable()}")
    return ["aten", pytest.param("i4w", marks=runs)]


@pytest.mark.parametrize("kernel", _int4_kernels())
@pytest.mark.parametrize("out_features,bias", [(64, True), (40, False), (24, True), (208, True)])
def test_int4_linear_computes_its_group_quantized_weights(out_features, bias, kernel):
    """Int4Linear computes x·Wq + b with Wq the 16-level rounding of each
    32-channel group (within bf16 rounding, or the i4w kernel's int8
    activations), Wq is within half a step of W, and output widths that are not
    a multiple of the kernels' 16 come out whole."""
    import torch

    from draft_service.cheap import Int4Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, out_features, bias=bias)
    with torch.no_grad():
        linear.weight[:, :32] *= 10  # groups of very different ranges
    x = torch.randn(5, 96)
    layer = Int4Linear(linear, group=32, kernel=kernel)
    y = layer(x)
    assert y.shape == (5, out_features)
    assert y.dtype == {"aten": torch.bfloat16, "i4w": torch.float32}[kernel]
    weight = linear.weight.detach()
    dequantized, step = _group_dequantized(weight, 32)
    assert torch.all((dequantized - weight).reshape(out_features, 3, 32).abs() <= step / 2 + 1e-6)
    inputs = x.to(torch.bfloat16).float() if kernel == "aten" else x
    reference = inputs @ dequantized.T + (linear.bias.detach() if bias else 0)
    unquantized = x @ weight.T + (linear.bias.detach() if bias else 0)
    error = (y.float() - reference).abs().max()
    assert error <= 0.02 * reference.abs().max()
    assert error < (unquantized - reference).abs().max() / 4  # it computes the rounded weights, not W
    assert layer(x[0]).shape == (out_features,)  # any leading shape


@pytest.mark.parametrize("out_features", [16, 80, 208])
def test_i4w_int4_kernel_computes_each_row_on_its_own(out_features):
    """tandem/i4w.c: each group of 32 of each row of x quantized to int8 with its
    own scale, times the packed codes, scales and low values, gives the test's
    own float64 reference to float32 rounding; and a row's output is bit for bit
    the same whatever the other rows of its forward and the number of threads
    (a draft's token gets the same probabilities alone or in a catch-up).
    Widths of 16, 64 + 16 and 3 × 64 + 16 take both kinds of column block."""
    import torch

    from draft_service.cheap import quantize_groups
    from tandem import i4w

    if i4w.unavailable() is not None:
        pytest.skip(f"i4w kernel: {i4w.unavailable()}")
    torch.manual_seed(2)
    weight = torch.randn(out_features, 128) * torch.rand(out_features, 1)  # rows of different ranges
    weight[:, 64:96] *= 20
    codes, scale, low = quantize_groups(weight, i4w.GROUP)
    packed = i4w.pack(codes, scale, low)
    bias = torch.randn(out_features)
    x = torch.randn(7, 128) * torch.tensor([1.0, 0.01, 5.0, 1.0, 0.0, 2.0, 1.0])[:, None]  # a zero row too
    x[6, 3] = 300.0  # one large channel: it coarsens its own group's int8 steps only
    y = i4w.linear(x, packed, bias, out_features)

    held = lambda t: t.to(torch.float16).double()[..., None]  # scale and low as the kernel holds them
    dequantized = (codes.double().reshape(out_features, -1, i4w.GROUP) * held(scale) + held(low)).reshape(weight.shape)
    groups = x.double().reshape(7, -1, i4w.GROUP)
    group_scale = groups.abs().amax(-1, keepdim=True) / 127
    group_scale[group_scale == 0] = 1
    quantized = (torch.round(groups / group_scale).clamp(-127, 127) * group_scale).reshape(x.shape)
    reference = quantized @ dequantized.T + bias.double()
    torch.testing.assert_close(y.double(), reference, rtol=1e-5, atol=1e-4)
    assert torch.equal(y[4], bias)  # a zero row gives the bias alone
    exact = x.double() @ dequantized.T + bias.double()  # activations unquantized
    without_outlier = exact[6] - x[6, 3].double() * dequantized[:, 3]
    assert (y[6].double() - exact[6]).abs().max() < 0.05 * without_outlier.abs().max()

    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            alone = torch.cat([i4w.linear(x[i:i + 1].contiguous(), packed, bias, out_features) for i in range(7)])
            assert torch.equal(alone, y)
            assert torch.equal(i4w.linear(x[2:7].contiguous(), packed, bias, out_features), y[2:7])
    finally:
        torch.set_num_threads(threads)
    unbiased = i4w.linear(x, packed, None, out_features)
    torch.testing.assert_close(unbiased.double(), reference - bias.double(), rtol=1e-5, atol=1e-4)


def test_i4w_builds_for_avx512_vnni_where_the_cpu_has_it_else_for_avx2(monkeypatch):
    """An AVX-512 CPU without VNNI (Skylake-SP) gets the AVX2 build rather than none."""
    from tandem import i4w

    vnni, no_vnni = {"avx512_bw": True, "avx512_vnni": True}, {"avx512_bw": True, "avx512_vnni": False}
    for capability, features, expected in [("AVX512", vnni, i4w.AVX512_FLAGS), ("AVX512", no_vnni, i4w.AVX2_FLAGS),
                                           ("AVX2", {}, i4w.AVX2_FLAGS)]:
        monkeypatch.setattr(i4w, "cpu_capability", lambda: capability)
        monkeypatch.setattr(i4w, "cpu_features", lambda: features)
        assert i4w._flags() == expected
    monkeypatch.setattr(i4w, "cpu_capability", lambda: None)
    with pytest.raises(RuntimeError, match="neither AVX2 nor AVX-512"):
        i4w._flags()


def test_the_avx2_build_of_i4w_gives_the_avx512_builds_bits(tmp_path, monkeypatch):
    """Both builds take each group's exact int32 dot product (vpdpbusd, or
    vpmaddubsw + vpmaddwd) and fold the groups with the same float32
    operations, so a draft computes the same logits on either kind of CPU."""
    import torch

    from draft_service.cheap import quantize_groups
    from tandem import i4w
    from tandem.ckernel import CKernel

    if i4w.unavailable() is not None or i4w._flags() != i4w.AVX512_FLAGS:
        pytest.skip("needs a CPU with AVX512-VNNI, to compare its build with the AVX2 one")
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    avx2 = CKernel("i4w-avx2", i4w.KERNEL.source, lambda: i4w.AVX2_FLAGS, i4w._declare)
    torch.manual_seed(4)
    weight = torch.randn(208, 256)
    packed = i4w.pack(*quantize_groups(weight, i4w.GROUP))
    bias = torch.randn(208)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 256) * 3
        assert torch.equal(i4w.linear(x, packed, bias, 208, kernel=avx2), i4w.linear(x, packed, bias, 208))


@pytest.mark.parametrize("kernel", _int4_kernels())
def test_int4_linear_takes_its_int8_copy_for_wide_forwards(kernel):
    """A forward of more rows than wide_rows (a prompt's prefill) runs the
    layer's int8 copy: the int4 kernels multiply a few rows a pass over the
    weights and are several times slower there. Rows up to wide_rows get the
    int4 result, row for row."""
    import torch

    from draft_service.cheap import Int4Linear

    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 48)
    layer = Int4Linear(linear, group=32, wide_rows=4, kernel=kernel)
    assert layer.wide is not None
    x = torch.randn(9, 64)
    exact = (x @ linear.weight.T + linear.bias).detach()
    narrow = torch.cat([layer(x[i:i + 3]) for i in range(0, 9, 3)])  # int4
    wide = layer(x)  # 9 rows > 4: int8
    assert wide.shape == (9, 48) and wide.dtype == layer.output_dtype
    int8_error = (wide.float() - exact).abs().max()
    int4_error = (narrow.float() - exact).abs().max()
    assert int8_error < int4_error / 2  # 256 levels per output channel against 16 per group
    assert torch.allclose(wide.float(), layer.wide(x).float(), atol=1e-2)
    assert Int4Linear(linear, group=32, wide_rows=None).wide is None


def test_int4_draft_quantizes_every_linear_layer_it_can(tiny_models):
    """quantize_int4 replaces each nn.Linear whose input width is a multiple of
    the group, keeps the others as they are, and the model still runs."""
    import torch
    from transformers import AutoModelForCausalLM

    from draft_service.cheap import Int4Linear, quantize_int4

    model = AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.bfloat16).eval()
    names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    quantize_int4(model, group=32)
    layers = dict(model.named_modules())
    assert all(type(layers[name]) is Int4Linear for name in names)
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[:2] == (1, 3) and torch.isfinite(logits).all()
    # a width that is not a multiple of the group stays nn.Linear
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(48, model.config.hidden_size, bias=False)
    quantize_int4(model.model.layers[0].mlp, group=32)
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear


def test_quantize_auto_picks_int4_on_the_i4w_kernel_or_with_amx(monkeypatch):
    """int4 on tandem/i4w.c wherever it runs (AVX512-VNNI or AVX2), AMX or not; on
    aten's kernel with AMX where i4w does not run; int8 elsewhere on a CPU,
    nothing on a GPU. An explicit kernel is kept, and i4w where it cannot run
    is an error."""
    from draft_service import cheap
    from tandem import cpu_kernels, i4w

    for amx, runs, quantize, kernel in [(True, True, "int4", "i4w"), (True, False, "int4", "aten"),
                                        (False, True, "int4", "i4w"), (False, False, "int8", "aten")]:
        monkeypatch.setattr(cpu_kernels, "amx_bf16", lambda: amx)
        monkeypatch.setattr(i4w, "unavailable", lambda: None if runs else "no AVX2")
        assert (cheap.auto_quantize("cpu"), cheap.int4_kernel()) == (quantize, kernel)
        assert cheap.int4_kernel("aten") == "aten"
        if runs:
            assert cheap.int4_kernel("i4w") == "i4w"
        else:
            with pytest.raises(ValueError, match="no AVX2"):
                cheap.int4_kernel("i4w")
        assert cheap.auto_quantize("cuda:0") == "none"
    with pytest.raises(ValueError, match="int4 kernel"):
        cheap.int4_kernel("int4")
    with pytest.raises(ValueError, match="int4_kernel"):
        DraftOptions(quantize="int4", int4_kernel="fast")
