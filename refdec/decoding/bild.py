"""Big Little Decoder (BiLD; Kim et al., NeurIPS 2023, "Speculative Decoding with Big Little
Decoder", section 3, Algorithm 1).

A small model decodes autoregressively while it is confident; the large model steps in only when
it is not, and then checks in one non-autoregressive call everything the small model wrote since
the large model's last call:

    y <- []
    while y[-1] != eos:
        p_S <- small(y)
        if max p_S[-1] >= fallback_threshold and the small model wrote fewer than max_window tokens
        since the large model's last call:
            y <- y + [sample(p_S[-1])]                               # small model's token
        else:                                                        # fallback
            p_L <- large(y)          one call over every token since the large model's last call
            m <- the first small-model token with d(p_L[m], p_S[m]) > rollback_threshold
            if m exists: y <- y[:m] + [sample(p_L[m])]               # rollback
            else:        y <- y + [sample(p_L[-1])]

d is the paper's distance: the cross-entropy of the small model's (hard) token under the large
model's distribution, -log p_L(y_m). Sampling is argmax by default, nucleus (top-p) sampling from
a seeded generator with sample=True.

That large-model call is refdec's shared verification step (refdec.decoding.verify): its draft is
the small model's tokens, its acceptance test is d <= rollback_threshold, and the token it commits
at the first failure, or after the last token when none fails, is the large model's. Both caches
are truncated to what stayed valid, never recomputed: the large model's by the verification step,
the small model's by its Follower (refdec.decoding.verify), which cuts back to the first changed
token and catches up with the rest in one call.

As in the paper's Algorithm 1, an eos written by the small model ends the sentence without a
large-model check. With a fallback threshold above 1 the small model never writes a token, every
iteration is one large-model step, and BiLD is greedy decoding of the large model exactly.
"""

from __future__ import annotations

import torch

from ..model import Transformer
from .result import DecodeResult, DecodeStats, check_eval, finish_row
from .sampling import distribution, draw
from .verify import Follower, row_memories, verify


def rollback_rule(threshold: float):
    """accept(logits, draft): keep a small-model token while -log p_L(token) <= threshold."""
    def accept(logits: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
        nll = -torch.log_softmax(logits.double(), dim=-1).gather(-1, draft[:, None])[:, 0]
        return nll.le(threshold)
    return accept


def check_pair(large: Transformer, small: Transformer) -> None:
    if large.cfg.vocab_size != small.cfg.vocab_size:
        raise ValueError(f"the small model's vocabulary ({small.cfg.vocab_size}) is not the large model's "
                         f"({large.cfg.vocab_size})")
    check_eval(large)
    check_eval(small)


def shares_encoder(large: Transformer, small) -> bool:
    """Whether the small model reads the large model's encoder (so it runs once for both)."""
    return getattr(small, "base", None) is large


def encoder_passes(large: Transformer, small) -> int:
    """Encoder runs per batch for the pair: 1 when the small model reads the large model's encoder."""
    return 1 if shares_encoder(large, small) else 2


def small_memory(large: Transformer, small, memory_l, src: torch.Tensor):
    """The small model's (or drafter's) memory: built from the large model's when it reads that
    encoder (an early exit, or a SharedEncoder), else from its own encoder pass over `src`."""
    return small.memory_from(memory_l) if shares_encoder(large, small) else small.encode(src)


def pair_rows(large: Transformer, small: Transformer, src: torch.Tensor):
    """Encode the batch with both models (`small_memory`); yield each row's (large memory, small memory)."""
    mem_l = large.encode(src)
    mem_s = small_memory(large, small, mem_l, src)
    return zip(row_memories(mem_l, src.shape[0], src.device), row_memories(mem_s, src.shape[0], src.device))


@torch.inference_mode()
def bild(large: Transformer, small: Transformer, src: torch.Tensor, *, max_len: int, fallback_threshold: float = 0.4,
         rollback_threshold: float = 2.0, max_window: int = 10, sample: bool = False, top_p: float = 0.9,
         seed: int = 0, trace: bool = False) -> DecodeResult:
    """src (B, S) right-padded source ids (each ending in eos) -> one output per row."""
    check_pair(large, small)
    if max_window < 1:
        raise ValueError("max_window must be at least 1")
    cfg = large.cfg
    gen = torch.Generator().manual_seed(seed)
    pick = (lambda logits: draw(distribution(logits, top_p=top_p), gen)) if sample else (lambda logits: int(logits.argmax()))
    accept = rollback_rule(rollback_threshold)
    stats = DecodeStats(sentences=src.shape[0], encoder_calls=encoder_passes(large, small))
    tokens, traces = [], ([] if trace else None)
    for ml, ms in pair_rows(large, small, src):
        cache_l = large.new_cache(1, capacity=max_len + 1)
        follower = Follower(small, ms, capacity=max_len + 1)
        out: list[int] = []
        pending: list[int] = []  # the small model's tokens since the large model's last call
        last_l, steps = cfg.bos_id, []
        while len(out) < max_len and (not out or out[-1] != cfg.eos_id):
            logits_s = follower.next_logits([cfg.bos_id] + out)
            stats.drafter_calls += 1
            confident = float(torch.softmax(logits_s.double(), dim=-1).max()) >= fallback_threshold
            if confident and len(pending) < max_window:
                tok = pick(logits_s)
                out.append(tok)
                pending.append(tok)
                continue
            kept = len(out) - len(pending)  # committed before the small model's run
            v = verify(large, ml, cache_l, last_l, pending, budget=max_len - kept, eos_id=cfg.eos_id,
                       accept=accept, choose=(lambda row, n, rejected: pick(row)) if sample else None)
            new = out[:kept] + v.tokens
            rolled = v.accepted < len(pending)
            stats.verifier_calls += 1
            stats.fallbacks += 1
            stats.rollbacks += int(rolled)
            stats.accepted.append(len(v.tokens))
            if trace:
                steps.append({"small": pending, "kept": v.accepted, "large": v.tokens[-1], "rollback": rolled})
            out, pending, last_l = new, [], v.tokens[-1]
        if trace and pending:
            steps.append({"small": pending, "kept": len(pending), "large": None, "rollback": False})
        tokens.append(finish_row(out, cfg.eos_id, stats, src.device))
        if trace:
            traces.append(steps)
    return DecodeResult(tokens, stats, traces)

