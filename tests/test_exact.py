"""Exact by construction: one tie rule for every decoder, row-invariant compute, and the model's
weights, position table and construction mode."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_rows_equal, random_src, tiny_model

from refdec.commands.fuzz import FAMILIES, comparisons, draw_case, gadpp_rule_at_exact, make_family
from refdec.commands.fuzz import main as fuzz_main
from refdec.config import BOS_ID, EOS_ID, ModelConfig
from refdec.decoding import decode_beam, decode_gad, decode_greedy, decode_iad, ties
from refdec.decoding import gad as gad_module
from refdec.decoding.blockwise import accept_rule
from refdec.decoding.gad import gadpp_rule
from refdec.decoding.ties import best_candidates, rank
from refdec.drafter import Drafter
from refdec.model import Transformer, sinusoidal_positions
from refdec.routes import on_route
from refdec.routes.kernels import is_row_invariant

DTYPES = [torch.float32, torch.float64]


def twin_model(vocab: int = 8, a: int = 5, b: int = 7) -> Transformer:
    """d=16, 1+1 layers, untied, output rows a and b equal and a constant final state on that row:
    tokens a and b tie exactly for the argmax at every position (greedy writes a, a, a, ...)."""
    m = tiny_model(2, vocab=vocab, d_model=16, layers=(1, 1))
    with torch.no_grad():
        W = m.out_proj.weight
        W[a] *= 4
        W[b] = W[a]
        m.dec_norm.weight.zero_()
        m.dec_norm.bias.copy_(W[a])
    return m


def family_model(seed: int, family: str, dtype=torch.float64, vocab: int = 16) -> Transformer:
    return make_family(tiny_model(seed, vocab=vocab), family, torch.Generator().manual_seed(seed)).to(dtype)


def assert_tokens_equal(got, ref, what: str):
    assert_rows_equal(got, ref, what)


# -- one tie rule --------------------------------------------------------------------------------------
def test_beam_of_one_is_greedy_when_two_logits_tie_exactly():
    """Guards beam search's candidate order on exact ties (topk returns no particular index among
    equal values, here the higher; greedy's argmax the lowest): the twin model, source [5, 6, 7],
    max_len 6 (beam(1) wrote 7s), then exact-tie and constant-state families, one source at a time."""
    m = twin_model()
    src = torch.tensor([[5, 6, 7, EOS_ID]])
    g = decode_greedy(m, src, max_len=6)
    assert g.tokens[0].tolist() == [5] * 6
    assert_tokens_equal(decode_beam(m, src, max_len=6, beam_size=1).tokens, g.tokens, "twin model")
    for seed in range(4):
        for family in ("exact", "constant"):
            m = family_model(seed, family)
            for b in range(3):
                src = random_src(seed * 10 + b, 1, 16)
                ref = decode_greedy(m, src, max_len=15).tokens
                assert_tokens_equal(decode_beam(m, src, max_len=15, beam_size=1).tokens, ref, f"{family} {seed}")


def test_rank_and_best_candidates_put_the_lowest_id_first_among_ties():
    """Guards the tie rule itself: equal logits rank by id; equal scores keep their logits' order,
    then their index order."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0]])
    assert rank(logits.expand(5, 5), torch.arange(5)).tolist() == [4, 0, 3, 1, 2]
    scores = torch.tensor([[0.5, 0.9, 0.9, 0.9, 0.1]], dtype=torch.float64)
    assert best_candidates(scores, 2).tolist() == [[1, 2]]
    assert best_candidates(scores, 3, tiebreak=torch.tensor([[0.0, 1.0, 2.0, 2.0, 0.0]])).tolist() == [[2, 3, 1]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_two_pass_argmax_is_torch_argmax_ties_nan_and_infinities_included(dtype, monkeypatch):
    """Guards ties.argmax, greedy's and verification's token: bitwise torch.argmax's index on rows
    of many shapes, vocabularies that are and are not a multiple of its block, exact ties inside a
    block and across blocks (the lowest id wins), NaN (counted as the largest, the first one wins),
    rows of -inf and a maximum in the short last block. Every shape takes the two passes here
    (DIRECT 0); a vocabulary under two blocks takes torch.argmax itself."""
    monkeypatch.setattr(ties, "DIRECT", 0)
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 8000), (3, 2000), (600, 300), (40, 64 * 7 + 5), (2, 9, 1000), (5000, 20)]:
        for case in range(6):
            x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
            flat = x.view(-1, shape[-1])
            if case == 1:  # exact ties: a row's maximum copied to a few ids, before and after it
                for row in flat:
                    top = row.max()
                    row[torch.randint(0, shape[-1], (3,), generator=g)] = top
            elif case == 2:  # NaN in some rows, twice in one
                flat[::3, torch.randint(0, shape[-1], (2,), generator=g)] = float("nan")
            elif case == 3:  # rows of -inf, +inf ties
                flat[::2] = float("-inf")
                flat[1::2, ::7] = float("inf")
            elif case == 4:  # the maximum in the last ids (a short last block)
                flat[:, -1] = 100
            elif case == 5:  # few distinct values: ties everywhere
                flat.copy_(torch.randint(0, 3, flat.shape, generator=g).to(dtype))
            assert torch.equal(ties.argmax(x), x.argmax(dim=-1)), (shape, case)


def test_argmax_takes_its_two_passes_on_a_cpu_alone_and_both_paths_agree(monkeypatch):
    """Guards where ties.argmax takes its two passes: on a CPU for many logits (where they pay), never
    off it (a meta tensor stands in for a GPU's here: one torch.argmax, whose documented rule, the first
    of equal maxima, is the tie rule) nor for few logits; and the two paths give the same index on rows
    full of exact ties (NaN-free), within a block, across blocks and in a short last block."""
    taken = []

    def two_passes(x):
        taken.append(x.device.type)
        return x.argmax(dim=-1)

    with monkeypatch.context() as patched:
        patched.setattr(ties, "two_passes", two_passes)
        ties.argmax(torch.empty(600, 8000, device="meta"))
        ties.argmax(torch.zeros(2, 8000))  # under DIRECT logits
        assert taken == []
        ties.argmax(torch.zeros(600, 8000))
        assert taken == ["cpu"]
    g = torch.Generator().manual_seed(1)
    for shape in [(600, 8000), (300, 64 * 40 + 9), (1200, 130)]:
        x = torch.randint(0, 4, shape, generator=g).float()  # four distinct values: ties in every row
        x[::5, -3:] = 9  # the row's maximum in its short last block only
        assert x.numel() >= ties.DIRECT
        assert torch.equal(ties.argmax(x), torch.argmax(x, dim=-1)), shape
        assert torch.equal(ties.two_passes(x), torch.argmax(x, dim=-1)), shape


def test_gadpp_at_beta_1_tau_0_accepts_only_the_argmax_on_ties(monkeypatch):
    """Guards GAD++'s top-beta rule (and blockwise's top-k) on ties: a drafted token equal in logit
    to the argmax but with a higher id is not greedy's token, so top_beta 1 refuses it (topk put
    id 7 before id 5 here); GAD++(1, 0) with a drafter that always proposes the twin is GAD; and
    on models that tie at every position (row-invariant mode)."""
    logits = torch.zeros(2, 40, dtype=torch.float64)
    logits[:, 5] = logits[:, 7] = 1.0
    draft = torch.tensor([7, 5])
    assert gadpp_rule(1, 0.0)(logits, draft).tolist() == [False, True]
    assert gadpp_rule(2, 0.0)(logits, draft).tolist() == [True, True]
    assert accept_rule("top-k", top_k=1)(logits, draft).tolist() == [False, True]
    m = twin_model(vocab=40)
    src = random_src(0, 2, 40)
    monkeypatch.setattr(
        gad_module, "draft_blocks", lambda drafter, memory, cache, sequences, k, layout: [[7] * k for _ in sequences]
    )
    with gadpp_rule_at_exact():
        b = decode_gad(m, Drafter(m, k=3), src, max_len=8)
    assert_tokens_equal(b.tokens, decode_greedy(m, src, max_len=8).tokens, "gad++(1, 0), twin drafts")
    monkeypatch.undo()
    for seed in range(3):  # exact ties at every position: in row-invariant mode, where a verification call
        # computes bitwise what a step computes (on the reference route a q-row product and a one-row
        # product may round the two tied logits apart in different directions)
        verifier = on_route(family_model(seed, "constant"), "invariant")
        drafter = Drafter(on_route(family_model(seed + 7, "exact"), "invariant"), k=4)
        src = random_src(seed, 3, 16)
        a = decode_gad(verifier, drafter, src, max_len=12)
        with gadpp_rule_at_exact():
            b = decode_gad(verifier, drafter, src, max_len=12)
        assert_tokens_equal(a.tokens, decode_greedy(verifier, src, max_len=12).tokens, "gad")
        assert_tokens_equal(b.tokens, a.tokens, "gad++(1, 0)")


# -- row-invariant compute -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_positions_logits_are_bitwise_equal_across_call_shapes(dtype, family):
    """Guards row invariance: one token at a time, chunks of several tokens, another cache capacity,
    each source alone against the padded batch, and the uncached forward all give a position the
    same logits bit for bit (x[:n] @ W.T rounds row 0 differently for most n; a masked longer
    attention row sums more terms)."""
    m = on_route(family_model(3, family, dtype, vocab=40), "invariant")
    src = random_src(3, 3, 40)
    tgt = torch.cat(
        [torch.full((3, 1), BOS_ID), torch.randint(5, 40, (3, 20), generator=torch.Generator().manual_seed(3))], 1
    )
    with torch.inference_mode():
        mem = m.encode(src)
        cache = m.new_cache(3, capacity=2)
        ref = torch.cat([m.decode(tgt[:, t : t + 1], mem, cache) for t in range(21)], 1)
        for chunks in ([21], [3, 1, 5, 12], [2] * 10 + [1]):
            cache, at, pieces = m.new_cache(3, capacity=40), 0, []
            for c in chunks:
                pieces.append(m.decode(tgt[:, at : at + c], mem, cache))
                at += c
            assert torch.equal(torch.cat(pieces, 1), ref), chunks
        for b in range(3):
            alone = m.encode(src[b : b + 1, : int(src[b].ne(0).sum())])
            assert torch.equal(m.decode(tgt[b : b + 1], alone, m.new_cache(1)), ref[b : b + 1]), b
        assert torch.equal(m(src, tgt), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_iad_equals_greedy_on_twin_rows_in_invariant_mode(dtype):
    """Guards the case where a verification call over many tokens and a one-token step rounded a
    position differently and IAD took the other twin: in row-invariant mode never, float32 and float64."""
    for seed in range(4):
        m = on_route(family_model(seed, "exact", dtype, vocab=12), "invariant")
        src = random_src(seed, 4, 12)
        ref = decode_greedy(m, src, max_len=20).tokens
        for match in ("unique", "longest"):
            assert_tokens_equal(decode_iad(m, src, max_len=20, match=match).tokens, ref, f"seed {seed} {match}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(3))
def test_invariant_mode_lossless_decoders_equal_greedy(dtype, family, seed):
    """Guards every lossless decoder in row-invariant mode (batched greedy, beam(1), IAD, GAD,
    GAD++(1, 0), exact blockwise, greedy speculative, BiLD falling back at every step and BiLD with
    the large model as its own small model) against greedy with torch.equal, on random models and on
    exact-tie, near-tie (1e-16) and constant-state families: a slice of `python -m refdec fuzz`."""
    case = draw_case(1000 + seed, dtype, family)
    for name, got, ref in comparisons(case):
        assert_tokens_equal(got, ref, name)


def test_fuzz_command_counts_and_reports(capsys):
    """Guards refdec.commands.fuzz's report: comparisons per decoder, and exit status 0 without mismatches."""
    assert fuzz_main(["--models", "2", "--dtype", "float32", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "2 models" in out and "row-invariant mode" in out and "0 mismatches" in out


def test_the_mode_wraps_one_model_and_leaves_it_as_it_is():
    """Guards the mode's wrapper: its layers are objects of their own holding the model's parameters
    (the same weights, now and after a change), the model itself keeps computing as model.py reads."""
    a = tiny_model(1)
    src = random_src(1, 2, 40)
    tgt = torch.tensor([[BOS_ID, 7, 8, 9, 10]] * 2)
    with torch.inference_mode():
        before = a(src, tgt)
        inv = on_route(a, "invariant")
        assert is_row_invariant(inv) and not is_row_invariant(a) and inv is not a
        assert (
            type(a.decoder[0].ff.w1) is torch.nn.Linear
            and inv.twin.decoder[0].ff.w1.weight is a.decoder[0].ff.w1.weight
        )
        torch.testing.assert_close(inv(src, tgt), before, rtol=1e-12, atol=1e-12)
        assert torch.equal(a(src, tgt), before)
    with torch.no_grad():
        a.out_proj.weight.mul_(2)
        a.decoder[0].ff.w1.weight.data = a.decoder[0].ff.w1.weight.data * 3
    with torch.inference_mode():
        torch.testing.assert_close(inv(src, tgt), a(src, tgt), rtol=1e-12, atol=1e-12)


# -- weights, position table, construction mode --------------------------------------------------------
def step_logits(m: Transformer, src: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return m.decode(torch.tensor([[BOS_ID]]), m.encode(src), m.new_cache(1))


@pytest.mark.parametrize("tie", [False, True])
def test_decoding_follows_data_writes_and_fused_optimizer_steps(tie):
    """Guards the reference route against any kept copy of the weights: `.data` writes and a fused
    Adam step bump no version counter, yet the next step must use the new weights (the fast and int8
    routes' copies: tests/test_fast.py, tests/test_int8.py)."""
    m = tiny_model(0, vocab=12, tie=tie)
    src = random_src(0, 1, 12)
    decode_greedy(m, src, max_len=5)  # decode once with the old weights
    W = m.tgt_embed.weight if tie else m.out_proj.weight
    W.data.copy_(W.data.flip(0))
    assert torch.equal(step_logits(m, src), step_logits(copy.deepcopy(m), src))
    assert_tokens_equal(
        decode_greedy(m, src, max_len=8).tokens, decode_greedy(copy.deepcopy(m), src, max_len=8).tokens, ".data"
    )
    opt = torch.optim.Adam(m.parameters(), lr=0.5, fused=True)
    m.train()
    m(src, torch.tensor([[BOS_ID, 5, 6]])).sum().backward()
    opt.step()
    m.eval()
    assert torch.equal(step_logits(m, src), step_logits(copy.deepcopy(m), src))


def test_float64_position_table_is_exact():
    """Guards the sinusoid table in float64: computed in float64, not float32 values cast up (about
    3e-8 off), after .double(), .float().double() and .to(dtype)."""
    m = tiny_model(0)
    exact = sinusoidal_positions(m.cfg.max_positions, m.cfg.d_model)
    assert m.positions.dtype == torch.float64 and torch.equal(m.positions, exact)
    assert torch.equal(m.float().positions, exact.float())
    assert torch.equal(m.double().positions, exact)
    assert torch.equal(m.to(torch.float32).to(torch.float64).positions, exact)


ROUTE_OF = {
    "reference": lambda m: m,
    "invariant": lambda m: on_route(m, "invariant"),
    "fast": lambda m: on_route(m, "fast"),
    "graphed": lambda m: on_route(m, "graphed"),
    "int8": lambda m: on_route(m, "reference", int8=True),
    "fast-int8": lambda m: on_route(m, "fast", int8=True),
}


@pytest.mark.parametrize("route", list(ROUTE_OF))
def test_a_model_built_under_inference_mode_decodes(route):
    """Guards construction under torch.inference_mode() (its tensors have no version counter, and
    may not be given new data): the model decodes on every route, and gives the logits and tokens of
    the same weights built normally."""
    cfg = ModelConfig(vocab_size=12, d_model=16, n_heads=2, d_ff=32, enc_layers=1, dec_layers=1, tie_embeddings=False)
    normal = Transformer(cfg).eval()
    with torch.inference_mode():
        built = Transformer(cfg).eval()
        built.load_state_dict(normal.state_dict())
    built, normal = ROUTE_OF[route](built), ROUTE_OF[route](normal)
    src = random_src(1, 2, 12)
    assert torch.equal(step_logits(built, src[:1]), step_logits(normal, src[:1]))
    assert_tokens_equal(
        decode_greedy(built, src, max_len=6).tokens, decode_greedy(normal, src, max_len=6).tokens, "greedy"
    )
    assert_tokens_equal(decode_iad(built, src, max_len=6).tokens, decode_greedy(normal, src, max_len=6).tokens, "iad")
