import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from engine.config import ModelConfig
from engine.errors import GDecodeError
from engine.weights import checkpoint_bytes, load_weights

ARCH_NAMES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def tiny_config(arch: str = "llama", **over) -> dict:
    d = {
        "architectures": [ARCH_NAMES[arch]],
        "vocab_size": 37,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 6,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    return {**d, **over}


def random_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor a checkpoint for cfg holds, as float32, in HF names."""
    rng = np.random.default_rng(seed)
    h, q, kv, d, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
        if cfg.attention_bias:
            shapes.update({p + f"self_attn.{x}_proj.bias": (s,) for x, s in (("q", q), ("k", kv), ("v", kv))})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def write_checkpoint(model_dir: Path, config: dict, tensors: dict, dtype=np.float32, shards: int = 1) -> Path:
    """Write config.json and the tensors as model.safetensors, or as `shards` files plus an index."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    cast = {k: np.ascontiguousarray(v if dtype is None else v.astype(dtype)) for k, v in tensors.items()}
    if shards == 1:
        save_file(cast, str(model_dir / "model.safetensors"))
        return model_dir
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: v for j, (k, v) in enumerate(cast.items()) if j % shards == s}
        save_file(part, str(model_dir / fname))
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": sum(v.nbytes for v in cast.values())}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return model_dir


def make_model(tmp_path: Path, arch="llama", dtype=np.float32, shards=1, name="m", **over):
    config = tiny_config(arch, **over)
    cfg = ModelConfig.from_dict(config)
    tensors = random_tensors(cfg)
    return write_checkpoint(tmp_path / name, config, tensors, dtype, shards), cfg, tensors


def all_arrays(w):
    out = {"embed": w.embed, "final_norm": w.final_norm, "lm_head": w.lm_head}
    for i, layer in enumerate(w.layers):
        out.update({f"{i}.{k}": v for k, v in vars(layer).items()})
    return out


VARIANTS = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("mistral", {"num_key_value_heads": 4}),
    ("qwen2", {}),
    ("qwen3", {"tie_word_embeddings": True}),
]


@pytest.mark.parametrize("arch,over", VARIANTS)
def test_sharded_matches_single(tmp_path, arch, over):
    single, cfg, _ = make_model(tmp_path, arch, name="single", **over)
    sharded, _, _ = make_model(tmp_path, arch, shards=3, name="sharded", **over)
    a, b = all_arrays(load_weights(single, cfg)), all_arrays(load_weights(sharded, cfg))
    assert a.keys() == b.keys()
    for k in a:
        if a[k] is None:
            assert b[k] is None, k
        else:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("arch,over", VARIANTS)
def test_fused_layout(tmp_path, arch, over):
    path, cfg, t = make_model(tmp_path, arch, **over)
    w = load_weights(path, cfg)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}."
        assert layer.wqkv.shape == (q + 2 * kv, cfg.hidden_size)
        np.testing.assert_array_equal(layer.wqkv[:q], t[p + "self_attn.q_proj.weight"])
        np.testing.assert_array_equal(layer.wqkv[q : q + kv], t[p + "self_attn.k_proj.weight"])
        np.testing.assert_array_equal(layer.wqkv[q + kv :], t[p + "self_attn.v_proj.weight"])
        assert layer.w_gate_up.shape == (2 * inter, cfg.hidden_size)
        np.testing.assert_array_equal(layer.w_gate_up[:inter], t[p + "mlp.gate_proj.weight"])
        np.testing.assert_array_equal(layer.w_gate_up[inter:], t[p + "mlp.up_proj.weight"])
        np.testing.assert_array_equal(layer.wo, t[p + "self_attn.o_proj.weight"])
        np.testing.assert_array_equal(layer.w_down, t[p + "mlp.down_proj.weight"])
        np.testing.assert_array_equal(layer.attn_norm, t[p + "input_layernorm.weight"])
        np.testing.assert_array_equal(layer.mlp_norm, t[p + "post_attention_layernorm.weight"])
        if cfg.attention_bias:
            bias = [t[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]
            np.testing.assert_array_equal(layer.bqkv, np.concatenate(bias))
        else:
            assert layer.bqkv is None
        if cfg.qk_norm:
            np.testing.assert_array_equal(layer.q_norm, t[p + "self_attn.q_norm.weight"])
            np.testing.assert_array_equal(layer.k_norm, t[p + "self_attn.k_norm.weight"])
        else:
            assert layer.q_norm is None and layer.k_norm is None
    np.testing.assert_array_equal(w.embed, t["model.embed_tokens.weight"])
    np.testing.assert_array_equal(w.final_norm, t["model.norm.weight"])
    if cfg.tie_word_embeddings:
        assert w.lm_head is w.embed
    else:
        np.testing.assert_array_equal(w.lm_head, t["lm_head.weight"])
    assert checkpoint_bytes(w) == cfg.param_count() * 4


def test_unfused_tensors_are_memory_mapped(tmp_path):
    path, cfg, _ = make_model(tmp_path)
    w = load_weights(path, cfg)
    assert not w.embed.flags.owndata and not w.embed.flags.writeable
    assert w.layers[0].wqkv.flags.owndata


@pytest.mark.parametrize("dtype,tol", [(ml_dtypes.bfloat16, 2.0**-8), (np.float16, 2.0**-11)])
@pytest.mark.parametrize("shards", [1, 2])
def test_half_precision_matches_fp32(tmp_path, dtype, tol, shards):
    ref_path, cfg, _ = make_model(tmp_path, "qwen2", name="f32")
    path, _, _ = make_model(tmp_path, "qwen2", dtype=dtype, shards=shards, name="half")
    ref, got = all_arrays(load_weights(ref_path, cfg)), all_arrays(load_weights(path, cfg))
    for k, r in ref.items():
        if r is None:
            continue
        assert got[k].dtype == np.dtype(dtype), k
        np.testing.assert_allclose(got[k].astype(np.float32), r, rtol=tol, atol=1e-6, err_msg=k)
    assert checkpoint_bytes(load_weights(path, cfg)) == cfg.param_count() * 2


def test_tied_checkpoint_with_lm_head_uses_embed(tmp_path):
    config = tiny_config(tie_word_embeddings=True)
    cfg = ModelConfig.from_dict(config)
    t = random_tensors(cfg)
    t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1
    w = load_weights(write_checkpoint(tmp_path / "m", config, t), cfg)
    assert w.lm_head is w.embed


def error_of(path, cfg) -> str:
    with pytest.raises(GDecodeError) as e:
        load_weights(path, cfg)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def error_after(tmp_path, edit, arch="llama", dtype=np.float32, shards=1) -> str:
    """The load error of a tiny checkpoint whose tensors edit(tensors) changed in place."""
    config = tiny_config(arch)
    cfg = ModelConfig.from_dict(config)
    t = random_tensors(cfg)
    edit(t)
    return error_of(write_checkpoint(tmp_path / "m", config, t, dtype=dtype, shards=shards), cfg)


def test_missing_tensor(tmp_path):
    msg = error_after(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert "model.safetensors" in msg and "model.layers.1.mlp.up_proj.weight" in msg and "missing" in msg


def test_missing_tensor_sharded(tmp_path):
    msg = error_after(tmp_path, lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"), "qwen2", shards=2)
    assert "model.safetensors.index.json" in msg and "model.layers.0.self_attn.k_proj.bias" in msg


def test_tensor_listed_in_index_but_absent_from_shard(tmp_path):
    path, cfg, _ = make_model(tmp_path, shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    wrong = next(f for f in set(wm.values()) if f != wm["model.norm.weight"])
    wm["model.norm.weight"] = wrong
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = error_of(path, cfg)
    assert wrong in msg and "model.norm.weight" in msg and "missing" in msg


def test_untied_without_lm_head(tmp_path):
    msg = error_after(tmp_path, lambda t: t.pop("lm_head.weight"))
    assert "model.safetensors" in msg and "lm_head.weight" in msg and "tie_word_embeddings" in msg


def test_wrong_shape(tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"].T.copy()

    msg = error_after(tmp_path, edit)
    assert "model.safetensors" in msg and "model.layers.0.self_attn.o_proj.weight" in msg
    assert "[24, 16]" in msg and "[16, 24]" in msg


def test_wrong_vocab_size(tmp_path):
    path, _, _ = make_model(tmp_path)
    cfg = ModelConfig.from_dict(tiny_config(vocab_size=40))
    assert "model.embed_tokens.weight" in error_of(path, cfg)


def test_unsupported_dtype(tmp_path):
    def edit(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.float64)

    msg = error_after(tmp_path, edit, dtype=None)
    assert "model.safetensors" in msg and "model.norm.weight" in msg and "F64" in msg


def test_mixed_dtypes_in_a_fused_group(tmp_path):
    def edit(t):
        t.update({k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()})
        t["model.layers.1.self_attn.v_proj.weight"] = t["model.layers.1.self_attn.v_proj.weight"].astype(np.float32)

    msg = error_after(tmp_path, edit, dtype=None)
    assert "model.layers.1.self_attn.v_proj.weight" in msg


def header_of(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def test_truncated_file(tmp_path):
    path, cfg, _ = make_model(tmp_path)
    f = path / "model.safetensors"
    header = header_of(f)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    f.write_bytes(f.read_bytes()[:-10])
    msg = error_of(path, cfg)
    assert "model.safetensors" in msg and last in msg and "truncated" in msg


def test_missing_shard(tmp_path):
    path, cfg, _ = make_model(tmp_path, shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    msg = error_of(path, cfg)
    assert "model-00002-of-00003.safetensors" in msg and "tensor" in msg


@pytest.mark.parametrize(
    "content",
    [b"", b"hello", b"not a safetensors file at all, just text", struct.pack("<Q", 5) + b"{oops"],
)
def test_not_safetensors(tmp_path, content):
    path, cfg, _ = make_model(tmp_path)
    (path / "model.safetensors").write_bytes(content)
    msg = error_of(path, cfg)
    assert "model.safetensors" in msg and "not a safetensors file" in msg and "model.embed_tokens.weight" in msg


def test_no_checkpoint(tmp_path):
    path, cfg, _ = make_model(tmp_path)
    (path / "model.safetensors").unlink()
    assert "model.safetensors" in error_of(path, cfg)


@pytest.mark.parametrize("kind, what", [("dir", "a directory, not a safetensors file"), ("fifo", "not a regular file")])
def test_checkpoint_not_a_regular_file(tmp_path, kind, what):
    path, cfg, _ = make_model(tmp_path)
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").mkdir() if kind == "dir" else os.mkfifo(path / "model.safetensors")
    assert error_of(path, cfg) == f"{path / 'model.safetensors'}: {what}"


def test_bad_index(tmp_path):
    path, cfg, _ = make_model(tmp_path, shards=2)
    (path / "model.safetensors.index.json").write_text("{}")
    assert "model.safetensors.index.json" in error_of(path, cfg)
