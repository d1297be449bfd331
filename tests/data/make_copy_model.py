"""Trains the tests' copying model and writes it to tests/data/copy_model.pt:

    python tests/data/make_copy_model.py

The model (conftest's copy_model) learns rewrite_target, copy with two edits, in 400 float32 Adam steps.
It is shipped rather than trained at test time because its weights depend on the CPU: float32 training
rounds differently on another instruction set, so the weights, and every figure the tests and the docs
quote from the model (the exercise of docs/algorithms.md: the first divergence, its logit margin, the
failed and passed counts, checked by tests/test_exercise.py), would differ from one machine to another.
Loaded from this file, every machine decodes with the same weights.

The recipe is the one copy_model trained with (seed 0, 400 steps, one torch thread): on the machine that
wrote the file the saved weights are bit-identical to what that training gave. The file holds the
float32 state dict and the ModelConfig as a dict, no optimizer state, and loads with weights_only=True.
Running the script again rewrites the file; on another CPU it may write other weights.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/, for conftest's rewrite_target

from conftest import rewrite_target  # noqa: E402

from refdec.config import BOS_ID, EOS_ID, PAD_ID, ModelConfig  # noqa: E402
from refdec.model import Transformer  # noqa: E402

PATH = HERE / "copy_model.pt"
CONFIG = ModelConfig(
    vocab_size=16, d_model=48, n_heads=4, d_ff=96, enc_layers=1, dec_layers=2, dropout=0.0, max_positions=64
)


def train(seed: int = 0, steps: int = 400, batch: int = 32) -> Transformer:
    """The float32 model after `steps` Adam steps (lr 3e-3) on batches of random sources of 1-12 tokens
    from the real vocabulary (>= 5) and their rewrite_target, drawn from a generator seeded with `seed`."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    vocab = CONFIG.vocab_size
    m = Transformer(CONFIG)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lens = torch.randint(1, 13, (batch,), generator=g).tolist()
        srcs = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lens]
        tgts = [rewrite_target(s) for s in srcs]
        src = torch.full((batch, max(map(len, srcs)) + 1), PAD_ID, dtype=torch.long)
        tgt = torch.full((batch, max(map(len, tgts)) + 2), PAD_ID, dtype=torch.long)
        for i, (s, t) in enumerate(zip(srcs, tgts)):
            src[i, : len(s) + 1] = torch.tensor(s + [EOS_ID])
            tgt[i, : len(t) + 2] = torch.tensor([BOS_ID] + t + [EOS_ID])
        logits = m(src, tgt[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tgt[:, 1:].reshape(-1), ignore_index=PAD_ID)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


def save(model: Transformer, path: Path = PATH) -> None:
    """Writes the float32 weights (tied matrices stored once) and the config."""
    torch.save({"config": dataclasses.asdict(model.cfg), "state_dict": model.float().state_dict()}, path)


def load(path: Path = PATH) -> Transformer:
    """The float32 model of the file, in eval mode."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    m = Transformer(ModelConfig(**saved["config"]))
    m.load_state_dict(saved["state_dict"])
    return m.eval()


if __name__ == "__main__":
    save(train())
    print(f"wrote {PATH} ({PATH.stat().st_size / 1024:.0f} KB)")
