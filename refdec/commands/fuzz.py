"""Every lossless decoder in row-invariant mode against greedy decoding, on random tiny models and on
model families built to tie.

    python -m refdec fuzz --models 1200 --dtype float64
    python -m refdec fuzz --models 1200 --dtype float32 --seed 1

Each drawn model (a family below, a random shape: vocabulary 8-24, width 8-24, 1-2 layers each
side, pre- or post-norm, tied or not) decodes a batch of 1-3 random sources with a random max_len,
all models in row-invariant mode (refdec.routes.on_route(model, "invariant"); --default-mode: without it).
Greedy decoding of the batch is the reference; each comparison is one decoder with random
options against it, on one source row, by torch.equal:

    batched greedy  each row decoded alone (no padding), against the batch
    beam(1)         beam search of width 1 on the batch
    iad             a random match policy, max_draft and max_suffix
    gad, gad++      a random drafter, block size and layout; GAD++ at top_beta 1, tau 0
    blockwise       exact rule, random proposal heads, random block size
    speculative     greedy form, a random small model, random gamma
    bild            falling back at every step (threshold above 1); and with the large model as its
                    own small model accepting every token (what the large model wrote one token at
                    a time must equal what it verifies in one call)

Families: random (no planned ties); exact (half the output rows copied onto the others, so a token
ties exactly with its twin wherever either is the argmax); near (the copies perturbed by 1e-16:
float64 near-ties, exact ties once rounded to float32); constant (exact twins and a final norm of
scale 0, so every position has the same logits and the same tie).

--device cuda runs the models and decoders on a GPU (the models are drawn on the CPU, so a seed gives
the same case on either device).

Prints the comparisons per decoder and family and every mismatch; exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from contextlib import contextmanager

import torch

from ..config import DRAFTER_LAYOUTS, EOS_ID, PAD_ID, ModelConfig
from ..errors import UsageError, run_command
from ..machine import device_name
from ..model import Transformer
from ..progress import ProgressLine
from ..routes import on_route
from ..timing import clock
from .harness import command_parser, machine_options, set_up_machine

FAMILIES = ("random", "exact", "near", "constant")


def random_model(
    g: torch.Generator, vocab: int, *, d_model: int, n_heads: int, layers: tuple[int, int], norm_first: bool, tie: bool
) -> Transformer:
    """A float64 model in eval mode with spread-out output rows (greedy outputs vary), drawn from `g`."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    m = Transformer(
        ModelConfig(
            vocab_size=vocab,
            d_model=d_model,
            n_heads=n_heads,
            d_ff=2 * d_model,
            enc_layers=layers[0],
            dec_layers=layers[1],
            dropout=0.0,
            norm_first=norm_first,
            tie_embeddings=tie,
            max_positions=64,
        )
    )
    with torch.no_grad():
        m.tgt_embed.weight.normal_(0, 1)
        if not tie:
            m.out_proj.weight.normal_(0, 0.6)
    return m.double().eval()


def output_rows(model: Transformer) -> torch.Tensor:
    """The (V, D) output projection (the embedding when tied)."""
    return model.tgt_embed.weight if model.out_proj is None else model.out_proj.weight


def make_family(model: Transformer, family: str, g: torch.Generator) -> Transformer:
    """Turn a random float64 model into one of FAMILIES (in place; returns it)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    if family == "random":
        return model
    W = output_rows(model)
    V = W.shape[0]
    perm = torch.randperm(V, generator=g)
    half = V // 2
    with torch.no_grad():
        W[perm[half : 2 * half]] = W[perm[:half]]  # each of these tokens gets a twin with the same row
        if family == "near":
            W[perm[half : 2 * half]] += 1e-16 * torch.randn(half, W.shape[1], generator=g, dtype=W.dtype)
        if family == "constant":  # a final norm of scale 0: every final state is its bias
            norm = model.dec_norm if model.cfg.norm_first else model.decoder[-1].sub3.norm
            norm.weight.zero_()
            norm.bias.copy_(torch.randn(norm.bias.shape, generator=g, dtype=norm.bias.dtype))
    return model


def random_sources(g: torch.Generator, batch: int, vocab: int, max_len: int = 8) -> torch.Tensor:
    """(B, S) right-padded sources of 1..max_len tokens from the real vocabulary (ids >= 5), each ending in eos."""
    rows = [
        torch.randint(5, vocab, (int(torch.randint(1, max_len + 1, (1,), generator=g)),), generator=g).tolist()
        + [EOS_ID]
        for _ in range(batch)
    ]
    out = torch.full((batch, max(map(len, rows))), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def random_choice(g: torch.Generator, options):
    return options[int(torch.randint(0, len(options), (1,), generator=g))]


def draw_case(
    seed: int, dtype: torch.dtype, family: str | None = None, invariant: bool = True, device: torch.device | str = "cpu"
) -> dict:
    """One fuzz case: a large model of `family` (random when None), a small model, a drafter,
    proposal heads, sources and a max_len, all from `seed`, in `dtype` on `device`, in row-invariant
    mode unless `invariant` is False."""
    from ..proposal import ProposalHeads

    g = torch.Generator().manual_seed(seed)
    family = family or random_choice(g, FAMILIES)
    vocab = int(torch.randint(8, 25, (1,), generator=g))
    d_model, n_heads = random_choice(g, [(8, 2), (12, 3), (16, 4), (20, 2), (24, 4)])
    norm_first = bool(torch.rand(1, generator=g) < 0.7)
    shape = dict(d_model=d_model, n_heads=n_heads, norm_first=norm_first)
    large = random_model(
        g,
        vocab,
        layers=(random_choice(g, [1, 2]), random_choice(g, [1, 2])),
        tie=bool(torch.rand(1, generator=g) < 0.3),
        **shape,
    )
    make_family(large, family, g)
    small = random_model(g, vocab, d_model=8, n_heads=2, layers=(1, 1), norm_first=True, tie=False)
    drafter = random_model(g, vocab, d_model=8, n_heads=2, layers=(1, 1), norm_first=True, tie=False)
    k = int(torch.randint(2, 6, (1,), generator=g))
    torch.manual_seed(seed)
    heads = ProposalHeads(d_model, 8, k)
    with torch.no_grad():
        heads.w2.weight.normal_(0, 0.5)
        heads.w2.bias.normal_(0, 0.5)
    models = [m.to(device=device, dtype=dtype) for m in (large, small, drafter, heads.double().eval())]
    if invariant:
        models = [on_route(m, "invariant") for m in models]
    return {
        "seed": seed,
        "family": family,
        "large": models[0],
        "small": models[1],
        "drafter": models[2],
        "heads": models[3],
        "src": random_sources(g, int(torch.randint(1, 4, (1,), generator=g)), vocab).to(device),
        "max_len": int(torch.randint(1, 13, (1,), generator=g)),
        "g": g,
    }


def comparisons(case: dict):
    """Yield (decoder label, its tokens, greedy's tokens) for every lossless decoder on `case`."""
    from ..decoding import (
        decode_beam,
        decode_bild,
        decode_blockwise,
        decode_gad,
        decode_greedy,
        decode_iad,
        decode_speculative,
    )
    from ..decoding.iad import MATCH_POLICIES
    from ..drafter import Drafter

    large, src, max_len, g = case["large"], case["src"], case["max_len"], case["g"]
    ref = decode_greedy(large, src, max_len=max_len).tokens
    alone = [
        decode_greedy(large, src[b : b + 1, : int(src[b].ne(PAD_ID).sum())], max_len=max_len).tokens[0]
        for b in range(len(src))
    ]
    yield "batched greedy", alone, ref
    yield "beam(1)", decode_beam(large, src, max_len=max_len, beam_size=1).tokens, ref
    knobs = dict(
        match=random_choice(g, MATCH_POLICIES),
        max_draft=random_choice(g, [0, 1, 3]),
        max_suffix=random_choice(g, [0, 2]),
    )
    yield "iad", decode_iad(large, src, max_len=max_len, **knobs).tokens, ref
    drafter = Drafter(
        case["drafter"], k=int(torch.randint(1, 7, (1,), generator=g)), layout=random_choice(g, DRAFTER_LAYOUTS)
    )
    yield "gad", decode_gad(large, drafter, src, max_len=max_len).tokens, ref
    with gadpp_rule_at_exact():
        relaxed = decode_gad(large, drafter, src, max_len=max_len).tokens
    yield "gad++(1, 0)", relaxed, ref
    block = int(torch.randint(2, case["heads"].k + 1, (1,), generator=g))
    yield "blockwise", decode_blockwise(large, case["heads"], src, max_len=max_len, block_size=block).tokens, ref
    gamma = int(torch.randint(1, 5, (1,), generator=g))
    yield "speculative", decode_speculative(large, case["small"], src, max_len=max_len, gamma=gamma).tokens, ref
    yield "bild", decode_bild(large, case["small"], src, max_len=max_len, fallback_threshold=1.5).tokens, ref
    yield (
        "bild(self)",
        decode_bild(
            large,
            large,
            src,
            max_len=max_len,
            fallback_threshold=0.0,
            rollback_threshold=1e9,
            max_window=int(torch.randint(1, 6, (1,), generator=g)),
        ).tokens,
        ref,
    )


@contextmanager
def gadpp_rule_at_exact():
    """Within: decode_gad verifies through GAD++'s acceptance test at top_beta 1 and tau 0, which it
    otherwise replaces by argmax equality; the two must agree, ties included. (Every Rows.verify call
    within takes that test: only decode_gad is run within.)"""
    from ..decoding import gad, rows

    real = rows.verify_rows

    def with_rule(*args, accept=None, **kwargs):
        return real(*args, accept=gad.gadpp_rule(1, 0.0), **kwargs)

    rows.verify_rows = with_rule
    try:
        yield
    finally:
        rows.verify_rows = real


def main(argv: list[str] | None = None) -> int:
    p = command_parser(__doc__, "fuzz")
    p.add_argument("--models", type=int, default=200, help="cases (drawn models) to run (default 200)")
    p.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0, help="first case's seed; case i uses seed + i (default 0)")
    p.add_argument("--family", choices=FAMILIES, help="only this family (default: each case draws one)")
    machine_options(p, threads=1, timed="the time printed is read after a device synchronisation")
    p.add_argument(
        "--default-mode",
        action="store_true",
        help="run the models in the default mode instead (its mismatches on ties are what row-invariant mode removes)",
    )
    return run_command(lambda: run(p.parse_args(argv)))


def run(args: argparse.Namespace) -> int:
    if args.models < 1 or args.threads < 1:
        raise UsageError("--models and --threads must be at least 1")
    device = set_up_machine(args)
    dtype = getattr(torch, args.dtype)
    counts: Counter = Counter()
    families: Counter = Counter()
    mismatches = []
    t0 = clock(device)
    progress = ProgressLine(args.models, "models")
    for i in range(args.models):
        progress.update(i)
        case = draw_case(args.seed + i, dtype, args.family, invariant=not args.default_mode, device=device)
        families[case["family"]] += 1
        for name, got, ref in comparisons(case):
            for b, (x, y) in enumerate(zip(got, ref)):
                counts[name] += 1
                if not torch.equal(x, y):
                    mismatches.append(
                        f"seed {case['seed']} ({case['family']}) {name} row {b}: {x.tolist()} vs greedy {y.tolist()}"
                    )
    seconds = clock(device) - t0
    total = sum(counts.values())
    print(
        f"{args.models} models ({', '.join(f'{f} {n}' for f, n in sorted(families.items()))}), {args.dtype}, "
        f"{'default' if args.default_mode else 'row-invariant'} mode, "
        f"seeds {args.seed}..{args.seed + args.models - 1}, "
        f"{device_name(device)}, {seconds:.0f} s"
    )
    print(
        f"{total} comparisons with greedy (one per decoder and source row): "
        + ", ".join(f"{name} {n}" for name, n in counts.items())
    )
    print(f"{len(mismatches)} mismatches")
    for line in mismatches:
        print("  " + line)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
