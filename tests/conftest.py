"""Shared fixtures: tiny random models in float64 (exactness) and a tiny trained checkpoint (CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refdec.config import EOS_ID, ModelConfig
from refdec.model import Transformer

REPO = Path(__file__).resolve().parent.parent
torch.set_num_threads(1)


def tiny_model(seed: int, vocab: int = 40, *, d_model: int = 32, n_heads: int = 4, layers: tuple[int, int] = (2, 2),
               norm_first: bool = True, tie: bool = False, max_positions: int = 64) -> Transformer:
    """A random float64 model in eval mode whose greedy outputs vary (untied, spread-out output
    weights; random tied models tend to repeat their input token). With a small vocabulary eos comes
    early in many sentences; with a larger one most run to max_len."""
    torch.manual_seed(seed)
    m = Transformer(ModelConfig(vocab_size=vocab, d_model=d_model, n_heads=n_heads, d_ff=2 * d_model,
                                enc_layers=layers[0], dec_layers=layers[1], dropout=0.1, norm_first=norm_first,
                                tie_embeddings=tie, max_positions=max_positions))
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


def run_py(*args: str, stdin: bytes | None = None, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, input=stdin, capture_output=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory) -> Path:
    """A checkpoint of the `tiny` preset trained for a few seconds on real mt-en-de pairs."""
    out = tmp_path_factory.mktemp("tiny")
    r = run_py("train.py", "--preset", "tiny", "--out-dir", str(out), "--train-limit", "1500",
               "--max-steps", "12", "--eval-every", "6", "--threads", "1")
    assert r.returncode == 0, r.stderr.decode()
    return out


def rewrite_target(src: list[int]) -> list[int]:
    """The toy rewriting task copy_model learns: copy, except token 5 becomes 6 and token 7 is dropped
    (a GEC-like mix of kept, substituted and deleted tokens)."""
    return [6 if t == 5 else t for t in src if t != 7]


_COPY_MODELS: dict = {}


def copy_model(seed: int = 0, steps: int = 400) -> Transformer:
    """A tiny float64 model trained for a few seconds on rewrite_target: it copies most of its input,
    so input-guided drafts are long and are both accepted and rejected (a random model copies nothing)."""
    key = (seed, steps)
    if key in _COPY_MODELS:
        return _COPY_MODELS[key]
    torch.manual_seed(seed)
    vocab = 16
    m = Transformer(ModelConfig(vocab_size=vocab, d_model=48, n_heads=4, d_ff=96, enc_layers=1, dec_layers=2,
                                dropout=0.0, max_positions=64))
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lens = torch.randint(1, 13, (32,), generator=g).tolist()
        srcs = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lens]
        tgts = [rewrite_target(s) for s in srcs]
        S = max(map(len, srcs)) + 1
        T = max(map(len, tgts)) + 2
        src = torch.zeros(32, S, dtype=torch.long)
        tgt = torch.zeros(32, T, dtype=torch.long)
        for i, (s, t) in enumerate(zip(srcs, tgts)):
            src[i, : len(s) + 1] = torch.tensor(s + [EOS_ID])
            tgt[i, : len(t) + 2] = torch.tensor([1] + t + [EOS_ID])
        logits = m(src, tgt[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tgt[:, 1:].reshape(-1), ignore_index=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    m = m.double().eval()
    _COPY_MODELS[key] = m
    return m


@pytest.fixture(scope="session")
def tiny_extras(trained_tiny, tmp_path_factory) -> dict:
    """Second models for the CLI tests, trained for seconds from the tiny checkpoint: blockwise
    proposal heads (k = 3) and a GAD block drafter (k = 4)."""
    out = tmp_path_factory.mktemp("extras")
    made = {}
    for name, extra in (("heads", ["--proposal-k", "3", "--freeze-base", "true"]), ("drafter", ["--drafter-k", "4"])):
        r = run_py("train.py", "--preset", "tiny", "--out-dir", str(out / name), "--train-limit", "800",
                   "--max-steps", "4", "--eval-every", "4", "--threads", "1", "--init-from",
                   str(trained_tiny / "model.pt"), *extra)
        assert r.returncode == 0, r.stderr.decode()
        made[name] = out / name / "model.pt"
    return made
