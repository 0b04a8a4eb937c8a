"""Device-strict mode: the GPU path's placement bugs made to fail on CPU (docs/operations.md,
"GPU correctness on CPU").

On CPU every tensor lives in one memory, so a tensor the code forgot to move to the device, or a
collective handed a host tensor, passes every CPU test and fails on the first GPU step. In strict mode
(HYBRIDFLOW_STRICT_DEVICE=1 in the driver's environment when the worker groups start) each worker
process computes on a stand-in accelerator, `torch.device("cpu", 0)`, and a TorchFunctionMode active
during every worker call tags tensors by where they would live on a GPU host:

  host    tensors arriving in a call from the driver or another group (Ray), `.cpu()` / `.to("cpu")`
          results, factory calls with no device (`torch.tensor(values)`) or `device="cpu"`;
  device  `.to(accel)` results (a fresh alias when the move is a no-op, so the host original keeps its
          tag), factory calls with `device=accel`, and the output of any op with a device input.

`t.device` reports the stand-in for a device tensor, so `torch.zeros(n, device=x.device)` is a device
tensor as it is on a GPU. An op mixing a device tensor with a host tensor of one or more dimensions raises
StrictDeviceError naming the op (a GPU raises "Expected all tensors to be on the same device"; 0-dim host
tensors are allowed there too). Collectives (torch.distributed.all_reduce, broadcast, ..., the pipeline
stages' isend / irecv) raise on a host tensor: every worker group stands in for NCCL, which has no CPU
backend. Offload (engines/offload.py) is active on the stand-in: its moves to the host tier and back tag
the state (`mark_moved`), so a weight used while offloaded raises as it would on a GPU.

Rules are kept strict on our code and off torch's own: calls made from inside torch (FSDP2 / DTensor
buffers, created with the mesh's plain "cpu" device) neither create host tensors nor see the stand-in
device, so their internals raise nothing. What it cannot see: CUDA-only kernels, dtype support,
memory, NCCL hangs from mismatched collectives, and tensors that never meet a device tensor.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

ENV = "HYBRIDFLOW_STRICT_DEVICE"
ACCEL = torch.device("cpu", 0)  # the stand-in accelerator: a plain "cpu" is the host
_TAG = "_hf_place"
DEVICE, HOST = "device", "host"

_DEVICE_GETTER = torch.Tensor.device  # the getset descriptor behind `t.device`
_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
    torch.linspace, torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye, torch.empty_strided,
    torch.scalar_tensor, torch.from_numpy, torch.frombuffer,
}  # fmt: skip
# Ops that legitimately take a host operand beside a device tensor on a GPU: copies between devices,
# indexing a device tensor with host indices, building a tensor on the device from host data.
_MIXED_OK = {
    torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.__getitem__, torch.Tensor.__setitem__,
    torch.Tensor.new_tensor, torch.Tensor.set_,
}  # fmt: skip
_COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "gather", "scatter", "reduce", "send", "recv", "isend", "irecv", "all_to_all", "all_to_all_single",
    "all_gather_single",
)  # fmt: skip
# Frames of torch's own argument plumbing between our call and the mode.
_PLUMBING = (
    "torch.overrides",
    "torch.functional",
    "torch.nn.functional",
    "torch._tensor",
    "torch.utils._device",
)


class StrictDeviceError(RuntimeError):
    """A tensor on the wrong side of the host/device line: what a GPU run would raise."""


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def tag(t) -> str | None:
    return getattr(t, _TAG, None)


def _set_tag(t, where: str | None) -> None:
    if where is not None and isinstance(t, torch.Tensor):
        with contextlib.suppress(AttributeError):
            setattr(t, _TAG, where)


def mark_host(obj) -> None:
    """Tag the tensors of a Batch (or a tensor, or a list / dict of them) as host: data arriving in a call."""
    from hybridflow.batch import Batch

    if isinstance(obj, Batch):
        obj = list(obj.tensors.values())
    if isinstance(obj, dict):
        obj = list(obj.values())
    for t in obj if isinstance(obj, (list, tuple)) else [obj]:
        _set_tag(t, HOST)


def mark_device(module: torch.nn.Module) -> None:
    """Tag a module's parameters and buffers as device tensors once an engine has placed and sharded it: FSDP2
    builds its sharded parameters inside torch, so they carry no tag of their own. A no-op outside strict mode."""
    if _ACTIVE[0]:
        for t in (*module.parameters(), *module.buffers()):
            _set_tag(t, DEVICE)


def mark_moved(tensors, device) -> None:
    """Tag tensors an engine moved between its device and host tiers through `Module.to` (offload): the move
    runs inside torch, whose moves to a plain "cpu" keep their tag, so the caller says where they went.
    A no-op outside strict mode."""
    if _ACTIVE[0]:
        for t in tensors:
            _set_tag(t, _place(device))


_ACTIVE = [0]  # strict scopes entered in this process


def _caller_is_torch() -> bool:
    """Whether the op was called from inside torch itself (FSDP2, DTensor, optimizers' internals)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name != __name__ and not name.startswith(_PLUMBING):
            return name == "torch" or name.startswith("torch.")
        f = f.f_back
    return False


def _place(device) -> str | None:
    """The tag a tensor created on / moved to `device` gets (None: an explicit non-CPU device)."""
    d = torch.device(device) if isinstance(device, (str, int)) else device
    if not isinstance(d, torch.device) or d.type != "cpu":
        return None
    return DEVICE if d.index is not None else HOST


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):  # ops take lists of tensors, gloo backends lists of lists
            yield from _tensors(a, {})


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _op_name(func) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return name.replace("_VariableFunctionsClass.", "torch.").replace("TensorBase.", "Tensor.")


def _to_target(args, kwargs) -> tuple[bool, str | None]:
    """(whether `.to(...)` names a device, the tag of that device)."""
    if "device" in kwargs:
        return True, _place(kwargs["device"])
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            return True, tag(a) or HOST
        if isinstance(a, (str, torch.device, int)):
            return True, _place(a)
    return False, None


class StrictDeviceMode(TorchFunctionMode):
    """The tagging and checking described in the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE_GETTER:
            out = func(*args)
            return ACCEL if tag(args[0]) == DEVICE and not _caller_is_torch() else out
        if func in (torch.Tensor.to, torch.Tensor.cpu):
            return self._move(func, args, kwargs)
        if func in _FACTORIES or "device" in kwargs:
            out = func(*args, **kwargs)
            if "device" in kwargs and kwargs["device"] is not None:
                # torch's own buffers on its mesh's plain "cpu" stay untagged
                where = _place(kwargs["device"])
                _set_tag(out, None if where == HOST and _caller_is_torch() else where)
            elif func in _FACTORIES and not _caller_is_torch():
                _set_tag(out, HOST)
            elif isinstance(out, torch.Tensor):
                _set_tag(out, self._combine(func, args, kwargs))
            return out
        where = self._combine(func, args, kwargs)
        out = func(*args, **kwargs)
        if where is not None:
            for t in out if isinstance(out, (list, tuple)) else (out,):
                _set_tag(t, where)
        return out

    @staticmethod
    def _combine(func, args, kwargs) -> str | None:
        device = host = None
        for t in _tensors(args, kwargs):
            where = tag(t)
            if where == DEVICE and device is None:
                device = t
            elif where == HOST and (host is None or host.dim() == 0):
                host = t  # a host tensor with dimensions, if there is one
        if device is not None and host is not None and host.dim() > 0 and func not in _MIXED_OK:
            raise StrictDeviceError(
                f"{_op_name(func)}: a device tensor {_describe(device)} meets a host tensor {_describe(host)} "
                "(on a GPU: 'Expected all tensors to be on the same device'); move the host tensor to the "
                "worker's device first"
            )
        return DEVICE if device is not None else (HOST if host is not None else None)

    @staticmethod
    def _move(func, args, kwargs):
        src = args[0]
        if func is torch.Tensor.cpu:
            named, where = True, HOST
        else:
            named, where = _to_target(args, kwargs)
        out = func(*args, **kwargs)
        if not named:
            where = tag(src)
        elif where == HOST and _caller_is_torch():
            where = tag(src)  # torch's own moves to its mesh's plain "cpu" keep the tensor's side
        if isinstance(src, torch.nn.Parameter) and where == DEVICE:
            _set_tag(src, where)  # a model placed on the device (Module.to sets param.data to the moved copy)
        if out is src and where != tag(src):
            out = src.view_as(src)  # a new object for the new tag: the original keeps its side
        _set_tag(out, where)
        return out


def check_output(out, method: str) -> None:
    """A worker call's output goes back through Ray: a device tensor there would be a CUDA tensor
    pickled to the driver (which then opens a CUDA context to unpickle it)."""
    from hybridflow.batch import Batch

    items = out.tensors.items() if isinstance(out, Batch) else out.items() if isinstance(out, dict) else ()
    if isinstance(out, torch.Tensor):
        items = [("output", out)]
    for name, t in items:
        if isinstance(t, torch.Tensor) and tag(t) == DEVICE:
            raise StrictDeviceError(
                f"{method} returns {name!r} {_describe(t)} on the device; return host tensors (.cpu())"
            )


def _checked_collective(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for t in _tensors(args, kwargs):
            if tag(t) == HOST:
                raise StrictDeviceError(
                    f"{name} on a host tensor {_describe(t)}: NCCL has no CPU backend; "
                    "create the tensor on the worker's device"
                )
        return fn(*args, **kwargs)

    wrapper._hf_strict = True
    return wrapper


# A torch.distributed Backend's own methods: what a process group built directly (the weight sync's) runs.
_BACKEND_COLLECTIVES = (
    "broadcast",
    "allreduce",
    "allgather",
    "reduce_scatter",
    "send",
    "recv",
    "gather",
    "scatter",
)


def install_collective_checks() -> None:
    """Wrap torch.distributed's collectives and a Backend's collective methods (once per process) so a host
    tensor in one raises. Collectives torch issues inside FSDP2 / DTensor go through neither."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    for owner, names, prefix in (
        (dist, _COLLECTIVES, "torch.distributed."),
        (torch._C._distributed_c10d.Backend, _BACKEND_COLLECTIVES, "Backend."),
    ):
        for name in names:
            fn = getattr(owner, name, None)
            if fn is not None and not getattr(fn, "_hf_strict", False):
                checked = _checked_collective(prefix + name, fn)
                setattr(owner, name, checked)
                # the same function where torch defines it: P2POp takes only `op is isend / irecv` there
                if getattr(distributed_c10d, name, None) is fn:
                    setattr(distributed_c10d, name, checked)


@contextlib.contextmanager
def strict_scope(active: bool = True):
    """Context: strict mode for a worker call (a no-op unless `active`)."""
    if not active:
        yield
        return
    install_collective_checks()
    _ACTIVE[0] += 1
    try:
        with StrictDeviceMode():
            yield
    finally:
        _ACTIVE[0] -= 1
