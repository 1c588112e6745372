"""The reference trainer on exactly draftsmith's data: vLLM's ``speculators`` 0.9.0 EAGLE-3 trainer beside draftsmith's.

    python benchmarks/peer.py --prepared runs/demo/prepare/data --draftsmith-run runs/demo/eagle3 --out OUT
    python benchmarks/peer.py --prepared DIR --out OUT --steps 150 --batch-size 8 --ttt-steps 2 --lr 2e-3
    python benchmarks/peer.py ... --speculators-defaults     # speculators' own norm flags (a second, unmatched run)
    python benchmarks/peer.py ... --seed 1                    # a second seed: split, batch order, speculators' init

Five stages, each skipped when its output is already in ``--out`` (a killed run continues):

1. **convert** (``OUT/speculators-data``): the prepared folder's records as speculators' offline hidden-states
   format — an arrow dataset (``input_ids``, ``loss_mask``, ``seq_len``, torch format) and
   ``hidden_states/hs_{i}.safetensors`` (``hidden_states`` [S, 4, H] bf16: the three feature layers of the
   recipe, then the target's last layer as the verifier's last hidden state, whose final norm and lm_head
   speculators applies itself; ``token_ids`` [S]), plus ``d2t.npy`` / ``t2d.npy``. Record i is draftsmith's
   row i of the feature cache, cut to ``train.max_length`` as draftsmith's collate cuts it: the same tokens,
   mask, features (the cache's bf16 values as they are) and draft vocabulary.
2. **train** (``OUT/speculators-run``): speculators' ``Eagle3DraftModel.from_training_args`` and ``Trainer``,
   wired as ``speculators.train.cli.main`` wires them, for the recipe's steps, lr, warmup, cosine schedule and
   TTT depth, on draftsmith's batches: each step packs exactly the records draftsmith's ``BatchOrder`` gives
   that step (``train/data.py``: same seed, same held-out split from ``split_heldout``, held-out records never
   trained on) into one row, as speculators' collate packs (its Multipack sampler would choose other records
   and a token budget instead of a record count).
3. **import** (``OUT/speculators-drafter``): the trained checkpoint as a draftsmith drafter folder
   (``export.import_drafter``, the inverse of ``--to speculators``).
4. **held-out**: both heads on the same held-out records with the computation of draftsmith's training-time
   evaluation (``train/eagle3.py`` ``evaluate``: per unrolled step, top-1 agreement and expected acceptance
   Σ min(p, q) against the target's full p; sim τ at the recipe's ``decode.k``).
5. **decoder**: both heads in the built-in decoder, what ``draftsmith eval ... eval.check_identity=false
   eval.engine=none`` measures (``measure.evaluate.evaluate``; a chain of ``--k``, no gate, greedy, bf16, the first
   ``--prompts`` MT-bench first turns, ``--max-new-tokens``): τ (bonus counted) and acceptance by position. Speed is
   not measured. A draftsmith run decoded by ``benchmarks/levers.py decode`` at the same settings is read from its
   ``levers_decode.json`` (the same call), not decoded again.

Prints one table and writes ``OUT/peer.json``, and the recipe both trainers followed as ``OUT/config.yaml`` (so
``benchmarks/levers.py decode OUT/speculators-drafter`` decodes the reference at other settings). Held-out and
acceptance figures do not depend on the machine's load; no time is reported.

Flags matched to draftsmith's (speculators' own options, no shim): ``norm_before_residual``, ``norm_before_fc``
and ``norm_output`` false as draftsmith's recipe has them (speculators' EAGLE-3 defaults are all true;
``--speculators-defaults`` trains with those, and the import carries them into draftsmith's head), one full-attention layer (its default is a 2048-token
sliding window, no different on records ≤ 2048 tokens), the recipe's feature layers (vLLM ids = ours + 1),
``ttt_step_loss_decay`` = the recipe's ``loss.step_decay`` (its default 1.0), ``kl_div`` loss (the same gradient as
draftsmith's soft CE over the draft vocabulary), cosine schedule with the recipe's warmup (its default is linear),
``weight_decay`` the recipe's, seed the recipe's, hidden states and autocast in bf16, ``draft_attn_impl`` ``sdpa``
(its default flex attention is not for CPUs), ``loss_implementation`` ``eager`` (its fused loss needs Triton).

Left as speculators has them (no option to change them): AdamW betas (0.9, 0.999) against draftsmith's recipe's
(0.9, 0.95); the cosine decays to 0, draftsmith's to ``min_lr_ratio`` of the peak; warmup ramps from 0 (HF)
against (step+1)/warmup; fp32 master weights under bf16 autocast against DeepSpeed's bf16 engine; its lm_head is
frozen at the target's rows (draftsmith trains it) and its final norm starts at 1 (draftsmith's at the target's);
its ``kl_div`` compares the distributions at temperature 1 (draftsmith's at the recipe's ``loss.temperature``);
its per-step loss is a mean over the packed row's answer positions where the input token is an answer token
(draftsmith: where the predicted token is one, summed over the step and divided by the step-0 rows), and it keeps
positions whose target argmax is outside the draft vocabulary (draftsmith masks them); gradient clipping 1.0 in both.

Runtime shims (monkeypatches inside this process; nothing installed is touched), each needed on a CPU only:

* ``speculators.train.trainer.get_local_rank`` → ``"cpu"``: the Trainer moves the model and every batch to
  ``self.local_rank``, the integer 0, which torch reads as ``cuda:0``.
* ``Trainer.device_type`` set to ``"cpu"`` after construction: it is ``torch.accelerator.current_accelerator()``'s
  type or else ``"cuda"``, and ``torch.autocast("cuda")`` without CUDA disables itself, so bf16 hidden states would
  meet fp32 weights.
* ``torch.accelerator.synchronize`` → a no-op when no accelerator is present: the Trainer's step timer calls it on
  every logged step and it raises "Cannot access accelerator device when none is available".

Avoided rather than shimmed: the verifier is the target's local HF folder (``target.resolve_target_folder``), so
``VerifierConfig`` and ``load_verifier_weights`` read it and never call the Hub (``name_or_path: null`` would);
``sdpa`` attention has no multiple-of-128 length; no validation loader (the held-out figures are draftsmith's).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from draftsmith.config import Recipe, load_recipe
from draftsmith.demo import SIZES, demo_stages
from draftsmith.drafters import load as load_drafter
from draftsmith.drafters.common import shift_left
from draftsmith.export.conventions import engine_layer_ids
from draftsmith.files import atomic_dir, write_json
from draftsmith.schema import save_recipe
from draftsmith.tables import text_table
from draftsmith.target import Target, load_target, resolve_target_folder
from draftsmith.train import losses
from draftsmith.train.data import BatchOrder, collate, heldout_batches, load_rows, record_lengths, split_heldout
from draftsmith.train.heldout import masked_metric, sim_tau, with_chain_summary
from draftsmith.train.setup import pad_id
from draftsmith.train.target_side import cached_layers, cached_logits, rows_ahead

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import script_parser  # noqa: E402 — the benchmarks folder is not a package

BEST = "drafter-best"
RECIPE = "smollm2-135m-eagle3"


# ---------------------------------------------------------------- the recipe both trainers follow


def recipe_for(args: argparse.Namespace) -> Any:
    """The draftsmith recipe of the comparison: the run's own ``config.yaml`` when ``--draftsmith-run`` has one,
    else ``smollm2-135m-eagle3`` with the default demo's train overrides on ``--prepared``; ``--steps``,
    ``--batch-size``, ``--ttt-steps``, ``--lr``, ``--seed`` override either; the draft vocabulary is ``--prepared``'s own unless
    ``--draft-vocab`` names another (the one the compared draftsmith head was trained with)."""
    given = os.path.join(args.draftsmith_run or "", "config.yaml")
    if args.draftsmith_run and os.path.isfile(given):
        path, overrides = given, []
    else:
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(args.prepared)))  # <run>/prepare/data
        path, overrides = RECIPE, demo_stages(run_dir, SIZES["default"])["train"]
        overrides = [o for o in overrides if not o.startswith(("train.dataset=", "train.features=", "drafter.draft_vocab="))]
    data = os.path.abspath(args.prepared)
    vocab = os.path.abspath(args.draft_vocab) if args.draft_vocab else f"{data}/draft_vocab.safetensors"
    overrides += [f"train.dataset={data}/tokenized", f"train.features={data}/features", f"drafter.draft_vocab={vocab}"]
    for flag, key in (("steps", "train.steps"), ("batch_size", "train.batch_size"), ("ttt_steps", "train.ttt_steps"),
                      ("lr", "train.optimizer.lr")):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    if args.seed is not None:
        overrides += [f"train.seed={args.seed}", f"drafter.seed={args.seed}"]
    if args.steps is not None and not os.path.isfile(given):
        overrides.append(f"train.schedule.warmup_steps={max(5, args.steps // 50)}")  # the demo's rule
    return load_recipe(path, overrides)


@dataclass
class Data:
    """draftsmith's view of the prepared data: rows, held-out split, and the batches of every step."""

    rows: Any
    heldout: list[int]
    batches: list[list[int]]
    layers: tuple[int, ...]
    d2t: Tensor
    t2d: Tensor


def draftsmith_data(recipe: Recipe, target: Target) -> Data:
    """The records, split and per-step batches exactly as ``train/setup.py`` ``start`` makes them (one process)."""
    from draftsmith.data.vocab import resolve_draft_vocab

    cfg = recipe.train
    rows = load_rows(cfg.dataset, cfg.features, target)
    split = split_heldout(len(rows), cfg.eval.heldout, cfg.seed, cfg.max_records)
    lengths = record_lengths(rows) if cfg.group_by_length else None
    order = BatchOrder(split.train, cfg.batch_size, 1, 0, cfg.seed, lengths, cfg.group_by_length)
    layers = tuple(recipe.drafter.resolve(target).feature_layers)
    d2t, t2d = resolve_draft_vocab(None, recipe.drafter.draft_vocab, 0, target.vocab_size, target.tokenizer_hash)
    return Data(rows, split.heldout, [order.at(s) for s in range(cfg.steps)], layers, d2t, t2d)


# ---------------------------------------------------------------- 1. convert


def convert(data: Data, recipe: Recipe, target: Target, out: str) -> None:
    """Write speculators' offline format for every record (see the module docstring) into ``out``, atomically."""
    import datasets
    from safetensors.torch import save_file

    if os.path.isfile(os.path.join(out, "state.json")):
        return
    last = target.num_layers - 1
    cached = list(data.rows.layer_ids)
    h, cut = target.hidden_size, recipe.train.max_length
    with atomic_dir(out) as tmp:
        os.makedirs(os.path.join(tmp, "hidden_states"))
        ids, masks, lens = [], [], []
        for i in range(len(data.rows)):
            row = data.rows[i]
            x = torch.as_tensor(np.asarray(row["input_ids"]), dtype=torch.long)[:cut]  # [S]
            hidden = row["hidden"][:cut]  # [S, L·H] bf16, the cache's layers
            layers = cached_layers(hidden, cached, (*data.layers, last), h).view(len(x), 4, h)  # [S, 4, H]
            save_file({"hidden_states": layers.to(torch.bfloat16).contiguous(), "token_ids": x},
                      os.path.join(tmp, "hidden_states", f"hs_{i}.safetensors"))
            ids.append(x.tolist())
            masks.append(torch.as_tensor(np.asarray(row["loss_mask"]))[:cut].long().tolist())
            lens.append(len(x))
        ds = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": lens})
        ds.set_format(type="torch")
        ds.save_to_disk(tmp)
        vd = int(data.d2t.shape[0])
        np.save(os.path.join(tmp, f"d2t-{vd}.npy"), data.d2t.numpy())
        np.save(os.path.join(tmp, f"t2d-{vd}.npy"), data.t2d.numpy())
        write_json(os.path.join(tmp, "peer_convert.json"), {
            "records": len(ids), "feature_layers": list(data.layers), "last_layer": last,
            "vllm_layer_ids": engine_layer_ids(data.layers, target.num_layers, "speculators"), "max_length": cut,
            "heldout": data.heldout, "draft_vocab": vd})


# ---------------------------------------------------------------- 2. train (speculators)


def cpu_shims() -> None:
    """The runtime shims of the module docstring, applied to this process."""
    import speculators.train.trainer as trainer_mod

    trainer_mod.get_local_rank = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *a, **k: None


class StepBatches(torch.utils.data.Sampler):
    """draftsmith's record indices of every optimizer step, one list per step (speculators' collate packs them)."""

    def __init__(self, batches: list[list[int]]):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def train_speculators(data: Data, recipe: Recipe, target: Target, data_dir: str, out: str, defaults: bool) -> str:
    """Train speculators' EAGLE-3 head for the recipe's steps on draftsmith's batches; returns its checkpoint folder.

    defaults: speculators' own norm flags (norm_before_residual, norm_before_fc, norm_output true) instead of the
    recipe's."""
    final = os.path.join(out, "0")
    if os.path.isfile(os.path.join(final, "model.safetensors")):
        return final
    cpu_shims()
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import create_transformer_layer_config, set_seed
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.trainer import Trainer, TrainerConfig

    cfg = recipe.train
    verifier = os.path.abspath(resolve_target_folder(recipe.target.name))
    set_seed(cfg.seed)
    layer_config = create_transformer_layer_config(verifier, num_layers=1, draft_arch="llama", hidden_act=None,
                                                   sliding_window=2048, full_attention_indices=[0])
    args = {"verifier_name_or_path": verifier, "target_layer_ids": engine_layer_ids(data.layers, target.num_layers, "speculators"),
            "draft_vocab_size": int(data.d2t.shape[0]), "norm_before_residual": defaults, "norm_before_fc": defaults,
            "fc_norm": False, "norm_output": defaults, "embed_requires_grad": False, "ttt_steps": cfg.ttt_steps,
            "draft_attn_impl": "sdpa", "ttt_step_loss_decay": cfg.loss.step_decay, "loss_fn": "kl_div",
            "loss_implementation": "eager"}
    model = Eagle3DraftModel.from_training_args(verifier_config=layer_config, t2d=data.t2d, d2t=data.d2t, **args)
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(**args)
    dataset = ArrowDataset(max_len=0, datapath=data_dir, on_missing="raise", train_ratio=1.0, split="train",
                           hidden_states_dtype=torch.bfloat16)
    lengths = dataset.approx_lengths
    packed = max(sum(lengths[i] for i in b) for b in data.batches)
    total = 128 * math.ceil(packed / 128)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=StepBatches(data.batches), num_workers=0,
                                         collate_fn=CollateFn(total, target.hidden_size, num_target_layers=3,
                                                              dtype=torch.bfloat16, preprocess=shift_batch))
    sched = cfg.schedule
    config = TrainerConfig(lr=cfg.optimizer.lr, num_epochs=1, save_path=out, train_call_kwargs=train_kwargs,
                           optimizer="adamw", weight_decay=cfg.optimizer.weight_decay, scheduler_type="cosine",
                           scheduler_warmup_steps=sched.warmup_steps, scheduler_total_steps=cfg.steps,
                           checkpoint_freq=1, hidden_states_dtype=torch.bfloat16, log_freq=10, max_steps=cfg.steps)
    log = logging.getLogger("speculators.metrics")
    log.setLevel(logging.INFO)
    os.makedirs(out, exist_ok=True)
    handler = logging.FileHandler(os.path.join(out, "metrics.jsonl"))
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    trainer = Trainer(model, config, loader, None)
    trainer.device_type = "cpu"  # shim: autocast on the CPU (module docstring)
    print(f"speculators: {cfg.steps} steps of {cfg.batch_size} records packed into rows of {total} tokens", flush=True)
    trainer.run_training()
    log.removeHandler(handler)
    write_json(os.path.join(out, "peer_train.json"), {"args": {k: v for k, v in args.items()}, "total_seq_len": total,
                                                      "steps": cfg.steps, "lr": cfg.optimizer.lr,
                                                      "warmup": sched.warmup_steps})
    return final


# ---------------------------------------------------------------- 4. held-out (draftsmith's evaluation)


@torch.no_grad()
def heldout(recipe: Recipe, target: Target, data: Data, path: str) -> dict[str, float]:
    """The held-out figures of ``train/eagle3.py``'s ``evaluate`` for the drafter folder ``path``, over
    ``data.heldout`` in draftsmith's held-out batches, and sim τ at the recipe's decode depth."""
    cfg = recipe.train
    head = load_drafter(path, target).module.eval()
    draft_ids = head.draft_ids
    cached = list(data.rows.layer_ids)
    totals: dict[str, list[float]] = {}
    for ids in heldout_batches(data.heldout, cfg.batch_size, 1, 0):
        batch = collate([data.rows[i] for i in ids], pad_id(target), cfg.max_length)
        need = shift_left(batch.loss_mask, 1, fill=False)  # [B, S]
        features = cached_layers(batch.hidden, cached, data.layers, target.hidden_size).to(target.dtype)
        logits_t = cached_logits(target, batch, cached, need)  # [N, V]
        keep = [shift_left(batch.loss_mask, j + 2, fill=False) for j in range(cfg.ttt_steps)]
        steps = head.unroll(batch.input_ids, features, steps=cfg.ttt_steps, attention_mask=batch.attention_mask,
                            logits_rows=keep)
        index = (need.flatten().long().cumsum(0) - 1).view(need.shape)
        for j, (_, logits) in enumerate(steps):
            rows = rows_ahead(index, j + 1, keep[j])  # the target's row (position t+j+1) of each kept row t
            accept, top1 = losses.draft_vocab_agreement(logits, logits_t, draft_ids, rows=rows)
            every = torch.ones(len(logits), dtype=torch.bool)
            for name, value in ((f"expected_accept_step{j}", accept), (f"top1_step{j}", top1)):
                s, n = masked_metric(lambda v=value: losses.masked_mean(v, every), every)
                acc = totals.setdefault(name, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + s, acc[1] + n
    out = with_chain_summary({k: s / n for k, (s, n) in totals.items() if n > 0})
    out["sim_tau"] = sim_tau(out, recipe.decode.depth, recipe.decode.warp.greedy)
    return out


def heldout_check(recipe: Recipe, target: Target, data: Data, run_dir: str) -> dict[str, float] | None:
    """:func:`heldout` of the run's final ``drafter`` beside the held-out sim τ its training logged at the end
    (``train_summary.json``): equal when this evaluation and the split are draftsmith's own."""
    summary, final = os.path.join(run_dir, "train_summary.json"), os.path.join(run_dir, "drafter")
    if not (os.path.isfile(summary) and os.path.isdir(final)):
        return None
    with open(summary, encoding="utf-8") as f:
        logged = json.load(f).get("heldout", {}).get("sim_tau")
    return None if logged is None else {"here": heldout(recipe, target, data, final)["sim_tau"], "logged": float(logged)}


# ---------------------------------------------------------------- 5. the built-in decoder


def decoder(recipe: Recipe, target: Target, path: str, prompts: int, k: int, max_new_tokens: int) -> dict[str, Any]:
    """The drafter folder ``path`` in the built-in decoder: what ``draftsmith eval ... eval.check_identity=false
    eval.engine=none`` measures (``measure.evaluate.evaluate``), a greedy chain of ``k`` on the first ``prompts``
    MT-bench first turns, on ``target`` (bf16), the target alone not timed. Reused from the run folder's
    ``levers_decode.json`` (``benchmarks/levers.py decode``: the same call on the same prompts) when that holds
    the same settings."""
    from dataclasses import replace

    from draftsmith.measure.evaluate import evaluate
    from draftsmith.measure.prompts import load_questions

    saved = os.path.join(os.path.dirname(os.path.abspath(path)), "levers_decode.json")
    if os.path.isfile(saved):
        with open(saved, encoding="utf-8") as f:
            done = json.load(f)
        if (done.get("prompts"), done.get("max_new_tokens"), done.get("dtype")) == (prompts, max_new_tokens, "bfloat16") \
                and str(k) in done.get("by_k", {}):
            return {**done["by_k"][str(k)], "tau_se_over_prompts": None, "prompts": prompts, "k": k, "from": saved}
    decode = replace(recipe.decode, k=k, max_new_tokens=max_new_tokens, min_confidence=0.0, tree="none", temperature=0.0)
    drafter = load_drafter(path, target)
    drafter.module.requires_grad_(False)
    result = evaluate(target, drafter, load_questions("mtbench", prompts), decode, progress=False)
    stats = result.stats.summary()
    taus = [float(r["stats"]["tau_with_bonus"]) for r in result.records if (r.get("stats") or {}).get("tau_with_bonus")]
    se = float(np.std(taus, ddof=1) / math.sqrt(len(taus))) if len(taus) > 1 else None
    return {"tau_with_bonus": stats["tau_with_bonus"], "acceptance_at_position": stats["acceptance_at_position"],
            "conditional_acceptance_at_position": stats["conditional_acceptance_at_position"], "tau_se_over_prompts": se,
            "prompts": prompts, "k": k}


# ---------------------------------------------------------------- the table


def table(results: dict[str, dict[str, Any]], ttt: int) -> str:
    """One row per head: held-out sim τ, top-1 and expected acceptance per TTT step, decoder τ and acceptance."""
    rows = []
    for name, r in results.items():
        h, d = r["heldout"], r.get("decoder")
        top1 = " / ".join(f"{h.get(f'top1_step{j}', float('nan')):.3f}" for j in range(ttt))
        acc = " / ".join(f"{h.get(f'expected_accept_step{j}', float('nan')):.3f}" for j in range(ttt))
        dec = "–" if d is None else f"{d['tau_with_bonus']:.3f}" + (
            f" ± {d['tau_se_over_prompts']:.3f}" if d.get("tau_se_over_prompts") is not None else "")
        pos = "–" if d is None else " / ".join("–" if a is None else f"{a:.3f}" for a in d["acceptance_at_position"])
        rows.append([name, f"{h['sim_tau']:.3f}", top1, acc, dec, pos])
    return "\n".join(text_table(["head", "held-out sim τ", "top-1 per step", "E[accept] per step", "decoder τ ± se",
                       "acceptance at position (cumulative)"], rows, width=200))


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--prepared", required=True, help="a `draftsmith prepare` data folder (tokenized, features, draft_vocab)")
    p.add_argument("--draftsmith-run", default="", help="a draftsmith EAGLE-3 run folder, already trained on --prepared "
                   "(its config.yaml is the recipe; its drafter-best the head compared)")
    p.add_argument("--out", required=True)
    p.add_argument("--draft-vocab", default="", help="a draft vocabulary file (d2t/t2d) instead of --prepared's "
                   "draft_vocab.safetensors: the one the draftsmith head compared was trained with")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--ttt-steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int, help="the recipe's train.seed and drafter.seed: the held-out split, the batch "
                   "order and speculators' set_seed (a second seed of the reference beside a draftsmith run at that seed)")
    p.add_argument("--prompts", type=int, default=20, help="MT-bench first turns decoded")
    p.add_argument("--k", type=int, default=4, help="drafts per round (a chain)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--speculators-defaults", action="store_true",
                   help="train speculators with its own norm_before_residual / norm_before_fc / norm_output (true) instead of draftsmith's")
    p.add_argument("--no-decoder", action="store_true", help="held-out figures only")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    recipe = recipe_for(args)
    save_recipe(recipe, args.out)  # OUT/config.yaml: what `levers.py decode OUT/speculators-drafter` reads
    target = load_target(recipe.target.name, recipe.target.dtype, "cpu")
    data = draftsmith_data(recipe, target)
    tag = "speculators-defaults" if args.speculators_defaults else "speculators"
    data_dir = os.path.join(args.out, "speculators-data")
    convert(data, recipe, target, data_dir)
    ckpt = train_speculators(data, recipe, target, data_dir, os.path.join(args.out, f"{tag}-run"), args.speculators_defaults)
    imported = os.path.join(args.out, f"{tag}-drafter")
    if not os.path.isdir(imported):
        from draftsmith.export import import_drafter

        import_drafter(ckpt, imported, target, fmt="speculators")
    heads = {"speculators 0.9.0" + (" (its norm flags)" if args.speculators_defaults else ""): imported}
    if args.draftsmith_run:
        heads = {f"draftsmith ({BEST})": os.path.join(args.draftsmith_run, BEST), **heads}
    results: dict[str, dict[str, Any]] = {}
    for name, path in heads.items():
        results[name] = {"path": os.path.abspath(path), "heldout": heldout(recipe, target, data, path)}
    check = heldout_check(recipe, target, data, args.draftsmith_run) if args.draftsmith_run else None
    for name, path in heads.items():  # the decoder after every held-out figure: those come first, cheaply
        if not args.no_decoder:
            bf16 = target if target.dtype == torch.bfloat16 else load_target(recipe.target.name, "bfloat16", "cpu")
            results[name]["decoder"] = decoder(recipe, bf16, path, args.prompts, args.k, args.max_new_tokens)
            write_json(os.path.join(args.out, "peer.partial.json"), results)
    text = table(results, recipe.train.ttt_steps)
    print(text)
    if check:
        print(f"held-out check: draftsmith's final head here sim τ {check['here']:.4f}, in its train_summary.json "
              f"{check['logged']:.4f}")
    cfg = recipe.train
    write_json(os.path.join(args.out, "peer.json"), {
        "prepared": os.path.abspath(args.prepared), "draftsmith_run": args.draftsmith_run, "records": len(data.rows),
        "heldout_records": data.heldout, "steps": cfg.steps, "batch_size": cfg.batch_size, "ttt_steps": cfg.ttt_steps,
        "lr": cfg.optimizer.lr, "warmup": cfg.schedule.warmup_steps, "sim_tau_k": recipe.decode.depth,
        "decoder": {"prompts": args.prompts, "k": args.k, "max_new_tokens": args.max_new_tokens, "dtype": "bfloat16"},
        "heads": results, "heldout_check": check, "table": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
