"""The audit behind `python -m refdec hf audit` (refdec.commands.hfcli): refdec's and transformers' decoders
on the same weights and inputs, line by line. It stands on refdec.hf (import, export, transformers beside
refdec) and on the runner it times with, so it lives in the application layer beside the runner, not in
refdec.hf, which refdec.app.loading reads folders from.

Audit: refdec greedy, refdec IAD (GEC tasks, and a transformers folder's own --input) and speculative
decoding (with --small), transformers' greedy generate, assisted generation (the small model as
assistant_model) and prompt-lookup decoding, on the same weights and inputs, in one process,
interleaved sentence by sentence after a warm-up by refdec.app.runner.decode_lines (the loop decode.py
times with; transformers' generate is an Algorithm like any other): seconds, ms per output token,
and how many outputs equal refdec greedy's, each differing line with its first divergent position
and refdec's top-1/top-2 logit margin there. --device cuda runs both on a GPU (each batch's time read
after a device synchronisation, as decode.py reads it).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from ..checkpoint import load_model
from ..data import source_rows
from ..decoding.result import DecodeResult, DecodeStats, result_of
from ..hf.common import HFError, first_line, is_hf_folder, require_transformers
from ..hf.compare import hf_from_pretrained, hf_generate
from ..hf.export import write_folder
from ..hf.importing import load_folder
from .algorithms import Algorithm


def _load_pair(path: str, *, task: str, src_lang, tgt_lang, workdir: Path, name: str, device="cpu"):
    """(refdec model, tokenizer, transformers model) for a refdec checkpoint (exported to `workdir`
    and loaded from there with transformers) or a transformers folder, in float32, both on `device`."""
    if is_hf_folder(path):
        model, tok, _ = load_folder(path, src_lang=src_lang, tgt_lang=tgt_lang)
        return model.to(device), tok, hf_from_pretrained(path).to(device)
    model, tok, _ = load_model(path, task=task)
    return model.to(device), tok, hf_from_pretrained(write_folder(model, tok, workdir / name)).to(device)


def audit(args) -> dict:
    from ..data import read_lines
    from ..repo import repo_file

    if args.input:  # a file of the user's (a transformers folder needs no task)
        lines = read_lines(args.input)
    else:
        src_path = repo_file("data", args.task, "test.src.gz", flag="--input FILE")
        if not src_path.is_file():
            raise HFError(f"{src_path} not found (an unknown task, or data/build.py not run)")
        lines = read_lines(src_path)
    lines = [line for line in lines if line.strip()][: args.limit]
    tmp = Path(tempfile.mkdtemp(prefix="refdec-hf-"))
    try:  # exported folders live while their transformers models do
        return _audit(args, lines, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def hf_algorithm(name: str, hf_model, failures: dict, **generate_args) -> Algorithm:
    """transformers' generate (greedy; `generate_args`: assistant_model, prompt_lookup_num_tokens) as an
    Algorithm of refdec.app.runner's timing loop, one generate call per source row. A row it fails on is
    recorded in `failures` (source ids -> message) and raised again, so the runner leaves that line empty."""

    def decode_hf(model, src: torch.Tensor, *, max_len: int, trace: bool = False) -> DecodeResult:
        cfg, outs = model.cfg, []
        for s in source_rows(src, cfg.eos_id, cfg.pad_id):
            try:
                out = hf_generate(hf_model, cfg, s, max_len, **generate_args).tolist()
            except Exception as e:
                failures[tuple(s)] = f"{type(e).__name__}: {first_line(e, 200)}"
                raise RuntimeError(failures[tuple(s)]) from None
            outs.append(out + [cfg.eos_id] * (len(out) < max_len))  # generate stops at eos or at max_len
        return result_of(outs, cfg.eos_id, DecodeStats(sentences=len(outs), encoder_calls=len(outs)), None, src.device)

    return Algorithm(name, decode_hf, f"transformers' {name}")


def route_models(models, routes: list[str]) -> list[tuple[str, object]]:
    """refdec's models on each route: the reference route's as loaded, the fast and graphed routes' wrapping
    them (refdec.routes.fast, refdec.routes.graphed), so that each route's decoders are rows of the one audit."""
    from .loading import routed

    return [(route, routed(models, route, False)) for route in routes]


def _audit(args, lines: list[str], tmp: Path) -> dict:
    from ..data import TASKS
    from ..machine import device_name, environment
    from . import inputs
    from .algorithms import ALGORITHMS
    from .exactness import divergences
    from .inputs import shown_path
    from .loading import Models
    from .runner import Run, decode_lines

    device = getattr(args, "device", "cpu")
    # The model, and the small one where BiLD runs: each as refdec loads it and as transformers does.
    shared = dict(task=args.task, src_lang=args.src_lang, tgt_lang=args.tgt_lang, workdir=tmp, device=device)
    model, tok, hf = _load_pair(args.model, name="model", **shared)
    small = hf_small = None
    if args.small:
        small, small_tok, hf_small = _load_pair(args.small, name="small", **shared)
        if (
            small_tok.sha256 != tok.sha256
            or small.cfg.encoder_prefix != model.cfg.encoder_prefix
            or small.cfg.decoder_prefix != model.cfg.decoder_prefix
        ):
            raise HFError(f"{args.small} does not share the vocabulary and forced tokens of {args.model}")
    cfg = model.cfg
    limit = cfg.max_positions - max(len(cfg.encoder_prefix), len(cfg.decoder_prefix))
    ids = inputs.source_ids(tok, lines, limit)
    models = Models(model, Path(args.model), small=small)
    refdec = ["greedy"] + ["iad"] * (args.task is None or TASKS.get(args.task) == "gec") + ["speculative"] * bool(small)
    runs = [
        Run(
            ALGORITHMS[a],
            {**ALGORITHMS[a].defaults(), **({"gamma": args.gamma} if a == "speculative" else {})},
            m,
            label=f"refdec-{a}" + (f" [{route}]" if route != "reference" else ""),
        )
        for route, m in route_models(models, getattr(args, "routes", ["reference"]))
        for a in refdec
    ]  # IAD copies the source: GEC, or the user's own model
    failures: dict = {}
    hf_methods = {
        "hf-greedy": {},
        "hf-assisted": {"assistant_model": hf_small},
        "hf-prompt-lookup": {"prompt_lookup_num_tokens": args.prompt_lookup},
    }
    runs += [
        Run(hf_algorithm(name, hf, failures, **generate_args), {}, models, label=name)
        for name, generate_args in hf_methods.items()
        if name != "hf-assisted" or hf_small is not None
    ]
    decode_lines(runs, ids, max_len=None, max_positions=limit, device=device, warmup=args.warmup)
    greedy_out = runs[0].outputs
    if any(o is None for o in greedy_out):
        raise HFError("refdec greedy failed on a line (see the warning above): nothing to audit against")
    rows = []
    for run in runs:
        outs = run.outputs
        tokens = sum(len(o) + 1 for o in outs if o is not None)  # eos included, as refdec counts them
        same = sum(b is not None and torch.equal(a, b) for a, b in zip(greedy_out, outs))
        errors = [
            {"line": i + 1, "error": failures.get(tuple(s), "failed")}
            for i, (s, o) in enumerate(zip(ids, outs))
            if o is None
        ]
        rows.append(
            {
                "method": run.name,
                "seconds": run.seconds,
                "tokens": tokens,
                "ms_per_token": 1000 * run.seconds / max(tokens, 1),
                "identical": same / max(len(ids), 1),
                "differing": [] if run is runs[0] else divergences(model, ids, greedy_out, outs, device),
                "errors": errors,
            }
        )
    transformers = require_transformers()
    return {
        "task": args.task,
        "model": shown_path(args.model),
        "small": args.small and shown_path(args.small),
        "lines": len(ids),
        "warmup": args.warmup,
        "threads": args.threads,
        "device": device_name(device),
        "transformers": transformers.__version__,
        "gamma": args.gamma,
        "prompt_lookup_num_tokens": args.prompt_lookup,
        "environment": environment(args.threads, device, model.tgt_embed.weight.dtype),
        "routes": getattr(args, "routes", ["reference"]),
        "methods": rows,
    }


def audit_table(report: dict) -> str:
    w = max([20] + [len(r["method"]) for r in report["methods"]])
    head = f"{'method':<{w}} {'seconds':>9} {'ms/token':>9} {'tokens':>7} {'identical':>9}"
    out = [
        f"{report['task'] or report['model']}: {report['lines']} lines, {report['threads']} thread(s), "
        f"{report.get('device', 'cpu')}, warm-up {report['warmup']}",
        head,
    ]
    for r in report["methods"]:
        out.append(
            f"{r['method']:<{w}} {r['seconds']:>9.2f} {r['ms_per_token']:>9.2f} {r['tokens']:>7} "
            f"{100 * r['identical']:>8.1f}%"
        )
    for r in report["methods"]:
        for d in r["differing"]:
            out.append(
                f"{r['method']}: line {d['line']} differs from refdec greedy at position {d['position']} "
                f"(refdec's top-1/top-2 margin there {d['margin_top1_top2']:.3g})"
            )
        for d in r["errors"]:
            out.append(f"{r['method']}: line {d['line']} failed: {d['error']}")
    return "\n".join(out)
