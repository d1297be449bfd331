"""The run folder: what a training run writes into out_dir and how it claims, resumes and finishes it.

Files in out_dir (refdec.training's docstring says what each holds): tokenizer.json, last.pt,
best.pt, snapshots/, average.pt, model.pt, log.jsonl. A run never clobbers another: an out_dir that
already holds a run's files is refused unless the run resumes it (its stored configuration must then
agree beyond RESUMABLE_CHANGES) or is told to overwrite it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import average_states, load_checkpoint, make_checkpoint, save_atomic
from ..config import TrainConfig
from ..data import DATA_DIR
from ..errors import TrainingError
from ..repo import shown
from ..tokenizer import Tokenizer
from .objectives import Objective
from .processes import Processes

# What a training run writes into its out_dir (and what --overwrite removes).
RUN_FILES = ("tokenizer.json", "last.pt", "best.pt", "average.pt", "model.pt", "log.jsonl", "snapshots")


# Fields a resumed run may change: how long and how verbosely it runs, not what it trains.
RESUMABLE_CHANGES = (
    "max_steps",
    "time_limit_min",
    "threads",
    "log_every",
    "eval_every",
    "eval_sentences",
    "speed_sentences",
    "pass_tokens",
    "compile",
    "dev_limit",
    "out_dir",
)


PATH_FIELDS = ("init_from", "tokenizer_from", "encoder_from", "kd_from", "data_dir")


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
        raise TrainingError(
            f"{out} already holds a training run ({', '.join(present)}); pass --resume to continue "
            f"it, --overwrite to replace it, or another --out-dir"
        )


def check_out_dir_data(out_dir: str, data_dir: str | None, task: str) -> None:
    """Refuse, before any work, an --out-dir among the run's training data: the folder its data files
    are read from (<data folder>/<task>/: train.src, train.tgt, dev.src ..., plain or .gz) or a folder
    inside it, and the data folder itself (--data-dir, the repository's data/ by default), which
    holds the task folders. The run's model.pt, tokenizer.json, log.jsonl and snapshots/ would
    otherwise lie among the files it reads, and --overwrite deletes those names there. A folder that
    holds the data folder (a project folder with data/ and runs/ side by side), another task's folder
    and any other folder pass."""
    data = Path(data_dir or DATA_DIR).resolve()
    folder, out = data / task, Path(out_dir).resolve()
    written, instead = (
        "model.pt, tokenizer.json, log.jsonl and snapshots/ would be written among",
        "give a folder of the run's own outside it, such as runs/<name>",
    )
    if out == folder or folder in out.parents:
        raise TrainingError(
            f"--out-dir {out_dir} {'is' if out == folder else 'lies inside'} the folder of the run's "
            f"training data ({shown(folder)}, its train and dev files): {written} them; {instead}"
        )
    if out == data:
        raise TrainingError(
            f"--out-dir {out_dir} is the data folder the run reads ({shown(data)}, whose {task}/ "
            f"holds its training data): {written} the task folders; {instead}"
        )


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
    return [
        f"{k}: {stored.get(k)!r} -> {v!r}"
        for k, v in new.items()
        if k not in RESUMABLE_CHANGES and norm(k, stored.get(k)) != norm(k, v)
    ]


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
        raise TrainingError(
            f"{out}/last.pt was trained with another configuration ({'; '.join(changed)}); "
            f"resume with the same options, or start a new run in another --out-dir"
        )
    return last


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
        return {
            "optimizer": opt.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "elapsed": self.elapsed,
            "best_loss": self.best_loss,
            "snapshots": self.snapshots,
            "rng": torch.get_rng_state(),
        }

    @classmethod
    def restore(cls, st: dict, opt: torch.optim.Optimizer) -> Progress:
        opt.load_state_dict(st["optimizer"])
        torch.set_rng_state(st["rng"])
        return cls(st["step"], st["epoch"], st["batch_in_epoch"], st["elapsed"], st["best_loss"], list(st["snapshots"]))


class RunFolder:
    """The checkpoints a run writes into out_dir (refdec.training's docstring lists them)."""

    def __init__(self, cfg: TrainConfig, objective: Objective, tok: Tokenizer, log):
        self.cfg, self.objective, self.tok, self.log = cfg, objective, tok, log
        self.out = Path(cfg.out_dir)

    def checkpoint(self, progress: Progress, meta_entries: dict | None = None, half: bool = False) -> dict:
        meta = {"train_config": self.cfg.to_dict(), "minutes": round(progress.elapsed / 60, 2), **(meta_entries or {})}
        checkpoint = make_checkpoint(self.objective.model, self.cfg.task, self.tok, progress.step, meta, half=half)
        checkpoint.update(self.objective.checkpoint_entries(half))
        return checkpoint

    def save_last(self, progress: Progress, opt: torch.optim.Optimizer) -> None:
        checkpoint = self.checkpoint(progress)
        checkpoint["train_state"] = progress.state(opt)
        save_atomic(checkpoint, self.out / "last.pt")

    def load_last(self, checkpoint: dict, opt: torch.optim.Optimizer) -> Progress:
        if checkpoint.get("tokenizer_sha256") != self.tok.sha256:
            raise TrainingError(f"{self.out}/last.pt does not match {self.out}/tokenizer.json (another vocabulary)")
        self.objective.model.load_state_dict(checkpoint["model"])
        self.objective.load_entries(checkpoint)
        progress = Progress.restore(checkpoint["train_state"], opt)
        self.log(
            f"resumed from {self.out}/last.pt at step {progress.step} (epoch {progress.epoch}, "
            f"{progress.elapsed / 60:.1f} min trained)"
        )
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
            self.objective.model.load_state_dict(average_states([snap["model"] for snap in snaps]))
            self.objective.average_entries(snaps)
            avg = evaluate()
            save_atomic(self.checkpoint(progress, {**avg, "averaged": len(snaps)}), self.out / "average.pt")
            results["average"] = avg
            self.log(f"average of {len(snaps)} snapshots: " + format_scores(avg))
        if (self.out / "best.pt").exists():
            best = load_checkpoint(self.out / "best.pt")
            results["best"] = {
                **{
                    k: best["meta"][k]
                    for k in ("dev_loss", "dev_bleu", "dev_block_accuracy", "dev_tokens_per_call")
                    if k in best["meta"]
                },
                "step": best["step"],
            }
        chosen = "average" if "average" in results and self.rank(results["average"]) <= progress.best_loss else "best"
        if self.cfg.pick == "last":  # e.g. alignment to a teacher: the references' dev loss is not the aim
            chosen = "last"
        if (self.out / f"{chosen}.pt").exists():
            checkpoint = load_checkpoint(self.out / f"{chosen}.pt")
            self.objective.model.load_state_dict(checkpoint["model"])
            self.objective.load_entries(checkpoint)
            final = self.checkpoint(progress, {**checkpoint["meta"], "picked": chosen}, half=True)
            note = self.objective.final_checkpoint(final)
            save_atomic(final, self.out / "model.pt")
            self.log(f"model.pt <- {chosen}.pt (float16{note})")
        return results


def format_scores(scores: dict) -> str:
    names = {
        "dev_loss": "dev loss",
        "dev_bleu": "dev BLEU",
        "dev_tokens_per_call": "tokens per call",
        "dev_block_accuracy": "block accuracy",
    }
    return " | ".join(f"{names[k]} {scores[k]:.4f}" for k in names if k in scores)
