"""Packed oneDNN linear layers compute what nn.Linear computes, and the model
config picks them only where they apply."""
import pytest
import torch

from tandem import cpu_kernels
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


def test_config_resolves_dtype_and_kernels():
    assert ModelConfig("m", device="cuda:0").resolved_dtype == "bfloat16"
    assert not ModelConfig("m", device="cuda:0", dtype="float32").packed
    assert not ModelConfig("m", dtype="bfloat16").packed
    assert ModelConfig("m", dtype="float32").packed
    assert not ModelConfig("m", dtype="float32", linear="native").packed
    cpu = ModelConfig("m").resolved_dtype
    assert cpu == ("bfloat16" if cpu_kernels.native_bf16() else "float32")
    with pytest.raises(ValueError, match="packed"):
        ModelConfig("m", dtype="bfloat16", linear="packed")
    with pytest.raises(ValueError, match="linear"):
        ModelConfig("m", linear="fast")
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig("m", dtype="int4")


def test_baselines_include_every_kernel_that_may_decode_faster():
    # A speedup is taken over the fastest target alone: the service's own
    # configuration comes first (the identity reference), then nn.Linear when
    # the service packs (it wins on one-token decoding), then bf16.
    assert cpu_kernels.baseline_configs("cpu", "float32") == [
        ("float32", "auto"), ("float32", "native"), ("bfloat16", "auto")]
    assert cpu_kernels.baseline_configs("cpu", "bfloat16") == [("bfloat16", "auto")]
    assert cpu_kernels.baseline_configs("cuda:0", "float32") == [("float32", "auto"), ("bfloat16", "auto")]
    for config in [("float32", "auto"), ("float32", "native"), ("bfloat16", "auto")]:
        assert cpu_kernels.parse_config(cpu_kernels.config_label(*config)) == config
