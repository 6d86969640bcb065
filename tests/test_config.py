import json
import math

import numpy as np
import pytest

from engine.config import ModelConfig, RopeScaling
from engine.errors import GDecodeError

LLAMA31_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
# trimmed from the published config.json files
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": LLAMA31_SCALING,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "torch_dtype": "float16",
    "vocab_size": 32000,
}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": None,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "vocab_size": 32768,
}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}


def test_llama31_with_llama3_scaling():
    c = ModelConfig.from_dict(LLAMA31_8B)
    assert (c.arch, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 32, 32, 8, 128)
    assert (c.q_size, c.kv_size, c.group_size) == (4096, 1024, 4)
    assert c.rope_theta == 500000.0 and c.rms_norm_eps == 1e-5
    assert c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert c.eos_token_ids == (128001, 128008, 128009) and c.bos_token_id == 128000
    assert not (c.attention_bias or c.qk_norm or c.tie_word_embeddings)
    assert c.param_count() == 8_030_261_248


def test_llama2_defaults():
    c = ModelConfig.from_dict(LLAMA2_7B)
    assert c.rope_theta == 10000.0 and c.rope_scaling is None
    assert c.num_kv_heads == 32 and c.group_size == 1 and c.head_dim == 128
    assert c.eos_token_ids == (2,) and c.torch_dtype == "float16"
    assert c.param_count() == 6_738_415_616


def test_rope_parameters_form():
    d = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    c = ModelConfig.from_dict({**d, "rope_parameters": {**LLAMA31_SCALING, "rope_theta": 500000.0}})
    ref = ModelConfig.from_dict(LLAMA31_8B)
    assert c.rope_theta == 500000.0 and c.rope_scaling == ref.rope_scaling
    plain = ModelConfig.from_dict({**d, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_explicit_head_dim():
    c = ModelConfig.from_dict(QWEN3_06B)
    assert c.head_dim == 128 != c.hidden_size // c.num_heads
    assert (c.q_size, c.kv_size) == (2048, 1024)


def test_mistral():
    c = ModelConfig.from_dict(MISTRAL_7B)
    assert c.arch == "mistral" and c.head_dim == 128 and c.rope_theta == 1e6
    assert not c.tie_word_embeddings and not c.attention_bias and not c.qk_norm


def test_qwen2_has_qkv_bias():
    c = ModelConfig.from_dict(QWEN25_05B)
    assert c.arch == "qwen2" and c.attention_bias and not c.qk_norm
    assert c.tie_word_embeddings and c.head_dim == 64 and c.group_size == 7
    assert c.param_count() == 494_032_768


def test_qwen3_has_qk_norm():
    c = ModelConfig.from_dict(QWEN3_06B)
    assert c.arch == "qwen3" and c.qk_norm and not c.attention_bias
    assert c.param_count() == 596_049_920


def test_unsupported_architecture_names_supported_ones():
    with pytest.raises(GDecodeError) as e:
        ModelConfig.from_dict({**LLAMA31_8B, "architectures": ["GPTNeoXForCausalLM"]}, source="m/config.json")
    msg = str(e.value)
    assert "m/config.json" in msg and "GPTNeoXForCausalLM" in msg
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in msg


def test_missing_architectures_mentions_model_type():
    d = {k: v for k, v in LLAMA31_8B.items() if k != "architectures"}
    with pytest.raises(GDecodeError, match="llama"):
        ModelConfig.from_dict(d)


def test_missing_field_is_named():
    d = {k: v for k, v in LLAMA31_8B.items() if k != "intermediate_size"}
    with pytest.raises(GDecodeError, match="intermediate_size"):
        ModelConfig.from_dict(d)


def test_unsupported_rope_type():
    with pytest.raises(GDecodeError, match="yarn"):
        ModelConfig.from_dict({**LLAMA31_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_from_dir_reads_generation_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (151645,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (151645, 151643)


def test_from_dir_errors(tmp_path):
    with pytest.raises(GDecodeError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(GDecodeError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(GDecodeError, match="not found"):
        ModelConfig.from_dir(tmp_path / "nope")


def llama3_inv_freq_reference(theta, head_dim, factor, low, high, old_ctx):
    # Meta's apply_scaling, one frequency at a time
    out = []
    for k in range(0, head_dim, 2):
        freq = 1.0 / theta ** (k / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(freq)
        elif wavelen > old_ctx / low:
            out.append(freq / factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def test_inv_freq_llama3_matches_direct_recomputation():
    c = ModelConfig.from_dict(LLAMA31_8B)
    got = c.inv_freq()
    want = llama3_inv_freq_reference(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    assert got.shape == (64,) and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # all three regions occur: unscaled, scaled by 1/factor, and smoothed
    base = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    ratio = got / base
    assert np.any(ratio == 1.0) and np.any(np.isclose(ratio, 1 / 8)) and np.any((ratio > 1 / 8) & (ratio < 1))


def test_inv_freq_without_scaling():
    c = ModelConfig.from_dict(QWEN3_06B)
    np.testing.assert_allclose(c.inv_freq(), 1.0 / 1e6 ** (np.arange(0, 128, 2) / 128), rtol=1e-14)


@pytest.mark.slow
def test_inv_freq_matches_transformers():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in LLAMA31_8B.items() if k != "architectures"})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    np.testing.assert_allclose(ModelConfig.from_dict(LLAMA31_8B).inv_freq(), want.double().numpy(), rtol=1e-6)


# ---- the sliding-window cap on the context, and the defaults of omitted fields ----


@pytest.mark.parametrize(
    "base, over, want",
    [
        (MISTRAL_7B, {"sliding_window": 4096}, 4096),  # Mistral 7B v0.1: attention past 4096 would differ
        (MISTRAL_7B, {"sliding_window": None}, 32768),
        (MISTRAL_7B, {"sliding_window": 65536}, 32768),  # a window past the context changes nothing
        (QWEN25_05B, {"sliding_window": 4096, "use_sliding_window": False}, 32768),
        (QWEN25_05B, {"sliding_window": 4096, "use_sliding_window": True}, 4096),
        (QWEN3_06B, {"sliding_window": 2048, "use_sliding_window": True}, 2048),
        (LLAMA2_7B, {"sliding_window": 1024}, 4096),  # Llama has no sliding window
    ],
)
def test_sliding_window_caps_the_context(base, over, want):
    assert ModelConfig.from_dict({**base, **over}).max_position_embeddings == want


@pytest.mark.parametrize("base", [LLAMA2_7B, LLAMA31_8B, MISTRAL_7B, QWEN25_05B, QWEN3_06B],
                         ids=lambda d: d["architectures"][0])
@pytest.mark.parametrize("missing", ["absent", "null"])
def test_defaults_of_omitted_fields(base, missing):
    # one KV head per head and eps 1e-6, as transformers' LlamaConfig (the others' eps default is the same)
    transformers = pytest.importorskip("transformers")
    d = {k: v for k, v in base.items() if k not in ("num_key_value_heads", "rms_norm_eps")}
    if missing == "null":
        d.update(num_key_value_heads=None, rms_norm_eps=None)
    hf = transformers.LlamaConfig(num_attention_heads=base["num_attention_heads"], hidden_size=base["hidden_size"])
    arch_hf = {"Mistral": transformers.MistralConfig, "Qwen2": transformers.Qwen2Config,
               "Qwen3": transformers.Qwen3Config}.get(base["architectures"][0][:-len("ForCausalLM")], type(hf))()
    c = ModelConfig.from_dict(d)
    assert c.num_kv_heads == hf.num_key_value_heads == base["num_attention_heads"] and c.group_size == 1
    assert c.rms_norm_eps == hf.rms_norm_eps == arch_hf.rms_norm_eps


def test_eps_and_theta_are_read_not_defaulted():
    c = ModelConfig.from_dict({**LLAMA2_7B, "rms_norm_eps": 3e-5, "rope_theta": 123456.0})
    assert (c.rms_norm_eps, c.rope_theta) == (3e-5, 123456.0)
