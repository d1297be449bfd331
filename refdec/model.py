"""An encoder-decoder Transformer written out by hand (Vaswani et al. 2017, "Attention Is All You
Need", section 3 and figure 1), in the paper's order: positions (section 3.5), attention (3.2), the
layers (3.1, 3.3), then the model with its explicit KV cache for incremental decoding. Its entry points:

    encode(src)                      -> Memory   encoder states + cross-attention K/V, once per source
    decode(tgt_new, memory, cache)   -> logits   (B, q, V) for q >= 1 new target tokens, appended to
                                                 the cache (greedy: q = 1, verification: q = k)
    forward(src, tgt)                -> logits   (B, T, V), training, no cache: the uncached reference
                                                 that the cached path is tested against

and the parts they are made of, for callers that need what lies between them:

    encode  = attach(encode_states(src))              the encoder alone; its states -> a decoder's Memory
    decode  = project(decode_hidden(...))             the decoder stack; the vocabulary projection
    forward = project(forward_hidden(src, tgt))       the same, teacher-forced
    decoder_states(src, tgt)                          forward_hidden's residual stream after each layer

Reading this file. Each function and class is the paper's, and with ModelConfig's defaults computes
what section 3 writes (but for refdec's default pre-norm: Sublayer). What section 3 does not have is
set off by a tag in the comment of the lines it takes:

    [family]    a variant of a family imported from Hugging Face (refdec.hf: Marian, BART, mBART, T5,
                M2M100/NLLB, Pegasus): T5's relative position bias and unscaled scores, other position
                tables, embedding norms, a gated feed-forward, a logits bias, forced prefix tokens; one
                call into refdec.variants, refdec.positions or refdec.forced, or one config field read
    [decoders]  an argument that a decoder beyond greedy, or its training, passes (GAD's block drafter,
                BiLD's early exit and shared encoder, a batch of rows at different lengths); its default
                is the paper's plain call (decode_hidden's docstring: who passes what)

A comment that starts with a tag marks a line there for that alone (on an `if`, with its body; on a
line of its own, with the statement below): a first reading skips it. A tag later in a comment names
what changes in one of the paper's lines. Tags, not the variants in a class of their own: they act
inside the paper's lines (a bias added to the scores, another table read), so a second class would
repeat those lines, and with them the reference route that every exactness test compares against bit
for bit. The speed routes (refdec.routes) use two seams here, ScaledDotProduct and OutputProduct: the
paper's attention and output product as modules without parameters, which a route replaces in its twin
of the model. The model, on torch's own layers (nn.Linear, nn.LayerNorm), stays as it is, and this file
knows nothing of the routes: computed as written here, it is the reference route, what a loaded
checkpoint is and what decode.py runs by default.

A decoder call asks its cache where its new tokens go and what each may attend to
(refdec.cache.KVCache.place); its layers append their keys and values through the answer. Shapes: B
batch, S source, T target, q new positions, L cached, H heads, Dh head dim, D d_model, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache, Memory, NewPositions, padding_block, teacher_forced
from .config import ModelConfig
from .forced import before_source
from .positions import FAMILY_TABLES, table_rows
from .variants import (
    GatedFeedForward,
    activation,
    embed_norms,
    learned_positions,
    make_norm,
    position_bias,
    relative_biases,
)


def sinusoidal_positions(n: int, d: int) -> torch.Tensor:
    """The fixed position encodings of section 3.5: (n, d), sin on even, cos on odd dims."""
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    inv = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * inv)
    pe[:, 1::2] = torch.cos(pos * inv)
    return pe


def position_table(cfg: ModelConfig) -> torch.Tensor:
    """The (max_positions, d_model) float64 table cfg.positions names: section 3.5's sinusoids."""
    if cfg.positions in FAMILY_TABLES:  # [family] Marian's, M2M100's (refdec.positions); zeros for learned, T5
        return FAMILY_TABLES[cfg.positions](cfg)
    return sinusoidal_positions(cfg.max_positions, cfg.d_model)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocked: torch.Tensor | None,
    scale: float | None = None,  # [family] T5's 1.0 in place of 1/sqrt(Dh)
    bias: torch.Tensor | None = None,  # [family] T5's relative position bias (refdec.variants.position_bias)
) -> torch.Tensor:
    """Scaled dot-product attention (section 3.2.1, equation 1): softmax(q k^T / sqrt(Dh)) v.

    q (B, H, q, Dh), k and v (B, H, L, Dh); blocked broadcasts to (B, H, q, L), True = may not attend.
    Returns (B, H, q, Dh)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale  # equation 1's; [family] T5's 1.0
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, q, L)
    scores = scores if bias is None else scores + bias  # [family] T5's relative position bias joins them
    if blocked is not None:
        scores = scores.masked_fill(blocked, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class ScaledDotProduct(nn.Module):
    """`attention` as a module of its own (no parameters), so that a route can compute it another way
    by putting another module in its place (refdec.routes.kernels)."""

    def __init__(self, scale: float | None):
        super().__init__()
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        blocked: torch.Tensor | None,
        bias: torch.Tensor | None = None,  # [family] T5's
    ) -> torch.Tensor:
        return attention(q, k, v, blocked, self.scale, bias)


class MultiHeadAttention(nn.Module):
    """Section 3.2.2: H heads of `attention` over keys and values from project_kv (self-attention:
    of the same states as the queries, or cached; cross-attention: of the encoder's)."""

    def __init__(self, cfg: ModelConfig, d_kv: int = 0):
        super().__init__()  # Dh = D / H, scores x 1/sqrt(Dh), biases; [family] T5: its own Dh, x 1.0, no biases
        D = cfg.d_model
        self.h, self.dh = cfg.n_heads, cfg.head_dim
        self.heads = ScaledDotProduct(None if cfg.scale_attention else 1.0)  # every head at once
        inner = self.h * self.dh
        self.wq = nn.Linear(D, inner, bias=cfg.bias)
        self.wk = nn.Linear(d_kv or D, inner, bias=cfg.bias)  # d_kv 0: D; [decoders] another encoder's width
        self.wv = nn.Linear(d_kv or D, inner, bias=cfg.bias)
        self.wo = nn.Linear(inner, D, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.h, self.dh).transpose(1, 2)  # (B, H, T, Dh)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.wk(x)), self.split(self.wv(x))  # each (B, H, T, Dh)

    def attend(
        self,
        x: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        blocked: torch.Tensor | None,
        bias: torch.Tensor | None = None,  # [family] T5's
    ) -> torch.Tensor:
        """x (B, q, D) queries over given keys/values (B, H, L, Dh); returns (B, q, D)."""
        B, q_len, _ = x.shape
        out = self.heads(self.split(self.wq(x)), k, v, blocked, bias)  # (B, H, q, Dh)
        if self.training:
            out = self.drop(out)
        return self.wo(out.transpose(1, 2).reshape(B, q_len, self.h * self.dh))


class FeedForward(nn.Module):
    """Section 3.3: two linear maps with a ReLU between, w2(relu(w1 x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, d_ff, bias = cfg.d_model, cfg.d_ff, cfg.bias
        self.w1, self.w2 = nn.Linear(D, d_ff, bias=bias), nn.Linear(d_ff, D, bias=bias)
        self.act, self.drop = activation(cfg.activation), nn.Dropout(cfg.dropout)  # relu; [family] gelu, silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.drop(self.act(self.w1(x))))


def feed_forward(cfg: ModelConfig) -> nn.Module:
    """The layer's feed-forward network: section 3.3's; [family] T5 v1.1's gated one (refdec.variants)."""
    return GatedFeedForward(cfg) if cfg.gated_ff else FeedForward(cfg)


class Sublayer(nn.Module):
    """Residual + layer norm around a sublayer: the paper's post-norm, norm(x + f(x)) (section 3.1), or
    pre-norm, x + f(norm(x)) (cfg.norm_first, refdec's default)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()  # make_norm: nn.LayerNorm; [family] T5's RMSNorm
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
        self.ff = feed_forward(cfg)
        self.sub1, self.sub2 = Sublayer(cfg), Sublayer(cfg)

    def forward(self, x: torch.Tensor, pad_block: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        def self_attn(h):  # bias: [family] T5's relative position bias, None for the paper's
            k, v = self.attn.project_kv(h)
            return self.attn.attend(h, k, v, pad_block, bias)

        return self.sub2(self.sub1(x, self_attn), self.ff)


class DecoderLayer(nn.Module):
    """Section 3.1: masked self-attention, attention over the encoder output, the feed-forward network."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index  # its place in the stack: its layer of the KV cache and of the memory's keys
        self.self_attn = MultiHeadAttention(cfg)
        self.cross_attn = MultiHeadAttention(cfg, cfg.memory_dim)
        self.ff = feed_forward(cfg)
        self.sub1, self.sub2, self.sub3 = Sublayer(cfg), Sublayer(cfg), Sublayer(cfg)

    def forward(
        self, x: torch.Tensor, new: NewPositions, memory: Memory, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (B, q, D): the states of the new positions `new` (refdec.cache.NewPositions: their masks,
        and the cache their keys and values go into); `bias`: [family] T5's relative position bias. Every
        position takes every sublayer, as the paper writes it; [decoders] a right-padded batch's padding
        too (never read: causal attention keeps it out of every real position, the caller cuts it)."""

        def self_attn(h):  # over the cache's keys and values, these positions' own appended
            k, v = new.keys_values(self.index, *self.self_attn.project_kv(h))
            return self.self_attn.attend(h, k, v, new.self_block, bias)

        def cross_attn(h):  # over the encoder's output, its keys and values made once per source
            k, v = memory.cross_kv[self.index]
            return self.cross_attn.attend(h, k, v, memory.src_block)

        return self.sub3(self.sub2(self.sub1(x, self_attn), cross_attn), self.ff)


class OutputProduct(nn.Module):
    """hidden (B, q, D) @ W (V, D).T: the product of the output embedding (section 3.4), a module of its
    own (no parameters: W is the target embedding or out_proj's) so that a route can compute it another
    way by putting another module in its place (refdec.routes.kernels)."""

    def forward(self, hidden: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, W)


class Transformer(nn.Module):
    """Encoder-decoder Transformer; see the module docstring for the entry points."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        D, V = cfg.d_model, cfg.vocab_size
        self.tgt_embed = nn.Embedding(V, D, padding_idx=cfg.pad_id)
        # the source's own embedding, or the target's (tied); [decoders] enc_layers 0: neither, no encoder of
        # its own (refdec.adapters.SharedEncoder gives another model's states)
        self.src_embed = (
            self.tgt_embed if cfg.tie_embeddings or not cfg.enc_layers else nn.Embedding(V, D, padding_idx=cfg.pad_id)
        )
        self.register_buffer("positions", position_table(cfg).to(self.tgt_embed.weight.dtype), persistent=False)
        self.src_positions, self.tgt_positions = learned_positions(cfg)  # [family] BART's learned tables
        self.src_relative, self.tgt_relative = relative_biases(cfg)  # [family] T5's relative position biases
        self.src_embed_norm, self.tgt_embed_norm = embed_norms(cfg)  # [family] BART's layernorm_embedding
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.dec_layers))
        # Pre-norm stacks end with a norm (the residual stream is never normalised otherwise).
        self.enc_norm = make_norm(cfg) if cfg.norm_first and cfg.enc_layers else nn.Identity()
        self.dec_norm = make_norm(cfg) if cfg.norm_first else nn.Identity()
        self.out_proj = None if cfg.tie_embeddings else nn.Linear(D, V, bias=False)
        self.output = OutputProduct()
        self.register_buffer("logits_bias", torch.zeros(V) if cfg.logits_bias else None)  # [family] final_logits_bias
        self.drop = nn.Dropout(cfg.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        nn.init.normal_(self.tgt_embed.weight, std=self.cfg.d_model**-0.5)
        with torch.no_grad():
            self.tgt_embed.weight[self.cfg.pad_id].zero_()

    def _apply(self, fn, recurse=True):
        # nn.Module._apply casts the table with everything else (float32 values in a float64 model):
        # recompute it from the float64 formula in the dtype and device it now has.
        out = super()._apply(fn, recurse)
        self.positions = position_table(self.cfg).to(self.positions.device, self.positions.dtype)
        return out

    def embed_source(self, src: torch.Tensor) -> torch.Tensor:
        """Section 3.4 + 3.5: src (B, S) -> (B, S, D), at positions 0 .. S - 1."""
        return self._embed(src, 0, None, self.src_embed, self.src_positions, self.src_embed_norm)

    def embed_target(
        self, tokens: torch.Tensor, offset: int | torch.Tensor, real: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Section 3.4 + 3.5: tokens (B, T) -> (B, T, D), at positions offset .. offset + T - 1.
        [decoders] offset (B,): one per row (a ragged cache); `real` (B,): decode_hidden's."""
        return self._embed(tokens, offset, real, self.tgt_embed, self.tgt_positions, self.tgt_embed_norm)

    def _embed(
        self,
        tokens: torch.Tensor,
        offset: int | torch.Tensor,
        real: torch.Tensor | None,  # [decoders]
        embedding: nn.Embedding,
        table: torch.Tensor | None,  # [family] a learned table of the side's own, else None
        norm: nn.Module,  # [family] BART's layernorm_embedding, else nn.Identity
    ) -> torch.Tensor:
        """The embeddings x sqrt(d_model) (section 3.4) plus the encodings of the tokens' positions (3.5)."""
        pos = table_rows(self.positions if table is None else table, offset, tokens, real, self.cfg.max_positions)
        scale = math.sqrt(self.cfg.d_model) if self.cfg.scale_embeddings else 1.0  # [family] BART's, T5's: 1.0
        x = norm(embedding(tokens) * scale + pos)
        return self.drop(x) if self.training else x

    def new_cache(self, batch: int, capacity: int = 64) -> KVCache:
        """An empty cache for `batch` rows, in the model's dtype and on its device."""
        p = self.tgt_embed.weight
        return KVCache(
            self.cfg.dec_layers, batch, self.cfg.n_heads, self.cfg.head_dim, capacity, device=p.device, dtype=p.dtype
        )

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, q, D) final decoder states -> (B, q, V) logits, the output embedding (V, D) applied
        (section 3.4)."""
        W = self.tgt_embed.weight if self.out_proj is None else self.out_proj.weight  # (V, D)
        if self.cfg.rescale_head:  # [family] T5 v1.0's tied head reads d_model^-0.5 x the decoder's output
            hidden = hidden * (self.cfg.d_model**-0.5)
        logits = self.output(hidden, W)
        return logits if self.logits_bias is None else logits + self.logits_bias  # [family] final_logits_bias

    # -- entry points, and (secondary) the parts they are made of -------------------------------------
    def encode(self, src: torch.Tensor) -> Memory:
        """src (B, S) token ids, right-padded with pad_id -> Memory."""
        return self.attach(*self.encode_states(src))

    def encode_states(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder alone: src (B, S) -> states (B, S, D) and src_pad (B, S), True at padding."""
        if not self.cfg.enc_layers:  # [decoders] a decoder on another model's encoder has none of its own
            raise ValueError(
                "this model has no encoder of its own: it reads another model's (refdec.adapters.SharedEncoder)"
            )
        src = before_source(src, self.cfg.encoder_prefix)  # [family] forced tokens (an NLLB model's language code)
        src_pad = src.eq(self.cfg.pad_id)  # (B, S)
        pad_block = padding_block(src_pad)  # (B, 1, 1, S) keys that are padding
        x = self.embed_source(src)
        bias = position_bias(self.src_relative, 0, src.shape[1], src.shape[1])  # [family] T5's; the paper's: None
        for layer in self.encoder:
            x = layer(x, pad_block, bias)
        return self.enc_norm(x), src_pad

    def attach(self, states: torch.Tensor, src_pad: torch.Tensor) -> Memory:
        """Encoder states (B, S, memory_dim), this model's or another's -> the Memory this decoder
        reads: its cross-attention keys and values, computed once per source."""
        return Memory(states, src_pad, [layer.cross_attn.project_kv(states) for layer in self.decoder])

    def decode_hidden(
        self,
        tgt_new: torch.Tensor,
        memory: Memory,
        cache: KVCache,
        open_from: int | torch.Tensor | None = None,  # [decoders] GAD's block drafter
        layers: int | None = None,  # [decoders] BiLD's early exit
        real: torch.Tensor | None = None,  # [decoders] a batch of rows with padding
    ) -> torch.Tensor:
        """The decoder stack over q new target tokens (section 3.1, a step of incremental decoding) -> their
        final states (B, q, D), before decode's vocabulary projection. The q positions' keys and values
        are appended to `cache` (cache.truncate undoes it).

        tgt_new    (B, q) token ids, row b's at positions cache.lengths[b] .. + q - 1: from every decoder,
                   greedy and beam one token a row (through decode), the verifying decoders a draft at once.
        memory     encode(src)'s Memory; [decoders] or attach's, from another model's encoder states.
        cache      the KVCache of this decoder's past (new_cache). Its place() says where the new tokens go
                   and what each may see: causally, the cache and the new positions up to its own.
        open_from  [decoders] None: causal (the paper's). j, or (B,) one per row: new positions j .. q-1
                   see every new position of their row, each other included, a block of masks filled in
                   at once: GAD's block drafter (refdec.drafter.draft). No family needs it.
        layers     [decoders] None: every decoder layer (the paper's). n: only the first n, then the same
                   final norm, into a cache of n layers: an early exit, BiLD's small model
                   (refdec.adapters.EarlyExit). No family needs it.
        real       [decoders] None: every token of every row is real (the paper's). (B,): how many of each
                   row's q tokens are, the rest right padding of rows at different lengths, never read and
                   cut by the caller: batched verification (refdec.decoding.verify.verify_rows), the
                   drafter's batched draft, a companion model kept in step (refdec.decoding.pairing).

        The speed routes take the same arguments and run this method's code for open_from and layers
        (refdec.routes). From the config, not the caller: [family] forced decoder tokens (decoder_prefix:
        an NLLB model's language code) in the cache's hidden prefix (refdec.forced), and T5's relative
        position bias (refdec.variants.position_bias); the paper's model has neither."""
        new = cache.place(tgt_new, self.cfg.decoder_prefix, open_from, real)  # positions, masks, forced tokens
        x = self.embed_target(new.tokens, new.offset, new.real)
        bias = position_bias(self.tgt_relative, new.offset, new.tokens.shape[1], new.keys)  # [family] T5's
        for layer in self.decoder[:layers]:  # each: self-attention over the cache, cross-attention, feed-forward
            x = layer(x, new, memory, bias)
        return self.dec_norm(new.commit(x))

    def decode(self, tgt_new: torch.Tensor, memory: Memory, cache: KVCache) -> torch.Tensor:
        """tgt_new (B, q) -> logits (B, q, V): row i predicts the token after tgt_new[:, i]."""
        return self.project(self.decode_hidden(tgt_new, memory, cache))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Teacher forcing without a cache: src (B, S), tgt (B, T) starting with bos -> logits (B, T, V)."""
        return self.project(self.forward_hidden(src, tgt))

    def forward_hidden(
        self,
        src: torch.Tensor,
        tgt: torch.Tensor,
        self_block: torch.Tensor | None = None,  # [decoders] a drafter's training
        memory: Memory | None = None,  # [decoders] a decoder on another model's encoder
    ) -> torch.Tensor:
        """forward() before the vocabulary projection: final decoder states (B, T, D). [decoders]
        `self_block` (T, T) or (B, 1, T, T), True = blocked, replaces the causal mask (a drafter's
        training); `memory` replaces encode(src) (a decoder on another model's encoder)."""
        return self.dec_norm(self.decoder_states(src, tgt, self_block, memory)[-1])

    def decoder_states(
        self, src: torch.Tensor, tgt: torch.Tensor, self_block: torch.Tensor | None = None, memory: Memory | None = None
    ) -> list[torch.Tensor]:
        """Teacher forcing without a cache: the residual stream (B, T, D) after each decoder layer, before
        the final norm ([decoders] an early exit's training reads the one after its layers: refdec.adapters)."""
        memory = self.encode(src) if memory is None else memory
        new = teacher_forced(tgt, self.cfg.decoder_prefix, self_block)  # the causal mask; [family] forced tokens in
        x = self.embed_target(new.tokens, 0)
        bias = position_bias(self.tgt_relative, 0, new.keys, new.keys)  # [family] T5's; the paper's: None
        states = []
        for layer in self.decoder:
            x = layer(x, new, memory, bias)
            states.append(x[:, new.forced :])  # [family] the forced tokens' states dropped
        return states

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
