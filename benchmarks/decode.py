"""Decode speed: draftsmith's speculative decoder vs HF assisted generation vs plain greedy.

Same as ``draftsmith bench decode``; all options pass through, e.g.

    python benchmarks/decode.py --dtypes float32,bfloat16 --prompts 10 --sweep-layers 8,16,20,24,28

The code lives in ``draftsmith/eval/bench.py``; figures and commands are in RESULTS.md.
"""

import sys

from draftsmith.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "decode", *sys.argv[1:]]))
