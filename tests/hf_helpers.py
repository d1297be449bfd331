"""Transformers model folders for the refdec.hf tests: a random M2M100 model saved by transformers with a
word-level tokenizer.json (words w0..w39 and two language codes), and random sources in its vocabulary.
Needs transformers (imported here, so conftest does not)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")


WORDS = [f"w{i}" for i in range(40)]
LANGS = ["__en__", "__de__"]


def word_tokenizer_json() -> str:
    """An M2M100-like vocabulary: <s> 0, <pad> 1, </s> 2, <unk> 3, words, then language codes."""
    from tokenizers import Tokenizer as Tok
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>"] + WORDS)}
    tok = Tok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>"] + LANGS)
    return tok.to_str()


def m2m_folder(path: Path, seed: int = 0, **over) -> Path:
    """A random M2M100 model (every weight perturbed: biases and norms are not their trivial init) saved
    by transformers, with a word-level tokenizer.json."""
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=4 + len(WORDS) + len(LANGS),
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        scale_embedding=True,
        activation_function="relu",
    )
    fields.update(over)
    model = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(**fields))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(word_tokenizer_json(), encoding="utf-8")
    return path


def sources(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, 4 + len(WORDS), (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
