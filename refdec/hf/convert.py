"""A transformers folder -> a refdec checkpoint: model.pt and its tokenizer.json, checked.

`python -m refdec hf import FOLDER --out DIR` reads the folder as decode.py reads it (refdec.hf.importing:
the family's mapping, its forced tokens, its banned tokens) and writes what train.py writes, so that
every command that takes a model.pt takes the folder's model: the weights in float32 (what the folder's
float16 or bfloat16 weights are exactly), its ModelConfig with the special ids and forced tokens in it,
and the folder's tokenizer.json beside it, recorded by its sha256 as a trained vocabulary is. The
checkpoint is marked `imported` (the architecture and the folder's name), which lets its model have
more embeddings than its tokenizer has tokens, as a transformers folder may (refdec.checkpoint.load_model).

Before it reports success the written model.pt is loaded back as any command loads it and compared with
transformers' model of the folder in float64, as `hf export` checks its own folder: logits within
LOGIT_TOLERANCE on two probes (a sentence, and a run of the vocabulary's ordinary tokens) and the same
greedy output; a checkpoint that fails the check is removed again. A folder whose weights float32
does not hold exactly (float64 ones) is written rounded to float32, as every checkpoint is, and its
logits are held to ROUNDED_TOLERANCE instead: what that rounding moves, not a wrong mapping, which
moves them by far more. An opus-mt folder whose tokenizer
is a sentencepiece model (no tokenizer.json) is refused: refdec reads it, but has no tokenizer.json to
write for it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..checkpoint import load_model, make_checkpoint, save_atomic
from ..tokenizer import Tokenizer
from .common import LOGIT_TOLERANCE, HFError, read_weights, require_transformers
from .compare import compare_with_folder
from .importing import load_folder

PROBE = "A short sentence to check the import."
ROUNDED_TOLERANCE = 1e-3  # logits of a float64 folder against its weights rounded to float32 (a checkpoint's)
PROBE_TOKENS = 24  # ordinary tokens of the vocabulary, evenly spaced, as the second probe


def held_exactly(folder: Path) -> bool:
    """Whether float32, the checkpoint's weights, holds every floating weight of the folder exactly
    (float32, float16 and bfloat16 weights; not float64 ones)."""
    return all(
        not w.is_floating_point() or torch.equal(w, w.float().to(w.dtype)) for w in read_weights(folder).values()
    )


def probes(tokenizer: Tokenizer) -> list[list[int]]:
    """The sources the check decodes: the probe sentence, and tokens spread over the whole vocabulary
    (special ones left out), so that a word-level vocabulary without the probe's words is checked too."""
    ordinary = [i for i in range(tokenizer.vocab_size) if i not in tokenizer.special_ids]
    step = max(1, len(ordinary) // PROBE_TOKENS)
    return [ids for ids in (tokenizer.encode(PROBE), ordinary[::step][:PROBE_TOKENS]) if ids]


def import_folder(
    folder: str | Path,
    out_dir: str | Path,
    *,
    task: str | None = None,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
) -> dict:
    """Write `out_dir`/model.pt and tokenizer.json for the transformers folder, then check them (module
    docstring). `task`: recorded in the checkpoint, for the commands that take --task beside --model."""
    folder, out = Path(folder), Path(out_dir)
    require_transformers()  # the check needs it: told before anything is written
    model, tokenizer, info = load_folder(folder, src_lang=src_lang, tgt_lang=tgt_lang)
    if not isinstance(tokenizer, Tokenizer):
        raise HFError(
            f"{folder} has no tokenizer.json (its tokenizer is source.spm and vocab.json): refdec reads "
            f"it, with decode.py --model {folder}, but has no tokenizer.json to write for it"
        )
    print(
        f"importing {folder} into {out}, then checking it against transformers (several seconds)",
        file=sys.stderr,
        flush=True,
    )
    checkpoint = make_checkpoint(model, task, tokenizer, step=0)
    checkpoint["imported"] = {"architecture": info["architecture"], "folder": folder.resolve().name}
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer.save(out / "tokenizer.json")
        save_atomic(checkpoint, out / "model.pt")
        back, back_tok, _ = load_model(out / "model.pt", task=task)
        result = compare_with_folder(back, folder, probes(back_tok))
        tolerance = LOGIT_TOLERANCE if held_exactly(folder) else ROUNDED_TOLERANCE
        if result["max_logit_difference"] > tolerance or not result["same_greedy"]:
            raise HFError(
                f"the imported {out / 'model.pt'} does not reproduce {folder}: {result['said']}; "
                f"nothing is left in {out}"
            )
    except BaseException:  # a checkpoint that failed its check (or was interrupted) is not left behind
        for name in ("model.pt", "tokenizer.json"):
            (out / name).unlink(missing_ok=True)
        if made:
            out.rmdir()
        raise
    return {
        "model": str(out / "model.pt"),
        "architecture": info["architecture"],
        "max_logit_difference": result["max_logit_difference"],
        "greedy_tokens": result["greedy_tokens"],
    }
