"""Beam search with a KV cache, batched, with a length penalty.

    hypotheses of row b: K prefixes with summed log-probabilities (only [bos] at first)
    each step: extend every live prefix by every token, keep the 2K best candidates;
        a candidate ending in eos that ranks among the top K is finished, score / length^alpha;
        the best K candidates that do not end in eos stay live (their cache rows are reordered)
    row b is done once it has K finished hypotheses; at max_len the live ones finish as they are.
    return the finished hypothesis with the best length-normalised score.

This is the stopping rule of fairseq and of the aggressive-decoding papers' baselines. Candidates
are ranked by refdec's one tie rule (refdec.decoding.ties): with K = 1 it keeps exactly greedy's
argmax token each step, ties included, so beam(1) == greedy (tested); with K at least the number
of possible prefixes it is exhaustive search (tested on a tiny vocabulary).
"""

from __future__ import annotations

import torch

from ..model import Transformer
from ..trace import Step
from .result import DecodeResult, DecodeStats, check_eval, result_of
from .ties import best_candidates


@torch.inference_mode()
def decode_beam(
    model: Transformer,
    src: torch.Tensor,
    *,
    max_len: int,
    beam_size: int = 5,
    length_penalty: float = 1.0,
    trace: bool = False,
) -> DecodeResult:
    """src (B, S) -> the best hypothesis per row. Score = sum log p / (length incl. eos) ** length_penalty."""
    check_eval(model)
    if beam_size < 1:
        raise ValueError("beam_size must be at least 1")
    cfg, K = model.cfg, beam_size
    B, device = src.shape[0], src.device
    memory = model.encode(src).select(torch.arange(B, device=device).repeat_interleave(K))  # row b*K+k
    cache = model.new_cache(B * K, capacity=max_len + 1)
    stats = DecodeStats(sentences=B, encoder_calls=1)
    steps: list[list[Step]] | None = [[] for _ in range(B)] if trace else None

    scores = torch.full((B, K), float("-inf"), dtype=torch.float64, device=device)
    scores[:, 0] = 0.0  # at the start only one hypothesis ([bos]) is live
    prefixes = torch.zeros((B, K, 0), dtype=torch.long, device=device)  # (B, K, t)
    last = torch.full((B * K, 1), cfg.bos_id, dtype=torch.long, device=device)
    finished: list[list[tuple[float, torch.Tensor]]] = [[] for _ in range(B)]
    done = [False] * B

    for t in range(max_len):
        logits = model.decode(last, memory, cache)[:, -1].double()  # (B*K, V)
        logp = torch.log_softmax(logits, dim=-1)
        stats.verifier_calls += 1
        stats.committed.extend(1 for b in range(B) if not done[b])  # one token per live row per call
        V = logp.shape[-1]
        cand = (scores[:, :, None] + logp.view(B, K, V)).view(B, K * V)  # (B, K*V)
        n_cand = min(2 * K, K * V)
        # Best first; equal scores in the order of their logits, then of beam and token id (refdec.decoding.ties).
        top_idx = best_candidates(cand, n_cand, tiebreak=logits.reshape(B, K * V))  # (B, 2K)
        top_scores = cand.gather(1, top_idx)
        top_beam, top_tok = top_idx // V, top_idx % V
        is_eos = top_tok.eq(cfg.eos_id)

        # Finish eos candidates ranked among the top K (and live ones too at the last step).
        ends = is_eos.clone()
        ends[:, K:] = False
        for b, j in (ends & torch.isfinite(top_scores)).nonzero().tolist():
            if not done[b]:
                hyp = torch.cat([prefixes[b, top_beam[b, j]], top_tok[b, j : j + 1]])
                finished[b].append((top_scores[b, j].item() / (t + 1) ** length_penalty, hyp))

        # Keep the K best candidates that do not end in eos (stable: ties keep their rank order).
        rank = torch.arange(n_cand, device=device).expand(B, n_cand)
        order = (rank + is_eos.long() * n_cand).argsort(dim=-1)[:, :K]  # (B, K)
        scores = top_scores.gather(1, order)
        beam_of = top_beam.gather(1, order)
        tok = top_tok.gather(1, order)
        scores = scores.masked_fill(is_eos.gather(1, order), float("-inf"))  # fewer than K non-eos
        prefixes = torch.cat([prefixes.gather(1, beam_of[:, :, None].expand(-1, -1, t)), tok[:, :, None]], dim=2)
        cache.select((torch.arange(B, device=device)[:, None] * K + beam_of).view(-1))
        last = tok.view(B * K, 1)

        if steps is not None:
            for b in range(B):
                if not done[b]:
                    steps[b].append(
                        Step(beams=tuple(map(tuple, prefixes[b].tolist())), scores=tuple(scores[b].tolist()))
                    )
        for b in range(B):
            if not done[b] and len(finished[b]) >= K:
                done[b] = True
        if all(done):
            break

    best = []
    for b in range(B):
        if not done[b]:  # max_len reached: live hypotheses finish without eos
            n = prefixes.shape[2]
            for k in range(K):
                if torch.isfinite(scores[b, k]):
                    finished[b].append((scores[b, k].item() / max(n, 1) ** length_penalty, prefixes[b, k]))
        best.append(max(finished[b], key=lambda sh: sh[0])[1].tolist() if finished[b] else [])
    return result_of(best, cfg.eos_id, stats, steps, device)
