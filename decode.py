"""Decode a task's test set (or any file) with one of refdec's algorithms: the command
refdec/commands/decode.py, which `refdec decode` (once installed) and `python -m refdec decode` run too.

    python decode.py --algo greedy --task mt-en-de                    # shipped model, real test set
    python decode.py --algo beam --task mt-en-de --compare greedy --report r.json
    python decode.py --model my/model.pt --input my.txt                # greedy, your checkpoint, text out
    python decode.py --help                                            # every option and algorithm
"""

from refdec.commands.decode import main

if __name__ == "__main__":
    raise SystemExit(main())
