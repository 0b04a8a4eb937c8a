"""The start-up hint of `hybridflow train` (trainers/speed_hint.py): which settings are priced, and the line
for a config the planner predicts slower than a setting its resources allow."""

from __future__ import annotations

import pytest

from hybridflow.config import load_config
from hybridflow.models.cpu import parse
from hybridflow.models.tiny import save_tiny_model
from hybridflow.trainers import speed_hint
from hybridflow.trainers.speed_hint import AHEAD, BF16, candidates, cpu_computes_bf16, faster_setting


def test_bf16_cpus_from_their_flags():
    assert cpu_computes_bf16(parse("flags : fpu sse avx2 amx_bf16 amx_tile\n"))
    assert cpu_computes_bf16(parse("flags : fpu avx512f avx512_bf16\n"))
    assert not cpu_computes_bf16(parse("flags : fpu sse avx2 fma\n"))  # AVX2 only: bf16 far slower than fp32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hint")
    return {size: save_tiny_model(tmp / size, size) for size in ("tiny", "medium")}


def overrides(model, devices: int, *extra: str) -> list[str]:
    return ["algorithm.name=grpo", f"model.path={model}", "data.dataset=synthetic:arithmetic", "rollout.n=4",
            "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.response_length=32",
            "resources.device=cpu", f"resources.n_gpus_per_node={devices}", *extra]  # fmt: skip


def test_the_settings_priced(models, monkeypatch):
    monkeypatch.setattr(speed_hint, "cpu_computes_bf16", lambda: True)
    cfg = lambda size, devices, *extra: load_config(None, overrides(models[size], devices, *extra))  # noqa: E731
    # one device: nothing ahead; the 0.1M model's GEMMs are too small for bf16
    assert candidates(cfg("tiny", 1)) == []
    assert candidates(cfg("tiny", 2)) == [[AHEAD]]
    assert candidates(cfg("medium", 2)) == [[AHEAD], [BF16], [BF16, AHEAD]]
    assert candidates(cfg("medium", 2, "model.dtype=bfloat16", "trainer.rollout_ahead=1")) == []
    monkeypatch.setattr(speed_hint, "cpu_computes_bf16", lambda: False)
    assert candidates(cfg("medium", 1)) == []


def test_the_line_names_the_faster_setting_and_its_gain(models, monkeypatch):
    monkeypatch.setattr(speed_hint, "cpu_computes_bf16", lambda: True)
    base = overrides(models["medium"], 2)
    line = faster_setting(load_config(None, base), lambda extra: load_config(None, [*base, *extra]))
    assert line is not None and line.startswith("hint: model.dtype=bfloat16"), line
    gain = float(line.split("predicted ")[1].split("x faster")[0])
    assert gain >= speed_hint.MIN_GAIN
    # the planner's own figures, read again: the gain is the ratio of its step times
    now = speed_hint.predicted_seconds(load_config(None, base))
    chosen = line.split("hint: ")[1].split(" is predicted")[0].split()
    assert gain == pytest.approx(
        now / speed_hint.predicted_seconds(load_config(None, [*base, *chosen])), abs=0.01
    )
    done = overrides(models["medium"], 2, "model.dtype=bfloat16", "trainer.rollout_ahead=1")
    assert faster_setting(load_config(None, done), lambda extra: load_config(None, [*done, *extra])) is None


def test_train_prints_the_line_and_never_fails_on_it(models, monkeypatch, capsys):
    from hybridflow.trainers.cli import say_faster_setting

    monkeypatch.setattr(speed_hint, "cpu_computes_bf16", lambda: True)
    base = overrides(models["medium"], 1)
    say_faster_setting(load_config(None, base), lambda extra: load_config(None, [*base, *extra]))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("hybridflow train: hint: model.dtype=bfloat16 is predicted")

    def broken(extra):
        raise KeyError("a planner bug")

    say_faster_setting(load_config(None, base), broken)  # advice only: nothing printed, nothing raised
    assert capsys.readouterr().out == ""
