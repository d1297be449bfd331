"""refdec's and transformers' decoders on the same weights and inputs, line by line.

Audit. refdec greedy, refdec IAD (GEC tasks, and a transformers folder's own --input) and speculative decoding (with --small), transformers'
greedy generate, assisted generation (the small model as assistant_model) and prompt-lookup
decoding, on the same weights and inputs, in one process, interleaved sentence by sentence after a
warm-up: seconds, ms per output token, and how many outputs equal refdec greedy's, each differing
line with its first divergent position and refdec's top-1/top-2 logit margin there.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from ..checkpoint import load_model
from .common import HFError, first_line, is_hf_folder, require_transformers
from .compare import hf_from_pretrained, hf_generate
from .export import write_folder
from .importing import load_folder

def _load_pair(path: str, *, task: str, src_lang, tgt_lang, workdir: Path, name: str):
    """(refdec model, tokenizer, transformers model) for a refdec checkpoint (exported to `workdir`
    and loaded from there with transformers) or a transformers folder, in float32."""
    if is_hf_folder(path):
        model, tok, _ = load_folder(path, src_lang=src_lang, tgt_lang=tgt_lang)
        return model, tok, hf_from_pretrained(path)
    model, tok, _ = load_model(path, task=task)
    return model, tok, hf_from_pretrained(write_folder(model, tok, workdir / name))


def audit(args) -> dict:
    from ..data import DATA_DIR, read_lines

    torch.set_num_threads(args.threads)
    if args.input:  # a file of the user's (a transformers folder needs no task)
        from ..inputs import read_text_lines
        lines = read_text_lines(args.input)
    else:
        src_path = DATA_DIR / args.task / "test.src.gz"
        if not src_path.is_file():
            raise HFError(f"{src_path} not found (an unknown task, or data/build.py not run)")
        lines = read_lines(src_path)
    lines = [line for line in lines if line.strip()][: args.limit]
    tmp = Path(tempfile.mkdtemp(prefix="refdec-hf-"))
    try:  # exported folders live while their transformers models do
        return _audit(args, lines, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _audit(args, lines: list[str], tmp: Path) -> dict:
    from .. import inputs
    from ..data import TASKS
    from ..exactness import divergences
    from ..decoding import decode_iad, decode_speculative
    from ..decoding.greedy import decode_greedy

    model, tok, hf = _load_pair(args.model, task=args.task, src_lang=args.src_lang, tgt_lang=args.tgt_lang,
                                workdir=tmp, name="model")
    small = hf_small = None
    if args.small:
        small, small_tok, hf_small = _load_pair(args.small, task=args.task, src_lang=args.src_lang,
                                                tgt_lang=args.tgt_lang, workdir=tmp, name="small")
        if small_tok.sha256 != tok.sha256 or small.cfg.encoder_prefix != model.cfg.encoder_prefix \
                or small.cfg.decoder_prefix != model.cfg.decoder_prefix:
            raise HFError(f"{args.small} does not share the vocabulary and forced tokens of {args.model}")
    cfg = model.cfg
    limit = cfg.max_positions - max(len(cfg.encoder_prefix), len(cfg.decoder_prefix))
    ids = inputs.source_ids(tok, lines, limit)

    def src_of(s):
        return torch.tensor([s + [cfg.eos_id]])
    methods = {"refdec-greedy": lambda s, n: decode_greedy(model, src_of(s), max_len=n).tokens[0]}
    if args.task is None or TASKS.get(args.task) == "gec":  # IAD copies the source: GEC, or the user's own model
        methods["refdec-iad"] = lambda s, n: decode_iad(model, src_of(s), max_len=n).tokens[0]
    if small is not None:
        methods["refdec-speculative"] = lambda s, n: decode_speculative(model, small, src_of(s), max_len=n,
                                                                 gamma=args.gamma).tokens[0]
    methods["hf-greedy"] = lambda s, n: hf_generate(hf, cfg, s, n)
    if hf_small is not None:
        methods["hf-assisted"] = lambda s, n: hf_generate(hf, cfg, s, n, assistant_model=hf_small)
    methods["hf-prompt-lookup"] = lambda s, n: hf_generate(hf, cfg, s, n, prompt_lookup_num_tokens=args.prompt_lookup)

    for s in ids[: args.warmup]:  # untimed: first-call allocations and kernel choices
        for run in methods.values():
            run(s, inputs.max_len_for([s], None, limit))
    outputs = {name: [] for name in methods}
    seconds = dict.fromkeys(methods, 0.0)
    errors = {name: [] for name in methods}  # a method that fails on a line (its output None) goes on with the next
    for i, s in enumerate(ids):  # interleaved: every method decodes a sentence before the next sentence
        budget = inputs.max_len_for([s], None, limit)
        for name, run in methods.items():
            t0 = time.perf_counter()
            try:
                outputs[name].append(run(s, budget))
            except Exception as e:
                if name == "refdec-greedy":
                    raise
                outputs[name].append(None)
                errors[name].append({"line": i + 1, "error": f"{type(e).__name__}: {first_line(e, 200)}"})
            seconds[name] += time.perf_counter() - t0
    greedy_out = outputs["refdec-greedy"]
    rows = []
    for name in methods:
        tokens = sum(len(o) + 1 for o in outputs[name] if o is not None)  # eos included, as refdec counts them
        same = sum(b is not None and torch.equal(a, b) for a, b in zip(greedy_out, outputs[name]))
        rows.append({"method": name, "seconds": seconds[name], "tokens": tokens,
                     "ms_per_token": 1000 * seconds[name] / max(tokens, 1), "identical": same / max(len(ids), 1),
                     "differing": [] if name == "refdec-greedy" else
                     divergences(model, ids, greedy_out, outputs[name], "cpu"), "errors": errors[name]})
    transformers = require_transformers()
    return {"task": args.task, "model": args.model, "small": args.small, "lines": len(ids), "warmup": args.warmup,
            "threads": args.threads, "torch": torch.__version__, "transformers": transformers.__version__,
            "gamma": args.gamma, "prompt_lookup_num_tokens": args.prompt_lookup, "methods": rows}


def audit_table(report: dict) -> str:
    head = f"{'method':<20} {'seconds':>9} {'ms/token':>9} {'tokens':>7} {'identical':>9}"
    out = [f"{report['task'] or report['model']}: {report['lines']} lines, {report['threads']} thread(s), warm-up {report['warmup']}", head]
    for r in report["methods"]:
        out.append(f"{r['method']:<20} {r['seconds']:>9.2f} {r['ms_per_token']:>9.2f} {r['tokens']:>7} "
                   f"{100 * r['identical']:>8.1f}%")
    for r in report["methods"]:
        for d in r["differing"]:
            out.append(f"{r['method']}: line {d['line']} differs from refdec greedy at position {d['position']} "
                       f"(refdec's top-1/top-2 margin there {d['margin_top1_top2']:.3g})")
        for d in r["errors"]:
            out.append(f"{r['method']}: line {d['line']} failed: {d['error']}")
    return "\n".join(out)


