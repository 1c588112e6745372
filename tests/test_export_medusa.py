"""Medusa checkpoints as the Medusa code writes them, built in the test from its published classes: a Medusa-2
model (a tiny random Llama, its ``medusa_head`` of ``[ResBlock] * L`` blocks, save_pretrained in shards, the blocks'
aliases dropped as transformers 4.x drops them) imports with the logits of Medusa's own forward, decodes against its
own backbone exactly as the backbone alone does (fp32 greedy), exports back, and is refused in one line with any
other target, blocks that differ, or a missing or misshapen head tensor; the same heads as a Medusa-1 checkpoint of
the Medusa code's training (``medusa_lm_head.safetensors`` and a config that names no dimension) import with the
same logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from draftsmith import drafters
from draftsmith.cli import main
from draftsmith.decode.reference import target_greedy
from draftsmith.decode.rounds import speculative_decode
from draftsmith.decode.sampling import Warp
from draftsmith.drafters import MedusaConfig
from draftsmith.errors import DraftsmithError
from draftsmith.export import check, export, import_drafter
from draftsmith.export.importer import detect
from draftsmith.export.run import default_prompts
from draftsmith.target import load_target, load_target_files

from .conftest import tiny_llama
from .test_export import perturb, target  # noqa: F401  (the tiny target: another backbone)

pytestmark = pytest.mark.usefixtures("one_thread")

HEADS = 3


class ResBlock(nn.Module):
    """FasterDecoding/Medusa ``medusa/model/medusa_model.py`` (and the axolotl fork's ``medusa_utils.py``), as
    published: x + SiLU(Linear(x)), the weight starting at zero."""

    def __init__(self, hidden_size):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        torch.nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def medusa_model(layers: int, seed: int = 5) -> nn.Module:
    """A Medusa-2 model as the axolotl fork's ``add_medusa_heads`` makes one (``medusa_head`` of ``[ResBlock] *
    layers`` blocks and a projection starting at the lm_head, Medusa's two config keys) on a tiny random Llama with
    peaked distributions, then moved as Medusa-2 training moves it: the heads and the backbone together."""
    model = tiny_llama(layers=4, seed=seed)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    model.config.medusa_num_heads, model.config.medusa_num_layers = HEADS, layers
    model.medusa_head = nn.ModuleList(
        [nn.Sequential(*([ResBlock(hidden)] * layers), nn.Linear(hidden, vocab, bias=False)) for _ in range(HEADS)])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("medusa_head."):
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
        model.model.norm.weight.mul_(10.0)
        for head in model.medusa_head:
            head[-1].weight.copy_(model.lm_head.weight)
            for p in head.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.002)
    return model.eval()


def medusa_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Medusa's forward with ``medusa_forward=True`` (``MedusaModelABC.forward``): every head on the backbone's
    ``self.model(...)[0]``, stacked → [K, B, S, V]."""
    with torch.inference_mode():
        outputs = model.model(input_ids=input_ids)
    hidden_states = outputs[0].clone()
    return torch.stack([model.medusa_head[i](hidden_states) for i in range(model.config.medusa_num_heads)])


def save_medusa2(model: nn.Module, folder: str, tokenizer, state: dict | None = None) -> str:
    """``save_pretrained`` in shards, as the training run saves the model; the tensors a head's repeated block shares
    are stored under one name, the last in sorted order, as transformers 4.x keeps them (5.x refuses to save them)."""
    state = dict(model.state_dict()) if state is None else state
    shared: dict[int, list[str]] = {}
    for name, t in state.items():
        if name.startswith("medusa_head."):
            shared.setdefault(t.data_ptr(), []).append(name)
    for names in shared.values():
        for name in sorted(names)[:-1]:
            del state[name]
    model.save_pretrained(folder, state_dict=state, max_shard_size="5MB")
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=[1, 2, 0], ids=["1-block", "2-shared-blocks", "projection-only"])
def checkpoint(request, tmp_path_factory, smollm2_tokenizer):
    """(the Medusa-2 model, its folder): one residual block (the released models'), two (one block applied twice,
    stored under one name), none (axolotl's default)."""
    model = medusa_model(request.param)
    folder = save_medusa2(model, str(tmp_path_factory.mktemp("medusa2") / "ckpt"), smollm2_tokenizer)
    return model, folder


@pytest.fixture(scope="module")
def backbone(checkpoint):
    return load_target(checkpoint[1], "float32", "cpu")


def test_a_medusa2_checkpoint_imports_with_the_medusa_codes_logits(tmp_path, checkpoint, backbone, capsys):
    model, folder = checkpoint
    layers = model.config.medusa_num_layers
    files = os.listdir(folder)
    assert "model.safetensors.index.json" in files and not any(f.endswith(".bin") for f in files)
    assert detect(folder) == "medusa2"
    out = str(tmp_path / "imported")
    assert main(["import", folder, "--out", out, "--target", folder]) == 0  # the checkpoint is its own target
    assert "a medusa drafter imported from medusa2" in capsys.readouterr().out
    meta = json.load(open(os.path.join(out, "config.json")))
    assert (meta["drafter"]["num_heads"], meta["drafter"]["num_layers"]) == (HEADS, layers)
    assert meta["target"]["fingerprint"] == backbone.fingerprint == meta["imported"]["backbone_fingerprint"]
    assert load_target_files(folder).fingerprint == backbone.fingerprint  # from the files: the heads are not hashed
    drafter = drafters.load(out, backbone)
    x = torch.tensor([default_prompts(backbone)[0]])
    features = backbone.forward(x, feature_layers=drafter.feature_layers).features  # [1, S, H], pre-norm
    with torch.no_grad():
        ours = drafter.module(features)  # [K, 1, S, V]
        theirs = medusa_logits(model, x)
    assert ours.shape == theirs.shape == (HEADS, 1, x.shape[1], backbone.vocab_size)
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())  # fp32: other summation orders
    assert not torch.equal(theirs[0].argmax(-1), theirs[1].argmax(-1))  # the heads differ: a swap would show
    # the decoder's drafter after the prefill drafts Medusa's top-1 candidates (generate_candidates: head i's argmax at
    # the prompt's last position), from the last feature it was handed
    drafter.reset()
    drafter.update(torch.cat([x[0], torch.tensor([7])]), features[0])
    assert drafter.propose(HEADS, Warp(), None).tokens.tolist() == theirs[:, 0, -1].argmax(-1).tolist()


def test_greedy_decoding_with_the_imported_heads_is_the_backbones_own(tmp_path, checkpoint, backbone):
    """fp32 greedy against the checkpoint's own backbone: token for token its own greedy output, with drafts
    accepted (head 0 starts at the backbone's lm_head, as Medusa's training starts it)."""
    out = str(tmp_path / "imported")
    import_drafter(checkpoint[1], out, backbone)
    drafter = drafters.load(out, backbone)
    accepted = 0
    for ids in default_prompts(backbone):
        res = speculative_decode(backbone, drafter, ids, k=HEADS, max_new_tokens=24)
        assert res.tokens == target_greedy(backbone, ids, 24)
        accepted += res.stats.accepted
    assert accepted > 0


def test_another_target_and_a_damaged_checkpoint_are_refused_in_one_line(tmp_path, checkpoint, target,
                                                                        smollm2_tokenizer):
    """The tiny target is another backbone (the one most like it: same shapes, same tokenizer); blocks of one head
    that differ, a missing Medusa key, a missing head and a projection of another vocabulary are damage."""
    model, folder = checkpoint
    layers = model.config.medusa_num_layers
    state = dict(model.state_dict())
    cases = {"another target": (folder, target, "is a Medusa-2 checkpoint: its heads were trained together with its "
                                                "own backbone .* fit no other, .*; pass --target ")}
    if layers == 2:
        differ = {k: v.clone() for k, v in state.items()}
        differ["medusa_head.1.0.linear.bias"] += 1.0
        cases["blocks that differ"] = (save_medusa2(model, str(tmp_path / "differ"), smollm2_tokenizer, differ), None,
                                       r"head 1's 2 residual blocks differ \(linear\.bias\)")
    no_key = save_medusa2(model, str(tmp_path / "no-key"), smollm2_tokenizer)
    cfg = json.load(open(os.path.join(no_key, "config.json")))
    del cfg["medusa_num_layers"]
    json.dump(cfg, open(os.path.join(no_key, "config.json"), "w"))
    cases["no medusa_num_layers"] = (no_key, None, "lacks a field the Medusa code reads: 'medusa_num_layers'")
    gone = {k: v for k, v in state.items() if not k.startswith(f"medusa_head.{HEADS - 1}.")}
    cases["a head missing"] = (save_medusa2(model, str(tmp_path / "gone"), smollm2_tokenizer, gone), None,
                               rf"missing \['medusa_head\.{HEADS - 1}\.")
    small = {**state, f"medusa_head.0.{layers}.weight": state[f"medusa_head.0.{layers}.weight"][:1000].clone()}
    cases["another vocabulary"] = (save_medusa2(model, str(tmp_path / "small"), smollm2_tokenizer, small), None,
                                   rf"medusa_head\.0\.{layers}\.weight: \(1000, 64\) float32, the loader reads "
                                   rf"\(49152, 64\)")
    for name, (src, tgt, match) in cases.items():
        with pytest.raises(DraftsmithError, match=match) as e:
            import_drafter(src, str(tmp_path / "out"), tgt or load_target(src, "float32", "cpu"), fmt="medusa2")
        assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "out"), name


def test_an_imported_medusa2_exports_back_to_medusa2_and_passes_its_check(tmp_path, checkpoint, backbone):
    """The imported heads (a 2-block head's blocks are one block's copies) written --to medusa2 beside the backbone:
    the same tensor names and values as the checkpoint's, and --check proves it against the backbone."""
    from safetensors import safe_open

    from draftsmith.target import safetensors_files

    model, folder = checkpoint
    imported, out = str(tmp_path / "imported"), str(tmp_path / "medusa2")
    import_drafter(folder, imported, backbone)
    export(imported, "medusa2", out, target=folder)
    assert any("its backbone is the target" in line for line in check(out))
    written = {}
    for path in safetensors_files(out):
        with safe_open(path, "pt") as f:
            written.update({k: f.get_tensor(k) for k in f.keys()})
    state = model.state_dict()
    assert {k for k in written if k.startswith("medusa_head.")} == {k for k in state if k.startswith("medusa_head.")}
    assert all(torch.equal(written[k], state[k]) for k in written)  # the backbone too, tensor for tensor


def save_medusa1(model: nn.Module, folder: str, base: str, dtype: torch.dtype = torch.float32) -> str:
    """What the Medusa code's own Medusa-1 training writes (``medusa/train/train_legacy.py``): its ``MedusaConfig``
    (the two keys, the base model, ``version``: no dimension, no dtype) and the heads' state dict by safetensors'
    ``save_file`` (a repeated block's names cloned apart: save_file stores no tensor twice)."""
    from safetensors.torch import save_file

    os.makedirs(folder)
    config = {"medusa_num_heads": HEADS, "medusa_num_layers": model.config.medusa_num_layers,
              "base_model_name_or_path": base, "version": "2", "transformers_version": "4.35.2"}
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    heads = {k: v.detach().to(dtype).clone() for k, v in model.medusa_head.state_dict().items()}
    save_file(heads, os.path.join(folder, "medusa_lm_head.safetensors"))
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_heads_as_a_medusa1_checkpoint_import_with_the_medusa_codes_logits(tmp_path, checkpoint, backbone,
                                                                                     dtype):
    """Medusa-1 keeps the backbone frozen: the checkpoint is the heads alone, for its base model (here the Medusa-2
    model's backbone); their dimensions and dtype are read off the projection, as the Medusa code takes them from the
    base model. bf16 heads (a bf16 run's) give the logits of the same heads rounded to bf16."""
    import copy

    model, folder = checkpoint
    heads = save_medusa1(model, str(tmp_path / "medusa1"), folder, dtype)
    assert detect(heads) == "medusa"
    out = str(tmp_path / "imported")
    meta = import_drafter(heads, out, backbone)
    assert (meta["drafter"]["num_heads"], meta["drafter"]["num_layers"]) == (HEADS, model.config.medusa_num_layers)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.medusa_head.parameters():
            p.copy_(p.to(dtype))
    x = torch.tensor([default_prompts(backbone)[0]])
    drafter = drafters.load(out, backbone)
    with torch.no_grad():
        ours = drafter.module(backbone.forward(x, feature_layers=drafter.feature_layers).features)
        theirs = medusa_logits(rounded, x)
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


def test_a_head_with_different_blocks_is_refused_for_medusa2_in_one_line(tmp_path, target):
    """draftsmith trains one block per layer; the Medusa code that reads --to medusa2 applies one block L times."""
    config = MedusaConfig(num_heads=2, num_layers=2)
    module = config.build_module(target)
    perturb(module)
    source = str(tmp_path / "heads")
    drafters.save(source, config, module, target)
    with pytest.raises(DraftsmithError, match=r"head 0 has 2 different residual blocks.*export it with --to medusa \(TGI\)"
                                              r" or --to medusa-vllm") as e:
        export(source, "medusa2", str(tmp_path / "out"))
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "out")


# ---------------------------------------------------------------- pickled, malicious and LoRA-only Medusa-2 checkpoints


class _Payload:
    """A pickle payload: unpickled without weights_only, its ``__reduce__`` runs ``open(marker, "w")`` (it creates a
    file: harmless, and visible)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def save_pickled(model: nn.Module, folder: str, tokenizer, extra: dict | None = None) -> str:
    """The Medusa-2 model as ``save_pretrained(safe_serialization=False)`` writes it (axolotl without ``save_safetensors:
    true``): ``torch.save`` shards named in ``pytorch_model.bin.index.json``, the backbone in one and the heads (a
    repeated block under one name) in the other, with ``extra`` entries in the heads' shard."""
    os.makedirs(folder)
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    state = dict(model.state_dict())
    heads = {k: state.pop(k) for k in sorted(state) if k.startswith("medusa_head.")}
    shared: dict[int, list[str]] = {}
    for name, t in heads.items():
        shared.setdefault(t.data_ptr(), []).append(name)
    heads = {names[-1]: heads[names[-1]] for names in shared.values()}
    shards = {"pytorch_model-00001-of-00002.bin": state, "pytorch_model-00002-of-00002.bin": {**heads, **(extra or {})}}
    for name, part in shards.items():
        torch.save(part, os.path.join(folder, name))
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    json.dump(index, open(os.path.join(folder, "pytorch_model.bin.index.json"), "w"))
    return folder


def test_a_pickled_medusa2_checkpoint_imports_as_its_safetensors_twin(tmp_path, checkpoint, backbone):
    """Its pickled shards are read with torch.load(weights_only=True) — the backbone by transformers, the heads'
    shard by the import — not refused: the same backbone (fingerprint) and the same heads as the safetensors one."""
    from safetensors.torch import load_file

    model, folder = checkpoint
    pickled = save_pickled(model, str(tmp_path / "pickled"), backbone.tokenizer)
    assert detect(pickled) == "medusa2" and not any(f.endswith(".safetensors") for f in os.listdir(pickled))
    meta = import_drafter(pickled, str(tmp_path / "from-pickles"), pickled)
    assert meta["target"]["fingerprint"] == backbone.fingerprint
    import_drafter(folder, str(tmp_path / "from-safetensors"), backbone)
    a, b = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("from-pickles", "from-safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("given", ["folder", "loaded backbone"])
def test_a_pickle_with_a_payload_is_refused_in_one_line_and_never_run(tmp_path, checkpoint, backbone, given):
    """A heads' shard that carries a __reduce__ payload: the import refuses it in one line naming torch.load's reason
    (whether the backbone is loaded from the folder by transformers, or given loaded and the heads' shard is the first
    pickle read), writes nothing, and the payload never runs."""
    model, _ = checkpoint
    marker = str(tmp_path / "payload-ran")
    folder = save_pickled(model, str(tmp_path / "evil"), backbone.tokenizer, {"medusa_head.note": _Payload(marker)})
    with pytest.raises(DraftsmithError, match=r"holds more than tensors \(WeightsUnpickler error: Unsupported global: "
                                              r"GLOBAL io\.open.*torch\.load\(weights_only=True\)") as e:
        import_drafter(folder, str(tmp_path / "out"), folder if given == "folder" else backbone)
    assert "\n" not in str(e.value) and not os.path.exists(marker) and not os.path.exists(tmp_path / "out")
    assert ("target '" in str(e.value)) == (given == "folder")  # who read it first: transformers, or the import


def lora_medusa2(base_dir: str, folder: str, tokenizer, pickled: bool = False) -> nn.Module:
    """A LoRA-only Medusa-2 checkpoint (LoRAX's Medusa LoRA adapter, Medusa-2 trained with a LoRA backbone): peft's
    ``save_pretrained`` of a LoRA on q/v (its B moved off zero, as training moves it) — adapter_config.json and
    adapter_model.safetensors (``pickled``: adapter_model.bin) — with the heads in the same file under
    ``base_model.model.medusa_head.*``, and the base's config with Medusa's keys; no backbone weights. Returns the model
    it stands for: the base with the LoRA merged (peft's merge_and_unload) and the heads."""
    import copy

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    heads = medusa_model(1, seed=9).medusa_head
    from transformers import AutoModelForCausalLM

    tiny_llama(layers=4, seed=5).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir)  # peft records where it came from
    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    lora.save_pretrained(folder)
    path = os.path.join(folder, "adapter_model.safetensors")
    state = {**load_file(path), **{f"base_model.model.medusa_head.{k}": v.detach().clone()
                                   for k, v in heads.state_dict().items()}}
    if pickled:
        os.remove(path)
        torch.save(state, os.path.join(folder, "adapter_model.bin"))
    else:
        save_file(state, path)
    config = base.config.to_dict()
    json.dump({**config, "medusa_num_heads": HEADS, "medusa_num_layers": 1}, open(os.path.join(folder, "config.json"), "w"))
    merged = lora.merge_and_unload()
    merged.medusa_head = heads
    merged.config.medusa_num_heads = HEADS
    return merged.eval()


@pytest.mark.parametrize("pickled", [False, True], ids=["safetensors", "pickled adapter"])
def test_a_lora_only_medusa2_checkpoint_is_merged_through_peft_when_its_base_is_given(tmp_path, smollm2_tokenizer,
                                                                                      pickled):
    """Without its base: refused in one line naming --base and the base the adapter records. With it: the adapter is
    merged into it through peft and written beside the drafter as its target (out/backbone, a Medusa-2 checkpoint), whose
    logits are those of the base with the LoRA merged (and not the base's), and the imported heads give the Medusa
    code's logits on it."""
    base_dir, folder, out = (str(tmp_path / name) for name in ("base", "adapter", "imported"))
    reference = lora_medusa2(base_dir, folder, smollm2_tokenizer, pickled)
    assert detect(folder) == "medusa2"
    with pytest.raises(DraftsmithError, match=rf"LoRA-only Medusa-2 checkpoint .* pass --base {base_dir} \(the model it "
                                              rf"was trained from\) to merge it through peft") as e:
        import_drafter(folder, out, base_dir)
    assert "\n" not in str(e.value) and not os.path.exists(out)
    if pickled:
        meta = import_drafter(folder, out, None, base=base_dir)
    else:
        assert main(["import", folder, "--out", out, "--base", base_dir]) == 0
        meta = json.load(open(os.path.join(out, "config.json")))
    backbone_dir = os.path.join(out, "backbone")
    assert meta["target"]["name"] == os.path.abspath(backbone_dir) and meta["imported"]["base"] == base_dir
    merged = load_target(backbone_dir, "float32", "cpu")
    assert meta["target"]["fingerprint"] == merged.fingerprint
    x = torch.tensor([default_prompts(merged)[0]])
    with torch.no_grad():
        want = reference(x).logits
        assert float((merged.model(x).logits - want).abs().max()) <= 1e-4
        assert float((load_target(base_dir, "float32", "cpu").model(x).logits - want).abs().max()) > 1e-2
        drafter = drafters.load(out, merged)
        ours = drafter.module(merged.forward(x, feature_layers=drafter.feature_layers).features)
        theirs = medusa_logits(reference, x)
    assert float((ours - theirs).abs().max()) <= 1e-4 * float(theirs.abs().max())


def test_loading_a_medusa2_folder_reports_every_unexpected_tensor_but_the_heads(tmp_path, checkpoint):
    """transformers lists the tensors it does not load as UNEXPECTED; a Medusa-2 folder's heads are known (not the
    model's) and left out of that report, any other tensor stays in it, and the model class is left as it was."""
    import io
    import logging

    from transformers import LlamaForCausalLM

    model, _ = checkpoint
    state = {**dict(model.state_dict()), "stray.weight": torch.zeros(3)}
    folder = save_medusa2(model, str(tmp_path / "stray"), load_target_files(checkpoint[1]).tokenizer, state)
    before = LlamaForCausalLM.__dict__.get("_keys_to_ignore_on_load_unexpected", "unset")
    from transformers.utils import logging as hf_logging

    log = io.StringIO()
    handler = logging.StreamHandler(log)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # the report's level (the CLI, run before in this process, sets error)
    logging.getLogger("transformers").addHandler(handler)  # where transformers logs its load report
    try:
        load_target(folder, "float32", "cpu")
    finally:
        logging.getLogger("transformers").removeHandler(handler)
        hf_logging.set_verbosity(level)
    report = log.getvalue()
    assert "stray.weight" in report and "UNEXPECTED" in report and "medusa_head" not in report
    assert LlamaForCausalLM.__dict__.get("_keys_to_ignore_on_load_unexpected", "unset") == before
