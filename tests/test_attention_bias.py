"""Llama and Qwen3 checkpoints with attention_bias: true carry a bias on o_proj too (LayerWeights.bo)."""

import json

import numpy as np
import pytest
import torch
import transformers as hf

from engine.config import ModelConfig
from engine.errors import GDecodeError
from engine.weights import load_weights
from tests.test_parity_hf import RTOL, hf_run, prompt, reference_run, rel_err
from tests.tiny import _perturb

ARCHS = {"llama": (hf.LlamaConfig, hf.LlamaForCausalLM), "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM),
         "mistral": (hf.MistralConfig, hf.MistralForCausalLM)}


def biased_model(d, arch: str, bias: bool = True, seed: int = 3):
    conf_cls, model_cls = ARCHS[arch]
    conf = conf_cls(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                    initializer_range=0.15, tie_word_embeddings=False, attention_bias=bias)
    torch.manual_seed(seed)
    model = model_cls(conf).eval()
    _perturb(model, seed)  # biases random, not zero
    model.save_pretrained(d, safe_serialization=True)
    return d, model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_o_proj_bias_matches_transformers(tmp_path, arch):
    d, model = biased_model(tmp_path / arch, arch)
    cfg = ModelConfig.from_dir(d)
    assert cfg.attention_bias and cfg.o_proj_bias
    w = load_weights(d, cfg)
    for i, layer in enumerate(w.layers):
        want = model.model.layers[i].self_attn.o_proj.bias.detach().numpy()
        assert layer.bo is not None and np.abs(want).max() > 0.1
        np.testing.assert_array_equal(layer.bo, want)
    ids = prompt(320, seed=5)
    ours, tokens = reference_run(d, ids)
    theirs, their_tokens = hf_run(d, ids)
    assert rel_err(ours, theirs).max() <= RTOL
    assert tokens == their_tokens


@pytest.mark.parametrize("arch, bias", [("llama", False), ("qwen3", False), ("mistral", True)])
def test_no_o_proj_bias(tmp_path, arch, bias):
    # Mistral has no attention biases whatever its config says
    d, _ = biased_model(tmp_path / arch, arch, bias=bias)
    assert json.loads((d / "config.json").read_text())["attention_bias"] is bias
    cfg = ModelConfig.from_dir(d)
    assert not cfg.o_proj_bias
    assert all(layer.bo is None for layer in load_weights(d, cfg).layers)


def test_cuda_backend_refuses_a_bias_it_does_not_apply(tmp_path):
    pytest.importorskip("cupy")
    from engine.backend_cuda import CudaBackend

    d, _ = biased_model(tmp_path / "llama", "llama")
    with pytest.raises(GDecodeError, match="o_proj"):
        CudaBackend(ModelConfig.from_dir(d), None)
