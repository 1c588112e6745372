"""Peak memory of the EAGLE-3 / DFlash held-out metrics on a large vocabulary (Gemma-3's 262,144 tokens).

    python benchmarks/heldout_memory.py --rows 1024        # both paths, each in its own process

``scattered``: the draft logits [N, Vd] scattered to [N, V] (q = 0 outside the draft vocabulary), then
``losses.expected_acceptance`` and ``losses.top1_accuracy`` — what the training loops did before.
``draft rows``: ``losses.draft_vocab_agreement``, which reads p at the draft ids through its log-normalizer, a
chunk of rows at a time. Both get the same random [N, V] target logits (which a held-out batch holds anyway) and
print the same figures; the peak RSS above those inputs is what the metric itself costs.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import script_parser  # noqa: E402 — the benchmarks folder is not a package


def one(path: str, rows: int, vocab: int, draft_vocab: int) -> None:
    from draftsmith.drafters.common import scatter_to_target
    from draftsmith.train import losses

    g = torch.Generator().manual_seed(0)
    target = torch.randn(rows, vocab, generator=g)
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    draft = torch.randn(rows, draft_vocab, generator=g)
    inputs = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    t0 = time.perf_counter()
    if path == "scattered":
        q, every = scatter_to_target(draft, ids, vocab), torch.ones(rows, dtype=torch.bool)
        accept, top1 = losses.expected_acceptance(q, target, every), losses.top1_accuracy(q, target.argmax(-1), every)
    else:
        a, t = losses.draft_vocab_agreement(draft, target, ids)
        accept, top1 = a.mean(), t.float().mean()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{path:<10} N={rows} V={vocab} Vd={draft_vocab}: accept {float(accept):.6f} top-1 {float(top1):.4f}; "
          f"peak RSS {peak:.2f} GiB, {peak - inputs:.2f} GiB above the inputs; {seconds:.1f} s", flush=True)


def main() -> int:
    p = script_parser(__doc__)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--path", choices=["scattered", "draft-rows"], help="run one path in this process")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.path:
        one(args.path, args.rows, args.vocab, args.draft_vocab)
        return 0
    for path in ("scattered", "draft-rows"):  # a process each: ru_maxrss never goes down
        subprocess.run([sys.executable, __file__, "--path", path, "--rows", str(args.rows), "--vocab", str(args.vocab),
                        "--draft-vocab", str(args.draft_vocab), "--threads", str(args.threads)], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
