"""Shared fixtures and helpers: tiny random models in float64 (exactness), a tiny trained checkpoint (CLI),
the batch-1 greedy reference and row-by-row comparisons, adversarial drafts, commands' one-line errors, and
a tiny corpus of one's own task (own_corpus)."""

from __future__ import annotations

import copy
import functools
import gzip
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refdec.adapters import SharedEncoder
from refdec.app.exactness import divergences
from refdec.checkpoint import make_checkpoint, save_atomic
from refdec.config import EOS_ID, PAD_ID, ModelConfig
from refdec.decoding import decode_bild, decode_blockwise, decode_gad, decode_greedy, decode_iad, decode_speculative
from refdec.decoding import gad as gad_module
from refdec.drafter import Drafter
from refdec.model import Transformer
from refdec.proposal import ProposalHeads
from refdec.routes import on_route
from refdec.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread():
    """Every test starts on one torch thread. A command run in-process sets torch's count for the whole
    process (its --threads, or its default); left at two, every later test's OpenMP threads wait for each
    other whenever another process holds a core, which made the suite several times slower on a shared
    machine."""
    torch.set_num_threads(1)
    yield


def tiny_model(
    seed: int,
    vocab: int = 40,
    *,
    d_model: int = 32,
    n_heads: int = 4,
    layers: tuple[int, int] = (2, 2),
    norm_first: bool = True,
    tie: bool = False,
    max_positions: int = 64,
) -> Transformer:
    """A random float64 model in eval mode whose greedy outputs vary (untied, spread-out output
    weights; random tied models tend to repeat their input token). With a small vocabulary eos comes
    early in many sentences; with a larger one most run to max_len. A plain Transformer, as every
    loaded checkpoint is (the reference route)."""
    torch.manual_seed(seed)
    m = Transformer(
        ModelConfig(
            vocab_size=vocab,
            d_model=d_model,
            n_heads=n_heads,
            d_ff=2 * d_model,
            enc_layers=layers[0],
            dec_layers=layers[1],
            dropout=0.1,
            norm_first=norm_first,
            tie_embeddings=tie,
            max_positions=max_positions,
        )
    )
    with torch.no_grad():
        m.tgt_embed.weight.normal_(0, 1)
        proj = m.tgt_embed.weight if tie else m.out_proj.weight
        proj.normal_(0, 0.6)
    return m.double().eval()


def random_src(seed: int, batch: int, vocab: int, min_len: int = 1, max_len: int = 10) -> torch.Tensor:
    """(B, S) right-padded sources of random lengths, each ending in eos, tokens from the real vocabulary (>= 5)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (batch,), generator=g).tolist()
    rows = [torch.randint(5, vocab, (n,), generator=g).tolist() + [EOS_ID] for n in lens]
    out = torch.zeros(batch, max(map(len, rows)), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def run_py(
    *args: str, stdin: bytes | None = None, timeout: int = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        input=stdin,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory) -> Path:
    """A checkpoint of the `tiny` preset trained for a few seconds on real mt-en-de pairs."""
    out = tmp_path_factory.mktemp("tiny")
    r = run_py(
        "train.py",
        "--preset",
        "tiny",
        "--out-dir",
        str(out),
        "--train-limit",
        "1500",
        "--max-steps",
        "12",
        "--eval-every",
        "6",
        "--threads",
        "1",
    )
    assert r.returncode == 0, r.stderr.decode()
    return out


def rewrite_target(src: list[int]) -> list[int]:
    """The toy rewriting task copy_model learns: copy, except token 5 becomes 6 and token 7 is dropped
    (a GEC-like mix of kept, substituted and deleted tokens)."""
    return [6 if t == 5 else t for t in src if t != 7]


COPY_MODEL = REPO / "tests" / "data" / "copy_model.pt"  # written by tests/data/make_copy_model.py


@functools.cache
def copy_model() -> Transformer:
    """A tiny float64 model trained on rewrite_target: it copies most of its input, so input-guided
    drafts are long and are both accepted and rejected (a random model copies nothing). Shipped, trained
    in float32 once by tests/data/make_copy_model.py (whose docstring says why: weights that do not
    depend on the CPU), and loaded here in float64, eval mode; one model for the whole session."""
    saved = torch.load(COPY_MODEL, map_location="cpu", weights_only=True)
    m = Transformer(ModelConfig(**saved["config"]))
    m.load_state_dict(saved["state_dict"])
    return m.double().eval()


@pytest.fixture(scope="session")
def tiny_extras(trained_tiny, tmp_path_factory) -> dict:
    """The drafter and the heads for the CLI tests, trained for seconds from the tiny checkpoint:
    blockwise proposal heads (k = 3) and a GAD block drafter (k = 4)."""
    out = tmp_path_factory.mktemp("extras")
    made = {}
    for name, flags in (("heads", ["--proposal-k", "3", "--freeze-base", "true"]), ("drafter", ["--drafter-k", "4"])):
        r = run_py(
            "train.py",
            "--preset",
            "tiny",
            "--out-dir",
            str(out / name),
            "--train-limit",
            "800",
            "--max-steps",
            "4",
            "--eval-every",
            "4",
            "--threads",
            "1",
            "--init-from",
            str(trained_tiny / "model.pt"),
            *flags,
        )
        assert r.returncode == 0, r.stderr.decode()
        made[name] = out / name / "model.pt"
    return made


def first_divergence(expected: torch.Tensor, got: torch.Tensor, model=None, src: torch.Tensor | None = None) -> str:
    """Where a decoder's tokens `got` part from greedy's `expected`: the first differing position and
    the tokens from there on, each side named; given the model and the row's source (1, S), also the
    model's top-1/top-2 logit margin there (refdec.app.exactness.divergences): a near-tie or a bug."""
    n = min(len(expected), len(got))
    pos = next((i for i in range(n) if expected[i] != got[i]), n)
    text = (
        f"first divergence at position {pos}: expected {expected[pos : pos + 3].tolist()}, "
        f"got {got[pos : pos + 3].tolist()}"
    )
    if len(expected) != len(got):
        text += f" (expected {len(expected)} tokens, got {len(got)})"
    if model is not None and src is not None and not torch.equal(expected, got):
        ids = [t for t in src[0].tolist() if t != model.cfg.pad_id][:-1]  # the source without its eos
        d = divergences(model, [ids], [expected], [got], src.device)
        text += f"; top-1/top-2 logit margin {d[0]['margin_top1_top2']:.3g}" if d else ""
    return text


def alone(src: torch.Tensor, b: int) -> torch.Tensor:
    """Source row b as a batch of one, without padding."""
    return src[b : b + 1, : max(1, int(src[b].ne(PAD_ID).sum()))]


def batch1_greedy(model, src: torch.Tensor, max_len: int) -> list[torch.Tensor]:
    return [decode_greedy(model, alone(src, b), max_len=max_len).tokens[0] for b in range(src.shape[0])]


def assert_rows_equal(got, ref, what: str, model=None, src: torch.Tensor | None = None):
    """The exactness tests' token comparison, made before any other assertion on a run: a decoder's
    rows `got` equal the reference rows `ref` (greedy's) with torch.equal, and a failure names the row
    and the first position where they part (first_divergence; with the model and the source batch,
    the logit margin there)."""
    assert len(got) == len(ref), f"{what}: {len(got)} rows, expected {len(ref)}"
    for b, (x, y) in enumerate(zip(got, ref)):
        row = src[b : b + 1] if src is not None else None
        assert torch.equal(x, y), f"{what}, row {b}: {first_divergence(y, x, model, row)}"


def invariant_copy(model, dtype):
    return on_route(copy.deepcopy(model).to(dtype), "invariant")


def check_batched_iad(model, src, max_len, **knobs):
    ref = batch1_greedy(model, src, max_len)
    r = decode_iad(model, src, max_len=max_len, trace=True, **knobs)
    assert_rows_equal(r.tokens, ref, f"B={src.shape[0]} max_len={max_len} {knobs}")
    singles = (
        [decode_iad(model, alone(src, b), max_len=max_len, **knobs) for b in range(src.shape[0])]
        if src.shape[0] <= 6
        else []
    )
    if singles:  # each row drafts what it drafts alone, so the batch makes as many calls as its slowest row
        assert r.stats.verifier_calls == max(s.stats.verifier_calls for s in singles)
        assert sorted(r.stats.committed) == sorted(a for s in singles for a in s.stats.committed)
    return r


def random_heads(model, k: int, seed: int) -> ProposalHeads:
    torch.manual_seed(seed)
    h = ProposalHeads(model.cfg.d_model, 16, k)
    with torch.no_grad():
        h.w2.weight.normal_(0, 0.5)
        h.w2.bias.normal_(0, 0.5)
    return h.double().eval()


def ragged_src(seed: int, batch: int, vocab: int) -> torch.Tensor:
    """Sources of 0-13 tokens (0: eos alone) for `batch` rows."""
    return random_src(seed, batch, vocab, min_len=0 if batch > 2 else 1, max_len=13)


def adversarial_drafter(refs: list[list[int]], seed: int, vocab: int):
    """A stand-in for draft_blocks that knows each row's greedy output (refs, eos included) and
    corrupts it: per row and call, the block is right, right up to one wrong token, all wrong, runs
    past eos (eos inside the draft) or is empty; lengths vary from row to row."""
    g = torch.Generator().manual_seed(seed)

    def draft(drafter, memory, cache, sequences, k, layout):
        out = []
        for sequence in sequences:
            j = len(sequence) - 1
            rows = [r for r in refs if r[:j] == sequence[1:]] or [[5] * (j + k)]  # rows sharing this output so far
            row = rows[int(torch.randint(0, len(rows), (1,), generator=g))]
            n = int(torch.randint(0, k + 1, (1,), generator=g))
            block = (row + [EOS_ID] * (k + 3))[j : j + n]
            how = int(torch.randint(0, 4, (1,), generator=g))
            if how == 1 and block:
                i = int(torch.randint(0, len(block), (1,), generator=g))
                block[i] = (block[i] + 1) % vocab
            elif how == 2:
                block = [(t + 3) % vocab for t in block]
            out.append(block)
        return out

    return draft


def fake_models():
    """The Models record of a run whose decoder needs no model, only the special ids."""
    from types import SimpleNamespace

    from refdec.app.loading import Models

    return Models(SimpleNamespace(cfg=SimpleNamespace(eos_id=EOS_ID, pad_id=0)), Path("fake.pt"))


def shared_small(large, seed: int = 7, d_model: int = 16):
    """A random float64 decoder without an encoder, reading `large`'s encoder states."""
    torch.manual_seed(seed)
    small = Transformer(
        ModelConfig(
            vocab_size=large.cfg.vocab_size,
            d_model=d_model,
            n_heads=2,
            d_ff=2 * d_model,
            enc_layers=0,
            dec_layers=1,
            d_memory=large.cfg.d_model,
            tie_embeddings=False,
            max_positions=large.cfg.max_positions,
        )
    )
    return SharedEncoder(small.double().eval(), large)


def check_lossless_decoders(route_copy, batch: int, monkeypatch) -> Transformer:
    """Every lossless decoder on a route (`route_copy(model)`: the model on it): batched IAD
    (a copying model: long drafts accepted and rejected), GAD (a real drafter and an adversarial one),
    blockwise (random heads), speculative (self-drafted and a random small model) and BiLD at its
    greedy limit, each equal row by row to batch-1 greedy on the same route (float64, torch.equal).
    Returns the verifier."""
    copying = route_copy(copy_model())
    src = random_src(100 + batch, batch, 16, min_len=1, max_len=14)
    check_batched_iad(copying, src, 30)
    check_batched_iad(copying, src, 30, max_draft=3, match="longest")

    vocab = 12 if batch % 2 else 40
    m = route_copy(tiny_model(batch, vocab=vocab))
    small = route_copy(tiny_model(batch + 100, vocab=vocab, d_model=16, layers=(1, 1)))
    drafter = Drafter(route_copy(tiny_model(batch + 50, vocab=vocab, layers=(1, 2))), k=1 + batch % 5)
    src = ragged_src(300 + batch, batch, vocab)
    for max_len in (25, 4):
        ref = batch1_greedy(m, src, max_len)
        what = f"B={batch} max_len={max_len}"
        assert_rows_equal(decode_greedy(m, src, max_len=max_len).tokens, ref, f"batched greedy {what}")
        assert_rows_equal(decode_gad(m, drafter, src, max_len=max_len).tokens, ref, f"gad {what}")
        refs = [t.tolist() + [EOS_ID] for t in ref]
        with monkeypatch.context() as mp:
            mp.setattr(gad_module, "draft_blocks", adversarial_drafter(refs, batch + max_len, vocab))
            assert_rows_equal(
                decode_gad(m, Drafter(drafter.model, k=6), src, max_len=max_len).tokens, ref, f"gad adversarial {what}"
            )
        assert_rows_equal(
            decode_blockwise(m, random_heads(m, 3, batch), src, max_len=max_len).tokens, ref, f"blockwise {what}"
        )
        assert_rows_equal(
            decode_speculative(m, m, src, max_len=max_len, gamma=4).tokens, ref, f"speculative self {what}"
        )
        assert_rows_equal(
            decode_speculative(m, small, src, max_len=max_len, gamma=1 + batch % 4).tokens, ref, f"speculative {what}"
        )
        assert_rows_equal(
            decode_bild(m, small, src, max_len=max_len, fallback_threshold=1.5).tokens,
            ref,
            f"bild (large writes) {what}",
        )
    return m


def error_of(main, argv: list[str], capsys, monkeypatch) -> str:
    """The one line main(argv) prints on stderr, checked to be an error with exit status 2."""
    monkeypatch.chdir(REPO)
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (code, err)
    return err


TEXTS = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "der Hund lief im Park",
    "the park",
    "a cat",
    "on the mat the dog sat",
    "im Park lief der Hund",
    "the dog ran",
]


def random_checkpoint(path: Path, seed: int = 0, eos_bias: float = 0.0) -> Path:
    """A random tied pre-norm refdec model (conftest's tiny_model) on a byte-level tokenizer of TEXTS.
    Its outputs run to max_len; `eos_bias` adds that much to eos's logit (through the final decoder
    norm's bias): 14 makes eos the first output token of some sources and not of others."""
    tok = Tokenizer.train(TEXTS * 5, vocab_size=300, min_frequency=1)
    model = tiny_model(seed, tok.vocab_size, d_model=16, n_heads=2, tie=True).float()
    with torch.no_grad():
        e = model.tgt_embed.weight[tok.eos_id]
        model.dec_norm.bias += eos_bias * e / e.norm() ** 2
    path.mkdir(parents=True, exist_ok=True)
    save_atomic(make_checkpoint(model, "mt-en-de", tok, step=1), path / "model.pt")
    tok.save(path / "tokenizer.json")
    return path / "model.pt"


def fake_cpu(monkeypatch, capability: str, flags: set[str] | None) -> None:
    """Makes refdec.machine see a CPU that torch reports as `capability`, with `flags` in /proc/cpuinfo
    (None: a system that lists none)."""
    from refdec import machine

    monkeypatch.setattr(machine, "cpu_capability", lambda: capability)
    monkeypatch.setattr(machine, "cpu_flags", lambda: None if flags is None else frozenset(flags))


ZEN3_FLAGS = {"sse4_2", "avx", "avx2", "fma"}  # an AMD EPYC that torch reports as AVX2: no AVX-512, no VNNI
AVX512_FLAGS = ZEN3_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}


def one_line_error(r) -> str:
    err = r.stderr.decode().strip()
    assert r.returncode != 0 and "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error:"), err
    return err


OWN_CORPUS_WORDS = "the a cat dog sat on mat red blue big small house tree runs sees eats".split()


def own_corpus(data_dir: Path, task: str = "up", n_train: int = 200, n_test: int = 4, gz: bool = False) -> Path:
    """A task of one's own in data_dir/task: each target is its source's words in reverse order;
    train and test files only (plain text, or gzip with `gz`). Returns data_dir."""
    rng = random.Random(5)
    folder = data_dir / task
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        src = [" ".join(rng.choice(OWN_CORPUS_WORDS) for _ in range(rng.randint(2, 6))) for _ in range(n)]
        for side, lines in (("src", src), ("tgt", [" ".join(reversed(s.split())) for s in src])):
            text = "".join(line + "\n" for line in lines).encode("utf-8")
            if gz:
                (folder / f"{split}.{side}.gz").write_bytes(gzip.compress(text))
            else:
                (folder / f"{split}.{side}").write_bytes(text)
    return data_dir


def counting_probes(monkeypatch) -> list:
    """refdec.routes.probes.probe_plan made to record each (in, out, threads) it probes, in the list returned."""
    from refdec.routes import probes

    probed, probe_plan = [], probes.probe_plan

    def counted(k, n, kernels):
        probed.append((k, n, torch.get_num_threads()))
        return probe_plan(k, n, kernels)

    monkeypatch.setattr(probes, "probe_plan", counted)
    return probed
