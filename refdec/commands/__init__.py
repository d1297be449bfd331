"""The measuring and data commands, each run as `python -m refdec.<name>` (a module of that name beside
the library calls the command's main; the Hugging Face command line as `python -m refdec.hf`). They
stand on top of the library and nothing in it imports them (docs/layout.md); what they repeat is in
harness.py.

    bench.py           every GPU table in one command
    ceiling.py         draft-then-verify speed when the draft is right (GAD's loop, scripted drafts)
    ctranslate2.py     refdec against CTranslate2 on the same weights
    distill.py         sequence-level distillation into a data folder
    fuzz.py            every lossless decoder against greedy on random tiny models
    hfaudit.py         transformers' decoders against refdec's (hfcli.py: python -m refdec.hf export|audit)
    int8bench.py       the candidate int8 products timed on a model's shapes
    stepcost.py        the cost of one decoder call appending q tokens
    train_drafters.py  the mt-en-de drafter and heads on one GPU
"""
