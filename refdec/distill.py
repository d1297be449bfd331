"""Sequence-level knowledge distillation (Kim and Rush 2016): a teacher decodes the training sources
and its outputs become the training targets.

    python -m refdec.distill --task mt-en-de --out data/distilled/mt-en-de-beam5       # beam 5
    python -m refdec.distill --task mt-en-de --algo greedy --out data/distilled/mt-en-de-greedy
    python train.py --preset mt-en-de --data-dir data/distilled/mt-en-de-beam5 ...    # train on it

The output is a data folder in the layout of data/ (<out>/<task>/train.{src,tgt,doc}.gz, the teacher's
outputs as train.tgt.gz; dev and test copied unchanged, so validation stays on real references)
plus <out>/<task>/distill.json (teacher checkpoint and its sha256, algorithm, counts, time).
GAD's drafter and verifier, blockwise parallel decoding's heads (section 6.2 of Stern et al.) and
BiLD's prediction alignment (the large model's greedy outputs, section 3.5.1 of Kim et al.) all
train on such a folder via train.py --data-dir.

Sources are decoded in batches of similar length (batched beam search or greedy) and written back
in corpus order. Work is saved every --save-every batches to <out>/<task>/.partial.jsonl, and a
rerun with the same options continues from there; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from . import data as data_mod
from .checkpoint import CheckpointError, file_sha256, load_model
from .decoding import beam_search, greedy

REPO = Path(__file__).resolve().parent.parent


def write_gz(path: Path, lines: list[str]) -> None:
    """gzip text with mtime 0, so the same content always gives the same bytes."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write("".join(line + "\n" for line in lines).encode("utf-8"))


def distill(task: str, model_path: Path, out: Path, *, algo: str = "beam", beam_size: int = 5,
            batch_size: int = 64, limit: int = 0, save_every: int = 20, data_dir: Path | None = None,
            device: str = "cpu", log=print) -> dict:
    data_dir = Path(data_dir or data_mod.DATA_DIR)
    model, tok, ckpt = load_model(model_path, task=task, device=device)
    train = data_mod.load_split(task, "train", data_dir)
    n = min(limit, len(train)) if limit else len(train)
    folder = out / task
    folder.mkdir(parents=True, exist_ok=True)
    options = {"teacher": str(model_path), "teacher_sha256": file_sha256(model_path),
               "algo": algo, "beam_size": beam_size if algo == "beam" else None, "sentences": n}
    partial = folder / ".partial.jsonl"
    done: dict[int, str] = {}
    if partial.exists():
        lines = partial.read_text(encoding="utf-8").splitlines()
        if lines and json.loads(lines[0]) == options:
            for line in lines[1:]:
                rec = json.loads(line)
                done[rec["i"]] = rec["out"]
            log(f"continuing: {len(done)} of {n} sentences already distilled")
        else:
            partial.unlink()
    if not partial.exists():
        partial.write_text(json.dumps(options) + "\n", encoding="utf-8")

    limit_len = model.cfg.max_positions - 1
    ids = [s[:limit_len] for s in tok.encode_batch(train.src[:n])]
    todo = sorted((i for i in range(n) if i not in done and ids[i]), key=lambda i: len(ids[i]))
    for i in range(n):
        if not ids[i]:
            done[i] = ""  # an empty source gives an empty target, as in decode.py
    t0, pending = time.time(), []
    batches = [todo[j:j + batch_size] for j in range(0, len(todo), batch_size)]
    with torch.inference_mode():
        for b, idx in enumerate(batches, 1):
            rows = [ids[i] for i in idx]
            src = data_mod.source_tensor(rows).to(device)
            max_len = min(limit_len, 2 * max(map(len, rows)) + 10)
            res = (beam_search(model, src, max_len=max_len, beam_size=beam_size) if algo == "beam"
                   else greedy(model, src, max_len=max_len))
            for i, t in zip(idx, res.tokens):
                text = tok.decode(t.tolist()).replace("\r", " ").replace("\n", " ")
                done[i] = text
                pending.append(json.dumps({"i": i, "out": text}, ensure_ascii=False))
            if b % save_every == 0 or b == len(batches):
                with open(partial, "a", encoding="utf-8") as f:
                    f.write("".join(p + "\n" for p in pending))
                pending = []
                rate = sum(map(len, batches[:b])) / (time.time() - t0)
                left = sum(map(len, batches[b:]))
                log(f"  {n - left}/{n} sentences, {rate:.1f}/s, ETA {left / rate / 60:.1f} min")
    targets = [done[i] for i in range(n)]
    write_gz(folder / "train.src.gz", train.src[:n])
    write_gz(folder / "train.tgt.gz", targets)
    write_gz(folder / "train.doc.gz", train.docs[:n])
    for split in ("dev", "test"):
        for f in sorted((data_dir / task).glob(f"{split}.*.gz")):
            shutil.copyfile(f, folder / f.name)
    same = sum(a == b for a, b in zip(targets, train.tgt[:n]))
    report = {**options, "seconds": round(time.time() - t0, 1), "identical_to_reference": same / max(n, 1)}
    (folder / "distill.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    partial.unlink()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, choices=sorted(data_mod.TASKS))
    p.add_argument("--model", help="teacher checkpoint (default: checkpoints/<task>/model.pt)")
    p.add_argument("--out", required=True, help="output data folder (the task's files go to <out>/<task>/)")
    p.add_argument("--algo", default="beam", choices=["beam", "greedy"], help="teacher decoding (default beam)")
    p.add_argument("--beam-size", type=int, default=5, help="beams (default 5)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch (default 64)")
    p.add_argument("--limit", type=int, default=0, help="distill only the first N training pairs (0 = all)")
    p.add_argument("--save-every", type=int, default=20, help="save progress every N batches (default 20)")
    p.add_argument("--data-dir", help="source data folder (default: the repo's data/)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when one is available, else cpu)")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {device}: this machine has no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    if args.beam_size < 1 or args.batch_size < 1 or args.limit < 0 or args.save_every < 1:
        print("error: --beam-size, --batch-size and --save-every must be at least 1, --limit at least 0", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else REPO / "checkpoints" / args.task / "model.pt"
    try:
        report = distill(args.task, model, Path(args.out), algo=args.algo, beam_size=args.beam_size,
                         batch_size=args.batch_size, limit=args.limit, save_every=args.save_every,
                         data_dir=Path(args.data_dir) if args.data_dir else None, device=device,
                         log=lambda m: print(m, file=sys.stderr, flush=True))
    except (CheckpointError, FileNotFoundError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
