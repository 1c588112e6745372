"""Data: sources → normalized conversations → chat template + loss mask → regenerate → feature cache → draft vocab.

``draftsmith prepare --config RECIPE`` (:func:`run_prepare_recipe`, which writes ``<run_dir>/config.yaml`` and
runs :func:`run_prepare`) writes, under
``data.out_dir`` (default ``<run_dir>/data``; :class:`PreparedPaths` names each path):

* ``tokenized/`` — what training reads: a `datasets.Dataset` (``save_to_disk``) with
  ``input_ids`` (list of int32), ``loss_mask`` (list of int8, 1 on assistant tokens that
  are trained on; token t is predicted from position t-1), ``source`` (str), ``conv_id``
  (str), and ``draftsmith_manifest.json`` (tokenizer fingerprint, target vocab size,
  counts, ``data_hash``, the sha256 of each file). Read it with :func:`load_tokenized`
  ``(path, tokenizer=None, verify="all")``, which checks the columns, refuses a file whose
  sha256 differs and, given a tokenizer / Target / fingerprint, data rendered with another
  tokenizer.
* ``features/`` — the offline feature cache (:mod:`.feature_cache`):
  :func:`write_feature_cache` writes it, ``FeatureCache.open(path, target)`` reads it
  (``len(cache)``, ``cache[i]`` → dict of ``input_ids``, ``loss_mask``, ``hidden`` [S, L*H] bf16,
  optional ``topk_ids`` / ``topk_logits``; ``cache.layer_ids``), refusing another target,
  another tokenizer, or a corrupt shard.
* ``draft_vocab.safetensors`` — the EAGLE-3 reduced vocabulary (:mod:`.vocab`):
  :func:`build_draft_vocab` ``(dataset, target_vocab_size, size) -> DraftVocab`` with ``d2t``
  (offsets: target_id = draft_id + d2t[draft_id]), ``t2d`` (bool over the target vocab) and
  ``coverage``; ``DraftVocab.save(path)`` / ``DraftVocab.load(path)``.
* ``conversations/`` (normalized), ``regenerate/`` + ``conversations_regenerated/``
  (self-distillation), ``summary.json``, ``.cache/`` (datasets map cache).
"""

from .feature_cache import FeatureCache, default_layer_ids, write_feature_cache
from .prepare import PreparedPaths, PrepareSummary, run_prepare, run_prepare_recipe
from .tokenized import load_tokenized
from .vocab import DraftVocab, build_draft_vocab

__all__ = [
    "DraftVocab",
    "FeatureCache",
    "PrepareSummary",
    "PreparedPaths",
    "build_draft_vocab",
    "default_layer_ids",
    "load_tokenized",
    "run_prepare",
    "write_feature_cache",
]
