"""Loading a target: :func:`load_target` (the model, frozen, on its device, with the CPU kernels installed) and
:func:`load_target_files` (what its files say, no model built)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from ..chat import apply_option
from ..cpu_kernels import cpu_linear
from ..devices import detect_device, resolve_dtype
from ..errors import DraftsmithError
from .architecture import check_cache_argument, freeze
from .config import TargetConfig
from .fingerprint import NOT_THE_MODELS, files_fingerprint
from .model import Target, TargetFiles
from .sources import BUILTINS, resolve_target_folder, unsafe_pickle


def load_target(
    spec: str | TargetConfig, dtype: str = "auto", device: str = "auto", chat_template: str = "auto"
) -> Target:
    """Load and freeze a target. See the module docstring for what ``spec`` may be; ``chat_template``
    as ``TargetConfig.chat_template``."""
    if isinstance(spec, TargetConfig):
        spec, dtype, device, chat_template = spec.name, spec.dtype, spec.device, spec.chat_template
    from transformers import AutoTokenizer

    dev = detect_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    folder = resolve_target_folder(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = load_causal_lm(folder, torch_dtype, f"target '{spec}'")
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


def load_causal_lm(folder: str, dtype: Any, where: str) -> Any:
    """transformers' causal LM of ``folder`` in ``dtype``, as draftsmith loads every model it did not build: pickled
    weights (``pytorch_model*.bin``) only through ``torch.load(weights_only=True)`` (transformers' default, passed
    explicitly), one that holds more than tensors refused in one line naming ``where`` (:func:`unsafe_pickle`), and the
    tensors known to lie beside the model unreported (:func:`known_extras_unreported`). OSError / ValueError (no such
    model, a file transformers cannot read) are the caller's to word."""
    import pickle

    from transformers import AutoModelForCausalLM

    try:
        with known_extras_unreported(folder):
            return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, weights_only=True)
    except pickle.UnpicklingError as e:  # pickled weights that hold more than tensors
        raise unsafe_pickle(where, e) from e


@contextlib.contextmanager
def known_extras_unreported(folder: str) -> Iterator[None]:
    """transformers' load report lists the tensors a folder holds beside its causal LM as UNEXPECTED; those under
    ``NOT_THE_MODELS`` (a Medusa-2 checkpoint's heads, ``export/medusa2.py``) are known not to be the model's, as its
    fingerprint knows, so for the load of ``folder`` the model class transformers builds ignores them (its
    ``_keys_to_ignore_on_load_unexpected``, restored after); any other unexpected tensor is still reported."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(folder))]
    except (KeyError, OSError, ValueError):  # a class transformers does not map (it says so itself), or no config
        yield
        return
    own = cls.__dict__.get("_keys_to_ignore_on_load_unexpected", _UNSET)
    cls._keys_to_ignore_on_load_unexpected = [*(cls._keys_to_ignore_on_load_unexpected or ()),
                                              *(rf"^{re.escape(prefix)}" for prefix in NOT_THE_MODELS)]
    try:
        yield
    finally:
        if own is _UNSET:
            del cls._keys_to_ignore_on_load_unexpected
        else:
            cls._keys_to_ignore_on_load_unexpected = own


_UNSET = object()


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
