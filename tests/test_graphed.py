"""The graphed route (refdec.routes.graphed): the fast route's step on static shapes. Its logits within float64
rounding of the reference route's, padded calls equal to unpadded ones on the real positions, greedy
writing the reference route's tokens, every lossless decoder on it equal to greedy on it (float64,
torch.equal), its static KV cache keeping KVCache's verbs in storage that does not move, and steps
that a CUDA graph can capture: no host synchronisation, no data-dependent shape. What no test here
can run is the capture itself on a GPU (`capture`, exercised with a stand-in for torch.cuda)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from conftest import (
    REPO,
    assert_rows_equal,
    batch1_greedy,
    check_batched_iad,
    check_lossless_decoders,
    copy_model,
    random_src,
    run_py,
    tiny_model,
)
from torch.utils._python_dispatch import TorchDispatchMode

from refdec.cache import KVCache
from refdec.commands import stepcost
from refdec.commands.stepcost import fused_route
from refdec.compiling import cpp_compiler
from refdec.config import BOS_ID
from refdec.decoding import decode_beam, decode_greedy
from refdec.model import Transformer
from refdec.routes import graphed, on_route
from refdec.routes.fast import FastRoute
from refdec.routes.graphed import GraphedRoute, Replay, StaticKVCache

TOL = 1e-12  # float64: the routes sum in different orders


def graphed_copy(model: Transformer) -> GraphedRoute:
    """The graphed route around a copy of the model (so that tests may change one and not the other)."""
    return on_route(copy.deepcopy(model), "graphed")


def calls(model: Transformer, src: torch.Tensor, tgt: torch.Tensor):
    """A uniform call of k tokens, then one token, then a ragged call (per-row lengths, right-padded
    rows): each call's logits at the real positions, and the cache afterwards, cut to the real
    positions as a verification step cuts it (a padded position's keys are not the reference's)."""
    B = src.shape[0]
    real = torch.tensor([3, 1, 2, 3, 2][:B])
    with torch.no_grad():
        memory, cache = model.encode(src), model.new_cache(B)
        out = [model.decode(tgt, memory, cache), model.decode(tgt[:, :1], memory, cache)]
        before = torch.tensor([1, 2, 3, 4, 5][:B])
        cache.truncate(before)
        ragged = model.project(model.decode_hidden(tgt[:, 1:], memory, cache, real=real))
        cache.truncate(before + real)
    out.append(ragged[torch.arange(3)[None, :] < real[:, None]])
    return out, cache


def assert_calls_close(a, b, what: str):
    (la, ca), (lb, cb) = a, b
    for x, y in zip(la, lb):
        assert x.shape == y.shape and (x - y).abs().max() < TOL, what
    assert torch.equal(ca.lengths, cb.lengths) and ca.end == cb.end, what
    for row, n in enumerate(ca.lengths.tolist()):
        assert (ca.k[:, row, :, :n] - cb.k[:, row, :, :n]).abs().max() < TOL, what
        assert (ca.v[:, row, :, :n] - cb.v[:, row, :, :n]).abs().max() < TOL, what


def decode_tokens(seed: int, B: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tgt = torch.randint(5, 40, (B, 4), generator=g)
    tgt[:, 0] = BOS_ID
    return tgt


# -- the same mathematics -----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_encoder_and_decoder_calls_match_the_reference(seed):
    """The encoder's states at the real source positions (the rest is the bucket's padding), and the
    decoder's logits for k tokens, one token and a ragged call with right-padded rows, within float64
    rounding of the reference route's; the caches hold the same positions."""
    m = tiny_model(seed, norm_first=seed % 2 == 0, tie=seed % 3 == 0)
    g = graphed_copy(m)
    src = random_src(seed + 10, 5, 40)
    with torch.no_grad():
        ref, got = m.encode(src), g.encode(src)
    S = src.shape[1]
    assert got.states.shape[1] == graphed.bucket(S) and not got.src_pad[:, S:].logical_not().any()
    assert torch.equal(got.src_pad[:, :S], ref.src_pad)
    assert (got.states[:, :S] - ref.states)[~ref.src_pad].abs().max() < TOL
    tgt = decode_tokens(seed, 5)
    a, b = calls(m, src, tgt), calls(g, src, tgt)
    assert type(b[1]) is StaticKVCache
    assert_calls_close(a, b, f"seed {seed}")


@pytest.mark.parametrize("seed", range(3))
def test_a_padded_call_equals_the_unpadded_one(seed, monkeypatch):
    """Calls padded twice as far (tokens, rows, source length, capacity) and the fast route's calls,
    which pad nothing, agree at every real position; so do their greedy outputs."""
    m = tiny_model(seed, norm_first=seed != 1)
    src, tgt = random_src(seed, 3, 40), decode_tokens(seed, 3)
    fast = on_route(copy.deepcopy(m), "fast")
    g = graphed_copy(m)
    padded = graphed_copy(m)
    unpadded, normal = calls(fast, src, tgt), calls(g, src, tgt)
    normal_greedy = decode_greedy(g, src, max_len=20).tokens
    with monkeypatch.context() as mp:
        mp.setattr(graphed, "bucket", lambda n: 2 * (1 << max(0, n - 1).bit_length()))
        wide = calls(padded, src, tgt)
        wide_greedy = decode_greedy(padded, src, max_len=20).tokens
        assert max(k[2] for k in padded._state().steps if k[0] == "decoder") == 8  # 3 new tokens padded to 8
    assert_calls_close(unpadded, normal, "fast route vs graphed")
    assert_calls_close(normal, wide, "graphed vs padded twice as far")
    assert_rows_equal(wide_greedy, normal_greedy, "greedy, padded twice as far")
    assert_rows_equal(normal_greedy, decode_greedy(m, src, max_len=20).tokens, "graphed greedy vs reference")


@pytest.mark.parametrize("seed", range(3))
def test_graphed_greedy_equals_reference_greedy(seed):
    """Away from near-ties (random float64 models) the graphed route writes the reference route's
    tokens, at batch 1 and batched (rows finishing at different steps leave the batch: its cache
    gathers them in place); beam search runs on it too."""
    m = tiny_model(seed, vocab=12 if seed == 2 else 40, norm_first=seed != 1, tie=seed == 2)
    g = graphed_copy(m)
    src = random_src(seed, 9, m.cfg.vocab_size)
    ref = decode_greedy(m, src, max_len=20).tokens
    assert_rows_equal(decode_greedy(g, src, max_len=20).tokens, ref, "graphed greedy, batch 9")
    assert_rows_equal(batch1_greedy(g, src, 20), ref, "graphed greedy, batch 1")
    beam = decode_beam(m, src, max_len=12, beam_size=3).tokens
    assert_rows_equal(decode_beam(g, src, max_len=12, beam_size=3).tokens, beam, "graphed beam")


@pytest.mark.parametrize("family", ["bart", "nllb"])
def test_imported_family_layers_match_the_reference(family):
    """BART's layers (post-norm, GELU, learned positions, embedding norms, a logits bias) and NLLB's
    forced encoder and decoder tokens (the decoder's first call takes the fast route, the later ones
    the graphed route, past the hidden prefix)."""
    base = tiny_model(11).cfg
    changes = {
        "bart": dict(
            norm_first=False,
            activation="gelu",
            positions="learned",
            embed_norm=True,
            logits_bias=True,
            scale_embeddings=False,
        ),
        "nllb": dict(encoder_prefix=(7,), decoder_prefix=(9,)),
    }[family]
    torch.manual_seed(11)
    m = Transformer(dataclasses.replace(base, **changes)).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    g = graphed_copy(m)
    src = random_src(11, 5, 40)
    ref = decode_greedy(m, src, max_len=15).tokens
    assert_rows_equal(decode_greedy(g, src, max_len=15).tokens, ref, family)
    assert_rows_equal(batch1_greedy(g, src, 15), ref, f"{family}, batch 1")
    check_batched_iad(g, src, 15)


# -- every lossless decoder on the graphed route equals greedy on the graphed route ------------------------
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_lossless_decoders_on_the_graphed_route_equal_its_greedy(batch, monkeypatch):
    """Batched IAD, GAD (a real drafter, whose block of masks takes the fast route, and an adversarial
    one), blockwise, speculative (self-drafted: two caches and two memories of one model at once; and
    a small model) and BiLD at its greedy limit, each equal row by row to batch-1 greedy on the graphed
    route (float64, torch.equal; test_fast.check_lossless_decoders), its verification calls graphed."""
    m = check_lossless_decoders(graphed_copy, batch, monkeypatch)
    widths = {k[2] for k in m._state().steps if k[0] == "decoder"}
    assert max(widths) > 1, widths


# -- the static cache ---------------------------------------------------------------------------------
def test_static_cache_keeps_the_verbs_of_kvcache_in_storage_that_does_not_move():
    """The same verbs on a KVCache and a StaticKVCache leave the same lengths and committed keys and
    values; selecting fewer rows gathers them in place; a clone is independent; growing past the
    capacity moves the cache; a finished cache's storage goes to the next cache of its shape."""
    pool = graphed.Pool(graphed.Slab)
    ref = KVCache(2, 3, 2, 4, capacity=6, dtype=torch.float64)
    got = StaticKVCache(pool, 2, 3, 2, 4, capacity=6, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)

    def both(verb, *args):
        for c in (ref, got):
            getattr(c, verb)(*args)

    def same():
        assert torch.equal(ref.lengths, got.lengths) and ref.end == got.end and ref.prefix == got.prefix
        for row, n in enumerate(ref.lengths.tolist()):
            assert torch.equal(ref.k[:, row, :, :n], got.k[:, row, :, :n])
            assert torch.equal(ref.v[:, row, :, :n], got.v[:, row, :, :n])

    def append(q):
        k, v = (
            torch.randn(ref.batch, 2, q, 4, generator=g, dtype=torch.float64),
            torch.randn(ref.batch, 2, q, 4, generator=g, dtype=torch.float64),
        )
        for layer in range(2):
            a, b = ref.append(layer, k, v), got.append(layer, k, v)
            assert (a[0].shape[2], b[0].shape[2]) == (ref.end + q + ref.prefix,) * 2
        both("advance", q)

    where = got.k.data_ptr()
    append(4)
    both("hide", 1)
    both("truncate", [1, 3, 2])
    append(2)
    same()
    twin = got.clone()
    both("select", torch.tensor([2, 0]))
    assert got.k.data_ptr() == where and got.batch == 2  # gathered in place
    same()
    append(3)
    both("truncate", 2)
    same()
    assert twin.lengths.tolist() == [3, 5, 4] and twin.k.data_ptr() != where
    append(200)  # past the capacity: a larger slab
    same()
    assert got.k.data_ptr() != where and got.capacity >= got.end + got.prefix + graphed.MAX_STEP
    moved = got.slab
    got = None  # the closures above share this name: the cache itself is gone
    again = StaticKVCache(pool, 2, 3, 2, 4, capacity=6, dtype=torch.float64)
    assert again.k.data_ptr() == where  # the first slab, free since the cache moved off it
    assert (
        StaticKVCache(pool, 2, 4, 2, 4, capacity=moved.k.shape[3] - graphed.MAX_STEP, dtype=torch.float64).slab is moved
    )  # free since its cache is gone


def test_decoding_calls_of_one_shape_reuse_their_steps():
    """A second batch of the same shape takes the first one's cache storage and memory slot, so it
    replays the steps made for the first (no new capture on a GPU)."""
    g = graphed_copy(tiny_model(4))
    src = random_src(4, 3, 40)
    first = decode_greedy(g, src, max_len=12).tokens
    made = dict(g._state().steps)
    assert any(k[0] == "decoder" for k in made) and any(k[0] == "encoder" for k in made)
    assert_rows_equal(decode_greedy(g, src, max_len=12).tokens, first, "again")
    assert g._state().steps == made


# -- capture ------------------------------------------------------------------------------------------
class NoHostSync(TorchDispatchMode):
    """Refuses what a CUDA graph capture refuses: reading a tensor's value on the host (`item`,
    `int()`, `bool()`, `tolist`) and shapes that depend on values (nonzero, boolean-mask indexing)."""

    REFUSED = {
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "aten::masked_select",
        "aten::unique_dim",
        "aten::_unique2",
        "aten::repeat_interleave",
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in self.REFUSED or (
            name == "aten::index" and any(i is not None and i.dtype == torch.bool for i in args[1])
        ):
            raise AssertionError(f"{name} in a step")
        return func(*args, **(kwargs or {}))


def test_steps_make_no_host_synchronisation_nor_data_dependent_shapes():
    """Every step the route made over a batched IAD run (ragged calls of several widths, rows
    leaving) and its encoder runs again under a mode that refuses what a capture refuses; the mode
    does refuse a host read."""
    g = graphed_copy(copy_model())
    src = random_src(7, 5, 16, min_len=1, max_len=14)
    check_batched_iad(g, src, 30)
    steps = g._state().steps
    assert len({k[2] for k in steps if k[0] == "decoder"}) >= 3  # several widths
    with torch.inference_mode(), NoHostSync():
        for step in steps.values():
            step.run.fn()
    with pytest.raises(AssertionError, match="_local_scalar_dense"), NoHostSync():
        int(torch.ones(2).sum())


class StandInCuda:
    """torch.cuda's graph API as `capture` uses it, recording the calls."""

    def __init__(self):
        self.log = []
        cuda = self

        class Stream:
            def wait_stream(self, other):
                cuda.log.append("wait")

        class Graph:
            def replay(self):
                cuda.log.append("replay")

        self.Stream, self.CUDAGraph, self._current = Stream, Graph, Stream()

    def current_stream(self):
        return self._current

    def stream(self, s):
        return self.context("side stream")

    def graph(self, g, pool=None):
        return self.context("capture")

    def context(self, what):
        cuda = self

        class Context:
            def __enter__(self):
                cuda.log.append(what)

            def __exit__(self, *exc):
                cuda.log.append("end " + what)

        return Context()


def test_a_step_is_captured_once_then_replayed():
    """On CUDA (here a stand-in for torch.cuda's graph API): the first call warms up on a side stream,
    captures one run and replays it; later calls only replay. Elsewhere the step runs as it is."""
    runs, cuda = [], StandInCuda()
    step = Replay(lambda: runs.append(cuda.log[-1]), torch.device("cuda"), cuda=cuda)
    step()
    step()
    assert runs == ["side stream", "capture"]
    assert cuda.log == ["wait", "side stream", "end side stream", "wait", "capture", "end capture", "replay", "replay"]
    eager = Replay(lambda: runs.append("eager"), torch.device("cpu"), cuda=cuda)
    eager()
    eager()
    assert runs[2:] == ["eager", "eager"] and cuda.log[-1] == "replay"


# -- the wrapper ---------------------------------------------------------------------------------------
def test_the_route_leaves_the_model_and_hands_on_where_it_does_not_apply():
    """Wrapping keeps every parameter's value and the model's classes; a model the fast route does
    not write is refused; with gradients on, calls take the model's own layers and make no step; a
    weight written in place or given a new tensor reaches the next decoding call (`.data` in place
    after `refresh`)."""
    m = tiny_model(6)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    g = on_route(m, "graphed")
    decode_greedy(g, random_src(6, 2, 40), max_len=6)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in state.items())
    assert type(m) is Transformer and type(m.decoder[0].ff.w1) is torch.nn.Linear
    with pytest.raises(ValueError, match="does not write"):
        GraphedRoute(Transformer(dataclasses.replace(tiny_model(8).cfg, norm="rms")))

    ref = tiny_model(6)
    g = graphed_copy(ref)
    src, tgt = random_src(6, 3, 40), torch.full((3, 1), BOS_ID)

    def logits(model, grad=False):
        with torch.set_grad_enabled(grad):
            return model.decode(tgt, model.encode(src), model.new_cache(3)).detach()

    assert (logits(ref, True) - logits(g, True)).abs().max() < TOL
    assert not g._state().steps  # with gradients on, no step was made
    assert (logits(ref) - logits(g)).abs().max() < TOL and g._state().steps
    for change, seen in (
        (lambda mm: mm.decoder[0].ff.w1.weight.data.mul_(1.5), False),
        (lambda mm: mm.decoder[0].ff.w1.weight.mul_(1.5), True),
        (lambda mm: setattr(mm.out_proj.weight, "data", mm.out_proj.weight.data * 0.7), True),
        (lambda mm: setattr(mm.decoder[1].sub2.norm.weight, "data", mm.decoder[1].sub2.norm.weight.data + 0.2), True),
        (lambda mm: setattr(mm.encoder[0].attn.wv.weight, "data", mm.encoder[0].attn.wv.weight.data + 0.1), True),
    ):
        for mm in (ref, g.model):
            with torch.no_grad():
                change(mm)
        if not seen:
            g.refresh()
        assert (logits(ref) - logits(g)).abs().max() < TOL
    assert isinstance(g, FastRoute)


def test_a_decoded_graphed_route_and_its_model_deep_copy():
    """Guards copy.deepcopy after decoding (its kept steps once held torch.cuda, which cannot be
    copied): the model copies, and a copy of the route is a route of a copy of the model, whose
    steps are made again and which writes the same tokens."""
    g = graphed_copy(tiny_model(9))
    src = random_src(9, 3, 40)
    first = decode_greedy(g, src, max_len=12).tokens
    assert g._state().steps
    twin = copy.deepcopy(g)
    assert twin.model is not g.model and twin.state is None and isinstance(copy.deepcopy(g.model), Transformer)
    assert_rows_equal(decode_greedy(twin, src, max_len=12).tokens, first, "the copy's greedy")


# -- decode.py ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_decode_graphed_writes_the_reference_output(trained_tiny, tmp_path):
    """decode.py --graphed in float64: greedy and IAD write what greedy on the reference route
    writes, batch 1 and batched; the report says which route ran; --graphed with --fast is refused."""
    base = [
        "decode.py",
        "--task",
        "mt-en-de",
        "--threads",
        "1",
        "--quiet",
        "--model",
        str(trained_tiny / "model.pt"),
        "--limit",
        "8",
        "--dtype",
        "float64",
        "--max-len",
        "16",
    ]
    outs = {}
    for name, flags in (
        ("reference", ["--algo", "greedy"]),
        ("greedy", ["--algo", "greedy", "--graphed"]),
        ("iad", ["--algo", "iad", "--graphed"]),
        ("batched", ["--algo", "greedy", "--graphed", "--batch-size", "4"]),
    ):
        rep = tmp_path / f"{name}.json"
        r = run_py(*base, *flags, "--report", str(rep))
        assert r.returncode == 0, r.stderr.decode()
        outs[name] = r.stdout.decode()
        assert json.loads(rep.read_text())["graphed_route"] is ("--graphed" in flags)
    assert (
        outs["greedy"] == outs["reference"]
        and outs["iad"] == outs["reference"]
        and outs["batched"] == outs["reference"]
    )
    r = run_py(*base, "--algo", "greedy", "--graphed", "--fast")
    assert r.returncode == 2 and "not allowed with" in r.stderr.decode()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["greedy", "beam", "iad", "gad", "blockwise", "bild", "speculative"])
def test_decode_graphed_runs_every_algorithm_on_a_shipped_checkpoint(algo, tmp_path):
    """decode.py --graphed runs each algorithm on its shipped mt-en-de checkpoints (drafter, heads,
    small model), one output line per input line."""
    out = tmp_path / "out.txt"
    r = run_py(
        "decode.py",
        "--algo",
        algo,
        "--task",
        "mt-en-de",
        "--graphed",
        "--limit",
        "3",
        "--threads",
        "1",
        "--quiet",
        "--output",
        str(out),
        "--batch-size",
        "2",
    )
    assert r.returncode == 0, r.stderr.decode()
    assert len(out.read_text(encoding="utf-8").splitlines()) == 3
    assert (REPO / "checkpoints" / "mt-en-de" / "model.pt").is_file()


def test_time_replay_times_the_step_that_the_call_runs(monkeypatch):
    """Guards stepcost's graphed replay timing (refdec.commands.harness.time_replay): the step it times is
    the one the route's call of that shape ran (step_of finds it, made once), and running it alone
    writes the call's final states again (the same inputs, the same outputs)."""
    from refdec.commands import harness as timing

    m = tiny_model(0)
    route = on_route(m, "graphed")
    src = random_src(0, 2, 7)
    with torch.inference_mode():
        memory = route.encode(src)
        cache = route.new_cache(2, capacity=8)
        route.decode(torch.full((2, 5), 7), memory, cache)
        states = route.decode_hidden(torch.full((2, 3), 9), memory, cache)
        step = route.step_of(memory, cache, 3)
        assert step.tokens.shape == (2, 4) and any(s is step for s in route.state.steps.values())
        step.run()
        assert torch.equal(step.out[:2, :3], states)
        assert timing.time_replay(route, memory, 5, 3, 2) > 0


# -- the fused form: each step compiled before its capture (stepcost --fused) -----------------------------
needs_cpp = pytest.mark.skipif(cpp_compiler() is None, reason="torch.compile's CPU kernels need a C++ compiler")


@pytest.mark.slow
@needs_cpp
def test_fused_steps_compute_what_the_graphed_steps_compute():
    """stepcost's fused_route runs each step compiled by torch.compile (one whole graph,
    fixed shapes), so every shape compiles: k tokens, one token, a ragged call, batched and batch-1 greedy,
    then calls of 1 to 16 tokens in 1 and 2 rows. Its logits within float64 rounding of the reference
    route's, its caches the same, its greedy the reference's tokens; each step is the compiled function,
    more decoder shapes than torch.compile's default 8 compilations of one function (past which, with
    fullgraph, it raises) all compiled."""
    m = tiny_model(3, norm_first=True)
    fused = fused_route(copy.deepcopy(m))
    assert copy.deepcopy(fused).prepare_step is stepcost.fused
    src, tgt = random_src(3, 3, 40), decode_tokens(3, 3)
    assert_calls_close(calls(m, src, tgt), calls(fused, src, tgt), "fused graphed route vs reference")
    ref = decode_greedy(m, src, max_len=12).tokens
    assert_rows_equal(decode_greedy(fused, src, max_len=12).tokens, ref, "fused greedy, batch 3")
    assert_rows_equal(batch1_greedy(fused, src, 12), ref, "fused greedy, batch 1")
    with torch.inference_mode():
        for rows in (1, 2):
            for q in (1, 2, 4, 8, 16):
                new = torch.arange(5, 5 + q).expand(rows, q)
                got = []
                for route in (m, fused):
                    memory, cache = route.encode(src[:rows]), route.new_cache(rows)
                    route.decode(tgt[:rows], memory, cache)
                    got.append(route.decode(new, memory, cache))
                assert (got[0] - got[1]).abs().max() < TOL, (rows, q)
    steps = fused._state().steps
    assert sum(key[0] == "decoder" for key in steps) > 8
    assert all(s.run.fn.__wrapped__ is not None for s in steps.values())  # each step the compiled one


def test_a_plain_graphed_route_prepares_no_step():
    """Only stepcost's measuring form compiles the steps: the graphed route on_route makes runs each step
    function as it is, and on_route takes no measuring flag."""
    plain = on_route(tiny_model(0), "graphed")
    step = lambda: None  # noqa: E731
    assert plain.prepare_step is None and plain._replay(step, torch.device("cpu"), None).fn is step
    with pytest.raises(TypeError):
        on_route(tiny_model(0), "graphed", fused=True)
