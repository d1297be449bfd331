"""The model's cached path against its uncached reference, and the KVCache's verbs."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, random_src, tiny_model

from refdec.cache import KVCache
from refdec.config import BOS_ID, EOS_ID


def uncached_greedy(model, src_row: torch.Tensor, max_len: int) -> torch.Tensor:
    """Greedy by re-running model.forward over the whole prefix each step: slow, obviously right."""
    tgt = torch.tensor([[BOS_ID]])
    out = []
    for _ in range(max_len):
        tok = model(src_row[None], tgt)[0, -1].argmax().item()
        out.append(tok)
        if tok == EOS_ID:
            return torch.tensor(out[:-1])
        tgt = torch.cat([tgt, torch.tensor([[tok]])], 1)
    return torch.tensor(out)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_cached_logits_equal_uncached(seed, norm_first):
    """Guards against a wrong causal offset, position offset or cache write in incremental decoding:
    feeding the target 1 token at a time, or in chunks of several, gives forward()'s logits."""
    m = tiny_model(seed, norm_first=norm_first)
    src = random_src(seed, 3, 40)
    g = torch.Generator().manual_seed(seed)
    tgt = torch.cat([torch.full((3, 1), BOS_ID), torch.randint(5, 40, (3, 11), generator=g)], 1)
    with torch.inference_mode():
        full = m(src, tgt)
        mem = m.encode(src)
        for chunks in ([1] * 12, [3, 1, 5, 3], [12], [2, 10]):
            cache = m.new_cache(3, capacity=2)  # small on purpose: growth must keep contents
            pieces, at = [], 0
            for c in chunks:
                pieces.append(m.decode(tgt[:, at : at + c], mem, cache))
                at += c
            inc = torch.cat(pieces, 1)
            assert cache.length == 12
            assert (inc - full).abs().max().item() < 1e-10, chunks


def test_truncate_then_redecode_gives_same_logits():
    """Guards against stale keys after truncate: rejected draft positions must vanish completely."""
    m = tiny_model(3)
    src = random_src(3, 1, 40)
    with torch.inference_mode():
        mem = m.encode(src)
        cache = m.new_cache(1)
        m.decode(torch.tensor([[BOS_ID, 7, 8]]), mem, cache)
        m.decode(torch.tensor([[30, 31, 32, 33]]), mem, cache)  # a draft that gets rejected
        cache.truncate(3)
        again = m.decode(torch.tensor([[9, 10]]), mem, cache)
        ref = m(src, torch.tensor([[BOS_ID, 7, 8, 9, 10]]))[:, 3:]
    assert (again - ref).abs().max().item() < 1e-10


@pytest.mark.parametrize("seed", range(6))
def test_cached_greedy_tokens_equal_uncached(seed):
    """Guards against any drift between the KV-cache greedy loop and the naive recomputation."""
    from refdec.decoding import decode_greedy

    m = tiny_model(seed, vocab=12)
    src = random_src(seed, 4, 12)
    res = decode_greedy(m, src, max_len=20)
    with torch.inference_mode():
        for b in range(4):
            assert torch.equal(res.tokens[b], uncached_greedy(m, src[b][src[b] != 0], 20))


def test_cache_verbs():
    """Guards against the cache's bookkeeping: lengths, bounds, row selection, independent clones."""
    c = KVCache(n_layers=2, batch=3, n_heads=2, head_dim=4, capacity=2, dtype=torch.float64)
    k = torch.arange(3 * 2 * 3 * 4, dtype=torch.float64).view(3, 2, 3, 4)
    for layer in range(2):
        K, V = c.append(layer, k, -k)
        assert K.shape == (3, 2, 3, 4) and torch.equal(K, k) and torch.equal(V, -k)
    assert c.length == 0  # nothing counts before advance
    c.advance(3)
    assert c.length == 3 and c.capacity >= 3
    with pytest.raises(ValueError):
        c.truncate(4)
    d = c.clone()
    c.truncate(1)
    assert c.length == 1 and d.length == 3
    K, _ = d.append(0, k[:, :, :1], k[:, :, :1])
    assert torch.equal(K[:, :, :3], k)  # clone kept its own storage
    rows = torch.tensor([2, 0, 0])
    d.select(rows)
    assert d.batch == 3 and torch.equal(d.k[0, :, :, :3], k[rows])
    with pytest.raises(RuntimeError):
        KVCache(1, 1, 1, 1, capacity=1).advance(2)


class WholeCopyCache(KVCache):
    """The cache with select as index_select of the whole storage, the obvious form."""

    def select(self, rows: torch.Tensor) -> None:
        self.k, self.v = self.k.index_select(1, rows), self.v.index_select(1, rows)
        if self._lengths is not None:
            self._set_lengths(self._lengths.index_select(0, rows))


@pytest.fixture
def uninitialised_is_nan():
    """torch.empty and its kin fill new memory with NaN (torch's deterministic mode), as memory never
    written may hold."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = before[2]


@pytest.mark.parametrize("seed", range(12))
def test_select_keeps_every_rows_positions_as_a_whole_copy_does(seed, uninitialised_is_nan):
    """Guards against select mixing rows: it moves rows that stay down in the same storage (rows
    leaving), or gathers the positions in use first (rows reordered, repeated, more rows). After any
    sequence of appends, per-row truncates and selects, every row's keys and values over the
    positions it holds, and what append returns there, equal those of a cache that copies the whole
    storage by index_select. And the storage, made uninitialised (NaN here) and zeroed only as calls
    reach it, never hands attention a NaN: every position append returns is a number, a row's masked
    ones past its length included (a masked weight is 0, and 0 x NaN is NaN)."""
    g = torch.Generator().manual_seed(seed)
    B = 5
    ours, whole = (
        cls(2, B, 2, 3, capacity=int(torch.randint(1, 6, (1,), generator=g)), dtype=torch.float64)
        for cls in (KVCache, WholeCopyCache)
    )
    for step in range(14):
        n = ours.batch
        q = int(torch.randint(1, 4, (1,), generator=g))
        k, v = (
            torch.randn(n, 2, q, 3, generator=g, dtype=torch.float64),
            torch.randn(n, 2, q, 3, generator=g, dtype=torch.float64),
        )
        for layer in range(2):
            got, want = ours.append(layer, k, v), whole.append(layer, k, v)
            assert all(bool(x.isfinite().all()) for x in got)
            for b, length in enumerate(ours.lengths.tolist()):
                for x, y in zip(got, want):
                    assert torch.equal(x[b, :, : length + q], y[b, :, : length + q])
        ours.advance(q)
        whole.advance(q)
        if step % 3 == 1:  # per-row truncates: a ragged cache
            cut = [int(torch.randint(0, length + 1, (1,), generator=g)) for length in ours.lengths.tolist()]
            ours.truncate(cut)
            whole.truncate(cut)
        kind = step % 4
        if kind == 0 and n > 1:  # rows leave, in order
            keep = torch.randperm(n, generator=g)[: int(torch.randint(1, n, (1,), generator=g))].sort().values
        elif kind == 2:  # rows reordered and repeated, the batch growing or shrinking
            keep = torch.randint(0, n, (int(torch.randint(1, B + 3, (1,), generator=g)),), generator=g)
        else:
            continue
        ours.select(keep)
        whole.select(keep)
        assert torch.equal(ours.lengths, whole.lengths) and ours.batch == whole.batch == len(keep)
        for b, length in enumerate(ours.lengths.tolist()):
            assert torch.equal(ours.k[:, b, :, :length], whole.k[:, b, :, :length])
            assert torch.equal(ours.v[:, b, :, :length], whole.v[:, b, :, :length])


def test_memory_select_matches_separate_encoding():
    """Guards against beam search reading another sentence's source after Memory.select."""
    m = tiny_model(5)
    src = random_src(5, 3, 40)
    with torch.inference_mode():
        mem = m.encode(src).select(torch.tensor([2, 2, 0]))
        alone = m.encode(src[2:3])
        S = alone.states.shape[1]
        assert (mem.states[0, :S] - alone.states[0]).abs().max() < 1e-12
        assert torch.equal(mem.src_pad[0], mem.src_pad[1])


def test_float32_and_positions_dtype():
    """Guards against the sinusoid table staying float32 in a float64 model (and vice versa)."""
    m = tiny_model(0)
    assert m.positions.dtype == torch.float64
    m32 = m.float()
    assert m32.positions.dtype == torch.float32
    with torch.inference_mode():
        out = m32.decode(torch.tensor([[BOS_ID]]), m32.encode(random_src(0, 1, 40)), m32.new_cache(1))
    assert out.dtype == torch.float32


def test_too_long_sequence_is_refused():
    """Guards against silently indexing past the position table."""
    m = tiny_model(0, max_positions=8)
    with pytest.raises(ValueError, match="max_positions"):
        m.encode(torch.full((1, 9), 6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_matches_cpu():
    """Guards against device mix-ups (masks or caches created on the CPU)."""
    from refdec.decoding import decode_greedy

    m = tiny_model(1, vocab=12)
    src = random_src(1, 3, 12)
    cpu = decode_greedy(m, src, max_len=15)
    gpu = decode_greedy(m.cuda(), src.cuda(), max_len=15)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu.tokens, gpu.tokens))


@pytest.mark.parametrize("bias", [True, False])
def test_few_row_route_computes_the_linear_map(bias):
    """refdec.routes.kernels.linear: the (W @ x.T).T route for 2-16 rows on CPU gives F.linear's values (the
    same products, at most summed in another order) and keeps the shape for every row count."""
    from refdec.routes import kernels as M

    g = torch.Generator().manual_seed(0)
    W = torch.randn(24, 8, generator=g, dtype=torch.float64)
    b = torch.randn(24, generator=g, dtype=torch.float64) if bias else None
    for shape in [(1, 1, 8), (1, 2, 8), (3, 5, 8), (1, 16, 8), (1, 17, 8), (4, 8)]:
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        rows = x.numel() // 8
        with torch.no_grad():
            assert M.few_row_route(x) == (2 <= rows <= 16)
            y = M.linear(x, W, b)
        assert y.shape == (*shape[:-1], 24)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, W, b), rtol=1e-12, atol=1e-12)
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    assert not M.few_row_route(x)  # training (grad enabled) always takes F.linear


def test_a_loaded_model_is_torch_layers_and_its_twin_replaces_every_leaf():
    """model.py builds torch's own layers, and a loaded checkpoint is one (the reference route: its
    linear layers exactly nn.Linear); a route's twin gives a model (proposal heads too) leaves of its
    own, each linear layer, layer norm, attention and output product its routed class holding the
    model's very parameters (the same state dict), the composite modules of the model's classes, and
    leaves the model's modules as they were (float64: the same logits within rounding)."""
    from refdec.checkpoint import load_model
    from refdec.proposal import ProposalHeads
    from refdec.routes import kernels as M

    for module in (tiny_model(0), ProposalHeads(16, 8, 3)):
        linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(type(m) is torch.nn.Linear for m in linears)
        before = [type(m) for m in module.modules()]
        routed = M.twin(module, M.Kernels(few_rows=True))
        assert [type(m) for m in module.modules()] == before
        assert [type(m) for m in routed.modules()] == [M.LEAVES.get(t, t) for t in before]
        assert not {id(m) for m in routed.modules()} & {id(m) for m in module.modules()}
        assert routed.state_dict().keys() == module.state_dict().keys()
        assert all(a is b for a, b in zip(routed.parameters(), module.parameters()))
    plain = tiny_model(5, vocab=40)
    routed = M.KernelRoute(plain, M.Kernels(few_rows=True))
    src, tgt = random_src(5, 2, 40), torch.tensor([[BOS_ID, 7, 8, 9]] * 2)
    with torch.no_grad():
        a = plain.decode(tgt, plain.encode(src), plain.new_cache(2))
        b = routed.decode(tgt, routed.encode(src), routed.new_cache(2))
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    loaded = load_model(REPO / "checkpoints" / "gec-uk" / "model.pt", task="gec-uk", device="cpu", dtype=torch.float32)[
        0
    ]
    linears = [m for m in loaded.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is torch.nn.Linear for m in linears)
    assert all(
        type(m) in (torch.nn.LayerNorm, torch.nn.Linear)
        for m in loaded.modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm))
    )


def test_the_few_row_product_is_the_kernels_choice_per_wrapper():
    """Kernels(few_rows=False) computes F.linear everywhere, bitwise the model's own logits (the
    reference route, as taken with gradients on too); Kernels(few_rows=True) makes the linear
    layers take (W @ x.T).T, on the same weights, and the model itself stays plain."""
    from refdec.routes.kernels import KernelRoute, Kernels

    m = tiny_model(3, vocab=40)
    src, tgt = random_src(3, 1, 40), torch.tensor([[BOS_ID, 7, 8, 9]])

    def logits(model, grad: bool = False) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return model.decode(tgt, model.encode(src), model.new_cache(1)).detach()

    plain, few = KernelRoute(m, Kernels()), KernelRoute(m, Kernels(few_rows=True))
    assert torch.equal(logits(plain), logits(m)) and torch.equal(logits(m), logits(m, True))
    x = torch.randn(1, 4, m.cfg.d_model, dtype=torch.float64)
    w1, few_w1 = m.decoder[0].ff.w1, few.twin.decoder[0].ff.w1
    with torch.no_grad():
        assert torch.equal(w1(x), torch.nn.functional.linear(x, w1.weight, w1.bias))
        assert torch.equal(few_w1(x), torch.addmm(w1.bias[:, None], w1.weight, x[0].t()).t()[None])
    torch.testing.assert_close(logits(few), logits(m), rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_stepcost_times_both_routes_every_round(trained_tiny, tmp_path):
    """refdec.commands.stepcost: a cost per q for the few-row and for the plain route, and both one-row
    projection timings."""
    import json

    from refdec.commands.stepcost import main

    rep = tmp_path / "cost.json"
    assert (
        main(
            [
                "--model",
                str(trained_tiny / "model.pt"),
                "--q",
                "1,2,4",
                "--rounds",
                "2",
                "--threads",
                "1",
                "--src",
                "8",
                "--prefix",
                "8",
                "--report",
                str(rep),
            ]
        )
        == 0
    )
    r = json.loads(rep.read_text())
    assert [c["q"] for c in r["calls"]] == [1, 2, 4]
    assert all(c["ms"] > 0 and c["plain_ms"] > 0 for c in r["calls"])
    assert r["calls"][0]["ratio"] == 1.0 and r["calls"][0]["plain_ratio"] == 1.0
    assert set(r["projection_ms"]) == {"strided W.t()", "contiguous copy"}
    assert r["rows"] == 1 and r["encoder_ms"] > 0
    assert r["environment"]["threads"] == 1 and r["environment"]["cpu"] and r["environment"]["cpu_capability"]
    assert all(c["ms_per_position"] == pytest.approx(c["ms"] / c["q"]) for c in r["calls"])


@pytest.mark.slow
def test_stepcost_times_calls_of_several_rows(trained_tiny, tmp_path, capsys):
    """refdec.commands.stepcost --rows: every call decodes that many rows; the cost per position divides by
    rows x q, and the encoder is timed over as many sources (with --ragged-src of unequal lengths, padded);
    --fast and --graphed add those routes' costs; a device torch does not know is refused."""
    import json

    from refdec.commands.stepcost import main

    rep = tmp_path / "cost.json"
    assert (
        main(
            [
                "--model",
                str(trained_tiny / "model.pt"),
                "--rows",
                "3",
                "--q",
                "1,4",
                "--rounds",
                "1",
                "--threads",
                "1",
                "--src",
                "5",
                "--prefix",
                "4",
                "--fast",
                "--graphed",
                "--device",
                "cpu",
                "--report",
                str(rep),
            ]
        )
        == 0
    )
    r = json.loads(rep.read_text())
    assert r["rows"] == 3 and r["encoder_ms"] > 0
    assert all(c["fast_ms"] > 0 for c in r["calls"]) and r["calls"][0]["fast_ratio"] == 1.0
    assert 0 < r["fast_products_ms"] < r["calls"][0]["fast_ms"] and r["fast_encoder_ms"] > 0
    assert all(c["graphed_ms"] > 0 for c in r["calls"]) and r["graphed_encoder_ms"] > 0 and r["device"] == "cpu"
    assert [c["ms_per_position"] == pytest.approx(c["ms"] / (3 * c["q"])) for c in r["calls"]] == [True, True]
    out = capsys.readouterr().out
    assert "decoder call of 3 row(s)" in out and "encoder over 3 source(s) of 5 tokens" in out
    assert "; fast route" in out and "; graphed route" in out and "matrix products alone" in out
    assert (
        main(
            [
                "--model",
                str(trained_tiny / "model.pt"),
                "--rows",
                "4",
                "--q",
                "1",
                "--rounds",
                "1",
                "--threads",
                "1",
                "--src",
                "10",
                "--prefix",
                "4",
                "--fast",
                "--ragged-src",
                "--report",
                str(rep),
            ]
        )
        == 0
    )
    r = json.loads(rep.read_text())  # sources of 2, 5, 8 and 10 tokens, padded to 10
    assert r["ragged_src"] and r["source_tokens"] == 25 and r["encoder_ms"] > 0 and r["fast_encoder_ms"] > 0
    assert "encoder over 4 source(s) of 1-10 tokens (25 in all, padded to 10)" in capsys.readouterr().out
    assert main(["--model", str(trained_tiny / "model.pt"), "--rows", "0"]) == 2
    assert main(["--model", str(trained_tiny / "model.pt"), "--device", "no-such-device"]) == 2
