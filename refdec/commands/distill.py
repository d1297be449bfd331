"""Sequence-level knowledge distillation (Kim and Rush 2016): a teacher decodes the training sources
and its outputs become the training targets.

    python -m refdec distill --task mt-en-de --out data/distilled/mt-en-de-beam5 --overwrite   # beam 5
    python -m refdec distill --task mt-en-de --algo greedy --out data/distilled/mt-en-de-greedy --overwrite
    python train.py --preset mt-en-de --data-dir data/distilled/mt-en-de-beam5 ...    # train on it
    python -m refdec distill --task mt-en-de --algo greedy --sources data/mono-en/train.src.gz \
        --add data/distilled/mt-en-de-greedy --out data/distilled/mt-en-de-mono --overwrite   # monolingual text

The output is a data folder in the layout of data/ (<out>/<task>/train.{src,tgt,doc}.gz, the teacher's
outputs as train.tgt.gz; dev and test copied unchanged, so validation stays on real references)
plus <out>/<task>/distill.json (teacher checkpoint and its sha256, algorithm, counts, time).
GAD's drafter and verifier, blockwise parallel decoding's heads (section 6.2 of Stern et al.) and
BiLD's prediction alignment (the large model's greedy outputs, section 3.5.1 of Kim et al.) all
train on such a folder via train.py --data-dir.

--sources FILE distills sentences that have no reference (one per line, gzip or plain text; the
document ids are read from the FILE's .doc.gz sibling when there is one) instead of the task's
training sources, and --add DIR puts the training pairs of a folder distilled by the same teacher
with the same decoding first (checked against its distill.json), so that monolingual sources add
to the distilled translation pairs without decoding those again.

The repository's data/ and checkpoints/ are shipped and only read unless told: an --out inside one
(data/distilled/<name>, where the presets look for distilled folders) needs --overwrite, which lets
the run write there and replace a folder of that name; data/ and checkpoints/ themselves are always
refused (refdec.repo.check_not_shipped). Elsewhere (runs/distilled/<name>) no flag is needed.

Sources are decoded in batches of similar length (batched beam search or greedy) and written back
in corpus order. The batches are fixed by the sources alone, so a run that is stopped and rerun
decodes the same batches as one that is not and gives the same bytes. Work is saved every
--save-every batches to <out>/<task>/.partial.jsonl, and a rerun with the same options continues
from there (a line cut off by a kill is decoded again); progress goes to stderr.

Across processes (one machine or several): `torchrun --nproc_per_node N -m refdec distill ...`.
Rank r decodes the batches r, r + N, r + 2N, ... (the same batches as one process: the same bytes)
and saves them to .partial.<r>.jsonl; once every rank is done, rank 0 merges them in corpus order
and writes the folder. A rerun, with any number of processes, continues from every partial file of
the same options.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from .. import data as data_mod
from ..app.inputs import add_device, add_threads, check_outputs, check_threads, checkpoint_files, shown_path
from ..app.resume import Records, partial_files, partial_name, read_partials, start_partial
from ..checkpoint import file_sha256, load_model
from ..decoding import decode_beam, decode_greedy
from ..errors import UsageError, run_command
from ..machine import BusyCores, check_device, fit_threads
from ..progress import ProgressLine
from ..repo import repo_file
from ..timing import clock
from .harness import command_parser

PARTIAL = ".partial"  # <out>/<task>/.partial.jsonl, .partial.<rank>.jsonl under torchrun (refdec.app.resume)


def write_gz(path: Path, lines: list[str]) -> None:
    """gzip text with mtime 0, so the same content always gives the same bytes."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write("".join(line + "\n" for line in lines).encode("utf-8"))


def doc_sibling(path: Path) -> Path | None:
    """The `.doc` sibling of a source file (`x.src.gz` -> `x.doc.gz`, `x.txt` -> `x.doc.txt`), if it exists."""
    name = path.name
    doc_name = name.replace(".src.", ".doc.") if ".src." in name else f"{path.stem}.doc{path.suffix}"
    return path.with_name(doc_name) if doc_name != name and path.with_name(doc_name).exists() else None


def check_paths(
    task: str,
    model_path: Path,
    folder: Path,
    data_dir: Path,
    sources: Path | None,
    add: Path | None,
    overwrite: bool = False,
) -> None:
    """None of the files distill writes into `folder` is one it reads, and `folder` is in the shipped
    data/ or checkpoints/ only with --overwrite (refdec.app.inputs.check_outputs)."""
    copied = sorted(f.name for split in ("dev", "test") for f in (data_dir / task).glob(f"{split}.*"))
    reads = checkpoint_files("the teacher (--model)", model_path) | {
        f"the data folder of {task} ({shown_path(data_dir / task)})": data_dir / task,
        "--sources": sources,
        "the document ids beside --sources": sources and doc_sibling(sources),
        f"the training data of --add ({add and add / task})": add and add / task,
    }
    written = ["train.src.gz", "train.tgt.gz", "train.doc.gz", "distill.json", *copied]
    check_outputs(
        {"--out": [folder.parent, *(folder / name for name in written)]},
        reads,
        folders_made=True,
        opt_in=("--overwrite", overwrite),
    )


def read_sources(path: Path) -> tuple[list[str], list[str] | None]:
    """Sentences of a source file (gzip or plain text, one per line) and the document ids of its
    `.doc` sibling (`x.src.gz` -> `x.doc.gz`, `x.txt` -> `x.doc.txt`), or None when it has none."""
    src = data_mod.read_lines(path)
    doc_path = doc_sibling(path)
    if doc_path is None:
        return src, None
    docs = data_mod.read_lines(doc_path)
    if len(docs) != len(src):
        raise ValueError(f"{doc_path}: {len(docs)} lines but {path} has {len(src)}")
    return src, docs


def added_pairs(add: Path, task: str, options: dict) -> data_mod.Split:
    """Training pairs of a folder distilled by the same teacher with the same decoding."""
    info = json.loads((add / task / "distill.json").read_text(encoding="utf-8"))
    for key in ("teacher_sha256", "algo", "beam_size"):
        if info.get(key) != options[key]:
            raise ValueError(f"--add {add}: its {key} is {info.get(key)!r}, this run's is {options[key]!r}")
    return data_mod.load_split(task, "train", add)


def distill(
    task: str,
    model_path: Path,
    out: Path,
    *,
    algo: str = "beam",
    beam_size: int = 5,
    batch_size: int = 64,
    limit: int = 0,
    save_every: int = 20,
    data_dir: Path | None = None,
    sources: Path | None = None,
    add: Path | None = None,
    overwrite: bool = False,
    device: str = "cpu",
    log=print,
    rank: int = 0,
    world: int = 1,
    barrier=lambda: None,
) -> dict:
    """Decode the task's training sources (or the sentences of `sources`) with the teacher and write
    the training folder <out>/<task>/ (see the module docstring); returns what distill.json holds.
    Process `rank` of `world` (torchrun) decodes every world-th batch; `barrier` waits for all of
    them; rank 0 writes the folder (the others return their options and the batches they decoded).
    `overwrite`: `out` may lie in the repository's data/ or checkpoints/ (refdec.repo.check_not_shipped)."""
    data_dir = Path(data_dir or data_mod.DATA_DIR)
    folder = out / task
    check_paths(task, model_path, folder, data_dir, sources and Path(sources), add and Path(add), overwrite)
    model, tok, _ = load_model(model_path, task=task, device=device)
    if sources is None:
        train = data_mod.load_split(task, "train", data_dir)
        src, docs, refs = train.src, train.docs, train.tgt
    else:
        src, docs = read_sources(Path(sources))
        refs = None
    n = min(limit, len(src)) if limit else len(src)
    options = {
        "teacher": shown_path(model_path),
        "teacher_sha256": file_sha256(model_path),
        "algo": algo,
        "beam_size": beam_size if algo == "beam" else None,
        "sentences": n,
    }
    if sources is not None:
        options |= {"sources": shown_path(sources), "sources_sha256": file_sha256(Path(sources))}
    added = added_pairs(Path(add), task, options) if add is not None else None
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / partial_name(PARTIAL, rank, world)
    done = start_partial(partial, options, barrier)
    if done:
        log(f"continuing: {len(done)} of {n} sentences already distilled")

    limit_len = model.cfg.max_positions - 1
    ids = [s[:limit_len] for s in tok.encode_batch(src[:n])]
    order = sorted((i for i in range(n) if ids[i]), key=lambda i: len(ids[i]))
    for i in range(n):
        if not ids[i]:
            done[i] = ""  # an empty source gives an empty target, as in decode.py
    t0, pending = clock(device), []
    batches = [order[j : j + batch_size] for j in range(0, len(order), batch_size)][rank::world]
    batches = [idx for idx in batches if not all(i in done for i in idx)]
    mine = sum(map(len, batches))  # this process's sentences still to decode
    total, already = (n, n - mine) if world == 1 else (mine, 0)
    progress = ProgressLine(total, "sentences" if world == 1 else f"sentences of rank {rank}", already=already, log=log)
    with torch.inference_mode():
        for b, idx in enumerate(batches, 1):
            rows = [ids[i] for i in idx]
            batch = data_mod.source_tensor(rows).to(device)
            max_len = min(limit_len, 2 * max(map(len, rows)) + 10)
            res = (
                decode_beam(model, batch, max_len=max_len, beam_size=beam_size)
                if algo == "beam"
                else decode_greedy(model, batch, max_len=max_len)
            )
            for i, t in zip(idx, res.tokens):
                text = tok.decode(t.tolist()).replace("\r", " ").replace("\n", " ")
                done[i] = text
                pending.append((i, text))
            saved = b % save_every == 0 or b == len(batches)
            if saved:
                Records(partial).put_many(pending)
                pending = []
            progress.update(
                already + mine - sum(map(len, batches[b:])), now=saved
            )  # a line at each save, and every few seconds
    barrier()  # every process has saved its batches
    if rank:
        return {**options, "rank": rank, "batches": len(batches)}
    done |= read_partials(folder, PARTIAL, options)
    missing = n - sum(i in done for i in range(n))
    if missing:
        raise RuntimeError(f"{missing} of {n} sentences are in no partial file of {folder}: rerun the same command")
    targets = [done[i] for i in range(n)]
    src, docs = src[:n], (docs[:n] if docs is not None else None)
    report = {**options, "seconds": round(clock(device) - t0, 1)}  # the device's work done
    if refs is not None:
        report["identical_to_reference"] = sum(a == b for a, b in zip(targets, refs)) / max(n, 1)
    if added is not None:
        if docs is None:
            docs = [f"{Path(sources).name}/{i + 1}" for i in range(n)]  # line number in the sources
        src, targets, docs = added.src + src, added.tgt + targets, added.docs + docs
        report |= {"added": str(add), "added_pairs": len(added.src), "pairs": len(src)}
    write_folder(folder, data_dir / task, src, targets, docs, report)
    return report


def write_folder(
    folder: Path, task_data: Path, src: list[str], targets: list[str], docs: list[str] | None, report: dict
) -> None:
    """The distilled folder: the pairs (and document ids) as train.*.gz, the task's dev and test files
    unchanged, distill.json; the partial files of the run removed."""
    write_gz(folder / "train.src.gz", src)
    write_gz(folder / "train.tgt.gz", targets)
    if docs is not None:
        write_gz(folder / "train.doc.gz", docs)
    else:
        (folder / "train.doc.gz").unlink(missing_ok=True)  # an earlier run's ids would not line up
    for split in ("dev", "test"):
        for f in sorted(task_data.glob(f"{split}.*")):  # gzip or plain, as the task's folder holds them
            shutil.copyfile(f, folder / f.name)
    (folder / "distill.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    for path in partial_files(folder, PARTIAL):
        path.unlink()


def main(argv: list[str] | None = None) -> int:
    p = command_parser(__doc__, "distill")
    p.add_argument(
        "--task",
        required=True,
        help=f"the task: {', '.join(sorted(data_mod.TASKS))}, or one of your own (its folder in --data-dir, "
        "its teacher --model)",
    )
    p.add_argument("--model", help="teacher checkpoint (default: checkpoints/<task>/model.pt, for a shipped task)")
    p.add_argument(
        "--out",
        required=True,
        help="output data folder (the task's files go to <out>/<task>/); one "
        "inside the repository's data/ or checkpoints/ only with --overwrite",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="let --out lie inside the repository's data/ or checkpoints/ (data/distilled/<name>), replacing its files",
    )
    p.add_argument("--algo", default="beam", choices=["beam", "greedy"], help="teacher decoding (default beam)")
    p.add_argument("--beam-size", type=int, default=5, help="beams (default 5)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch (default 64)")
    p.add_argument("--limit", type=int, default=0, help="distill only the first N sources (0 = all)")
    p.add_argument(
        "--sources",
        help="distill the sentences of this file (one per line, gzip or text; document ids "
        "from its .doc sibling) instead of the task's training sources",
    )
    p.add_argument("--add", help="a folder distilled by the same teacher and decoding whose training pairs go first")
    p.add_argument("--save-every", type=int, default=20, help="save progress every N batches (default 20)")
    p.add_argument("--data-dir", help="source data folder (default: the repo's data/)")
    add_threads(p, says="torch's count, cut to the cores other processes leave idle")
    add_device(p, default=None, says="None: cuda when one is available, else cpu")
    return run_command(lambda: run(p.parse_args(argv)), known=(FileNotFoundError, ValueError))


def run(args: argparse.Namespace) -> int:
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    barrier = lambda: None  # noqa: E731
    if world > 1:  # torchrun: gloo only to wait for each other (no tensors are exchanged)
        import torch.distributed as dist

        dist.init_process_group("gloo")
        barrier = dist.barrier
        if device == "cuda":
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    device = str(check_device(device))
    if args.beam_size < 1 or args.batch_size < 1 or args.limit < 0 or args.save_every < 1:
        raise UsageError("--beam-size, --batch-size and --save-every must be at least 1, --limit at least 0")
    if check_threads(args.threads):
        torch.set_num_threads(args.threads)
    elif world > 1:  # the machine's cores shared between its processes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    elif note := fit_threads(BusyCores().others()):  # a half-second look at the other processes
        print(f"note: {note}", file=sys.stderr, flush=True)
    if args.task not in data_mod.TASKS and not (args.model and args.data_dir):
        raise UsageError(
            f"--task {args.task} is not a shipped task ({', '.join(sorted(data_mod.TASKS))}): give its teacher "
            f"--model and the --data-dir whose {args.task}/ holds its train.src and train.tgt"
        )
    model = Path(args.model) if args.model else repo_file("checkpoints", args.task, "model.pt", flag="--model")
    if not args.data_dir:
        repo_file("data", args.task, flag="--data-dir")  # the task's sources, dev and test sets
    report = distill(
        args.task,
        model,
        Path(args.out),
        algo=args.algo,
        beam_size=args.beam_size,
        batch_size=args.batch_size,
        limit=args.limit,
        save_every=args.save_every,
        data_dir=Path(args.data_dir) if args.data_dir else None,
        sources=Path(args.sources) if args.sources else None,
        add=Path(args.add) if args.add else None,
        overwrite=args.overwrite,
        device=device,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        rank=rank,
        world=world,
        barrier=barrier,
    )
    if rank == 0:
        print(json.dumps(report, indent=2))
    if world > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
