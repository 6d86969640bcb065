"""Safetensors loading into fused per-layer weights (QKV and gate/up fused once, at load)."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from engine.config import ModelConfig
from engine.errors import GDecodeError, not_a_file


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [H]
    wqkv: np.ndarray  # [q_size + 2*kv_size, H]  rows: q, then k, then v
    bqkv: np.ndarray | None  # [q_size + 2*kv_size] (Qwen2) or None
    wo: np.ndarray  # [H, q_size]
    q_norm: np.ndarray | None  # [head_dim] (Qwen3) or None
    k_norm: np.ndarray | None  # [head_dim] (Qwen3) or None
    mlp_norm: np.ndarray  # [H]
    w_gate_up: np.ndarray  # [2*I, H]  rows: gate, then up
    w_down: np.ndarray  # [H, I]
    bo: np.ndarray | None = None  # [H] o_proj bias (Llama, Qwen3 with attention_bias) or None


@dataclass
class ModelWeights:
    """Arrays keep the checkpoint dtype: float32, float16 or ml_dtypes.bfloat16. Loaded from a GGUF
    (engine.gguf_model), a matrix may instead be an engine.quant.QuantMatrix, and wqkv / w_gate_up a
    QuantStack of one QuantMatrix per part."""

    embed: np.ndarray  # [V, H]
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [H]
    lm_head: np.ndarray  # [V, H]; the same array as embed when tied


DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32)}
# bits per element of every dtype a safetensors file may hold (the ones we do not load are still checked)
_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
         "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "F4": 4, "F6_E2M3": 6,
         "F6_E3M2": 6}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class _Info:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _unique_keys(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise GDecodeError(f"duplicate key {k!r}")
        d[k] = v
    return d


def parse_header(raw: bytes, data_bytes: int, where: str) -> dict[str, _Info]:
    """Tensor name -> (dtype, shape, offsets) of a safetensors header, checked as the safetensors library
    checks it: known dtypes, non-negative integer dimensions, sizes that match, and data ranges that
    are in order, without gaps or overlaps, and fill the data_bytes after the header exactly."""
    bad = f"{where}: not a safetensors file:"
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except GDecodeError as e:
        raise GDecodeError(f"{bad} header has a {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise GDecodeError(f"{bad} header is not JSON") from None
    if not isinstance(header, dict):
        raise GDecodeError(f"{bad} header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise GDecodeError(f"{bad} __metadata__ must map names to strings")
    infos = {}
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise GDecodeError(f"{bad} tensor {name} needs exactly dtype, shape and data_offsets")
        kind, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if kind not in _BITS:
            raise GDecodeError(f"{bad} tensor {name} has unknown dtype {kind!r}")
        if not isinstance(shape, list) or not all(type(x) is int and x >= 0 for x in shape):
            raise GDecodeError(f"{bad} tensor {name} shape {shape!r:.60} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(x) is int and x >= 0 for x in offsets)
                or offsets[0] > offsets[1]):
            raise GDecodeError(f"{bad} tensor {name} data_offsets {offsets!r:.60} are not [begin, end]")
        bits = math.prod(shape) * _BITS[kind]
        if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
            raise GDecodeError(f"{bad} tensor {name} holds {offsets[1] - offsets[0]} bytes, but {kind} "
                               f"{shape} needs {bits / 8:g}")
        infos[name] = _Info(kind, tuple(shape), offsets[0], offsets[1])
    at = 0
    for name, info in sorted(infos.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != at:
            what = "overlaps the tensor before it" if info.begin < at else f"leaves a gap at byte {at}"
            raise GDecodeError(f"{bad} tensor {name} data at bytes {info.begin}..{info.end} {what}")
        at = info.end
    if at != data_bytes:
        if at > data_bytes:
            cut = next(n for n, i in infos.items() if i.end > data_bytes)
            raise GDecodeError(f"{where}: truncated safetensors file: tensor {cut} runs past the end (the header "
                               f"describes {at} bytes of data, the file holds {data_bytes})")
        raise GDecodeError(f"{bad} {data_bytes - at} bytes after the last tensor's data")
    return infos


class _SafetensorsFile:
    """One memory-mapped .safetensors file; tensors are read-only views into the map.

    The header is read into memory and validated, as a whole, against the size of the open file
    before anything is mapped, so no view can reach past the end of the file as it was opened.
    """

    def __init__(self, path: Path, wanted: str):
        self.path = path
        where = f"{path} (while looking for tensor {wanted})"
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 < n <= min(size - 8, _MAX_HEADER):
                    raise GDecodeError(
                        f"{where}: not a safetensors file: header length {n} does not fit the file "
                        f"({size} bytes)" if n > 0 else f"{where}: not a safetensors file: no header"
                    )
                raw = f.read(n)
                if len(raw) != n:
                    raise GDecodeError(f"{where}: truncated safetensors file (the header is cut short)")
                self.infos = parse_header(raw, size - 8 - n, where)
                self._map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size > 8 + n else b""
            if hasattr(self._map, "madvise"):
                # start readahead: every byte is read soon (fused now, uploaded next)
                self._map.madvise(mmap.MADV_WILLNEED)
        except OSError as e:
            raise GDecodeError(f"{path}: cannot read ({e.strerror}) while looking for tensor {wanted}") from None
        self.header = self.infos
        self._base = 8 + n

    def tensor(self, name: str) -> np.ndarray:
        info = self.infos[name]
        dtype = DTYPES.get(info.dtype)
        if dtype is None:
            supported = ", ".join(DTYPES)
            raise GDecodeError(
                f"{self.path}: tensor {name} has unsupported dtype {info.dtype} (supported: {supported})"
            )
        count = math.prod(info.shape)
        return np.frombuffer(self._map, dtype, count, self._base + info.begin).reshape(info.shape)


class _Checkpoint:
    """Tensor name -> file, for a single-file or sharded checkpoint; files are opened on first use."""

    def __init__(self, model_dir: Path):
        self.files: dict[Path, _SafetensorsFile] = {}
        self.where: dict[str, Path] | None = None  # None: everything is in self.source
        index = model_dir / "model.safetensors.index.json"
        self.source = model_dir / "model.safetensors"
        if index.is_file():
            self.source = index
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.where = {str(k): model_dir / str(v) for k, v in weight_map.items()}
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
                raise GDecodeError(f"{index}: not a valid safetensors index (no weight_map)") from None
        elif self.source.exists() and not self.source.is_file():
            raise not_a_file(self.source, "safetensors")
        elif not self.source.is_file():
            raise GDecodeError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")

    def path(self, name: str) -> Path | None:
        return self.source if self.where is None else self.where.get(name)

    def _file(self, name: str) -> _SafetensorsFile | None:
        path = self.path(name)
        if path is None:
            return None
        f = self.files.get(path)
        if f is None:
            if not path.is_file():
                raise GDecodeError(f"{path}: shard file is missing (it should hold tensor {name})")
            self.files[path] = f = _SafetensorsFile(path, name)
        return f if name in f.header else None

    def has(self, name: str) -> bool:
        return self._file(name) is not None

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        f = self._file(name)
        if f is None:
            raise GDecodeError(f"{self.path(name) or self.source}: tensor {name} is missing")
        t = f.tensor(name)
        if t.shape != shape:
            raise GDecodeError(f"{f.path}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        return t


def _fuse(ck: _Checkpoint, names: list[str], parts: list[np.ndarray]) -> np.ndarray:
    dtype = parts[0].dtype
    for name, p in zip(names, parts, strict=True):
        if p.dtype != dtype:
            raise GDecodeError(f"{ck.path(name)}: tensor {name} is {p.dtype}, but {names[0]} is {dtype}")
    out = np.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), dtype)
    # copy raw bits: a same-size unsigned view keeps the copy a plain memcpy that releases the GIL
    raw = np.dtype(f"u{dtype.itemsize}")
    np.concatenate([p.view(raw) for p in parts], out=out.view(raw))
    return out


def _layer(ck: _Checkpoint, cfg: ModelConfig, i: int) -> dict:
    p = f"model.layers.{i}."
    h, q, kv, d, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim, cfg.intermediate_size
    shapes = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    if cfg.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if cfg.o_proj_bias:
        shapes["self_attn.o_proj.bias"] = (h,)
    if cfg.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    return {k: ck.get(p + k, s) for k, s in shapes.items()}


def _build_layer(ck: _Checkpoint, i: int, t: dict) -> LayerWeights:
    def fuse(*keys):
        return _fuse(ck, [f"model.layers.{i}.{k}" for k in keys], [t[k] for k in keys])

    a = "self_attn."
    has_bias = a + "q_proj.bias" in t
    return LayerWeights(
        attn_norm=t["input_layernorm.weight"],
        wqkv=fuse(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
        bqkv=fuse(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if has_bias else None,
        wo=t[a + "o_proj.weight"],
        q_norm=t.get(a + "q_norm.weight"),
        k_norm=t.get(a + "k_norm.weight"),
        mlp_norm=t["post_attention_layernorm.weight"],
        w_gate_up=fuse("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        w_down=t["mlp.down_proj.weight"],
        bo=t.get(a + "o_proj.bias"),
    )


def load_weights(model_dir: str | Path, cfg: ModelConfig) -> ModelWeights:
    """Map a Hugging Face safetensors checkpoint (single file or sharded) and validate it against cfg.

    Unfused tensors are read-only views of the memory-mapped files; the fused QKV and
    gate/up arrays are copied once. Every problem raises GDecodeError naming file and tensor.
    """
    ck = _Checkpoint(Path(model_dir))
    v, h = cfg.vocab_size, cfg.hidden_size
    embed = ck.get("model.embed_tokens.weight", (v, h))
    final_norm = ck.get("model.norm.weight", (h,))
    if cfg.tie_word_embeddings:
        lm_head = embed
    elif ck.has("lm_head.weight"):
        lm_head = ck.get("lm_head.weight", (v, h))
    else:
        raise GDecodeError(f"{ck.source}: tensor lm_head.weight is missing (config says tie_word_embeddings=false)")
    # validate every tensor before copying any
    tensors = [_layer(ck, cfg, i) for i in range(cfg.num_layers)]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        layers = list(pool.map(lambda i: _build_layer(ck, i, tensors[i]), range(cfg.num_layers)))
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def weight_arrays(weights: ModelWeights) -> list:
    """Every weight once (a numpy array, or a quantized matrix where the weights hold one); a tied
    lm_head is the embedding."""
    arrays = [weights.embed, weights.final_norm]
    if weights.lm_head is not weights.embed:
        arrays.append(weights.lm_head)
    for layer in weights.layers:
        arrays += [a for a in vars(layer).values() if a is not None]
    return arrays


def checkpoint_bytes(weights: ModelWeights) -> int:
    """Bytes of all weight arrays, counting a tied lm_head once."""
    return sum(a.nbytes for a in weight_arrays(weights))
