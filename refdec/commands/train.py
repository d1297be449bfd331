"""Train a refdec model.

    python train.py --preset mt-en-de                 # about an hour on a 2-core CPU, into runs/mt-en-de/
    python train.py --preset mt-en-de --resume        # continue after an interruption (or Ctrl-C)
    python train.py --preset tiny --max-steps 20 --out-dir runs/smoke  # seconds: a smoke run
    python train.py --preset tiny --data-dir mydata --task up --out-dir runs/up  # your own corpus, mydata/up/train.src
    torchrun --nproc_per_node 2 train.py --preset tiny --out-dir runs/ddp    # data-parallel

Any field of a preset can be overridden (see --help). Output: refdec/training's docstring. A task
of your own is a folder <data-dir>/<task>/ holding train.src and train.tgt (plain or .gz, one
sentence a line), dev.src and dev.tgt if it has a dev set (else 1 in 20 training pairs, the same in
every run, are held out as one: refdec.data.training_splits); docs/usage.md, "Training on your own
corpus". --encoder-from or --init-from a checkpoint other than the preset's own brings that model's
shape to every field the command line leaves out (follow_checkpoint), and a note says which.
A run writes into runs/<preset>/ (under the current folder) unless --out-dir says otherwise; the
shipped models in checkpoints/ (and the data sets in data/) are only ever read: a run goes into
checkpoints/<name> only when told with --out-dir checkpoints/<name> --overwrite (and --resume
continues such a run), never into checkpoints/ or data/ themselves, nor among the run's own
training data (its --data-dir, or the task's folder in it: refdec.training.check_out_dir_data). A
folder that already holds a run is refused unless --resume continues it or --overwrite replaces it.
Ctrl-C saves last.pt and exits; the same command with --resume continues exactly where it stopped.
The paths a preset names (its starting checkpoint, vocabulary, data) are the repository's, whatever
the current folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from ..config import TrainConfig
from ..errors import UsageError, run_command
from ..interrupt import hold_sigint, release_sigint
from ..presets import PRESETS
from ..repo import REPO, check_not_shipped, repo_file
from . import as_typed

HELP = {
    "task": "task to train on: the folder <data-dir>/<task>/ (train.src and train.tgt, plain or .gz; without dev.src "
    "and dev.tgt, 1 in 20 training pairs are held out as the dev set)",
    "out_dir": "folder for tokenizer.json and checkpoints (the preset's: runs/<preset>; a folder inside the shipped "
    "checkpoints/ or data/ only with --overwrite, those folders themselves never, nor the folder of the "
    "run's own training data or its --data-dir)",
    "vocab_size": "BPE vocabulary size (joint source/target)",
    "d_model": "model width",
    "n_heads": "attention heads",
    "d_ff": "feed-forward width",
    "enc_layers": "encoder layers",
    "dec_layers": "decoder layers",
    "dropout": "dropout rate",
    "norm_first": "pre-norm (true) or post-norm (false)",
    "max_positions": "longest sequence the model accepts",
    "max_train_len": "skip training pairs longer than this (tokens)",
    "batch_tokens": "padded source+target tokens per batch and process",
    "pass_tokens": "padded tokens per forward/backward pass, gradients accumulated over the batch's passes "
    "(0 = by the device: the whole batch on a CPU, what fits on a GPU)",
    "compile": "torch.compile each forward/backward pass's loss: on, off, or auto (on a GPU, off on a CPU, where it "
    "did not pay); the first passes compile first (minutes), on a CPU with a C++ compiler (g++)",
    "lr": "peak learning rate",
    "warmup_steps": "linear warmup steps before inverse-sqrt decay",
    "label_smoothing": "label smoothing epsilon",
    "clip_norm": "gradient norm clip",
    "max_steps": "stop after this many updates",
    "time_limit_min": "stop after this many minutes of training (0 = none)",
    "eval_every": "validate and checkpoint every N updates",
    "eval_sentences": "dev sentences decoded for BLEU",
    "keep_last": "snapshots kept and averaged at the end",
    "pick": "what model.pt holds: dev-loss (best or average, the lower dev loss), tokens-per-call (drafters and "
    "heads: best or average, the more tokens per call of their decoder) or last (the final weights)",
    "speed_sentences": "drafters and heads: dev sentences their decoder (GAD with the verifier, blockwise) runs at "
    "each evaluation for the tokens per call",
    "seed": "random seed (runs are reproducible)",
    "train_limit": "use only the first N training pairs (0 = all)",
    "dev_limit": "validate on only the first N dev pairs (0 = all)",
    "data_dir": "data folder holding <task>/ (default: the repo's data/)",
    "threads": "torch threads (0 = torch's count, cut to the cores other processes leave idle)",
    "log_every": "progress line every N updates",
    "init_from": "start from this checkpoint: its shape, weights and tokenizer (with --encoder-from: a drafter "
    "continued, or a whole model's embeddings, first --dec-layers decoder layers, norm and output; "
    "a heads file: its heads, on the base it names)",
    "tokenizer_from": "train with this tokenizer.json instead of a new BPE "
    "(e.g. a small model on a large one's vocabulary)",
    "proposal_k": "train k-1 blockwise proposal heads on top of the model (0 = none)",
    "proposal_d_ff": "hidden width per proposal head (0 = the model's d_ff)",
    "freeze_base": "with --proposal-k: train only the heads",
    "head_loss": "with --proposal-k: random (one head per batch), mean (all heads) or base+random "
    "(the base's loss in every batch plus one random head)",
    "drafter_k": "train a GAD block drafter filling k masks (0 = an autoregressive model)",
    "drafter_layout": "drafter self-attention: causal (prefix cached across iterations) or bidirectional (the paper's)",
    "glancing_start": "drafter: glancing ratio at step 0",
    "glancing_end": "drafter: glancing ratio after the decay",
    "glancing_decay_steps": "drafter: updates over which the glancing ratio decays linearly",
    "early_exit": "also train the first N decoder layers as an early exit (BiLD's small model; 0 = no)",
    "encoder_from": "train a decoder (--enc-layers 0) on this checkpoint's frozen encoder and vocabulary "
    "(BiLD's small model on the large model's encoder)",
    "kd_from": "word-level distillation: also learn this teacher checkpoint's next-token distributions "
    "(same vocabulary)",
    "kd_weight": "with --kd-from: the weight of the teacher's distributions in the loss (the rest: the labels')",
}


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    command = as_typed("train")  # the examples read as the user typed the command
    p = argparse.ArgumentParser(
        prog=command,
        description=__doc__.replace("python train.py", command),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="starting configuration")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out-dir from its last.pt (same options; "
        "only max-steps, time-limit-min, threads, log-every, eval-every, eval-sentences, speed-sentences, dev-limit, "
        "pass-tokens and compile may change)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out-dir (its checkpoints, tokenizer and log are deleted first)",
    )
    for f in dataclasses.fields(TrainConfig):
        kind = (
            {bool: parse_bool, int: int, float: float, str: str}[type(f.default)]
            if f.default is not dataclasses.MISSING
            else str
        )
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=None,
            help=HELP.get(f.name, "") + " (default: the preset's)",
        )
    return p


def preset_config(preset: str, changes: dict) -> TrainConfig:
    """The preset with the command line's changes. The preset's own paths are the repository's
    (refdec.repo.repo_file: in a copy installed without the repository, one line naming the flag that
    gives the path instead), so a run from any folder reads the same files; paths given on the
    command line are the user's, relative to the current folder."""
    cfg = PRESETS[preset]
    from ..training import PATH_FIELDS

    repo_paths = {
        f: str(repo_file(getattr(cfg, f), flag=f"--{f.replace('_', '-')}"))
        for f in PATH_FIELDS
        if f not in changes and getattr(cfg, f) and not os.path.isabs(getattr(cfg, f))
    }
    if not (cfg.data_dir or changes.get("data_dir")):
        repo_file("data", flag="--data-dir")  # the default, the repository's data/ (refdec.data.DATA_DIR)
    return cfg.replace(**repo_paths, **changes)


# The shape of a model, which a checkpoint given in place of a preset's own brings (follow_checkpoint).
SHAPE_FIELDS = ("vocab_size", "d_model", "n_heads", "d_ff", "max_positions")


def follow_checkpoint(preset: str, cfg: TrainConfig, changes: dict) -> tuple[TrainConfig, str]:
    """A preset borrowed for another model: when the command line gives --encoder-from or --init-from
    in place of the preset's own checkpoint, the run takes that model's shape (its vocabulary, width,
    heads, feed-forward width and positions; with --init-from alone, its layers too: build_model
    continues that model whole), in every field the command line leaves out, and keeps the preset's
    share of the feed-forward width for proposal heads (--proposal-d-ff) unless the checkpoint brings
    heads of its own. Otherwise a decoder of the preset's width would train on another model's
    encoder, with more positions than the model it drafts for. Returns the configuration and a line
    naming what changed ("" when nothing did)."""
    from ..checkpoint import load_checkpoint
    from ..config import ModelConfig

    own = PRESETS[preset]
    given = [
        f
        for f in ("encoder_from", "init_from")
        if changes.get(f) and not (getattr(own, f) and Path(changes[f]).resolve() == (REPO / getattr(own, f)).resolve())
    ]
    if not given:
        return cfg, ""
    source = "encoder_from" if cfg.encoder_from and "encoder_from" in given else given[0]
    checkpoint = load_checkpoint(getattr(cfg, source))
    shape = ModelConfig.from_dict(checkpoint["model_config"])
    fields = list(SHAPE_FIELDS) + (
        ["enc_layers", "dec_layers"] if source == "init_from" and not cfg.encoder_from else []
    )
    follow = {f: getattr(shape, f) for f in fields if f not in changes and getattr(cfg, f) != getattr(shape, f)}
    if cfg.proposal_k and "proposal_d_ff" not in changes and source == "init_from":
        heads = checkpoint.get("proposal", {}).get("config")
        if heads:
            follow |= {"proposal_k": heads["k"], "proposal_d_ff": heads["d_ff"]}
            follow = {k: v for k, v in follow.items() if getattr(cfg, k) != v and k not in changes}
        elif cfg.proposal_d_ff and cfg.proposal_d_ff != (
            width := max(1, round(cfg.proposal_d_ff * shape.d_ff / own.d_ff))
        ):
            follow["proposal_d_ff"] = width
    if not follow:
        return cfg, ""
    flag = "--" + source.replace("_", "-")
    said = ", ".join(f"{f} {getattr(cfg, f)} -> {v}" for f, v in follow.items())
    return cfg.replace(**follow), (
        f"note: {flag} {getattr(cfg, source)} replaces the preset {preset}'s model, so the run takes its shape: "
        f"{said} (give these options to choose others)"
    )


def main(argv: list[str] | None = None) -> int:
    hold_sigint()  # a Ctrl-C while torch is imported waits for the import to finish (see refdec/interrupt.py)
    try:
        # A Ctrl-C that reaches here came before training started (loading data, training the vocabulary).
        return run_command(
            lambda: train(build_parser().parse_args(argv)),
            known=(FileNotFoundError, NotADirectoryError, PermissionError, ValueError, TypeError),
            interrupted="interrupted before training started: nothing was saved",
        )
    finally:
        release_sigint(raise_held=False)  # --help or a bad flag ends main before train() released it


def check_paths(changes: dict, path_fields) -> None:
    """A path typed on the command line that is not there is most likely a typo: say so, naming the flag."""
    for name in path_fields:
        flag, value = f"--{name.replace('_', '-')}", changes.get(name)
        if value and not os.path.exists(value):
            raise UsageError(f"{flag} {value}: no such {'folder' if name == 'data_dir' else 'file'}; check the path")
        if value and name != "data_dir" and os.path.isfile(os.path.join(value, "model.pt")):
            raise UsageError(
                f"{flag} {value} is a folder: give the checkpoint in it, {flag} {os.path.join(value, 'model.pt')}"
            )


def check_out_dir_place(out_dir: str, *, overwrite: bool, resume: bool) -> None:
    """Where a run may write, checked before any work: not into the shipped checkpoints/ or data/
    folders themselves, into a folder inside one only when told (--overwrite, or --resume of a run
    started so; a shipped model's folder holds no last.pt to resume; refdec.repo.check_not_shipped),
    and only where this user can write."""
    check_not_shipped(
        "--out-dir", out_dir, ("--overwrite", overwrite or resume), instead="a folder of the run's own, runs/<name>"
    )
    out = Path(out_dir).resolve()
    there = next(p for p in (out, *out.parents) if p.exists())  # the folder the run would create its own in
    if not there.is_dir():
        raise UsageError(f"--out-dir {out_dir}: {there} is a file, not a folder; give a folder path")
    if not os.access(there, os.W_OK | os.X_OK):
        raise UsageError(
            f"--out-dir {out_dir}: the folder {there} is not writable; give a folder you can write "
            f"to (or make it writable)"
        )


def out_dir_error(e: OSError, out_dir: str) -> UsageError | None:
    """A file of the run's folder it could not write or read (a read-only disk, a full one): one line
    naming --out-dir, the file and the reason, instead of a bare OSError."""
    out = Path(out_dir).resolve()
    if not e.filename or not (out == Path(e.filename).resolve() or out in Path(e.filename).resolve().parents):
        return None
    return UsageError(
        f"--out-dir {out_dir}: cannot write {e.filename} ({e.strerror or type(e).__name__}); "
        f"give a folder you can write to, with room for the checkpoints"
    )


def train(args) -> int:
    changes = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if getattr(args, f.name) is not None
    }
    from ..machine import BusyCores, fit_threads, usable_cores
    from ..training import PATH_FIELDS, Interrupted, Trainer, check_out_dir_data, log_to_stderr

    release_sigint()  # every import is done: a Ctrl-C held so far stops here, later ones at once
    busy = BusyCores()  # other processes' CPU use while the configuration is checked
    cfg = preset_config(args.preset, changes)
    check_paths(changes, PATH_FIELDS)
    cfg, followed = follow_checkpoint(args.preset, cfg, changes)
    cfg.model_config(cfg.vocab_size)  # validates the shape before any work
    if cfg.threads > usable_cores():
        raise UsageError(
            f"--threads {cfg.threads} is more than the {usable_cores()} cores this machine gives "
            f"the run (more threads than cores only slows it down)"
        )
    check_out_dir_data(cfg.out_dir, cfg.data_dir, cfg.task)  # first: --overwrite would not make it right
    check_out_dir_place(cfg.out_dir, overwrite=args.overwrite, resume=args.resume)
    if followed:
        log_to_stderr(followed)
    if not cfg.threads and int(os.environ.get("WORLD_SIZE", "1")) == 1:  # (under torchrun the others are its ranks)
        note = fit_threads(busy.others())
        if note:
            log_to_stderr(f"note: {note}")
    try:
        results = Trainer(cfg, resume=args.resume, overwrite=args.overwrite, log=log_to_stderr).run()
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return 130
    except OSError as e:
        err = out_dir_error(e, cfg.out_dir)
        if err is None:
            raise
        raise err from e
    for name, r in results.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    return 0
