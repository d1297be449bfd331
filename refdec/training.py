"""Autoregressive training behind train.py (Vaswani et al. 2017, section 5).

Label-smoothed cross-entropy, Adam (0.9, 0.98, 1e-9) with linear warmup then inverse-sqrt decay,
gradient clipping, batches of a fixed number of tokens, periodic validation (dev loss + greedy BLEU),
best/last checkpoints written atomically, the last N snapshots averaged at the end, and resume from
last.pt after an interruption. Under torchrun it runs data-parallel (DistributedDataParallel; gloo on
CPU, nccl on CUDA): each process takes every world_size-th batch and gradients are averaged.

Files in out_dir:
    tokenizer.json   trained on the task's training text before step 1
    last.pt          weights + optimizer + position in the data: what --resume continues from
    best.pt          the best evaluation so far: lowest dev loss, or most tokens per call (pick)
    snapshots/       the last keep_last evaluation snapshots
    average.pt       their average
    model.pt         the file decode.py loads: the better of best/average (pick), or last; float16
    log.jsonl        one JSON record per evaluation

A run never clobbers another: an out_dir that already holds a run's files is refused unless the
run resumes it (its stored configuration, task and vocabulary must then agree with the new one,
beyond the schedule fields of RESUMABLE_CHANGES) or is told to overwrite it. Ctrl-C (SIGINT) ends
the run after the current update with last.pt saved, so --resume continues it exactly.

Each mode trains on a loss of its own, chosen once per run (`objective_class`): CrossEntropyLoss
(a plain model), DistillationLoss (kd_from), EarlyExitLoss (early_exit), ProposalHeadsLoss
(proposal_k) and DrafterLoss (drafter_k). Each mode also owns what it adds to a run: what it loads
or creates beside the model (the teacher, the heads), its dev evaluation, what its checkpoints
carry and how those are averaged and kept in model.pt, so the loop (Trainer) is the same for all.

With `proposal_k` the run trains the proposal heads of blockwise parallel decoding (refdec.proposal)
on top of the model of `init_from`, with the base frozen (`freeze_base`) or fine-tuned with them,
on one randomly drawn head's loss per batch (the paper's unbiased estimate) or the mean over heads.
The checkpoints then carry the heads beside the model, and validation decodes blockwise (exact
mode) to report the tokens per call, per row (the paper's mean accepted block size). A GAD
drafter's validation runs GAD with its verifier for the same figure; with pick tokens-per-call
that figure, not the dev loss against the references, chooses model.pt. With the base frozen,
model.pt holds the heads alone and names the init_from file as its base (`frozen_base`: path and
sha256; refdec.checkpoint loads the weights from there).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import data as data_mod
from .checkpoint import average_states, file_sha256, load_checkpoint, make_checkpoint, referenced_file, save_atomic
from .config import ModelConfig, TrainConfig
from .decoding.blockwise import decode_blockwise
from .decoding.gad import decode_gad
from .decoding.greedy import decode_greedy
from .decoding.result import DecodeStats
from .metrics import corpus_bleu
from .decoding.adapters import SharedEncoder
from .model import Transformer
from .drafter import Drafter, block_batch, glance, glancing_ratio
from .errors import UsageError
from .proposal import ProposalHeads, head_logits, head_targets, proposal_state
from .tokenizer import Tokenizer, iter_training_text


# What a training run writes into its out_dir (and what --overwrite removes).
RUN_FILES = ("tokenizer.json", "last.pt", "best.pt", "average.pt", "model.pt", "log.jsonl", "snapshots")
# Fields a resumed run may change: how long and how verbosely it runs, not what it trains.
RESUMABLE_CHANGES = ("max_steps", "time_limit_min", "threads", "log_every", "eval_every", "eval_sentences",
                     "speed_sentences", "pass_tokens", "dev_limit", "out_dir")
PATH_FIELDS = ("init_from", "tokenizer_from", "encoder_from", "kd_from", "data_dir")


class TrainingError(UsageError):
    """A run that cannot start or go on as asked: train.py prints the message on one line and exits 2."""


class Interrupted(Exception):
    """Training stopped on Ctrl-C; last.pt holds the state --resume continues from."""


def check_out_dir(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to mix a new run into an old one's folder: an existing run needs --resume or --overwrite."""
    if out.exists() and not out.is_dir():
        raise TrainingError(f"--out-dir {out} is a file, not a folder")
    present = [name for name in RUN_FILES if (out / name).exists()]
    if resume:
        if overwrite:
            raise TrainingError("--resume continues the run in --out-dir and --overwrite deletes it: choose one")
        if not (out / "last.pt").is_file():
            raise TrainingError(f"nothing to resume: {out}/last.pt does not exist (drop --resume to start a new run)")
    elif present and not overwrite:
        raise TrainingError(f"{out} already holds a training run ({', '.join(present)}); pass --resume to continue "
                            f"it, --overwrite to replace it, or another --out-dir")


def remove_run(out: Path, keep: tuple[str, ...] = ()) -> None:
    """--overwrite: delete the files a previous run wrote into `out` (nothing else in the folder),
    except those in `keep`: files the new run itself reads (its vocabulary or starting checkpoint)."""
    kept = {Path(k).resolve() for k in keep if k}
    for name in RUN_FILES:
        path = out / name
        if path.resolve() in kept:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def config_changes(stored: dict, cfg: TrainConfig) -> list[str]:
    """The fields in which `cfg` differs from a run's stored configuration, beyond RESUMABLE_CHANGES
    (paths compared as resolved files, so `a/b` and `./a/b` agree)."""
    def norm(name, value):
        return str(Path(value).resolve()) if name in PATH_FIELDS and value else value
    new = cfg.to_dict()
    return [f"{k}: {stored.get(k)!r} -> {v!r}" for k, v in new.items()
            if k not in RESUMABLE_CHANGES and norm(k, stored.get(k)) != norm(k, v)]


def inverse_sqrt(step: int, warmup: int) -> float:
    """Learning-rate multiplier: linear warmup to 1 at `warmup`, then sqrt(warmup / step)."""
    step = max(step, 1)
    return min(step / warmup, math.sqrt(warmup / step))


def smoothed_loss(logits: torch.Tensor, target: torch.Tensor, eps: float, pad_id: int) -> torch.Tensor:
    """Label-smoothed cross-entropy (Szegedy et al. 2016), mean over non-pad target tokens."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bfloat16 (autocast) up, float64 kept
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                            ignore_index=pad_id, label_smoothing=eps, reduction="sum")
    # Divided by at least 1: a batch with no target (a far proposal head on short sentences) gives 0, not NaN.
    return total / target.ne(pad_id).sum().clamp(min=1)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """-sum_v q(v) log p(v), mean over the positions where `keep` (B, T) is True: word-level
    distillation's loss against a teacher's distributions q (its KL divergence plus q's entropy)."""
    nll = -(target_probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # (B, T)
    return (nll * keep).sum() / keep.sum().clamp(min=1)


class Objective(torch.nn.Module):
    """A training mode's loss as one module (what DistributedDataParallel wraps), chosen once per run
    by `objective_class`: one subclass per mode, each with its own forward(src, tgt_in, tgt_out), and
    each owning what the mode adds to a run: the parts it loads or creates beside the model (`load`),
    what its checkpoints carry (`checkpoint_entries`, `load_entries`), how snapshots of those are
    averaged (`average_entries`), what model.pt keeps (`final_checkpoint`) and how it is logged."""

    unused_parameters = False  # DistributedDataParallel must look for weights without a gradient

    def __init__(self, model: Transformer, cfg: TrainConfig, encoder: Transformer | None = None):
        super().__init__()
        self.model, self.cfg = model, cfg
        self.heads: ProposalHeads | None = None  # trained proposal heads beside the model (ProposalHeadsLoss)
        self.trained_heads: list[int] = []  # which heads evaluation reports (none: the model alone)
        # encoder_from: the other model's encoder, frozen and in eval mode. Kept in a tuple, not as a
        # submodule: its weights are not trained, saved, or switched to training mode with the rest.
        self.frozen_encoder = (encoder,) if encoder is not None else ()
        # Where that encoder is, from the run's folder, and which file it was (checkpoints record both).
        self.shared_encoder = ({"path": os.path.relpath(cfg.encoder_from, cfg.out_dir),
                                "sha256": file_sha256(cfg.encoder_from)} if encoder is not None and cfg.encoder_from
                               else None)
        self.step = 0  # set by the trainer: the drafter's glancing ratio decays with it

    @classmethod
    def load(cls, cfg: TrainConfig, model: Transformer, tok: Tokenizer, device: torch.device,
             encoder: Transformer | None = None) -> "Objective":
        """The mode's loss on `model`, with whatever else the mode loads or creates (after the model:
        new weights draw from torch's generator in that order)."""
        return cls.of_parts(cfg, model, encoder=encoder)

    @classmethod
    def of_parts(cls, cfg: TrainConfig, model: Transformer, *, heads: ProposalHeads | None = None,
                 encoder: Transformer | None = None, teacher: Transformer | None = None) -> "Objective":
        """The mode's loss over parts already built (those the mode does not use are ignored)."""
        return cls(model, cfg, encoder)

    def describe(self) -> str:
        """What the run's log line about the model adds for this mode."""
        return f"; reads the frozen encoder of {self.cfg.encoder_from}" if self.frozen_encoder else ""

    def eval_note(self, dev_size: int) -> str:
        """What the log line of an evaluation adds after the scores."""
        return f" (greedy BLEU on {min(self.cfg.eval_sentences, dev_size)} sentences)"

    def hidden(self, src: torch.Tensor, tgt_in: torch.Tensor, self_block: torch.Tensor | None = None) -> torch.Tensor:
        """The model's final decoder states, on its own encoder or on the frozen one of encoder_from
        (`self_block`: a drafter's attention layout, as forward_hidden takes it)."""
        if not self.frozen_encoder:
            return self.model.forward_hidden(src, tgt_in, self_block)
        with torch.no_grad():
            states, src_pad = self.frozen_encoder[0].encode_states(src)
        return self.model.forward_hidden(src, tgt_in, self_block, memory=self.model.attach(states, src_pad))

    def decoding_model(self):
        """What greedy decoding of the dev set runs: the model, on the frozen encoder if it has one."""
        return SharedEncoder(self.model, self.frozen_encoder[0]) if self.frozen_encoder else self.model

    def checkpoint_entries(self, half: bool) -> dict:
        """What a checkpoint carries beside the model to be decoded in this mode (for a plain model,
        only where its frozen encoder is)."""
        return {"shared_encoder": self.shared_encoder} if self.shared_encoder else {}

    def load_entries(self, ck: dict) -> None:
        """Take the weights beside the model back from checkpoint `ck` (none for a plain model)."""

    def average_entries(self, snaps: list[dict]) -> None:
        """Load the average of the snapshots' weights beside the model (none for a plain model)."""

    def final_checkpoint(self, ck: dict) -> str:
        """Turn checkpoint `ck` into model.pt's content in place; returns what the log says about it."""
        return ""

    def smoothed(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return smoothed_loss(logits, target, self.cfg.label_smoothing, self.model.cfg.pad_id)

    @torch.no_grad()
    def evaluate(self, tok: Tokenizer, dev: data_mod.Split, device: torch.device) -> dict:
        """Teacher-forced dev loss (no smoothing) over the dev set, and BLEU of greedy decoding of its
        first sentences. With proposal heads: dev_loss is the mean over the trained heads, and the
        sentences are decoded blockwise (exact mode: the same output as greedy) for the tokens per
        call (the paper's mean accepted block size)."""
        m, heads = self.model, self.heads
        self.eval()
        src, batches = dev_batches(tok, dev, min(self.cfg.max_train_len, m.cfg.max_positions - 1), device)
        which = self.trained_heads or [1]
        total, count = [0.0] * len(which), [0] * len(which)
        for s, ti, to in batches:
            hidden = self.hidden(s, ti)
            for j, i in enumerate(which):
                target = head_targets(to, i)
                logits = head_logits(m, heads, hidden, i)
                total[j] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                                            ignore_index=tok.pad_id, reduction="sum").item()
                count[j] += target.ne(tok.pad_id).sum().item()
        n = min(self.cfg.eval_sentences, len(src))
        # With heads, blockwise decoding (exact: greedy's output) gives the BLEU of the first n
        # sentences and the tokens per call of the first speed_sentences, in batches cut at both.
        speed = min(self.cfg.speed_sentences, len(src)) if heads is not None else 0
        hyps, stats = [], DecodeStats()
        for rows, first in decode_batches(src, n, speed):
            x = data_mod.source_tensor(rows).to(device)
            max_len = min(m.cfg.max_positions - 1, 2 * max(map(len, rows)) + 10)
            res = (decode_greedy(self.decoding_model(), x, max_len=max_len) if heads is None
                   else decode_blockwise(m, heads, x, max_len=max_len))
            hyps += [tok.decode(t.tolist()) for t in res.tokens]
            if first:
                stats.merge(res.stats)
        self.train()
        out = {"dev_loss": sum(t / max(c, 1) for t, c in zip(total, count)) / len(which),
               "dev_bleu": corpus_bleu(hyps[:n], dev.tgt[:n])}
        if heads is not None:
            out["dev_loss_per_head"] = {str(i): t / max(c, 1) for i, t, c in zip(which, total, count)}
            out["dev_tokens_per_call"] = stats.mean_committed  # per row: tokens each sentence gains per call
        return out


def decode_batches(src: list[list[int]], n: int, speed: int, size: int = 32):
    """Batches of at most `size` of the first max(n, speed) sources, none straddling `speed`: each as
    (rows, whether they are among the first `speed`)."""
    for lo, hi in ((0, speed), (speed, max(n, speed))):
        for i in range(lo, hi, size):
            yield src[i:min(i + size, hi)], hi == speed


def dev_batches(tok: Tokenizer, dev: data_mod.Split, limit: int, device: torch.device):
    """The dev sources' token ids cut to `limit` tokens, and an iterator over teacher-forcing
    batches (src, tgt_in, tgt_out) of the dev pairs, 8000 tokens each at most."""
    src = [s[:limit] for s in tok.encode_batch(dev.src)]
    tgt = [t[:limit] for t in tok.encode_batch(dev.tgt)]
    batches = (tuple(x.to(device) for x in data_mod.training_tensors([src[i] for i in idx], [tgt[i] for i in idx]))
               for idx in data_mod.token_batches([(len(s), len(t)) for s, t in zip(src, tgt)], 8000, None))
    return src, batches


class CrossEntropyLoss(Objective):
    """A plain model (on its own encoder or a frozen one): the label-smoothed cross-entropy."""

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        return self.smoothed(self.model.project(self.hidden(src, tgt_in)), tgt_out)


class DistillationLoss(Objective):
    """Word-level distillation (kd_from): (1 - kd_weight) x the label-smoothed cross-entropy +
    kd_weight x the cross-entropy to the teacher's next-token distributions."""

    def __init__(self, model: Transformer, cfg: TrainConfig, teacher: Transformer, encoder: Transformer | None = None):
        super().__init__(model, cfg, encoder)
        self.teacher = (teacher,)  # frozen, kept out of the submodules as the frozen encoder is

    @classmethod
    def load(cls, cfg: TrainConfig, model: Transformer, tok: Tokenizer, device: torch.device,
             encoder: Transformer | None = None) -> "DistillationLoss":
        """The teacher of kd_from, frozen; it must be on the run's task and vocabulary."""
        ck = load_checkpoint(cfg.kd_from)
        if ck.get("tokenizer_sha256") != tok.sha256 or ck.get("task") != cfg.task:
            raise ValueError(f"the teacher {cfg.kd_from} is not on this run's task and vocabulary")
        return cls(model, cfg, frozen_model(ck, device), encoder)

    @classmethod
    def of_parts(cls, cfg: TrainConfig, model: Transformer, *, heads: ProposalHeads | None = None,
                 encoder: Transformer | None = None, teacher: Transformer | None = None) -> "DistillationLoss":
        return cls(model, cfg, teacher, encoder)

    def describe(self) -> str:
        return super().describe() + f"; distils {self.cfg.kd_from} (weight {self.cfg.kd_weight})"

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        logits = self.model.project(self.hidden(src, tgt_in))
        loss = self.smoothed(logits, tgt_out)
        with torch.no_grad():
            soft = torch.softmax(self.teacher[0](src, tgt_in).float(), dim=-1)  # (B, T, V)
        w = self.cfg.kd_weight
        return (1 - w) * loss + w * soft_cross_entropy(logits, soft, tgt_out.ne(self.model.cfg.pad_id))


class EarlyExitLoss(Objective):
    """BiLD's early exit: the mean of the full model's loss and that of its first early_exit layers."""

    @classmethod
    def load(cls, cfg: TrainConfig, model: Transformer, tok: Tokenizer, device: torch.device,
             encoder: Transformer | None = None) -> "EarlyExitLoss":
        if not cfg.early_exit < model.cfg.dec_layers:
            raise ValueError(f"early_exit={cfg.early_exit} needs more than {cfg.early_exit} decoder layers")
        return cls(model, cfg)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        final, early = self.model.early_exit_hidden(src, tgt_in, self.cfg.early_exit)
        return 0.5 * (self.smoothed(self.model.project(final), tgt_out)
                      + self.smoothed(self.model.project(early), tgt_out))

    def checkpoint_entries(self, half: bool) -> dict:
        return {"early_exit": self.cfg.early_exit, **super().checkpoint_entries(half)}


class ProposalHeadsLoss(Objective):
    """Blockwise parallel decoding's proposal heads: the loss of one random head (head_loss random),
    of the base and one random far head (base+random), or the mean over heads (mean)."""

    unused_parameters = True  # head 1 (the base) is skipped in some batches when heads are drawn at random

    def __init__(self, model: Transformer, heads: ProposalHeads, cfg: TrainConfig, base_file: str = ""):
        super().__init__(model, cfg)
        self.heads = heads
        # Head 1 is the base model itself: trained only when the base is not frozen.
        self.trained_heads = list(range(2 if cfg.freeze_base else 1, heads.k + 1))
        # Heads on a frozen base ship without the base's weights: model.pt names the file holding them
        # (init_from, or the base that init_from's heads stand on) instead.
        self.base_file = base_file = base_file or cfg.init_from
        self.frozen_base = ({"path": os.path.relpath(base_file, cfg.out_dir), "sha256": file_sha256(base_file)}
                            if cfg.freeze_base and base_file else None)

    @classmethod
    def load(cls, cfg: TrainConfig, model: Transformer, tok: Tokenizer, device: torch.device,
             encoder: Transformer | None = None) -> "ProposalHeadsLoss":
        """Heads of cfg's shape on the model, whose weights are frozen with freeze_base: new ones, or
        those of init_from when it has heads of that shape (trained heads continued)."""
        heads = ProposalHeads(model.cfg.d_model, cfg.proposal_d_ff or model.cfg.d_ff, cfg.proposal_k).to(device)
        base_file = ""
        if cfg.init_from:
            ck = load_checkpoint(cfg.init_from)
            if "proposal" in ck:
                if ck["proposal"]["config"] != heads.config():
                    raise TrainingError(f"{cfg.init_from} holds heads of shape {ck['proposal']['config']}, not "
                                        f"{heads.config()}: give --proposal-k and --proposal-d-ff as they were trained")
                heads.load_state_dict({k: v.float() for k, v in ck["proposal"]["state"].items()})
            if "frozen_base" in ck:  # heads alone: the weights are those of the base they name
                base_file = str(referenced_file(cfg.init_from, ck["frozen_base"], "holds proposal heads on the frozen model"))
        if cfg.freeze_base:
            model.requires_grad_(False)
        return cls(model, heads, cfg, base_file)

    @classmethod
    def of_parts(cls, cfg: TrainConfig, model: Transformer, *, heads: ProposalHeads | None = None,
                 encoder: Transformer | None = None, teacher: Transformer | None = None) -> "ProposalHeadsLoss":
        return cls(model, heads, cfg)

    def describe(self) -> str:
        cfg = self.cfg
        return super().describe() + (f"; {cfg.proposal_k - 1} proposal heads ({sum(p.numel() for p in self.heads.parameters()) / 1e6:.2f}M), "
                                     f"base {'frozen' if cfg.freeze_base else 'fine-tuned'}, {cfg.head_loss} head loss")

    def load_entries(self, ck: dict) -> None:
        self.heads.load_state_dict({k: v.float() for k, v in ck["proposal"]["state"].items()})

    def average_entries(self, snaps: list[dict]) -> None:
        self.heads.load_state_dict(average_states([ck["proposal"]["state"] for ck in snaps]))

    def final_checkpoint(self, ck: dict) -> str:
        """On a frozen base: the heads alone, naming the base's file (refdec.checkpoint loads it from there)."""
        if self.frozen_base is None:
            return ""
        del ck["model"]
        ck["frozen_base"] = self.frozen_base
        return f", the heads alone: the base is {self.base_file}"

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.cfg.freeze_base):
            hidden = self.model.forward_hidden(src, tgt_in)
        losses = [self.smoothed(head_logits(self.model, self.heads, hidden, i), head_targets(tgt_out, i))
                  for i in self.chosen_heads()]
        return sum(losses) / len(losses)

    def checkpoint_entries(self, half: bool) -> dict:
        return {"proposal": proposal_state(self.heads, half), **super().checkpoint_entries(half)}

    def chosen_heads(self) -> list[int]:
        """This batch's heads; random ones drawn from torch's generator, whose state last.pt keeps."""
        if self.cfg.head_loss == "random":
            return [self.trained_heads[int(torch.randint(len(self.trained_heads), ()))]]
        if self.cfg.head_loss == "base+random":  # head 1 (the base) always, one of heads 2..k beside it
            far = [i for i in self.trained_heads if i > 1]
            return [1, far[int(torch.randint(len(far), ()))]]
        return self.trained_heads


class DrafterLoss(Objective):
    """GAD's block drafter: L_NAR with glancing (GLAT). Predict the block, reveal gold tokens where it
    was wrong, learn the rest. Its verifier (the model of encoder_from, or else of init_from when
    that is not itself a drafter) runs GAD with it at each evaluation for the tokens per call."""

    def __init__(self, model: Transformer, cfg: TrainConfig, encoder: Transformer | None = None,
                 verifier: Transformer | None = None):
        super().__init__(model, cfg, encoder)
        self.verifier = (verifier,) if verifier is not None else ()  # frozen, out of the submodules

    @classmethod
    def load(cls, cfg: TrainConfig, model: Transformer, tok: Tokenizer, device: torch.device,
             encoder: Transformer | None = None) -> "DrafterLoss":
        verifier = encoder
        if verifier is None and cfg.init_from:
            ck = load_checkpoint(cfg.init_from)
            verifier = None if "drafter" in ck else frozen_model(ck, device)
        if verifier is None and cfg.pick == "tokens-per-call":
            raise TrainingError("pick tokens-per-call needs the drafter's verifier: --encoder-from (or --init-from "
                                "a model that is not a drafter)")
        return cls(model, cfg, encoder, verifier)

    @classmethod
    def of_parts(cls, cfg: TrainConfig, model: Transformer, *, heads: ProposalHeads | None = None,
                 encoder: Transformer | None = None, teacher: Transformer | None = None) -> "DrafterLoss":
        return cls(model, cfg, encoder, encoder)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        inp, gold, block = self.drafter_batch(tgt_out)
        with torch.no_grad():
            pred = self.model.project(self.hidden(src, inp, block))
        cfg = self.cfg
        ratio = glancing_ratio(self.step, cfg.glancing_start, cfg.glancing_end, cfg.glancing_decay_steps)
        inp, target = glance(inp, gold, pred.argmax(dim=-1), ratio)
        return self.smoothed(self.model.project(self.hidden(src, inp, block)), target)

    @torch.no_grad()
    def evaluate(self, tok: Tokenizer, dev: data_mod.Split, device: torch.device) -> dict:
        """The drafter's dev loss and top-1 accuracy on the block, at prefix lengths drawn from a fixed
        seed (the same blocks at every evaluation), without glancing."""
        self.eval()
        _, batches = dev_batches(tok, dev, min(self.cfg.max_train_len, self.model.cfg.max_positions - 1), device)
        gen = torch.Generator().manual_seed(1234)
        loss = correct = count = 0.0
        for s, _, to in batches:
            inp, gold, block = self.drafter_batch(to, gen)
            logits = self.model.project(self.hidden(s, inp, block))
            loss += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), gold.reshape(-1),
                                    ignore_index=tok.pad_id, reduction="sum").item()
            on = gold.ne(tok.pad_id)
            correct += (logits.argmax(-1).eq(gold) & on).sum().item()
            count += on.sum().item()
        out = {"dev_loss": loss / max(count, 1), "dev_block_accuracy": correct / max(count, 1)}
        if self.verifier:
            out["dev_tokens_per_call"] = self.tokens_per_call(tok, dev, device)
        self.train()
        return out

    def tokens_per_call(self, tok: Tokenizer, dev: data_mod.Split, device: torch.device) -> float:
        """GAD's tokens per verifier call and row, with the verifier, on the first speed_sentences dev
        sources (what the drafter is for: GAD accepts what matches the verifier's own output)."""
        verifier, cfg = self.verifier[0], self.cfg
        drafter = Drafter(self.decoding_model(), k=cfg.drafter_k, layout=cfg.drafter_layout)
        room = min(verifier.cfg.max_positions, self.model.cfg.max_positions - cfg.drafter_k) - 1
        src = [s[:room] for s in tok.encode_batch(dev.src[:cfg.speed_sentences])]
        stats = DecodeStats()
        for rows, _ in decode_batches(src, len(src), 0):
            x = data_mod.source_tensor(rows).to(device)
            stats.merge(decode_gad(verifier, drafter, x, max_len=min(room, 2 * max(map(len, rows)) + 10)).stats)
        return stats.mean_committed

    def checkpoint_entries(self, half: bool) -> dict:
        return {"drafter": {"k": self.cfg.drafter_k, "layout": self.cfg.drafter_layout},
                **super().checkpoint_entries(half)}

    def eval_note(self, dev_size: int) -> str:
        return (f" (GAD with the verifier on {min(self.cfg.speed_sentences, dev_size)} sentences)" if self.verifier
                else "")

    def drafter_batch(self, tgt_out: torch.Tensor, generator: torch.Generator | None = None):
        """Block inputs for every row: a random prefix length p in 0 .. len(y), then k masks."""
        pad = self.model.cfg.pad_id
        ys = [row[row.ne(pad)].tolist()[:-1] for row in tgt_out.cpu()]  # drop the eos
        ps = [int(torch.randint(len(y) + 1, (), generator=generator)) for y in ys]
        return (t.to(tgt_out.device) for t in block_batch(ys, self.cfg.drafter_k, ps, self.cfg.drafter_layout))


def objective_class(cfg: TrainConfig) -> type[Objective]:
    """The loss of the run's mode (TrainConfig's rules let at most one of them be on)."""
    if cfg.drafter_k:
        return DrafterLoss
    if cfg.early_exit:
        return EarlyExitLoss
    if cfg.proposal_k:
        return ProposalHeadsLoss
    if cfg.kd_from:
        return DistillationLoss
    return CrossEntropyLoss


def build_objective(cfg: TrainConfig, model: Transformer, heads: ProposalHeads | None = None,
                    encoder: Transformer | None = None, teacher: Transformer | None = None) -> Objective:
    """The loss of the run's mode over parts already built (a run loads its own: Objective.load)."""
    return objective_class(cfg).of_parts(cfg, model, heads=heads, encoder=encoder, teacher=teacher)


def frozen_model(ck: dict, device: torch.device) -> Transformer:
    """A checkpoint's model in float32 and eval mode, its weights frozen (an encoder or a teacher)."""
    model = Transformer(ModelConfig.from_dict(ck["model_config"]))
    model.load_state_dict({k: v.float() for k, v in ck["model"].items()})
    return model.to(device).eval().requires_grad_(False)


def build_model(cfg: TrainConfig, vocab_size: int, base: dict | None = None, encoder: Transformer | None = None,
                device: torch.device | str = "cpu") -> Transformer:
    """The model a run trains: a new one of cfg's shape (reading `encoder`'s states, the frozen encoder
    of encoder_from, if given), or that of the init_from checkpoint `base` with cfg's dropout (on
    `encoder`: decoder_from)."""
    if encoder is not None and base is not None:
        return decoder_from(base, cfg, encoder).to(device)
    if encoder is not None:
        return Transformer(cfg.model_config(vocab_size, d_memory=encoder.cfg.d_model)).to(device)
    if base is not None:
        model = Transformer(replace(ModelConfig.from_dict(base["model_config"]), dropout=cfg.dropout))
        model.load_state_dict({k: v.float() for k, v in base["model"].items()})
        return model.to(device)
    return Transformer(cfg.model_config(vocab_size)).to(device)


def decoder_from(base: dict, cfg: TrainConfig, encoder: Transformer) -> Transformer:
    """A decoder on the frozen encoder of encoder_from (GAD's drafter), started from the init_from
    checkpoint `base`: one already on that encoder (a shipped drafter) goes on as it is; a whole model
    (the verifier) gives its embeddings, its first dec_layers decoder layers, its final norm and its
    output projection, so the drafter starts as the verifier's early exit."""
    shape = ModelConfig.from_dict(base["model_config"])
    state = {k: v.float() for k, v in base["model"].items()}
    if shape.enc_layers == 0:
        if shape.memory_dim != encoder.cfg.d_model:
            raise TrainingError(f"{cfg.init_from} reads encoder states of width {shape.memory_dim}, "
                                f"{cfg.encoder_from} gives {encoder.cfg.d_model}")
        model = Transformer(replace(shape, dropout=cfg.dropout))
    else:
        differ = [f"{f} {getattr(cfg, f)} (the model's: {getattr(shape, f)})" for f in ("d_model", "n_heads", "d_ff")
                  if getattr(cfg, f) != getattr(shape, f)]
        if differ or cfg.dec_layers > shape.dec_layers:
            raise TrainingError(f"a decoder started from {cfg.init_from} takes its width and at most its "
                                f"{shape.dec_layers} decoder layers: {', '.join(differ) or f'dec_layers {cfg.dec_layers}'}")
        model = Transformer(replace(shape, enc_layers=0, dec_layers=cfg.dec_layers, d_memory=encoder.cfg.d_model,
                                    dropout=cfg.dropout))
        state = {k: state[k] for k in model.state_dict()}  # the first dec_layers layers; no encoder
    model.load_state_dict(state)
    return model


class Processes:
    """The processes of a run: one, or world_size under torchrun (DistributedDataParallel; gloo on
    CPU, nccl on CUDA), each with its rank and device. Rank 0 (the main one) writes the files."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = torch.device("cpu")
        if self.world > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend)
        elif torch.cuda.is_available():
            self.device = torch.device("cuda")

    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def agree(self, stop: bool) -> bool:
        """Rank 0's decision, for every rank: ranks that stopped on their own clocks or signals at
        different steps would leave the others waiting forever in the gradient all-reduce."""
        if self.world == 1:
            return stop
        flag = torch.tensor([float(stop)], device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def end(self) -> None:
        self.barrier()
        if self.world > 1:
            dist.destroy_process_group()


def claim_out_dir(cfg: TrainConfig, procs: Processes, *, resume: bool, overwrite: bool) -> dict | None:
    """Check out_dir before any work (every rank, before rank 0 writes into it); on --resume,
    return last.pt once its stored configuration, task and vocabulary agree with this run's."""
    out = Path(cfg.out_dir)
    check_out_dir(out, resume=resume, overwrite=overwrite)
    procs.barrier()
    if overwrite and procs.is_main():
        remove_run(out, keep=(cfg.init_from, cfg.tokenizer_from, cfg.encoder_from, cfg.kd_from))
    if not resume:
        return None
    last = load_checkpoint(out / "last.pt")
    changed = config_changes(last.get("meta", {}).get("train_config", {}), cfg)
    if changed:
        raise TrainingError(f"{out}/last.pt was trained with another configuration ({'; '.join(changed)}); "
                            f"resume with the same options, or start a new run in another --out-dir")
    return last


def load_data(cfg: TrainConfig) -> tuple[list[tuple[str, str]], data_mod.Split]:
    """The training pairs and the dev set, each cut to train_limit / dev_limit when set."""
    data_dir = cfg.data_dir or data_mod.DATA_DIR
    train = data_mod.load_split(cfg.task, "train", data_dir)
    dev = data_mod.load_split(cfg.task, "dev", data_dir)
    if cfg.dev_limit:  # smoke runs: validate on the first dev pairs only
        n = cfg.dev_limit
        dev = data_mod.Split(dev.src[:n], [r[:n] for r in dev.refs], dev.docs[:n])
    pairs = list(zip(train.src, train.tgt))
    return (pairs[: cfg.train_limit] if cfg.train_limit else pairs), dev


def prepare_tokenizer(cfg: TrainConfig, procs: Processes, pairs: list[tuple[str, str]], base: dict | None,
                      base_path: str, log) -> Tokenizer:
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
            Tokenizer.train(iter_training_text(iter(pairs)), cfg.vocab_size).save(tok_path)
            log(f"tokenizer: {cfg.vocab_size} BPE tokens trained in {time.time() - t0:.0f}s -> {tok_path}")
    procs.barrier()
    tok = Tokenizer.load(tok_path)
    if base is not None and base.get("tokenizer_sha256") != tok.sha256:
        raise ValueError(f"{tok_path} is not the vocabulary of {base_path}")
    return tok


def encode_pairs(cfg: TrainConfig, tok: Tokenizer, pairs: list[tuple[str, str]], dev_size: int,
                 log, procs: "Processes | None" = None) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of the pairs that fit: both sides non-empty and within max_train_len tokens. The ids
    of a whole training set come from its cache (TokenCache) when it has one for this vocabulary."""
    cache = TokenCache(cfg, tok)
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
    log(f"train: {len(keep)} pairs ({len(pairs) - len(keep)} skipped: empty or over {limit} tokens), "
        f"{n_tok} tokens; dev: {dev_size} pairs")
    return src_ids, tgt_ids


class TokenCache:
    """The token ids of a task's training set, tokenized once and kept beside its files as
    .train-ids-<vocabulary>.pt: every later run and process on that vocabulary reads them instead of
    tokenizing again. The file records the sha256 of the vocabulary and of the training files, and
    is used only while all of them are the same (an edited corpus or another vocabulary is tokenized
    anew and the cache rewritten)."""

    def __init__(self, cfg: TrainConfig, tok: Tokenizer):
        self.folder = Path(cfg.data_dir or data_mod.DATA_DIR) / cfg.task
        self.path = self.folder / f".train-ids-{tok.sha256[:16]}.pt"
        self.tok_sha = tok.sha256

    def key(self) -> dict:
        return {"tokenizer": self.tok_sha, **{name: file_sha256(self.folder / name)
                                              for name in ("train.src.gz", "train.tgt.gz")}}

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
        return f"cached in {self.path.name} beside the data"

    @staticmethod
    def unflatten(flat: torch.Tensor, lengths: torch.Tensor, n: int) -> list[list[int]]:
        values, rows, at = flat.tolist(), [], 0
        for length in lengths[:n].tolist():
            rows.append(values[at:at + length])
            at += length
        return rows


def build_run_objective(cfg: TrainConfig, tok: Tokenizer, base: dict | None, device: torch.device) -> Objective:
    """The frozen encoder of encoder_from, the model, and what the mode adds (Objective.load), in this
    order: each new one draws its initial weights from torch's generator."""
    encoder = None
    if cfg.encoder_from:
        own = load_checkpoint(cfg.encoder_from) if cfg.init_from else base  # `base` is init_from's when both are set
        if own.get("tokenizer_sha256") != tok.sha256 or own.get("task") != cfg.task:
            raise TrainingError(f"{cfg.encoder_from} is not on the task and vocabulary of {cfg.init_from}")
        spec = base.get("shared_encoder") if cfg.init_from else None
        if spec and spec["sha256"] != file_sha256(cfg.encoder_from):
            raise TrainingError(f"{cfg.init_from} was trained on another encoder than {cfg.encoder_from}'s: give "
                                f"--encoder-from the model it reads ({spec['path']} from its folder)")
        encoder = frozen_model(own, device)
    model = build_model(cfg, tok.vocab_size, base if cfg.init_from else None, encoder, device)
    return objective_class(cfg).load(cfg, model, tok, device, encoder)


@dataclass
class Progress:
    """How far a run is: what last.pt keeps, beside the weights and the optimizer, to resume exactly."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    elapsed: float = 0.0  # seconds spent in updates so far (neither setup nor evaluations)
    best_loss: float = float("inf")  # the best evaluation's rank (RunFolder.rank: lower is better)
    snapshots: list[str] = field(default_factory=list)

    def state(self, opt: torch.optim.Optimizer) -> dict:
        return {"optimizer": opt.state_dict(), "step": self.step, "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch, "elapsed": self.elapsed, "best_loss": self.best_loss,
                "snapshots": self.snapshots, "rng": torch.get_rng_state()}

    @classmethod
    def restore(cls, st: dict, opt: torch.optim.Optimizer) -> "Progress":
        opt.load_state_dict(st["optimizer"])
        torch.set_rng_state(st["rng"])
        return cls(st["step"], st["epoch"], st["batch_in_epoch"], st["elapsed"], st["best_loss"], list(st["snapshots"]))


class RunFolder:
    """The checkpoints a run writes into out_dir (refdec/training.py's docstring lists them)."""

    def __init__(self, cfg: TrainConfig, objective: Objective, tok: Tokenizer, log):
        self.cfg, self.objective, self.tok, self.log = cfg, objective, tok, log
        self.out = Path(cfg.out_dir)

    def checkpoint(self, progress: Progress, extra: dict | None = None, half: bool = False) -> dict:
        meta = {"train_config": self.cfg.to_dict(), "minutes": round(progress.elapsed / 60, 2), **(extra or {})}
        ck = make_checkpoint(self.objective.model, self.cfg.task, self.tok, progress.step, meta, half=half)
        ck.update(self.objective.checkpoint_entries(half))
        return ck

    def save_last(self, progress: Progress, opt: torch.optim.Optimizer) -> None:
        ck = self.checkpoint(progress)
        ck["train_state"] = progress.state(opt)
        save_atomic(ck, self.out / "last.pt")

    def load_last(self, ck: dict, opt: torch.optim.Optimizer) -> Progress:
        if ck.get("tokenizer_sha256") != self.tok.sha256:
            raise TrainingError(f"{self.out}/last.pt does not match {self.out}/tokenizer.json (another vocabulary)")
        self.objective.model.load_state_dict(ck["model"])
        self.objective.load_entries(ck)
        progress = Progress.restore(ck["train_state"], opt)
        self.log(f"resumed from {self.out}/last.pt at step {progress.step} (epoch {progress.epoch}, "
                 f"{progress.elapsed / 60:.1f} min trained)")
        return progress

    def rank(self, scores: dict) -> float:
        """Where an evaluation ranks, lower being better: its dev loss, or with pick tokens-per-call
        minus the tokens per call of the drafter's or the heads' decoder."""
        return -scores["dev_tokens_per_call"] if self.cfg.pick == "tokens-per-call" else scores["dev_loss"]

    def save_evaluation(self, scores: dict, progress: Progress, opt: torch.optim.Optimizer) -> None:
        """A snapshot (the oldest beyond keep_last removed), best.pt when the evaluation ranks first
        yet (RunFolder.rank), last.pt, and the scores' line in log.jsonl."""
        snap = self.out / "snapshots" / f"step{progress.step:07d}.pt"
        save_atomic(self.checkpoint(progress, scores), snap)
        progress.snapshots.append(str(snap))
        while len(progress.snapshots) > self.cfg.keep_last:
            Path(progress.snapshots.pop(0)).unlink(missing_ok=True)
        if self.rank(scores) < progress.best_loss:
            progress.best_loss = self.rank(scores)
            save_atomic(self.checkpoint(progress, scores), self.out / "best.pt")
        self.save_last(progress, opt)
        with open(self.out / "log.jsonl", "a") as f:
            f.write(json.dumps({"step": progress.step, "minutes": round(progress.elapsed / 60, 2), **scores}) + "\n")

    def finish(self, progress: Progress, evaluate) -> dict:
        """Average the kept snapshots, evaluate best and average, write model.pt (float16) from the better
        by RunFolder.rank (or from last.pt, the final weights, with pick="last")."""
        results = {}
        snaps = [load_checkpoint(p) for p in progress.snapshots if Path(p).exists()]
        if snaps:
            self.objective.model.load_state_dict(average_states([ck["model"] for ck in snaps]))
            self.objective.average_entries(snaps)
            avg = evaluate()
            save_atomic(self.checkpoint(progress, {**avg, "averaged": len(snaps)}), self.out / "average.pt")
            results["average"] = avg
            self.log(f"average of {len(snaps)} snapshots: " + format_scores(avg))
        if (self.out / "best.pt").exists():
            best = load_checkpoint(self.out / "best.pt")
            results["best"] = {**{k: best["meta"][k] for k in ("dev_loss", "dev_bleu", "dev_block_accuracy",
                                                               "dev_tokens_per_call") if k in best["meta"]},
                               "step": best["step"]}
        pick = "average" if "average" in results and self.rank(results["average"]) <= progress.best_loss else "best"
        if self.cfg.pick == "last":  # e.g. alignment to a teacher: the references' dev loss is not the aim
            pick = "last"
        if (self.out / f"{pick}.pt").exists():
            ck = load_checkpoint(self.out / f"{pick}.pt")
            self.objective.model.load_state_dict(ck["model"])
            self.objective.load_entries(ck)
            final = self.checkpoint(progress, {**ck["meta"], "picked": pick}, half=True)
            note = self.objective.final_checkpoint(final)
            save_atomic(final, self.out / "model.pt")
            self.log(f"model.pt <- {pick}.pt (float16{note})")
        return results


class Trainer:
    """The training loop: batches of a fixed number of tokens, the learning-rate schedule, one update
    per batch, an evaluation and checkpoints every eval_every updates, and the run's end (Ctrl-C or
    time limit: last.pt saved; otherwise model.pt written by RunFolder.finish)."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, log=print):
        self.cfg, self.log = cfg, log
        self.procs = Processes()
        self.device = self.procs.device
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.out = Path(cfg.out_dir)
        self.resume, self.overwrite = resume, overwrite
        self.stop_requested = False  # set by Ctrl-C: the loop saves last.pt and stops after this update

    def prepare(self) -> None:
        """Everything before the first update: out_dir, data, vocabulary, models, loss and optimizer,
        and on --resume the state of last.pt."""
        cfg = self.cfg
        last = claim_out_dir(cfg, self.procs, resume=self.resume, overwrite=self.overwrite)
        pairs, self.dev = load_data(cfg)
        base_path = cfg.init_from or cfg.encoder_from  # a starting model, or the model whose encoder is read
        base = load_checkpoint(base_path) if base_path else None
        if base is not None and base.get("task") != cfg.task:
            raise ValueError(f"{base_path} was trained for {base.get('task')}, not {cfg.task}")
        self.tok = prepare_tokenizer(cfg, self.procs, pairs, base, base_path, self.log)
        self.src_ids, self.tgt_ids = encode_pairs(cfg, self.tok, pairs, len(self.dev), self.log, self.procs)
        self.lengths = [(len(s), len(t)) for s, t in zip(self.src_ids, self.tgt_ids)]
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.objective = build_run_objective(cfg, self.tok, base, self.device)
        self.model = self.objective.model
        params = [p for p in self.objective.parameters() if p.requires_grad]
        # Adam (0.9, 0.98, 1e-9) as AdamW without weight decay (the same update, bit for bit), fused into
        # one kernel per step on a GPU.
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0,
                                     fused=True if self.device.type == "cuda" else None)
        self.pass_tokens = cfg.pass_tokens or device_pass_tokens(cfg, self.model.cfg, self.device)
        self.folder = RunFolder(cfg, self.objective, self.tok, self.log)
        self.progress = Progress() if last is None else self.folder.load_last(last, self.opt)
        self.ddp = (torch.nn.parallel.DistributedDataParallel(self.objective,
                                                              find_unused_parameters=self.objective.unused_parameters)
                    if self.procs.world > 1 else self.objective)
        mc = self.model.cfg
        self.log(f"model: {self.model.num_parameters() / 1e6:.2f}M parameters, {mc.enc_layers}+{mc.dec_layers} "
                 f"layers, d_model {mc.d_model}; {self.procs.world} process(es) on {self.device}"
                 + self.objective.describe())

    def evaluate(self) -> dict:
        """The run's mode's dev scores (Objective.evaluate, DrafterLoss.evaluate)."""
        return self.objective.evaluate(self.tok, self.dev, self.device)

    def update(self, idx: list[int]) -> tuple[float, int]:
        """One update on the training pairs `idx`: the loss and the batch's non-pad tokens. The batch
        runs in passes of at most pass_tokens padded tokens (one on a CPU by default), their gradients
        accumulated; in bfloat16 autocast on a GPU."""
        cfg, p = self.cfg, self.progress
        self.lr = cfg.lr * inverse_sqrt(p.step + 1, cfg.warmup_steps)
        for g in self.opt.param_groups:
            g["lr"] = self.lr
        self.objective.step = p.step
        pieces = ([idx] if self.pass_tokens >= cfg.batch_tokens else
                  [[idx[j] for j in part] for part in
                   data_mod.token_batches([self.lengths[i] for i in idx], self.pass_tokens, None)])
        self.opt.zero_grad(set_to_none=True)
        loss, n_tok = accumulate(self.ddp, [data_mod.training_tensors([self.src_ids[i] for i in part],
                                                                      [self.tgt_ids[i] for i in part])
                                            for part in pieces], self.model.cfg.pad_id, self.device)
        torch.nn.utils.clip_grad_norm_(self.objective.parameters(), cfg.clip_norm)
        self.opt.step()
        p.step += 1
        p.batch_in_epoch += 1
        return loss, n_tok

    def train(self) -> dict:
        cfg, p, world = self.cfg, self.progress, self.procs.world
        self.objective.train()
        limit_s = cfg.time_limit_min * 60 if cfg.time_limit_min else float("inf")
        t_last, window_start, tok_count, loss_sum, loss_n = time.time(), self._t0, 0, 0.0, 0
        while p.step < cfg.max_steps and not self._should_stop(limit_s):
            batches = data_mod.token_batches(self.lengths, cfg.batch_tokens, seed=cfg.seed * 1000 + p.epoch)
            mine = batches[self.procs.rank::world]
            n_steps = len(batches) // world  # every rank must run the same number of steps
            while p.batch_in_epoch < n_steps and p.step < cfg.max_steps and not self._should_stop(limit_s):
                loss, n_tok = self.update(mine[p.batch_in_epoch])
                tok_count, loss_sum, loss_n = tok_count + n_tok, loss_sum + loss, loss_n + 1
                now = time.time()
                p.elapsed += now - t_last
                t_last = now
                if self.procs.is_main() and p.step % cfg.log_every == 0:
                    eta = min((cfg.max_steps - p.step) * p.elapsed / max(p.step, 1), limit_s - p.elapsed)
                    self.log(f"step {p.step:6d} | epoch {p.epoch} | loss {loss_sum / loss_n:.3f} | lr {self.lr:.2e} | "
                             f"{tok_count * world / max(now - window_start, 1e-9):,.0f} tok/s | "
                             f"{p.elapsed / 60:.1f} min | ETA {max(eta, 0) / 60:.1f} min")
                    tok_count, loss_sum, loss_n = 0, 0.0, 0
                    window_start = now
                if p.step % cfg.eval_every == 0:
                    self._eval_and_save()
                    t_last = time.time()
            if p.batch_in_epoch >= n_steps:
                p.epoch, p.batch_in_epoch = p.epoch + 1, 0
        if self.stop_requested:  # Ctrl-C: keep what was trained, resumable, and stop
            if self.procs.is_main():
                self.folder.save_last(p, self.opt)
            self.procs.barrier()
            raise Interrupted(f"interrupted at step {p.step}: {self.out}/last.pt saved; "
                              f"continue with the same command and --resume")
        if p.step % cfg.eval_every:
            self._eval_and_save()
        results = self.folder.finish(p, self.evaluate) if self.procs.is_main() else {}
        self.procs.end()
        return results

    def _should_stop(self, limit_s: float) -> bool:
        """Out of time, or Ctrl-C was pressed (rank 0 decides for every rank)."""
        stop = self.procs.agree(self.progress.elapsed >= limit_s or self.stop_requested)
        self.stop_requested = self.stop_requested or (stop and self.progress.elapsed < limit_s)
        return stop

    def _eval_and_save(self) -> None:
        if self.procs.is_main():
            scores = self.evaluate()
            self.log(f"eval step {self.progress.step}: " + format_scores(scores) + self.objective.eval_note(len(self.dev)))
            self.folder.save_evaluation(scores, self.progress, self.opt)
        self.procs.barrier()

    def run(self) -> dict:
        self._t0 = time.time()
        self.prepare()
        self._t0 = time.time()
        with stop_on_sigint(self):
            return self.train()


def accumulate(objective: torch.nn.Module, pieces: list[tuple[torch.Tensor, ...]], pad_id: int,
               device: torch.device) -> tuple[float, int]:
    """The gradients of one batch's loss, run as `pieces` (src, tgt_in, tgt_out): each piece's mean
    loss weighted by its share of the batch's target tokens, so that for the losses that are a mean
    over target tokens (plain, distillation, early exit) the gradient is the whole batch's (for the
    heads' and the drafter's, the same expectation). Returns the batch's loss and its non-pad tokens.
    With one piece it is loss.backward() on the batch, as it was before passes existed. Under
    DistributedDataParallel the gradients are all-reduced on the last piece only. On a GPU the
    forward passes run in bfloat16 autocast (the weights, gradients and optimizer stay float32)."""
    weights = [int(t.ne(pad_id).sum()) for _, _, t in pieces]
    total, loss_sum, n_tok = sum(weights), 0.0, 0
    for j, (piece, w) in enumerate(zip(pieces, weights)):
        src, tgt_in, tgt_out = (x.to(device) for x in piece)
        last = j == len(pieces) - 1
        sync = contextlib.nullcontext() if last or not hasattr(objective, "no_sync") else objective.no_sync()
        with sync:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = objective(src, tgt_in, tgt_out)
            (loss if len(pieces) == 1 else loss * (w / total)).backward()
        loss_sum += loss.item() * w / total
        n_tok += int(src.ne(pad_id).sum() + tgt_out.ne(pad_id).sum())
    return (loss.item() if len(pieces) == 1 else loss_sum), n_tok


def device_pass_tokens(cfg: TrainConfig, shape: ModelConfig, device: torch.device) -> int:
    """Padded tokens per forward/backward pass when pass_tokens is 0: the whole batch on a CPU (one
    pass, as a preset's optimisation was set); on a GPU as many as about half its free memory holds
    (float32 logits and their gradients, and each layer's activations), at most the whole batch."""
    if device.type != "cuda":
        return cfg.batch_tokens
    free, _ = torch.cuda.mem_get_info(device)
    per_token = 4 * (3 * shape.vocab_size + 40 * shape.d_model * (shape.enc_layers + shape.dec_layers))
    return max(1, min(cfg.batch_tokens, free // 2 // per_token))


@contextlib.contextmanager
def stop_on_sigint(trainer: Trainer):
    """During training, the first Ctrl-C asks the loop to stop after the current update (with
    last.pt saved); a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if trainer.stop_requested:
            raise KeyboardInterrupt
        trainer.stop_requested = True
        trainer.log("Ctrl-C: stopping after this update and saving last.pt (press again to quit at once)")

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def format_scores(scores: dict) -> str:
    names = {"dev_loss": "dev loss", "dev_bleu": "dev BLEU", "dev_tokens_per_call": "tokens per call",
             "dev_block_accuracy": "block accuracy"}
    return " | ".join(f"{names[k]} {scores[k]:.4f}" for k in names if k in scores)


def log_to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
