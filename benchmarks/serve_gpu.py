"""The GPU check's serving step: a trained EAGLE-3 head served by vLLM and SGLang against each engine's target alone.

    python benchmarks/serve_gpu.py --drafter RUN/eagle3-zero2/drafter --out OUT/serve.json [--prompts 8]

For each engine that is installed (``vllm``, ``sglang``; one that is missing is recorded as skipped, with why): the
head exported by draftsmith (``--to eagle3`` for both; ``--to speculators`` for vLLM as well), the engine started on
a loopback port with the target alone and then with the head (3 speculative tokens, chains), greedy MT-bench first
turns sent as token ids (the prompt is exactly the one draftsmith renders), tokens/s of each and their ratio,
outputs identical to the target alone's, and the engine's own acceptance figures (vLLM: the spec-decode counters of
``/metrics``; SGLang: ``meta_info.spec_verify_ct`` of ``/generate``). Every server is stopped by its PID.
Written for benchmarks/gpu_check.sh; it cannot run without a GPU and these engines (this repository's CI has neither).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import script_parser  # noqa: E402 — the benchmarks folder is not a package

SPEC_TOKENS = 3


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(url: str, proc: subprocess.Popen, limit: float = 900) -> None:
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"the server was not ready in {limit:.0f} s")


def serve(cmd: list[str], port: int, log: str):
    from draftsmith.engines.llamacpp import _die_with_parent

    out = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(60)


def vllm_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for name in ("spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_drafts_total"):
        m = re.findall(rf"^vllm:{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        out[name] = sum(float(x) for x in m)
    return out


def run_prompts(engine: str, url: str, prompts: list[list[int]], n: int, model: str) -> tuple[list[list[int]], float, dict]:
    tokens, extra, t0 = [], {"verify_ct": 0, "completion_tokens": 0}, time.perf_counter()
    for ids in prompts:
        if engine == "sglang":
            r = post(url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0},
                                         "return_logprob": False})
            tokens.append(list(r.get("output_ids", [])))
            extra["verify_ct"] += int(r.get("meta_info", {}).get("spec_verify_ct", 0))
            extra["completion_tokens"] += int(r.get("meta_info", {}).get("completion_tokens", 0))
        else:
            r = post(url + "/v1/completions", {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0,
                                               "return_token_ids": True})
            choice = r["choices"][0]
            tokens.append(list(choice.get("token_ids") or []) or [len(choice.get("text", ""))])
    return tokens, time.perf_counter() - t0, extra


def measure(engine: str, target_dir: str, exports: dict[str, str], prompts: list[list[int]], n: int, out_dir: str) -> dict:
    from draftsmith.engines.llamacpp import free_port

    configs = {"target alone": []}
    if engine == "vllm":
        configs["eagle3"] = ["--speculative-config", json.dumps({"method": "eagle3", "model": exports["eagle3"],
                                                                  "num_speculative_tokens": SPEC_TOKENS})]
        configs["speculators"] = ["--speculative-config", json.dumps({"model": exports["speculators"],
                                                                       "num_speculative_tokens": SPEC_TOKENS})]
    else:
        configs["eagle3"] = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", exports["eagle3"],
                             "--speculative-num-steps", str(SPEC_TOKENS), "--speculative-eagle-topk", "1",
                             "--speculative-num-draft-tokens", str(SPEC_TOKENS + 1)]
    rows: dict = {}
    for name, extra in configs.items():
        port = free_port()
        if engine == "vllm":
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target_dir, "--host",
                   "127.0.0.1", "--port", str(port), "--max-model-len", "4096", "--gpu-memory-utilization", "0.35",
                   "--served-model-name", "target", *extra]
        else:
            cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", target_dir, "--host", "127.0.0.1",
                   "--port", str(port), "--mem-fraction-static", "0.35", *extra]
        url = f"http://127.0.0.1:{port}"
        try:
            proc = serve(cmd, port, os.path.join(out_dir, f"{engine}-{name.replace(' ', '_')}.log"))
        except Exception as e:  # noqa: BLE001 - recorded, the other configurations still run
            rows[name] = {"error": str(e)}
            continue
        try:
            run_prompts(engine, url, prompts[:1], n, "target")  # warm-up
            before = vllm_counters(url) if engine == "vllm" and extra else {}
            tokens, secs, meta = run_prompts(engine, url, prompts, n, "target")
            row = {"tokens_per_s": round(sum(map(len, tokens)) / secs, 2), "tokens": tokens}
            if engine == "vllm" and extra:
                after = vllm_counters(url)
                d = {k: after[k] - before.get(k, 0.0) for k in after}
                if d["spec_decode_num_drafts_total"]:
                    row["tau"] = round(1 + d["spec_decode_num_accepted_tokens_total"] / d["spec_decode_num_drafts_total"], 4)
            if engine == "sglang" and extra and meta["verify_ct"]:
                row["tau"] = round(meta["completion_tokens"] / meta["verify_ct"], 4)
            rows[name] = row
        except Exception as e:  # noqa: BLE001
            rows[name] = {"error": str(e)}
        finally:
            stop(proc)
    base = rows.get("target alone", {})
    for name, row in rows.items():
        if name != "target alone" and "tokens_per_s" in row and "tokens_per_s" in base:
            row["speedup"] = round(row["tokens_per_s"] / base["tokens_per_s"], 4)
            row["identical_to_target"] = sum(a == b for a, b in zip(row["tokens"], base["tokens"]))
    for row in rows.values():
        row.pop("tokens", None)
    return rows


def main() -> int:
    p = script_parser(__doc__, target=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from draftsmith.measure.prompts import load_questions
    from draftsmith.export import export
    from draftsmith.target import load_target, resolve_target_folder

    out_dir = os.path.dirname(os.path.abspath(args.out))
    target = load_target(args.target, "float32", "cpu")
    prompts = [target.render_chat(q.messages()) for q in load_questions("mtbench", args.prompts)]
    exports = {}
    for fmt in ("eagle3", "speculators"):
        exports[fmt] = os.path.join(out_dir, f"export-{fmt}")
        export(args.drafter, fmt, exports[fmt], target=args.target, force=True)
    result: dict = {"step": "serve", "engines": {}}
    for engine in ("vllm", "sglang"):
        if importlib.util.find_spec(engine) is None:
            result["engines"][engine] = {"skipped": f"{engine} is not installed on this machine (pip install {engine})"}
            continue
        result["engines"][engine] = measure(engine, resolve_target_folder(args.target), exports, prompts,
                                            args.max_new_tokens, out_dir)
    result["ok"] = all("error" not in r for e in result["engines"].values() for r in e.values() if isinstance(r, dict))
    from draftsmith.files import write_json

    write_json(args.out, result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
