"""Every field of config.json read by ModelConfig: its default, its bounds (both ends), and the exact
one-line error that names it. Written against the survivors of `make mutants FILES=engine/config.py`."""

import dataclasses
import errno
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from engine.config import ModelConfig, RopeScaling
from engine.errors import GDecodeError
from tests.test_reference import plain_inv_freq

BASE = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
SUPPORTED = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"


def cfg(**over):
    d = {**BASE, **over}
    return ModelConfig.from_dict({k: v for k, v in d.items() if v is not ...})


def exactly(msg):
    return "^" + re.escape(msg) + "$"


@pytest.mark.parametrize("over, msg", [
    ({"architectures": ["Foo", "Bar"]}, f"unsupported architecture Foo, Bar (supported: {SUPPORTED})"),
    ({"architectures": ..., "model_type": "gpt2"}, f"unsupported architecture gpt2 (supported: {SUPPORTED})"),
    ({"architectures": ...}, f"unsupported architecture none given (supported: {SUPPORTED})"),
    ({"mlp_bias": True}, "mlp_bias is not supported"),
    ({"num_attention_heads": 128, "num_key_value_heads": 128, "head_dim": 16},
     "num_attention_heads is 128, outside [1, 64]"),
    ({"num_key_value_heads": 8}, "num_key_value_heads is 8, outside [1, 4]"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"hidden_size": 66}, "hidden_size 66 is not a multiple of num_attention_heads 4"),
    ({"head_dim": 15}, "head_dim 15 must be even for RoPE"),
    ({"bos_token_id": 100}, "bos_token_id is 100, outside [0, 99]"),
    ({"bos_token_id": -1}, "bos_token_id is -1, outside [0, 99]"),
    ({"torch_dtype": 5}, "torch_dtype must be a string, not an integer"),
    ({"rms_norm_eps": 1.0}, "rms_norm_eps is 1.0, outside (0, 1)"),
    ({"rms_norm_eps": 0}, "rms_norm_eps is 0, outside (0, 1)"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps must be a number, not a string ('x')"),
    ({"hidden_size": "64"}, "hidden_size must be an integer, not a string ('64')"),
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0, outside [1, 2147483648]"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false, not a string ('yes')"),
    ({"eos_token_id": 100}, "eos_token_id 100 is outside the vocabulary [0, 100)"),
    ({"eos_token_id": [2, -1]}, "eos_token_id must be a token id or a list of ids, not a list ([2, -1])"),
    ({"_generation_eos": [-1]}, "generation_eos must be a token id or a list of ids, not a list ([-1])"),
    ({"_generation_eos": [100]}, "eos_token_id of generation_config.json 100 is outside the vocabulary [0, 100)"),
    ({"rope_parameters": "x"}, "rope_parameters must be an object or null, not a string"),
    ({"rope_scaling": 5}, "rope_scaling must be an object or null, not an integer"),
    ({"hidden_size": True}, "hidden_size must be an integer, not a boolean (True)"),
    ({"hidden_size": 64.0}, "hidden_size must be an integer, not a number (64.0)"),
    ({"torch_dtype": {"a": 1}}, "torch_dtype must be a string, not an object"),
])
def test_bad_field_is_one_exact_line(over, msg):
    with pytest.raises(GDecodeError, match=exactly("config.json: " + msg)):
        cfg(**over)


@pytest.mark.parametrize("over, msg", [
    ({"rope_theta": ..., "rope_parameters": {"rope_theta": "x"}},
     "config.json rope_parameters: rope_theta must be a number, not a string ('x')"),
    *[({"rope_scaling": {k: v for k, v in LLAMA3.items() if k != missing}},
       f"config.json rope_scaling: missing field {missing}")
      for missing in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")],
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 2.0}},
     "config.json rope_scaling: high_freq_factor 2.0 must exceed low_freq_factor 2.0"),
])
def test_bad_rope_field_names_its_object(over, msg):
    with pytest.raises(GDecodeError, match=exactly(msg)):
        cfg(**over)


def test_not_an_object():
    with pytest.raises(GDecodeError, match=exactly("config.json: must be a JSON object, not a list")):
        ModelConfig.from_dict([1])
    with pytest.raises(GDecodeError, match=exactly("x.json: must be a JSON object, not null")):
        ModelConfig.from_dict(None, source="x.json")
    with pytest.raises(GDecodeError, match=exactly("config.json: must be a JSON object, not tuple")):
        ModelConfig.from_dict((1,))


def test_defaults_of_omitted_fields():
    c = cfg(num_key_value_heads=..., max_position_embeddings=..., rms_norm_eps=..., architectures="LlamaForCausalLM")
    assert c.num_kv_heads == 4 and type(c.group_size) is int and c.group_size == 1
    assert c.max_position_embeddings == 4096 and c.rms_norm_eps == 1e-6
    assert type(c.head_dim) is int and c.head_dim == 16
    assert c.tie_word_embeddings is False and c.attention_bias is False and c.o_proj_bias is False
    assert c.bos_token_id is None and c.eos_token_ids == () and c.torch_dtype == "bfloat16"
    assert c.rope_theta == 10000.0 and c.rope_scaling is None
    assert cfg(rope_theta=..., rope_parameters={"rope_theta": 5e5}).rope_theta == 5e5
    assert cfg(dtype="float16").torch_dtype == "float16"
    assert cfg(torch_dtype="float32", dtype="float16").torch_dtype == "float32"


def test_bounds_are_inclusive_where_they_should_be():
    assert cfg(num_hidden_layers=1).num_layers == 1
    assert cfg(bos_token_id=0).bos_token_id == 0 and cfg(bos_token_id=99).bos_token_id == 99
    assert cfg(eos_token_id=[0, 99]).eos_token_ids == (0, 99)
    assert cfg(num_key_value_heads=4, num_attention_heads=4).num_kv_heads == 4
    assert cfg(rms_norm_eps=0.5).rms_norm_eps == 0.5
    assert cfg(hidden_size=66, head_dim=16).head_dim == 16  # head_dim given: hidden need not divide


def test_attention_biases_per_architecture():
    def biases(arch, flag):
        c = cfg(architectures=[arch], attention_bias=flag)
        return c.attention_bias, c.o_proj_bias

    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        assert biases(arch, True) == (True, True) and biases(arch, False) == (False, False)
    assert biases("Qwen2ForCausalLM", True) == (True, False) == biases("Qwen2ForCausalLM", False)
    assert biases("MistralForCausalLM", True) == (False, False)
    assert cfg(attention_bias=...).o_proj_bias is False
    assert cfg(mlp_bias=False).arch == "llama"


def test_param_count_counts_every_bias():
    plain, biased = cfg(), cfg(attention_bias=True)
    per_layer = plain.q_size + 2 * plain.kv_size + plain.hidden_size
    assert biased.param_count() - plain.param_count() == plain.num_layers * per_layer
    qwen3 = cfg(architectures=["Qwen3ForCausalLM"])
    assert qwen3.param_count() - plain.param_count() == plain.num_layers * 2 * plain.head_dim


def test_kv_bytes_per_token():
    c = cfg()
    assert c.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2 and c.kv_bytes_per_token(4) == 2 * 2 * 2 * 16 * 4


def test_rope_scaling_is_read_from_either_key_and_type():
    for d in ({"rope_scaling": LLAMA3}, {"rope_parameters": {**LLAMA3, "rope_theta": 5e5}, "rope_theta": ...},
              {"rope_scaling": {k if k != "rope_type" else "type": v for k, v in LLAMA3.items()}}):
        c = cfg(**d)
        assert c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192), d
    assert cfg(rope_scaling={"rope_type": "default"}).rope_scaling is None


def test_llama3_bands_with_their_own_factors():
    c = cfg(head_dim=64, rope_theta=1e4, rope_scaling={**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 8.0})
    np.testing.assert_allclose(c.inv_freq(), plain_inv_freq(c), rtol=1e-13, atol=0)


def test_llama3_band_edge_is_continuous():
    # the first pair's wavelength is exactly 2 pi = original / low_freq_factor: the smooth band starts
    # there at inv / factor (as in transformers), not at the unscaled inv
    s = {**LLAMA3, "low_freq_factor": 8192 / (2 * math.pi), "high_freq_factor": 8192 / 3.0}
    assert 8192 / s["low_freq_factor"] == 2 * math.pi
    c = cfg(rope_scaling=s)
    assert c.inv_freq()[0] == pytest.approx(1 / 8.0, rel=1e-12)


def test_post_init_messages():
    c = cfg()
    with pytest.raises(AssertionError, match=exactly("num_heads must be a multiple of num_kv_heads")):
        dataclasses.replace(c, num_kv_heads=3)
    with pytest.raises(AssertionError, match=exactly("head_dim must be even for RoPE")):
        dataclasses.replace(c, head_dim=15)


def write(d: Path, config, gen=None) -> Path:
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if gen is not None:
        (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def test_from_dir_names_its_files(tmp_path):
    d = write(tmp_path / "m", {**BASE, "eos_token_id": 1}, {"eos_token_id": [1, 2]})
    assert ModelConfig.from_dir(d).eos_token_ids == (1, 2)
    write(d, {**BASE, "rms_norm_eps": 2.0})
    with pytest.raises(GDecodeError, match=exactly(f"{d / 'config.json'}: rms_norm_eps is 2.0, outside (0, 1)")):
        ModelConfig.from_dir(d)
    write(d, BASE, {"eos_token_id": "x"})
    gen = d / "generation_config.json"
    with pytest.raises(GDecodeError, match=exactly(f"{gen}: eos_token_id must be a token id or a list of ids, "
                                                   f"not a string ('x')")):
        ModelConfig.from_dir(d)
    write(d, BASE, {"eos_token_id": 100})
    with pytest.raises(GDecodeError, match=exactly(f"{d / 'config.json'}: eos_token_id of generation_config.json "
                                                   f"100 is outside the vocabulary [0, 100)")):
        ModelConfig.from_dir(d)
    (d / "config.json").write_text("[1]")
    with pytest.raises(GDecodeError, match=exactly(f"{d / 'config.json'}: must be a JSON object, not a list")):
        ModelConfig.from_dir(d)
    (d / "config.json").write_text("[" * 100_000)
    with pytest.raises(GDecodeError, match=exactly(f"{d / 'config.json'}: not valid JSON (nested too deeply)")):
        ModelConfig.from_dir(d)
    (d / "config.json").write_text("{")
    with pytest.raises(GDecodeError, match="^" + re.escape(f"{d / 'config.json'}: not valid JSON (")):
        ModelConfig.from_dir(d)
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(GDecodeError, match=exactly(f"{f} is not a model directory")):
        ModelConfig.from_dir(f)


def test_unreadable_config(tmp_path, monkeypatch):
    d = write(tmp_path / "m", BASE)

    def fail(self):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(Path, "read_bytes", fail)
    with pytest.raises(GDecodeError, match=exactly(f"{d / 'config.json'}: cannot read (Input/output error)")):
        ModelConfig.from_dir(d)


def test_hub_name_gets_its_own_message():
    with pytest.raises(GDecodeError, match="^" + re.escape("meta-llama/Llama-3-8B is not a local path, and "
                                                           "downloading from the Hugging Face hub")):
        ModelConfig.from_dir("meta-llama/Llama-3-8B")
