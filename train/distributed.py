"""All DeepSpeed and torch.distributed code of draftsmith lives here.

Recipes call these functions; models, losses and the decoder never import
``deepspeed`` or ``torch.distributed``.

One process or many, the path is the same: :func:`init_distributed` reads the
launcher's environment (torchrun and the ``deepspeed`` launcher set RANK /
WORLD_SIZE / LOCAL_RANK / MASTER_*; without a launcher it fills them in for a
single process), picks NCCL on GPUs and gloo on CPU (where it also sets
``DS_ACCELERATOR=cpu``), and :func:`build_engine` wraps the trainable drafter with
``deepspeed.initialize`` — always, even for one CPU process, so a smoke run tests
the code a cluster run uses. The engine settings come from a JSON file in
``configs/deepspeed/``; the optimizer is a plain ``torch.optim.AdamW`` (no
DeepSpeed op to compile) and the schedule a ``LambdaLR`` built from the recipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..data.shards import SOLO, Workers
from ..devices import cache_dir
from ..errors import ConfigError, DraftsmithError

DEEPSPEED_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "deepspeed")
RECIPE_OWNED_KEYS = {
    "optimizer": "train.optimizer",
    "scheduler": "train.schedule",
    "train_batch_size": "train.batch_size (per process) and gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "train.batch_size",
}


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# ------------------------------------------------------------------ process group


def init_distributed() -> World:
    """Join (or, without a launcher, create) the process group; return this process's place in it."""
    _prepare_environment()
    import deepspeed
    import torch.distributed as dist

    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device, backend = torch.device("cuda", torch.cuda.current_device()), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]), device)


def _prepare_environment() -> None:
    """Environment DeepSpeed reads at import time, and the rendezvous of a launcher-less run."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed JIT-compiles C++ ops on first use; keep them in our cache, not ~/.cache.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(cache_dir(), "torch_extensions"))
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        # no launcher: a one-process group on a free local port, forgotten again by shutdown()
        _SINGLE_PROCESS_ENV.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=str(_free_port()))
        os.environ.update(_SINGLE_PROCESS_ENV)
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    import importlib

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    deepspeed.utils.logger.setLevel("WARNING")
    if get_accelerator().device_name() == "cpu":
        # The shared-memory all-reduce op serves only DeepSpeed *inference*; on CPU it would be
        # compiled (~80 s, C++) on every machine's first run for nothing, so skip building it.
        # (deepspeed.comm re-exports the torch package as `torch`, hence import_module.)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


_SINGLE_PROCESS_ENV: dict[str, str] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def process_group() -> Iterator[World]:
    """:func:`init_distributed` for the block, and :func:`shutdown` after it — without waiting for
    peers when the block raised (a peer may be gone, and a barrier would hang)."""
    world = init_distributed()
    try:
        yield world
    except BaseException:
        shutdown(wait_for_peers=False)
        raise
    shutdown()


@contextlib.contextmanager
def sharing() -> Iterator[Workers]:
    """The processes that share ``draftsmith prepare``'s sharded stages (``data.shards.Workers``): under
    torchrun / the deepspeed launcher the process group for the block, else one process and no group
    (prepare's cheap stages need none, and one process must not pay DeepSpeed's start-up)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield SOLO
        return
    with process_group() as world:
        yield Workers(world.rank, world.world_size, barrier, all_sum)


def shutdown(wait_for_peers: bool = True) -> None:
    """Destroy the process group explicitly (leaving it to interpreter exit crashes gloo ZeRO-3 runs)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
    # DeepSpeed caches a clone of the world group; a later run in this process (tests) needs a new one,
    # and child processes must not inherit a rendezvous that no longer exists.
    from deepspeed.utils import groups

    groups._WORLD_GROUP = None
    for key, value in _SINGLE_PROCESS_ENV.items():
        if os.environ.get(key) == value:
            del os.environ[key]
    _SINGLE_PROCESS_ENV.clear()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sum of a list of floats over all ranks."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ------------------------------------------------------------------ engine config


def resolve_engine_config_path(name: str) -> str:
    if os.path.isfile(name):
        return name
    path = os.path.join(DEEPSPEED_CONFIG_DIR, name if name.endswith(".json") else name + ".json")
    if os.path.isfile(path):
        return path
    shipped = sorted(f[:-5] for f in os.listdir(DEEPSPEED_CONFIG_DIR) if f.endswith(".json"))
    raise ConfigError(f"train.deepspeed = '{name}' is neither a JSON file nor a shipped engine config; choose one of: "
                      f"{', '.join(shipped)} or give a path")


def load_engine_config(name: str, micro_batch_size: int, device: torch.device,
                       target_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Read and check a DeepSpeed JSON, resolve ``"auto"`` precision, set the micro-batch size.

    ``"bf16": {"enabled": "auto"}`` follows the frozen target's dtype (``target_dtype``, the
    recipe's ``target.dtype`` resolved): a bf16 target trains its drafter in DeepSpeed's bf16
    engine (fp32 master weights), an fp32 target in fp32 — so ``target.dtype=bfloat16`` alone
    moves a CPU run with a native bf16 path (``devices.native_bf16``) to the faster dtype. Without
    ``target_dtype``: bf16 on a GPU that supports it, fp32 elsewhere.

    The JSON holds engine settings only: ZeRO stage, bf16/fp16, gradient accumulation,
    clipping. Learning rate, schedule and batch size live in the recipe YAML, and a JSON
    that sets them is refused rather than silently overriding the recipe.
    """
    path = resolve_engine_config_path(name)
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config '{path}' is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"DeepSpeed config '{path}' must hold a JSON object")
    for key, owner in RECIPE_OWNED_KEYS.items():
        if key in cfg:
            raise ConfigError(f"DeepSpeed config '{path}' sets '{key}', which belongs in the recipe YAML ({owner}); "
                              f"remove it from the JSON")
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"DeepSpeed config '{path}': zero_optimization.stage = {stage!r} does not exist; "
                          f"choose 0, 1, 2 or 3")
    _check_zero_block(cfg.get("zero_optimization", {}), path)
    clip = cfg.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ConfigError(f"DeepSpeed config '{path}': gradient_clipping = {clip!r} must be a number ≥ 0 (0 turns it off)")
    bf16, fp16 = cfg.setdefault("bf16", {}), cfg.setdefault("fp16", {})
    if bf16.get("enabled") == "auto":
        bf16["enabled"] = (target_dtype == torch.bfloat16 if target_dtype is not None
                           else device.type == "cuda" and torch.cuda.is_bf16_supported())
    if fp16.get("enabled") == "auto":
        fp16["enabled"] = False
    if fp16.get("enabled") and device.type == "cpu":
        raise ConfigError(f"DeepSpeed config '{path}' enables fp16, which DeepSpeed does not support on CPU; "
                          f"use bf16 or fp32 (set fp16.enabled to false)")
    if fp16.get("enabled") and bf16.get("enabled"):
        raise ConfigError(f"DeepSpeed config '{path}' enables both fp16 and bf16; choose one")
    gas = cfg.setdefault("gradient_accumulation_steps", 1)
    if not isinstance(gas, int) or gas < 1:
        raise ConfigError(f"DeepSpeed config '{path}': gradient_accumulation_steps = {gas!r} must be an integer ≥ 1")
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg.setdefault("steps_per_print", 1 << 30)  # we log ourselves
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg


def _check_zero_block(zero: Any, path: str) -> None:
    """Validate ``zero_optimization`` with DeepSpeed's own schema now, not deep inside ``initialize``."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    if not isinstance(zero, dict):
        raise ConfigError(f"DeepSpeed config '{path}': zero_optimization must be an object, e.g. {{\"stage\": 2}}")
    try:
        DeepSpeedZeroConfig(**zero)
    except ValueError as e:  # pydantic's ValidationError names each bad field and why
        from deepspeed import __version__

        raise ConfigError(f"DeepSpeed config '{path}': zero_optimization is not valid for DeepSpeed "
                          f"{__version__}: {e}") from e


def engine_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


# ------------------------------------------------------------------ engine


def build_engine(
    model: torch.nn.Module,
    ds_config: dict[str, Any],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    lr_lambda: Callable[[int], float],
    frozen: torch.nn.Module | None = None,
) -> Any:
    """Wrap ``model`` in a DeepSpeed engine with AdamW over its trainable parameters.

    ``frozen`` (the target) stays outside the engine: it must share no tensor with
    ``model``, since the engine casts and (ZeRO-3) partitions every parameter it holds.
    """
    import deepspeed

    if frozen is not None:
        _refuse_shared_tensors(model, frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise DraftsmithError("the drafter has no trainable parameters")
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    fp32 = fp32_buffers(model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    restore_fp32_buffers(engine.module, fp32)
    return engine


def fp32_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the module's float32 buffers (RoPE's ``inv_freq`` / ``original_inv_freq``), by name."""
    return {name: b.detach().clone() for name, b in module.named_buffers() if b.dtype == torch.float32}


def restore_fp32_buffers(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> list[str]:
    """Put back, exactly, the float32 buffers an engine cast; then check all of them. Returns the names restored.

    DeepSpeed 0.19 casts only parameters to bf16 and keeps buffers (its ``_cast_module_mixed_precision``);
    older releases ran ``module.bfloat16()``, which rounds RoPE's ``inv_freq`` to bf16 and shifts every
    rotary angle (by up to ~0.8 rad at position 2k). Restoring from the copies taken before
    ``deepspeed.initialize`` makes the version irrelevant, so none is pinned for this.
    """
    restored = []
    for name, buf in module.named_buffers():
        ref = saved.get(name)
        if ref is not None and buf.dtype != torch.float32:
            buf.data = ref.to(buf.device)
            restored.append(name)
    check_fp32_buffers(module, saved)
    return restored


def check_fp32_buffers(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """DraftsmithError unless every buffer in ``saved`` is still float32 and bit-equal to its copy."""
    own = dict(module.named_buffers())
    for name, ref in saved.items():
        buf = own.get(name)
        if buf is None or buf.dtype != torch.float32 or not torch.equal(buf.detach().cpu(), ref.cpu()):
            got = "missing" if buf is None else str(buf.dtype).replace("torch.", "")
            raise DraftsmithError(f"buffer '{name}' of the drafter is no longer the float32 tensor it was ({got}) inside "
                                  f"the training engine; RoPE would rotate with rounded frequencies")


def _refuse_shared_tensors(model: torch.nn.Module, frozen: torch.nn.Module) -> None:
    frozen_ptrs = {p.data_ptr(): name for name, p in frozen.named_parameters() if p.numel()}
    for name, p in model.named_parameters():
        if p.numel() and p.data_ptr() in frozen_ptrs:
            raise DraftsmithError(
                f"drafter parameter '{name}' shares its storage with the target's '{frozen_ptrs[p.data_ptr()]}'; "
                f"the training engine would cast or partition the target's weights. The drafter must hold a copy"
            )


def zero_stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage())


@contextlib.contextmanager
def full_weights(engine: Any) -> Iterator[torch.nn.Module]:
    """The engine's module with every parameter whole on every rank (ZeRO-3 gathers; others as-is).

    All ranks must enter together. Read-only: changes made inside are discarded.
    """
    if zero_stage(engine) == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            yield engine.module
    else:
        yield engine.module


def save_engine(engine: Any, root: str, tag: str) -> None:
    """Every rank writes its shard of model, optimizer and scheduler state to ``root/tag``."""
    engine.save_checkpoint(root, tag=tag, save_latest=False)


def consolidated_weights(root: str, tag: str) -> dict[str, torch.Tensor]:
    """The whole fp32 weights of the ZeRO-1/2/3 checkpoint ``root/tag``, gathered from every rank's
    partition files on one CPU process (no process group), named as the engine's module names them.

    DeepSpeed's own ``zero_to_fp32`` reader does the gathering, under :func:`weights_only_loads`;
    buffers come back as saved.
    """
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                weights_only_loads(os.path.join(root, tag)):  # progress lines
            return dict(get_fp32_state_dict_from_zero_checkpoint(root, tag=tag))
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise DraftsmithError(f"checkpoint '{os.path.join(root, tag)}' is incomplete or not a DeepSpeed ZeRO "
                              f"checkpoint: {e}") from e


def load_engine(engine: Any, root: str, tag: str) -> None:
    """Restore model, optimizer and scheduler state from ``root/tag`` (under :func:`weights_only_loads`)."""
    with weights_only_loads(os.path.join(root, tag)):
        path, _ = engine.load_checkpoint(root, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise DraftsmithError(f"checkpoint '{os.path.join(root, tag)}' could not be loaded by DeepSpeed; "
                              f"is it complete, and made with the same ZeRO stage and number of processes?")


_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_PICKLE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


@contextlib.contextmanager
def weights_only_loads(path: str) -> Iterator[None]:
    """Every ``torch.load`` in the block — DeepSpeed's too — unpickles nothing that could run code.

    DeepSpeed's loaders call ``torch.load(..., weights_only=False)``; torch's
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` (read at each call) overrides that, so they read tensors and
    plain containers, plus the few DeepSpeed types its optimizer state holds (allow-listed here, all
    plain data: a fragment's address, the ZeRO stage, the loss scaler). Anything else in a file of
    ``path`` is refused with a one-line :class:`DraftsmithError`, before it is built.
    """
    import pickle

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    saved = {key: os.environ.pop(key, None) for key in (_FORCE_WEIGHTS_ONLY, _FORCE_PICKLE)}
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals([fragment_address, ZeroStageEnum, LossScaler, DynamicLossScaler]):
            yield
    except pickle.UnpicklingError as e:
        raise unsafe_checkpoint(path, e) from e
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def unsafe_checkpoint(path: str, error: Exception) -> DraftsmithError:
    """The one-line refusal of a checkpoint file that ``torch.load(weights_only=True)`` would not read."""
    import re

    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return DraftsmithError(f"checkpoint '{path}' holds objects other than tensors and plain data, which loading could "
                           f"run as code: refused{f' (it names {found[1]})' if found else ''}. Resume or export only "
                           f"checkpoints that draftsmith train wrote")


def set_peak_lr(engine: Any, lr: float) -> float:
    """Give the engine's schedule the peak learning rate ``lr`` at its current step; return the peak it had.

    ``load_engine`` restores the scheduler's ``base_lrs`` (and the optimizer's current lr) from the
    checkpoint, which would silently keep the old peak when a resumed run changes ``train.optimizer.lr``.
    """
    scheduler = engine.lr_scheduler  # the LambdaLR of build_engine
    old = float(scheduler.base_lrs[0])
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = lr, lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return old


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak accelerator memory (GiB) on a GPU; the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return {"memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    import resource

    return {"memory/max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
