"""Speculative sampling (Leviathan, Kalman, Matias 2023; Chen et al. 2023): a small model drafts a
fixed window of gamma tokens, the large model scores them in one call, and rejection sampling keeps
the output distributed exactly as sampling from the large model alone.

    repeat:
        draft x_1 .. x_gamma from the small model, x_i ~ q_i = q(. | prefix, x_<i)
        one large-model call: p_1 .. p_(gamma+1)
        for i = 1 .. gamma: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); stop at the first
        rejection and draw that position from norm(max(0, p_i - q_i))
        if all gamma were accepted, draw one more token from p_(gamma+1)

p and q are the models' sampling distributions (softmax at `temperature`, then nucleus `top_p`, the
same transform for both), so the output follows the large model's p exactly. Without sampling
(sample=False) the drafts are the small model's argmax and a drafted token passes only when it is
the large model's argmax: the output is greedy decoding of the large model, token for token.

The large-model call is refdec's shared verification step with a random acceptance test and a
`choose` that draws from the residual (or, after a full acceptance, from p); the small model keeps
its own cache in step (a Follower: cut back to the first changed token, catch up) as in BiLD (refdec.decoding.bild).
"""

from __future__ import annotations

import torch

from ..model import Transformer
from .bild import check_pair, encoder_passes, pair_rows
from .result import DecodeResult, DecodeStats, finish_row
from .sampling import distribution, draw
from .verify import Follower, verify


@torch.inference_mode()
def speculative(large: Transformer, small: Transformer, src: torch.Tensor, *, max_len: int, gamma: int = 3,
                sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                trace: bool = False) -> DecodeResult:
    """src (B, S) right-padded source ids (each ending in eos) -> one output per row."""
    check_pair(large, small)
    if gamma < 1:
        raise ValueError("gamma (the draft window) must be at least 1")
    if temperature <= 0:
        raise ValueError("temperature must be positive (sample=False is the greedy case)")
    cfg = large.cfg
    gen = torch.Generator().manual_seed(seed)
    stats = DecodeStats(sentences=src.shape[0], encoder_calls=encoder_passes(large, small))
    tokens, traces = [], ([] if trace else None)
    for ml, ms in pair_rows(large, small, src):
        cache_l = large.new_cache(1, capacity=max_len + 1)
        follower = Follower(small, ms, capacity=max_len + gamma + 1)
        out: list[int] = []
        last_l, steps = cfg.bos_id, []
        while len(out) < max_len and (not out or out[-1] != cfg.eos_id):
            budget = max_len - len(out)
            draft: list[int] = []
            q: list[torch.Tensor] = []  # the small model's distribution at each drafted position
            while len(draft) < min(gamma, budget - 1) and (not draft or draft[-1] != cfg.eos_id):
                logits = follower.next_logits([cfg.bos_id] + out + draft)
                stats.drafter_calls += 1
                if sample:
                    q.append(distribution(logits, temperature, top_p))
                    draft.append(draw(q[-1], gen))
                else:
                    draft.append(int(logits.argmax()))
            accept = choose = None
            if sample:
                def accept(logits, d, q=q):
                    p = torch.stack([distribution(row, temperature, top_p) for row in logits]).cpu()
                    i, d = torch.arange(len(d)), d.cpu()
                    ratio = p[i, d] / torch.stack(q).cpu()[i, d]
                    return torch.rand(len(d), generator=gen, dtype=torch.float64) < ratio.clamp(max=1.0)

                def choose(row, n, rejected, q=q):
                    p = distribution(row, temperature, top_p).cpu()
                    if rejected:  # the residual max(0, p - q), renormalised
                        r = (p - q[n].cpu()).clamp(min=0.0)
                        p = r / r.sum() if float(r.sum()) > 0 else p
                    return draw(p, gen)
            v = verify(large, ml, cache_l, last_l, draft, budget=budget, eos_id=cfg.eos_id, accept=accept,
                       choose=choose)
            new = out + v.tokens
            stats.verifier_calls += 1
            stats.accepted.append(len(v.tokens))
            if trace:
                steps.append({"small": draft, "kept": v.accepted, "large": v.tokens[-1]})
            out, last_l = new, v.tokens[-1]
        tokens.append(finish_row(out, cfg.eos_id, stats, src.device))
        if trace:
            traces.append(steps)
    return DecodeResult(tokens, stats, traces)
