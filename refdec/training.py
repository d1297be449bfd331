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
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import data as data_mod
from .checkpoint import average_states, load_checkpoint, make_checkpoint, model_state, save_atomic
from .config import TrainConfig
from .decoding.greedy import greedy
from .metrics import corpus_bleu
from .model import Transformer
from .tokenizer import Tokenizer, iter_training_text


def inverse_sqrt(step: int, warmup: int) -> float:
    """Learning-rate multiplier: linear warmup to 1 at `warmup`, then sqrt(warmup / step)."""
    step = max(step, 1)
    return min(step / warmup, math.sqrt(warmup / step))


def smoothed_loss(logits: torch.Tensor, target: torch.Tensor, eps: float, pad_id: int) -> torch.Tensor:
    """Label-smoothed cross-entropy (Szegedy et al. 2016), mean over non-pad target tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                           ignore_index=pad_id, label_smoothing=eps)


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool = False, log=print):
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
        self.resume = resume

    # -- setup -------------------------------------------------------------------------------------
    def _is_main(self) -> bool:
        return self.rank == 0

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def prepare(self) -> None:
        cfg = self.cfg
        data_dir = cfg.data_dir or data_mod.DATA_DIR
        train = data_mod.load_split(cfg.task, "train", data_dir)
        self.dev = data_mod.load_split(cfg.task, "dev", data_dir)
        pairs = list(zip(train.src, train.tgt))
        if cfg.train_limit:
            pairs = pairs[: cfg.train_limit]
        tok_path = self.out / "tokenizer.json"
        if self._is_main() and not tok_path.exists():
            self.out.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            Tokenizer.train(iter_training_text(iter(pairs)), cfg.vocab_size).save(tok_path)
            self.log(f"tokenizer: {cfg.vocab_size} BPE tokens trained in {time.time() - t0:.0f}s -> {tok_path}")
        self._barrier()
        self.tok = Tokenizer.load(tok_path)
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

        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.model = Transformer(cfg.model_config(self.tok.vocab_size)).to(self.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-9)
        self.step, self.epoch, self.batch_in_epoch, self.elapsed = 0, 0, 0, 0.0
        self.best_loss = float("inf")
        self.snapshots: list[str] = []
        if self.resume and (self.out / "last.pt").exists():
            self._load_last()
        self.ddp = (torch.nn.parallel.DistributedDataParallel(self.model) if self.world > 1 else self.model)
        self.log(f"model: {self.model.num_parameters() / 1e6:.2f}M parameters, {cfg.enc_layers}+{cfg.dec_layers} "
                 f"layers, d_model {cfg.d_model}; {self.world} process(es) on {self.device}")

    def _load_last(self) -> None:
        ck = load_checkpoint(self.out / "last.pt")
        if ck.get("tokenizer_sha256") != self.tok.sha256:
            raise SystemExit(f"error: {self.out}/last.pt does not match {self.out}/tokenizer.json")
        self.model.load_state_dict(ck["model"])
        st = ck["train_state"]
        self.opt.load_state_dict(st["optimizer"])
        self.step, self.epoch, self.batch_in_epoch = st["step"], st["epoch"], st["batch_in_epoch"]
        self.elapsed, self.best_loss, self.snapshots = st["elapsed"], st["best_loss"], list(st["snapshots"])
        torch.set_rng_state(st["rng"])
        self.log(f"resumed from {self.out}/last.pt at step {self.step} (epoch {self.epoch}, "
                 f"{self.elapsed / 60:.1f} min trained)")

    # -- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Teacher-forced dev loss (no smoothing) over the dev set, greedy BLEU on its first sentences."""
        m = self.model
        m.eval()
        limit = min(self.cfg.max_train_len, self.cfg.max_positions - 1)
        src = [s[:limit] for s in self.tok.encode_batch(self.dev.src)]
        tgt = [t[:limit] for t in self.tok.encode_batch(self.dev.tgt)]
        total, count = 0.0, 0
        for idx in data_mod.token_batches([(len(s), len(t)) for s, t in zip(src, tgt)], 8000, None):
            s, ti, to = (x.to(self.device) for x in data_mod.training_tensors([src[i] for i in idx], [tgt[i] for i in idx]))
            logits = m(s, ti)
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), to.reshape(-1),
                                     ignore_index=self.tok.pad_id, reduction="sum").item()
            count += to.ne(self.tok.pad_id).sum().item()
        n = min(self.cfg.eval_sentences, len(src))
        hyps = []
        for i in range(0, n, 32):
            rows = src[i:min(i + 32, n)]
            res = greedy(m, data_mod.source_tensor(rows).to(self.device),
                         max_len=min(self.cfg.max_positions - 1, 2 * max(map(len, rows)) + 10))
            hyps += [self.tok.decode(t.tolist()) for t in res.tokens]
        m.train()
        return {"dev_loss": total / max(count, 1), "dev_bleu": corpus_bleu(hyps, self.dev.tgt[:n])}

    # -- checkpoints -------------------------------------------------------------------------------
    def _meta(self, extra: dict | None = None) -> dict:
        return {"train_config": self.cfg.to_dict(), "minutes": round(self.elapsed / 60, 2), **(extra or {})}

    def _save_last(self) -> None:
        ck = make_checkpoint(self.model, self.cfg.task, self.tok, self.step, self._meta())
        ck["train_state"] = {"optimizer": self.opt.state_dict(), "step": self.step, "epoch": self.epoch,
                             "batch_in_epoch": self.batch_in_epoch, "elapsed": self.elapsed,
                             "best_loss": self.best_loss, "snapshots": self.snapshots, "rng": torch.get_rng_state()}
        save_atomic(ck, self.out / "last.pt")

    def _checkpoint(self, scores: dict) -> None:
        meta = self._meta(scores)
        snap = self.out / "snapshots" / f"step{self.step:07d}.pt"
        save_atomic(make_checkpoint(self.model, self.cfg.task, self.tok, self.step, meta), snap)
        self.snapshots.append(str(snap))
        while len(self.snapshots) > self.cfg.keep_last:
            Path(self.snapshots.pop(0)).unlink(missing_ok=True)
        if scores["dev_loss"] < self.best_loss:
            self.best_loss = scores["dev_loss"]
            save_atomic(make_checkpoint(self.model, self.cfg.task, self.tok, self.step, meta), self.out / "best.pt")
        self._save_last()
        with open(self.out / "log.jsonl", "a") as f:
            f.write(json.dumps({"step": self.step, "minutes": round(self.elapsed / 60, 2), **scores}) + "\n")

    def finish(self) -> dict:
        """Average the kept snapshots, evaluate best and average, write model.pt (float16) from the better."""
        states = [load_checkpoint(p)["model"] for p in self.snapshots if Path(p).exists()]
        results = {}
        if states:
            self.model.load_state_dict(average_states(states))
            avg = self.evaluate()
            save_atomic(make_checkpoint(self.model, self.cfg.task, self.tok, self.step,
                                        self._meta({**avg, "averaged": len(states)})), self.out / "average.pt")
            results["average"] = avg
            self.log(f"average of {len(states)} snapshots: dev loss {avg['dev_loss']:.4f} BLEU {avg['dev_bleu']:.2f}")
        best_path = self.out / "best.pt"
        if best_path.exists():
            best = load_checkpoint(best_path)
            results["best"] = {"dev_loss": self.best_loss, "dev_bleu": best["meta"].get("dev_bleu"), "step": best["step"]}
        pick = "average" if "average" in results and results["average"]["dev_loss"] <= self.best_loss else "best"
        src_file = self.out / f"{pick}.pt"
        if src_file.exists():
            ck = load_checkpoint(src_file)
            self.model.load_state_dict(ck["model"])
            final = make_checkpoint(self.model, self.cfg.task, self.tok, self.step,
                                    {**ck["meta"], "picked": pick}, half=True)
            save_atomic(final, self.out / "model.pt")
            self.log(f"model.pt <- {pick}.pt (float16)")
        return results

    # -- the loop ----------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, m = self.cfg, self.model
        m.train()
        limit_s = cfg.time_limit_min * 60 if cfg.time_limit_min else float("inf")
        t_last, tok_count, loss_sum, loss_n = time.time(), 0, 0.0, 0
        while self.step < cfg.max_steps and not self._out_of_time(limit_s):
            batches = data_mod.token_batches(self.lengths, cfg.batch_tokens, seed=cfg.seed * 1000 + self.epoch)
            mine = batches[self.rank::self.world]
            n_steps = len(batches) // self.world  # every rank must run the same number of steps
            while self.batch_in_epoch < n_steps and self.step < cfg.max_steps and not self._out_of_time(limit_s):
                idx = mine[self.batch_in_epoch]
                src, tgt_in, tgt_out = (x.to(self.device) for x in data_mod.training_tensors(
                    [self.src_ids[i] for i in idx], [self.tgt_ids[i] for i in idx]))
                lr = cfg.lr * inverse_sqrt(self.step + 1, cfg.warmup_steps)
                for g in self.opt.param_groups:
                    g["lr"] = lr
                loss = smoothed_loss(self.ddp(src, tgt_in), tgt_out, cfg.label_smoothing, self.tok.pad_id)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.clip_norm)
                self.opt.step()
                self.step += 1
                self.batch_in_epoch += 1
                tok_count += int(src.ne(0).sum() + tgt_out.ne(0).sum())
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
        if self.step % cfg.eval_every:
            self._eval_and_save()
        results = self.finish() if self._is_main() else {}
        self._barrier()
        if self.world > 1:
            dist.destroy_process_group()
        return results

    def _out_of_time(self, limit_s: float) -> bool:
        """Rank 0's clock decides for everyone: ranks that stopped on their own clocks at different
        steps would leave the others waiting forever in the gradient all-reduce."""
        over = self.elapsed >= limit_s
        if self.world > 1 and limit_s != float("inf"):
            flag = torch.tensor([float(over)], device=self.device)
            dist.broadcast(flag, src=0)
            over = bool(flag.item())
        return over

    def _window(self, now: float) -> float:
        start = getattr(self, "_window_start", None) or self._t0
        return now - start

    def _eval_and_save(self) -> None:
        if self._is_main():
            scores = self.evaluate()
            self.log(f"eval step {self.step}: dev loss {scores['dev_loss']:.4f} | dev BLEU {scores['dev_bleu']:.2f} "
                     f"(greedy, {min(self.cfg.eval_sentences, len(self.dev))} sentences)")
            self._checkpoint(scores)
        self._barrier()

    def run(self) -> dict:
        self._t0 = time.time()
        self.prepare()
        self._t0 = time.time()
        return self.train()


def log_to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
