"""ensure_ray starts a local node again when it misses Ray's fixed 30 s registration wait, and only then.

A raylet that registers late cannot be produced on demand, so ray.init is replaced by one that raises
Ray's own message for it (ray/_private/node.py) the given number of times."""

from __future__ import annotations

import os

import pytest
import ray

from hybridflow.controller import resource_pool

TIMEOUT = "The current node timed out during startup. This could happen because some of the raylet failed to startup"


def _fake_init(monkeypatch, errors: list[Exception]):
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if errors:
            raise errors.pop(0)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    return calls


def test_a_late_node_is_started_again_with_one_line(monkeypatch, capsys):
    calls = _fake_init(monkeypatch, [Exception(TIMEOUT)])
    resource_pool.ensure_ray(address="local", num_cpus=2)
    assert calls == [
        {"address": "local", "num_cpus": 2, "include_dashboard": False},
        "shutdown",
        {"address": "local", "num_cpus": 2, "include_dashboard": False},
    ]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hybridflow: the local Ray node did not start within Ray's 30 s; starting it again (1/2)"]


def test_other_errors_and_the_last_timeout_are_raised(monkeypatch):
    calls = _fake_init(monkeypatch, [ValueError("bad num_cpus")])
    with pytest.raises(ValueError, match="bad num_cpus"):
        resource_pool.ensure_ray(address="local")
    assert len(calls) == 1  # not retried
    calls = _fake_init(monkeypatch, [Exception(TIMEOUT)] * 3)
    with pytest.raises(Exception, match="timed out during startup"):
        resource_pool.ensure_ray(address="local")
    assert [c for c in calls if c != "shutdown"] == [{"address": "local", "include_dashboard": False}] * 3


@pytest.mark.parametrize("on_cpu", [True, False])
def test_cpu_workers_get_rays_jemalloc_unless_the_user_chose_an_allocator(monkeypatch, on_cpu):
    for key in (
        "LD_PRELOAD",
        "MALLOC_CONF",
        "RAY_LD_PRELOAD_ON_WORKERS",
        "OMP_WAIT_POLICY",
        "GOMP_SPINCOUNT",
    ):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(resource_pool, "ray_jemalloc", lambda: "/ray/core/libjemalloc.so")
    env = resource_pool.embedded_worker_env(compute_on_cpu=on_cpu)
    heap = {"RAY_LD_PRELOAD_ON_WORKERS": "1", "MALLOC_CONF": resource_pool.CPU_MALLOC_CONF}
    assert env == {"GOMP_SPINCOUNT": resource_pool.WORKER_SPIN_COUNT, **(heap if on_cpu else {})}
    for key, value in (("MALLOC_CONF", "narenas:2"), ("LD_PRELOAD", "/usr/lib/libtcmalloc.so")):
        monkeypatch.setenv(key, value)  # the user's own choice reaches the workers as it is
        assert "MALLOC_CONF" not in resource_pool.embedded_worker_env(compute_on_cpu=on_cpu)
        monkeypatch.delenv(key)
    monkeypatch.setattr(resource_pool, "ray_jemalloc", lambda: None)  # a Ray build without it
    assert "MALLOC_CONF" not in resource_pool.embedded_worker_env(compute_on_cpu=on_cpu)


def test_the_allocator_env_is_set_while_ray_starts_and_the_drivers_restored(monkeypatch):
    for key in ("LD_PRELOAD", "MALLOC_CONF", "RAY_LD_PRELOAD_ON_WORKERS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(resource_pool, "ray_jemalloc", lambda: "/ray/core/libjemalloc.so")
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(os.environ.get("MALLOC_CONF")))
    resource_pool.ensure_ray(compute_on_cpu=True, address="local")
    assert seen == [resource_pool.CPU_MALLOC_CONF]
    assert "MALLOC_CONF" not in os.environ and "RAY_LD_PRELOAD_ON_WORKERS" not in os.environ
