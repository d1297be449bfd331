"""refdec: a from-scratch PyTorch reference implementation of lossless and speculative
seq2seq decoding (greedy, beam, and the aggressive / blockwise / big-little decoders built on them).

The pieces, bottom up:
    config.py     frozen dataclasses for the model and for training presets
    cache.py      KVCache, the one key/value cache every decoder uses
    model.py      the encoder-decoder Transformer: encode / decode / forward
    tokenizer.py  byte-level BPE with the special tokens pad, bos, eos, unk, mask
    data.py       the shipped tasks (data/<task>/*.gz) and token-count batching
    checkpoint.py atomic save, safe load (weights_only=True), averaging
    training/     the training behind train.py: objectives (one loss per mode), the run folder, the
                  data and its cached token ids, the loop (Trainer)
    train_drafters.py  the mt-en-de drafter and heads trained on one GPU in one command
    decoding/     one decoder per file, all returning a DecodeResult; verify.py the shared
                  verification step, pairing.py a second model beside the verifier
    metrics.py    BLEU, chrF and an edit-level GEC F0.5
    runner.py     what decode.py does: decode a file, compare, time, report
    trace.py      Step, one record per decoding iteration for every decoder, and the --trace text
    htmlreport.py decode.py --html: a self-contained page of a run (matplotlib charts, inline SVG)
    hf/           Hugging Face folders in and out, and an audit of transformers' decoders
                  (transformers is imported only when these are called)
"""

__version__ = "0.1.0"
