"""fp32 linear layers through oneDNN (models/cpu_gemm.py, model.cpu_gemm): the same numbers as F.linear,
forward and backward, at every row count its padding buckets meet; a routed HF model trains as the plain one
does; what stays on F.linear (autocast, other dtypes) stays there; `resolve`'s choices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridflow.models import cpu_gemm
from hybridflow.models.cpu import CpuInfo
from hybridflow.models.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="this torch build has no oneDNN linear op")


def test_buckets_bound_padding_and_shapes():
    for m in range(1, 5000):
        b = cpu_gemm.bucket_rows(m)
        assert b >= m and b % 8 == 0
        assert b <= max(64, m * 1.125), (m, b)
    # a micro-batch's token count that moves +-20% around 1,000 meets a handful of shapes, not one per step
    assert len({cpu_gemm.bucket_rows(m) for m in range(800, 1200)}) <= 6


@pytest.mark.parametrize("rows", [1, 7, 8, 63, 65, 300, 1001])
def test_linear_equals_f_linear_forward_and_backward(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 40, generator=g, requires_grad=True)
    b = torch.randn(48, generator=g, requires_grad=True)
    x = torch.randn(rows, 40, generator=g, requires_grad=True)
    up = torch.randn(rows, 48, generator=g)
    got = cpu_gemm.linear(x, w, b)
    (got * up).sum().backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    want = F.linear(x, w, b)
    (want * up).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for mine, ref in zip(grads, (x.grad, w.grad, b.grad)):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_gemm.matmul(x.detach(), w.detach(), b.detach()), want.detach())
    with torch.no_grad():  # the no-autograd path
        torch.testing.assert_close(cpu_gemm.linear(x[None], w, b)[0], want.detach(), rtol=1e-5, atol=1e-5)


def test_padding_never_leaks_nan_into_the_weight_gradient():
    """The padded rows are zeros: a NaN left in fresh memory would reach dW as 0 * NaN."""
    w = torch.randn(16, 24, requires_grad=True)
    x = torch.randn(3, 5, 24)  # 15 rows, padded to 16; 3-D like a model's (batch, seq, hidden)
    cpu_gemm.linear(x, w).sum().backward()
    assert torch.isfinite(w.grad).all()
    torch.testing.assert_close(w.grad, torch.ones(3 * 5, 16).t() @ x.reshape(-1, 24), rtol=1e-5, atol=1e-5)


def test_routed_model_trains_as_the_plain_one():
    plain = build_tiny_model("small", "llama", seed=3)
    routed = build_tiny_model("small", "llama", seed=3)
    n = cpu_gemm.use_onednn(routed)
    assert n == sum(isinstance(m, torch.nn.Linear) for m in routed.modules()) > 0
    assert cpu_gemm.use_onednn(routed) == 0  # idempotent
    assert cpu_gemm.routed(routed.lm_head) and not cpu_gemm.routed(plain.lm_head)
    ids = torch.randint(3, plain.config.vocab_size, (4, 21), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (plain, routed):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(plain.named_parameters(), routed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_what_is_not_fp32_on_cpu_stays_on_f_linear(monkeypatch):
    calls = []
    real = cpu_gemm._mm
    monkeypatch.setattr(cpu_gemm, "_mm", lambda *a: calls.append(a) or real(*a))
    w, x = torch.randn(8, 8), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_gemm.linear(x, w).dtype == torch.bfloat16  # autocast's cast, as F.linear's
    cpu_gemm.linear(x.bfloat16(), w.bfloat16())
    assert not calls
    cpu_gemm.linear(x, w)  # no grad: oneDNN without an autograd node
    cpu_gemm.linear(x, w.requires_grad_()).sum().backward()  # forward + the weight's gradient
    assert len(calls) == 3


def test_resolve():
    assert cpu_gemm.resolve("onednn", "cpu") is True
    assert cpu_gemm.resolve("mkl", "cpu") is False
    assert cpu_gemm.resolve("onednn", torch.device("cuda", 0)) is False  # GPUs: cuBLAS, untouched
    assert cpu_gemm.resolve("auto", "cpu") == cpu_gemm.mkl_slow_path()
    with pytest.raises(ValueError, match="model.cpu_gemm must be one of auto, onednn, mkl"):
        cpu_gemm.resolve("blas", "cpu")


@pytest.mark.parametrize(
    "vendor, flags, onednn",
    [("AuthenticAMD", "fpu avx2 avx512f avx512bw", True),  # MKL's AVX2 kernels on an AVX-512 CPU
     ("AuthenticAMD", "fpu avx2", False),  # AVX2 either way
     ("GenuineIntel", "fpu avx2 avx512f avx512bw", False),  # MKL's own full-width kernels
     ("", "", False)],  # no /proc/cpuinfo (not Linux): PyTorch's path
)  # fmt: skip
def test_auto_follows_the_cpu_not_a_timing(monkeypatch, vendor, flags, onednn):
    monkeypatch.setattr(cpu_gemm, "this_cpu", lambda: CpuInfo(vendor, "", frozenset(flags.split())))
    assert cpu_gemm.resolve("auto", "cpu") is (onednn and cpu_gemm.available())
    assert cpu_gemm.resolve("mkl", "cpu") is False
