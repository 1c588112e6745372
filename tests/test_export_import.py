"""Import, the inverse of export: every export format imports back into the drafter it came from (same tensors, same
proposals), a checkpoint built by speculators' own class imports with its class's logits (norm_before_residual too, in
its own layout and in the EAGLE-3 layout SGLang reads), and a checkpoint for another target, another vocabulary or
hidden size, or with shifted layer ids is refused in one line before anything is written."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith import drafters
from draftsmith.cli import main
from draftsmith.drafters import DraftLMConfig, Eagle3Config, MedusaConfig
from draftsmith.drafters.dflash import DFlashConfig
from draftsmith.drafters.dflash2 import DFlash2Config
from draftsmith.drafters.peagle import PEagleConfig
from draftsmith.drafters.common import shift_left
from draftsmith.errors import DraftsmithError
from draftsmith.export import IMPORTS, export, import_drafter
from draftsmith.export.eagle3 import speculators_logits
from draftsmith.export.conventions import native_layer_ids
from draftsmith.export.importer import detect
from draftsmith.export.run import LOGIT_TOLERANCE, compare_proposals, default_prompts
from draftsmith.target import load_target

# the tiny target, its scattered draft vocabulary and perturb(): what the export tests build their exports from
from .test_export import perturb, target, vocab  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [0, 1, 3]
"""Three distinct layers of the 4-layer tiny target."""
DFLASH2 = {"num_layers": 1, "block_size": 4, "feature_layers": [0, 2], "conv_group_size": 8, "selector_rank": 8,
           "selector_top_k": 5}
"""A tiny DFlash2 (its convolutions and selector included) for the 64-wide tiny target."""


SOURCES = {  # case → (export format, the drafter it holds); a case is named by its format, or format-family, or
    # format-"deep": a two-layer EAGLE-3 head, whose second layer reads what that format's engines give it
    "speculators": ("speculators", lambda: Eagle3Config(feature_layers=LAYERS, norm_before_residual=True)),
    "speculators-deep": ("speculators", lambda: Eagle3Config(feature_layers=LAYERS, num_layers=2, norm_before_fc=True)),
    "speculators-peagle": ("speculators", lambda: PEagleConfig(feature_layers=LAYERS, num_depths=4, fc_norm=True)),
    "eagle3": ("eagle3", lambda: Eagle3Config(feature_layers=LAYERS)),
    "eagle3-deep": ("eagle3", lambda: Eagle3Config(feature_layers=LAYERS, num_layers=3, residual_between_layers=False)),
    "medusa": ("medusa", lambda: MedusaConfig(num_heads=3, num_layers=2)),
    "medusa-vllm": ("medusa-vllm", lambda: MedusaConfig(num_heads=2, num_layers=1)),
    "medusa2": ("medusa2", lambda: MedusaConfig(num_heads=2, num_layers=1)),
    "dflash": ("dflash", lambda: DFlashConfig(num_layers=2, block_size=6, feature_layers=[0, 2])),
    "speculators-dflash": ("speculators-dflash", lambda: DFlashConfig(num_layers=1, block_size=4, feature_layers=[0, 1],
                                                                      draft_vocab_size=1000)),
    "speculators-dflash2": ("speculators-dflash", lambda: DFlash2Config(**DFLASH2)),
    "hf": ("hf", lambda: DraftLMConfig(num_layers=2)),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, target, vocab):
    """fmt → (saved drafter folder, its export in fmt)."""
    root = tmp_path_factory.mktemp("import")
    out = {}
    for case, (fmt, make) in SOURCES.items():
        config = make()
        reduced = isinstance(config, Eagle3Config) or getattr(config, "draft_vocab_size", 0)
        module = config.build_module(target, vocab) if reduced else config.build_module(target)
        perturb(module)
        source, folder = str(root / f"{case}-source"), str(root / case)
        drafters.save(source, config, module, target)
        export(source, fmt, folder)
        out[case] = (source, folder)
    return out


def test_every_export_format_and_family_is_importable():
    from draftsmith.export import FORMATS

    assert set(IMPORTS) == set(FORMATS) - {"gguf", "eagle1"}  # GGUF: llama.cpp's own file; eagle1: refused on export
    held = {(fmt, family) for fmt in IMPORTS for family in FORMATS[fmt].families}
    cases = {(fmt, make().type) for fmt, make in SOURCES.values()}
    assert cases == held  # every family of every format goes through the identity below


@pytest.mark.parametrize("case", list(SOURCES))
def test_export_then_import_is_an_identity(tmp_path, target, exported, case):
    """Detected from its files, imported back: the same tensors, the same drafter config, the same proposals."""
    fmt = SOURCES[case][0]
    source, folder = exported[case]
    assert detect(folder) == fmt
    out = str(tmp_path / "imported")
    meta = import_drafter(folder, out, target)
    assert meta["imported"]["format"] == fmt and meta["target"]["fingerprint"] == target.fingerprint
    before = json.load(open(os.path.join(source, "config.json")))
    assert meta["drafter"] == before["drafter"] and meta["feature_layers"] == before["feature_layers"]
    ours, theirs = load_file(os.path.join(source, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    lines = compare_proposals(target, drafters.load(source, target), drafters.load(out, target), default_prompts(target))
    assert "max |Δq| = 0.0e+00" in lines[0]


def test_every_imported_drafter_decodes_trees_as_the_target_alone(tmp_path, target, exported):
    """An imported folder is an ordinary drafter for the tree decoder: each family's import, greedy fp32 with a dynamic
    tree (EAGLE-2's) and a static one (Medusa's kind), gives the target's own greedy output."""
    from draftsmith.decode.reference import target_greedy
    from draftsmith.decode.tree import DynamicTree, StaticTree, tree_decode

    prompt = default_prompts(target)[1]
    expected = target_greedy(target, prompt, 12)
    for case in SOURCES:
        out = str(tmp_path / case)
        import_drafter(exported[case][1], out, target)
        drafter = drafters.load(out, target)
        for shape in (DynamicTree(depth=3, top_k=2, budget=6), StaticTree.named_or_given([[0], [1], [0, 0]])):
            assert tree_decode(target, drafter, prompt, tree=shape, max_new_tokens=12).tokens == expected, (case, shape)


def test_an_imported_checkpoint_goes_through_eval_and_report(tmp_path, tiny_target_dir, target, foreign):
    """speculators' own checkpoint, imported, is a saved drafter to ``eval`` (with dynamic trees, fp32: every output
    identical to the target alone's) and to ``report`` (which measures chains)."""
    from draftsmith.config import load_recipe
    from draftsmith.eval.run import run_eval_recipe
    from draftsmith.report.run import run_report

    out = str(tmp_path / "imported")
    import_drafter(foreign, out, target)
    common = [f"target.name={tiny_target_dir}", "target.dtype=float32", "drafter.type=saved", f"drafter.path={out}",
              "eval.prompts=copyheavy", "eval.num_prompts=2", "eval.baselines=[]", "eval.repeats=1",
              "eval.check_identity=true", "decode.max_new_tokens=6"]
    metrics = run_eval_recipe(load_recipe("smollm2-135m-eagle3", [*common, "decode.tree=dynamic",
                                                                   f"run_dir={tmp_path / 'eval'}"]))
    assert metrics["identity"] == {"dtype": "float32", "identical": 2, "prompts": 2} and metrics["new_tokens"] == 12
    assert max(int(n) for n in metrics["tree_size_histogram"]) > metrics["k"]  # trees, wider than a chain
    report = run_report(load_recipe("smollm2-135m-eagle3", [
        *common, f"run_dir={tmp_path / 'report'}", "report.seeds=[]", "report.turns=1", "report.per_category=0"]))
    assert os.path.isfile(os.path.join(tmp_path, "report", "report", "report.json")) and report


def speculators_checkpoint(folder: str, target_dir: str, target, vocab, aux_ids: list[int], seed: int = 3,
                           depths: int = 0, layers: int = 1, **flags: bool) -> str:
    """A foreign checkpoint: speculators' own ``Eagle3DraftModel`` (with ``depths``: its ``PEagleDraftModel`` drafting
    that many tokens per forward, the last id of the vocabulary its mask token), built from its config class the way
    its ``from_training_args`` builds it (the verifier's config as the layer config with ``layers`` decoder layers,
    norm_before_residual on, and the norm ``flags`` given), weights moved off their init, written by its own
    ``save_pretrained``."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    layer = AutoConfig.from_pretrained(target_dir)
    layer.num_hidden_layers = layers
    layer._attn_implementation = "eager"
    config_class, model_class, extra = (PEagleSpeculatorConfig, PEagleDraftModel, {"mask_token_id": layer.vocab_size - 1}) \
        if depths else (Eagle3SpeculatorConfig, Eagle3DraftModel, {})
    config = config_class(
        transformer_layer_config=layer, draft_vocab_size=1000, **{"norm_before_residual": True, **flags},
        eagle_aux_hidden_state_layer_ids=aux_ids, **extra,
        speculators_config=SpeculatorsConfig(algorithm="peagle" if depths else "eagle3", proposal_methods=[
            GreedyTokenProposalConfig(speculative_tokens=depths or 3)], default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(target_dir)))
    torch.manual_seed(seed)
    model = model_class(config)
    d2t, t2d = vocab
    model.load_vocab_mappings(t2d, d2t)
    model.load_verifier_weights()  # the embedding and the lm_head rows of the draft vocabulary, from the verifier
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # what training moves (the lm_head too: speculators trains it unless told not to)
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens.", "verifier_")):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def foreign(tmp_path_factory, tiny_target_dir, target, vocab):
    return speculators_checkpoint(str(tmp_path_factory.mktemp("foreign") / "spec"), tiny_target_dir, target, vocab,
                                  aux_ids=[1, 2, 4])


@pytest.fixture(scope="module")
def foreign_deep(tmp_path_factory, tiny_target_dir, target, vocab):
    """speculators' own two-layer head (its second layer transformers' LlamaDecoderLayer)."""
    return speculators_checkpoint(str(tmp_path_factory.mktemp("foreign") / "deep"), tiny_target_dir, target, vocab,
                                  aux_ids=[1, 2, 4], layers=2)


def logits_gap(folder: str, drafter, target) -> float:
    """max |Δlogit| between the drafter's head unrolled 3 steps and speculators' Eagle3DraftModel loaded from ``folder``
    on the same hidden states, as a fraction of ``export --check``'s tolerance (≤ 1: equal)."""
    ids = default_prompts(target)[0]
    x = torch.tensor([ids])
    features = target.forward(x, feature_layers=tuple(drafter.feature_layers)).features
    theirs, _ = speculators_logits(folder, shift_left(x, 1), features, 3)
    with torch.no_grad():
        ours = [logits for _, logits in drafter.module.unroll(x, features, steps=3)]
    scale = max(1.0, max(float(a.abs().max()) for a in ours))
    assert len(theirs) == 3
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs)) / (LOGIT_TOLERANCE * scale)


def test_a_speculators_checkpoint_imports_with_its_own_classes_logits(tmp_path, target, foreign):
    from draftsmith.export.eagle3 import EAGLE3_SPECULATORS

    cfg = json.load(open(os.path.join(foreign, "config.json")))
    assert cfg["norm_before_residual"] is True
    assert {k: cfg[k] for k in EAGLE3_SPECULATORS} == EAGLE3_SPECULATORS  # what --to speculators names a head
    out = str(tmp_path / "imported")
    meta = import_drafter(foreign, out, target)
    assert meta["feature_layers"] == LAYERS and meta["drafter"]["norm_before_residual"] is True  # vLLM ids [1, 2, 4]
    drafter = drafters.load(out, target)
    assert logits_gap(foreign, drafter, target) <= 1
    drafter.module.midlayer.norm_before_residual = False  # the option is what makes it equal: without it, it is not
    assert logits_gap(foreign, drafter, target) > 100


def test_a_two_layer_speculators_checkpoint_imports_with_its_own_classes_logits(tmp_path, target, foreign_deep):
    """speculators' Eagle3DraftModel with two decoder layers: imported as a two-layer head whose second layer reads the
    first's whole output, with its class's logits over three unrolled steps; the same weights with SGLang's layer
    stack (the second layer reading the first's MLP output alone) are not equal."""
    meta = import_drafter(foreign_deep, str(tmp_path / "imported"), target)
    assert meta["drafter"]["num_layers"] == 2 and meta["drafter"]["residual_between_layers"] is True
    drafter = drafters.load(str(tmp_path / "imported"), target)
    assert logits_gap(foreign_deep, drafter, target) <= 1
    drafter.module.residual_between_layers = False
    assert logits_gap(foreign_deep, drafter, target) > 100


@pytest.mark.parametrize("checkpoint", ["foreign", "foreign_deep"])
def test_the_eagle3_layout_of_the_same_head_imports_with_the_same_logits(request, tmp_path, target, checkpoint):
    """The EAGLE-3 layout of that head: midlayer.*, no embedding, SGLang's ids in eagle_config (ours); a second layer
    stays under vLLM's name layers.1.* (what vLLM's LlamaForCausalLMEagle3 loads, and computes as speculators does)."""
    foreign = request.getfixturevalue(checkpoint)
    cfg = json.load(open(os.path.join(foreign, "config.json")))
    layout = {"architectures": ["LlamaForCausalLMEagle3"], **cfg["transformer_layer_config"],
              "draft_vocab_size": 1000, "target_hidden_size": 64, "norm_before_residual": True,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": LAYERS, "use_aux_hidden_state": True}}
    folder = tmp_path / "sglang"
    os.makedirs(folder)
    json.dump(layout, open(folder / "config.json", "w"))
    state = load_file(os.path.join(foreign, "model.safetensors"))
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in state.items() if k != "embed_tokens.weight"},
              str(folder / "model.safetensors"))
    out = str(tmp_path / "imported")
    meta = import_drafter(str(folder), out, target)
    assert meta["imported"]["format"] == "eagle3" and meta["feature_layers"] == LAYERS
    assert meta["drafter"]["num_layers"] == cfg["transformer_layer_config"]["num_hidden_layers"]
    assert meta["drafter"]["residual_between_layers"] is True
    assert logits_gap(foreign, drafters.load(out, target), target) <= 1


def test_a_speculators_export_naming_eagle3speculator_still_checks_and_imports(tmp_path, target, exported):
    """An export of an earlier draftsmith named the head Eagle3Speculator (speculators' config default, which its
    save_pretrained never writes): --check and import still take it; another name is refused by the check."""
    from draftsmith.export import check

    old = _copy(exported["speculators"][1], str(tmp_path / "old"), {"architectures": ["Eagle3Speculator"]})
    assert "architectures = ['Eagle3Speculator']" in check(old)
    meta = import_drafter(old, str(tmp_path / "imported"), target)
    assert meta["imported"]["format"] == "speculators"
    wrong = _copy(exported["speculators"][1], str(tmp_path / "wrong"), {"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(DraftsmithError, match=r"architectures = \['Eagle3DraftModel'\]"):
        check(wrong)


def sglang_eagle3_drafts(folder: str, target, ids: list[int], steps: int = 2) -> tuple[torch.Tensor, list[int]]:
    """SGLang's EAGLE-3 draft model on an eagle3-layout folder (its tensors, the target's embedding), written from
    ``python/sglang/srt/models/llama_eagle3.py`` at 03d5a777 (``LlamaForCausalLMEagle3``) in plain torch: the draft
    extend over ``ids`` (row t: the token ids[t + 1], the target's fused features of position t through ``fc``), then
    ``steps`` - 1 draft decode steps, each reading the previous step's pre-norm state (``hidden_states_to_aux``) and
    token and attending to the rows before it. A head of ``num_hidden_layers`` > 1 runs its ``additional_layers``
    after ``midlayer`` as ``BasicDecoderLayer.forward`` does: each takes the MLP output the layer before returned as its
    input and as its residual (the residual it is passed is dropped), ``hidden_norm`` its pre-attention norm, its own
    KV cache. Returns the extend's logits [S - 1, Vd] and the greedy drafts (target ids: ``hot_token_id = d2t +
    arange``)."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    w = load_file(os.path.join(folder, "model.safetensors"))
    eps, nh, nkv, d = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    layers = native_layer_ids(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], target.num_layers, "sglang")
    embed = target.model.get_input_embeddings().weight
    hot = w["d2t"] + torch.arange(w["d2t"].shape[0])

    def rms(x, name):  # RMSNorm
        return w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # [S, n, d] at positions [S] (neox style: rotate_half)
        inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angle = torch.cat([pos[:, None] * inv[None]] * 2, -1)[:, None]  # [S, 1, d]
        half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        return x * angle.cos() + half * angle.sin()

    caches: dict[str, tuple[list, list]] = {}  # per layer (its RadixAttention's layer_id): keys, values

    def attention(x, layer, pos):  # LlamaAttention: qkv_proj, RoPE, causal over the layer's cache, o_proj
        cache_k, cache_v = caches.setdefault(layer, ([], []))
        q = rope((x @ w[f"{layer}self_attn.q_proj.weight"].T).view(-1, nh, d), pos)
        cache_k.append(rope((x @ w[f"{layer}self_attn.k_proj.weight"].T).view(-1, nkv, d), pos))
        cache_v.append((x @ w[f"{layer}self_attn.v_proj.weight"].T).view(-1, nkv, d))
        k, v = (torch.cat(c).repeat_interleave(nh // nkv, dim=1) for c in (cache_k, cache_v))  # [T, nh, d]
        scores = torch.einsum("snd,tnd->nst", q, k) / d ** 0.5
        past = k.shape[0] - q.shape[0]
        scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(past + 1), float("-inf"))
        attn = torch.einsum("nst,tnd->snd", scores.softmax(-1), v).reshape(q.shape[0], nh * d)
        return attn @ w[f"{layer}self_attn.o_proj.weight"].T

    def mlp(residual, layer):  # post_attention_layernorm's normed output through LlamaMLP
        x = rms(residual, f"{layer}post_attention_layernorm.weight")
        return (torch.nn.functional.silu(x @ w[f"{layer}mlp.gate_proj.weight"].T) * (x @ w[f"{layer}mlp.up_proj.weight"].T)
                ) @ w[f"{layer}mlp.down_proj.weight"].T

    def model(embeds, hidden, pos):  # LlamaModel.forward of llama_eagle3.py
        x = torch.cat([rms(embeds, "midlayer.input_layernorm.weight"), rms(hidden, "midlayer.hidden_norm.weight")], -1)
        residual = attention(x, "midlayer.", pos) + hidden  # post_attention_layernorm(hidden_states, residual)
        out = mlp(residual, "midlayer.")  # LlamaDecoderLayer returns (mlp output, residual)
        for j in range(cfg["num_hidden_layers"] - 1):  # BasicDecoderLayer.forward(positions, out, …, residual)
            layer = f"additional_layers.{j}."
            residual = out  # residual = hidden_states: the residual passed in is not read
            residual = attention(rms(out, f"{layer}hidden_norm.weight"), layer, pos) + residual
            out = mlp(residual, layer)
        aux = out + residual  # norm(hidden_states, residual): the sum, then the norm
        return aux, rms(aux, "norm.weight") @ w["lm_head.weight"].T

    with torch.no_grad():
        feats = target.forward(torch.tensor([ids[:-1]]), feature_layers=tuple(layers)).features[0]  # [S - 1, 3H]
        n = feats.shape[0]
        aux, logits = model(embed[ids[1:]], feats @ w["fc.weight"].T, torch.arange(n, dtype=torch.float32))
        extend, drafts = logits, [int(hot[logits[-1].argmax()])]
        for step in range(1, steps):
            aux, logits = model(embed[drafts[-1:]], aux[-1:], torch.tensor([n - 1.0 + step]))
            drafts.append(int(hot[logits[-1].argmax()]))
    return extend, drafts


@pytest.mark.parametrize("case", ["eagle3", "eagle3-deep"])
def test_the_eagle3_layout_computes_what_sglangs_forward_computes(tmp_path, target, exported, case):
    """The eagle3-layout head, imported, against SGLang's own draft model on the same folder (a reference forward
    written from its code): the draft extend's logits over a prompt and the drafts of two chain steps, which the
    runtime proposes; the same head on the features one layer up is not equal. A three-layer head (SGLang's
    additional_layers) is imported with SGLang's layer stack, and the same weights with the residual stream carried
    between the layers (speculators' and vLLM's stack) are not equal."""
    from draftsmith.decode.sampling import Warp

    folder = exported[case][1]
    out = str(tmp_path / "imported")
    meta = import_drafter(folder, out, target)
    drafter = drafters.load(out, target)
    prompt = default_prompts(target)[0]
    with torch.no_grad():
        out_t = target.forward(torch.tensor([prompt]), feature_layers=tuple(drafter.feature_layers))
    ids = prompt + [int(out_t.logits[0, -1].argmax())]  # the prefill commits the target's first token
    theirs, their_drafts = sglang_eagle3_drafts(folder, target, ids, steps=3)

    def gap() -> float:
        with torch.no_grad():
            _, ours = drafter.module(torch.tensor([ids[1:]]), out_t.features)
        return float((ours[0] - theirs).abs().max()) / (LOGIT_TOLERANCE * max(1.0, float(theirs.abs().max())))

    assert gap() <= 1
    drafter.reset()
    drafter.update(torch.tensor(ids), out_t.features[0])
    assert drafter.propose(3, Warp(), None).tokens.tolist() == their_drafts
    shifted = [min(i + 1, target.num_layers - 1) for i in drafter.feature_layers]  # the features one layer up
    with torch.no_grad():
        _, off = drafter.module(torch.tensor([ids[1:]]), target.forward(torch.tensor([prompt]),
                                                                         feature_layers=tuple(shifted)).features)
    assert float((off[0] - theirs).abs().max()) > 100 * LOGIT_TOLERANCE
    if case == "eagle3-deep":
        assert meta["drafter"]["num_layers"] == 3 and meta["drafter"]["residual_between_layers"] is False
        drafter.module.residual_between_layers = True
        assert gap() > 100


def zlab_dflash_block(folder: str, target, ids: list[int]) -> torch.Tensor:
    """z-lab's DFlashDraftModel on a z-lab folder (its tensors; the target's embedding and lm_head, as its
    ``dflash_generate`` passes them: the raw embedding rows × ``input_embedding_scale``), written from z-lab/dflash
    ``dflash/model.py`` in plain torch: the first block after the prefill of ``ids[:-1]`` — context = the target's ``hidden_states[id + 1]`` of every prompt position
    through ``hidden_norm(fc(·))``, the block = [ids[-1], mask × (Bs − 1)] at the positions after them, each layer's
    queries from the block, keys/values from [context ; block] (q/k norms, RoPE, no mask: its attention is not causal
    on full-attention layers), the final norm and the target's lm_head. Returns the logits of the Bs − 1 masked rows
    (``[:, 1 - verify_size:]``)."""
    from transformers.activations import ACT2FN

    cfg = json.load(open(os.path.join(folder, "config.json")))
    w = load_file(os.path.join(folder, "model.safetensors"))
    eps, nh, nkv, d = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    draft = cfg["dflash_config"]
    bs, theta = draft["block_size"], (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))

    def rms(x, weight):  # Qwen3RMSNorm
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    act = ACT2FN[cfg["hidden_act"]]  # Qwen3MLP's
    with torch.no_grad():
        prompt = torch.tensor([ids[:-1]])
        ctx = target.forward(prompt, feature_layers=tuple(draft["target_layer_ids"])).features[0]  # [n, L·H]
        ctx = rms(ctx @ w["fc.weight"].T, w["hidden_norm.weight"])
        n = ctx.shape[0]
        h = target.model.get_input_embeddings().weight[[ids[-1]] + [draft["mask_token_id"]] * (bs - 1)]  # raw rows
        h = h * float(draft.get("input_embedding_scale", cfg.get("input_embedding_scale", 1.0)))  # _draft_value
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angle = torch.cat([torch.arange(n + bs, dtype=torch.float32)[:, None] * inv] * 2, -1)[:, None]  # [n+Bs, 1, d]
        rope = lambda x, a: x * a.cos() + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * a.sin()  # noqa: E731
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            residual, x = h, rms(h, w[p + "input_layernorm.weight"])
            q = rms((x @ w[p + "self_attn.q_proj.weight"].T).view(bs, nh, d), w[p + "self_attn.q_norm.weight"])
            k = torch.cat([ctx, x]) @ w[p + "self_attn.k_proj.weight"].T
            k = rms(k.view(n + bs, nkv, d), w[p + "self_attn.k_norm.weight"])
            v = (torch.cat([ctx, x]) @ w[p + "self_attn.v_proj.weight"].T).view(n + bs, nkv, d)
            q, k = rope(q, angle[-bs:]), rope(k, angle)  # the queries take the last q_len positions
            k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
            attn = torch.einsum("snd,tnd->nst", q, k).mul(d ** -0.5).softmax(-1)
            h = residual + torch.einsum("nst,tnd->snd", attn, v).reshape(bs, nh * d) @ w[p + "self_attn.o_proj.weight"].T
            residual, x = h, rms(h, w[p + "post_attention_layernorm.weight"])
            h = residual + (act(x @ w[p + "mlp.gate_proj.weight"].T)
                            * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return rms(h, w["norm.weight"])[1:] @ target.model.get_output_embeddings().weight.T  # [Bs - 1, V]


def test_the_zlab_dflash_layout_computes_what_zlabs_forward_computes(tmp_path, target, exported):
    """The z-lab-layout drafter, imported, against z-lab's own DFlashDraftModel on the same folder (a reference forward
    written from its code): the first block's logits after a prompt, and the drafts the runtime proposes are its
    argmax; the same drafter on the features one layer up is not equal."""
    from draftsmith.decode.sampling import Warp

    folder = exported["dflash"][1]
    out = str(tmp_path / "imported")
    import_drafter(folder, out, target)
    drafter = drafters.load(out, target)
    m = drafter.module
    prompt = default_prompts(target)[0]
    with torch.no_grad():
        out_t = target.forward(torch.tensor([prompt]), feature_layers=tuple(m.feature_layers))
    ids = prompt + [int(out_t.logits[0, -1].argmax())]  # the prefill commits the target's first token
    theirs = zlab_dflash_block(folder, target, ids)

    def ours(features):
        n, positions = len(prompt), torch.arange(len(prompt) + m.block_size)[None]
        block = torch.tensor([[ids[-1]] + [m.mask_token_id] * (m.block_size - 1)])
        with torch.no_grad():
            return m.lm_head(m(block, positions[:, n:], m.context(features, positions[:, :n]))[0])[1:]  # [Bs - 1, V]

    scale = max(1.0, float(theirs.abs().max()))
    assert float((ours(out_t.features) - theirs).abs().max()) <= LOGIT_TOLERANCE * scale
    drafter.reset()
    drafter.update(torch.tensor(ids), out_t.features[0])
    assert drafter.propose(m.block_size - 1, Warp(), None).tokens.tolist() == theirs.argmax(-1).tolist()
    shifted = [min(i + 1, target.num_layers - 1) for i in m.feature_layers]
    with torch.no_grad():
        off = ours(target.forward(torch.tensor([prompt]), feature_layers=tuple(shifted)).features)
    assert float((off - theirs).abs().max()) > 100 * LOGIT_TOLERANCE * scale


def test_a_gemma_targets_zlab_export_carries_its_embedding_scale(tmp_path, smollm2_tokenizer):
    """Gemma's embedding module scales its rows by √H, which draftsmith's drafter reads as the target's embedding; z-lab's
    code reads the raw rows × input_embedding_scale: the export writes it, z-lab's forward then computes the drafter's
    logits, and the import takes it back; a folder without it (× 1) is refused in one line."""
    from draftsmith.export.dflash import embedding_scale

    from .test_architectures import tiny_gemma3

    folder = str(tmp_path / "gemma3")
    tiny_gemma3().save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    gemma = load_target(folder, "float32", "cpu")
    assert embedding_scale(gemma) == pytest.approx(32 ** 0.5)
    config = DFlashConfig(num_layers=1, block_size=4, feature_layers=[0, 2])
    module = config.build_module(gemma)
    perturb(module)
    source, zlab = str(tmp_path / "drafter"), str(tmp_path / "zlab")
    drafters.save(source, config, module, gemma)
    export(source, "dflash", zlab)
    cfg = json.load(open(os.path.join(zlab, "config.json")))
    assert cfg["dflash_config"]["input_embedding_scale"] == embedding_scale(gemma)
    m = drafters.load(source, gemma).module
    prompt = torch.randint(100, 2000, (12,), generator=torch.Generator().manual_seed(0)).tolist()  # its 2,048 ids
    with torch.no_grad():
        out = gemma.forward(torch.tensor([prompt]), feature_layers=tuple(m.feature_layers))
        ids = prompt + [int(out.logits[0, -1].argmax())]
        n, positions = len(prompt), torch.arange(len(prompt) + m.block_size)[None]
        block = torch.tensor([[ids[-1]] + [m.mask_token_id] * (m.block_size - 1)])
        ours = m.lm_head(m(block, positions[:, n:], m.context(out.features, positions[:, :n]))[0])[1:]
    theirs = zlab_dflash_block(zlab, gemma, ids)
    assert float((ours - theirs).abs().max()) <= LOGIT_TOLERANCE * max(1.0, float(theirs.abs().max()))
    # no layer check: its chat prompts hold tokenizer ids past the tiny model's 2,048 rows
    assert import_drafter(zlab, str(tmp_path / "imported"), gemma, check_ids=False)["drafter"]["type"] == "dflash"
    del cfg["dflash_config"]["input_embedding_scale"]
    json.dump(cfg, open(os.path.join(zlab, "config.json"), "w"))
    with pytest.raises(DraftsmithError, match=r"input_embedding_scale 1 .* the target embedding's own 5.65685") as e:
        import_drafter(zlab, str(tmp_path / "unscaled"), gemma)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def foreign_peagle(tmp_path_factory, tiny_target_dir, target, vocab):
    return speculators_checkpoint(str(tmp_path_factory.mktemp("foreign") / "peagle"), tiny_target_dir, target, vocab,
                                  aux_ids=[1, 2, 4], depths=4)


def dflash2_checkpoint(folder: str, target_dir: str, seed: int = 3) -> str:
    """A foreign DFlash2: speculators' own ``DFlash2DraftModel`` on a Qwen3 layer config of the verifier's dimensions
    (the reference's layer family), the last id of the vocabulary its mask token, weights moved off their init (the
    convolutions' and the selector's too), written by its own ``save_pretrained``."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, Qwen3Config

    v = AutoConfig.from_pretrained(target_dir)
    layer = Qwen3Config(vocab_size=v.vocab_size, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                        num_attention_heads=v.num_attention_heads, num_key_value_heads=v.num_key_value_heads,
                        head_dim=v.hidden_size // v.num_attention_heads, num_hidden_layers=DFLASH2["num_layers"],
                        rms_norm_eps=v.rms_norm_eps, max_position_embeddings=v.max_position_embeddings,
                        rope_parameters=v.rope_parameters, tie_word_embeddings=False)
    layer._attn_implementation = "eager"
    bs = DFLASH2["block_size"]
    config = DFlash2SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=v.vocab_size, block_size=bs,
        aux_hidden_state_layer_ids=[i + 1 for i in DFLASH2["feature_layers"]], mask_token_id=v.vocab_size - 1,
        conv_kernel_size=2, **{k: DFLASH2[k] for k in ("conv_group_size", "selector_rank", "selector_top_k")},
        speculators_config=SpeculatorsConfig(algorithm="dflash2", proposal_methods=[GreedyTokenProposalConfig(
            speculative_tokens=bs - 1)], default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(target_dir)))
    torch.manual_seed(seed)
    model = DFlash2DraftModel(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens.", "lm_head.", "verifier_")):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def foreign_dflash2(tmp_path_factory, tiny_target_dir):
    return dflash2_checkpoint(str(tmp_path_factory.mktemp("foreign") / "dflash2"), tiny_target_dir)


def test_a_speculators_peagle_checkpoint_imports_with_its_own_classes_logits(tmp_path, target, foreign_peagle):
    """speculators' PEagleDraftModel and the imported head, its training forward (its own COD draw) on the same hidden
    states; the learned mask hidden state is what makes the masked rows equal."""
    from draftsmith.export.run import compare_speculators

    out = str(tmp_path / "imported")
    meta = import_drafter(foreign_peagle, out, target)
    assert meta["imported"]["format"] == "speculators" and meta["feature_layers"] == LAYERS  # vLLM ids [1, 2, 4]
    spec = meta["drafter"]
    assert (spec["type"], spec["num_depths"], spec["mask_token_id"], spec["norm_before_residual"]) == (
        "peagle", 4, target.vocab_size - 1, True)
    drafter = drafters.load(out, target)
    ids = default_prompts(target)[0]
    assert "= draftsmith's logits" in compare_speculators(foreign_peagle, target, drafter, ids)[-1]
    with torch.no_grad():
        drafter.module.mask_hidden.add_(1.0)
    with pytest.raises(DraftsmithError, match="speculators' logits differ"):
        compare_speculators(foreign_peagle, target, drafter, ids)


def test_a_speculators_dflash2_checkpoint_imports_with_its_own_classes_logits(tmp_path, target, foreign_dflash2):
    """speculators' DFlash2DraftModel and the imported drafter, the same block on the same target hidden states: the
    logits and the selector's scores; its convolutions are what make them equal."""
    from types import SimpleNamespace

    from draftsmith.export.dflash import compare_reference

    out = str(tmp_path / "imported")
    meta = import_drafter(foreign_dflash2, out, target)
    assert meta["imported"]["format"] == "speculators-dflash" and meta["feature_layers"] == DFLASH2["feature_layers"]
    assert {k: meta["drafter"][k] for k in DFLASH2} == DFLASH2 and meta["drafter"]["type"] == "dflash2"
    drafter = drafters.load(out, target)
    ids = default_prompts(target)[0]
    lines = compare_reference(foreign_dflash2, "speculators-dflash", target, SimpleNamespace(drafter=drafter), ids)
    assert "= draftsmith's logits and selector scores" in lines[-1]
    with torch.no_grad():
        drafter.module.layers[0].attention_conv.base_kernel.add_(0.5)
    with pytest.raises(DraftsmithError, match="(differ from|picks other candidates than) draftsmith's drafter"):
        compare_reference(foreign_dflash2, "speculators-dflash", target, SimpleNamespace(drafter=drafter), ids)


def _copy(src: str, dst: str, config: dict | None = None, tensors=None) -> str:
    os.makedirs(dst)
    for name in os.listdir(src):
        if name.endswith(".json") and name != "config.json":
            json.dump(json.load(open(os.path.join(src, name))), open(os.path.join(dst, name), "w"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.update(config or {})
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            state = load_file(os.path.join(src, name))
            save_file(tensors(state) if tensors else state, os.path.join(dst, name))
    return dst


@pytest.fixture(scope="module")
def other_target(tmp_path_factory, smollm2_tokenizer):
    """Another tiny target of the same shape and tokenizer (other weights: another fingerprint)."""
    from .conftest import tiny_llama

    path = str(tmp_path_factory.mktemp("other_target"))
    tiny_llama(layers=4, seed=7).save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return load_target(path, "float32", "cpu")


def _dflash_config(folder: str, **change) -> dict:
    """The change of a z-lab config.json that sets ``change`` in its dflash_config."""
    return {"dflash_config": {**json.load(open(os.path.join(folder, "config.json")))["dflash_config"], **change}}


def _layer_config(folder: str, **change) -> dict:
    """The change of a speculators config.json that sets ``change`` in its transformer_layer_config."""
    return {"transformer_layer_config": {**json.load(open(os.path.join(folder, "config.json")))["transformer_layer_config"],
                                         **change}}


def test_a_checkpoint_for_another_target_is_refused_in_one_line(tmp_path, target, other_target, exported, foreign,
                                                                foreign_peagle, foreign_dflash2):
    spec = exported["speculators"][1]
    other_embedding = lambda s: {**s, "embed_tokens.weight": s["embed_tokens.weight"] + 0.5}  # noqa: E731
    d2, sg, zl, deep = foreign_dflash2, exported["eagle3"][1], exported["dflash"][1], exported["eagle3-deep"][1]
    cases = {  # name: (folder, target, config changes, tensor changes, message)
        "fingerprint": (spec, other_target, None, None, "exported for target fingerprint .* pass that one with --target"),
        "embedding": (foreign, target, None, other_embedding, "is not .*'s: it was trained for another target"),
        "vocabulary": (foreign, target, _layer_config(foreign, vocab_size=32000), None, "vocabulary 32000"),
        "hidden": (foreign, target, {"target_hidden_size": 32}, None, "hidden size 32"),
        "layers": (foreign, target, {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}, None, "names no decoder output"),
        "medusa": (exported["medusa"][1], other_target, None, None, "exported for target fingerprint"),
        "peagle-fingerprint": (exported["speculators-peagle"][1], other_target, None, None, "exported for target fingerprint"),
        "peagle-embedding": (foreign_peagle, target, None, other_embedding, "trained for another target"),
        "peagle-vocabulary": (foreign_peagle, target, _layer_config(foreign_peagle, vocab_size=32000), None,
                              "vocabulary 32000"),
        "peagle-layers": (foreign_peagle, target, {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}, None,
                          "names no decoder output"),
        "dflash2-fingerprint": (exported["speculators-dflash2"][1], other_target, None, None, "exported for target "
                                                                                               "fingerprint"),
        "dflash2-hidden": (d2, target, _layer_config(d2, hidden_size=32), None, "hidden_size 32 .* another target"),
        "dflash2-vocabulary": (d2, target, {**_layer_config(d2, vocab_size=32000), "draft_vocab_size": 32000}, None,
                               "vocab_size 32000 .* another target"),
        "dflash2-layers": (d2, target, {"aux_hidden_state_layer_ids": [1, 9]}, None, "layer id 9 names no decoder output"),
        # the layouts whose foreign checkpoints are read by a reference forward above (SGLang's, z-lab's) and Medusa's
        "eagle3-vocabulary": (sg, target, {"vocab_size": 32000}, None, "vocabulary 32000"),
        "eagle3-hidden": (sg, target, {"target_hidden_size": 32}, None, "hidden size 32"),
        "eagle3-layers": (sg, target, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9],
                                                        "use_aux_hidden_state": True}}, None, "sglang layer id 9 names no decoder"),
        "eagle3-rope": (sg, target, {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
                        None, "rope_theta 500000.0 is not the 10000.0"),
        # SpecForge's unmerged multi-layer branch names its first layer fuse_layer.*, which SGLang does not load either
        "eagle3-fuse-layer": (sg, target, None, lambda st: {k.replace("midlayer.", "fuse_layer."): v for k, v in st.items()},
                              "has no rule for the eagle3 tensor 'fuse_layer"),
        "eagle3-both-stacks": (deep, target, None, lambda st: {**st, **{k.replace("additional_layers.0.", "layers.1."): v.clone()
                                                                         for k, v in st.items()}},
                               "under both SGLang's names .* and vLLM's"),
        "dflash-vocabulary": (zl, target, {"vocab_size": 32000}, None, "vocab_size 32000 .* another target"),
        "dflash-layers": (zl, target, _dflash_config(zl, target_layer_ids=[0, 9]), None, "layer id 9 names no decoder"),
        "dflash-rope": (zl, target, {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
                        None, "rope_theta 500000.0 is not the 10000.0"),
        "dflash-eps": (zl, target, {"rms_norm_eps": 1e-3}, None, r"rms_norm_eps \(0.001 vs 1e-06\)"),
        "dflash-embedding-scale": (zl, target, _dflash_config(zl, input_embedding_scale=8.0), None,
                                   "input_embedding_scale 8 .* the target embedding's own 1"),
        "dflash-softcap": (zl, target, {"final_logit_softcapping": 30.0}, None, "no output_multiplier or final_logit"),
        "dflash-causal": (zl, target, _dflash_config(zl, is_causal=True), None, "no is_causal"),
        "dflash-sliding": (zl, target, {"layer_types": ["sliding_attention", "full_attention"]}, None,
                           "no sliding_attention layer_types"),
        "medusa-vocabulary": (exported["medusa"][1], target, {"vocab_size": 32000}, None, "64 / 32000 are not the "
                                                                                         "target's 64 / 49152"),
    }
    for name, (src, tgt, config, tensors, match) in cases.items():
        folder = _copy(src, str(tmp_path / name), config, tensors) if (config or tensors) else src
        if name == "medusa":
            folder = src
        with pytest.raises(DraftsmithError, match=match) as e:
            import_drafter(folder, str(tmp_path / f"{name}-out"), tgt)
        assert "\n" not in str(e.value) and not os.path.exists(tmp_path / f"{name}-out"), name


class _LayerBoundHead(torch.nn.Module):
    """A stand-in for a trained head that drafts the target's next prediction exactly from the features of the layers it
    was trained on and wrongly from any others (on the tiny random target every layer set drafts alike: its predictions
    follow the token embedding, so a fitted head cannot show the effect)."""

    def __init__(self, target, layers: list[int]):
        super().__init__()
        self.vocab = target.vocab_size
        self.draft_ids = torch.arange(self.vocab)
        self.known = {}
        with torch.no_grad():
            for ids in default_prompts(target):
                out = target.forward(torch.tensor([ids]), feature_layers=tuple(layers))
                self.known[len(ids)] = (out.features, out.logits[0, 1:].argmax(-1))

    def forward(self, input_ids, features):
        feats, want = self.known[features.shape[1]]
        right = torch.equal(feats, features)
        logits = torch.zeros(1, features.shape[1], self.vocab)
        logits[0, torch.arange(len(want)), want if right else (want + 1) % self.vocab] = 1.0
        return None, logits


def test_a_head_whose_layer_ids_are_shifted_is_refused(target):
    """A head trained on our layers [0, 1, 2]: named so, it is taken; named [1, 2, 3] (its vLLM ids [1, 2, 3] read as
    ours, as an import that skipped the convention would), it is refused in one line naming the layers it fits."""
    from types import SimpleNamespace

    from draftsmith.export.importer import check_layers

    head = _LayerBoundHead(target, [0, 1, 2])
    lines = check_layers(SimpleNamespace(module=head, feature_layers=(0, 1, 2)), target, "head")
    assert lines == ["feature layers [0, 1, 2]: first drafts 100% right, [1, 2, 3] 0%"]
    with pytest.raises(DraftsmithError, match=r"feature layers look shifted: it drafts .* at 0% from the layers it names "
                                              r"\(ours \[1, 2, 3\]\) and at 100% from \[0, 1, 2\]") as e:
        check_layers(SimpleNamespace(module=head, feature_layers=(1, 2, 3)), target, "head")
    assert "\n" not in str(e.value)


class _LayerBoundBlocks(torch.nn.Module):
    """The DFlash stand-in of :class:`_LayerBoundHead`: the block anchored at every position drafts the target's next
    prediction at its first masked position exactly from the features of the layers it was trained on, and wrongly
    from any others (hidden rows are one-hot over the vocabulary; its lm_head passes them through)."""

    draft_ids = None  # the full vocabulary

    def __init__(self, target, layers: list[int]):
        super().__init__()
        self.vocab, self.block_size = target.vocab_size, 4
        self.lm_head = torch.nn.Identity()
        self.known = {}
        with torch.no_grad():
            for ids in default_prompts(target):
                out = target.forward(torch.tensor([ids]), feature_layers=tuple(layers))
                self.known[len(ids)] = (out.features, out.logits[0, 1:].argmax(-1))

    def train_blocks(self, input_ids, features, anchors):
        feats, want = self.known[features.shape[1]]
        assert torch.equal(anchors[0], torch.arange(1, features.shape[1]))  # a block at every position with context
        hidden = torch.zeros(1, anchors.shape[1], self.block_size, self.vocab)  # [B, N, Bs, V]
        hidden[0, torch.arange(len(want)), 1, want if torch.equal(feats, features) else (want + 1) % self.vocab] = 1.0
        return hidden


def test_a_dflash_drafter_whose_layer_ids_are_shifted_is_refused(target):
    """As for EAGLE-3: a DFlash drafter trained on our layers [0, 2] is taken named so; named [1, 3] (speculators' ids,
    input-of-layer, read as z-lab's output-of-layer ones) it is refused in one line naming the layers it fits."""
    from types import SimpleNamespace

    from draftsmith.export.importer import check_layers

    blocks = _LayerBoundBlocks(target, [0, 2])
    lines = check_layers(SimpleNamespace(module=blocks, feature_layers=(0, 2)), target, "dflash")
    assert lines == ["feature layers [0, 2]: first drafts 100% right, [1, 3] 0%"]
    with pytest.raises(DraftsmithError, match=r"feature layers look shifted: it drafts .* at 0% from the layers it names "
                                              r"\(ours \[1, 3\]\) and at 100% from \[0, 2\]") as e:
        check_layers(SimpleNamespace(module=blocks, feature_layers=(1, 3)), target, "dflash")
    assert "\n" not in str(e.value)


def test_every_drafter_of_named_layers_is_probed_on_import_and_the_flag_skips_it(tmp_path, target, exported,
                                                                                monkeypatch):
    """The import runs the layer check on the drafter it builds (the real module, its named layers) for every format
    that holds one reading named target layers, and on no other; --no-layer-check skips it."""
    import draftsmith.export.importer as importer

    probed = []
    check = importer.check_layers
    monkeypatch.setattr(importer, "check_layers", lambda d, t, w: probed.append((w, list(d.feature_layers))) or check(d, t, w))
    for case in SOURCES:
        import_drafter(exported[case][1], str(tmp_path / case), target)
    names = {case for case in SOURCES if SOURCES[case][1]().type in ("eagle3", "peagle", "dflash", "dflash2")}
    assert {w for w, _ in probed} == {exported[case][1] for case in names}
    assert {"dflash", "speculators-dflash", "speculators-dflash2"} <= names
    assert (exported["dflash"][1], [0, 2]) in probed
    probed.clear()
    import_drafter(exported["dflash"][1], str(tmp_path / "unchecked"), target, check_ids=False)
    assert probed == []


@pytest.mark.parametrize("files", [("config.json", "pytorch_model.bin"), ("config.json", "medusa_lm_head.pt"),
                                   ("model.pth",)])
def test_a_folder_of_pickled_weights_is_refused_in_one_line_naming_them(tmp_path, target, files):
    """The EAGLE authors publish pytorch_model.bin and early Medusa heads medusa_lm_head.pt: refused before anything is
    read, detected or with --from, naming the file and the conversion (a pickle can run code; safetensors cannot)."""
    folder = tmp_path / "pickled"
    folder.mkdir()
    for name in files:
        if name == "config.json":
            (folder / name).write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 1000}))
        else:
            torch.save({"w": torch.zeros(2)}, folder / name)
    pickled = next(name for name in files if name != "config.json")
    for fmt in (None, "eagle3"):
        with pytest.raises(DraftsmithError, match=rf"holds its weights pickled \({re.escape(pickled)}\) and no "
                                                  rf"\.safetensors: .*weights_only=True") as e:
            import_drafter(str(folder), str(tmp_path / "out"), target, fmt=fmt)
        assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "out")


def test_cli_import_detects_the_format_and_writes_a_drafter(tmp_path, tiny_target_dir, target, exported, capsys):
    out = tmp_path / "imported"
    assert main(["import", exported["medusa"][1], "--out", str(out), "--target", tiny_target_dir]) == 0
    assert "a medusa drafter imported from medusa" in capsys.readouterr().out
    assert drafters.load(str(out), target).module.num_heads == 3
    assert main(["import", exported["medusa"][1], "--out", str(out), "--target", tiny_target_dir]) == 2
    assert "exists and is not empty; pass --force" in capsys.readouterr().err
    assert main(["import", str(tmp_path), "--out", str(tmp_path / "x"), "--target", tiny_target_dir]) == 2
    assert "has no config.json" in capsys.readouterr().err
