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
    # a phase that ran nothing reads the timers' bookkeeping (~10 us): no rate over it, nor just under 1 ms
    tiny = {"timing_s/gen": 2.0, "timing_s/ref": 1.4e-5, "timing_s/update_actor": 0.99e-3}
    m = flops_metrics({"gen": 4e12, "update_actor": 1e12, "ref": 1e12}, tiny, {"gen": 2}, None)
    assert set(m) == {"perf/tflops_per_device/gen"} and m["perf/tflops_per_device/gen"] == pytest.approx(1.0)
    m = flops_metrics({"ref": 1e9}, {"timing_s/ref": 1e-3}, {}, None)
    assert m == {"perf/tflops_per_device/ref": pytest.approx(1.0)}  # 1e9 FLOP / 1e-3 s: at the floor, logged
    assert "perf/mfu/gen" not in flops_metrics({"gen": 1.0}, {"timing_s/gen": 1.0}, {}, None)


def test_peak_flops_catalogue():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops(None) is None and peak_flops("Some CPU") is None


def test_worker_memory_stats_and_the_per_role_max(monkeypatch):
    """A Worker's memory_stats on CPU (host RSS only), and on CUDA with torch.cuda's counters faked
    (no GPU here: only the arithmetic and the reset are checked); memory_metrics takes the max per role."""
    import torch

    from hybridflow.controller import Worker
    from hybridflow.controller.worker import local_worker_context, set_worker_context
    from hybridflow.trainers.perf import memory_metrics

    local_worker_context()
    try:
        stats = Worker().memory_stats()
        assert set(stats) == {"host_peak_rss_gb"} and 0.01 < stats["host_peak_rss_gb"] < 64
        local_worker_context(device="cuda:0")
        reset = []
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 1024**3)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 4 * 1024**3)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H100 80GB HBM3")
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: reset.append(d))
        stats = Worker().memory_stats()
        assert stats["max_memory_allocated_gb"] == 3.0 and stats["max_memory_reserved_gb"] == 4.0
        assert stats["device_name"] == "NVIDIA H100 80GB HBM3" and len(reset) == 1
    finally:
        set_worker_context(None)

    class Group:  # what a WorkerGroup's ONE_TO_ALL call returns: one dict per rank
        def __init__(self, ranks):
            self.ranks, self.calls = ranks, 0

        def memory_stats(self):
            self.calls += 1
            return self.ranks

    actor = Group([{"host_peak_rss_gb": 1.0, "max_memory_allocated_gb": 5.0, "device_name": "NVIDIA H200"},
                   {"host_peak_rss_gb": 2.0, "max_memory_allocated_gb": 3.0, "device_name": "NVIDIA H200"}])  # fmt: skip
    out, name = memory_metrics({"actor_rollout": actor, "ref": actor}, driver=False)
    assert actor.calls == 1 and name == "NVIDIA H200"  # a colocated group is asked once
    assert out["perf/memory/actor_rollout/host_peak_rss_gb"] == 2.0
    assert out["perf/memory/ref/max_memory_allocated_gb"] == 5.0

    class Pending:  # request_memory_stats's Future: read at log time, no call of its own then
        def get(self):
            return [{"host_peak_rss_gb": 7.0}]

    out, _ = memory_metrics({"actor_rollout": actor}, driver=False, pending={id(actor): Pending()})
    assert actor.calls == 1 and out["perf/memory/actor_rollout/host_peak_rss_gb"] == 7.0
