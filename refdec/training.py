"""Autoregressive training behind train.py (Vaswani et al. 2017, section 5).

Label-smoothed cross-entropy, Adam (0.9, 0.98, 1e-9) with linear warmup then inverse-sqrt decay,
gradient clipping, batches of a fixed number of tokens, periodic validation (dev loss + greedy BLEU),
best/last checkpoints written atomically, the last N snapshots averaged at the end, and resume from
last.pt after an interruption. Under torchrun it runs data-parallel (DistributedDataParallel; gloo on
CPU, nccl on CUDA): each process takes every world_size-th batch and gradients are averaged.

Files in out_dir:
    tokenizer.json   trained on the task's training text before step 1
    last.pt          weights + optimizer + position in the data: what --resume continues from
    best.pt          lowest dev loss so far
    snapshots/       the last keep_last evaluation snapshots
    average.pt       their average
    model.pt         the file decode.py loads: the better of best/average on dev loss, float16
    log.jsonl        one JSON record per evaluation

A run never clobbers another: an out_dir that already holds a run's files is refused unless the
run resumes it (its stored configuration, task and vocabulary must then agree with the new one,
beyond the schedule fields of RESUMABLE_CHANGES) or is told to overwrite it. Ctrl-C (SIGINT) ends
the run after the current update with last.pt saved, so --resume continues it exactly.

Each mode trains on a loss of its own, chosen once per run (`build_objective`): CrossEntropyLoss
(a plain model), DistillationLoss (kd_from), EarlyExitLoss (early_exit), ProposalHeadsLoss
(proposal_k) and DrafterLoss (drafter_k); each also evaluates on the dev set and names what its
checkpoints carry beside the model.

With `proposal_k` the run trains the proposal heads of blockwise parallel decoding (refdec.proposal)
on top of the model of `init_from`, with the base frozen (`freeze_base`) or fine-tuned with them,
on one randomly drawn head's loss per batch (the paper's unbiased estimate) or the mean over heads.
The checkpoints then carry the heads beside the model, and validation decodes blockwise (exact
mode) to report the tokens per call (the paper's mean accepted block size). With the base frozen,
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
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import data as data_mod
from .checkpoint import average_states, file_sha256, load_checkpoint, make_checkpoint, save_atomic
from .config import ModelConfig, TrainConfig
from .decoding.blockwise import decode_blockwise
from .decoding.greedy import decode_greedy
from .metrics import corpus_bleu
from .decoding.adapters import SharedEncoder
from .model import Transformer
from .drafter import block_batch, glance, glancing_ratio
from .proposal import ProposalHeads, head_logits, head_targets, proposal_state
from .tokenizer import Tokenizer, iter_training_text


# What a training run writes into its out_dir (and what --overwrite removes).
RUN_FILES = ("tokenizer.json", "last.pt", "best.pt", "average.pt", "model.pt", "log.jsonl", "snapshots")
# Fields a resumed run may change: how long and how verbosely it runs, not what it trains.
RESUMABLE_CHANGES = ("max_steps", "time_limit_min", "threads", "log_every", "eval_every", "eval_sentences", "dev_limit",
                     "out_dir")
PATH_FIELDS = ("init_from", "tokenizer_from", "encoder_from", "kd_from", "data_dir")


class TrainingError(Exception):
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
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
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
    by `build_objective`: one subclass per mode, each with its own forward(src, tgt_in, tgt_out)."""

    def __init__(self, model: Transformer, cfg: TrainConfig, encoder: Transformer | None = None):
        super().__init__()
        self.model, self.cfg = model, cfg
        self.heads: ProposalHeads | None = None  # trained proposal heads beside the model (ProposalHeadsLoss)
        self.trained_heads: list[int] = []  # which heads evaluation reports (none: the model alone)
        # encoder_from: the other model's encoder, frozen and in eval mode. Kept in a tuple, not as a
        # submodule: its weights are not trained, saved, or switched to training mode with the rest.
        self.frozen_encoder = (encoder,) if encoder is not None else ()
        self.step = 0  # set by the trainer: the drafter's glancing ratio decays with it

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
        """What a checkpoint carries beside the model to be decoded in this mode (none for a plain model)."""
        return {}

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
        hyps, calls, produced = [], 0, 0
        for i in range(0, n, 32):
            rows = src[i:min(i + 32, n)]
            x = data_mod.source_tensor(rows).to(device)
            max_len = min(m.cfg.max_positions - 1, 2 * max(map(len, rows)) + 10)
            res = (decode_greedy(self.decoding_model(), x, max_len=max_len) if heads is None
                   else decode_blockwise(m, heads, x, max_len=max_len))
            hyps += [tok.decode(t.tolist()) for t in res.tokens]
            calls, produced = calls + res.stats.verifier_calls, produced + res.stats.tokens
        self.train()
        out = {"dev_loss": sum(t / max(c, 1) for t, c in zip(total, count)) / len(which),
               "dev_bleu": corpus_bleu(hyps, dev.tgt[:n])}
        if heads is not None:
            out["dev_loss_per_head"] = {str(i): t / max(c, 1) for i, t, c in zip(which, total, count)}
            out["dev_tokens_per_call"] = produced / max(calls, 1)
        return out


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

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        logits = self.model.project(self.hidden(src, tgt_in))
        loss = self.smoothed(logits, tgt_out)
        with torch.no_grad():
            soft = torch.softmax(self.teacher[0](src, tgt_in).float(), dim=-1)  # (B, T, V)
        w = self.cfg.kd_weight
        return (1 - w) * loss + w * soft_cross_entropy(logits, soft, tgt_out.ne(self.model.cfg.pad_id))


class EarlyExitLoss(Objective):
    """BiLD's early exit: the mean of the full model's loss and that of its first early_exit layers."""

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        final, early = self.model.early_exit_hidden(src, tgt_in, self.cfg.early_exit)
        return 0.5 * (self.smoothed(self.model.project(final), tgt_out)
                      + self.smoothed(self.model.project(early), tgt_out))

    def checkpoint_entries(self, half: bool) -> dict:
        return {"early_exit": self.cfg.early_exit}


class ProposalHeadsLoss(Objective):
    """Blockwise parallel decoding's proposal heads: the loss of one random head (head_loss random),
    of the base and one random far head (base+random), or the mean over heads (mean)."""

    def __init__(self, model: Transformer, heads: ProposalHeads, cfg: TrainConfig):
        super().__init__(model, cfg)
        self.heads = heads
        # Head 1 is the base model itself: trained only when the base is not frozen.
        self.trained_heads = list(range(2 if cfg.freeze_base else 1, heads.k + 1))

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.cfg.freeze_base):
            hidden = self.model.forward_hidden(src, tgt_in)
        losses = [self.smoothed(head_logits(self.model, self.heads, hidden, i), head_targets(tgt_out, i))
                  for i in self.chosen_heads()]
        return sum(losses) / len(losses)

    def checkpoint_entries(self, half: bool) -> dict:
        return {"proposal": proposal_state(self.heads, half)}

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
    was wrong, learn the rest."""

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
        self.train()
        return {"dev_loss": loss / max(count, 1), "dev_block_accuracy": correct / max(count, 1)}

    def checkpoint_entries(self, half: bool) -> dict:
        return {"drafter": {"k": self.cfg.drafter_k, "layout": self.cfg.drafter_layout}}

    def drafter_batch(self, tgt_out: torch.Tensor, generator: torch.Generator | None = None):
        """Block inputs for every row: a random prefix length p in 0 .. len(y), then k masks."""
        pad = self.model.cfg.pad_id
        ys = [row[row.ne(pad)].tolist()[:-1] for row in tgt_out.cpu()]  # drop the eos
        ps = [int(torch.randint(len(y) + 1, (), generator=generator)) for y in ys]
        return (t.to(tgt_out.device) for t in block_batch(ys, self.cfg.drafter_k, ps, self.cfg.drafter_layout))


def build_objective(cfg: TrainConfig, model: Transformer, heads: ProposalHeads | None = None,
                    encoder: Transformer | None = None, teacher: Transformer | None = None) -> Objective:
    """The loss of the run's mode (TrainConfig's rules let at most one of them be on)."""
    if cfg.drafter_k:
        return DrafterLoss(model, cfg, encoder)
    if cfg.early_exit:
        return EarlyExitLoss(model, cfg)
    if heads is not None:
        return ProposalHeadsLoss(model, heads, cfg)
    if teacher is not None:
        return DistillationLoss(model, cfg, teacher, encoder)
    return CrossEntropyLoss(model, cfg, encoder)


def frozen_model(ck: dict, device: torch.device) -> Transformer:
    """A checkpoint's model in float32 and eval mode, its weights frozen (an encoder or a teacher)."""
    model = Transformer(ModelConfig.from_dict(ck["model_config"]))
    model.load_state_dict({k: v.float() for k, v in ck["model"].items()})
    return model.to(device).eval().requires_grad_(False)


def build_model(cfg: TrainConfig, vocab_size: int, base: dict | None = None, encoder: Transformer | None = None,
                device: torch.device | str = "cpu") -> Transformer:
    """The model a run trains: a new one of cfg's shape (reading `encoder`'s states, the frozen encoder
    of encoder_from, if given), or that of the init_from checkpoint `base` with cfg's dropout."""
    if encoder is not None:
        return Transformer(cfg.model_config(vocab_size, d_memory=encoder.cfg.d_model)).to(device)
    if base is not None:
        model = Transformer(replace(ModelConfig.from_dict(base["model_config"]), dropout=cfg.dropout))
        model.load_state_dict({k: v.float() for k, v in base["model"].items()})
        return model.to(device)
    return Transformer(cfg.model_config(vocab_size)).to(device)


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, log=print):
        self.cfg, self.log = cfg, log
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
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.out = Path(cfg.out_dir)
        self.resume, self.overwrite = resume, overwrite
        self.stop_requested = False  # set by Ctrl-C: the loop saves last.pt and stops after this update

    # -- setup -------------------------------------------------------------------------------------
    def _is_main(self) -> bool:
        return self.rank == 0

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def claim_out_dir(self) -> dict | None:
        """Check out_dir before any work (every rank, before rank 0 writes into it); on --resume,
        return last.pt once its stored configuration, task and vocabulary agree with this run's."""
        check_out_dir(self.out, resume=self.resume, overwrite=self.overwrite)
        self._barrier()
        if self.overwrite and self._is_main():
            cfg = self.cfg
            remove_run(self.out, keep=(cfg.init_from, cfg.tokenizer_from, cfg.encoder_from, cfg.kd_from))
        if not self.resume:
            return None
        last = load_checkpoint(self.out / "last.pt")
        stored = last.get("meta", {}).get("train_config", {})
        changed = config_changes(stored, self.cfg)
        if changed:
            raise TrainingError(f"{self.out}/last.pt was trained with another configuration ({'; '.join(changed)}); "
                                f"resume with the same options, or start a new run in another --out-dir")
        return last

    def prepare(self) -> None:
        """Everything before the first update: out_dir, data, vocabulary, models, loss and optimizer,
        and on --resume the state of last.pt."""
        cfg = self.cfg
        last = self.claim_out_dir()
        pairs = self._load_data()
        base_path = cfg.init_from or cfg.encoder_from  # a starting model, or the model whose encoder is read
        base = load_checkpoint(base_path) if base_path else None
        if base is not None and base.get("task") != cfg.task:
            raise ValueError(f"{base_path} was trained for {base.get('task')}, not {cfg.task}")
        self._prepare_tokenizer(pairs, base, base_path)
        self._encode_training_pairs(pairs)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self._build_models(base)
        self.objective = build_objective(cfg, self.model, self.heads, self.encoder_model, self.teacher)
        params = [p for p in self.objective.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(params, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-9)
        self.step, self.epoch, self.batch_in_epoch, self.elapsed = 0, 0, 0, 0.0
        self.best_loss = float("inf")
        self.snapshots: list[str] = []
        if last is not None:
            self._load_last(last)
        # Head 1 (the base) is skipped in some batches when drawn at random: those weights get no gradient.
        self.ddp = (torch.nn.parallel.DistributedDataParallel(self.objective, find_unused_parameters=self.heads is not None)
                    if self.world > 1 else self.objective)
        self._log_models()

    def _load_data(self) -> list[tuple[str, str]]:
        """The dev set (self.dev) and the training pairs, each cut to train_limit / dev_limit when set."""
        cfg = self.cfg
        data_dir = cfg.data_dir or data_mod.DATA_DIR
        train = data_mod.load_split(cfg.task, "train", data_dir)
        self.dev = data_mod.load_split(cfg.task, "dev", data_dir)
        if cfg.dev_limit:  # smoke runs: validate on the first dev pairs only
            n = cfg.dev_limit
            self.dev = data_mod.Split(self.dev.src[:n], [r[:n] for r in self.dev.refs], self.dev.docs[:n])
        pairs = list(zip(train.src, train.tgt))
        return pairs[: cfg.train_limit] if cfg.train_limit else pairs

    def _prepare_tokenizer(self, pairs: list[tuple[str, str]], base: dict | None, base_path: str) -> None:
        """out_dir/tokenizer.json (rank 0 writes it once): the starting model's (or the encoder's), the
        tokenizer_from file, or a new BPE trained on the pairs; then self.tok reads it."""
        cfg, tok_path = self.cfg, self.out / "tokenizer.json"
        if self._is_main() and not tok_path.exists():
            self.out.mkdir(parents=True, exist_ok=True)
            if base is not None:  # the starting model (or the encoder's) brings its vocabulary
                shutil.copyfile(Path(base_path).parent / "tokenizer.json", tok_path)
            elif cfg.tokenizer_from:
                shutil.copyfile(cfg.tokenizer_from, tok_path)
            else:
                t0 = time.time()
                Tokenizer.train(iter_training_text(iter(pairs)), cfg.vocab_size).save(tok_path)
                self.log(f"tokenizer: {cfg.vocab_size} BPE tokens trained in {time.time() - t0:.0f}s -> {tok_path}")
        self._barrier()
        self.tok = Tokenizer.load(tok_path)
        if base is not None and base.get("tokenizer_sha256") != self.tok.sha256:
            raise ValueError(f"{tok_path} is not the vocabulary of {base_path}")

    def _encode_training_pairs(self, pairs: list[tuple[str, str]]) -> None:
        """Token ids of the pairs that fit (self.src_ids, self.tgt_ids) and their lengths (self.lengths)."""
        cfg = self.cfg
        src_ids = self.tok.encode_batch([s for s, _ in pairs])
        tgt_ids = self.tok.encode_batch([t for _, t in pairs])
        limit = min(cfg.max_train_len, cfg.max_positions - 1)
        keep = [i for i in range(len(pairs)) if 0 < len(src_ids[i]) <= limit and 0 < len(tgt_ids[i]) <= limit]
        self.src_ids = [src_ids[i] for i in keep]
        self.tgt_ids = [tgt_ids[i] for i in keep]
        n_tok = sum(map(len, self.src_ids)) + sum(map(len, self.tgt_ids))
        self.log(f"train: {len(keep)} pairs ({len(pairs) - len(keep)} skipped: empty or over {limit} tokens), "
                 f"{n_tok} tokens; dev: {len(self.dev)} pairs")
        self.lengths = [(len(s), len(t)) for s, t in zip(self.src_ids, self.tgt_ids)]

    def _build_models(self, base: dict | None) -> None:
        """The frozen encoder of encoder_from, the model, its proposal heads and the teacher of kd_from
        (in this order: each new one draws its initial weights from torch's generator)."""
        cfg = self.cfg
        self.encoder_model = frozen_model(base, self.device) if cfg.encoder_from else None
        self.encoder_sha256 = file_sha256(cfg.encoder_from) if cfg.encoder_from else None
        # Heads on a frozen base ship without the base's weights: model.pt names this file instead.
        self.base_sha256 = file_sha256(cfg.init_from) if cfg.init_from and cfg.proposal_k and cfg.freeze_base else None
        self.model = build_model(cfg, self.tok.vocab_size, base if cfg.init_from else None, self.encoder_model,
                                 self.device)
        if cfg.early_exit and not cfg.early_exit < self.model.cfg.dec_layers:
            raise ValueError(f"early_exit={cfg.early_exit} needs more than {cfg.early_exit} decoder layers")
        self.heads = None
        if cfg.proposal_k:
            mc = self.model.cfg
            self.heads = ProposalHeads(mc.d_model, cfg.proposal_d_ff or mc.d_ff, cfg.proposal_k).to(self.device)
            if cfg.freeze_base:
                self.model.requires_grad_(False)
        self.teacher = None
        if cfg.kd_from:
            t_ck = load_checkpoint(cfg.kd_from)
            if t_ck.get("tokenizer_sha256") != self.tok.sha256 or t_ck.get("task") != cfg.task:
                raise ValueError(f"the teacher {cfg.kd_from} is not on this run's task and vocabulary")
            self.teacher = frozen_model(t_ck, self.device)

    def _log_models(self) -> None:
        cfg, mc = self.cfg, self.model.cfg
        self.log(f"model: {self.model.num_parameters() / 1e6:.2f}M parameters, {mc.enc_layers}+{mc.dec_layers} "
                 f"layers, d_model {mc.d_model}; {self.world} process(es) on {self.device}"
                 + (f"; reads the frozen encoder of {cfg.encoder_from}" if cfg.encoder_from else "")
                 + (f"; distils {cfg.kd_from} (weight {cfg.kd_weight})" if cfg.kd_from else "")
                 + (f"; {cfg.proposal_k - 1} proposal heads ({sum(p.numel() for p in self.heads.parameters()) / 1e6:.2f}M), "
                    f"base {'frozen' if cfg.freeze_base else 'fine-tuned'}, {cfg.head_loss} head loss" if self.heads else ""))

    def _load_last(self, ck: dict) -> None:
        if ck.get("tokenizer_sha256") != self.tok.sha256:
            raise TrainingError(f"{self.out}/last.pt does not match {self.out}/tokenizer.json (another vocabulary)")
        self.model.load_state_dict(ck["model"])
        if self.heads is not None:
            self.heads.load_state_dict(ck["proposal"]["state"])
        st = ck["train_state"]
        self.opt.load_state_dict(st["optimizer"])
        self.step, self.epoch, self.batch_in_epoch = st["step"], st["epoch"], st["batch_in_epoch"]
        self.elapsed, self.best_loss, self.snapshots = st["elapsed"], st["best_loss"], list(st["snapshots"])
        torch.set_rng_state(st["rng"])
        self.log(f"resumed from {self.out}/last.pt at step {self.step} (epoch {self.epoch}, "
                 f"{self.elapsed / 60:.1f} min trained)")

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """The run's mode's dev scores (Objective.evaluate, DrafterLoss.evaluate)."""
        return self.objective.evaluate(self.tok, self.dev, self.device)

    # -- checkpoints -------------------------------------------------------------------------------
    def _meta(self, extra: dict | None = None) -> dict:
        return {"train_config": self.cfg.to_dict(), "minutes": round(self.elapsed / 60, 2), **(extra or {})}

    def _ckpt(self, meta: dict, half: bool = False) -> dict:
        ck = make_checkpoint(self.model, self.cfg.task, self.tok, self.step, meta, half=half)
        ck.update(self.objective.checkpoint_entries(half))
        if self.cfg.encoder_from:  # where the encoder is, from this checkpoint's folder, and which file it was
            ck["shared_encoder"] = {"path": os.path.relpath(self.cfg.encoder_from, self.out),
                                    "sha256": self.encoder_sha256}
        return ck

    def _save_last(self) -> None:
        ck = self._ckpt(self._meta())
        ck["train_state"] = {"optimizer": self.opt.state_dict(), "step": self.step, "epoch": self.epoch,
                             "batch_in_epoch": self.batch_in_epoch, "elapsed": self.elapsed,
                             "best_loss": self.best_loss, "snapshots": self.snapshots, "rng": torch.get_rng_state()}
        save_atomic(ck, self.out / "last.pt")

    def _checkpoint(self, scores: dict) -> None:
        meta = self._meta(scores)
        snap = self.out / "snapshots" / f"step{self.step:07d}.pt"
        save_atomic(self._ckpt(meta), snap)
        self.snapshots.append(str(snap))
        while len(self.snapshots) > self.cfg.keep_last:
            Path(self.snapshots.pop(0)).unlink(missing_ok=True)
        if scores["dev_loss"] < self.best_loss:
            self.best_loss = scores["dev_loss"]
            save_atomic(self._ckpt(meta), self.out / "best.pt")
        self._save_last()
        with open(self.out / "log.jsonl", "a") as f:
            f.write(json.dumps({"step": self.step, "minutes": round(self.elapsed / 60, 2), **scores}) + "\n")

    def finish(self) -> dict:
        """Average the kept snapshots, evaluate best and average, write model.pt (float16) from the better
        (or from last.pt, the final weights, with pick="last")."""
        snaps = [load_checkpoint(p) for p in self.snapshots if Path(p).exists()]
        states = [ck["model"] for ck in snaps]
        results = {}
        if states:
            self.model.load_state_dict(average_states(states))
            if self.heads is not None:
                self.heads.load_state_dict(average_states([ck["proposal"]["state"] for ck in snaps]))
            avg = self.evaluate()
            save_atomic(self._ckpt(self._meta({**avg, "averaged": len(states)})), self.out / "average.pt")
            results["average"] = avg
            self.log(f"average of {len(states)} snapshots: " + format_scores(avg))
        best_path = self.out / "best.pt"
        if best_path.exists():
            best = load_checkpoint(best_path)
            results["best"] = {"dev_loss": self.best_loss, **{k: best["meta"][k] for k in ("dev_bleu", "dev_block_accuracy")
                                                               if k in best["meta"]}, "step": best["step"]}
        pick = "average" if "average" in results and results["average"]["dev_loss"] <= self.best_loss else "best"
        if self.cfg.pick == "last":  # e.g. alignment to a teacher: the references' dev loss is not the aim
            pick = "last"
        src_file = self.out / f"{pick}.pt"
        if src_file.exists():
            ck = load_checkpoint(src_file)
            self.model.load_state_dict(ck["model"])
            if self.heads is not None:
                self.heads.load_state_dict({k: v.float() for k, v in ck["proposal"]["state"].items()})
            final = self._ckpt({**ck["meta"], "picked": pick}, half=True)
            if self.heads is not None and self.cfg.freeze_base and self.cfg.init_from:  # the heads alone; the base: init_from
                del final["model"]
                final["frozen_base"] = {"path": os.path.relpath(self.cfg.init_from, self.out), "sha256": self.base_sha256}
            save_atomic(final, self.out / "model.pt")
            self.log(f"model.pt <- {pick}.pt (float16" + (", the heads alone: the base is "
                     f"{self.cfg.init_from})" if "frozen_base" in final else ")"))
        return results

    # -- the loop ----------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg = self.cfg
        self.objective.train()
        limit_s = cfg.time_limit_min * 60 if cfg.time_limit_min else float("inf")
        t_last, tok_count, loss_sum, loss_n = time.time(), 0, 0.0, 0
        while self.step < cfg.max_steps and not self._should_stop(limit_s):
            batches = data_mod.token_batches(self.lengths, cfg.batch_tokens, seed=cfg.seed * 1000 + self.epoch)
            mine = batches[self.rank::self.world]
            n_steps = len(batches) // self.world  # every rank must run the same number of steps
            while self.batch_in_epoch < n_steps and self.step < cfg.max_steps and not self._should_stop(limit_s):
                idx = mine[self.batch_in_epoch]
                src, tgt_in, tgt_out = (x.to(self.device) for x in data_mod.training_tensors(
                    [self.src_ids[i] for i in idx], [self.tgt_ids[i] for i in idx]))
                lr = cfg.lr * inverse_sqrt(self.step + 1, cfg.warmup_steps)
                for g in self.opt.param_groups:
                    g["lr"] = lr
                self.objective.step = self.step
                loss = self.ddp(src, tgt_in, tgt_out)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.objective.parameters(), cfg.clip_norm)
                self.opt.step()
                self.step += 1
                self.batch_in_epoch += 1
                tok_count += int(src.ne(self.model.cfg.pad_id).sum() + tgt_out.ne(self.model.cfg.pad_id).sum())
                loss_sum, loss_n = loss_sum + loss.item(), loss_n + 1
                now = time.time()
                self.elapsed += now - t_last
                t_last = now
                if self._is_main() and self.step % cfg.log_every == 0:
                    eta = min((cfg.max_steps - self.step) * self.elapsed / max(self.step, 1), limit_s - self.elapsed)
                    self.log(f"step {self.step:6d} | epoch {self.epoch} | loss {loss_sum / loss_n:.3f} | lr {lr:.2e} | "
                             f"{tok_count * self.world / max(self._window(now), 1e-9):,.0f} tok/s | "
                             f"{self.elapsed / 60:.1f} min | ETA {max(eta, 0) / 60:.1f} min")
                    tok_count, loss_sum, loss_n = 0, 0.0, 0
                    self._window_start = now
                if self.step % cfg.eval_every == 0:
                    self._eval_and_save()
                    t_last = time.time()
            if self.batch_in_epoch >= n_steps:
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        if self.stop_requested:  # Ctrl-C: keep what was trained, resumable, and stop
            if self._is_main():
                self._save_last()
            self._barrier()
            raise Interrupted(f"interrupted at step {self.step}: {self.out}/last.pt saved; "
                              f"continue with the same command and --resume")
        if self.step % cfg.eval_every:
            self._eval_and_save()
        results = self.finish() if self._is_main() else {}
        self._barrier()
        if self.world > 1:
            dist.destroy_process_group()
        return results

    def _should_stop(self, limit_s: float) -> bool:
        """Out of time, or Ctrl-C was pressed. Rank 0 decides for everyone: ranks that stopped on their
        own clocks or signals at different steps would leave the others waiting forever in the
        gradient all-reduce."""
        stop = self.elapsed >= limit_s or self.stop_requested
        if self.world > 1:
            flag = torch.tensor([float(stop)], device=self.device)
            dist.broadcast(flag, src=0)
            stop = bool(flag.item())
            self.stop_requested = self.stop_requested or (stop and self.elapsed < limit_s)
        return stop

    def _window(self, now: float) -> float:
        start = getattr(self, "_window_start", None) or self._t0
        return now - start

    def _eval_and_save(self) -> None:
        if self._is_main():
            scores = self.evaluate()
            self.log(f"eval step {self.step}: " + format_scores(scores)
                     + ("" if self.cfg.drafter_k else f" (greedy BLEU on {min(self.cfg.eval_sentences, len(self.dev))} sentences)"))
            self._checkpoint(scores)
        self._barrier()

    def run(self) -> dict:
        self._t0 = time.time()
        self.prepare()
        self._t0 = time.time()
        with stop_on_sigint(self):
            return self.train()


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
