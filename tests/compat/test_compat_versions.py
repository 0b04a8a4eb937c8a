"""The version check `hybridflow train` runs before Ray starts (hybridflow/compat/versions.py): vendor
builds of a supported release pass, anything older is refused in one line naming the minimum."""

from __future__ import annotations

import logging

import pytest

from hybridflow.compat import versions
from hybridflow.errors import UserError

OK = {"torch": "2.13.0+cpu", "transformers": "5.24.0", "ray": "2.60.0"}


@pytest.mark.parametrize(
    "version, want",
    [("2.11.0+cu130", (2, 11, 0)), ("2.11.0a0+git9f2b", (2, 11, 0)), ("2.13.0.dev20260101", (2, 13, 0)),
     ("5.17.0", (5, 17, 0)), ("5.24", (5, 24)), ("2.9.1rc2", (2, 9, 1))],
)  # fmt: skip
def test_release_ignores_local_and_pre_release_tags(version, want):
    assert versions.release(version) == want


@pytest.mark.parametrize(
    "torch_version", ["2.11.0+cu130", "2.11.0a0+gitabc", "2.12.1", "2.13.0+cpu", "3.0.0"]
)
def test_supported_torch_passes(torch_version):
    line = versions.check_versions({**OK, "torch": torch_version, "transformers": "5.17.0"})
    assert line == f"torch {torch_version}, transformers 5.17.0, ray 2.60.0"


@pytest.mark.parametrize(
    "found, message",
    [
        ({**OK, "torch": "2.10.2+cu128"}, "hybridflow needs torch >= 2.11, found 2.10.2+cu128"),
        ({**OK, "torch": "1.13.1"}, "hybridflow needs torch >= 2.11, found 1.13.1"),
        ({**OK, "transformers": "5.16.1"}, "hybridflow needs transformers >= 5.17, found 5.16.1"),
        ({**OK, "transformers": "4.57.6"}, "hybridflow needs transformers >= 5.17, found 4.57.6"),
        ({**OK, "transformers": "missing"}, "hybridflow needs transformers >= 5.17, found missing"),
    ],
)
def test_older_releases_are_refused_in_one_line(found, message):
    with pytest.raises(UserError) as err:
        versions.check_versions(found)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_installed_versions_are_this_venvs():
    import ray
    import torch
    import transformers

    found = versions.installed_versions()
    assert found == {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ray": ray.__version__,
    }
    versions.check_versions(found)  # the dev venv itself passes


def test_train_refuses_an_old_torch_before_ray_starts(monkeypatch, capsys, caplog):
    import ray

    from hybridflow.trainers import cli

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(versions, "installed_versions", lambda: {**OK, "torch": "2.10.0+cu126"})
    with caplog.at_level(logging.INFO, logger=versions.__name__):
        rc = cli.main(["examples/configs/grpo_tiny.yaml"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == ["hybridflow train: hybridflow needs torch >= 2.11, found 2.10.0+cu126 "
                   "(docs/operations.md, 'Supported versions')"]  # fmt: skip
    assert "versions: torch 2.10.0+cu126, transformers 5.24.0, ray 2.60.0" in caplog.text
