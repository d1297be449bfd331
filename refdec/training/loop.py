"""The training loop (Trainer): the processes of a run, the learning-rate schedule, updates in
passes of a device's size with their gradients accumulated (bfloat16 autocast, fused AdamW and
compiled passes on a GPU), evaluations and checkpoints, and the run's end.
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from .. import data as data_mod
from ..checkpoint import file_sha256, load_checkpoint
from ..compiling import cpp_compiler
from ..config import ModelConfig, TrainConfig
from ..tokenizer import Tokenizer
from .corpus import encode_pairs, load_data, prepare_tokenizer
from .folder import Interrupted, Progress, RunFolder, TrainingError, claim_out_dir, format_scores
from .models import build_model, frozen_model
from .objectives import Objective, objective_class
from .processes import Processes


def inverse_sqrt(step: int, warmup: int) -> float:
    """Learning-rate multiplier: linear warmup to 1 at `warmup`, then sqrt(warmup / step)."""
    step = max(step, 1)
    return min(step / warmup, math.sqrt(warmup / step))


def build_run_objective(cfg: TrainConfig, tok: Tokenizer, base: dict | None, device: torch.device) -> Objective:
    """The frozen encoder of encoder_from, the model, and what the mode adds (Objective.load), in this
    order: each new one draws its initial weights from torch's generator."""
    encoder = None
    if cfg.encoder_from:
        encoder_checkpoint = (
            load_checkpoint(cfg.encoder_from) if cfg.init_from else base
        )  # `base` is init_from's when both are set
        if encoder_checkpoint.get("tokenizer_sha256") != tok.sha256 or encoder_checkpoint.get("task") != cfg.task:
            raise TrainingError(f"{cfg.encoder_from} is not on the task and vocabulary of {cfg.init_from}")
        spec = base.get("shared_encoder") if cfg.init_from else None
        if spec and spec["sha256"] != file_sha256(cfg.encoder_from):
            raise TrainingError(
                f"{cfg.init_from} was trained on another encoder than {cfg.encoder_from}'s: give "
                f"--encoder-from the model it reads ({spec['path']} from its folder)"
            )
        encoder = frozen_model(encoder_checkpoint, device)
    model = build_model(cfg, tok.vocab_size, base if cfg.init_from else None, encoder, device)
    return objective_class(cfg).load(cfg, model, tok, device, encoder)


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
        pairs, self.dev, held_out = load_data(cfg, self.log)
        base_path = cfg.init_from or cfg.encoder_from  # a starting model, or the model whose encoder is read
        base = load_checkpoint(base_path) if base_path else None
        if base is not None and base.get("task") != cfg.task:
            raise ValueError(f"{base_path} was trained for {base.get('task')}, not {cfg.task}")
        self.tok = prepare_tokenizer(cfg, self.procs, pairs, base, base_path, self.log)
        self.src_ids, self.tgt_ids = encode_pairs(cfg, self.tok, pairs, len(self.dev), self.log, self.procs, held_out)
        self.lengths = [(len(s), len(t)) for s, t in zip(self.src_ids, self.tgt_ids)]
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.objective = build_run_objective(cfg, self.tok, base, self.device)
        self.model = self.objective.model
        params = [p for p in self.objective.parameters() if p.requires_grad]
        # Adam (0.9, 0.98, 1e-9) as AdamW without weight decay (the same update, bit for bit), fused into
        # one kernel per step on a GPU.
        self.opt = torch.optim.AdamW(
            params,
            lr=cfg.lr,
            betas=(0.9, 0.98),
            eps=1e-9,
            weight_decay=0.0,
            fused=True if self.device.type == "cuda" else None,
        )
        self.pass_tokens = cfg.pass_tokens or device_pass_tokens(cfg, self.model.cfg, self.device)
        if compiles(cfg, self.device):
            self.objective.compile()
        self.folder = RunFolder(cfg, self.objective, self.tok, self.log)
        self.progress = Progress() if last is None else self.folder.load_last(last, self.opt)
        self.ddp = (
            torch.nn.parallel.DistributedDataParallel(
                self.objective, find_unused_parameters=self.objective.unused_parameters
            )
            if self.procs.world > 1
            else self.objective
        )
        mc = self.model.cfg
        self.log(
            f"model: {self.model.num_parameters() / 1e6:.2f}M parameters, {mc.enc_layers}+{mc.dec_layers} "
            f"layers, d_model {mc.d_model}; {self.procs.world} process(es) on {self.device}" + self.objective.describe()
        )

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
        pieces = (
            [idx]
            if self.pass_tokens >= cfg.batch_tokens
            else [
                [idx[j] for j in part]
                for part in data_mod.token_batches([self.lengths[i] for i in idx], self.pass_tokens, None)
            ]
        )
        self.opt.zero_grad(set_to_none=True)
        loss, n_tok = accumulate(
            self.ddp,
            [
                data_mod.training_tensors([self.src_ids[i] for i in part], [self.tgt_ids[i] for i in part])
                for part in pieces
            ],
            self.model.cfg.pad_id,
            self.device,
        )
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
        self.run_tokens, self.run_seconds = 0, 0.0  # this process's updates: the tokens/s log.jsonl records
        while p.step < cfg.max_steps and not self._should_stop(limit_s):
            batches = data_mod.token_batches(self.lengths, cfg.batch_tokens, seed=cfg.seed * 1000 + p.epoch)
            mine = batches[self.procs.rank :: world]
            n_steps = len(batches) // world  # every rank must run the same number of steps
            while p.batch_in_epoch < n_steps and p.step < cfg.max_steps and not self._should_stop(limit_s):
                loss, n_tok = self.update(mine[p.batch_in_epoch])
                tok_count, loss_sum, loss_n = tok_count + n_tok, loss_sum + loss, loss_n + 1
                now = time.time()
                p.elapsed += now - t_last
                self.run_tokens, self.run_seconds = self.run_tokens + n_tok * world, self.run_seconds + now - t_last
                t_last = now
                if self.procs.is_main() and p.step % cfg.log_every == 0:
                    eta = min((cfg.max_steps - p.step) * p.elapsed / max(p.step, 1), limit_s - p.elapsed)
                    self.log(
                        f"step {p.step:6d} | epoch {p.epoch} | loss {loss_sum / loss_n:.3f} | lr {self.lr:.2e} | "
                        f"{tok_count * world / max(now - window_start, 1e-9):,.0f} tok/s | "
                        f"{p.elapsed / 60:.1f} min | ETA {max(eta, 0) / 60:.1f} min"
                    )
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
            raise Interrupted(
                f"interrupted at step {p.step}: {self.out}/last.pt saved; continue with the same command and --resume"
            )
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
            if self.run_seconds:  # training tokens per second since the run (or its resumption) started
                scores["tokens_per_s"] = round(self.run_tokens / self.run_seconds)
            self.log(
                f"eval step {self.progress.step}: " + format_scores(scores) + self.objective.eval_note(len(self.dev))
            )
            self.folder.save_evaluation(scores, self.progress, self.opt)
        self.procs.barrier()

    def run(self) -> dict:
        self._t0 = time.time()
        self.prepare()
        self._t0 = time.time()
        with stop_on_sigint(self):
            return self.train()


def accumulate(
    objective: torch.nn.Module, pieces: list[tuple[torch.Tensor, ...]], pad_id: int, device: torch.device
) -> tuple[float, int]:
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


def compiles(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether the run compiles its passes (Objective.compile): compile "on", or "auto" on a GPU.
    On a CPU, torch.compile's inductor builds its kernels with a C++ compiler, which must be there."""
    if cfg.compile == "off" or (cfg.compile == "auto" and device.type != "cuda"):
        return False
    if device.type == "cpu" and cpp_compiler() is None:
        raise TrainingError(
            "--compile on needs a C++ compiler on a CPU (torch.compile builds its kernels with "
            "one): install g++, or train with --compile off"
        )
    return True


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


def log_to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
