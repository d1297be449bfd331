"""The verification step and the decoders' draft-and-commit lines against the one-line changes a
reader would try on them: tests whose expected values are worked out by hand, so that a change
that keeps the output exact but breaks the algorithm still fails.

Every lossless decoder's output is guarded by comparisons with greedy decoding; those comparisons
cannot see a change that only costs calls (a draft compared one position off, proposals read from
the wrong decoder state, a row given another row's draft), because verification keeps the output
greedy's whatever is drafted. Here the drafts are known exactly (scripted proposal heads and
drafters that know each row's greedy output), and the tests check what each call committed, which
decoder state the heads read, each row's cache length and states, and the token taken at the
bifurcation. The rules the decoders decide by are worked out the same way: IAD's match of the
output in its source, BiLD's fallback and rollback (a scripted small model beside the real large
one), and speculative sampling's acceptance and residual at one position, whose emitted
probabilities are computed in closed form and must be the large model's exactly.
docs/algorithms.md ("Which test catches which mutation") lists the changes tried and the tests that
fail on each. Tiny float64 models; about a second in all.
"""

from __future__ import annotations

import functools

import torch
from conftest import alone, batch1_greedy, random_src, tiny_model

from refdec.config import BOS_ID, EOS_ID, PAD_ID
from refdec.decoding import decode_gad, decode_iad, decode_speculative
from refdec.decoding import gad as gad_module
from refdec.decoding.blockwise import decode_blockwise
from refdec.decoding.verify import accept_row, verify, verify_rows
from refdec.drafter import Drafter

MAX_LEN = 12


@functools.cache
def verifier():
    """A random float64 model (vocabulary 40 <= d_model 48, so every token has a state that projects
    to it alone) whose greedy outputs for SOURCE_ROWS repeat no token within MAX_LEN."""
    return tiny_model(8, vocab=40, d_model=48)


SOURCE_ROWS = [3, 4, 1, 5]  # of random_src(8, 6, 40): row 3's output ends in eos after 10 tokens


def sources() -> torch.Tensor:
    return random_src(8, 6, 40)[SOURCE_ROWS]


@functools.cache
def references() -> list[list[int]]:
    """Each source's greedy output as its decoder commits it: eos included where greedy wrote one."""
    outs = [t.tolist() for t in batch1_greedy(verifier(), sources(), MAX_LEN)]
    refs = [out + [EOS_ID] if len(out) < MAX_LEN else out for out in outs]
    assert [len(r) for r in refs] == [11, 12, 12, 12] and refs[0][-1] == EOS_ID
    assert all(len(set(r)) == len(r) for r in refs), "every proposal at a position should be its own token"
    return refs


def states(model, src_row: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """(1 + len(tokens), D) final decoder states of bos + tokens teacher-forced on one source row:
    row t is the state fed token t (0: bos), the one whose p_1 predicts token t + 1."""
    return model.forward_hidden(src_row, torch.tensor([[BOS_ID] + tokens]))[0]


def wrong(token: int) -> int:
    """A token that is not `token`: what a scripted draft puts where it is to be rejected."""
    return (token + 1) % verifier().cfg.vocab_size


class ScriptedHeads(torch.nn.Module):
    """Proposal heads that know each row's greedy output y_1 y_2 .. (refs[b]) and read the position
    from the decoder state: at the state fed y_t of row b (t = 0: bos), head i (2 .. k) proposes
    y_(t+i), the token i steps ahead, as trained heads aim to, except at the positions in
    misses[b], where it proposes another token; past the end of the output it proposes pad. A state
    that is no greedy state of any row (a position fed a rejected token) gets pad from every head.
    `reads` records, per call, the (row, t) of each state the heads were given (None: no greedy state).

    Each proposal is emitted as a vector the model projects to that token alone (10 at the token,
    0 elsewhere): the model's vocabulary is no larger than its width."""

    def __init__(self, model, srcs: torch.Tensor, refs: list[list[int]], misses: list[set[int]], k: int):
        super().__init__()
        self.k, self.refs, self.misses = k, refs, misses
        W = model.out_proj.weight  # (V, D)
        self.vectors = (torch.linalg.pinv(W) @ (10 * torch.eye(W.shape[0], dtype=W.dtype))).T  # (V, D)
        assert torch.equal(model.project(self.vectors[None])[0].argmax(-1), torch.arange(W.shape[0]))
        self.table = [
            (b, t, s) for b, ref in enumerate(refs) for t, s in enumerate(states(model, alone(srcs, b), ref[:-1]))
        ]
        self.reads: list[list[tuple[int, int] | None]] = []

    def locate(self, h: torch.Tensor) -> tuple[int, int] | None:
        b, t, s = min(self.table, key=lambda e: float((e[2] - h).norm()))
        return (b, t) if float((s - h).norm()) < 1e-7 else None

    def proposal(self, b: int, q: int) -> int:
        """Row b's proposal for output position q (1-based)."""
        ref = self.refs[b]
        if q > len(ref):
            return PAD_ID
        return wrong(ref[q - 1]) if q in self.misses[b] else ref[q - 1]

    def proposals(self, b: int, t: int) -> tuple[int, ...]:
        return tuple(self.proposal(b, t + i) for i in range(2, self.k + 1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (n, 1, D) -> (n, 1, k, D): out_1 = h, then one vector per proposal."""
        out, read = [], []
        for state in h[:, 0]:
            where = self.locate(state)
            read.append(where)
            props = self.proposals(*where) if where else (PAD_ID,) * (self.k - 1)
            out.append(torch.cat([state[None], self.vectors[list(props)]]))
        self.reads.append(read)
        return torch.stack(out)[:, None]


def committed(trace) -> list[int]:
    """The number of tokens each call committed, from one row's trace."""
    return [len(step.committed) for step in trace]


# -- the acceptance of one row: accept_row --------------------------------------------------------------------
def test_accept_row_commits_the_passing_prefix_and_the_verifiers_token():
    """Guards accept_row's comparison and its count against hand-worked cases. The verifier's argmax
    at the fed positions last, d_1, d_2, d_3 is 4 5 6 7; d_i passes when it equals the argmax one
    position before it (p_(i-1)), and the step commits the passing prefix and then the verifier's
    token at the first failure (or after the last drafted token).

    Case: comparing each drafted token with the argmax at its own position (`zip(draft, argmax[1:])`)
    passed the verification tests on a real model, which only checked that the committed tokens are
    greedy's: a draft compared one position off is rejected at once, and one token per call is still
    greedy's. Here the all-right draft [4, 5, 6] must commit 4 5 6 7 (n = 3), not 4 (n = 0). Also
    guards counting the failing token as passed (n one too high), committing the drafted token where
    the verifier's belongs ([4, 9] instead of [4, 5]), and committing drafted tokens after the first
    failure."""
    argmax = [4, 5, 6, 7]
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 10).double()
    cases = [
        ([4, 5, 6], [4, 5, 6, 7], 3),  # all pass: the verifier's token after them comes free
        ([4, 9, 6], [4, 5], 1),  # d_2 fails: the verifier's 5, never the drafted 9 or the later 6
        ([9, 5, 6], [4], 0),  # d_1 fails: one token, the verifier's
        ([4, 5, 9], [4, 5, 6], 2),
        ([5, 6, 7], [4], 0),
    ]  # greedy's tokens one position late: rejected at once
    for draft, tokens, n in cases:
        assert accept_row(draft, logits, argmax, budget=20, eos_id=EOS_ID) == (tokens, n), draft
    assert accept_row([], logits[:1], argmax[:1], budget=20, eos_id=EOS_ID) == (
        [4],
        0,
    )  # nothing drafted: a greedy step


def test_accept_row_cuts_at_eos_and_at_the_budget():
    """Guards accept_row's two cuts against hand-worked cases: nothing after the first eos (eos kept),
    nothing past the budget, while n still counts every drafted token that passed. The verifier's
    argmax at last, d_1 .. d_4 is 4 eos 6 7 8."""
    argmax = [4, EOS_ID, 6, 7, 8]
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 10).double()

    def cut(draft, budget=20):
        return accept_row(draft, logits, argmax, budget=budget, eos_id=EOS_ID)

    assert cut([4, EOS_ID, 6, 7]) == ([4, EOS_ID], 4)  # a drafted eos passes; the rest passes but is cut
    assert cut([4, 9]) == ([4, EOS_ID], 1)  # the verifier's own token is eos
    assert cut([4, EOS_ID, 6, 7], budget=1) == ([4], 4)
    argmax = [4, 5, 6, 7, 8]
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 10).double()
    for budget, tokens in ((1, [4]), (2, [4, 5]), (4, [4, 5, 6, 7]), (5, [4, 5, 6, 7, 8]), (6, [4, 5, 6, 7, 8])):
        assert accept_row([4, 5, 6, 7], logits, argmax, budget=budget, eos_id=EOS_ID) == (tokens, 4), budget


def test_accept_row_gives_its_rules_the_rows_of_the_drafted_positions():
    """Guards which logits rows accept_row hands a lossy acceptance test and a sampler: the test gets
    rows last .. d_(m-1) (row i - 1 checks d_i) with the draft itself, the sampler gets row n, the
    bifurcation, and whether d_(n+1) was refused (False when the whole draft passed). With a test
    and a sampler that are argmax equality and argmax, every case decides as without them."""
    from refdec.decoding.ties import argmax as first_max

    argmax = [4, 5, 6, 7]
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 10).double()
    seen = []

    def accept(rows, draft):
        seen.append(("accept", first_max(rows).tolist(), draft.tolist()))
        return first_max(rows).eq(draft)

    def choose(row, n, rejected):
        seen.append(("choose", int(row.argmax()), n, rejected))
        return int(row.argmax())

    for draft in ([4, 5, 6], [4, 9, 6], [9, 5, 6]):
        assert accept_row(draft, logits, argmax, budget=20, eos_id=EOS_ID, accept=accept, choose=choose) == accept_row(
            draft, logits, argmax, budget=20, eos_id=EOS_ID
        ), draft
    assert seen == [
        ("accept", [4, 5, 6], [4, 5, 6]),
        ("choose", 7, 3, False),
        ("accept", [4, 5, 6], [4, 9, 6]),
        ("choose", 5, 1, True),
        ("accept", [4, 5, 6], [9, 5, 6]),
        ("choose", 4, 0, True),
    ]


# -- one decoder call: verify and verify_rows -------------------------------------------------------------------
def test_verify_accepts_exactly_up_to_the_first_wrong_token():
    """Guards verify on a real model by hand: a draft of greedy's next 6 tokens with the token at
    position w replaced passes exactly w tokens and commits greedy's first w + 1 (the verifier's
    own token at w), and the whole draft right commits 7; the cache keeps bos and every committed
    token but the last (1 + w positions), and the next call continues greedy's output."""
    m, src = verifier(), alone(sources(), 1)
    ref = references()[1]
    memory = m.encode(src)
    for w in range(7):
        draft = [wrong(t) if i == w else t for i, t in enumerate(ref[:6])]
        cache = m.new_cache(1, 16)
        v = verify(m, memory, cache, BOS_ID, draft, budget=MAX_LEN, eos_id=EOS_ID)
        assert (v.tokens, v.accepted, cache.length) == (ref[: w + 1], w, w + 1), w
        nxt = m.decode(torch.tensor([[v.tokens[-1]]]), memory, cache)[0, -1].argmax().item()
        assert nxt == ref[w + 1], w


def test_verify_rows_keeps_each_rows_tokens_states_and_cache():
    """Guards the batched verification call's bookkeeping by hand: four rows of different sources
    verify drafts of different lengths in one call (cache empty, each row feeding bos first):

        row 0: 6 right tokens with a budget of 3: cut to 2 drafted (logits for 3 positions); 2 pass,
               committed y_1 y_2 and the verifier's y_3; cache 3
        row 1: its 10 tokens, eos, then the verifier's own token after eos, budget 20: all 12 pass;
               committed the 11 up to eos (cut there), cache 11 (bos + 10: not 13, the count that
               passed + 1)
        row 2: 6 tokens, the third wrong: 2 pass; committed y_1 y_2 and the verifier's y_3; cache 3
        row 3: nothing: a greedy step; committed y_1; cache 1

    Each row's Verified holds its own row's logits and final states (those of bos + its draft fed
    alone), and the next call continues each row's own greedy output. Guards a row given another
    row's argmax, logits, states or budget (row 0's budget would cut row 1), a draft not cut to the
    budget, a cache not cut back (or cut by one row's count for all), and a cut at the count that
    passed rather than at what was committed."""
    m = verifier()
    order = [3, 0, 1, 2]
    src, refs = sources()[order], [references()[b] for b in order]
    after_eos = int(m.project(states(m, alone(src, 1), refs[1])[None])[0, -1].argmax())
    drafts = [refs[0][:6], refs[1] + [after_eos], refs[2][:2] + [wrong(refs[2][2])] + refs[2][3:6], []]
    budgets = [3, 20, MAX_LEN, MAX_LEN]
    memory = m.encode(src)
    cache = m.new_cache(4, capacity=16)
    vs = verify_rows(m, memory, cache, [BOS_ID] * 4, drafts, budgets=budgets, eos_id=EOS_ID)
    assert [v.tokens for v in vs] == [refs[0][:3], refs[1], refs[2][:3], refs[3][:1]]
    assert [v.accepted for v in vs] == [2, 12, 2, 0]
    assert cache.lengths.tolist() == [3, 11, 3, 1]
    for b, (v, draft) in enumerate(zip(vs, drafts)):
        fed = states(m, alone(src, b), draft[: budgets[b] - 1])
        assert v.hidden.shape == fed.shape and (v.hidden - fed).abs().max() < 1e-10, b
        assert (v.logits - m.project(fed[None])[0]).abs().max() < 1e-10, b
    nxt = m.decode(torch.tensor([[v.tokens[-1]] for v in vs]), memory, cache)[:, 0]
    for b, v in enumerate(vs):
        want = m.project(states(m, alone(src, b), v.tokens)[None])[0, -1]
        assert (nxt[b] - want).abs().max() < 1e-10, b


def test_verify_rows_hands_an_accept_rule_each_rows_own_draft():
    """Guards the draft a batched call hands a lossy acceptance test (each row's drafted tokens, not
    shifted onto `last`, not another row's): with a test that is argmax equality, every row
    commits and passes exactly what it does without one."""
    from refdec.decoding.ties import argmax as first_max

    m, src, refs = verifier(), sources(), references()
    drafts = [refs[0][:5], refs[1][:2] + [wrong(refs[1][2])] + refs[1][3:6], [], refs[3][:6]]
    decided = []
    for accept in (None, lambda logits, draft: first_max(logits).eq(draft)):
        vs = verify_rows(
            m,
            m.encode(src),
            m.new_cache(4, capacity=16),
            [BOS_ID] * 4,
            drafts,
            budgets=[MAX_LEN] * 4,
            eos_id=EOS_ID,
            accept=accept,
        )
        decided.append([(v.tokens, v.accepted) for v in vs])
    assert decided[0] == decided[1] == [(refs[0][:6], 5), (refs[1][:3], 2), (refs[2][:1], 0), (refs[3][:7], 6)]


# -- blockwise parallel decoding ------------------------------------------------------------------------------
def test_blockwise_heads_read_the_state_where_verification_stopped():
    """Guards the predict step of blockwise parallel decoding (Stern et al. 2018, section 4): the
    heads read the final decoder state of the position where verification stopped, the one whose
    p_1 gave the last committed token. Scripted heads (k = 4) propose greedy's tokens 2 .. 4 steps
    ahead of the state they read, but a wrong token for output positions 3, 7 and 8; max_len 12.
    By hand, with j tokens committed the heads read the state at position j - 1 and propose
    positions j + 1 .. j + 3; a call commits up to the first wrong proposal (the verifier's own
    token there), or all three and the verifier's next:

        call 1: [bos]                  commits y_1                       j = 1, reads position 0
        call 2: proposals 2 3 4        3 wrong: commits y_2 y_3          j = 3, reads 2
        call 3: proposals 4 5 6        all right: commits y_4 .. y_7     j = 7, reads 6
        call 4: proposals 8 9 10       8 wrong: commits y_8              j = 8, reads 7
        call 5: proposals 9 10 11      all right: commits y_9 .. y_12    j = 12 = max_len

    so 5 calls committing 1 2 4 1 4 tokens (12 / 5 = 2.4 per call), the heads reading positions
    0 2 6 7. The output is greedy's whatever the heads read; only these counts see which state.

    Case: the heads reading another row of the verification call (`v.hidden[0]` instead of
    `v.hidden[v.accepted]`) passed every blockwise, proposal-head and head-training test, slow ones
    included (their perfect proposals came from a model that writes one token at every position):
    the output stayed greedy's and only the tokens per call fell."""
    m, src, ref = verifier(), alone(sources(), 1), references()[1]
    heads = ScriptedHeads(m, src, [ref], [{3, 7, 8}], k=4).eval()
    r = decode_blockwise(m, heads, src, max_len=MAX_LEN, trace=True)
    assert r.tokens[0].tolist() == ref
    assert r.stats.verifier_calls == 5 and r.stats.committed == [1, 2, 4, 1, 4]
    assert heads.reads == [[(0, 0)], [(0, 2)], [(0, 6)], [(0, 7)]]
    assert [step.drafted for step in r.trace[0]] == [()] + [heads.proposals(0, t) for t in (0, 2, 6, 7)]
    assert [step.accepted for step in r.trace[0]] == [0, 1, 3, 0, 3]


def test_batched_blockwise_rows_get_proposals_from_their_own_states():
    """Guards the rows of a blockwise batch: each row's heads read that row's state where its own
    verification stopped, and the proposals go back to that row, also after other rows have left.
    Three sources, heads with k = 5 decoding with block size 4 (heads 2 .. 4: proposals for 3
    positions), max_len 12; by hand as in the one-row case (with j tokens committed, the heads
    read position j - 1 and propose j + 1 .. j + 3):

        row 0 (10 tokens and eos; no wrong proposal): commits 1 4 4 2 (call 4: proposals 10, eos
              and pad: y_10 and eos, cut at eos), reads positions 0 4 8; leaves after call 4
        row 1 (wrong at 3, 7, 8): commits 1 2 4 1 4, reads 0 2 6 7; leaves after call 5
        row 2 (wrong at 2, 5, 6, 9): commits 1 1 3 1 3 3 (call 6: proposals 10 11 12, budget 3: two
              drafted, both right, and y_12), reads 0 1 4 5 8; leaves after call 6

    6 calls in all. Guards a row given another row's final states, proposals meant for rows that
    left, and heads 1 .. k - 1 read instead of 2 .. k or all k - 1 instead of the block size."""
    m, srcs, refs = verifier(), sources()[:3], references()[:3]
    heads = ScriptedHeads(m, srcs, refs, [set(), {3, 7, 8}, {2, 5, 6, 9}], k=5).eval()
    r = decode_blockwise(m, heads, srcs, max_len=MAX_LEN, block_size=4, trace=True)
    assert [t.tolist() + [EOS_ID] * (len(t) < MAX_LEN) for t in r.tokens] == refs
    assert r.stats.verifier_calls == 6
    assert [committed(steps) for steps in r.trace] == [[1, 4, 4, 2], [1, 2, 4, 1, 4], [1, 1, 3, 1, 3, 3]]
    reads = {b: [t for call in heads.reads for (row, t) in filter(None, call) if row == b] for b in range(3)}
    assert reads == {0: [0, 4, 8], 1: [0, 2, 6, 7], 2: [0, 1, 4, 5, 8]}
    assert [len(call) for call in heads.reads] == [3, 3, 3, 2, 1] and None not in sum(heads.reads, [])
    for b, steps in enumerate(r.trace):
        assert [s.drafted for s in steps] == [()] + [heads.proposals(b, t)[:3] for t in reads[b]], b


# -- the other decoders' drafts ---------------------------------------------------------------------------------
def test_gad_commits_what_a_scripted_drafter_allows(monkeypatch):
    """Guards GAD's draft-and-commit lines with a drafter that knows each row's greedy output (it
    tells the rows apart by their encoder states): the block after j committed tokens is greedy's
    tokens j + 1 .. j + k (k = 3), wrong at the positions given, pad past the output's end. By
    hand, a call commits up to the first wrong token (the verifier's own there) or the whole block
    and the verifier's next; max_len 12:

        row 0 (wrong at 3, 7, 8): blocks 1-3 | 4-6 | 8-10 | 9-11  -> commits 3 4 1 4
        row 1 (nothing wrong; 10 tokens and eos): 1-3 | 5-7 | 9-11 -> commits 4 4 3 (y_9 y_10 eos)

    Row 1 leaves after call 3, row 0 after call 4."""
    m, refs = verifier(), references()
    srcs = sources()[[1, 0]]
    encoded = m.encode(srcs).states
    rows = [(refs[1], {3, 7, 8}), (refs[0], set())]

    def draft(model, memory, cache, sequences, k, layout):
        out = []
        for r, sequence in enumerate(sequences):
            b = next(b for b in range(len(rows)) if (memory.states[r] - encoded[b]).abs().max() < 1e-12)
            (ref, misses), j = rows[b], len(sequence) - 1
            assert sequence[1:] == ref[:j], "the drafter is given bos and the row's output so far"
            out.append(
                [
                    PAD_ID if q > len(ref) else wrong(ref[q - 1]) if q in misses else ref[q - 1]
                    for q in range(j + 1, j + k + 1)
                ]
            )
        return out

    monkeypatch.setattr(gad_module, "draft_blocks", draft)
    r = decode_gad(m, Drafter(m, k=3), srcs, max_len=MAX_LEN, trace=True)
    assert [committed(steps) for steps in r.trace] == [[3, 4, 1, 4], [4, 4, 3]]
    assert r.stats.verifier_calls == 4


def test_speculative_self_drafts_commit_gamma_plus_one():
    """Guards speculative decoding's draft window: the model drafting for itself is always right, so
    a call commits the gamma = 4 drafted tokens and the verifier's next, and near max_len the window
    shrinks to leave room for that one. By hand, max_len 12:

        row 0 (10 tokens and eos): 5 (y_1 .. y_5), 5 (y_6 .. y_10), then 1 drafted: eos    -> 5 5 1
        row 1 (12 tokens):         5, 5, then 1 drafted (budget 2) and the verifier's y_12 -> 5 5 2"""
    m, refs = verifier(), references()
    r = decode_speculative(m, m, sources()[:2], max_len=MAX_LEN, gamma=4, trace=True)
    assert [t.tolist() for t in r.tokens] == [refs[0][:-1], refs[1]]
    assert [committed(steps) for steps in r.trace] == [[5, 5, 1], [5, 5, 2]]
    assert [[len(s.drafted) for s in steps] for steps in r.trace] == [[4, 4, 1], [4, 4, 1]]


def test_iad_drafts_the_source_after_the_match():
    """Guards IAD's draft (the source after the matched token, each row its own source): two sources
    that share the start of the model's greedy output 17 10 33 22 21 30 34 .., max_len 14:

        row 0: source 17 10 33 22 21 30 34 13 38 36, greedy 17 10 33 22 21 30 34 13 38 36 32 38 36 16.
               Call 1 drafts the source and eos after bos: 10 pass, eos fails, the verifier's 32: 11
               tokens. 32 is not in the source: a greedy step, 38. 38 occurs once: draft 36 eos;
               36 passes, eos fails, the verifier's 16: 2. Commits 11 1 2, then leaves.
        row 1: source 17 10 33 22 5 6, greedy 17 10 33 22 21 30 34 29 13 38 36 16 18 11. Call 1:
               17 10 33 22 pass, 5 fails, the verifier's 21: 5 tokens; 21 is not in the source, nor
               anything after it: greedy steps. Commits 5 and then 1 nine times."""
    m = verifier()
    rows = [[17, 10, 33, 22, 21, 30, 34, 13, 38, 36], [17, 10, 33, 22, 5, 6]]
    src = torch.full((2, 11), PAD_ID, dtype=torch.long)
    for b, row in enumerate(rows):
        src[b, : len(row) + 1] = torch.tensor(row + [EOS_ID])
    r = decode_iad(m, src, max_len=14, trace=True)
    assert [t.tolist() for t in r.tokens] == [
        rows[0] + [32, 38, 36, 16],
        [17, 10, 33, 22, 21, 30, 34, 29, 13, 38, 36, 16, 18, 11],
    ]
    assert [committed(steps) for steps in r.trace] == [[11, 1, 2], [5] + [1] * 9]


def test_iad_matches_the_shortest_unique_suffix_of_the_output():
    """Guards IAD's match (`find_match`, Algorithm 1's line 3, the paper's `unique` policy): the
    shortest suffix of the output that occurs exactly once in the source, aligned on its last token.
    The source 17 10 33 22 5 21 9 9 22 21 30 34 13 38 36 (x_0 = bos, x_16 = eos) holds 21, 9 and 22
    twice; the model's greedy output, max_len 16, is 17 10 33 22 21 30 34 13 38 36 16 18 9 22 21 30.
    By hand, with "match" the x_i the output's last token aligns with:

        call 1: bos is x_0: draft x_1 ..: 17 10 33 22 pass, 5 fails, the verifier's 21      5 tokens
        call 2: 21 is x_6 and x_10, "22 21" only x_9 x_10: draft x_11 .. (30 34 13 38 36 eos):
                5 pass, eos fails, the verifier's 16                                      6
        call 3: 16 is not in the source: a greedy step, 18                                1
        call 4: 18 neither: a greedy step, 9                                              1
        call 5: 9 is x_7 and x_8, "18 9" nowhere: a greedy step, 22                       1
        call 6: 22 is x_4 and x_9, "9 22" only x_8 x_9: draft x_10 .. (21 30 ..), cut to the
                budget's 1 token: 21 passes, the verifier's 30                            2

    Matches 0 10 - - - 9. The output is greedy's whatever is matched; only these counts see the
    match. Guards a suffix compared one position off (call 2 then matches x_6 and drafts 9 9 ..), an
    ambiguous suffix taken at its first occurrence instead of looking one token further (call 2
    drafts from x_6 too), and a match aligned after or before the output's last token."""
    m = verifier()
    row = [17, 10, 33, 22, 5, 21, 9, 9, 22, 21, 30, 34, 13, 38, 36]
    src = torch.tensor([row + [EOS_ID]])
    r = decode_iad(m, src, max_len=16, trace=True)
    assert r.tokens[0].tolist() == [17, 10, 33, 22, 21, 30, 34, 13, 38, 36, 16, 18, 9, 22, 21, 30]
    assert r.tokens[0].tolist() == batch1_greedy(m, src, 16)[0].tolist()
    assert [step.origin for step in r.trace[0]] == [0, 10, None, None, None, 9]
    assert committed(r.trace[0]) == [5, 6, 1, 1, 1, 2]


# -- BiLD's rules: fall back, roll back -------------------------------------------------------------------------
class ScriptedSmall:
    """BiLD's small model, scripted, in the place of its Follower (the cache kept in step, which a
    script does not need): at output position q (1-based) of source row b, after greedy's tokens
    y_1 .. y_(q-1), it writes y_q with probability 0.9, except at the positions in unsure[b], where its
    largest probability is 0.3, and at those in wrong[b], where it writes, with probability 0.9, the
    token wrong[b][q] instead. After any other prefix (one holding a wrong token) it is unsure."""

    def __init__(self, refs: list[list[int]], unsure: list[set[int]], wrong: list[dict[int, int]], vocab: int):
        self.refs, self.unsure, self.wrong, self.vocab = refs, unsure, wrong, vocab
        self.rows = list(range(len(refs)))  # the source row of each batch row, as rows leave

    def next_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        out = []
        for b, seq in zip(self.rows, sequences):
            ref, q = self.refs[b], len(seq)  # seq is bos + the output so far: q - 1 tokens
            on_path = seq[1:] == ref[: q - 1]
            tok, top = self.wrong[b].get(q, ref[q - 1]) if on_path else PAD_ID, 0.9
            if not on_path or q in self.unsure[b]:
                top = 0.3
            probs = torch.full((self.vocab,), (1 - top) / (self.vocab - 1), dtype=torch.float64)
            probs[tok] = top
            out.append(probs.log())
        return torch.stack(out)

    def select(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[r] for r in rows.tolist()]


def test_bild_falls_back_when_unsure_and_rolls_back_a_token_the_large_model_finds_unlikely(monkeypatch):
    """Guards BiLD's two rules (Kim et al. 2023, Algorithm 1; `bild.py:small_run`, `bild.py:rollback_rule`)
    with a scripted small model (ScriptedSmall) beside the real large one, fallback_threshold 0.5,
    rollback_threshold 2.0, max_window 3, max_len 12: the small model writes while its largest
    probability is at least 0.5 (0.9) and it wrote fewer than 3 tokens since the large model's last
    call, falls back when unsure (0.3); the large model keeps a small-model token while -log p_L of it
    is at most 2 (every greedy token here: at most 1.6), and rolls back at the first it finds
    unlikely (its least likely token there, -log p_L above 20), committing its own token there. By hand:

        row 0 (greedy y_1 .. y_12; unsure at 6, writes a wrong token at 5):
            run y_1 y_2 y_3 (window full)  -> all kept, + y_4               commits 4
            run w_5 (then unsure)          -> w_5 rolled back, y_5          1, a rollback
            run nothing (unsure at 6)      -> y_6: a large-model step        1
            run y_7 y_8 y_9 (window)       -> + y_10                         4
            run y_11 y_12: max_len, leaves without a large-model check       2, unverified
        row 1 (greedy y_1 .. y_10 eos; unsure at 2, wrong at 7):
            run y_1 (then unsure)          -> + y_2                          2
            run y_3 y_4 y_5 (window)       -> + y_6                          4
            run w_7                        -> w_7 rolled back, y_7           1, a rollback
            run y_8 y_9 y_10 (window)      -> + eos: leaves                  4

    4 large-model calls, each a fallback of both rows (8 fallbacks), 2 rollbacks; both outputs are
    the large model's greedy ones. Guards the fallback comparison turned round (writing when unsure),
    the rollback comparison turned round (keeping the unlikely token, rolling back greedy's), a
    window of one token more, and a row given another row's confidence."""
    from refdec.decoding import bild as bild_module
    from refdec.decoding.bild import decode_bild

    m, refs = verifier(), references()
    srcs, rows = sources()[[1, 0]], [refs[1], refs[0]]
    wrong_at = [5, 7]
    with torch.no_grad():  # -log p_L at each position of each row's greedy output
        nll = [
            -torch.log_softmax(m.project(states(m, alone(srcs, b), ref[:-1])[None])[0], -1)
            for b, ref in enumerate(rows)
        ]
    wrong = [{q: int(nll[b][q - 1].argmax())} for b, q in enumerate(wrong_at)]  # the large model's least likely
    for b, (ref, q) in enumerate(zip(rows, wrong_at)):  # greedy's tokens at most 2, the wrong ones above
        assert float(nll[b][range(len(ref)), ref].max()) <= 2.0 < float(nll[b][q - 1, wrong[b][q]]), b
        assert wrong[b][q] != EOS_ID, b
    small = ScriptedSmall(rows, [{6}, {2}], wrong, m.cfg.vocab_size)
    monkeypatch.setattr(bild_module, "Follower", lambda model, memory, capacity: small)
    r = decode_bild(
        m, m, srcs, max_len=MAX_LEN, fallback_threshold=0.5, rollback_threshold=2.0, max_window=3, trace=True
    )
    assert [t.tolist() for t in r.tokens] == [rows[0], rows[1][:-1]]
    assert [committed(steps) for steps in r.trace] == [[4, 1, 1, 4, 2], [2, 4, 1, 4]]
    assert [[s.rollback for s in steps] for steps in r.trace] == [[0, 1, 0, 0, 0], [0, 0, 1, 0]]
    assert [[s.verified for s in steps] for steps in r.trace] == [[1, 1, 1, 1, 0], [1, 1, 1, 1]]
    assert (r.stats.verifier_calls, r.stats.fallbacks, r.stats.rollbacks) == (4, 8, 2)


# -- speculative sampling: one position's acceptance and residual ----------------------------------------------
def test_speculative_sampling_emits_each_token_with_the_large_models_probability(monkeypatch):
    """Guards speculative sampling's two rules at one drafted position (Leviathan et al. 2023,
    Algorithm 1; `speculative.py:residual_test`, `speculative.py:residual_draw`) in closed form, on 5
    tokens, in sixteenths:

        q, the small model's         4  4  4  2  2     x ~ q is drafted
        p, the large model's         8  2  0  3  3
        min(1, p(x) / q(x))          1 1/2 0  1  1     x is kept with this probability: mass 10/16
        max(0, p - q)                4  0  0  1  1     a rejection (mass 6/16) draws from this / 6

    so y is emitted with probability q(y) min(1, p(y) / q(y)) + 6/16 (4 0 0 1 1)(y) / 6 = 8 2 0 3 3:
    p exactly. The test reads both rules off the code: the acceptance probability of each x as the
    fraction of N uniforms (k + 1/2) / N it keeps (exact here, every min(1, p/q) a multiple of 1/N;
    torch.rand replaced by them for one call), and the residual as what residual_draw hands `draw`
    (replaced by one that records it). After a whole window kept, the next token is drawn from p.

    Guards the residual's sign turned round (max(0, q - p), 0 2 4 0 0: the output then follows q, not
    p), a rejection drawn from p, from q or from |p - q|, keeping every drafted token (emitted: q),
    keeping x with probability p(x) or q(x) / p(x), and the residual left unnormalised or normalised
    by anything but its mass (softmax, its maximum): what `draw` is handed is then no distribution,
    or the wrong one. min(1, p/q) without the min is the same test, r < p/q for every r < 1; no test
    can tell them apart."""
    from refdec.decoding import speculative

    p = torch.tensor([8, 2, 0, 3, 3], dtype=torch.float64) / 16
    q = torch.tensor([4, 4, 4, 2, 2], dtype=torch.float64) / 16
    logits = p.log()  # the large model's logits at the position: distribution(logits) is p (log 0: -inf)
    gen, n = torch.Generator().manual_seed(0), 48

    def uniforms(size, *, generator, dtype):
        assert size == n and generator is gen and dtype == torch.float64
        return (torch.arange(n, dtype=dtype) + 0.5) / n

    kept = []
    with monkeypatch.context() as patch:
        patch.setattr(torch, "rand", uniforms)
        for x in range(5):  # the one position n times, each with its own uniform
            test = speculative.residual_test([q] * n, 1.0, 1.0, gen)
            kept.append(float(test(logits.expand(n, 5), torch.full((n,), x)).double().mean()))
    handed = []
    monkeypatch.setattr(speculative, "draw", lambda probs, generator: handed.append(probs) or 0)
    choose = speculative.residual_draw([q], 1.0, 1.0, gen)
    choose(logits, 0, True)  # x_1 rejected: the token drawn in its place
    choose(logits, 1, False)  # the window of 1 kept: the token after it
    residual, after = handed
    accept = torch.tensor(kept, dtype=torch.float64)
    emitted = q * accept + (1 - (q * accept).sum()) * residual
    assert (emitted - p).abs().max() < 1e-12, (emitted * 16).tolist()
    assert kept == [1.0, 0.5, 0.0, 1.0, 1.0]
    assert (residual - torch.tensor([4, 0, 0, 1, 1], dtype=torch.float64) / 6).abs().max() < 1e-12, residual.tolist()
    assert (after - p).abs().max() < 1e-12
