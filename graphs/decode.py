"""One decode step: a fixed list of launches over static buffers, captured once into a CUDA graph.

The step reads the token and position from the device state, appends K/V, attends over
nkv = pos + 1 rows, samples, and writes the next token and position back, so replays chain
with no host copy. The same graph is valid for every nkv from 1 to the context limit.
"""

from __future__ import annotations

from engine.config import ModelConfig
from graphs.buffers import DecodeBuffers, DeviceWeights
from kernels import ops


class Launches(list):
    """The step's launches, holding the attention counters they point at."""

    counters = None


def step_launches(cfg: ModelConfig, w: DeviceWeights, b: DecodeBuffers, pdl: bool = True) -> Launches:
    """The launches of one step in order: embed, 5 per layer (6 with a per-head q/k norm), lm_head with
    the final norm and the greedy argmax (two rows per warp), sample.

    Per layer: QKV with RoPE and the K/V append in its epilogue (or QKV, then rope_append), attention
    with the combine in its last block, o_proj + residual, gate/up with SiLU, down_proj + residual.
    """
    import cupy as cp

    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    eps, ctx, splits = cfg.rms_norm_eps, b.max_context, b.attn_splits
    n_qkv = cfg.q_size + 2 * cfg.kv_size
    out = Launches([ops.embed(w.embed, b.state, b.x, cfg.vocab_size, h, pdl=pdl)])
    # counters: [layers, kv heads], each left zero by its attention launch
    out.counters = cp.zeros((len(w.layers), nkv), cp.uint32)
    cp.cuda.get_current_stream().synchronize()
    for i, lw in enumerate(w.layers):
        k_cache, v_cache = b.layer_cache(i)
        if lw.q_norm is None:
            out.append(ops.gemv_rope(lw.wqkv, b.x, lw.attn_norm, lw.bqkv, b.qkv, b.state, b.cos, b.sin, k_cache,
                                     v_cache, nh=nh, nkv=nkv, hd=hd, k=h, max_ctx=ctx, eps=eps, pdl=pdl))
        else:
            out += [
                ops.gemv(lw.wqkv, b.x, b.qkv, n_qkv, h, gamma=lw.attn_norm, bias=lw.bqkv, eps=eps, pdl=pdl),
                ops.rope_append(b.qkv, lw.q_norm, lw.k_norm, b.cos, b.sin, b.state, k_cache, v_cache, nh=nh,
                                nkv=nkv, hd=hd, max_ctx=ctx, eps=eps, pdl=pdl),
            ]
        out += [
            ops.attn_decode(b.qkv, k_cache, v_cache, b.state, b.pm, b.pl, b.pacc, b.attn, out.counters[i], nh=nh,
                            nkv=nkv, hd=hd, splits=splits, max_ctx=ctx, pdl=pdl),
            ops.gemv(lw.wo, b.attn, b.x, h, cfg.q_size, epi=ops.EPI_ADD, pdl=pdl),
            ops.gemv(lw.w_gate_up, b.x, b.act, cfg.intermediate_size, h, gamma=lw.mlp_norm, epi=ops.EPI_SILU,
                     eps=eps, pdl=pdl),
            ops.gemv(lw.w_down, b.act, b.x, h, cfg.intermediate_size, epi=ops.EPI_ADD, pdl=pdl),
        ]
    out.append(ops.gemv(w.lm_head, b.x, b.logits, cfg.vocab_size, h, gamma=w.final_norm, eps=eps, amax=b.amax,
                        pair=True, pdl=pdl))
    out.append(ops.sample(b.logits, b.amax, b.state, b.prompt, b.ring_dev, b.scratch_z, b.scratch_i,
                          vocab=cfg.vocab_size, max_ctx=ctx, pdl=pdl))
    return out


class DecodeStep:
    """Runs the step on `stream`: one graph replay, or (use_graph=False) the same launches eagerly."""

    def __init__(self, cfg: ModelConfig, weights: DeviceWeights, bufs: DecodeBuffers, stream,
                 use_graph: bool = True, pdl: bool = True):
        self.stream, self.use_graph = stream, use_graph
        self.launches = step_launches(cfg, weights, bufs, pdl)
        self.graph = None
        # warm up eagerly (the state is rewritten before every request), then capture
        self.eager()
        stream.synchronize()
        if use_graph:
            from graphs.graph import capture

            self.graph = capture(stream, self.eager)
            stream.synchronize()

    def eager(self):
        for launch in self.launches:
            launch(self.stream)

    def __call__(self):
        if self.graph is not None:
            self.graph.replay(self.stream)
        else:
            self.eager()
