"""Data pipeline speed on a ShareGPT subset, each comparison timed side by side in one run.

    python benchmarks/prepare.py --threads 1          # defaults below; ~8 min on a busy 2-core CPU
    python benchmarks/prepare.py --threads 1 --render 400 --features 32 --regen-prompts 8

1. rendering (conversations/s): the text-divergence renderer `draftsmith.data.render`
   vs the naive token-level one (two tokenized renders per assistant turn), interleaved
   over the same conversations, with mask equality checked; then the whole tokenize
   stage (`datasets.map`, 1 vs 2 workers).
2. feature cache (target tokens/s, bytes/token): `write_feature_cache` (EAGLE-3 layers +
   last, bf16 shards, checksums) vs a bare target forward over the same batches, interleaved.
3. regeneration engines (new tokens/s): batched HF generate (batch 8) vs batch 1 vs the built-in
   speculative decoder with the layer-skip drafter, greedy, same prompts, outputs compared.
4. the regenerate stage as `draftsmith prepare` runs it (``regenerate_conversations``, ShareGPT
   first turns, greedy, the demo's 64 new tokens): the old settings (fp32, batch 8, shards of 8,
   one HF ``generate`` call per batch) vs the new ones (``--regenerate-new``, default fp32, batch
   16, shards of 64, the greedy loop that drops finished rows: longer shards sort more prompts by
   length, so a batch pads less) on the same conversations, alternating, the median of
   ``--rounds``; and how many answers the two agree on token for token.
5. feature capture by dtype (``--feature-dtypes float32,bfloat16``): ``write_feature_cache`` with
   an fp32 and a bf16 target over the same rows, alternating, and how far the stored (bf16)
   features of the two differ.

Prints a table and writes ``benchmarks/out/prepare.json``; figures go to RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import offline, save_result, script_parser  # noqa: E402 — the benchmarks folder is not a package


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = script_parser(__doc__, target=True, threads=True)
    p.add_argument("--dtype", default="float32", help="target dtype for features and regeneration")
    p.add_argument("--render", type=int, default=300, help="conversations for the rendering comparison")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per comparison (median reported)")
    p.add_argument("--features", type=int, default=8, help="conversations for the feature-cache comparison")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--regen-prompts", type=int, default=8)
    p.add_argument("--regen-tokens", type=int, default=32)
    p.add_argument("--regenerate-conversations", type=int, default=48,
                   help="ShareGPT conversations for the regenerate-stage comparison (the demo: 96)")
    p.add_argument("--regenerate-old", default="float32,8,8", help="old settings: dtype,batch_size,shard_size")
    p.add_argument("--regenerate-new", default="float32,16,64", help="new settings: dtype,batch_size,shard_size")
    p.add_argument("--feature-dtypes", default="", help="e.g. float32,bfloat16: time feature capture per dtype")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: render,features,regen,regenerate")
    p.add_argument("--out", default="benchmarks/out/prepare.json")
    return p.parse_args(argv)


def sharegpt(n: int) -> list[list[dict[str, str]]]:
    from draftsmith.data.config import SourceConfig
    from draftsmith.data.normalize import ReadStats, iter_conversations

    return [c["messages"] for c in iter_conversations([SourceConfig(path="sharegpt")], n, ReadStats())]


def token_level_render(tokenizer, messages, max_length, stop_ids):
    """The naive reference: tokenize the prompt and the turn render for every assistant turn."""
    from draftsmith.decode.protocol import common_prefix
    from draftsmith.target import render_chat

    ids = render_chat(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:
            continue
        prompt = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        turn = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False)
        start, end = common_prefix(prompt, turn), len(turn)
        while end > start and turn[end - 1] not in stop_ids:
            end -= 1
        mask[start:end] = [1] * (end - start)
    return ids[:max_length], mask[:max_length]


def bench_render(tokenizer, folder, convs, args) -> dict:
    from draftsmith.data.render import render_conversation, stop_token_ids

    stops = stop_token_ids(tokenizer, folder)
    fast_s, slow_s = [], []
    for _ in range(args.rounds):
        t = time.perf_counter()
        fast = [render_conversation(tokenizer, m, args.max_length, False, stops) for m in convs]
        fast_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        slow = [token_level_render(tokenizer, m, args.max_length, stops) for m in convs]
        slow_s.append(time.perf_counter() - t)
    same = sum(isinstance(f, tuple) and f == s for f, s in zip(fast, slow))
    kept = sum(isinstance(f, tuple) for f in fast)
    n = len(convs)
    out = {"conversations": n, "text_divergence_conv_per_s": n / statistics.median(fast_s),
           "token_level_conv_per_s": n / statistics.median(slow_s), "masks_identical": f"{same}/{kept}"}
    out["speedup"] = out["text_divergence_conv_per_s"] / out["token_level_conv_per_s"]
    out["pipeline"] = bench_tokenize_stage(tokenizer, folder, convs, args)
    return out


def bench_tokenize_stage(tokenizer, folder, convs, args) -> dict:
    """The tokenize stage as `draftsmith prepare` runs it (datasets.map), 1 vs 2 workers, fresh caches."""
    import datasets

    from draftsmith.data.conversations import conversation_features
    from draftsmith.data.render import stop_token_ids
    from draftsmith.data.tokenized import tokenize_conversations

    ds = datasets.Dataset.from_list([{"conv_id": str(i), "source": "sharegpt", "messages": m, "truncated_turns": []}
                                     for i, m in enumerate(convs)], features=conversation_features())
    times: dict[int, list[float]] = {1: [], 2: []}
    for r in range(args.rounds):
        for workers in (1, 2):
            tmp = tempfile.mkdtemp()
            t = time.perf_counter()
            tokenize_conversations(ds, os.path.join(tmp, "tok"), tokenizer, max_length=args.max_length,
                                   last_turn_only=False, stop_ids=stop_token_ids(tokenizer, folder),
                                   num_proc=workers, map_batch_size=64, cache_dir=os.path.join(tmp, "cache"),
                                   fingerprint=f"bench{r}{workers}", manifest={})
            times[workers].append(time.perf_counter() - t)
            shutil.rmtree(tmp)
    return {f"map_{w}_workers_conv_per_s": len(convs) / statistics.median(t) for w, t in times.items()}


def tokenized_rows(tokenizer, folder, convs, max_length: int) -> tuple[list, object]:
    """(input_ids, loss_mask) of each renderable conversation, and the same as a tokenized Dataset."""
    import datasets

    from draftsmith.data.render import render_conversation, stop_token_ids
    from draftsmith.data.tokenized import tokenized_features

    stops = stop_token_ids(tokenizer, folder)
    rows = [r for r in (render_conversation(tokenizer, m, max_length, False, stops) for m in convs)
            if isinstance(r, tuple)]
    ds = datasets.Dataset.from_dict({"conv_id": [str(i) for i in range(len(rows))], "source": ["s"] * len(rows),
                                     "input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows]},
                                    features=tokenized_features())
    return rows, ds


def bench_features(target, tokenizer, folder, convs, args) -> dict:
    from draftsmith.data.feature_cache import _length_batches, write_feature_cache

    rows, ds = tokenized_rows(tokenizer, folder, convs, args.max_length)
    tokens = sum(len(r[0]) for r in rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    batches = _length_batches(order, [len(r[0]) for r in rows], 8192)
    cache_s, bare_s, manifest = [], [], {}
    for _ in range(args.rounds):
        tmp = tempfile.mkdtemp()
        t = time.perf_counter()
        manifest = write_feature_cache(ds, os.path.join(tmp, "f"), target, shard_size=64, batch_tokens=8192,
                                       progress=False)
        cache_s.append(time.perf_counter() - t)
        shutil.rmtree(tmp)
        t = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                width = len(rows[batch[0]][0])
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for j, i in enumerate(batch):
                    ids[j, : len(rows[i][0])] = torch.tensor(rows[i][0])
                    mask[j, : len(rows[i][0])] = 1
                target.forward(ids.to(target.device), attention_mask=mask.to(target.device), logits_to_keep=1)
        bare_s.append(time.perf_counter() - t)
    out = {"samples": len(rows), "tokens": tokens, "layer_ids": manifest["layer_ids"],
           "cache_target_tok_per_s": tokens / statistics.median(cache_s),
           "bare_forward_tok_per_s": tokens / statistics.median(bare_s),
           "bytes_per_token": manifest["bytes_per_token"]}
    out["cache_vs_bare"] = out["cache_target_tok_per_s"] / out["bare_forward_tok_per_s"]
    return out


def bench_regen(target, convs, args) -> dict:
    from draftsmith.config import load_recipe
    from draftsmith.data.config import RegenerateConfig
    from draftsmith.data.regenerate import generate_batch
    from draftsmith.decode.rounds import speculative_decode
    from draftsmith.drafters.layer_skip import layer_skip_drafter

    prompts = []
    for m in convs:
        p = target.render_chat(m[:1] if m[0]["role"] == "user" else m[:2])
        if len(p) <= 512:
            prompts.append(p)
        if len(prompts) == args.regen_prompts:
            break
    layers = load_recipe("smollm2-135m-layerskip").drafter.num_layers
    drafter = layer_skip_drafter(target.model, layers)

    def generate(batch_size):
        cfg = RegenerateConfig(max_new_tokens=args.regen_tokens, batch_size=batch_size)
        return [t for b in range(0, len(prompts), batch_size)
                for t in generate_batch(target, prompts[b: b + batch_size], cfg)]

    def speculative():
        return [speculative_decode(target, drafter, p, k=4, max_new_tokens=args.regen_tokens).tokens for p in prompts]

    results, outputs = {}, {}
    for name, fn in (("generate_batch8", lambda: generate(8)), ("generate_batch1", lambda: generate(1)),
                     (f"speculative_layerskip{layers}_k4", speculative)):
        t = time.perf_counter()
        outputs[name] = fn()
        dt = time.perf_counter() - t
        results[name] = {"new_tok_per_s": sum(map(len, outputs[name])) / dt, "seconds": dt}
    base = results["generate_batch1"]["new_tok_per_s"]
    for name, r in results.items():
        r["vs_batch1"] = r["new_tok_per_s"] / base
        r["identical_to_batch1"] = f"{sum(a == b for a, b in zip(outputs[name], outputs['generate_batch1']))}/{len(prompts)}"
    return {"prompts": len(prompts), "max_new_tokens": args.regen_tokens, **results}


def bench_feature_dtypes(tokenizer, folder, convs, args) -> dict:
    """write_feature_cache with one target per dtype over the same rows, alternating; median tokens/s."""
    from draftsmith.data.feature_cache import FeatureCache, write_feature_cache
    from draftsmith.target import load_target

    rows, ds = tokenized_rows(tokenizer, folder, convs, args.max_length)
    tokens = sum(len(r[0]) for r in rows)
    dtypes = [d for d in args.feature_dtypes.split(",") if d]
    targets = {d: load_target(args.target, dtype=d) for d in dtypes}
    times: dict[str, list[float]] = {d: [] for d in dtypes}
    first: dict[str, torch.Tensor] = {}
    for r in range(args.rounds):
        for d in (dtypes if r % 2 == 0 else dtypes[::-1]):
            tmp = tempfile.mkdtemp()
            t = time.perf_counter()
            write_feature_cache(ds, os.path.join(tmp, "f"), targets[d], shard_size=64, batch_tokens=8192,
                                progress=False)
            times[d].append(time.perf_counter() - t)
            first[d] = FeatureCache.open(os.path.join(tmp, "f"), targets[d])[0]["hidden"].float()
            shutil.rmtree(tmp)
    out = {"samples": len(rows), "tokens": tokens,
           **{f"{d}_target_tok_per_s": tokens / statistics.median(t) for d, t in times.items()}}
    if len(dtypes) == 2:
        a, b = (first[d] for d in dtypes)
        out[f"{dtypes[1]}_over_{dtypes[0]}"] = out[f"{dtypes[1]}_target_tok_per_s"] / out[f"{dtypes[0]}_target_tok_per_s"]
        out["sample0_max_rel_diff"] = float((a - b).abs().max() / a.abs().max())
        out["sample0_equal_fraction"] = float((a == b).float().mean())
    return out


@torch.inference_mode()
def hf_generate_batch(target, prompts: list[list[int]], st) -> list[list[int]]:
    """The regenerate engine before the greedy loop: one left-padded HF ``generate`` call (greedy), new tokens
    cut after the first EOS. The "old" settings run it, so they measure yesterday's code path."""
    eos = sorted(target.eos_token_ids)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), eos[0], dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    out = target.model.generate(ids, attention_mask=mask, max_new_tokens=st.max_new_tokens, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos[0])
    rows = out[:, width:].tolist()
    return [row[: next((i + 1 for i, t in enumerate(row) if t in target.eos_token_ids), len(row))] for row in rows]


def bench_regenerate_stage(args) -> dict:
    """The regenerate stage, old settings vs new, on the same ShareGPT first turns (see the module docstring)."""
    import datasets

    from draftsmith.data.config import RegenerateConfig, SourceConfig
    from draftsmith.data.conversations import conversation_features
    from draftsmith.data.normalize import ReadStats, iter_conversations
    from draftsmith.data import regenerate
    from draftsmith.data.regenerate import regenerate_conversations, regenerated_records
    from draftsmith.target import load_target

    engine = regenerate.generate_batch
    rows = [{"conv_id": str(i), "source": "sharegpt", "messages": c["messages"], "truncated_turns": []} for i, c in
            enumerate(iter_conversations([SourceConfig(path="sharegpt")], args.regenerate_conversations, ReadStats()))]
    convs = datasets.Dataset.from_list(rows, features=conversation_features())
    settings = {}
    for name, spec in (("old", args.regenerate_old), ("new", args.regenerate_new)):
        dtype, batch, shard = spec.split(",")
        settings[name] = (dtype, RegenerateConfig(max_new_tokens=64, max_turns=1, batch_size=int(batch),
                                                  shard_size=int(shard)))
    targets = {dtype: load_target(args.target, dtype=dtype) for dtype, _ in settings.values()}
    rates: dict[str, list[float]] = {name: [] for name in settings}
    answers: dict[str, list] = {}
    for r in range(args.rounds):
        for name in (("new", "old") if r % 2 else ("old", "new")):
            dtype, cfg = settings[name]
            tmp = tempfile.mkdtemp()
            regenerate.generate_batch = hf_generate_batch if name == "old" else engine
            report = regenerate_conversations(convs, os.path.join(tmp, "regen"), targets[dtype], cfg, max_length=1024,
                                              progress=False)
            answers[name] = [rec["messages"][-1]["content"] for rec in regenerated_records(os.path.join(tmp, "regen"))]
            regenerate.generate_batch = engine
            shutil.rmtree(tmp)
            rates[name].append(report.new_tokens / report.seconds)
            print(f"round {r + 1} {name} ({dtype}, batch {cfg.batch_size}, shards of {cfg.shard_size}): "
                  f"{rates[name][-1]:.1f} new tok/s ({report.new_tokens} tokens, {report.seconds:.1f} s, "
                  f"finish {dict(report.finish)})", flush=True)
    out = {"conversations": len(rows), "max_new_tokens": 64,
           **{name: {"dtype": d, "batch_size": c.batch_size, "shard_size": c.shard_size,
                     "new_tok_per_s": statistics.median(rates[name]), "rounds": [round(x, 1) for x in rates[name]]}
              for name, (d, c) in settings.items()}}
    out["speedup"] = out["new"]["new_tok_per_s"] / out["old"]["new_tok_per_s"]
    out["same_answers"] = f"{sum(a == b for a, b in zip(answers['old'], answers['new']))}/{len(answers['old'])}"
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    offline(args.threads)
    from transformers import AutoTokenizer

    from draftsmith.target import load_target, resolve_target_folder

    skip = set(filter(None, args.skip.split(",")))
    folder = resolve_target_folder(args.target)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    convs = sharegpt(max(args.render, args.features, args.regen_prompts * 4))
    result = {"command": "python benchmarks/prepare.py " + " ".join(argv), "threads": torch.get_num_threads(),
              "cpu_count": os.cpu_count(), "device": "cpu" if not torch.cuda.is_available() else "cuda"}
    if "render" not in skip:
        result["render"] = bench_render(tokenizer, folder, convs[: args.render], args)
        print(json.dumps({"render": result["render"]}, indent=1), flush=True)
    if not {"features", "regen"} <= skip:
        target = load_target(args.target, dtype=args.dtype)
        result["dtype"] = str(target.dtype)
        if "features" not in skip:
            result["features"] = bench_features(target, tokenizer, folder, convs[: args.features], args)
            print(json.dumps({"features": result["features"]}, indent=1), flush=True)
        if "regen" not in skip:
            result["regenerate"] = bench_regen(target, convs, args)
            print(json.dumps({"regenerate": result["regenerate"]}, indent=1), flush=True)
    if args.feature_dtypes:
        result["feature_dtypes"] = bench_feature_dtypes(tokenizer, folder, convs[: args.features], args)
        print(json.dumps({"feature_dtypes": result["feature_dtypes"]}, indent=1), flush=True)
    if "regenerate" not in skip:
        result["regenerate_stage"] = bench_regenerate_stage(args)
        print(json.dumps({"regenerate_stage": result["regenerate_stage"]}, indent=1), flush=True)
    save_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
