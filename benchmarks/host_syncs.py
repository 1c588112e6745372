"""Host syncs per round of the built-in decoder: how often the loop waits for the device.

    python benchmarks/host_syncs.py                       # tiny random target on CPU (seconds)
    python benchmarks/host_syncs.py --target smollm2-135m-instruct --device cuda --cuda-sync-debug

Every read of a device value by the host (``.item()``, ``.tolist()``, ``bool()/int()/float()`` of a
tensor, ``.cpu()``, ``.numpy()``) blocks until the GPU has finished all queued work: per round of
speculative decoding these are the points where the CPU cannot run ahead to queue the next kernels.
:func:`count_host_reads` counts them by wrapping those ``torch.Tensor`` methods (on any device, so
the count is the same on CPU and GPU). It does not see synchronizing *kernels* (``nonzero``, boolean
indexing, …); on a GPU ``--cuda-sync-debug`` also counts every synchronization CUDA reports through
``torch.cuda.set_sync_debug_mode`` — the complete number. Prints one JSON object per drafter.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import script_parser  # noqa: E402 — the benchmarks folder is not a package

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")


def budget_per_round(k: int) -> int:
    """Host reads a greedy round may cost today (measured, benchmarks/RESULTS.md): one per drafted token (the
    drafter picks it on the host to feed the next draft step), two in the acceptance, one to commit the
    emitted tokens, and one more for the self-speculative layer-skip drafter's verification."""
    return k + 5


@contextlib.contextmanager
def count_host_reads() -> Iterator[Counter]:
    """Count calls of the ``torch.Tensor`` methods that copy a value to the host, by name."""
    counts: Counter = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name: str, fn: Any) -> Any:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(self, *args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@contextlib.contextmanager
def count_cuda_syncs() -> Iterator[list]:
    """Every synchronization CUDA reports (``set_sync_debug_mode("warn")``), as a list of warnings."""
    caught: list = []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")
            caught.extend(x for x in w if "synchroniz" in str(x.message))


def measure(target: Any, drafter: Any, prompts: list[list[int]], k: int, max_new_tokens: int, cuda_debug: bool = False) -> dict[str, Any]:
    """Decode ``prompts`` greedily; host reads (and CUDA syncs) per verification round."""
    from draftsmith.decode.rounds import speculative_decode

    speculative_decode(target, drafter, prompts[0], k=k, max_new_tokens=max_new_tokens)  # warm-up (lazy initialization reads values once)
    rounds = tokens = prefills = 0
    cuda = contextlib.nullcontext([]) if not cuda_debug else count_cuda_syncs()
    with count_host_reads() as reads, cuda as syncs:
        for p in prompts:
            res = speculative_decode(target, drafter, p, k=k, max_new_tokens=max_new_tokens)
            rounds += res.stats.rounds
            tokens += res.stats.new_tokens
            prefills += 1
    total = sum(reads.values())
    out = {"rounds": rounds, "prompts": prefills, "new_tokens": tokens, "host_reads": total,
           "host_reads_by_kind": dict(sorted(reads.items())), "host_reads_per_round": total / max(rounds, 1)}
    if cuda_debug:
        out["cuda_syncs"] = len(syncs)
        out["cuda_syncs_per_round"] = len(syncs) / max(rounds, 1)
    return out


def tiny_target() -> Any:
    """A 4-layer random Llama (vocab 2048, final norm ×10 for peaked distributions) with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from draftsmith.target import Target, resolve_target_folder

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=2)).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    return Target(model, AutoTokenizer.from_pretrained(resolve_target_folder("smollm2-135m-instruct")), name="tiny-llama")


def drafters_for(target: Any) -> dict[str, Any]:
    from draftsmith.drafters.eagle3 import Eagle3Config
    from draftsmith.drafters.layer_skip import LayerSkipConfig

    n = target.num_layers
    return {
        f"layer_skip {n // 2}/{n} (shared cache)": LayerSkipConfig(num_layers=n // 2).build(target),
        f"layer_skip {n // 2}/{n} (own cache)": LayerSkipConfig(num_layers=n // 2, share_cache=False).build(target),
        "eagle3 (untrained)": Eagle3Config(feature_layers=[0, n // 2, n - 1]).build(target),
    }


def run(target_name: str, device: str, k: int, prompts: int, max_new_tokens: int, cuda_debug: bool) -> list[dict[str, Any]]:
    from draftsmith.target import load_target

    if device == "cpu":
        torch.set_num_threads(1)  # tiny models: one thread is fastest, and does not fight other processes
    target = tiny_target() if target_name == "tiny" else load_target(target_name, dtype="auto", device=device)
    if target_name == "tiny" and device != "cpu":
        target.model.to(device)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, min(target.vocab_size, 2000), (12,), generator=g).tolist() for _ in range(prompts)]
    results = []
    for name, drafter in drafters_for(target).items():
        row = {"drafter": name, "target": target.name, "device": str(target.device), "dtype": str(target.dtype), "k": k,
               **measure(target, drafter, ids, k, max_new_tokens, cuda_debug)}
        results.append(row)
        print(json.dumps(row))
    return results


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--target", default="tiny", help="'tiny' (random 4-layer Llama) or a target spec")
    p.add_argument("--device", default="cpu")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--cuda-sync-debug", action="store_true", help="also count CUDA's own sync reports (GPU only)")
    p.add_argument("--out", default="", help="also write {step, ok, rows, host_reads_per_round} to this JSON file")
    a = p.parse_args(argv)
    rows = run(a.target, a.device, a.k, a.prompts, a.max_new_tokens, a.cuda_sync_debug)
    if a.out:
        from draftsmith.files import write_json

        worst = max(r["host_reads_per_round"] for r in rows)
        summary = {"step": "host_syncs", "ok": worst <= budget_per_round(a.k), "k": a.k, "rows": rows,
                   "host_reads_per_round": worst, "budget_per_round": budget_per_round(a.k)}
        if a.cuda_sync_debug:
            summary["cuda_syncs_per_round"] = max(r["cuda_syncs_per_round"] for r in rows)
        write_json(a.out, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
