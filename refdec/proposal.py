"""The proposal layer of blockwise parallel decoding (Stern, Shazeer, Uszkoreit 2018, section 6 and
figure 3): the combined scoring and proposal model.

    h = the decoder's final state at one position                      (D)
    f(h) = W2 relu(W1 h + b1) + b2                                      hidden (k-1) x d_ff, output (k-1) x D
    out_1 = h                 (p_1: the base model itself)
    out_i = h + f(h)[i-1]     (p_2 .. p_k: a residual from the input to each output)
    p_i = softmax(out_i @ E^T), the model's own vocabulary projection E applied to every output

The paper passes every output, out_1 included, through the learned layer, so its BLEU with frozen
base parameters varies slightly with k (its footnote 1). refdec takes the identity for p_1, which
the footnote offers: with the base frozen, p_1 is the base model exactly and blockwise decoding in
exact mode reproduces the base model's greedy output, whatever the heads learned. The layer's
hidden and output widths therefore count k - 1 heads, not k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import PAD_ID


class ProposalHeads(nn.Module):
    """k - 1 proposal heads over a Transformer's final decoder states."""

    def __init__(self, d_model: int, d_ff: int, k: int):
        super().__init__()
        if k < 2:
            raise ValueError(f"blockwise decoding needs k >= 2 (got k={k}): head 1 is the base model")
        self.k, self.d_model, self.d_ff = k, d_model, d_ff
        self.w1 = nn.Linear(d_model, (k - 1) * d_ff)
        self.w2 = nn.Linear((k - 1) * d_ff, (k - 1) * d_model)
        nn.init.zeros_(self.w2.weight)  # start every head as a copy of p_1; training moves them apart
        nn.init.zeros_(self.w2.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., D) -> (..., k, D): out_1 = h, out_i = h + f(h)_i."""
        lead = h.shape[:-1]
        f = self.w2(F.relu(self.w1(h))).view(*lead, self.k - 1, self.d_model)
        return torch.cat([h.unsqueeze(-2), h.unsqueeze(-2) + f], dim=-2)

    def config(self) -> dict:
        return {"d_model": self.d_model, "d_ff": self.d_ff, "k": self.k}


def head_targets(tgt_out: torch.Tensor, i: int) -> torch.Tensor:
    """Targets of head i (1-based) for teacher-forced positions: position t predicts tgt_out[t + i - 1],
    the token i steps ahead; the last i - 1 positions have none (pad, ignored by the loss)."""
    if i == 1:
        return tgt_out
    out = tgt_out.new_full(tgt_out.shape, PAD_ID)  # targets shorter than i - 1 tokens: all pad
    out[:, : max(tgt_out.shape[1] - (i - 1), 0)] = tgt_out[:, i - 1 :]
    return out


def head_logits(model, heads: ProposalHeads, hidden: torch.Tensor, i: int) -> torch.Tensor:
    """(B, T, D) final decoder states -> (B, T, V) logits of head i (1-based) through the model's projection."""
    if i == 1:
        return model.project(hidden)
    lead = hidden.shape[:-1]
    f = heads.w2(F.relu(heads.w1(hidden))).view(*lead, heads.k - 1, heads.d_model)[..., i - 2, :]
    return model.project(hidden + f)


def proposal_state(heads: ProposalHeads, half: bool = False) -> dict:
    """What a checkpoint stores of the heads: their shape and weights."""
    state = {
        k: (v.detach().to("cpu", copy=True).half() if half else v.detach().to("cpu", copy=True))
        for k, v in heads.state_dict().items()
    }
    return {"config": heads.config(), "state": state}


def load_proposal(checkpoint: dict, device="cpu", dtype=torch.float32) -> ProposalHeads | None:
    """The heads stored in a checkpoint (eval mode), or None for a plain model."""
    entry = checkpoint.get("proposal")
    if entry is None:
        return None
    heads = ProposalHeads(**entry["config"])
    heads.load_state_dict({k: v.float() for k, v in entry["state"].items()})
    return heads.to(device=device, dtype=dtype).eval()
