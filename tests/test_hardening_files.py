"""Hostile input files: every bad one ends with one `error:` line, a non-zero exit, files unchanged.

Each parametrized case is one bad input; the CLI runs in this process (a stray exception fails the
test as a traceback would), except where signals are sent.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFValueType  # noqa: E402

from cli.main import main  # noqa: E402
from engine.gguf_mmap import read_gguf  # noqa: E402
from engine.gguf_outdir import MARKER  # noqa: E402
from tests.test_gguf import write_gguf  # noqa: E402
from tests.test_weights import make_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
F32 = {"token_embd": Q.F32}  # every tensor float32: quick to write and to import


def run(*args) -> tuple[int, str, str]:
    """gdecode ARGS in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: int, err: str, *needles: str) -> str:
    assert code != 0, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> content digest (or link target) of everything under root, root included."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


# ---- import-gguf --force never loses data ----


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("src") / "m.gguf", types=F32)


def _foreign(out, src):
    out.mkdir()
    (out / "notes.txt").write_text("mine")


def _source_inside(out, src):
    out.mkdir()
    (out / "m.gguf").write_bytes(src.read_bytes())


def _source_inside_import(out, src):
    assert run("import-gguf", src, out, "--no-progress")[0] == 0
    (out / "m.gguf").write_bytes(src.read_bytes())


def _sibling_model(out, src):
    make_model(out.parent, name=out.name)  # a Hugging Face folder: config.json, model.safetensors


def _import_plus_file(out, src):
    assert run("import-gguf", src, out, "--no-progress")[0] == 0
    (out / "sub").mkdir()
    (out / "sub" / "kept.bin").write_bytes(b"\0" * 10)


def _file(out, src):
    out.write_text("a file, not a folder")


def _symlink(out, src):
    (out.parent / "real").mkdir()
    out.symlink_to(out.parent / "real")


DATA_LOSS = {
    "foreign file": (_foreign, "notes.txt"),
    "source gguf inside": (_source_inside, "inside"),
    "source gguf inside an earlier import": (_source_inside_import, "inside"),
    "sibling model folder": (_sibling_model, "did not write"),
    "earlier import with a user folder": (_import_plus_file, "sub"),
    "outdir is a file": (_file, "not a directory"),
    "outdir is a symlink": (_symlink, "symbolic link"),
}


@pytest.mark.parametrize("case", list(DATA_LOSS))
def test_force_refuses_what_an_import_did_not_write(tmp_path, gguf_file, case):
    setup, needle = DATA_LOSS[case]
    out = tmp_path / "out"
    setup(out, gguf_file)
    src = out / "m.gguf" if "inside" in case else gguf_file  # import from inside OUTDIR itself
    before = snapshot(tmp_path)
    code, _, err = run("import-gguf", src, out, "--force", "--no-progress")
    assert_one_line_error(code, err, needle)
    assert snapshot(tmp_path) == before


def test_existing_outdir_without_force(tmp_path, gguf_file):
    out = tmp_path / "out"
    out.mkdir()
    before = snapshot(tmp_path)
    assert_one_line_error(*run("import-gguf", gguf_file, out)[::2], "--force")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("sub", ["sub", "sub/deeper"])
def test_outdir_under_a_file(tmp_path, gguf_file, sub):
    (tmp_path / "afile").write_text("a file, not a folder")
    before = snapshot(tmp_path)
    code, _, err = run("import-gguf", gguf_file, tmp_path / "afile" / sub, "--no-progress")
    assert_one_line_error(code, err, f"{tmp_path / 'afile'} is a file, not a folder")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("earlier", ["empty folder", "earlier import"])
def test_force_replaces_an_empty_folder_or_an_earlier_import(tmp_path, gguf_file, earlier):
    out = tmp_path / "out"
    out.mkdir()
    if earlier == "earlier import":
        assert run("import-gguf", gguf_file, out, "--force", "--no-progress")[0] == 0
        (out / "config.json").write_text("{}")
    before = snapshot(gguf_file.parent)
    code, _, err = run("import-gguf", gguf_file, out, "--force", "--no-progress")
    assert code == 0, err
    assert (out / MARKER).is_file() and json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert snapshot(gguf_file.parent) == before


# ---- killed imports: SIGTERM/SIGHUP clean up like Ctrl-C; what SIGKILL leaves, the next import removes ----

SLOW_IMPORT = """
import sys, time
import engine.gguf_import as g
real = g.to_bf16
def slow(e):
    print("writing", flush=True)
    time.sleep(60)
    return real(e)
g.to_bf16 = slow
from cli.main import main
main(sys.argv[1:])
"""


def _start_slow_import(src: Path, out: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", SLOW_IMPORT, "import-gguf", str(src), str(out), "--no-progress"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing", p.stderr.read()
    return p


def _temps(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_signal_during_import_cleans_up(tmp_path, gguf_file, sig):
    out = tmp_path / "out"
    p = _start_slow_import(gguf_file, out)
    assert _temps(tmp_path)  # the temp folder exists while writing
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_sigkill_debris_is_removed_by_the_next_import(tmp_path, gguf_file):
    out = tmp_path / "out"
    p = _start_slow_import(gguf_file, out)
    p.kill()
    p.wait(timeout=60)
    left = _temps(tmp_path)
    assert len(left) == 1 and (tmp_path / left[0] / MARKER).is_file()
    # look-alikes the next import must keep: a live owner's folder, and one without a marker
    live = tmp_path / f".x.gdecode-{os.getpid()}-abc.tmp"
    live.mkdir()
    (live / MARKER).write_text("")
    foreign = tmp_path / f".y.gdecode-{p.pid}-abc.tmp"
    foreign.mkdir()
    (foreign / "data").write_text("not an import")
    code, _, err = run("import-gguf", gguf_file, tmp_path / "other", "--no-progress")
    assert code == 0, err
    assert _temps(tmp_path) == sorted([live.name, foreign.name])
    assert not out.exists()


# ---- safetensors headers, checked as strictly as the safetensors library ----


def _rewrite(path: Path, header_bytes: bytes | None = None, edit=None, n: int | None = None, tail: bytes = b""):
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + size]), raw[8 + size :]
    if edit is not None:
        edit(header)
    blob = header_bytes if header_bytes is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if n is None else n) + blob + data + tail)


def _tensors(h):
    return sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


def _set(key, value, which=0):
    def edit(h):
        h[_tensors(h)[which]][key] = value
    return edit


def _shift(which, delta):
    def edit(h):
        a, b = h[_tensors(h)[which]]["data_offsets"]
        h[_tensors(h)[which]]["data_offsets"] = [a + delta, b + delta]
    return edit


def _overlap(h):
    t = _tensors(h)
    first, second = h[t[0]], h[t[1]]
    n = second["data_offsets"][1] - second["data_offsets"][0]
    second["data_offsets"] = [first["data_offsets"][0], first["data_offsets"][0] + n]


def _duplicate(path: Path):
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + size].decode()
    h = json.loads(text)
    name = _tensors(h)[0]
    entry = json.dumps({name: h[name]})[1:-1]
    _rewrite(path, header_bytes=("{" + entry + "," + text.strip()[1:]).encode())


SAFETENSORS = {
    "overlapping ranges": (lambda p: _rewrite(p, edit=_overlap), "overlaps"),
    "gap between tensors": (lambda p: _rewrite(p, edit=_shift(-1, 4), tail=b"\0" * 4), "gap"),
    "reversed data_offsets": (lambda p: _rewrite(p, edit=_set("data_offsets", [8, 0])), "data_offsets"),
    "duplicate key": (_duplicate, "duplicate"),
    "float dimension": (lambda p: _rewrite(p, edit=_set("shape", [37.0, 16])), "shape"),
    "negative dimension": (lambda p: _rewrite(p, edit=_set("shape", [-37, -16])), "shape"),
    "boolean dimension": (lambda p: _rewrite(p, edit=_set("shape", [True, 16])), "shape"),
    "string dimension": (lambda p: _rewrite(p, edit=_set("shape", ["37", 16])), "shape"),
    "shape larger than its bytes": (lambda p: _rewrite(p, edit=_set("shape", [38, 16])), "needs"),
    "dtype larger than its bytes": (lambda p: _rewrite(p, edit=_set("dtype", "F64")), "needs"),
    "unknown dtype": (lambda p: _rewrite(p, edit=_set("dtype", "Q4")), "unknown dtype"),
    "missing data_offsets": (lambda p: _rewrite(p, edit=lambda h: h[_tensors(h)[0]].pop("data_offsets")),
                             "data_offsets"),
    "non-string metadata": (lambda p: _rewrite(p, edit=lambda h: h.update(__metadata__={"a": 1})), "__metadata__"),
    "header is a list": (lambda p: _rewrite(p, header_bytes=b"[1, 2, 3]"), "not a JSON object"),
    "header is not UTF-8": (lambda p: _rewrite(p, header_bytes=b'{"\xff": 1}'), "not JSON"),
    "header longer than the file": (lambda p: _rewrite(p, n=10**6), "does not fit"),
    "header length zero": (lambda p: _rewrite(p, n=0), "no header"),
    "trailing bytes": (lambda p: _rewrite(p, tail=b"\0" * 16), "after the last"),
    "data cut short": (lambda p: p.write_bytes(p.read_bytes()[:-1]), "truncated"),
    "cut inside the header": (lambda p: p.write_bytes(p.read_bytes()[:40]), "does not fit"),
    "empty file": (lambda p: p.write_bytes(b""), "no header"),
}


@pytest.fixture
def model_dir(tmp_path):
    return make_model(tmp_path)[0]


@pytest.mark.parametrize("case", list(SAFETENSORS))
def test_bad_safetensors_header(model_dir, case):
    damage, needle = SAFETENSORS[case]
    damage(model_dir / "model.safetensors")
    before = snapshot(model_dir)
    assert_one_line_error(*run("info", "--model", model_dir)[::2], "model.safetensors", needle)
    assert snapshot(model_dir) == before


def test_safetensors_library_refuses_what_we_refuse(tmp_path):
    # the library is the standard: each damaged header it also rejects (ours add duplicate keys)
    safetensors = pytest.importorskip("safetensors.numpy")
    for case, (damage, _) in SAFETENSORS.items():
        d = make_model(tmp_path, name=case.replace(" ", "_"))[0]
        damage(d / "model.safetensors")
        if case == "duplicate key":
            continue  # serde keeps the last entry of a repeated key
        with pytest.raises(Exception):  # noqa: B017 (the library raises several kinds)
            safetensors.load_file(str(d / "model.safetensors"))


# ---- config.json and generation_config.json: type and range of every value ----


def _cfg(**over):
    def edit(d):
        for k, v in over.items():
            if v is _DROP:
                d.pop(k, None)
            else:
                d[k] = v
        return d
    return edit


_DROP = object()
CONFIG = {
    "a JSON list": (lambda d: [d], "JSON object"),
    "a JSON string": (lambda d: "config", "JSON object"),
    "string hidden_size": (_cfg(hidden_size="16"), "hidden_size"),
    "float num_hidden_layers": (_cfg(num_hidden_layers=2.0), "num_hidden_layers"),
    "boolean num_attention_heads": (_cfg(num_attention_heads=True), "num_attention_heads"),
    '"false" tie_word_embeddings': (_cfg(tie_word_embeddings="false"), "tie_word_embeddings"),
    "integer tie_word_embeddings": (_cfg(tie_word_embeddings=0), "tie_word_embeddings"),
    '"true" attention_bias': (_cfg(attention_bias="true"), "attention_bias"),
    "zero heads": (_cfg(num_attention_heads=0), "num_attention_heads"),
    "negative kv heads": (_cfg(num_key_value_heads=-2), "num_key_value_heads"),
    "zero layers": (_cfg(num_hidden_layers=0), "num_hidden_layers"),
    "negative layers": (_cfg(num_hidden_layers=-1), "num_hidden_layers"),
    "zero eps": (_cfg(rms_norm_eps=0), "rms_norm_eps"),
    "negative eps": (_cfg(rms_norm_eps=-1e-5), "rms_norm_eps"),
    "NaN eps": (_cfg(rms_norm_eps=float("nan")), "rms_norm_eps"),
    "string eps": (_cfg(rms_norm_eps="1e-5"), "rms_norm_eps"),
    "zero rope theta": (_cfg(rope_theta=0), "rope_theta"),
    "negative rope theta": (_cfg(rope_theta=-10000.0), "rope_theta"),
    "infinite rope theta": (_cfg(rope_theta=float("inf")), "rope_theta"),
    "rope_scaling a list": (_cfg(rope_scaling=[8.0]), "rope_scaling"),
    "rope_scaling a string": (_cfg(rope_scaling="llama3"), "rope_scaling"),
    "rope_scaling yarn": (_cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    "rope_scaling linear": (_cfg(rope_scaling={"type": "linear", "factor": 2.0}), "linear"),
    "llama3 scaling without factor": (
        _cfg(rope_scaling={"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}), "factor"),
    "llama3 scaling, high below low": (
        _cfg(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                           "original_max_position_embeddings": 64}), "high_freq_factor"),
    "heads not a multiple of kv heads": (_cfg(num_key_value_heads=3), "multiple"),
    "kv heads above heads": (_cfg(num_key_value_heads=8), "num_key_value_heads"),
    "hidden not a multiple of heads": (_cfg(head_dim=_DROP, hidden_size=18), "multiple"),
    "odd head_dim": (_cfg(head_dim=5), "head_dim"),
    "zero vocab": (_cfg(vocab_size=0), "vocab_size"),
    "zero context": (_cfg(max_position_embeddings=0), "max_position_embeddings"),
    "string sliding_window": (_cfg(sliding_window="4096", use_sliding_window=True), "sliding_window"),
    "eos id outside the vocabulary": (_cfg(eos_token_id=[1, 999]), "eos_token_id"),
    "string eos id": (_cfg(eos_token_id="2"), "eos_token_id"),
    "negative bos id": (_cfg(bos_token_id=-1), "bos_token_id"),
    "mlp_bias": (_cfg(mlp_bias=True), "mlp_bias"),
    "missing hidden_size": (_cfg(hidden_size=_DROP), "hidden_size"),
    "unknown architecture": (_cfg(architectures=["BertModel"]), "BertModel"),
}
GENERATION = {
    "generation_config a list": ("[2]", "JSON object"),
    "generation_config not JSON": ("{eos", "not valid JSON"),
    "generation_config string eos": ('{"eos_token_id": "2"}', "eos_token_id"),
    "generation_config eos outside the vocabulary": ('{"eos_token_id": [2, 100000]}', "eos_token_id"),
}


@pytest.mark.parametrize("case", list(CONFIG))
def test_bad_config_value(model_dir, case):
    edit, needle = CONFIG[case]
    path = model_dir / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    before = snapshot(model_dir)
    assert_one_line_error(*run("info", "--model", model_dir)[::2], "config.json", needle)
    assert snapshot(model_dir) == before


@pytest.mark.parametrize("case", list(GENERATION))
def test_bad_generation_config(model_dir, case):
    text, needle = GENERATION[case]
    (model_dir / "generation_config.json").write_text(text)
    before = snapshot(model_dir)
    assert_one_line_error(*run("info", "--model", model_dir)[::2], "generation_config.json", needle)
    assert snapshot(model_dir) == before


# ---- GGUF metadata and structure: bounded by the file size before anything is allocated ----


def _value_at(data: bytes, key: str) -> int:
    """Offset of key's value type field in a GGUF image."""
    k = key.encode()
    at = data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k)
    return at


def _edit(key: str, fmt: str, value, skip: int = 4):
    """Overwrite the bytes after key's type field (skip=4) or inside an array header (skip=8: count)."""
    def damage(p: Path):
        data = bytearray(p.read_bytes())
        at = _value_at(data, key) + skip
        struct.pack_into("<" + fmt, data, at, value)
        p.write_bytes(bytes(data))
    return damage


def _tensor_info(name: str, field: str, value: int):
    """Overwrite one field of a tensor's info: n_dims, dim0, type or offset."""
    def damage(p: Path):
        data = bytearray(p.read_bytes())
        k = name.encode()
        at = data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k)
        (n_dims,) = struct.unpack_from("<I", data, at)
        where = {"n_dims": (at, "I"), "dim0": (at + 4, "Q"), "type": (at + 4 + 8 * n_dims, "I"),
                 "offset": (at + 8 + 8 * n_dims, "Q")}[field]
        struct.pack_into("<" + where[1], data, where[0], value)
        p.write_bytes(bytes(data))
    return damage


def _header_count(which: int, value: int):
    def damage(p: Path):
        data = bytearray(p.read_bytes())
        struct.pack_into("<Q", data, 8 + 8 * which, value)
        p.write_bytes(bytes(data))
    return damage


def _meta(**over):
    return {k.replace("__", "."): v for k, v in over.items()}


GGUF_EDITS = {
    "block_count 10^9": (_edit("llama.block_count", "I", 10**9), "block_count"),
    "token array length 10^9": (_edit("tokenizer.ggml.tokens", "Q", 10**9, skip=8), "items"),
    "merges array length 2^63": (_edit("tokenizer.ggml.merges", "Q", 2**63, skip=8), "items"),
    "metadata count 10^12": (_header_count(1, 10**12), "metadata"),
    "tensor count 10^12": (_header_count(0, 10**12), "tensor"),
    "tensor with 99 dimensions": (_tensor_info("output_norm.weight", "n_dims", 99), "dimensions"),
    "tensor dimension zero": (_tensor_info("output_norm.weight", "dim0", 0), "dimension"),
    "tensor dimension 2^62": (_tensor_info("output_norm.weight", "dim0", 2**62), "truncated"),
    "unknown tensor type": (_tensor_info("output_norm.weight", "type", 999), "type"),
    "rows not whole blocks": (lambda p: (_tensor_info("output_norm.weight", "dim0", 33)(p),
                                         _tensor_info("output_norm.weight", "type", int(Q.Q4_0))(p)), "blocks"),
    "tensor offset out of order": (_tensor_info("output_norm.weight", "offset", 0), "offset"),
    "alignment not a power of two": (_edit("general.alignment", "I", 3), "alignment"),
    "cut in the metadata": (lambda p: p.write_bytes(p.read_bytes()[:200]), "truncated"),
    "cut in the tensor data": (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
    "magic only": (lambda p: p.write_bytes(b"GGUF"), "truncated"),
    "unsupported version": (lambda p: p.write_bytes(b"GGUF" + struct.pack("<I", 7) + p.read_bytes()[8:]),
                            "version"),
}
GGUF_META = {
    "block_count a string": (_meta(llama__block_count="2"), "llama.block_count"),
    "block_count zero": (_meta(llama__block_count=0), "llama.block_count"),
    "block_count above the tensors": (_meta(llama__block_count=3), "block_count"),
    "embedding_length a float": (_meta(llama__embedding_length=256.0), "embedding_length"),
    "head_count zero": (_meta(llama__attention__head_count=0), "head_count"),
    "head_count_kv not dividing": (_meta(llama__attention__head_count_kv=3), "head_count"),
    "eps zero": (_meta(llama__attention__layer_norm_rms_epsilon=0.0), "epsilon"),
    "eps negative": (_meta(llama__attention__layer_norm_rms_epsilon=-1e-5), "epsilon"),
    "eps a string": (_meta(llama__attention__layer_norm_rms_epsilon="1e-5"), "epsilon"),
    "eps missing": (_meta(llama__attention__layer_norm_rms_epsilon=None), "epsilon"),
    "rope theta negative": (_meta(llama__rope__freq_base=-1.0), "freq_base"),
    "rope theta NaN": (_meta(llama__rope__freq_base=float("nan")), "freq_base"),
    "context_length zero": (_meta(llama__context_length=0), "context_length"),
    "rope scaling yarn": (_meta(llama__rope__scaling__type="yarn"), "yarn"),
    "partial rotary": (_meta(llama__rope__dimension_count=32), "rotary"),
    "unsupported architecture": (_meta(general__architecture="gemma"), "gemma"),
    "architecture an integer": (_meta(general__architecture=7), "architecture"),
    "unsupported tokenizer": (_meta(tokenizer__ggml__model="bert"), "bert"),
    "eos id outside the vocabulary": (_meta(tokenizer__ggml__eos_token_id=10**6), "eos_token_id"),
    "eot id a string": (_meta(tokenizer__ggml__eot_token_id="2"), "eot_token_id"),
    "tokens of integers": (_meta(tokenizer__ggml__tokens=([1, 2, 3], GGUFValueType.ARRAY)), "tokens"),
    "token types of another length": (_meta(tokenizer__ggml__token_type=[1, 1]), "token_type"),
    "add_bos_token a string": (_meta(tokenizer__ggml__add_bos_token="false"), "add_bos_token"),
    "chat template an integer": (_meta(tokenizer__chat_template=5), "chat_template"),
}


@pytest.mark.parametrize("command", ["import-gguf", "info"])
@pytest.mark.parametrize("case", list(GGUF_EDITS) + list(GGUF_META))
def test_bad_gguf(tmp_path, case, command):
    path = tmp_path / "m.gguf"
    if case in GGUF_META:
        meta, needle = GGUF_META[case]
        write_gguf(path, types=F32, meta=meta)
    else:
        damage, needle = GGUF_EDITS[case]
        write_gguf(path, types=F32, meta={"general.alignment": 32})
        damage(path)
    before = snapshot(tmp_path)
    args = ("import-gguf", path, tmp_path / "out") if command == "import-gguf" else ("info", "--model", path)
    tracemalloc.start()
    try:
        code, _, err = run(*args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_one_line_error(code, err, str(path), needle)
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB allocated before refusing"
    assert snapshot(tmp_path) == before


# ---- weights holding NaN or Inf: `info --check` names the tensor ----


@pytest.mark.parametrize("where, value", [("model.layers.1.mlp.down_proj.weight", np.nan),
                                          ("model.embed_tokens.weight", np.inf),
                                          ("model.layers.0.self_attn.k_proj.weight", -np.inf)])
def test_info_check_names_the_nonfinite_tensor(tmp_path, where, value):
    from safetensors.numpy import load_file, save_file

    d = make_model(tmp_path)[0]
    code, out, err = run("info", "--model", d, "--check")
    assert code == 0 and "ok" in out.splitlines()[-1], err
    tensors = load_file(str(d / "model.safetensors"))
    tensors[where].reshape(-1)[7] = value
    save_file(tensors, str(d / "model.safetensors"))
    field = {"down_proj": "layers.1.w_down", "embed": "embed", "k_proj": "layers.0.wqkv"}
    name = next(v for k, v in field.items() if k in where)
    assert_one_line_error(*run("info", "--model", d, "--check")[::2], f"weight {name} holds 1 non-finite")


def test_info_check_on_a_gguf(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", types={"token_embd": Q.Q8_0})
    code, out, err = run("info", "--model", path, "--check")
    assert code == 0 and "ok" in out.splitlines()[-1], err
    begin = read_gguf(path).tensors["token_embd.weight"].data_offset
    data = bytearray(path.read_bytes())
    data[begin : begin + 2] = np.float16(np.inf).tobytes()  # the first Q8_0 block's scale
    path.write_bytes(bytes(data))
    assert_one_line_error(*run("info", "--model", path, "--check")[::2], "weight embed holds 32 non-finite")


# ---- model paths: a hub name is not downloaded ----


@pytest.mark.parametrize("command", ["info", "generate"])
@pytest.mark.parametrize("name, needle", [("HuggingFaceTB/SmolLM2-135M-Instruct", "hub"),
                                          ("meta-llama/Llama-3.2-1B", "hub"),
                                          ("no/such/folder", "not found")])
def test_model_path_that_does_not_exist(tmp_path, monkeypatch, command, name, needle):
    monkeypatch.chdir(tmp_path)
    args = ("info", "--model", name) if command == "info" else ("generate", "hi", "--model", name,
                                                                "--backend", "numpy")
    line = assert_one_line_error(*run(*args)[::2], name, needle)
    if needle == "hub":
        assert "local" in line and ".gguf" in line
