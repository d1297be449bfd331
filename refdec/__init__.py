"""refdec: a from-scratch PyTorch reference implementation of lossless and speculative seq2seq decoding
(greedy, beam, and the aggressive, blockwise, big-little and speculative decoders built on them). The
modules, where to start reading and the layers they import each other in are described in one place,
docs/layout.md."""

__version__ = "0.1.0"
