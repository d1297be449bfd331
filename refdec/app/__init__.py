"""The application layer: what decode.py and the measuring commands need between their parsers and
the model. algorithms (the registry of decoders and their options), plan (--algo and --compare
resolved to runs before anything loads), hints (the one-line errors for a checkpoint path), inputs
(input and output paths checked, source ids), loading (every checkpoint of a run loaded once, on its
route), runner/ (the interleaved timing loop and the output lines), exactness (identical rate and
divergences with their margins), report (the summary table and the JSON report), htmlreport
(decode.py --html) and hfaudit (the audit of transformers' decoders against refdec's). Nothing below it
(the model, its routes, the decoders, training) imports it.
"""
