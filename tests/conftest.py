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
