"""The device-strict mode's rules (hybridflow/controller/strict_device.py), one by one, in this process."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.controller import strict_device as sd
from hybridflow.controller.strict_device import ACCEL, DEVICE, HOST, StrictDeviceError, tag


def test_where_tensors_come_from():
    with sd.strict_scope():
        host = torch.ones(3)  # a factory with no device
        dev = host.to(ACCEL)
        assert (tag(host), tag(dev)) == (HOST, DEVICE) and dev is not host  # the original keeps its side
        assert dev.device == ACCEL and host.device == torch.device("cpu")
        assert tag(torch.zeros(2, device=dev.device)) == DEVICE  # the idiom device=x.device
        assert tag(torch.zeros_like(dev)) == DEVICE and tag(dev.new_zeros(2)) == DEVICE
        assert tag(dev.cpu()) == HOST and tag(dev.to("cpu")) == HOST and tag(dev) == DEVICE
        assert tag(dev * 2 + 1) == DEVICE and tag(dev.sum()) == DEVICE
        assert all(tag(t) == DEVICE for t in dev.split(1))
        linear = torch.nn.Linear(3, 2).to(ACCEL)  # Module.to places the parameters themselves
        assert tag(linear.weight) == DEVICE and tag(linear(dev)) == DEVICE


def test_mixing_raises_naming_the_op_except_where_a_gpu_allows_it():
    with sd.strict_scope():
        host, dev = torch.ones(3), torch.ones(3, device=ACCEL)
        with pytest.raises(
            StrictDeviceError, match=r"^Tensor.mul: a device tensor \(3,\) float32 meets a host"
        ):
            dev * host
        with pytest.raises(StrictDeviceError, match="^torch.cat: "):
            torch.cat([dev, host])
        assert tag(dev * torch.tensor(2.0)) == DEVICE  # a 0-dim host tensor is allowed, as on a GPU
        dev.copy_(host)  # copies and indexing with host indices cross the line legitimately
        assert tag(dev[torch.tensor([0, 2])]) == DEVICE
        assert torch.equal((host + host).cpu(), torch.full((3,), 2.0))  # host with host is fine


def test_a_batch_from_the_driver_is_host_and_outputs_must_be():
    batch = Batch({"a": torch.ones(2, 3), "b": torch.zeros(2)})
    sd.mark_host(batch)
    assert tag(batch["a"]) == tag(batch["b"]) == HOST
    with sd.strict_scope():
        moved = batch.to(ACCEL)
        assert tag(moved["a"]) == DEVICE and tag(batch["a"]) == HOST
        with pytest.raises(StrictDeviceError, match="^actor.compute_log_prob returns 'a' .* on the device"):
            sd.check_output(moved, "actor.compute_log_prob")
        sd.check_output(Batch({"a": moved["a"].cpu()}), "actor.compute_log_prob")


def test_collectives_refuse_host_tensors():
    """One gloo rank standing in for NCCL: dist.* and a directly built group's Backend methods."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with sd.strict_scope():
            with pytest.raises(
                StrictDeviceError, match=r"^torch.distributed.all_reduce on a host tensor \(2,\)"
            ):
                dist.all_reduce(torch.ones(2))
            t = torch.ones(2, device=ACCEL)
            dist.all_reduce(t)
            pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
            opts = dist.BroadcastOptions()
            with pytest.raises(StrictDeviceError, match="^Backend.broadcast on a host tensor"):
                pg.broadcast([torch.ones(2)], opts)
            pg.broadcast([t], opts).wait()
    finally:
        dist.destroy_process_group()


def test_enabled_by_the_environment(monkeypatch):
    monkeypatch.delenv(sd.ENV, raising=False)
    assert not sd.enabled()
    monkeypatch.setenv(sd.ENV, "1")
    assert sd.enabled()


def test_point_to_point_ops_pass_torch_checks_and_refuse_host_tensors():
    """The pipeline stages' sends and receives: a P2POp takes the checked isend (torch compares the op with
    its own isend / irecv), and a host tensor in one raises before anything is sent."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with sd.strict_scope():
            dev = torch.ones(2, device=ACCEL)
            assert dist.P2POp(dist.isend, dev, 0).op is dist.isend  # raised ValueError: Invalid ``op``
            with pytest.raises(StrictDeviceError, match=r"^torch.distributed.isend on a host tensor"):
                dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), 0)])
    finally:
        dist.destroy_process_group()
