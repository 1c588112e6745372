"""benchmarks/gpu_check.sh on a machine without a GPU: the CPU steps pass, then it stops with exit code 3
and says "no GPU"; benchmarks/host_syncs.py counts the decoder's host reads per round."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from draftsmith.config import CONFIG_DIR

from .conftest import benchmark_script

ROOT = os.path.dirname(CONFIG_DIR)


def test_host_reads_are_counted_and_the_methods_restored():
    hs = benchmark_script("host_syncs")
    t = torch.tensor([3, 4])
    item = torch.Tensor.item
    with hs.count_host_reads() as reads:
        t[0].item()
        t.tolist()
        int(t[1])
        bool(t[0] > 1)
        _ = t + 1  # no read
    assert dict(reads) == {"item": 1, "tolist": 1, "__int__": 1, "__bool__": 1}
    assert torch.Tensor.item is item


def test_decoder_host_reads_per_round_within_budget():
    hs = benchmark_script("host_syncs")
    torch.set_num_threads(1)
    target = hs.tiny_target()
    for name, drafter in hs.drafters_for(target).items():
        row = hs.measure(target, drafter, [[5, 6, 7, 8, 9, 10]], k=4, max_new_tokens=24)
        assert row["rounds"] > 0
        # at least the acceptance reads the verified tokens every round; at most the budget written down
        assert 1 <= row["host_reads_per_round"] <= hs.budget_per_round(4), (name, row)


def test_peak_table_matches_device_names():
    gc = benchmark_script("gpu_check")
    assert gc.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gc.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gc.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gc.peak_tflops("NVIDIA A10G") == 70.0
    assert gc.peak_tflops("NVIDIA L40S") == 362.0
    assert gc.peak_tflops("Some New GPU") is None


@pytest.mark.slow  # five Python processes (~1–2 min on a loaded 2-core machine)
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs in full (minutes)")
def test_gpu_check_stops_with_no_gpu_after_the_cpu_steps(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_SKIP_SETUP="1", GPU_CHECK_OUT=str(out), GPU_CHECK_PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no GPU: torch sees no CUDA device here" in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["status"] == "no_gpu"
    steps = report["steps"]
    assert sorted(steps) == ["env", "gpu_tests_collected", "host_syncs_cpu", "scale"]
    for name in ("scale", "host_syncs_cpu", "gpu_tests_collected"):
        assert steps[name]["ok"] and steps[name]["rc"] == 0, (name, steps[name])
    assert steps["env"]["rc"] == 3 and steps["env"]["reason"].startswith("no GPU")
    assert steps["host_syncs_cpu"]["host_reads_per_round"] <= steps["host_syncs_cpu"]["budget_per_round"]
    assert "gpu_check: no_gpu" in (out / "summary.txt").read_text()
    collected = (out / "raw" / "gpu_tests_collected.log").read_text()
    assert "test_gpu_engine_is_nccl_on_local_rank_with_fp32_buffers" in collected
    assert "test_greedy_identity_on_the_gpu_and_syncs_per_round" in collected
