"""One decode step: a fixed list of launches over static buffers, captured once into a CUDA graph.

The step reads the token and position from the device state, appends K/V, attends over the
n_cached = pos + 1 cache rows, samples, and writes the next token and position back, so replays
chain with no host copy. The same graph is valid for every n_cached from 1 to the context limit.
"""

from __future__ import annotations

from engine.config import ModelConfig
from graphs.buffers import DecodeBuffers, DeviceWeights
from graphs.linear import linear, linear_rope
from kernels import gemv_ops, ops
from kernels.attention import ATTN_MAX_SPLITS, attn_blocks_per_sm, attn_decode
from kernels.gemv_ops import EPI_ADD, EPI_SILU
from kernels.launch import Launch
from kernels.tuning import Tuning

# what each launch of the step does; a launch is named "<kind>" or, inside layer i, "layer<i>.<kind>"
STEP_KINDS = ("embed", "qkv_proj", "rope_kv_append", "attn", "o_proj", "gate_up", "down_proj", "lm_head", "sample")


class Launches(list):
    """The step's launches in order, each named (e.g. "layer3.attn"), holding the attention counters
    they point at."""

    counters = None

    def add(self, launch: Launch, name: str) -> None:
        assert self.kind(name) in STEP_KINDS, name
        launch.name = name
        self.append(launch)

    @staticmethod
    def kind(name: str) -> str:
        """"layer3.attn" -> "attn"; names outside a layer are their own kind."""
        return name.rsplit(".", 1)[-1]


def default_splits(cfg: ModelConfig, tuning: Tuning = Tuning()) -> int:
    """Attention splits at long contexts: one full wave, every resident attention block of every SM
    over the kv heads (at most ATTN_MAX_SPLITS). A second, partial wave would leave SMs idle while it runs.
    Short contexts use fewer (the attention kernel derives them from the cached rows)."""
    group = cfg.num_heads // cfg.num_kv_heads
    slots = attn_blocks_per_sm(cfg.head_dim, group, tuning.attn) * ops.sm_count()
    return max(1, min(ATTN_MAX_SPLITS, slots // cfg.num_kv_heads))


def step_launches(cfg: ModelConfig, w: DeviceWeights, b: DecodeBuffers, tuning: Tuning = Tuning(),
                  pdl: bool = True) -> Launches:
    """The launches of one step in order: embed, 5 per layer (6 with a per-head q/k norm), lm_head with
    the final norm and the greedy argmax (two rows per warp), sample. Each projection's kernel follows
    its matrix's format (graphs/linear.py); a matrix whose parts differ in format takes one launch per
    part.

    Per layer: qkv_proj with RoPE and the K/V append in its epilogue (or qkv_proj, then rope_kv_append),
    attn with the split merge in its last block, o_proj + residual, gate_up with SiLU, down_proj +
    residual. The attention split count is the buffers' (b.attn_splits), fixed at allocation.
    """
    import cupy as cp

    h, hd, nh, kv_heads = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    eps, ctx, splits = cfg.rms_norm_eps, b.max_context, b.attn_splits
    n_qkv = cfg.q_size + 2 * cfg.kv_size
    out = Launches()
    g = tuning.gemv

    def first(kind):  # this launch lets the next one launch before its own PDL wait (Tuning.trigger_first)
        return kind in tuning.trigger_first

    def add(launches, name):
        for launch in launches:
            out.add(launch, name)

    embed = gemv_ops.embed_quant(w.embed, b.state, b.x, pdl=pdl) if gemv_ops.is_quant(w.embed) else \
        ops.embed(w.embed, b.state, b.x, cfg.vocab_size, h, pdl=pdl)
    out.add(embed, "embed")
    # counters: [layers, kv heads], each left zero by its attention launch
    out.counters = cp.zeros((len(w.layers), kv_heads), cp.uint32)
    cp.cuda.get_current_stream().synchronize()
    for i, lw in enumerate(w.layers):
        k_cache, v_cache = b.layer_cache(i)
        layer = f"layer{i}."
        if lw.q_norm is None:
            add(linear_rope(lw.wqkv, b.x, lw.attn_norm, lw.bqkv, b.qkv, b.state, b.cos, b.sin, k_cache, v_cache,
                            nh=nh, nkv=kv_heads, hd=hd, k=h, max_ctx=ctx, eps=eps, tuning=g, pdl=pdl,
                            trigger_first=first("qkv_proj")), layer + "qkv_proj")
        else:
            add(linear(lw.wqkv, b.x, b.qkv, n_qkv, h, gamma=lw.attn_norm, bias=lw.bqkv, eps=eps, tuning=g, pdl=pdl,
                       trigger_first=first("qkv_proj")), layer + "qkv_proj")
            out.add(ops.rope_append(b.qkv, lw.q_norm, lw.k_norm, b.cos, b.sin, b.state, k_cache, v_cache, nh=nh,
                                    kv_heads=kv_heads, hd=hd, max_ctx=ctx, eps=eps, warps=tuning.rope_warps, pdl=pdl),
                    layer + "rope_kv_append")
        out.add(attn_decode(b.qkv, k_cache, v_cache, b.state, b.pm, b.pl, b.pacc, b.attn, out.counters[i], nh=nh,
                            kv_heads=kv_heads, hd=hd, splits=splits, max_ctx=ctx, tuning=tuning.attn, pdl=pdl,
                            trigger_first=first("attn")), layer + "attn")
        add(linear(lw.wo, b.attn, b.x, h, cfg.q_size, bias=lw.bo, epi=EPI_ADD, tuning=g, pdl=pdl, whole=g.o_whole,
                   trigger_first=first("o_proj")), layer + "o_proj")
        add(linear(lw.w_gate_up, b.x, b.act, cfg.intermediate_size, h, gamma=lw.mlp_norm, epi=EPI_SILU, eps=eps,
                   tuning=g, pdl=pdl, trigger_first=first("gate_up")), layer + "gate_up")
        add(linear(lw.w_down, b.act, b.x, h, cfg.intermediate_size, epi=EPI_ADD, tuning=g, pdl=pdl,
                   trigger_first=first("down_proj")), layer + "down_proj")
    add(linear(w.lm_head, b.x, b.logits, cfg.vocab_size, h, gamma=w.final_norm, eps=eps, amax=b.amax, pair=True,
               tuning=g, pdl=pdl, trigger_first=first("lm_head")), "lm_head")
    out.add(ops.sample(b.logits, b.amax, b.state, b.prompt, b.ring_dev, b.lp_ring_dev, b.counts, b.window,
                       b.sample_work, vocab=cfg.vocab_size, max_ctx=ctx, pdl=pdl), "sample")
    return out


class DecodeStep:
    """Runs the step on `stream`: one graph replay, or (use_graph=False) the same launches eagerly."""

    def __init__(self, cfg: ModelConfig, weights: DeviceWeights, bufs: DecodeBuffers, stream,
                 tuning: Tuning = Tuning(), use_graph: bool = True, pdl: bool = True):
        self.stream, self.use_graph = stream, use_graph
        self.launches = step_launches(cfg, weights, bufs, tuning, pdl)
        self.graph = None
        # warm up eagerly (the state is rewritten before every request), then capture
        self.eager()
        stream.synchronize()
        if use_graph:
            from graphs.graph import capture

            self.graph = capture(stream, self.launches)
            stream.synchronize()

    def eager(self):
        for launch in self.launches:
            launch(self.stream)

    def __call__(self):
        if self.graph is not None:
            self.graph.replay(self.stream)
        else:
            self.eager()
