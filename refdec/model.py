"""An encoder-decoder Transformer written out by hand (Vaswani et al. 2017, "Attention Is All You
Need", figure 1), with an explicit KV cache for incremental decoding.

Three entry points, one return type each:

    encode(src)                      -> Memory   encoder states + cross-attention K/V, once per source
    decode(tgt_new, memory, cache)   -> logits   (B, q, V) for q >= 1 new target tokens; appends
                                                 them to the cache (greedy: q = 1, verification: q = k)
    forward(src, tgt)                -> logits   (B, T, V), training, no cache: the uncached reference
                                                 that the cached path is tested against

Secondary: the parts each entry point is made of, for callers that need what lies between them
(heads on the last hidden state, a decoder on another model's encoder, training losses):

    encode  = attach(encode_states(src))              the encoder alone; its states -> a decoder's Memory
    decode  = project(decode_hidden(...), memory)     the decoder stack; the vocabulary projection
    forward = project(forward_hidden(src, tgt))       the same, teacher-forced
    early_exit_hidden(src, tgt, n)                    forward_hidden's states and those after n layers

Two switches per model, each set on all of its layers at once: `set_row_invariant` (bitwise
call-shape-independent logits) and `set_few_row_route` (the CPU few-row matrix product, below).
Shape letters: B batch, S source length, T target length, q new positions, L cached positions,
H heads, Dh head dim, D d_model, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache
from .config import ModelConfig
from .variants import RelativePositionBias, RMSNorm, activation, marian_positions


def sinusoidal_positions(n: int, d: int) -> torch.Tensor:
    """The fixed position encodings of section 3.5: (n, d), sin on even, cos on odd dims."""
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    inv = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * inv)
    pe[:, 1::2] = torch.cos(pos * inv)
    return pe


def m2m100_positions(n: int, d: int, pad_id: int) -> torch.Tensor:
    """Hugging Face M2M100's (and NLLB's) table, (n, d): row p is its row p + pad_id + 1, [sin | cos]
    halves at frequencies 10000^(-i / (d/2 - 1)), computed in float32 as transformers computes it (so
    a float64 model holds the same float32-rounded values its Hugging Face twin holds)."""
    rows, half = n + pad_id + 1, d // 2
    step = math.log(10000) / (half - 1)
    freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    emb = torch.arange(rows, dtype=torch.int64).float().unsqueeze(1) * freq.unsqueeze(0)
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
    if d % 2:
        emb = torch.cat([emb, torch.zeros(rows, 1)], dim=1)
    return emb[pad_id + 1:].double()


def position_table(cfg: ModelConfig) -> torch.Tensor:
    """The (max_positions, d_model) float64 table cfg.positions names (learned and relative
    positions have none: zeros, never read)."""
    if cfg.positions == "m2m100":
        return m2m100_positions(cfg.max_positions, cfg.d_model, cfg.pad_id)
    if cfg.positions == "marian":
        return marian_positions(cfg.max_positions, cfg.d_model)
    if cfg.positions in ("learned", "relative"):
        return torch.zeros(cfg.max_positions, cfg.d_model, dtype=torch.float64)
    return sinusoidal_positions(cfg.max_positions, cfg.d_model)


@dataclass
class Memory:
    """What the decoder needs from one encoder pass.

    states:   (B, S, D) encoder output
    src_pad:  (B, S) True where the source is padding
    cross_kv: per decoder layer, the cross-attention keys and values, each (B, H, S, Dh)
    """

    states: torch.Tensor
    src_pad: torch.Tensor
    cross_kv: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def batch(self) -> int:
        return self.states.shape[0]

    @property
    def src_block(self) -> torch.Tensor | None:
        """(B, 1, 1, S) cross-attention mask, or None when no row has padding (batch 1): the
        masked_fill it saves is a no-op then, so the logits are the same either way."""
        if not hasattr(self, "_src_block"):
            self._src_block = self.src_pad[:, None, None, :] if bool(self.src_pad.any()) else None
        return self._src_block

    def projection(self, W: torch.Tensor, make) -> torch.Tensor | None:
        """A contiguous (D, V) copy of the output embedding W (V, D) for one-row steps, or None.

        On CPU, MKL's (1, D) @ (D, V) with that copy takes about half the time of the strided view
        W.t() inside a decoding loop (`python -m refdec.stepcost`). It is taken on this memory's
        (one decoding call's) second one-row step, from `make(W)`, which checks the copy against
        W's current values: a call with a single one-row step, as IAD's often are, does not pay for
        the check, and no call ever decodes with weights older than its own."""
        got = self.__dict__.setdefault("_projections", {}).get(W.data_ptr())
        if got is None:
            self._projections[W.data_ptr()] = False  # one one-row step seen
            return None
        if got is False:
            got = self._projections[W.data_ptr()] = make(W)
        return got

    def select(self, rows: torch.Tensor) -> "Memory":
        """The memory of batch rows `rows` (repeats allowed: beam search expands each source)."""
        return Memory(
            self.states.index_select(0, rows),
            self.src_pad.index_select(0, rows),
            [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.cross_kv],
        )


# On CPU, MKL's matrix product picks a much faster routine for a few rows x (r, D) when asked for
# (W @ x.T).T than for x @ W.T: on the mt-en-de model a decoder call over 2-16 new tokens costs
# 1.30-1.57 single steps instead of 1.38-1.92 (`python -m refdec.stepcost` times both;
# docs/cpu-cost.md).
# Beyond 16 rows (an encoder pass) it loses, so the route depends on the row count. Same products,
# possibly summed in another order: float32 logits may differ in the last bits between routes.
# The route is on by default and switched per model (`set_few_row_route`: refdec.stepcost times
# both routes on one model).
FEW_ROWS = range(2, 17)


def few_row_route(x: torch.Tensor) -> bool:
    """Whether `linear` takes the (W @ x.T).T route for x (..., D): inference on CPU, 2-16 rows."""
    return x.device.type == "cpu" and not torch.is_grad_enabled() and x.numel() // x.shape[-1] in FEW_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, few_rows: bool = True) -> torch.Tensor:
    """x (..., D) @ weight (O, D).T + bias (O,) -> (..., O); F.linear except for few rows on CPU
    (`few_rows` False: F.linear always)."""
    if not (few_rows and few_row_route(x)):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).t()  # (D, r)
    y = weight @ rows if bias is None else torch.addmm(bias[:, None], weight, rows)  # (O, r)
    return y.t().reshape(*x.shape[:-1], weight.shape[0])


# -- row-invariant compute ------------------------------------------------------------------------
# A matrix product x @ W.T may round row i differently depending on how many rows x has (MKL picks
# its blocking by shape, and by the memory alignment of its operands). In row-invariant mode every
# dot product is an elementwise product summed over its last dimension by torch's own reduction,
# which sums each output alone over the same D elements in the same order whatever else is in the
# tensor and wherever it lies in memory; every attention query sees exactly its own keys. So a
# position's logits do not depend on the call shape (new tokens, batch rows, cache length) and a
# decoder that verifies k tokens in one call computes bitwise what greedy computes one by one.
# Temporaries are kept to INVARIANT_BLOCK bytes: glibc serves larger ones (from 128 KiB) by mmap,
# and their page faults made a greedy step several times slower here.
INVARIANT_BLOCK = 1 << 16


class RowInvariant:
    """Marks a layer with a row-invariant code path; `set_row_invariant` switches it per model."""

    row_invariant = False


def set_row_invariant(module: nn.Module, on: bool = True) -> nn.Module:
    """Switch row-invariant compute on (or off) for every layer of `module` (a Transformer, an
    EarlyExit, a SharedEncoder, proposal heads) and return it. In that mode every position's logits
    are bitwise the same whatever the call shape, so every lossless decoder equals greedy decoding
    exactly, ties included; it is slower (docs/algorithms.md, "Row-invariant mode"). Other models are untouched."""
    for m in module.modules():
        if isinstance(m, RowInvariant):
            m.row_invariant = on
    return module


class FewRowRoute:
    """Marks a layer whose products may take the few-row route; `set_few_row_route` switches it per model."""

    few_rows = True


def set_few_row_route(module: nn.Module, on: bool = True) -> nn.Module:
    """Let the linear layers and the vocabulary projection of `module` take the few-row route of
    `linear` (on, the default) or always F.linear (off), and return it. Other models are untouched."""
    for m in module.modules():
        if isinstance(m, FewRowRoute):
            m.few_rows = on
    return module


def is_row_invariant(module: nn.Module) -> bool:
    """Whether `module` computes in row-invariant mode (all of its layers: the switch sets them together)."""
    layers = [m for m in module.modules() if isinstance(m, RowInvariant)]
    return bool(layers) and all(m.row_invariant for m in layers)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., D) @ weight (O, D).T + bias -> (..., O), each output the sum over D of x * w alone
    (blocks of rows and outputs bound the temporary; a block's size changes no output)."""
    D, O = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, D)
    out = rows.new_empty(rows.shape[0], O)
    per_block = max(1, INVARIANT_BLOCK // (D * x.element_size()))  # (row, output) pairs per temporary
    o_step = min(O, per_block)
    r_step = max(1, per_block // O) if o_step == O else 1
    for r in range(0, rows.shape[0], r_step):
        for o in range(0, O, o_step):
            torch.sum(rows[r:r + r_step, None, :] * weight[o:o + o_step], dim=-1, out=out[r:r + r_step, o:o + o_step])
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], O)


def rowwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
                      scale: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`attention` computed so that each query sees exactly the keys it may attend to (never a
    masked longer row: more terms change how a sum rounds): queries that share their keys (no mask,
    or a mask without a query dimension) go together, the others one by one, batch row by row."""
    B, H, Q, Dh = q.shape
    L = k.shape[2]
    scale = 1.0 / math.sqrt(Dh) if scale is None else scale
    out = q.new_empty(B, H, Q, Dh)
    allowed = None if blocked is None else ~blocked.expand(B, 1, Q, L)
    shared = allowed is None or blocked.shape[-2] == 1
    for b in range(B):
        for i0, i1 in ([(0, Q)] if shared else [(i, i + 1) for i in range(Q)]):
            keys = None if allowed is None else allowed[b, 0, i0].nonzero().squeeze(1)
            kb, vb = (k[b], v[b]) if keys is None else (k[b].index_select(1, keys), v[b].index_select(1, keys))  # (H, n, Dh)
            bb = None if bias is None else bias[b if bias.shape[0] > 1 else 0]  # (H, q, L)
            if bb is not None and keys is not None:
                bb = bb.index_select(2, keys)
            step = max(1, INVARIANT_BLOCK // (max(1, kb.shape[1]) * H * Dh * q.element_size()))  # queries per temporary
            for j in range(i0, i1, step):
                qj = q[b, :, j:min(j + step, i1)]  # (H, m, Dh)
                scores = (qj[:, :, None, :] * kb[:, None]).sum(-1) * scale  # (H, m, n)
                if bb is not None:
                    scores = scores + bb[:, j:j + qj.shape[1]]
                p = torch.softmax(scores, dim=-1)
                out[b, :, j:j + qj.shape[1]] = (p[..., None] * vb[:, None]).sum(-2)  # (H, m, Dh)
    return out


class Linear(nn.Linear, RowInvariant, FewRowRoute):
    """nn.Linear (same parameters and state-dict keys) whose forward is `linear` above, or
    `rowwise_linear` in row-invariant mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_invariant:
            return rowwise_linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias, self.few_rows)


class LayerNorm(nn.LayerNorm, RowInvariant):
    """nn.LayerNorm (same parameters and state-dict keys); in row-invariant mode each row is
    normalised by a call of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.row_invariant:
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1])
        return torch.stack([super(LayerNorm, self).forward(r) for r in rows.unbind(0)]).reshape(x.shape)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
              scale: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention (section 3.2.1).

    q (B, H, q, Dh), k and v (B, H, L, Dh); blocked broadcasts to (B, H, q, L), True = may not attend.
    scale: 1/sqrt(Dh) unless given; bias (B or 1, H, q, L) added to the scores (T5's relative positions).
    Returns (B, H, q, Dh).
    """
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)  # (B, H, q, L)
    if bias is not None:
        scores = scores + bias
    if blocked is not None:
        scores = scores.masked_fill(blocked, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def causal_block(q_len: int, offset: int, device: torch.device) -> torch.Tensor:
    """(q, offset + q) mask, True = blocked: new query i (at position offset + i) sees keys 0..offset+i."""
    rows = torch.arange(q_len, device=device)[:, None] + offset
    cols = torch.arange(offset + q_len, device=device)[None, :]
    return cols > rows


class MultiHeadAttention(nn.Module, RowInvariant):
    """Section 3.2.2; self-attention when `kv_input` is the query input, cross-attention otherwise."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, d_kv: int = 0, cfg: ModelConfig | None = None):
        """d_kv: the width of the states keys and values are made from (cross-attention over another
        model's encoder; 0 = d_model). cfg: the head width, biases and score scale it names."""
        super().__init__()
        self.h, self.dh = n_heads, cfg.head_dim if cfg else d_model // n_heads
        bias, inner = cfg.bias if cfg else True, self.h * self.dh
        self.scale = None if cfg is None or cfg.scale_attention else 1.0  # None: 1/sqrt(Dh)
        self.wq = Linear(d_model, inner, bias=bias)
        self.wk = Linear(d_kv or d_model, inner, bias=bias)
        self.wv = Linear(d_kv or d_model, inner, bias=bias)
        self.wo = Linear(inner, d_model, bias=bias)
        self.drop = nn.Dropout(dropout)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.h, self.dh).transpose(1, 2)  # (B, H, T, Dh)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.wk(x)), self.split(self.wv(x))  # each (B, H, T, Dh)

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, q, D) queries over given keys/values (B, H, L, Dh), `bias` added to the scores; returns (B, q, D)."""
        B, q_len, _ = x.shape
        attend = rowwise_attention if self.row_invariant else attention
        out = attend(self.split(self.wq(x)), k, v, blocked, self.scale, bias)  # (B, H, q, Dh)
        if self.training:
            out = self.drop(out)
        return self.wo(out.transpose(1, 2).reshape(B, q_len, self.h * self.dh))


class FeedForward(nn.Module):
    """Section 3.3: two linear maps with a ReLU between (cfg.activation: another nonlinearity;
    cfg.gated_ff: the gated form w2(act(w1 x) * w3 x))."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, cfg: ModelConfig | None = None):
        super().__init__()
        bias = cfg.bias if cfg else True
        self.w1, self.w2 = Linear(d_model, d_ff, bias=bias), Linear(d_ff, d_model, bias=bias)
        self.w3 = Linear(d_model, d_ff, bias=bias) if cfg and cfg.gated_ff else None
        self.act = activation(cfg.activation if cfg else "relu")
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.w1(x))
        return self.w2(self.drop(h if self.w3 is None else h * self.w3(x)))


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The layer normalisation cfg.norm names: LayerNorm (Ba et al. 2016) or T5's RMSNorm."""
    return LayerNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.norm == "layer" else RMSNorm(cfg.d_model, cfg.norm_eps)


class Sublayer(nn.Module):
    """Residual + layer norm around a sublayer, pre-norm (x + f(norm(x))) or post-norm (norm(x + f(x)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm, self.drop, self.norm_first = make_norm(cfg), nn.Dropout(cfg.dropout), cfg.norm_first

    def forward(self, x: torch.Tensor, f) -> torch.Tensor:
        if self.norm_first:
            return x + self.drop(f(self.norm(x)))
        return self.norm(x + self.drop(f(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.dropout, cfg=cfg)
        self.ff = FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout, cfg)
        self.sub1, self.sub2 = Sublayer(cfg), Sublayer(cfg)

    def forward(self, x: torch.Tensor, pad_block: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        def self_attn(h):
            k, v = self.attn.project_kv(h)
            return self.attn.attend(h, k, v, pad_block, bias)
        return self.sub2(self.sub1(x, self_attn), self.ff)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.dropout, cfg=cfg)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.dropout, cfg.memory_dim, cfg)
        self.ff = FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout, cfg)
        self.sub1, self.sub2, self.sub3 = Sublayer(cfg), Sublayer(cfg), Sublayer(cfg)

    def forward(self, x: torch.Tensor, cross_kv: tuple[torch.Tensor, torch.Tensor], src_block: torch.Tensor,
                self_kv, self_block: torch.Tensor, real: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, q, D). `self_kv(h)` returns the self-attention keys/values for the new states h:
        from the cache (incremental) or from h alone (training). `real` (B, q) bool, True at the real
        positions of a right-padded ragged batch: the feed-forward sublayer, position by position,
        runs on those alone (a padded position's state is never read: causal attention keeps it
        out of every real one, and the caller cuts it)."""
        def self_attn(h):
            k, v = self_kv(h)
            return self.self_attn.attend(h, k, v, self_block, bias)

        def cross_attn(h):
            return self.cross_attn.attend(h, cross_kv[0], cross_kv[1], src_block)

        def packed_ff(h):
            out = torch.zeros_like(h)
            out[real] = self.ff(h[real])
            return out

        return self.sub3(self.sub2(self.sub1(x, self_attn), cross_attn), self.ff if real is None else packed_ff)


class Transformer(nn.Module, RowInvariant, FewRowRoute):
    """Encoder-decoder Transformer; see the module docstring for the entry points."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        D, V = cfg.d_model, cfg.vocab_size
        self.tgt_embed = nn.Embedding(V, D, padding_idx=cfg.pad_id)
        # enc_layers 0: no encoder and no source embedding of its own (SharedEncoder gives the states).
        self.src_embed = (self.tgt_embed if cfg.tie_embeddings or not cfg.enc_layers
                          else nn.Embedding(V, D, padding_idx=cfg.pad_id))
        self.register_buffer("positions", position_table(cfg).to(self.tgt_embed.weight.dtype), persistent=False)
        learned = cfg.positions == "learned"  # a table per side, learned (BART, mBART)
        self.src_positions = nn.Parameter(torch.zeros(cfg.max_positions, D)) if learned and cfg.enc_layers else None
        self.tgt_positions = nn.Parameter(torch.zeros(cfg.max_positions, D)) if learned else None
        relative = cfg.positions == "relative"  # T5: a bias on the self-attention scores per side instead
        self.src_relative = (RelativePositionBias(cfg.n_heads, cfg.relative_buckets, cfg.relative_max_distance, True)
                             if relative and cfg.enc_layers else None)
        self.tgt_relative = (RelativePositionBias(cfg.n_heads, cfg.relative_buckets, cfg.relative_max_distance, False)
                             if relative else None)
        self.src_embed_norm = make_norm(cfg) if cfg.embed_norm and cfg.enc_layers else nn.Identity()
        self.tgt_embed_norm = make_norm(cfg) if cfg.embed_norm else nn.Identity()
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.dec_layers))
        # Pre-norm stacks end with a norm (the residual stream is never normalised otherwise).
        self.enc_norm = make_norm(cfg) if cfg.norm_first and cfg.enc_layers else nn.Identity()
        self.dec_norm = make_norm(cfg) if cfg.norm_first else nn.Identity()
        self.out_proj = None if cfg.tie_embeddings else Linear(D, V, bias=False)
        self.register_buffer("logits_bias", torch.zeros(V) if cfg.logits_bias else None)
        self.drop = nn.Dropout(cfg.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        nn.init.normal_(self.tgt_embed.weight, std=self.cfg.d_model ** -0.5)
        with torch.no_grad():
            self.tgt_embed.weight[self.cfg.pad_id].zero_()

    def _apply(self, fn, recurse=True):
        # nn.Module._apply casts the table with everything else (float32 values in a float64 model):
        # recompute it from the float64 formula in the dtype and device it now has.
        out = super()._apply(fn, recurse)
        self.positions = position_table(self.cfg).to(self.positions.device, self.positions.dtype)
        return out

    # -- helpers ---------------------------------------------------------------------------------
    def _embed(self, side: str, tokens: torch.Tensor, offset: int | torch.Tensor,
               real: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) of `side` ("src" or "tgt") at positions offset .. offset + T - 1: one offset
        for every row, or (B,) one per row (a ragged cache). `real` (B,): how many of the T tokens of each row are real; the
        rest pad a ragged batch, and their positions are clamped to the table's end (their states
        are never read), so only real positions must fit in max_positions."""
        T = tokens.shape[1]
        ends = offset + (T if real is None else real)
        top = int(ends.max()) if torch.is_tensor(ends) else ends
        if top > self.cfg.max_positions:
            raise ValueError(f"sequence of {top} positions exceeds max_positions={self.cfg.max_positions}")
        table = self.src_positions if side == "src" else self.tgt_positions
        table = self.positions if table is None else table
        if torch.is_tensor(offset) or real is not None:
            at = torch.as_tensor(offset, device=tokens.device).reshape(-1, 1) + torch.arange(T, device=tokens.device)
            pos = table[at.clamp(max=self.cfg.max_positions - 1)]  # (B or 1, T, D): the same table rows
        else:
            pos = table[offset:offset + T]
        x = (self.src_embed if side == "src" else self.tgt_embed)(tokens)
        if self.cfg.scale_embeddings:
            x = x * math.sqrt(self.cfg.d_model)
        if self.cfg.positions != "relative":
            x = x + pos
        x = (self.src_embed_norm if side == "src" else self.tgt_embed_norm)(x)
        return self.drop(x) if self.training else x

    def _relative_bias(self, side: str, queries: int, offset: int | torch.Tensor, keys: int) -> torch.Tensor | None:
        """T5's position bias (B or 1, H, q, keys) for `queries` new positions from `offset` (or None)."""
        bias = self.src_relative if side == "src" else self.tgt_relative
        if bias is None:
            return None
        at = torch.as_tensor(offset, device=self.positions.device).reshape(-1, 1)
        return bias(at + torch.arange(queries, device=at.device), keys)

    def new_cache(self, batch: int, capacity: int = 64) -> KVCache:
        p = self.tgt_embed.weight
        return KVCache(self.cfg.dec_layers, batch, self.cfg.n_heads, self.cfg.head_dim, capacity,
                       device=p.device, dtype=p.dtype)

    def project(self, hidden: torch.Tensor, memory: Memory | None = None) -> torch.Tensor:
        """(B, q, D) final decoder states -> (B, q, V) logits, the output embedding (V, D) applied.
        With the `memory` of a decoding call, a one-row step on CPU may use its copy of the
        embedding (Memory.projection): the same products and sums, in float32 possibly rounded
        differently in the last bits (the row-invariant mode never takes it)."""
        W = self.tgt_embed.weight if self.out_proj is None else self.out_proj.weight  # (V, D)
        if self.cfg.rescale_head:  # T5 v1.0's tied head reads d_model^-0.5 x the decoder's output
            hidden = hidden * (self.cfg.d_model ** -0.5)
        if self.row_invariant:
            logits = rowwise_linear(hidden, W, None)
        elif (memory is not None and hidden.shape[0] * hidden.shape[1] == 1 and hidden.device.type == "cpu"
                and not torch.is_grad_enabled() and (W_t := memory.projection(W, self._transposed)) is not None):
            logits = hidden @ W_t
        else:
            logits = linear(hidden, W, None, self.few_rows)
        return logits if self.logits_bias is None else logits + self.logits_bias

    def _transposed(self, W: torch.Tensor) -> torch.Tensor:
        """W.t() as a contiguous copy, kept beside the values it was made from and checked against
        W's current values (torch.equal costs a fraction of a transposition), so weights changed in
        any way, through `.data` or a fused optimizer step included, give a new copy."""
        kept = self.__dict__.get("_projection_copy")
        if (kept is None or kept[0].shape != W.shape or kept[0].dtype != W.dtype or kept[0].device != W.device
                or not torch.equal(kept[0], W)):
            kept = (W.detach().clone(), W.detach().t().contiguous())
            self.__dict__["_projection_copy"] = kept
        return kept[1]

    # -- entry points, and (secondary) the parts they are made of -------------------------------------
    def encode(self, src: torch.Tensor) -> Memory:
        """src (B, S) token ids, right-padded with pad_id -> Memory."""
        return self.attach(*self.encode_states(src))

    def encode_states(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder alone: src (B, S) -> states (B, S, D) and src_pad (B, S), True at padding."""
        if not self.cfg.enc_layers:
            raise ValueError("this model has no encoder of its own: it reads another model's (refdec.model.SharedEncoder)")
        if self.cfg.encoder_prefix:  # forced tokens before every source (an NLLB model's language code)
            src = torch.cat([src.new_tensor(self.cfg.encoder_prefix).expand(src.shape[0], -1), src], dim=1)
        src_pad = src.eq(self.cfg.pad_id)  # (B, S)
        pad_block = src_pad[:, None, None, :] if bool(src_pad.any()) else None  # (B, 1, 1, S) keys that are padding
        x = self._embed("src", src, 0)
        bias = self._relative_bias("src", src.shape[1], 0, src.shape[1])  # T5: the first layer's, shared by all
        for layer in self.encoder:
            x = layer(x, pad_block, bias)
        return self.enc_norm(x), src_pad

    def attach(self, states: torch.Tensor, src_pad: torch.Tensor) -> Memory:
        """Encoder states (B, S, memory_dim), this model's or another's -> the Memory this decoder
        reads: its cross-attention keys and values, computed once per source."""
        return Memory(states, src_pad, [layer.cross_attn.project_kv(states) for layer in self.decoder])

    def decode_hidden(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache,
                      open_from: int | torch.Tensor | None = None, layers: int | None = None,
                      real: torch.Tensor | None = None) -> torch.Tensor:
        """tgt_new (B, q) tokens at positions [cache.lengths[b], cache.lengths[b] + q) of row b ->
        final states (B, q, D).

        Appends the q positions to `cache` (truncate it to undo). Causal by default; with `open_from`
        = j, new positions j .. q-1 see every new position, each other included (a block of mask
        tokens that a non-autoregressive drafter fills in at once), while positions before j stay
        causal. `layers` = n runs only the first n decoder layers (an early exit; `cache` then has n
        layers), followed by the same final norm. `real` (B,): how many of the q tokens of each row
        are real, the rest right padding of a ragged batch (their positions may run past the table;
        the caller truncates them away). `open_from` may also be (B,), one per row: row b's block
        runs from open_from[b] to its last real token, and its padding stays out of it.

        The start token fed to an empty cache is followed by the model's forced decoder_prefix, if
        any: those positions go into the cache's hidden prefix, so no decoder sees them."""
        forced = len(self.cfg.decoder_prefix) if not cache.ragged and cache.end == 0 else 0
        if forced:
            cache.truncate(0)  # drops an earlier hidden prefix
            tgt_new = self._after_start(tgt_new)
            real = None if real is None else real + forced
            open_from = None if open_from is None else open_from + forced
        q_len = tgt_new.shape[1]
        if cache.ragged or torch.is_tensor(open_from):
            offset = cache.prefix + cache.lengths  # (B,)
            # Query i of row b sees keys 0 .. lengths[b] + i and nothing else: past them lie another
            # row's longer history or this row's rejected tail, which must not enter its softmax.
            steps = torch.arange(q_len, device=offset.device)
            last_key = offset[:, None] + steps  # (B, q)
            if open_from is not None:  # row b's open block ends at its last real token
                width = torch.full_like(offset, q_len) if real is None else real.to(offset.device)
                opened = steps[None, :] >= torch.as_tensor(open_from, device=offset.device).reshape(-1, 1)
                last_key = torch.where(opened, (offset + width - 1)[:, None], last_key)
            keys = torch.arange(cache.prefix + cache.end + q_len, device=offset.device)
            self_block = (keys > last_key[:, :, None])[:, None]  # (B, 1, q, end + q)
        else:
            offset = cache.prefix + cache.length
            # One new query sees every cached key: no mask needed (the greedy step stays lean).
            self_block = causal_block(q_len, offset, tgt_new.device) if q_len > 1 else None  # (q, L + q)
            if open_from is not None and self_block is not None:
                self_block[open_from:] = False
        x = self._embed("tgt", tgt_new, offset, real)
        bias = self._relative_bias("tgt", q_len, offset, cache.prefix + cache.end + q_len)
        src_block = memory.src_block
        rows = None if real is None else torch.arange(q_len, device=x.device)[None, :] < real.to(x.device)[:, None]
        for i, layer in enumerate(self.decoder[:layers]):
            x = layer(x, memory.cross_kv[i], src_block,
                      lambda h, i=i, layer=layer: cache.append(i, *layer.self_attn.project_kv(h)), self_block, rows, bias)
        cache.advance(q_len)
        if forced:
            cache.hide(forced)
            x = x[:, forced:]
        return self.dec_norm(x)

    def _after_start(self, tgt: torch.Tensor) -> torch.Tensor:
        """tgt (B, T) beginning with the start token -> (B, T + P) with decoder_prefix after it."""
        forced = tgt.new_tensor(self.cfg.decoder_prefix).expand(tgt.shape[0], -1)
        return torch.cat([tgt[:, :1], forced, tgt[:, 1:]], dim=1)

    def decode(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache) -> torch.Tensor:
        """tgt_new (B, q) -> logits (B, q, V): row i predicts the token after tgt_new[:, i]."""
        return self.project(self.decode_hidden(tgt_new, memory, cache), memory)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Teacher forcing without a cache: src (B, S), tgt (B, T) starting with bos -> logits (B, T, V)."""
        return self.project(self.forward_hidden(src, tgt))

    def forward_hidden(self, src: torch.Tensor, tgt: torch.Tensor, self_block: torch.Tensor | None = None,
                       memory: Memory | None = None) -> torch.Tensor:
        """forward() before the vocabulary projection: final decoder states (B, T, D). `self_block`
        (T, T) or (B, 1, T, T), True = blocked, replaces the causal mask (a drafter's training).
        `memory` replaces encode(src) (a decoder on another model's encoder)."""
        for x in self._decoder_layers(src, tgt, self_block, memory):
            pass
        return self.dec_norm(x)

    def early_exit_hidden(self, src: torch.Tensor, tgt: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_hidden's final states and, through the same final norm, the states after the first
        `layers` decoder layers (an early exit's, BiLD's small model): (final, early), each (B, T, D)."""
        if not 1 <= layers < self.cfg.dec_layers:
            raise ValueError(f"an early exit needs 1 <= layers < {self.cfg.dec_layers}, got {layers}")
        early = None
        for i, x in enumerate(self._decoder_layers(src, tgt), start=1):
            if i == layers:
                early = self.dec_norm(x)
        return self.dec_norm(x), early

    def _decoder_layers(self, src: torch.Tensor, tgt: torch.Tensor, self_block: torch.Tensor | None = None,
                        memory: Memory | None = None):
        """Teacher forcing without a cache: the residual stream (B, T, D) after each decoder layer."""
        if memory is None:
            memory = self.encode(src)
        forced = len(self.cfg.decoder_prefix)
        if forced:  # the forced tokens after the start token, their states dropped from the result
            if self_block is not None:
                raise ValueError("a model with a decoder_prefix takes no self_block")
            tgt = self._after_start(tgt)
        x = self._embed("tgt", tgt, 0)
        if self_block is None:
            self_block = causal_block(tgt.shape[1], 0, x.device)
        src_block, bias = memory.src_block, self._relative_bias("tgt", tgt.shape[1], 0, tgt.shape[1])
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory.cross_kv[i], src_block, layer.self_attn.project_kv, self_block, bias=bias)
            yield x[:, forced:]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class EarlyExit(nn.Module):
    """The first `layers` decoder layers of a Transformer with its final norm and prediction head:
    BiLD's early-exit small model (Kim et al. 2023, section 4.4). It shares every weight, and the
    encoder output, with the full model, and keeps its own KV cache of `layers` layers; decoders
    that take a small model take this as one."""

    def __init__(self, base: Transformer, layers: int):
        super().__init__()
        if not 1 <= layers < base.cfg.dec_layers:
            raise ValueError(f"an early exit needs 1 <= layers < {base.cfg.dec_layers}, got {layers}")
        self.base, self.layers, self.cfg = base, layers, base.cfg
        self.train(base.training)  # in step with the model it belongs to (eval for decoding)

    def encode(self, src: torch.Tensor) -> Memory:
        return self.base.encode(src)

    def new_cache(self, batch: int, capacity: int = 64) -> KVCache:
        p = self.base.tgt_embed.weight
        return KVCache(self.layers, batch, self.cfg.n_heads, self.cfg.head_dim, capacity, device=p.device, dtype=p.dtype)

    def decode_hidden(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache, open_from: int | torch.Tensor | None = None,
                      real: torch.Tensor | None = None) -> torch.Tensor:
        return self.base.decode_hidden(tgt_new, memory, cache, open_from=open_from, layers=self.layers, real=real)

    def project(self, hidden: torch.Tensor, memory: Memory | None = None) -> torch.Tensor:
        return self.base.project(hidden, memory)

    def decode(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache) -> torch.Tensor:
        return self.project(self.decode_hidden(tgt_new, memory, cache), memory)

    def memory_from(self, memory: Memory) -> Memory:
        """The small model's memory from the large model's: the same (every weight is shared)."""
        return memory


class SharedEncoder(nn.Module):
    """A decoder without an encoder of its own (enc_layers 0) on another model's encoder: a BiLD
    small model that reads the large model's encoder states. Paired with that large model, the
    encoder runs once per source for both (`memory_from`), and the small model's cost is its
    decoder alone. Decoders take it as a model; its decoder is `small`, the encoder's model `base`."""

    def __init__(self, small: Transformer, base: Transformer):
        super().__init__()
        if small.cfg.enc_layers:
            raise ValueError("SharedEncoder takes a decoder without an encoder (enc_layers 0)")
        if small.cfg.memory_dim != base.cfg.d_model:
            raise ValueError(f"the decoder reads states of width {small.cfg.memory_dim}, the encoder gives {base.cfg.d_model}")
        self.small, self.base, self.cfg = small, base, small.cfg
        self.train(small.training)

    def encode(self, src: torch.Tensor) -> Memory:
        return self.small.attach(*self.base.encode_states(src))

    def memory_from(self, memory: Memory) -> Memory:
        """The decoder's memory from the base model's (its encoder states; cross-attention K/V anew)."""
        return self.small.attach(memory.states, memory.src_pad)

    def new_cache(self, batch: int, capacity: int = 64) -> KVCache:
        return self.small.new_cache(batch, capacity)

    def decode_hidden(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache, open_from: int | torch.Tensor | None = None,
                      real: torch.Tensor | None = None) -> torch.Tensor:
        return self.small.decode_hidden(tgt_new, memory, cache, open_from=open_from, real=real)

    def project(self, hidden: torch.Tensor, memory: Memory | None = None) -> torch.Tensor:
        return self.small.project(hidden, memory)

    def decode(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache) -> torch.Tensor:
        return self.project(self.decode_hidden(tgt_new, memory, cache), memory)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Teacher forcing, no cache: (B, T, V) logits."""
        return self.small.project(self.small.forward_hidden(src, tgt, memory=self.encode(src)))
