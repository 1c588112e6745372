"""Inside the DeepSpeed engine in bf16, RoPE's float32 buffers stay float32 and bit-exact (ZeRO 0/2/3),
through a training step too; an engine that casts them (older DeepSpeed ran ``module.bfloat16()``) is
undone by ``build_engine``. The same on a GPU with NCCL (marker ``gpu``)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.drafters.eagle3 import build_eagle3
from draftsmith.errors import DraftsmithError
from draftsmith.train import distributed

pytestmark = pytest.mark.usefixtures("one_thread")

ROPE_BUFFERS = ["rotary_emb.inv_freq", "rotary_emb.original_inv_freq"]


def tiny_head() -> torch.nn.Module:
    """An EAGLE-3 head for a tiny Llama-3.1-style target (llama3 rope scaling), fp32 on CPU."""
    from transformers import LlamaConfig

    arch = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    head = build_eagle3(arch, torch.nn.Embedding(256, 64), seed=0)
    head.embed_tokens.requires_grad_(False)
    return head


def engine_config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 1 << 30}


def build(head: torch.nn.Module, stage: int):
    return distributed.build_engine(head, engine_config(stage), 1e-3, (0.9, 0.95), 1e-8, 0.0, lambda step: 1.0)


def train_step(engine, device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 12), generator=g).to(device)
    features = torch.randn(2, 12, 3 * 64, generator=g).to(device, torch.bfloat16)
    _, logits = engine(ids, features)
    loss = logits.float().logsumexp(-1).mean()
    engine.backward(loss)
    engine.step()


@pytest.fixture(scope="module")
def world():
    with distributed.process_group() as w:
        yield w


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_rope_buffers_stay_fp32_in_a_bf16_engine(world, stage):
    head = tiny_head()
    before = distributed.fp32_buffers(head)
    assert sorted(before) == ROPE_BUFFERS
    engine = build(head, stage)
    assert next(p for p in engine.module.parameters() if p.requires_grad).dtype == torch.bfloat16  # the engine is bf16
    train_step(engine, world.device)
    distributed.check_fp32_buffers(engine.module, before)  # float32, bit-equal
    assert engine.module.rotary_emb.inv_freq.dtype == torch.float32


def test_an_engine_that_casts_buffers_is_undone(world, monkeypatch):
    import deepspeed

    real = deepspeed.initialize

    def old_deepspeed(*args, **kwargs):  # what DeepSpeed releases before the param-only cast did
        out = real(*args, **kwargs)
        out[0].module.bfloat16()
        return out

    monkeypatch.setattr(deepspeed, "initialize", old_deepspeed)
    head = tiny_head()
    before = distributed.fp32_buffers(head)
    engine = build(head, 2)
    distributed.check_fp32_buffers(engine.module, before)
    train_step(engine, world.device)
    # and the check itself fails on a rounded buffer
    engine.module.rotary_emb.inv_freq.data = engine.module.rotary_emb.inv_freq.data.bfloat16()
    with pytest.raises(DraftsmithError, match=r"buffer 'rotary_emb.inv_freq' of the drafter is no longer the float32 "
                                              r"tensor it was \(bfloat16\)"):
        distributed.check_fp32_buffers(engine.module, before)
    rounded = before["rotary_emb.inv_freq"].bfloat16().float()
    assert not torch.equal(rounded, before["rotary_emb.inv_freq"])  # bf16 really rounds these frequencies


@pytest.mark.gpu
def test_gpu_engine_is_nccl_on_local_rank_with_fp32_buffers(world):
    import torch.distributed as dist

    assert dist.get_backend() == "nccl"
    assert world.device == torch.device("cuda", torch.cuda.current_device())
    head = tiny_head().to(world.device)
    before = distributed.fp32_buffers(head)
    engine = build(head, 3)
    assert next(engine.module.parameters()).device.type == "cuda"
    train_step(engine, world.device)
    distributed.check_fp32_buffers(engine.module, before)
