"""Helpers of ``benchmarks/gpu_check.sh`` (one JSON per step; the shell script orchestrates).

    python benchmarks/gpu_check.py env  OUT.json        # torch / CUDA / GPU facts; exit 3 without a GPU
    python benchmarks/gpu_check.py mfu  OUT.json        # SmolLM2 bf16 target forward: tokens/s and MFU
    python benchmarks/gpu_check.py train-stats RUN_DIR OUT.json   # training tokens/s, MFU of its target forward
    python benchmarks/gpu_check.py summary DIR          # DIR/*.json → DIR/gpu_check.json + DIR/summary.txt

MFU (model-FLOPs utilization) = achieved FLOP/s ÷ the GPU's dense bf16 peak, with the forward's
FLOPs counted as ``2·N + 2·L·s·d_attn`` per token (N = non-embedding parameters incl. lm_head;
benchmarks/scale.py uses the same count). Peaks are in :data:`PEAK_TFLOPS` by device name;
``GPU_PEAK_TFLOPS`` overrides.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from typing import Any

NO_GPU_EXIT = 3
# dense bf16 tensor-core peaks, TFLOP/s (vendor data sheets), matched by substring of the device name
PEAK_TFLOPS = {"B200": 2250.0, "H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "GH200": 989.0, "A100": 312.0,
               "L40S": 362.0, "L40": 181.0, "A6000": 155.0, "L4": 121.0, "A10G": 70.0, "A10": 125.0,
               "RTX 4090": 165.0, "RTX 3090": 71.0, "V100": 125.0}


def write(path: str, obj: dict[str, Any]) -> None:
    from draftsmith.files import write_json

    write_json(path, obj)
    print(json.dumps(obj))


def peak_tflops(name: str) -> float | None:
    if os.environ.get("GPU_PEAK_TFLOPS"):
        return float(os.environ["GPU_PEAK_TFLOPS"])
    for key, value in PEAK_TFLOPS.items():  # longest names first where they overlap (H100 PCIe before H100)
        if key in name:
            return value
    return None


def cmd_env(out: str) -> int:
    import torch

    info: dict[str, Any] = {"step": "env", "torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    try:
        import deepspeed
        import transformers

        info.update(deepspeed=deepspeed.__version__, transformers=transformers.__version__)
    except ImportError as e:
        info["import_error"] = str(e)
    if not torch.cuda.is_available():
        info.update(ok=False, reason="no GPU: torch.cuda.is_available() is False")
        write(out, info)
        return NO_GPU_EXIT
    name = torch.cuda.get_device_name(0)
    info.update(ok=True, gpu=name, gpus=torch.cuda.device_count(), cuda=torch.version.cuda,
                capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                bf16=torch.cuda.is_bf16_supported(), memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30,
                peak_bf16_tflops=peak_tflops(name), nccl=torch.distributed.is_nccl_available(),
                flash_sdp=torch.backends.cuda.flash_sdp_enabled(), mem_efficient_sdp=torch.backends.cuda.mem_efficient_sdp_enabled())
    write(out, info)
    return 0


def forward_flops_per_token(config: Any, nonembed: int, seq: int) -> float:
    heads = int(config.num_attention_heads)
    d_attn = heads * int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2.0 * nonembed + 2.0 * int(config.num_hidden_layers) * seq * d_attn


def target_flops(target: Any, seq: int) -> float:
    total = sum(p.numel() for p in target.model.parameters())
    embed = target.model.get_input_embeddings().weight.numel()
    tied = target.model.get_output_embeddings().weight is target.model.get_input_embeddings().weight
    nonembed = total - embed + (embed if tied else 0)  # a tied lm_head still runs its matmul
    return forward_flops_per_token(target.config, nonembed, seq)


def cmd_mfu(out: str, batch: int = 16, seq: int = 1024, iters: int = 20) -> int:
    """Time the frozen target's bf16 forward (EAGLE-3's three feature layers captured, as in online training)."""
    import torch

    from draftsmith.target import default_eagle3_layers
    from draftsmith.target import load_target

    target = load_target("smollm2-135m-instruct", dtype="bfloat16", device="cuda")
    layers = default_eagle3_layers(target.num_layers)
    ids = torch.randint(0, target.vocab_size, (batch, seq), device="cuda")
    with torch.inference_mode():
        for _ in range(3):
            target.forward(ids, feature_layers=layers)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            target.forward(ids, feature_layers=layers)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    tps = batch * seq * iters / dt
    flops = target_flops(target, seq)
    peak = peak_tflops(torch.cuda.get_device_name(0))
    write(out, {"step": "mfu", "ok": True, "batch": batch, "seq": seq, "tokens_per_s": tps, "flops_per_token": flops,
                "achieved_tflops": tps * flops / 1e12, "peak_bf16_tflops": peak,
                "mfu": tps * flops / (peak * 1e12) if peak else None,
                "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30})
    return 0


def cmd_train_stats(run_dir: str, out: str, step_name: str = "train") -> int:
    """Training throughput from the run's rank-0 log (first logged interval left out as warm-up)."""
    import torch

    from draftsmith.config import load_recipe
    from draftsmith.target import load_target

    rows = []
    with open(os.path.join(run_dir, "logs", "train.rank0.jsonl"), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "tokens_per_s" in rec:
                rows.append(rec)
    summary_path = os.path.join(run_dir, "train_summary.json")
    summary = json.load(open(summary_path)) if os.path.isfile(summary_path) else {}
    steady = rows[1:] or rows
    tps = sum(r["tokens_per_s"] for r in steady) / max(len(steady), 1)
    recipe = load_recipe(os.path.join(run_dir, "config.yaml"))
    target = load_target(recipe.target.name, dtype="bfloat16", device="cpu")  # only counts parameters
    flops = target_flops(target, recipe.train.max_length)
    peak = peak_tflops(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    mem = [r[k] for r in rows for k in r if k.startswith("memory/")]
    write(out, {"step": step_name, "ok": bool(summary) and bool(rows), "steps": summary.get("steps"),
                "zero_stage": summary.get("zero_stage"), "dtype": summary.get("dtype"),
                "heldout": summary.get("heldout"), "tokens_per_s": tps, "target_forward_flops_per_token": flops,
                "target_forward_mfu": tps * flops / (peak * 1e12) if peak else None,
                "peak_memory_gib": max(mem) if mem else None, "logged_intervals": len(rows)})
    return 0


def cmd_summary(folder: str) -> int:
    """Merge the step JSONs into gpu_check.json and write a human summary next to it."""
    steps = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json")), key=os.path.getmtime):  # in run order
        if os.path.basename(path) == "gpu_check.json":
            continue
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        steps[os.path.splitext(os.path.basename(path))[0]] = obj
    env = steps.get("env", {})
    status = "no_gpu" if env and not env.get("cuda_available") else (
        "pass" if steps and all(s.get("ok") for s in steps.values()) else "fail")
    report = {"status": status, "steps": steps}
    from draftsmith.files import write_json, write_text

    write_json(os.path.join(folder, "gpu_check.json"), report)
    lines = [f"gpu_check: {status}" + (f" on {env.get('gpu')}" if env.get("gpu") else "")]
    for name, s in steps.items():
        keys = [k for k in ("reason", "tokens_per_s", "mfu", "target_forward_mfu", "host_reads_per_round",
                            "cuda_syncs_per_round", "zero_stage", "peak_memory_gib", "seconds", "rc") if s.get(k) is not None]
        facts = ", ".join(f"{k}={s[k]:.3g}" if isinstance(s[k], float) else f"{k}={s[k]}" for k in keys)
        word = "ok  " if s.get("ok") else ("STOP" if status == "no_gpu" and name == "env" else "FAIL")
        lines.append(f"  {word} {name}: {facts}")
    write_text(os.path.join(folder, "summary.txt"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str]) -> int:
    cmd, *args = argv
    if cmd == "env":
        return cmd_env(*args)
    if cmd == "mfu":
        return cmd_mfu(*args)
    if cmd == "train-stats":
        return cmd_train_stats(*args)
    if cmd == "summary":
        return cmd_summary(*args)
    raise SystemExit(f"unknown command {cmd!r}; see the module docstring")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
