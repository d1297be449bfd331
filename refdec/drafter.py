"""The non-autoregressive block drafter of generalized aggressive decoding (GAD; Ge et al. 2022,
section 3.2): an encoder-decoder whose decoder input is the verified prefix followed by k mask
tokens, and which fills in all k masks at once.

    input     bos  o_1 .. o_j  <mask> x k
    predicts                   o~_(j+1) .. o~_(j+k)      argmax at each mask position, in parallel

It is a refdec Transformer; what makes it a drafter is the self-attention mask and the training
objective (the paper's L_NAR: a random prefix length p per sentence, cross-entropy on the k mask
positions only). The mask token is its own id (MASK_ID), never unk. Two attention layouts:

    bidirectional   the paper's: every position sees every position. The prefix's states depend on
                    the masks, so each iteration recomputes the whole prefix (its table 15 names
                    this the part to improve).
    causal          prefix positions attend causally, as in an autoregressive decoder, so their keys
                    and values are cached across iterations; the mask positions see the prefix and
                    each other. Each iteration feeds only the newly verified tokens and the masks.

Glancing training (GLAT, Qian et al. 2021), restricted to the block: a first pass without gradient
predicts the block; with N of its tokens wrong, ceil(ratio * N) gold tokens are revealed at random
mask positions; the loss is taken on the positions still masked. The ratio decays linearly over
training (`glancing_ratio`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import KVCache, Memory
from .config import BOS_ID, DRAFTER_LAYOUTS, EOS_ID, MASK_ID, PAD_ID
from .model import Transformer


@dataclass(frozen=True)
class Drafter:
    """A trained block drafter as GAD runs it: the Transformer, the block size k it was trained for
    and its attention layout, as its checkpoint records them (train.py --drafter-k, --drafter-layout;
    refdec.app.loading builds one from the checkpoint's "drafter" entry)."""

    model: Transformer
    k: int
    layout: str = "causal"

    def __post_init__(self) -> None:
        if self.layout not in DRAFTER_LAYOUTS:
            raise ValueError(f"unknown drafter layout {self.layout!r}; choose {' or '.join(DRAFTER_LAYOUTS)}")
        if self.k < 1:
            raise ValueError(f"a drafter's block size k must be at least 1, not {self.k}")


def block_batch(targets: list[list[int]], k: int, prefix_lens: list[int], layout: str):
    """Drafter training inputs for sentences with target ids `targets` (without bos/eos).

    Row r is bos + y[:p] + k masks, to predict (y + [eos])[p : p + k] at the masks (pad where the
    sentence has ended: no loss there). Returns (inp (B, T), gold (B, T) with PAD off the block,
    self_block (B, 1, T, T) True = blocked)."""
    if layout not in DRAFTER_LAYOUTS:
        raise ValueError(f"unknown drafter layout {layout!r}; choose {' or '.join(DRAFTER_LAYOUTS)}")
    B = len(targets)
    T = max(1 + p + k for p in prefix_lens)
    inp = torch.full((B, T), PAD_ID, dtype=torch.long)
    gold = torch.full((B, T), PAD_ID, dtype=torch.long)
    blocked = torch.ones(B, T, T, dtype=torch.bool)
    for r, (y, p) in enumerate(zip(targets, prefix_lens)):
        n = 1 + p + k
        inp[r, :n] = torch.tensor([BOS_ID] + y[:p] + [MASK_ID] * k)
        block = (y + [EOS_ID])[p : p + k]
        gold[r, 1 + p : 1 + p + len(block)] = torch.tensor(block, dtype=torch.long)
        if layout == "bidirectional":
            blocked[r, :n, :n] = False
        else:
            i = torch.arange(n)
            blocked[r, :n, :n] = i[None, :] > i[:, None]  # causal prefix
            blocked[r, 1 + p : n, :n] = False  # the masks see everything
        blocked[r, n:, 0] = False  # padding rows: attend to something (their output is ignored)
    return inp, gold, blocked[:, None]


def glance(
    inp: torch.Tensor, gold: torch.Tensor, pred: torch.Tensor, ratio: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reveal ceil(ratio x wrong) gold tokens per row at random block positions.

    Returns (new input, loss targets): revealed positions carry the gold token in the input and PAD
    (no loss) in the targets."""
    device = inp.device
    in_block = gold.ne(PAD_ID).cpu()  # chosen on the CPU in one pass: no per-row device round trips
    wrong = (pred.ne(gold).cpu() & in_block).sum(dim=1)
    n = torch.ceil(torch.tensor(ratio, dtype=torch.float64) * wrong.double()).long()  # as math.ceil would
    keys = torch.rand(in_block.shape, generator=generator).masked_fill(~in_block, 2.0)  # off-block sorts last
    rank = keys.argsort(dim=1).argsort(dim=1)  # each block position's place in a random order of its row
    reveal = ((rank < n[:, None]) & in_block).to(device)
    return torch.where(reveal, gold, inp), gold.masked_fill(reveal, PAD_ID)


def glancing_ratio(step: int, start: float, end: float, decay_steps: int) -> float:
    """Linear decay from `start` to `end` over `decay_steps` updates, then constant."""
    if decay_steps <= 0:
        return end
    return start + (end - start) * min(step / decay_steps, 1.0)


def draft_block(
    drafter: Transformer, memory: Memory, cache: KVCache | None, sequence: list[int], k: int, layout: str
) -> list[int]:
    """The drafter's k tokens after `sequence` (bos + verified output), argmax at each mask; fewer
    (none at all) where the drafter's positions end: `draft_blocks` for one row."""
    return draft_blocks(drafter, memory, cache, [sequence], k, layout)[0]


def draft_blocks(
    drafter: Transformer, memory: Memory, cache: KVCache | None, sequences: list[list[int]], k: int, layout: str
) -> list[list[int]]:
    """draft_block for every batch row of memory (and cache) in one drafter call: row b drafts after
    sequences[b]. Rows of different lengths are right-padded; each row's block of masks is open
    within the row only (its padding stays out), and only real positions are read.

    causal: `cache` holds a prefix of each row's sequence; the missing tokens and the masks go in one
    call, and each row's cache is cut back to its whole sequence afterwards (the masks never stay).
    bidirectional: `cache` is ignored; the whole sequences and the masks are recomputed."""
    device = memory.states.device
    limit = drafter.cfg.max_positions - len(drafter.cfg.decoder_prefix)  # the forced tokens take hidden positions
    ks = [max(0, min(k, limit - len(s))) for s in sequences]
    if max(ks) == 0:
        return [[] for _ in sequences]
    if layout == "causal":
        have = cache.lengths.tolist()
        todo = [s[n:limit] for s, n in zip(sequences, have)]  # a row out of positions drafts nothing
    else:
        todo = [s[:limit] for s in sequences]
        cache = drafter.new_cache(len(sequences), capacity=max(map(len, todo)) + k)
    real = [len(t) + n for t, n in zip(todo, ks)]
    width = max(real)
    inp = torch.tensor([t + [MASK_ID] * n + [PAD_ID] * (width - r) for t, n, r in zip(todo, ks, real)], device=device)
    if len(sequences) == 1:
        hidden = drafter.decode_hidden(inp, memory, cache, open_from=len(todo[0]))
    else:
        hidden = drafter.decode_hidden(
            inp,
            memory,
            cache,
            open_from=torch.tensor([len(t) for t in todo], device=device),
            real=torch.tensor(real, device=device),
        )
    if layout == "causal":
        kept = [min(len(s), limit) for s in sequences]
        cache.truncate(kept[0] if len(kept) == 1 else kept)
    rows = torch.cat([torch.full((n,), b) for b, n in enumerate(ks)]).to(device)
    cols = torch.cat([torch.arange(len(t), len(t) + n) for t, n in zip(todo, ks)]).to(device)
    picked = drafter.project(hidden[rows, cols][None])[0].argmax(dim=-1).tolist()  # every row's masks, in order
    out, at = [], 0
    for n in ks:
        out.append(picked[at : at + n])
        at += n
    return out
