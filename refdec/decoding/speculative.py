"""Speculative sampling (Leviathan, Kalman, Matias 2023; Chen et al. 2023): a small model drafts a
fixed window of gamma tokens, the large model scores them in one call, and rejection sampling keeps
the output distributed exactly as sampling from the large model alone. One iteration is Leviathan
et al.'s Algorithm 1 (SpeculativeDecodingStep), step for step in the paper's order and notation
(M_q the small model, M_p the large one); the line numbers are this docstring's own, which the
comments below point at:

     1: for i = 1 .. gamma:
     2:     q_i(x) <- M_q(prefix + [x_1 .. x_(i-1)])
     3:     x_i ~ q_i(x)
     4: p_1(x) .. p_(gamma+1)(x) <- M_p(prefix) .. M_p(prefix + [x_1 .. x_gamma])    (one call, in parallel)
     5: r_1 ~ U(0, 1) .. r_gamma ~ U(0, 1)
     6: n <- the first i - 1 with r_i > p_i(x_i) / q_i(x_i), or gamma when there is none
     7: p'(x) <- p_(n+1)(x)
     8: if n < gamma:
     9:     p'(x) <- norm(max(0, p_(n+1)(x) - q_(n+1)(x)))
    10: t ~ p'(x)
    11: return prefix + [x_1 .. x_n, t]

Lines 5-6 keep x_i with probability min(1, p_i(x_i) / q_i(x_i)) and stop at the first rejection;
lines 7-10 draw the rejected position from the residual norm(max(0, p - q)), or, when all gamma
were kept, one more token from p_(gamma+1). A drafted x is then emitted with probability
q(x) min(1, p(x) / q(x)) = min(p(x), q(x)), and a rejection, of mass sum_x max(0, q(x) - p(x)) =
sum_x max(0, p(x) - q(x)), adds max(0, p - q): min(p, q) + max(0, p - q) = p.

p and q are the models' sampling distributions (softmax at `temperature`, then nucleus `top_p`, the
same transform for both), so the output follows the large model's p exactly. Without sampling
(sample=False) the drafts are the small model's argmax and a drafted token passes only when it is
the large model's argmax: the output is greedy decoding of the large model, token for token.

The large-model call is refdec's shared verification step with a random acceptance test and a
`choose` that draws from the residual (or, after a full acceptance, from p); the small model keeps
its own cache in step (a Follower: cut back to the first changed token, catch up) as in BiLD (refdec.decoding.bild).

Batches: the small model drafts for every row still decoding in the same calls (a row whose
window is full, or that drafted eos, waits), the large model verifies every row's draft in one call
(refdec.decoding.verify.verify_rows, each row with its own rules when sampling), each row commits its
own tokens, and a row that reaches eos or max_len leaves the batch (refdec.decoding.rows). Sampling draws each row's
tokens from the one seeded generator, rows in turn.
"""

from __future__ import annotations

import torch

from ..model import Transformer
from .pairing import Follower, check_pair, encoder_passes, small_memory
from .result import DecodeResult, DecodeStats
from .rows import Rows
from .sampling import distribution, draw


@torch.inference_mode()
def decode_speculative(
    large: Transformer,
    small: Transformer,
    src: torch.Tensor,
    *,
    max_len: int,
    gamma: int = 3,
    sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    trace: bool = False,
) -> DecodeResult:
    """src (B, S) right-padded source ids (each ending in eos) -> one output per row."""
    check_pair(large, small)
    if gamma < 1:
        raise ValueError("gamma (the draft window) must be at least 1")
    if temperature <= 0:
        raise ValueError("temperature must be positive (sample=False is the greedy case)")
    cfg = large.cfg
    gen = torch.Generator().manual_seed(seed)
    B = src.shape[0]
    stats = DecodeStats(sentences=B, encoder_calls=encoder_passes(large, small))
    mem_l = large.encode(src)
    follower = Follower(small, small_memory(large, small, mem_l, src), capacity=max_len + gamma + 1)
    rows = Rows(
        cfg, B, max_len, stats, trace, memories=[mem_l], caches=[large.new_cache(B, capacity=max_len + 1), follower]
    )
    while rows:
        # Lines 1-3: sample gamma guesses x_1 .. x_gamma from M_q autoregressively (q: their distributions).
        drafts, qs = small_drafts(follower, rows, gamma, sample, temperature, top_p, gen)
        accept = choose = None
        if sample:
            accept = [residual_test(q, temperature, top_p, gen) for q in qs]
            choose = [residual_draw(q, temperature, top_p, gen) for q in qs]
        # Lines 4-10: run M_p in parallel (p_1 .. p_(gamma+1)), determine the number of accepted
        # guesses n, adjust the distribution from M_p if needed and draw t from it.
        verified = rows.verify(large, drafts, accept=accept, choose=choose)
        # Line 11: return prefix + [x_1 .. x_n, t]. Finished rows leave the batch.
        rows.commit(drafts, verified, drafted_by="small")
    return rows.result(src.device)


def small_drafts(
    follower: Follower, rows: Rows, gamma: int, sample: bool, temperature: float, top_p: float, gen: torch.Generator
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Each batch row's draft, written by the small model in shared calls, and (when sampling) the
    small model's distribution q_i at each drafted position. A row stops at gamma tokens, at a
    drafted eos, or where its budget leaves no room past the verifier's own token."""
    budgets, eos_id = rows.budgets(), rows.eos_id
    drafts: list[list[int]] = [[] for _ in rows.alive]
    qs: list[list[torch.Tensor]] = [[] for _ in rows.alive]
    while True:
        drafting = [
            r for r, d in enumerate(drafts) if len(d) < min(gamma, budgets[r] - 1) and (not d or d[-1] != eos_id)
        ]
        if not drafting:
            return drafts, qs
        logits = follower.next_logits([prefix + d for prefix, d in zip(rows.prefixes(), drafts)])
        rows.stats.drafter_calls += 1
        for r in drafting:
            if sample:  # lines 2-3: q_i(x) <- M_q(prefix + [x_1 .. x_(i-1)]); x_i ~ q_i(x)
                qs[r].append(distribution(logits[r], temperature, top_p))
                drafts[r].append(draw(qs[r][-1], gen))
            else:
                drafts[r].append(int(logits[r].argmax()))


def residual_test(q: list[torch.Tensor], temperature: float, top_p: float, gen: torch.Generator):
    """Speculative sampling's acceptance test for one row's draft, whose small-model distributions are q:
    accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) (lines 5-6)."""

    def accept(logits, draft):
        p = torch.stack([distribution(row, temperature, top_p) for row in logits]).cpu()
        i, x = torch.arange(len(draft)), draft.cpu()
        ratio = p[i, x] / torch.stack(q).cpu()[i, x]
        # Lines 5-6: r_i ~ U(0, 1); n = the first i - 1 with r_i > p_i(x_i) / q_i(x_i).
        return torch.rand(len(x), generator=gen, dtype=torch.float64) < ratio.clamp(max=1.0)

    return accept


def residual_draw(q: list[torch.Tensor], temperature: float, top_p: float, gen: torch.Generator):
    """The token after the accepted prefix (lines 7-10): from the residual max(0, p - q), renormalised,
    after a rejection; from p after a full acceptance."""

    def choose(row, n, rejected):
        p = distribution(row, temperature, top_p).cpu()
        if rejected:  # lines 8-9: p'(x) = norm(max(0, p_(n+1)(x) - q_(n+1)(x))) when n < gamma
            residual = (p - q[n].cpu()).clamp(min=0.0)
            p = residual / residual.sum() if float(residual.sum()) > 0 else p
        return draw(p, gen)

    return choose
