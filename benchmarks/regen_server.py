"""Regeneration speed: in-process HF (today's settings) vs a local llama-server, on the same conversations.

    python benchmarks/regen_server.py                                  # the issue's grid; long: run it quiet
    python benchmarks/regen_server.py --conversations 4 --new-tokens 16 --slots 1,4 --threads 1 --types f32

Every configuration answers the same ShareGPT first turns (greedy, ``max_turns: 1``) through
``regenerate_conversations``, exactly as ``draftsmith prepare`` runs it:

* **in-process**: ``method: generate`` with the demo recipe's settings (``--inproc dtype,batch,shard``;
  configs/smollm2-135m-prepare.yaml: float32, batch 32, shards of 96) on ``--torch-threads`` threads;
* **llama-server**: ``method: server`` against a llama-server on the target's GGUF of each ``--types``
  (``as-loaded`` = the Q4_1 file the builtin target ships, ``bf16``, ``f32``: converted once by llama.cpp's
  converter), for each ``--slots`` (``-np``, with as many requests in flight) × ``--threads``. The server
  is started and warmed up (one request) before the clock starts, so its load time is not counted; the
  tokenizer probe is.

Figures: new tokens per second of wall time for the whole job, prefill included (every prompt is
prefilled whole, ``cache_prompt: false``), the ratio against in-process (the median of ``--rounds``
rounds; each round runs in-process first, then every server configuration), and the share of answers
identical to the in-process ones (an F32 server should give nearly all; Q4_1 and BF16 answers are the
target's policy only approximately). Prints a table and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import offline, save_result, script_parser  # noqa: E402 — the benchmarks folder is not a package


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = script_parser(__doc__, target=True)
    p.add_argument("--conversations", type=int, default=96, help="ShareGPT conversations (first turns)")
    p.add_argument("--new-tokens", type=int, default=160, help="max new tokens per answer")
    p.add_argument("--max-length", type=int, default=1024, help="data.render.max_length (longer prompts are skipped)")
    p.add_argument("--inproc", default="float32,32,96", help="in-process settings: dtype,batch_size,shard_size")
    p.add_argument("--torch-threads", type=int, default=2, help="torch threads of the in-process run")
    p.add_argument("--slots", default="1,4,8,16", help="llama-server -np values (requests in flight = slots)")
    p.add_argument("--threads", default="1,2", help="llama-server -t values")
    p.add_argument("--types", default="as-loaded,bf16,f32", help="target GGUF types: as-loaded (Q4_1), bf16, f32, …")
    p.add_argument("--server-flags", default="", help="extra llama-server flags for every server, e.g. '-fa on -ub 1024'")
    p.add_argument("--rounds", type=int, default=1, help="rounds over every configuration (median reported)")
    p.add_argument("--out", default="benchmarks/out/regen_server.json")
    return p.parse_args(argv)


def conversations(n: int) -> Any:
    import datasets

    from draftsmith.data.config import SourceConfig
    from draftsmith.data.conversations import conversation_features
    from draftsmith.data.normalize import ReadStats, iter_conversations

    rows = [{"conv_id": str(i), "source": "sharegpt", "messages": c["messages"], "truncated_turns": []}
            for i, c in enumerate(iter_conversations([SourceConfig(path="sharegpt")], n, ReadStats()))]
    return datasets.Dataset.from_list(rows, features=conversation_features())


def regenerate(convs: Any, target: Any, cfg: Any, max_length: int) -> tuple[float, int, list[str]]:
    """(seconds, new tokens, answers) of one regeneration job in a fresh folder."""
    from draftsmith.data.regenerate import regenerate_conversations, regenerated_records

    with tempfile.TemporaryDirectory(prefix="regen-bench-") as tmp:
        report = regenerate_conversations(convs, tmp, target, cfg, max_length=max_length,
                                          progress=False)
        answers = {r["conv_id"]: r["messages"][-1]["content"] for r in regenerated_records(tmp)}
    return report.seconds, report.new_tokens, [answers.get(c, "") for c in convs["conv_id"]]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    offline(args.torch_threads)
    from draftsmith.data.config import RegenerateConfig, ServerConfig
    from draftsmith.engines import llamacpp
    from draftsmith.engines.targets import target_gguf
    from draftsmith.target import load_target

    dtype, batch, shard = args.inproc.split(",")
    convs = conversations(args.conversations)
    target = load_target(args.target, dtype=dtype, device="cpu")
    common = dict(max_new_tokens=args.new_tokens, max_turns=1, temperature=0.0, shard_size=int(shard))
    inproc = RegenerateConfig(method="generate", batch_size=int(batch), **common)
    grid = [(kind, int(s), int(t)) for kind in args.types.split(",") for s in args.slots.split(",")
            for t in args.threads.split(",")]
    ggufs = {kind: target_gguf(target, kind) for kind in args.types.split(",")}

    from draftsmith.data.regenerate import greedy_batch

    greedy_batch(target, [target.render_chat([{"role": "user", "content": "Hi"}])], 4)  # warm-up, as the servers get
    rates: dict[str, list[float]] = {}
    answers: dict[str, list[str]] = {}
    tokens: dict[str, int] = {}
    for r in range(args.rounds):
        seconds, n, answers["in-process"] = regenerate(convs, target, inproc, args.max_length)
        rates.setdefault("in-process", []).append(n / seconds)
        tokens["in-process"] = n
        print(f"round {r + 1}: in-process ({args.inproc}, {args.torch_threads} torch threads) "
              f"{n / seconds:.1f} new tok/s", flush=True)
        for kind, slots, threads in grid:
            name = f"{kind} np={slots} t={threads}"
            spec = llamacpp.ServerSpec(model=ggufs[kind], threads=threads, slots=slots,
                                       ctx=args.max_length + args.new_tokens, extra=tuple(args.server_flags.split()))
            with llamacpp.serving(spec) as server:
                server.complete(target.render_chat([{"role": "user", "content": "Hi"}]), 4)  # warm-up
                cfg = RegenerateConfig(method="server", server=ServerConfig(url=server.url, concurrency=slots), **common)
                seconds, n, answers[name] = regenerate(convs, target, cfg, args.max_length)
            rates.setdefault(name, []).append(n / seconds)
            tokens[name] = n
            print(f"round {r + 1}: {name} {n / seconds:.1f} new tok/s", flush=True)

    base = statistics.median(rates["in-process"])
    rows = []
    for name, values in rates.items():
        rate = statistics.median(values)
        same = sum(a == b for a, b in zip(answers[name], answers["in-process"]))
        rows.append({"config": name, "new_tok_s": round(rate, 1), "ratio": round(rate / base, 3),
                     "new_tokens": tokens[name], "identical_answers": f"{same}/{len(convs)}"})
    print(f"\n{len(convs)} ShareGPT first turns, ≤ {args.new_tokens} new tokens, greedy; median of {args.rounds} round(s)")
    print(f"{'configuration':<24} {'new tok/s':>10} {'× in-process':>13} {'new tokens':>11} {'same answers':>13}")
    for row in rows:
        print(f"{row['config']:<24} {row['new_tok_s']:>10.1f} {row['ratio']:>13.2f} {row['new_tokens']:>11} "
              f"{row['identical_answers']:>13}")
    save_result(args.out, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
