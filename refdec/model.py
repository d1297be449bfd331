"""An encoder-decoder Transformer written out by hand (Vaswani et al. 2017, "Attention Is All You
Need", figure 1), in the paper's order: positions (section 3.5), attention (3.2), the layers (3.1,
3.3), then the model with its explicit KV cache for incremental decoding. Its entry points:

    encode(src)                      -> Memory   encoder states + cross-attention K/V, once per source
    decode(tgt_new, memory, cache)   -> logits   (B, q, V) for q >= 1 new target tokens, appended to
                                                 the cache (greedy: q = 1, verification: q = k)
    forward(src, tgt)                -> logits   (B, T, V), training, no cache: the uncached reference
                                                 that the cached path is tested against

and the parts they are made of, for callers that need what lies between them:

    encode  = attach(encode_states(src))              the encoder alone; its states -> a decoder's Memory
    decode  = project(decode_hidden(...))             the decoder stack; the vocabulary projection
    forward = project(forward_hidden(src, tgt))       the same, teacher-forced
    early_exit_hidden(src, tgt, n)                    forward_hidden's states and those after n layers

The layers are torch's own (nn.Linear, nn.LayerNorm) and the attention and projection are computed
as written here: this is the reference route, what a loaded checkpoint is and decode.py runs by
default. The speed routes beside it (refdec.routes: other kernels for the same products, the fast
and graphed routes, int8) wrap a model and compute the same mathematics another way, the model
unchanged; this file knows nothing of them. A model's forced decoder tokens
(ModelConfig.decoder_prefix) are its own business (refdec.forced).
Shapes: B batch, S source, T target, q new positions, L cached, H heads, Dh head dim, D d_model, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache, Memory, padding_block
from .config import ModelConfig
from .forced import after_start, before_source, with_forced_prefix
from .positions import FAMILY_TABLES
from .variants import activation, embed_norms, learned_positions, make_norm, position_bias, relative_biases


def sinusoidal_positions(n: int, d: int) -> torch.Tensor:
    """The fixed position encodings of section 3.5: (n, d), sin on even, cos on odd dims."""
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    inv = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * inv)
    pe[:, 1::2] = torch.cos(pos * inv)
    return pe


def position_table(cfg: ModelConfig) -> torch.Tensor:
    """The (max_positions, d_model) float64 table cfg.positions names (imported families: refdec.positions)."""
    if cfg.positions in FAMILY_TABLES:
        return FAMILY_TABLES[cfg.positions](cfg)
    return sinusoidal_positions(cfg.max_positions, cfg.d_model)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
              scale: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention (section 3.2.1).

    q (B, H, q, Dh), k and v (B, H, L, Dh); blocked broadcasts to (B, H, q, L), True = may not attend.
    Returns (B, H, q, Dh). T5 (refdec.variants): `scale` replaces 1/sqrt(Dh), `bias` joins the scores.
    """
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)  # (B, H, q, L)
    scores = scores if bias is None else scores + bias
    if blocked is not None:
        scores = scores.masked_fill(blocked, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def causal_block(q_len: int, offset: int, device: torch.device, open_from: int | None = None) -> torch.Tensor:
    """(q, offset + q) mask, True = blocked: new query i (at position offset + i) sees keys 0..offset+i.
    With `open_from` = j, queries j .. q-1 see every new position (a drafter's block of masks)."""
    rows = torch.arange(q_len, device=device)[:, None] + offset
    cols = torch.arange(offset + q_len, device=device)[None, :]
    blocked = cols > rows
    if open_from is not None:
        blocked[open_from:] = False
    return blocked


def ragged_block(offset: torch.Tensor, q_len: int, keys: int, open_from: int | torch.Tensor | None = None,
                 real: torch.Tensor | None = None) -> torch.Tensor:
    """(B, 1, q, keys) mask, True = blocked, for rows whose new queries start at different positions
    offset (B,): query i of row b sees keys 0 .. offset[b] + i and nothing else, since past them lie
    another row's longer history or this row's rejected tail, which must not enter its softmax. With
    `open_from` (one int, or (B,) one per row), row b's queries from open_from[b] on see up to its last
    real token, offset[b] + real[b] - 1 (all q when `real` is None), and its padding stays out."""
    steps = torch.arange(q_len, device=offset.device)
    last_key = offset[:, None] + steps  # (B, q)
    if open_from is not None:
        width = torch.full_like(offset, q_len) if real is None else real.to(offset.device)
        opened = steps[None, :] >= torch.as_tensor(open_from, device=offset.device).reshape(-1, 1)
        last_key = torch.where(opened, (offset + width - 1)[:, None], last_key)
    return (torch.arange(keys, device=offset.device) > last_key[:, :, None])[:, None]


def new_positions(cache: KVCache, q_len: int, device: torch.device, open_from: int | torch.Tensor | None = None,
                  real: torch.Tensor | None = None) -> tuple[int | torch.Tensor, torch.Tensor | None]:
    """Where q_len new tokens go in `cache` and what they may attend to: their first position (one int,
    or (B,) one per row in a ragged cache or with one open_from per row) and the self-attention mask
    over the cache's keys and theirs, True = blocked (causal_block, or ragged_block per row; None for
    one new token in a uniform cache, which sees every cached key: the greedy step stays lean)."""
    if cache.ragged or torch.is_tensor(open_from):
        offset = cache.prefix + cache.lengths  # (B,) each row's first new position
        return offset, ragged_block(offset, q_len, cache.prefix + cache.end + q_len, open_from, real)
    offset = cache.prefix + cache.length
    return offset, (causal_block(q_len, offset, device, open_from) if q_len > 1 else None)


class MultiHeadAttention(nn.Module):
    """Section 3.2.2: H heads of `attention` over keys and values from project_kv (self-attention:
    of the same states as the queries, or cached; cross-attention: of the encoder's)."""

    def __init__(self, cfg: ModelConfig, d_kv: int = 0):
        super().__init__()  # d_kv: the width of the states keys and values are made from (0 = d_model)
        D = cfg.d_model  # Dh = D / H, biases, scores scaled by 1/sqrt(Dh): the paper's, unless an imported family's cfg differs
        self.h, self.dh, self.scale = cfg.n_heads, cfg.head_dim, None if cfg.scale_attention else 1.0
        inner = self.h * self.dh
        self.wq = nn.Linear(D, inner, bias=cfg.bias)
        self.wk = nn.Linear(d_kv or D, inner, bias=cfg.bias)
        self.wv = nn.Linear(d_kv or D, inner, bias=cfg.bias)
        self.wo = nn.Linear(inner, D, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.h, self.dh).transpose(1, 2)  # (B, H, T, Dh)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.wk(x)), self.split(self.wv(x))  # each (B, H, T, Dh)

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, q, D) queries over given keys/values (B, H, L, Dh); returns (B, q, D)."""
        B, q_len, _ = x.shape
        out = self.attend_heads(self.split(self.wq(x)), k, v, blocked, bias)  # (B, H, q, Dh)
        if self.training:
            out = self.drop(out)
        return self.wo(out.transpose(1, 2).reshape(B, q_len, self.h * self.dh))

    def attend_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        """`attention` over every head at once: q (B, H, q, Dh) -> (B, H, q, Dh)."""
        return attention(q, k, v, blocked, self.scale, bias)


class FeedForward(nn.Module):
    """Section 3.3: two linear maps with a ReLU between (an imported family's cfg: its activation and
    biases, or the gated form w2(act(w1 x) * w3 x); refdec.variants)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, d_ff, bias = cfg.d_model, cfg.d_ff, cfg.bias
        self.w1, self.w2 = nn.Linear(D, d_ff, bias=bias), nn.Linear(d_ff, D, bias=bias)
        self.w3 = nn.Linear(D, d_ff, bias=bias) if cfg.gated_ff else None
        self.act, self.drop = activation(cfg.activation), nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.w1(x))
        return self.w2(self.drop(h if self.w3 is None else h * self.w3(x)))


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
    """Section 3.1: self-attention over the source, then the feed-forward network."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = MultiHeadAttention(cfg)
        self.ff = FeedForward(cfg)
        self.sub1, self.sub2 = Sublayer(cfg), Sublayer(cfg)

    def forward(self, x: torch.Tensor, pad_block: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        def self_attn(h):  # bias: T5's relative position bias
            k, v = self.attn.project_kv(h)
            return self.attn.attend(h, k, v, pad_block, bias)
        return self.sub2(self.sub1(x, self_attn), self.ff)


class DecoderLayer(nn.Module):
    """Section 3.1: masked self-attention, attention over the encoder output, the feed-forward network."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.cross_attn = MultiHeadAttention(cfg, cfg.memory_dim)
        self.ff = FeedForward(cfg)
        self.sub1, self.sub2, self.sub3 = Sublayer(cfg), Sublayer(cfg), Sublayer(cfg)

    def forward(self, x: torch.Tensor, cross_kv: tuple[torch.Tensor, torch.Tensor], src_block: torch.Tensor,
                self_kv, self_block: torch.Tensor, is_real: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, q, D). `self_kv(h)` returns the self-attention keys/values for the new states h:
        from the cache (incremental) or from h alone (training). `is_real` (B, q), True at the real
        positions of a right-padded ragged batch: the feed-forward sublayer, position by position,
        runs on those alone (a padded position's state is never read: causal attention keeps it
        out of every real one, and the caller cuts it)."""
        def self_attn(h):
            k, v = self_kv(h)
            return self.self_attn.attend(h, k, v, self_block, bias)  # bias: T5's relative position bias

        def cross_attn(h):
            return self.cross_attn.attend(h, cross_kv[0], cross_kv[1], src_block)

        def packed_ff(h):
            out = torch.zeros_like(h)
            out[is_real] = self.ff(h[is_real])
            return out

        return self.sub3(self.sub2(self.sub1(x, self_attn), cross_attn), self.ff if is_real is None else packed_ff)


class Transformer(nn.Module):
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
        # An imported family's (refdec.variants): learned tables, T5's relative biases, embedding norms
        self.src_positions, self.tgt_positions = learned_positions(cfg)
        self.src_relative, self.tgt_relative = relative_biases(cfg)
        self.src_embed_norm, self.tgt_embed_norm = embed_norms(cfg)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.dec_layers))
        # Pre-norm stacks end with a norm (the residual stream is never normalised otherwise).
        self.enc_norm = make_norm(cfg) if cfg.norm_first and cfg.enc_layers else nn.Identity()
        self.dec_norm = make_norm(cfg) if cfg.norm_first else nn.Identity()
        self.out_proj = None if cfg.tie_embeddings else nn.Linear(D, V, bias=False)
        self.register_buffer("logits_bias", torch.zeros(V) if cfg.logits_bias else None)  # final_logits_bias
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

    def _embed(self, side: str, tokens: torch.Tensor, offset: int | torch.Tensor,
               real: torch.Tensor | None = None) -> torch.Tensor:
        """Section 3.4 + 3.5: tokens (B, T) of `side` (src or tgt) at positions offset .. offset + T - 1, offset one int or (B,)
        one per row (a ragged cache). With `real` (B,) real tokens per row, the padding's positions
        are clamped to the table's end (their states are never read): only real ones must fit."""
        T = tokens.shape[1]
        ends = offset + (T if real is None else real)
        top = int(ends.max()) if torch.is_tensor(ends) else ends
        if top > self.cfg.max_positions:
            raise ValueError(f"sequence of {top} positions exceeds max_positions={self.cfg.max_positions}")
        table = getattr(self, f"{side}_positions")
        table = self.positions if table is None else table
        if torch.is_tensor(offset) or real is not None:
            at = torch.as_tensor(offset, device=tokens.device).reshape(-1, 1) + torch.arange(T, device=tokens.device)
            pos = table[at.clamp(max=self.cfg.max_positions - 1)]  # (B or 1, T, D): the same table rows
        else:
            pos = table[offset:offset + T]
        x = getattr(self, f"{side}_embed")(tokens) * (math.sqrt(self.cfg.d_model) if self.cfg.scale_embeddings else 1.0)
        x = getattr(self, f"{side}_embed_norm")(x + pos)
        return self.drop(x) if self.training else x

    def new_cache(self, batch: int, capacity: int = 64) -> KVCache:
        """An empty cache for `batch` rows, in the model's dtype and on its device."""
        p = self.tgt_embed.weight
        return KVCache(self.cfg.dec_layers, batch, self.cfg.n_heads, self.cfg.head_dim, capacity,
                       device=p.device, dtype=p.dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, q, D) final decoder states -> (B, q, V) logits, the output embedding (V, D) applied
        (section 3.4)."""
        W = self.tgt_embed.weight if self.out_proj is None else self.out_proj.weight  # (V, D)
        if self.cfg.rescale_head:  # T5 v1.0's tied head reads d_model^-0.5 x the decoder's output
            hidden = hidden * (self.cfg.d_model ** -0.5)
        logits = self.vocabulary(hidden, W)
        return logits if self.logits_bias is None else logits + self.logits_bias

    def vocabulary(self, hidden: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """hidden (B, q, D) @ W (V, D).T: the product `project` makes."""
        return F.linear(hidden, W)

    # -- entry points, and (secondary) the parts they are made of -------------------------------------
    def encode(self, src: torch.Tensor) -> Memory:
        """src (B, S) token ids, right-padded with pad_id -> Memory."""
        return self.attach(*self.encode_states(src))

    def encode_states(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder alone: src (B, S) -> states (B, S, D) and src_pad (B, S), True at padding."""
        if not self.cfg.enc_layers:
            raise ValueError("this model has no encoder of its own: it reads another model's (refdec.adapters.SharedEncoder)")
        src = before_source(src, self.cfg.encoder_prefix)  # forced tokens (an NLLB model's language code)
        src_pad = src.eq(self.cfg.pad_id)  # (B, S)
        pad_block = padding_block(src_pad)  # (B, 1, 1, S) keys that are padding
        x, bias = self._embed("src", src, 0), position_bias(self.src_relative, 0, src.shape[1], src.shape[1])
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
        = j (or (B,), one per row), new positions j .. q-1 see every new position of their row, each
        other included (a block of masks that a non-autoregressive drafter fills in at once). `layers`
        = n runs only the first n decoder layers (an early exit; `cache` then has n layers), then the
        same final norm. `real` (B,): how many of the q tokens of each row are real, the rest right
        padding of a ragged batch (the caller truncates them away). A forced decoder_prefix goes into
        the cache's hidden prefix (`with_forced_prefix`)."""
        tgt_new, forced, open_from, real = with_forced_prefix(self.cfg.decoder_prefix, tgt_new, cache, open_from, real)
        q_len = tgt_new.shape[1]
        offset, self_block = new_positions(cache, q_len, tgt_new.device, open_from, real)
        x = self._embed("tgt", tgt_new, offset, real)
        bias, src_block = position_bias(self.tgt_relative, offset, q_len, cache.prefix + cache.end + q_len), memory.src_block
        is_real = None if real is None else torch.arange(q_len, device=x.device)[None, :] < real.to(x.device)[:, None]
        for i, layer in enumerate(self.decoder[:layers]):
            x = layer(x, memory.cross_kv[i], src_block,
                      lambda h, i=i, layer=layer: cache.append(i, *layer.self_attn.project_kv(h)), self_block, is_real, bias)
        cache.advance(q_len)
        if forced:
            cache.hide(forced)
            x = x[:, forced:]
        return self.dec_norm(x)

    def decode(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache) -> torch.Tensor:
        """tgt_new (B, q) -> logits (B, q, V): row i predicts the token after tgt_new[:, i]."""
        return self.project(self.decode_hidden(tgt_new, memory, cache))

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
            tgt = after_start(tgt, self.cfg.decoder_prefix)
        x = self._embed("tgt", tgt, 0)
        if self_block is None:
            self_block = causal_block(tgt.shape[1], 0, x.device)
        src_block, bias = memory.src_block, position_bias(self.tgt_relative, 0, tgt.shape[1], tgt.shape[1])
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory.cross_kv[i], src_block, layer.self_attn.project_kv, self_block, bias=bias)
            yield x[:, forced:]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
