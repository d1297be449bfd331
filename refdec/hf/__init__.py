"""Hugging Face transformers interoperability: import a model folder, export a checkpoint.

Everything that touches transformers lives in this package, and transformers is imported only
inside the functions that need it: the rest of refdec imports and runs without it.

    python -m refdec hf import FOLDER --out DIR      a refdec checkpoint (model.pt, tokenizer.json), checked
    python -m refdec hf export CKPT OUT_DIR          a folder stock transformers loads (no remote code)
    python -m refdec hf audit --task T --model M [--small S] --limit N --threads T --report FILE
    decode.py --model HF_FOLDER [--small HF_FOLDER]  every decoder on the folder's model

    common.py     HFError, the optional imports, a folder's config and weight files read
    layout.py     refdec's state-dict names and the M2M100/Pegasus names; the export's permutation
    families.py   each family (Marian, BART, mBART, T5, M2M100, Pegasus): config.json -> ModelConfig, weight names
    importing.py  a folder -> (Transformer, Tokenizer): the family's mapping applied, its tokenizer read and
                  checked against config.json's special ids (docs/hf.md, section The tokenizer of a folder)
    compare.py    transformers' model, generate and logits beside refdec's on the same weights
    export.py     a refdec checkpoint -> a Pegasus or M2M100 folder, checked by loading it back
    convert.py    a folder -> a refdec checkpoint (model.pt, tokenizer.json), checked against transformers

The audit (refdec.app.hfaudit) and the command line (refdec.commands.hfcli, run by this package's
__main__) stand on the runner, which stands on refdec.app.loading, which reads folders with this package:
they live beside the other commands, above it.
"""

from .common import LOGIT_TOLERANCE, HFError, is_hf_folder, read_weights
from .compare import compare_with_folder, hf_from_pretrained, hf_generate, hf_inputs, hf_logits, refdec_logits
from .convert import import_folder
from .export import check_export, export, export_route, hf_state, write_folder
from .importing import M2M100, PEGASUS, load_folder, load_tokenizer

__all__ = [
    "LOGIT_TOLERANCE",
    "HFError",
    "is_hf_folder",
    "read_weights",
    "compare_with_folder",
    "hf_from_pretrained",
    "hf_generate",
    "hf_inputs",
    "hf_logits",
    "refdec_logits",
    "import_folder",
    "check_export",
    "export",
    "export_route",
    "hf_state",
    "write_folder",
    "M2M100",
    "PEGASUS",
    "load_folder",
    "load_tokenizer",
]
