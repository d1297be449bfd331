"""Decoders, one per file.

Every decoder has the shape `decode_x(model, [companion model or heads,] src, *, max_len, ...options, trace=False)
-> DecodeResult`, runs under torch.inference_mode() and refuses a model in training mode. Its
keyword options with plain defaults are the command line's options (refdec/app/algorithms.py reads them
from the signature).
"""

from .beam import decode_beam
from .bild import decode_bild
from .blockwise import decode_blockwise
from .gad import decode_gad
from .greedy import decode_greedy
from .iad import MATCH_POLICIES, decode_iad, find_match
from .result import DecodeResult, DecodeStats, check_eval
from .speculative import decode_speculative
from .verify import Verified, verify

__all__ = [
    "DecodeResult",
    "DecodeStats",
    "MATCH_POLICIES",
    "Verified",
    "check_eval",
    "decode_beam",
    "decode_bild",
    "decode_blockwise",
    "decode_gad",
    "decode_greedy",
    "decode_iad",
    "decode_speculative",
    "find_match",
    "verify",
]
