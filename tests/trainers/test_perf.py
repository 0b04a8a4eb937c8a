"""Resource metrics as pure functions: parameter counts from safetensors headers, FLOPs per phase by hand,
achieved FLOP/s and MFU, the accelerator catalogue lookup."""

from __future__ import annotations

import pytest

from hybridflow.trainers.perf import count_params, flops_metrics, peak_flops, phase_flops


def test_count_params_matches_the_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # tied embeddings are stored once, as the model's parameters() counts them
    assert count_params(tiny_model_dir) == sum(p.numel() for p in model.parameters())
    assert count_params(tiny_model_dir) > 1000


def test_phase_flops_and_rates_by_hand():
    # N = 1e6 actor, 5e5 critic, 100 tokens, 2 actor epochs, 1 critic epoch
    f = phase_flops(10**6, 5 * 10**5, 100.0, 2, 1, recompute_old=True)
    assert f == {
        "gen": 2e8, "ref": 2e8, "update_actor": 6e6 * 100 * 2, "old_log_prob": 2e8,
        "values": 1e8, "update_critic": 3e6 * 100,
    }  # fmt: skip
    assert "old_log_prob" not in phase_flops(10**6, 0, 100.0, 1, 1, recompute_old=False)
    assert "values" not in phase_flops(10**6, 0, 100.0, 1, 1, recompute_old=False)
    times = {"timing_s/gen": 2.0, "timing_s/update_actor": 0.5}
    m = flops_metrics(
        {"gen": 4e12, "update_actor": 1e12, "ref": 1e12}, times, {"gen": 2, "update_actor": 1}, 1e12
    )
    assert m["perf/tflops_per_device/gen"] == pytest.approx(1.0)  # 4e12 / 2 s / 2 devices
    assert m["perf/tflops_per_device/update_actor"] == pytest.approx(2.0)
    assert m["perf/mfu/gen"] == pytest.approx(1.0) and m["perf/mfu/update_actor"] == pytest.approx(2.0)
    assert not any("ref" in k for k in m)  # no timer, no figure
    assert "perf/mfu/gen" not in flops_metrics({"gen": 1.0}, {"timing_s/gen": 1.0}, {}, None)


def test_peak_flops_catalogue():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops(None) is None and peak_flops("Some CPU") is None
