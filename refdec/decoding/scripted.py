"""The ceiling of draft-then-verify decoding (a measuring tool, no paper): GAD's loop whose draft is the
model's own greedy output, each drafted token kept with a given probability, so that a run shows
what a drafter that guesses that well would buy (`python -m refdec ceiling`, refdec.commands.ceiling).

    y = greedy(x)                                      the output a perfect drafter would propose
    repeat until eos:
        draft  = the next k tokens of y, each kept with probability `accept`
                 (the first one not kept is replaced by a wrong token, and the draft ends there)
        commit = verify(draft)                         the shared step: up to and including the bifurcation

The verification step is lossless, so the output is greedy's whatever the draft; only the number of
calls, and so the time, depends on it.
"""

from __future__ import annotations

import random

import torch

from ..drafter import draft_block
from ..model import Transformer
from .greedy import decode_greedy
from .pairing import Follower, small_memory
from .verify import verify


def greedy_output(model: Transformer, src: torch.Tensor, max_len: int) -> tuple[list[int], int]:
    """Greedy decoding of one sentence as the scripted loop returns it: the tokens with their eos
    (none when max_len stopped it), and the decoder calls."""
    res = decode_greedy(model, src, max_len=max_len)
    y = res.tokens[0].tolist()
    return (y + [model.cfg.eos_id] if len(y) < max_len else y), res.stats.verifier_calls


def scripted_draft(y: list[int], done: int, k: int, accept: float, rng: random.Random, vocab: int) -> list[int]:
    """The next k tokens of the known output y after `done` committed ones, each kept with
    probability `accept`; the first one not kept becomes another token (so the verifier refuses it)
    and the draft ends there."""
    draft = []
    for tok in y[done : done + k]:
        if rng.random() >= accept:
            draft.append((tok + 1) % vocab)
            break
        draft.append(tok)
    return draft


@torch.inference_mode()
def scripted_gad(
    model: Transformer,
    src: torch.Tensor,
    y: list[int],
    *,
    k: int,
    accept: float,
    max_len: int,
    rng: random.Random,
    drafter=None,
    layout: str = "causal",
    small=None,
) -> tuple[list[int], int]:
    """GAD's loop for one sentence (src (1, S)) with the scripted draft of y (y ends in eos).
    With `drafter`, it also drafts each iteration; with `small`, that autoregressive model takes a
    step per drafted token (their tokens unused: only their cost counts). Returns (output, calls)."""
    cfg = model.cfg
    memory = model.encode(src)
    if drafter is not None:
        mem_d = small_memory(model, drafter, memory, src)
        cache_d = drafter.new_cache(1, capacity=max_len + k + 1) if layout == "causal" else None
    if small is not None:
        follower = Follower(small, small_memory(model, small, memory, src), capacity=max_len + k + 2)
    cache = model.new_cache(1, capacity=max_len + 1)
    out: list[int] = []
    last, calls = cfg.bos_id, 0
    while len(out) < max_len and (not out or out[-1] != cfg.eos_id):
        if drafter is not None:
            draft_block(drafter, mem_d, cache_d, [cfg.bos_id] + out, k, layout)
        draft = scripted_draft(y, len(out), k, accept, rng, cfg.vocab_size)
        if small is not None:
            for i in range(len(draft)):
                follower.next_logits([[cfg.bos_id] + out + draft[:i]])
        v = verify(model, memory, cache, last, draft, budget=max_len - len(out), eos_id=cfg.eos_id)
        out += v.tokens
        last, calls = v.tokens[-1], calls + 1
    return out, calls
