"""Pieces every op module shares: jit module acquisition, the Triton probe, debug range checks."""

from __future__ import annotations

import re

import torch

from ..jit import JitSpec, artifact_dir, cuda_arch, env_flag, get_function
from ._dispatch import BackendUnavailable
from ._validate import unsupported_device


def jit_function(spec: JitSpec, name: str):
    """(function, backend_info fields) of a built module; JitUnavailable propagates."""
    return get_function(spec, name), {"key": artifact_dir(spec).name, "artifact": str(artifact_dir(spec))}


def cuda_target(device: torch.device) -> str:
    return cuda_arch(device)


def require_triton(device: torch.device):
    """The jitkv.triton package for a CUDA device, or BackendUnavailable."""
    if device.type != "cuda":
        raise BackendUnavailable("Triton kernels run on CUDA devices only")
    try:
        import triton  # noqa: F401, PLC0415
    except ImportError as e:
        raise BackendUnavailable(f"triton is not installed ({e})") from e


def debug_checks() -> bool:
    """JITKV_DEBUG=1: GPU wrappers check slot ranges on the host first (syncs; not graph-safe).

    Read when an op's backend is resolved (first call per device/shape), not per call."""
    return env_flag("JITKV_DEBUG")


def device_index(op: str, name: str, t) -> int:
    """-1 for a CPU tensor, else the CUDA device index (cheaper than ``t.device``); ValueError for a
    tensor on any other device (meta included), before anything runs."""
    try:
        if t.is_cuda:
            return t.get_device()
        if t.is_cpu:
            return -1
    except AttributeError:
        raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(t).__name__}") from None
    raise unsupported_device(op, name, t)


_FFI_ARG = re.compile(r"Mismatched type on argument #(\d+)")


def name_ffi_error(op: str, err: Exception, arg_names: tuple[str, ...], args: tuple) -> Exception:
    """An error tvm-ffi raises while packing a binding's arguments, naming the argument: a wrong type
    (reported by position), or a tensor on a device DLPack cannot describe (meta: a RuntimeError with
    a C++ frame dump). Any other error is returned as it is."""
    if isinstance(err, RuntimeError):
        bad = [(n, a) for n, a in zip(arg_names, args) if isinstance(a, torch.Tensor) and not (a.is_cpu or a.is_cuda)]
        return unsupported_device(op, *bad[0]) if bad else err
    m = _FFI_ARG.search(str(err))
    if m is None or int(m.group(1)) >= len(arg_names):
        return err
    return TypeError(f"{op}: {arg_names[int(m.group(1))]}: unsupported argument type ({err})")
