"""Pieces every op module shares: jit module acquisition, the Triton probe, debug range checks."""

from __future__ import annotations

import re

import torch

from ..jit import JitSpec, artifact_dir, env_flag, get_module
from ..jit.toolchain import cuda_arch
from ._dispatch import BackendUnavailable


def jit_function(spec: JitSpec, name: str):
    """(function, backend_info fields) of a built module; JitUnavailable propagates."""
    mod = get_module(spec)
    return getattr(mod, name), {"key": artifact_dir(spec).name, "artifact": str(artifact_dir(spec))}


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
    """-1 for a CPU tensor, else the CUDA device index (cheaper than ``t.device``)."""
    try:
        return t.get_device()
    except AttributeError:
        raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(t).__name__}") from None


_FFI_ARG = re.compile(r"Mismatched type on argument #(\d+)")


def name_ffi_type_error(op: str, err: TypeError, arg_names: tuple[str, ...]) -> TypeError:
    """tvm-ffi reports a wrong argument type by position; say which argument it was."""
    m = _FFI_ARG.search(str(err))
    if m is None or int(m.group(1)) >= len(arg_names):
        return err
    return TypeError(f"{op}: {arg_names[int(m.group(1))]}: unsupported argument type ({err})")
