"""Offline feature cache: one pass of the frozen target over the tokenized data, stored for training.

Feature-based drafters (EAGLE-1/3, Medusa) train on the target's hidden states; running
the target once and reading its features back makes every epoch after the first cost
only the drafter. A cache folder holds

* ``shard-NNNNN.safetensors`` — ``shard_size`` samples packed end to end:
  ``hidden`` [T, L*H] bf16 (the features of the manifest's ``layer_ids``, concatenated in
  that order, exactly as ``Target.forward(ids, feature_layers=layer_ids).features`` returns
  them for one sample, cast to bf16), ``input_ids`` [T] int32, ``loss_mask`` [T] int8,
  ``offsets`` [n+1] int64 (sample i is rows offsets[i]:offsets[i+1]), and with ``topk > 0``
  ``topk_ids`` [T, K] int32 and ``topk_logits`` [T, K] float32 (the target's K largest
  logits, descending);
* ``manifest.json`` — shapes, dtype, layer ids, target name and fingerprint, tokenizer hash,
  source-data hash (the tokenized dataset's ``data_hash``), and per shard its sample range,
  token count, byte size and sha256; plus bytes/token and the target tokens/s of the run.

Layer ids mean *output of decoder layer i* (0-based, before the final norm). The default,
:func:`default_layer_ids`, is EAGLE-3's low/mid/high choice as SpecForge, SGLang and
TensorRT-LLM compute it, ``[1, L//2 - 1, L - 4]`` (EAGLE-3's reference code captures the
*inputs* of layers 2, L//2 and L-3, which are the same tensors), followed by the last layer
``L - 1`` (EAGLE-1's feature, pre-norm). For SmolLM2 (30 layers): ``[1, 14, 26, 29]``.

:meth:`FeatureCache.open` refuses a cache made for another target or tokenizer, a missing
or truncated shard, and — the first time each shard is read, or at open with
``verify="all"`` — a shard whose sha256 differs from the manifest. Writing is resumable
(:class:`~draftsmith.data.shards.ShardedJob`): a killed run keeps its finished shards.
"""

from __future__ import annotations

import bisect
import json
import os
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from ..progress import progress_bar
from ..errors import DraftsmithError
from ..target import Target, default_eagle3_layers
from .shards import MANIFEST, SOLO, ShardedJob, Workers, read_json, record_digest, sha256_file

FORMAT = "draftsmith-feature-cache/1"


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers (:func:`~draftsmith.target.default_eagle3_layers`) and the last layer
    (output of decoder layer i, 0-based); a target under 5 layers, where those collide: 0, N//2 and N-1."""
    if num_layers < 5:
        return sorted({0, num_layers // 2, num_layers - 1})
    return [*default_eagle3_layers(num_layers), num_layers - 1]


def write_feature_cache(
    tokenized: Any,
    folder: str,
    target: Target,
    *,
    layer_ids: Sequence[int] = (),
    topk: int = 0,
    shard_size: int = 256,
    batch_tokens: int = 8192,
    source_data_hash: str = "",
    progress: bool = True,
    workers: Workers = SOLO,
    restart: bool = False,
) -> dict[str, Any]:
    """Run ``target`` over ``tokenized`` (rows with input_ids, loss_mask) and write the cache to ``folder``.

    Resumable, and extended when samples are added (:class:`~draftsmith.data.shards.ShardedJob`; ``restart``
    lets it discard finished shards that changed settings or samples invalidate); returns the manifest.
    ``layer_ids`` empty = :func:`default_layer_ids`. With several ``workers`` each process computes its
    share of the shards; the manifest's
    ``target_tokens_per_s`` is then the sum of the processes' rates.
    """
    ids = [target.layer_index(i) for i in layer_ids] or default_layer_ids(target.num_layers)
    spec = {"format": FORMAT, "target": target.fingerprint, "tokenizer_hash": target.tokenizer_hash,
            "data.features.layer_ids": ids, "data.features.topk": topk, "target.dtype": str(target.dtype)}  # not sizes
    rows = tokenized.with_format(None)
    records = [record_digest([i, m]) for i, m in zip(rows["input_ids"], rows["loss_mask"])]
    job = ShardedJob(folder, spec, ".safetensors", records, shard_size)
    finished = job.finished()
    if finished is not None:
        return {**finished, "note": "up to date (reused)"}
    note = job.start(workers, restart)
    n = len(tokenized)
    mine = [s for s in job.shards if workers.owns(s.index)]
    bar = progress_bar(total=sum(s.stop - s.start for s in mine), unit="sample",
               desc="features" if workers.size == 1 else f"features (process {workers.rank} of {workers.size})",
               disable=not progress or not workers.is_main, dynamic_ncols=True)
    computed_tokens, compute_s = 0, 0.0
    for shard in mine:
        lo, hi = shard.start, shard.stop
        if job.done(shard) is None:
            batch = rows[lo:hi]
            start = time.perf_counter()
            tensors = _shard_tensors(target, batch["input_ids"], batch["loss_mask"], ids, topk, batch_tokens)
            compute_s += time.perf_counter() - start
            computed_tokens += int(tensors["input_ids"].numel())
            # one metadata key: safetensors writes a map's keys in arbitrary order, and the same shard
            # must be the same bytes (and sha256) whichever run or process computes it
            payload = save_safetensors(tensors, metadata={"draftsmith": json.dumps({"format": FORMAT, "first_index": lo})})
            with job.writing():  # a full disk: one line, saying which shards the rerun keeps
                job.commit(shard, payload, {"num_samples": hi - lo, "num_tokens": int(tensors["input_ids"].numel()),
                                            "process": workers.rank})
        bar.update(hi - lo)
        if compute_s:
            bar.set_postfix_str(f"{computed_tokens / compute_s:.0f} target tok/s")
    bar.close()
    rate = computed_tokens / compute_s if compute_s else 0.0
    rate = workers.all_sum([rate])[0]
    shards = job.collect(workers)
    tokens = sum(m["num_tokens"] for m in shards)
    size = sum(m["bytes"] for m in shards)
    manifest = job.finish(
        shards,
        workers,
        format=FORMAT,
        target={"name": target.name, "fingerprint": target.fingerprint},
        tokenizer_hash=target.tokenizer_hash,
        source_data_hash=source_data_hash,
        layer_ids=ids,
        hidden_size=target.hidden_size,
        feature_dim=len(ids) * target.hidden_size,
        dtype="bfloat16",
        topk=topk,
        num_samples=n,
        num_tokens=tokens,
        bytes=size,
        bytes_per_token=size / max(tokens, 1),
        target_tokens_per_s=rate or None,
    )
    return {**manifest, "note": note}


@torch.inference_mode()
def _shard_tensors(
    target: Target, input_ids: list[list[int]], loss_mask: list[list[int]], layer_ids: list[int], topk: int,
    batch_tokens: int,
) -> dict[str, torch.Tensor]:
    """The packed tensors of one shard; samples are batched by length, stored in their own order."""
    n = len(input_ids)
    order = sorted(range(n), key=lambda i: -len(input_ids[i]))
    hidden: list[torch.Tensor | None] = [None] * n
    top_ids: list[torch.Tensor | None] = [None] * n
    top_logits: list[torch.Tensor | None] = [None] * n
    for batch in _length_batches(order, [len(x) for x in input_ids], batch_tokens):
        width = len(input_ids[batch[0]])  # longest first
        ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B, S]
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, S]
        for r, i in enumerate(batch):
            ids[r, : len(input_ids[i])] = torch.tensor(input_ids[i])
            mask[r, : len(input_ids[i])] = 1
        out = target.forward(ids.to(target.device), feature_layers=tuple(layer_ids),
                             attention_mask=mask.to(target.device), logits_to_keep=0 if topk else 1)
        feats = out.features.to(torch.bfloat16).cpu()  # [B, S, L*H]
        if topk:
            values, indices = out.logits.float().topk(topk, dim=-1)  # [B, S, K]
        for r, i in enumerate(batch):
            length = len(input_ids[i])
            hidden[i] = feats[r, :length]
            if topk:
                top_logits[i] = values[r, :length].cpu()
                top_ids[i] = indices[r, :length].to(torch.int32).cpu()
    lengths = torch.tensor([len(x) for x in input_ids], dtype=torch.int64)
    tensors = {
        "hidden": torch.cat(hidden).contiguous(),  # [T, L*H]
        "input_ids": torch.tensor([t for x in input_ids for t in x], dtype=torch.int32),  # [T]
        "loss_mask": torch.tensor([t for x in loss_mask for t in x], dtype=torch.int8),  # [T]
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),  # [n+1]
    }
    if topk:
        tensors["topk_ids"] = torch.cat(top_ids).contiguous()  # [T, K]
        tensors["topk_logits"] = torch.cat(top_logits).contiguous()  # [T, K]
    return tensors


_MANIFEST_FIELDS = {"target": dict, "tokenizer_hash": str, "shards": list, "layer_ids": list, "hidden_size": int,
                    "topk": int, "num_tokens": int, "num_samples": int, "source_data_hash": str}
_SHARD_FIELDS = {"file": str, "bytes": int, "first_index": int}
_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "integer"}


def _manifest_damage(manifest: dict[str, Any]) -> str:
    """What is missing or mistyped in a manifest of the current format ("" when nothing): a hand-edited or
    foreign one is refused at open, not as a KeyError mid-training."""
    for key, kind in _MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            return f"'{key}' should be a JSON {_JSON_NAMES[kind]}, got {manifest.get(key)!r:.60}"
    if not isinstance(manifest["target"].get("fingerprint"), str):
        return "'target.fingerprint' is missing"
    for i, shard in enumerate(manifest["shards"]):
        bad = [k for k, kind in _SHARD_FIELDS.items() if not isinstance(shard, dict) or not isinstance(shard.get(k), kind)]
        if bad:
            return f"shards[{i}] lacks {', '.join(bad)}"
    return ""


def _length_batches(order: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive groups of ``order`` (longest first) whose padded size fits ``batch_tokens`` (≥ 1 sample)."""
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class FeatureCache:
    """Read access to a feature cache: ``len(cache)``, ``cache[i] -> dict`` of tensors.

    ``cache[i]`` holds ``input_ids`` LongTensor[S], ``loss_mask`` LongTensor[S],
    ``hidden`` BFloat16Tensor[S, L*H] and, when stored, ``topk_ids`` LongTensor[S, K] and
    ``topk_logits`` FloatTensor[S, K]. Open it with :meth:`open`.
    """

    def __init__(self, path: str, manifest: dict[str, Any], verify: Literal["lazy", "all", "none"]):
        self.path = path
        self.manifest = manifest
        self._verify = verify
        self._shards = manifest["shards"]
        self._starts = [m["first_index"] for m in self._shards]
        self._open: dict[int, tuple[Any, torch.Tensor]] = {}
        self._verified: set[int] = set()

    @classmethod
    def open(cls, path: str, target: Any, verify: Literal["lazy", "all", "none"] = "lazy") -> FeatureCache:
        """Open the cache at ``path`` for ``target`` (a :class:`Target`, or anything with ``fingerprint``
        and ``tokenizer_hash``). verify: "lazy" checks each shard's sha256 the first time it is read,
        "all" checks every shard now, "none" only sizes."""
        manifest = read_json(os.path.join(path, MANIFEST))
        rebuild = (f"re-run `draftsmith prepare` with 'features' in data.stages for this target "
                   f"(finished shards that are intact are kept)")
        if manifest is None:
            raise DraftsmithError(f"'{path}' is not a finished feature cache (no {MANIFEST}); {rebuild}")
        if not isinstance(manifest, dict):
            raise DraftsmithError(f"feature cache '{path}': {MANIFEST} holds a JSON {type(manifest).__name__}, not the "
                                  f"manifest's object; {rebuild}")
        if manifest.get("format") != FORMAT:
            raise DraftsmithError(f"feature cache '{path}' has format {manifest.get('format')!r}, expected {FORMAT}; "
                                  f"{rebuild}")
        damaged = _manifest_damage(manifest)
        if damaged:
            raise DraftsmithError(f"feature cache '{path}': {MANIFEST} is damaged ({damaged}); {rebuild}")
        made_for = manifest["target"]
        if made_for["fingerprint"] != target.fingerprint:
            raise DraftsmithError(
                f"feature cache '{path}' was made by target '{made_for['name']}' (fingerprint "
                f"{made_for['fingerprint']}), not by this target '{getattr(target, 'name', '?')}' (fingerprint "
                f"{target.fingerprint}); its features would teach the drafter another model. Point to the cache "
                f"made for this target, or {rebuild}"
            )
        if manifest["tokenizer_hash"] != target.tokenizer_hash:
            raise DraftsmithError(
                f"feature cache '{path}' was made with tokenizer {manifest['tokenizer_hash']}, but this target's "
                f"tokenizer is {target.tokenizer_hash}; {rebuild}"
            )
        cache = cls(path, manifest, verify)
        for meta in cache._shards:
            file = os.path.join(path, meta["file"])
            if not os.path.isfile(file):
                raise DraftsmithError(f"feature cache '{path}' is missing shard {meta['file']}; {rebuild}")
            if os.path.getsize(file) != meta["bytes"]:
                raise DraftsmithError(f"feature cache shard {file} is {os.path.getsize(file)} bytes, the manifest says "
                                      f"{meta['bytes']}: it is truncated or was replaced; delete it and {rebuild}")
        if verify == "all":
            cache.verify_all()
        return cache

    @property
    def layer_ids(self) -> list[int]:
        """Target layers of ``hidden``, in order (output of decoder layer i, 0-based)."""
        return list(self.manifest["layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def topk(self) -> int:
        return int(self.manifest["topk"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def source_data_hash(self) -> str:
        return str(self.manifest["source_data_hash"])

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} is out of range for a feature cache of {len(self)} samples")
        i %= len(self)
        s = bisect.bisect_right(self._starts, i) - 1
        handle, offsets = self._shard(s)
        local = i - self._starts[s]
        a, b = int(offsets[local]), int(offsets[local + 1])
        item = {
            "input_ids": handle.get_slice("input_ids")[a:b].long(),
            "loss_mask": handle.get_slice("loss_mask")[a:b].long(),
            "hidden": handle.get_slice("hidden")[a:b],
        }
        if self.topk:
            item["topk_ids"] = handle.get_slice("topk_ids")[a:b].long()
            item["topk_logits"] = handle.get_slice("topk_logits")[a:b]
        return item

    def lengths(self) -> list[int]:
        """Tokens of every sample, from the shards' offsets (no features read)."""
        out: list[int] = []
        for s in range(len(self._shards)):
            offsets = self._shard(s)[1]
            out += (offsets[1:] - offsets[:-1]).tolist()
        return out

    def verify_all(self) -> None:
        """Check every shard's sha256 now (raises on the first mismatch)."""
        for s in range(len(self._shards)):
            self._check(s)

    def _check(self, s: int) -> None:
        if s in self._verified:
            return
        meta = self._shards[s]
        file = os.path.join(self.path, meta["file"])
        digest = sha256_file(file)
        if digest != meta["sha256"]:
            raise DraftsmithError(
                f"feature cache shard {file} is corrupt: sha256 {digest[:16]}… differs from the manifest's "
                f"{meta['sha256'][:16]}…. Delete that file and re-run `draftsmith prepare` with 'features' in "
                f"data.stages: only the missing shard is recomputed"
            )
        self._verified.add(s)

    def _shard(self, s: int) -> tuple[Any, torch.Tensor]:
        if s not in self._open:
            if self._verify != "none":
                self._check(s)
            handle = safe_open(os.path.join(self.path, self._shards[s]["file"]), framework="pt")
            self._open[s] = (handle, handle.get_tensor("offsets"))
        return self._open[s]

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get a copy without open file handles; each reopens what it reads
        state = self.__dict__.copy()
        state["_open"] = {}
        return state
