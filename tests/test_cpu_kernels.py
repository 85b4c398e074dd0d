"""Packed oneDNN and fp16-weight FBGEMM linear layers compute what nn.Linear
computes, and the model config picks them only where they apply."""
import pytest
import torch
from transformers import DynamicCache

from tandem import bf16w, cpu_kernels, modeling
from tandem.modeling import ModelConfig, load_causal_lm
from tests.conftest import reference_greedy

pytestmark = pytest.mark.skipif(not cpu_kernels.packed_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 7, 48)])
def test_packed_linear_equals_nn_linear(bias, shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)  # [..., in]
    expected = linear(x)
    got = cpu_kernels.PackedLinear(linear)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_packing_replaces_every_linear_and_keeps_greedy_output(tiny_models):
    native = load_causal_lm(tiny_models["target"], ModelConfig(tiny_models["target"], dtype="float32", linear="native"))
    packed = load_causal_lm(tiny_models["target"], ModelConfig(tiny_models["target"], dtype="float32", linear="packed"))
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert sum(isinstance(m, cpu_kernels.PackedLinear) for m in packed.modules()) == \
        sum(type(m) is torch.nn.Linear for m in native.modules()) > 0
    prompt = [5, 17, 99, 3, 42, 8]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, native(ids).logits, rtol=1e-4, atol=1e-4)
        out = packed.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40,
                              do_sample=False, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == reference_greedy(tiny_models["target"], prompt, 40)


def _bf16_linear(out_features: int, in_features: int, bias: bool) -> torch.nn.Linear:
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(linear.weight.bfloat16().float())
        linear.weight[3] *= 2.0**-24  # a row of tiny weights: fp16 holds it only once the row is scaled
        linear.weight[5, :4] = torch.tensor([1e3, -2.5e-4, 0.0, 7.0]).bfloat16().float()
    return linear


@pytest.mark.skipif(not cpu_kernels.fp16_available(), reason="torch built without FBGEMM")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (6, 48), (2, 7, 48)])
def test_fp16_linear_computes_the_float32_function_of_bf16_weights(bias, shape):
    torch.manual_seed(0)
    linear = _bf16_linear(80, 48, bias)
    exact = cpu_kernels.exact_fp16(linear.weight.detach())
    assert exact is not None and exact[1] is not None  # the tiny row needs its scale
    weight, scale = exact
    assert torch.equal(weight / scale[:, None], linear.weight.detach())  # not a bit lost
    x = torch.randn(*shape)
    got = cpu_kernels.Fp16Linear(linear, exact)(x)
    exact64 = torch.nn.functional.linear(x.double(), linear.weight.double(),
                                         None if linear.bias is None else linear.bias.double())
    assert got.shape == exact64.shape
    # as close to the exact product as nn.Linear's own float32 sum is (not fp16's 1e-3)
    err_fp16, err_native = (got.double() - exact64).abs(), (linear(x).double() - exact64).abs()
    scale64 = exact64.abs().amax(dim=-1, keepdim=True) + 1e-30
    assert (err_fp16 / scale64).max() < 1e-6 and (err_native / scale64).max() < 1e-6
    assert ((got.double() - exact64)[..., 3].abs() <= 1e-6 * exact64[..., 3].abs().amax() + 1e-30).all()


@pytest.mark.skipif(not cpu_kernels.fp16_available(), reason="torch built without FBGEMM")
def test_weights_that_fp16_would_round_keep_the_packed_kernel():
    torch.manual_seed(0)
    assert cpu_kernels.exact_fp16(torch.randn(8, 16)) is None  # float32 mantissas: 23 bits
    wide = torch.ones(4, 16)
    wide[0, 0] = 2.0**-40  # 40 binades below the row's largest: beyond fp16 even when scaled
    assert cpu_kernels.exact_fp16(wide) is None
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), _bf16_linear(8, 8, True))
    assert cpu_kernels.pack_linears(model, "fp16") == 2
    assert isinstance(model[0], cpu_kernels.PackedLinear) and isinstance(model[2], cpu_kernels.Fp16Linear)


def _assert_greedy_equals_reference(model, path: str) -> None:
    prompt = [5, 17, 99, 3, 42, 8]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40,
                             do_sample=False, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == reference_greedy(path, prompt, 40)


@pytest.mark.skipif(not cpu_kernels.fp16_available(), reason="torch built without FBGEMM")
def test_fp16_kernels_keep_greedy_output(tiny_models):
    path = tiny_models["target"]
    model = load_causal_lm(path, ModelConfig(path, dtype="float32", linear="fp16"))
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert not any(isinstance(m, cpu_kernels.PackedLinear) for m in model.modules())  # bf16 weights: all exact
    _assert_greedy_equals_reference(model, path)


def test_config_resolves_dtype_and_kernels():
    assert ModelConfig("m", device="cuda:0").resolved_dtype == "bfloat16"
    assert not ModelConfig("m", device="cuda:0", dtype="float32").packed
    assert not ModelConfig("m", device="cuda:0", dtype="bfloat16").packed
    assert ModelConfig("m", dtype="float32").packed
    assert not ModelConfig("m", dtype="float32", linear="native").packed
    assert ModelConfig("m", dtype="float32").kernel == (
        "bf16w" if cpu_kernels.bf16w_preferred() else "fp16" if cpu_kernels.fp16_available() else "packed")
    if cpu_kernels.bf16w_preferred():
        assert bf16w.unavailable() is None
    if bf16w.unavailable() is None:
        assert ModelConfig("m", dtype="float32", linear="bf16w").kernel == "bf16w"
    else:
        with pytest.raises(ValueError, match="bf16w linear layers cannot run here"):
            ModelConfig("m", dtype="float32", linear="bf16w")
    assert ModelConfig("m", dtype="float32", linear="packed").kernel == "packed"
    assert not ModelConfig("m", dtype="bfloat16", linear="native").packed
    with pytest.raises(ValueError, match="fp16 linear layers need"):
        ModelConfig("m", device="cuda:0", dtype="float32", linear="fp16")
    with pytest.raises(ValueError, match="fp16 linear layers need"):
        ModelConfig("m", dtype="bfloat16", linear="fp16")
    with pytest.raises(ValueError, match="linear"):
        ModelConfig("m", linear="fast")
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig("m", dtype="int4")


@pytest.mark.parametrize("amx,native_bf16", [(True, True), (False, True), (False, False)])
def test_cpu_picks_bf16_packed_with_amx_and_packs_bf16_only_where_native(monkeypatch, amx, native_bf16):
    monkeypatch.setattr(cpu_kernels, "amx_bf16", lambda: amx)
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: native_bf16)
    fp16 = cpu_kernels.fp16_available()
    float32 = fp16 or cpu_kernels.bf16w_preferred() or not native_bf16
    expected = "bfloat16" if amx else ("float32" if float32 else "bfloat16")
    assert ModelConfig("m").resolved_dtype == expected
    assert ModelConfig("m", dtype="bfloat16").kernel == ("packed" if native_bf16 else "native")
    if native_bf16:
        assert ModelConfig("m", dtype="bfloat16", linear="packed").kernel == "packed"
    else:
        with pytest.raises(ValueError, match="packed bfloat16 linear layers need a CPU with native bf16"):
            ModelConfig("m", dtype="bfloat16", linear="packed")


@pytest.mark.skipif(not cpu_kernels.native_bf16(), reason="CPU without native bf16: bf16 layers are not packed")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (6, 48), (2, 7, 48)])
def test_packed_bf16_linear_computes_the_bf16_layer(bias, shape):
    # Both sum bf16 products in float32 and round once to bf16: they may differ
    # by the last bit of a result, no more.
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias).bfloat16()
    x = torch.randn(*shape).bfloat16()
    packed = cpu_kernels.PackedLinear(linear)
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == linear(x).shape
    exact = torch.nn.functional.linear(x.float(), linear.weight.float(),
                                       None if linear.bias is None else linear.bias.float())
    torch.testing.assert_close(got.float(), exact, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, linear(x), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not cpu_kernels.native_bf16(), reason="CPU without native bf16: bf16 layers are not packed")
def test_a_bf16_model_on_packed_layers_keeps_the_logits_of_nn_linear(tiny_models):
    path = tiny_models["target"]
    native = load_causal_lm(path, ModelConfig(path, dtype="bfloat16", linear="native"))
    packed = load_causal_lm(path, ModelConfig(path, dtype="bfloat16", linear="packed"))
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    ids = torch.tensor([[5, 17, 99, 3, 42, 8]])
    with torch.inference_mode():
        got, expected = packed(ids).logits, native(ids).logits
    assert got.dtype == expected.dtype and got.shape == expected.shape
    got, expected = got.float(), expected.float()
    # bf16 keeps 8 bits: the two orders of summation agree to a few bf16 ulps
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05 * expected.abs().max().item())
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


def test_baselines_include_every_kernel_that_may_decode_faster():
    # A speedup is taken over the fastest target alone: the service's own
    # configuration comes first (the identity reference), then on a CPU float32
    # on its fastest layers, nn.Linear (it wins on one-token decoding where the
    # service packs) and bf16, each set of kernels once.
    auto = cpu_kernels.resolve_linear("auto", "cpu", "float32")
    # FBGEMM's fp16 layers where auto runs other kernels (bf16w where it builds)
    fbgemm = [("float32", "fp16")] if auto not in ("fp16", "packed", "native") else []
    # and bf16w where auto measured FBGEMM faster (tandem.linear_choice)
    fbgemm += [("float32", "bf16w")] if auto == "fp16" and bf16w.unavailable() is None else []
    assert cpu_kernels.baseline_configs("cpu", "float32") == [
        ("float32", "auto"), *fbgemm, ("float32", "native"), ("bfloat16", "auto")]
    native = auto == "native"
    assert cpu_kernels.baseline_configs("cpu", "bfloat16") == [("bfloat16", "auto"), ("float32", "auto"), *fbgemm] + (
        [] if native else [("float32", "native")])
    assert cpu_kernels.baseline_configs("cuda:0", "float32") == [("float32", "auto"), ("bfloat16", "auto")]
    for config in [("float32", "auto"), ("float32", "native"), ("bfloat16", "auto")]:
        assert cpu_kernels.parse_config(cpu_kernels.config_label(*config)) == config
    if bf16w.unavailable() is None and auto == "fp16":
        # A service on --linear bf16w: its own kernels first, then the others, auto's included.
        assert cpu_kernels.baseline_configs("cpu", "float32", "bf16w") == [
            ("float32", "bf16w"), ("float32", "auto"), ("float32", "native"), ("bfloat16", "auto")]
    if auto == "bf16w":  # and a service on --linear fp16
        assert cpu_kernels.baseline_configs("cpu", "float32", "fp16") == [
            ("float32", "fp16"), ("float32", "auto"), ("float32", "native"), ("bfloat16", "auto")]
    # Configurations asked for by hand come last, and only with kernels not timed yet.
    assert cpu_kernels.baseline_configs("cpu", "float32", extra=[("float32", auto), ("bfloat16", "native")]) == (
        cpu_kernels.baseline_configs("cpu", "float32")
        + ([] if cpu_kernels.resolve_linear("auto", "cpu", "bfloat16") == "native" else [("bfloat16", "native")]))
    with pytest.raises(ValueError, match="fp16 linear layers need"):
        cpu_kernels.baseline_configs("cuda:0", "bfloat16", extra=[("float32", "fp16")])


def _assert_rows_alone_and_threads_change_nothing(layer, x, got) -> None:
    """Each row bit for bit what it is alone (a verify's rows equal one-token
    decoding's), at 1 to 9 rows (past the kernels' 8 a pass), and on two threads."""
    for rows in (1, 4, 5, 6, 7, 8, 9):
        assert torch.equal(layer(x[:rows]), got[:rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(layer(x.reshape(x.shape[0], 1, x.shape[1])).reshape(x.shape[0], -1), got)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(bf16w.unavailable() is not None, reason=f"bf16w kernel: {bf16w.unavailable()}")
@pytest.mark.parametrize("out_features,in_features,bias", [(80, 34, True), (128, 64, False), (16, 6, True)])
def test_bf16w_layers_compute_the_float32_product_and_rows_do_not_depend_on_each_other(out_features, in_features,
                                                                                      bias):
    """Shapes with 64-wide blocks, 16-wide tail blocks, or both; 1 to 13 rows
    (past the kernel's 8 a pass); one thread and two."""
    torch.manual_seed(0)
    linear = _bf16_linear(out_features, in_features, bias)
    layer = bf16w.Bf16wLinear(linear)
    x = torch.randn(13, in_features)
    exact64 = torch.nn.functional.linear(x.double(), linear.weight.double(),
                                         None if linear.bias is None else linear.bias.double())
    got = layer(x)
    assert got.shape == exact64.shape and got.dtype == torch.float32
    scale64 = exact64.abs().amax(dim=-1, keepdim=True) + 1e-30
    assert ((got.double() - exact64).abs() / scale64).max() < 1e-6
    _assert_rows_alone_and_threads_change_nothing(layer, x, got)


@pytest.mark.skipif(bf16w.DOT_KERNEL.unavailable() is not None, reason=f"bf16dot: {bf16w.DOT_KERNEL.unavailable()}")
@pytest.mark.parametrize("out_features,in_features,bias", [(80, 34, True), (128, 64, False), (16, 6, True)])
def test_bf16dot_layers_sum_the_bf16_products_in_order_and_rows_do_not_depend_on_each_other(out_features,
                                                                                          in_features, bias):
    """The inputs rounded to bf16 (to nearest even), then per output one float32
    sum over the pairs of input columns in order (AVX512-BF16's vdpbf16ps adds
    a pair's two exact products, the odd column's first in Intel's manual; a
    Zen 5 VM matched that order bit for bit, which this test does not require)."""
    torch.manual_seed(0)
    linear = _bf16_linear(out_features, in_features, bias)
    with torch.no_grad():
        linear.weight[3] *= 2.0**24  # no subnormal weights: the dot product reads them as zero
    layer = bf16w.Bf16dotLinear(linear)
    x = torch.randn(13, in_features)
    got = layer(x)
    assert got.shape == (13, out_features) and got.dtype == torch.float32
    exact64 = torch.nn.functional.linear(x.bfloat16().double(), linear.weight.double(),
                                         None if linear.bias is None else linear.bias.double())
    scale64 = exact64.abs().amax(dim=-1, keepdim=True) + 1e-30
    assert ((got.double() - exact64).abs() / scale64).max() < 1e-6  # float32 sums of the bf16 inputs' products
    unrounded64 = torch.nn.functional.linear(x.double(), linear.weight.double(), None)
    assert ((exact64 - unrounded64 - (0 if linear.bias is None else linear.bias.double())).abs() / scale64).max() > 1e-5
    _assert_rows_alone_and_threads_change_nothing(layer, x, got)


@pytest.mark.skipif(bf16w.DOT_KERNEL.unavailable() is not None, reason=f"bf16dot: {bf16w.DOT_KERNEL.unavailable()}")
def test_bf16dot_model_is_its_own_reference_and_tandem_equals_it(tiny_models):
    """With --linear bf16dot the target is not float32's, so Tandem's greedy
    output is compared with the target alone on the same kernels, over real
    gRPC, with a draft that is mostly rejected, sequential and pipelined,
    and with a turn's first block verified beside its prompt or with it.
    The linear layers give a verify's rows bit for bit what decoding gives,
    and so does the attention, row by row; SDPA over a block of queries
    differs from one query's in the last float32 bit, which a bf16 rounding
    can carry into a near-tie: on the real pair 3 of 4 bench prompts were
    identical before (bench/RESULTS.md)."""
    from tests.conftest import Cluster

    path = tiny_models["target"]
    model = load_causal_lm(path, ModelConfig(path, dtype="float32", linear="bf16dot"))
    assert not any(type(m) in (torch.nn.Linear, bf16w.Bf16wLinear, cpu_kernels.Fp16Linear, cpu_kernels.PackedLinear)
                   for m in model.modules())  # bf16 weights, shapes that fit: all bf16dot
    assert model.config._attn_implementation == modeling.ROW_BY_ROW
    ids = torch.tensor([[(11 * i) % 128 for i in range(30)]])
    cache = modeling.cache_kwarg(model)
    with torch.inference_mode():  # a verify of 6 tokens: its logits are one-token decoding's, bit for bit
        block_cache, step_cache = DynamicCache(), DynamicCache()
        model(ids[:, :24], use_cache=True, **{cache: block_cache})
        model(ids[:, :24], use_cache=True, **{cache: step_cache})
        block = model(ids[:, 24:], use_cache=True, **{cache: block_cache}).logits[0]
        for row in range(6):
            step = model(ids[:, 24 + row:25 + row], use_cache=True, **{cache: step_cache}).logits[0, 0]
            assert torch.equal(block[row], step)
    prompts = [[5, 17, 99, 3, 42, 8], list(range(20, 60))]
    alone = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40,
                                 do_sample=False, pad_token_id=0)
        alone.append(out[0, len(prompt):].tolist())
    cluster = Cluster(path, tiny_models["other"], k=3, target_linear="bf16dot")
    try:
        with cluster.client() as client:
            for prompt, expected in zip(prompts, alone):
                for pipeline in (False, True):
                    result = client.generate(prompt_ids=prompt, max_tokens=40, pipeline=pipeline)
                    assert result.token_ids == expected
                    assert result.stats.drafted_tokens > result.stats.accepted_tokens  # blocks were cut short
    finally:
        cluster.stop()
    cluster = Cluster(path, tiny_models["other"], k=3, target_linear="bf16dot", prefill_overlap=False)
    try:  # a turn's first block verified with its prompt, in one call (--prefill-overlap off)
        with cluster.client() as client:
            for prompt, expected in zip(prompts, alone):
                assert client.generate(prompt_ids=prompt, max_tokens=40).token_ids == expected
    finally:
        cluster.stop()


@pytest.mark.skipif(bf16w.unavailable() is not None, reason=f"bf16w kernel: {bf16w.unavailable()}")
def test_a_block_verified_with_its_prompt_gives_the_logits_of_decoding_it(tiny_models):
    """A turn's first block can come in one call with its prompt (--prefill-overlap
    off, or a re-sync). On a model that attends row by row, the block's logits
    are still one-token decoding's, bit for bit, after the prompt's own prefill:
    in one forward of 30 rows they would be SDPA's over the whole, whose last
    float32 bits differ. float32 on bf16w, whose rows do not depend on each
    other, carries such a bit into the logits, where bf16dot's rounding of each
    layer's input would mostly hide it in a model this small."""
    path = tiny_models["target"]
    model = load_causal_lm(path, ModelConfig(path, dtype="float32", linear="bf16w"))
    model.set_attn_implementation(modeling.ROW_BY_ROW)
    runner = modeling.ModelRunner(modeling.LoadedModel(model, None, path, "", 128, 512, ()), "cpu")
    assert runner.attends_row_by_row
    tokens = [(11 * i) % 128 for i in range(30)]
    logits = runner.forward_block(DynamicCache(), tokens, k=6)  # [7, vocab]: after the prompt, then each draft token
    cache = DynamicCache()
    steps = [runner.forward(cache, tokens[:24], logits_to_keep=1)[0]]  # the prompt's prefill, then decoding
    steps += [runner.forward(cache, [token], logits_to_keep=1)[0] for token in tokens[24:29]]
    for row, step in enumerate(steps):
        assert torch.equal(logits[row], step), row


@pytest.mark.skipif(bf16w.unavailable() is not None, reason=f"bf16w kernel: {bf16w.unavailable()}")
def test_bf16w_takes_only_bf16_valued_weights_and_keeps_greedy_output(tiny_models):
    torch.manual_seed(0)
    rounded, plain = torch.nn.Linear(16, 32), torch.nn.Linear(16, 32)  # float32 mantissas: not bf16 values
    with torch.no_grad():
        rounded.weight.copy_(rounded.weight.bfloat16().float())
    model = torch.nn.Sequential(rounded, torch.nn.ReLU(), plain, torch.nn.Linear(32, 7))  # 7 outputs: not a multiple of 16
    model[3].weight.data = model[3].weight.data.bfloat16().float()
    assert cpu_kernels.pack_linears(model, "bf16w") == 3
    assert isinstance(model[0], bf16w.Bf16wLinear)
    assert not isinstance(model[2], bf16w.Bf16wLinear) and not isinstance(model[3], bf16w.Bf16wLinear)

    path = tiny_models["target"]
    model = load_causal_lm(path, ModelConfig(path, dtype="float32", linear="bf16w"))
    assert not any(type(m) in (torch.nn.Linear, cpu_kernels.Fp16Linear, cpu_kernels.PackedLinear)
                   for m in model.modules())  # bf16 weights, shapes that fit: all bf16w
    _assert_greedy_equals_reference(model, path)


def test_bf16dot_says_why_it_cannot_run_on_a_cpu_without_the_bf16_dot_product(monkeypatch):
    monkeypatch.setattr(bf16w, "cpu_features", lambda: {"avx512_bf16": False})
    kernel = bf16w.CKernel("bf16dot-test", bf16w.DOT_KERNEL.source, bf16w._dot_flags, bf16w._dot_declare)
    assert kernel.library() is None
    assert "AVX512-BF16" in kernel.unavailable()
    monkeypatch.setattr(bf16w, "DOT_KERNEL", kernel)
    with pytest.raises(ValueError, match="bf16dot linear layers cannot run here: .*AVX512-BF16.*use --linear bf16w"):
        cpu_kernels.resolve_linear("bf16dot", "cpu", "float32")
    with pytest.raises(ValueError, match="need device cpu and dtype float32"):
        cpu_kernels.resolve_linear("bf16dot", "cuda:0", "bfloat16")


def test_auto_measures_the_two_float32_kernels_once_per_machine_and_keeps_the_choice(monkeypatch, tmp_path):
    """tandem.linear_choice: FBGEMM only where it is faster by more than the
    margin; the environment's choice first; a measurement kept in the model
    cache and read back by the next process (here: a cleared cache)."""
    from tandem import linear_choice

    def times(bf16w_ms, fp16_ms):
        return {"bf16w": {1: bf16w_ms, 4: bf16w_ms}, "fp16": {1: fp16_ms, 4: fp16_ms}}

    assert linear_choice.choose(times(10.0, 9.6)) == "bf16w"  # within the margin: bf16w verifies for less
    assert linear_choice.choose(times(10.0, 9.0)) == "fp16"
    assert linear_choice.choose(times(9.0, 10.0)) == "bf16w"
    monkeypatch.setenv("TANDEM_MODEL_CACHE", str(tmp_path))
    measured = []
    monkeypatch.setattr(linear_choice, "measure", lambda threads: measured.append(threads) or times(10.0, 8.0))
    linear_choice.faster_float32_kernel.cache_clear()
    try:
        assert linear_choice.faster_float32_kernel(1) == "fp16" and measured == [1]
        linear_choice.faster_float32_kernel.cache_clear()  # as a new process would
        assert linear_choice.faster_float32_kernel(1) == "fp16" and measured == [1]  # read back, not measured
        assert linear_choice.faster_float32_kernel(2) == "fp16" and measured == [1, 2]  # another thread count
        monkeypatch.setenv("TANDEM_LINEAR_AUTO", "bf16w")
        linear_choice.faster_float32_kernel.cache_clear()
        assert linear_choice.faster_float32_kernel(1) == "bf16w" and measured == [1, 2]
        monkeypatch.setenv("TANDEM_LINEAR_AUTO", "fast")
        linear_choice.faster_float32_kernel.cache_clear()
        with pytest.raises(ValueError, match="TANDEM_LINEAR_AUTO"):
            linear_choice.faster_float32_kernel(1)
    finally:
        linear_choice.faster_float32_kernel.cache_clear()


@pytest.mark.skipif(not (cpu_kernels.bf16w_available() and cpu_kernels.fp16_available()
                         and cpu_kernels.packed_available()), reason="needs bf16w and FBGEMM's fp16 layers")
def test_the_measurement_times_both_kernels_on_layers_that_stream_from_memory():
    from tandem import linear_choice

    ms = linear_choice.measure(1)
    assert set(ms) == {"bf16w", "fp16"} and all(0 < t < 10_000 for by_rows in ms.values() for t in by_rows.values())
    assert linear_choice._layers() * linear_choice.LAYER_BYTES >= min(linear_choice.MIN_BYTES,
                                                               linear_choice.MAX_LAYERS * linear_choice.LAYER_BYTES)
