"""A run's data: the training pairs and dev set, the vocabulary, and the token ids of the pairs
(tokenized once per training set and vocabulary, and cached in refdec's cache folder: TokenCache).
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import torch

from .. import data as data_mod
from ..checkpoint import file_sha256, save_atomic
from ..config import TrainConfig
from ..repo import cache_folder, shown
from ..tokenizer import Tokenizer, iter_training_text
from .processes import Processes


def load_data(cfg: TrainConfig, log=None) -> tuple[list[tuple[str, str]], data_mod.Split, int]:
    """The training pairs and the dev set, each cut to train_limit / dev_limit when set, and how many
    training pairs were held out as the dev set (0: the task's folder has dev files; otherwise
    refdec.data.training_splits holds out the same pairs in every run, and a line of the log says so)."""
    data_dir = cfg.data_dir or data_mod.DATA_DIR
    train, dev, held_out = data_mod.training_splits(cfg.task, data_dir)
    if held_out and log is not None:
        log(
            f"dev: {shown(Path(data_dir) / cfg.task)} has no dev.src/dev.tgt, so {held_out} of its "
            f"{len(train) + held_out} training pairs are held out as the dev set (1 in {data_mod.DEV_SHARE}, at "
            f"most {data_mod.DEV_MAX}, the same pairs in every run; never trained on)"
        )
    if cfg.dev_limit:  # smoke runs: validate on the first dev pairs only
        dev = dev.rows(list(range(min(cfg.dev_limit, len(dev)))))
    pairs = list(zip(train.src, train.tgt))
    return (pairs[: cfg.train_limit] if cfg.train_limit else pairs), dev, held_out


def prepare_tokenizer(
    cfg: TrainConfig, procs: Processes, pairs: list[tuple[str, str]], base: dict | None, base_path: str, log
) -> Tokenizer:
    """out_dir/tokenizer.json (rank 0 writes it once): the starting model's (or the encoder's), the
    tokenizer_from file, or a new BPE trained on the pairs; then every rank reads it."""
    out = Path(cfg.out_dir)
    tok_path = out / "tokenizer.json"
    if procs.is_main() and not tok_path.exists():
        out.mkdir(parents=True, exist_ok=True)
        if base is not None:  # the starting model (or the encoder's) brings its vocabulary
            shutil.copyfile(Path(base_path).parent / "tokenizer.json", tok_path)
        elif cfg.tokenizer_from:
            shutil.copyfile(cfg.tokenizer_from, tok_path)
        else:
            t0 = time.time()
            log(f"tokenizer: training a BPE vocabulary of up to {cfg.vocab_size} tokens on {len(pairs)} pairs")
            trained = Tokenizer.train(iter_training_text(iter(pairs)), cfg.vocab_size)
            trained.save(tok_path)
            why = (
                "no pair of tokens left in the training text occurs twice"
                if trained.vocab_size < cfg.vocab_size
                else "the 256 bytes and the special tokens come first"
            )
            asked = f" ({cfg.vocab_size} asked for: {why})" if trained.vocab_size != cfg.vocab_size else ""
            log(f"tokenizer: {trained.vocab_size} BPE tokens trained{asked} in {time.time() - t0:.0f}s -> {tok_path}")
    procs.barrier()
    tok = Tokenizer.load(tok_path)
    if base is not None and base.get("tokenizer_sha256") != tok.sha256:
        raise ValueError(f"{tok_path} is not the vocabulary of {base_path}")
    return tok


def encode_pairs(
    cfg: TrainConfig,
    tok: Tokenizer,
    pairs: list[tuple[str, str]],
    dev_size: int,
    log,
    procs: Processes | None = None,
    held_out: int = 0,
) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of the pairs that fit: both sides non-empty and within max_train_len tokens. The ids
    of a whole training set come from its cache (TokenCache) when it has one for this vocabulary
    (`held_out`: the training pairs load_data held out as the dev set, which the cached pairs lack)."""
    cache = TokenCache(cfg, tok, held_out)
    ids = cache.read(len(pairs))
    if ids is None:
        t0 = time.time()
        ids = tok.encode_batch([s for s, _ in pairs]), tok.encode_batch([t for _, t in pairs])
        if not cfg.train_limit and (procs is None or procs.is_main()):
            note = cache.write(*ids)
            log(f"tokenized {len(pairs)} pairs in {time.time() - t0:.0f}s; " + note)
    src_ids, tgt_ids = ids
    limit = min(cfg.max_train_len, cfg.max_positions - 1)
    keep = [i for i in range(len(pairs)) if 0 < len(src_ids[i]) <= limit and 0 < len(tgt_ids[i]) <= limit]
    src_ids, tgt_ids = [src_ids[i] for i in keep], [tgt_ids[i] for i in keep]
    n_tok = sum(map(len, src_ids)) + sum(map(len, tgt_ids))
    log(
        f"train: {len(keep)} pairs ({len(pairs) - len(keep)} skipped: empty or over {limit} tokens), "
        f"{n_tok} tokens; dev: {dev_size} pairs"
    )
    return src_ids, tgt_ids


class TokenCache:
    """The token ids of a task's training set, tokenized once and kept in refdec's cache folder
    (refdec.repo.cache_folder: train-ids/<task>-<data folder>-<vocabulary>.pt), never beside the data,
    which no command writes into: every later run and process on that vocabulary reads them instead
    of tokenizing again. The file records the sha256 of the vocabulary and of the training files, and
    is used only while all of them are the same (an edited corpus or another vocabulary is tokenized
    anew and the cache rewritten)."""

    def __init__(self, cfg: TrainConfig, tok: Tokenizer, held_out: int = 0):
        self.folder = Path(cfg.data_dir or data_mod.DATA_DIR) / cfg.task
        where = hashlib.sha256(str(self.folder.resolve()).encode("utf-8")).hexdigest()[:12]
        self.path = cache_folder("train-ids") / f"{cfg.task}-{where}-{tok.sha256[:16]}.pt"
        self.tok_sha, self.held_out = tok.sha256, held_out

    def key(self) -> dict:
        """What the ids depend on: the vocabulary, the training files (plain or gzip) and the pairs held
        out of them as the dev set (a folder given dev files later trains on every pair)."""
        files = [data_mod.split_file(self.folder, "train", side) for side in ("src", "tgt")]
        return {
            "tokenizer": self.tok_sha,
            **{path.name: file_sha256(path) for path in files},
            **({"dev_held_out": self.held_out} if self.held_out else {}),
        }

    def read(self, n: int) -> tuple[list[list[int]], list[list[int]]] | None:
        """The ids of the first n pairs, or None without a cache that holds this corpus's ids."""
        if not self.path.is_file():
            return None
        try:
            stored = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception:  # a torn or foreign file: tokenize again (and rewrite it)
            return None
        if stored.get("key") != self.key() or len(stored["src_lengths"]) < n:
            return None
        return tuple(self.unflatten(stored[f"{side}_ids"], stored[f"{side}_lengths"], n) for side in ("src", "tgt"))

    def write(self, src_ids: list[list[int]], tgt_ids: list[list[int]]) -> str:
        """Save the ids (atomically); returns what the log says about it."""
        flat = {}
        for side, ids in (("src", src_ids), ("tgt", tgt_ids)):
            flat[f"{side}_ids"] = torch.tensor([t for row in ids for t in row], dtype=torch.int32)
            flat[f"{side}_lengths"] = torch.tensor(list(map(len, ids)), dtype=torch.int64)
        try:
            save_atomic({"key": self.key(), **flat}, self.path)
        except OSError as e:
            return f"not cached ({e.strerror or e})"
        return f"cached in {self.path}"

    @staticmethod
    def unflatten(flat: torch.Tensor, lengths: torch.Tensor, n: int) -> list[list[int]]:
        values, rows, at = flat.tolist(), [], 0
        for length in lengths[:n].tolist():
            rows.append(values[at : at + length])
            at += length
        return rows
