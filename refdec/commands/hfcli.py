"""python -m refdec hf import|export|audit: the command over refdec.hf (its import into a checkpoint, its
export) and refdec.app.hfaudit"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..app.hfaudit import audit, audit_table
from ..app.inputs import check_outputs, checkpoint_files, input_files
from ..data import TASKS
from ..errors import run_command
from ..hf.common import HFError, is_hf_folder
from ..hf.convert import import_folder
from ..hf.export import export
from . import as_typed
from .harness import machine_options, report_option, set_up_machine, write_report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=as_typed("hf"),
        description="Hugging Face transformers folders: import one as a "
        "refdec checkpoint, export a refdec checkpoint, audit transformers' decoders",
    )
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser(
        "import", help="write a refdec checkpoint (model.pt, tokenizer.json) for a transformers folder (and check it)"
    )
    i.add_argument(
        "folder", metavar="FOLDER", help="a transformers model folder (config.json, weights, tokenizer.json)"
    )
    i.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the folder to write model.pt and tokenizer.json into "
        "(created; a new or empty one, outside the repository's checkpoints/ and data/)",
    )
    i.add_argument(
        "--task",
        help="the task recorded in the checkpoint, for the commands that take --task beside "
        "--model (default none: decode.py --model DIR/model.pt --input FILE needs none)",
    )
    i.add_argument("--src-lang", help="the source-language token forced before every source (NLLB: eng_Latn)")
    i.add_argument("--tgt-lang", help="the target-language token forced after the start token (NLLB: deu_Latn)")
    e = sub.add_parser("export", help="write a transformers folder for a refdec checkpoint (and check it)")
    e.add_argument("ckpt", metavar="CKPT", help="a refdec model.pt")
    e.add_argument(
        "out_dir",
        metavar="OUT_DIR",
        help="the folder to write (created; outside the repository's checkpoints/ and data/)",
    )
    e.add_argument(
        "--without-heads",
        action="store_true",
        help="a checkpoint with blockwise proposal heads: export "
        "the model alone (transformers has no place for the heads; without this flag such a checkpoint "
        "is refused)",
    )
    a = sub.add_parser("audit", help="refdec's and transformers' decoders on the same weights and inputs")
    a.add_argument("--task", help="its data/<task>/test.src.gz is decoded (or --input)")
    a.add_argument(
        "--input",
        metavar="FILE",
        help="the sentences to decode, one per line (a transformers folder needs no --task then)",
    )
    a.add_argument("--model", required=True, help="a refdec model.pt or a transformers folder")
    a.add_argument("--small", help="a small model on the same vocabulary: speculative and assisted generation")
    a.add_argument("--limit", type=int, default=100, help="sentences decoded (default 100)")
    a.add_argument("--warmup", type=int, default=2, help="untimed warm-up sentences (default 2)")
    a.add_argument("--gamma", type=int, default=3, help="refdec speculative decoding's draft window (default 3)")
    a.add_argument(
        "--prompt-lookup", type=int, default=10, metavar="N", help="transformers' prompt_lookup_num_tokens (default 10)"
    )
    a.add_argument("--src-lang", help="a transformers folder's source-language token (NLLB: eng_Latn)")
    a.add_argument("--tgt-lang", help="a transformers folder's target-language token (NLLB: deu_Latn)")
    a.add_argument(
        "--routes",
        default="reference",
        help="refdec's decoders on each of these routes, separated "
        "by commas: reference, fast (refdec.routes.fast), graphed (refdec.routes.graphed); "
        "the reference route's always, first (default reference)",
    )
    machine_options(
        a,
        threads=1,
        timed="refdec's and transformers' models both run there, each batch's time read after a device synchronisation",
    )
    report_option(a)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: _run(args))


def check_new_folder(flag: str, path: str, reads: dict) -> None:
    """The folder a command creates and fills: a new or empty one, not a file, nowhere the run reads
    or the repository ships (check_outputs)."""
    if Path(path).is_file():
        raise HFError(f"{flag} {path} is a file: give the folder to write (a new or empty one)")
    if Path(path).exists() and any(Path(path).iterdir()):
        raise HFError(f"{flag} {path} exists and is not empty")
    check_outputs({flag: path}, reads, folders_made=True)


def _run(args: argparse.Namespace) -> int:
    if args.command == "import":
        if args.task is not None and args.task not in TASKS:
            raise HFError(f"--task {args.task}: choose from {', '.join(TASKS)}")
        check_new_folder("--out", args.out, {"FOLDER": args.folder})
        if not is_hf_folder(args.folder):
            raise HFError(f"{args.folder} is not a transformers model folder (a folder with a config.json)")
        result = import_folder(args.folder, args.out, task=args.task, src_lang=args.src_lang, tgt_lang=args.tgt_lang)
        print(
            f"wrote {result['model']} and its tokenizer.json ({result['architecture']}); refdec's float64 logits "
            f"within {result['max_logit_difference']:.2g} of transformers' on the folder, the same greedy output"
        )
        return 0
    if args.command == "export":
        check_new_folder("OUT_DIR", args.out_dir, checkpoint_files("CKPT", args.ckpt))
        result = export(args.ckpt, args.out_dir, without_heads=args.without_heads)
        print(
            f"wrote {result['folder']} ({result['architecture']}); transformers' float64 logits within "
            f"{result['max_logit_difference']:.2g} of refdec's, the same greedy output"
            + ("; the proposal heads are not in it" if result["heads_left_out"] else "")
        )
        return 0
    for name in ("limit", "threads", "gamma", "prompt_lookup"):
        if getattr(args, name) < 1:
            raise HFError(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        raise HFError("--warmup must be at least 0")
    args.device = str(set_up_machine(args))
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    if not set(routes) <= {"reference", "fast", "graphed"}:
        raise HFError(f"--routes {args.routes}: choose from reference, fast, graphed, separated by commas")
    args.routes = ["reference"] + [r for r in dict.fromkeys(routes) if r != "reference"]
    if not (args.task or args.input) or (args.task is None and not is_hf_folder(args.model)):
        raise HFError("audit needs --task (a refdec checkpoint's task) or a transformers folder and --input")
    if not is_hf_folder(args.model) and (args.src_lang or args.tgt_lang):
        raise HFError("--src-lang and --tgt-lang choose the language tokens of a transformers folder's model")
    check_outputs(
        {"--report": args.report},
        input_files(args.task, args.input)
        | checkpoint_files("--model", args.model)
        | checkpoint_files("--small", args.small),
    )
    report = audit(args)
    print(audit_table(report))
    if args.report:
        write_report(args.report, report)
    return 0
