"""transfer_pages: KV pages between a device pool and a host pool (and host to host), and pack_pages /
unpack_pages, a request's pages in one buffer for a handoff to another GPU (docs/design.md §2)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.compiler import is_compiling

from .. import checks, reference
from ..jit import JitSpec, cuda_arch
from ._op import Op, jit_function
from ._samples import index, rand

__all__ = ["pack_pages", "transfer_pages", "unpack_pages"]

OP = "transfer_pages"
# SMs the CUDA copy may use by default: it runs beside the forward pass and must leave it its SMs, and a
# host<->device copy is bound by the link, which a few SMs' loads in flight saturate.
MAX_SMS = 4


def transfer_pages(src, dst, src_pages, dst_pages, *, max_sms=MAX_SMS, backend=None):
    """Copy page ``src_pages[i]`` of every layer of ``src`` to page ``dst_pages[i]`` of ``dst``.

    A pool is ``[num_layers, num_pages, *page]`` whose page part (every dim after dim 1) is dense, so
    one page of one layer is one contiguous run of ``page_bytes`` bytes; dims 0 and 1 may have any
    strides::

        layer-first pool    [L, P, ...] contiguous                       pass it as is
        page-first pool     [P, L, ...] (sglang HiCache's page_first)    pass pool.transpose(0, 1)
        one layer's cache   [P, ...]                                     pass cache.view(1, P, ...)

    For every i and every layer l: ``dst[l, dst_pages[i]] = src[l, src_pages[i]]``, bitwise.

    Args:
        src: the pool read, any dtype (bf16, fp16, fp32, float8, uint8, ...), or a tuple of pools
            (e.g. ``(k_pool, v_pool)``) moved in one call, each to the pool at its position in dst.
        dst: the pool written in place: src's dtype, page shape and layer count; a tuple when src is.
        src_pages, dst_pages: ``[N]`` int32 or int64 page ids, dense. A pair with a negative id in
            either is padding and is skipped. Of pairs naming one destination page one wins (as torch
            indexing). An id past its pool: IndexError before anything is copied on CPU; skipped on
            CUDA (``JITKV_DEBUG=1`` raises on the host first), docs/design.md §3.
        max_sms: the most SMs the CUDA kernel uses (an int >= 1, default 4; the device's count caps
            it). The copy runs beside the forward pass and must not take its SMs; a host<->device copy
            is bound by the link, which a few SMs saturate. Ignored on CPU and by the torch backend.
        backend: "jit", "torch" or None (auto; also ``JITKV_BACKEND``).

    Devices: the page ids live on the device of the CUDA pool (host to device, device to host, or
    device to device on one GPU), or on the CPU when both pools are CPU tensors. A CPU pool in a copy
    with a GPU must be pinned (``pin_memory()``): ValueError otherwise, as the copy engines read and
    write only page-locked host memory at full speed and a pageable pool would silently stage through
    a bounce buffer. Pools on two different GPUs: ValueError naming both.

    src and dst may be one pool (pages moved inside it); a page both read and written by one call
    gets unspecified bytes.

    Raises:
        TypeError: an argument that is no tensor (or tuple of them), ids not int32/int64, max_sms no int.
        ValueError: src and dst of different dtypes or page shapes (naming both) or layer counts, a
        page part that is not dense, a pool of fewer than 2 dims, ids not 1-D or dense or of different
        lengths, a device rule above broken, tuples of different lengths, max_sms < 1.
        IndexError: an id past its pool (CPU; CUDA under JITKV_DEBUG=1), before anything is copied.

    Algorithm: CPU (host to host) — the pairs resolved serially first (padding skipped, range checked,
    the last pair of each destination page kept), then one memcpy of page_bytes per (pair, layer) run,
    OpenMP over the runs above a payload threshold. CUDA: an SM copy kernel, one launch per pool pair
    on the current stream, no host sync (graph-safe in every direction): a warp per pair and
    interleaved set of its layers (about 8 such items per warp), a grid-stride loop, 16-byte vectors
    when every pointer, stride and page_bytes allows (else 4 or 1 bytes), host pools read and written
    in place through their pinned mapping (UVA); a grid of at most ``max_sms`` x 4 CTAs of 8 warps. A
    pair whose destination page a later valid pair names is skipped (a warp-wide scan of the later
    ids), so the last one wins as on CPU. A copy-engine path (cudaMemcpyBatchAsync, no SMs at all) is
    still to come. The torch reference (gather, then ``index_copy_`` of byte views) is the fallback;
    it reads the plan on the host for host pools.
    """
    if isinstance(src, (tuple, list)) or isinstance(dst, (tuple, list)):
        _transfer_tuples(src, dst, src_pages, dst_pages, max_sms, backend)
        return
    TRANSFER_PAGES.run((src, dst, src_pages, dst_pages, max_sms), backend)


def _transfer_tuples(src, dst, src_pages, dst_pages, max_sms, backend):
    """Each (src[j], dst[j]) pair, all checked (and on CPU ids, range checked) before any is copied."""
    if not isinstance(src, (tuple, list)):
        raise TypeError(f"{OP}: src: expected a tuple of pools like dst, got {type(src).__name__}")
    if not isinstance(dst, (tuple, list)):
        raise TypeError(f"{OP}: dst: expected a tuple of {len(src)} pools like src, got {type(dst).__name__}")
    if not src:
        raise ValueError(f"{OP}: src: expected at least one pool, got an empty tuple")
    if len(dst) != len(src):
        raise ValueError(f"{OP}: dst: expected {len(src)} pools like src, got {len(dst)}")
    if not is_compiling():
        for j, (s, d) in enumerate(zip(src, dst)):
            _check(s, d, src_pages, dst_pages, f"src[{j}]", f"dst[{j}]")
        _max_sms(max_sms)
        if src_pages.is_cpu:
            for s, d in zip(src, dst):
                reference.check_pages(src_pages, dst_pages, s.shape[1], d.shape[1])
    for s, d in zip(src, dst):
        TRANSFER_PAGES.run((s, d, src_pages, dst_pages, max_sms), backend)


def pack_pages(src, src_pages, out, *, max_sms=MAX_SMS, backend=None):
    """Pack a request's pages into one buffer: ``out[i] = src[:, src_pages[i]]``, all layers.

    The pack format (docs/design.md §2) is page-first: ``out [N, L, *page]``, request page i's L layers
    contiguous, so a prefix of pages is a prefix of the buffer. For a tuple of K pools (K and V)
    ``out [N, K, L, *page]``: page i holds pool 0's L layers, then pool 1's. out is contiguous, of
    src's dtype. Pages with a negative id in src_pages are left as they were in out.

    Args:
        src: a pool ``[L, P, *page]`` or a tuple of K such pools (see ``transfer_pages``).
        src_pages: ``[N]`` int32/int64 on the CUDA pool's device (or CPU for host pools).
        out: ``[N, L, *page]`` or ``[N, K, L, *page]``, written in place (a pinned CPU tensor for a
            device pool, or a device tensor: a device-to-device pack).
        max_sms, backend: as ``transfer_pages``.

    Raises:
        ValueError: out of the wrong shape, dtype or layout (naming out); anything ``transfer_pages``
        raises for ``transfer_pages(src, out.transpose(0, 1), src_pages, arange(N))``.

    Algorithm: ``transfer_pages`` with out viewed as a pool and destination pages ``0..N-1``.
    """
    op = "pack_pages"
    pools = _pools(op, "src", src)
    n = checks.tensor(op, "src_pages", src_pages).numel()
    views = _buffer_views(op, "out", out, pools, n, isinstance(src, (tuple, list)))
    pages = torch.arange(n, dtype=src_pages.dtype, device=src_pages.device)
    transfer_pages(
        src, views if isinstance(src, (tuple, list)) else views[0], src_pages, pages, max_sms=max_sms, backend=backend
    )


def unpack_pages(buf, dst, dst_pages, *, max_sms=MAX_SMS, backend=None):
    """Unpack a ``pack_pages`` buffer into a pool: ``dst[:, dst_pages[i]] = buf[i]``, all layers.

    Args:
        buf: ``[N, L, *page]`` or, for a tuple of K pools, ``[N, K, L, *page]`` (the pack format),
            contiguous, of dst's dtype.
        dst: a pool ``[L, P, *page]`` or a tuple of K pools, written in place.
        dst_pages: ``[N]`` int32/int64 on the CUDA pool's device (or CPU for host pools); a negative
            id skips that page of buf.
        max_sms, backend: as ``transfer_pages``.

    Raises:
        ValueError: buf of the wrong shape, dtype or layout (naming buf); anything ``transfer_pages``
        raises for ``transfer_pages(buf.transpose(0, 1), dst, arange(N), dst_pages)``.

    Algorithm: ``transfer_pages`` with buf viewed as a pool and source pages ``0..N-1``.
    """
    op = "unpack_pages"
    pools = _pools(op, "dst", dst)
    n = checks.tensor(op, "dst_pages", dst_pages).numel()
    views = _buffer_views(op, "buf", buf, pools, n, isinstance(dst, (tuple, list)))
    pages = torch.arange(n, dtype=dst_pages.dtype, device=dst_pages.device)
    transfer_pages(
        views if isinstance(dst, (tuple, list)) else views[0], dst, pages, dst_pages, max_sms=max_sms, backend=backend
    )


def _pools(op, name, pools):
    """The pools of a pack or unpack (one, or a tuple of them), each a tensor of at least 2 dims."""
    is_tuple = isinstance(pools, (tuple, list))
    seq = pools if is_tuple else (pools,)
    if not seq:
        raise ValueError(f"{op}: {name}: expected at least one pool, got an empty tuple")
    for j, t in enumerate(seq):
        label = f"{name}[{j}]" if is_tuple else name
        checks.tensor(op, label, t)
        if t.dim() < 2:
            raise ValueError(
                f"{op}: {label}: expected a pool [num_layers, num_pages, *page], got shape {list(t.shape)}"
            )
    return seq


def _buffer_views(op, name, buf, pools, n, is_tuple):
    """The pack buffer ``buf`` as one pool view ``[L, N, *page]`` per pool, after checking it."""
    checks.tensor(op, name, buf)
    first = pools[0]
    want = [n, *([len(pools)] if is_tuple else []), *first.shape[:1], *first.shape[2:]]
    if list(buf.shape) != want or buf.dtype != first.dtype:
        raise ValueError(
            f"{op}: {name}: expected dtype {checks.dtype_name(first.dtype)} and shape {want} (the pack format), "
            f"got {checks.dtype_name(buf.dtype)} and {list(buf.shape)}"
        )
    if not buf.is_contiguous():
        raise ValueError(f"{op}: {name}: expected a contiguous tensor (the pack format), got strides {buf.stride()}")
    if not is_tuple:
        return [buf.transpose(0, 1)]
    return [buf.select(1, j).transpose(0, 1) for j in range(len(pools))]


# ---------------------------------------------------------------------------------------- checks


def check(src, dst, src_pages, dst_pages, max_sms):
    """Every check of csrc/transfer/parse.h, and the device rules; the arguments unchanged."""
    _check(src, dst, src_pages, dst_pages, "src", "dst")
    _max_sms(max_sms)
    return src, dst, src_pages, dst_pages, max_sms


def _max_sms(max_sms):
    if isinstance(max_sms, bool) or not isinstance(max_sms, int):
        raise TypeError(f"{OP}: max_sms: expected an int, got {type(max_sms).__name__}")
    if max_sms < 1:
        raise ValueError(f"{OP}: max_sms: expected an int >= 1, got {max_sms}")


def _check(src, dst, src_pages, dst_pages, sname, dname):
    for name, t in ((sname, src), (dname, dst), ("src_pages", src_pages), ("dst_pages", dst_pages)):
        checks.tensor(OP, name, t)
    dev = src_pages.device
    checks.index(OP, "src_pages", src_pages, dev, "src_pages")
    checks.index(OP, "dst_pages", dst_pages, dev, "src_pages")
    _devices(src, dst, dev, sname, dname)
    _page_bytes(sname, src)
    _page_bytes(dname, dst)
    if src.dtype != dst.dtype or src.shape[2:] != dst.shape[2:]:
        raise ValueError(
            f"{OP}: {dname}: expected dtype {checks.dtype_name(src.dtype)} and page shape {list(src.shape[2:])} "
            f"like {sname}, got {checks.dtype_name(dst.dtype)} and {list(dst.shape[2:])}"
        )
    if src.shape[0] != dst.shape[0]:
        raise ValueError(f"{OP}: {dname}: expected {src.shape[0]} layers like {sname}, got {dst.shape[0]}")
    checks.written(OP, dname, dst)
    if dst_pages.numel() != src_pages.numel():
        raise ValueError(
            f"{OP}: dst_pages: expected {src_pages.numel()} entries like src_pages, got {dst_pages.numel()}"
        )


def _devices(src, dst, dev, sname, dname):
    """The ids' device is the CUDA pool's (a CPU pool beside it pinned), or the CPU for two host pools."""
    pools = ((sname, src), (dname, dst))
    if dev.type == "cpu":
        for name, t in pools:
            if not t.is_cpu:
                raise ValueError(
                    f"{OP}: src_pages: expected a tensor on {t.device} like {name} (page ids live on the "
                    "CUDA pool's device), got one on cpu"
                )
        return
    if src.is_cpu and dst.is_cpu:
        raise ValueError(
            f"{OP}: src_pages: expected a tensor on cpu like {sname} and {dname} (a host-to-host transfer), "
            f"got one on {dev}"
        )
    for name, t in pools:
        if t.is_cpu:
            if not t.is_pinned():
                raise ValueError(
                    f"{OP}: {name}: expected a pinned CPU tensor (pin_memory()) for a copy with {dev}, "
                    "got one that is not pinned"
                )
        else:
            checks.same_device(OP, name, t, dev, "src_pages")


def _page_bytes(name, t):
    """A pool ``[num_layers, num_pages, *page]`` with a dense page part (the message of parse.h)."""
    if t.dim() < 2:
        raise ValueError(f"{OP}: {name}: expected a pool [num_layers, num_pages, *page], got shape {list(t.shape)}")
    want = 1
    for d in range(t.dim() - 1, 1, -1):
        if t.shape[d] != 1 and t.stride(d) != want:
            raise ValueError(
                f"{OP}: {name}: expected a dense page part (every dim after dim 1 contiguous), got shape "
                f"{list(t.shape)} with stride {t.stride(d)} at dim {d}"
            )
        want *= t.shape[d]
    return want * t.element_size()


def debug_check(src, dst, src_pages, dst_pages, max_sms):
    """JITKV_DEBUG=1 on CUDA: the page ids against their pools, on the host."""
    reference.check_pages(src_pages, dst_pages, src.shape[1], dst.shape[1])


# -------------------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    """The CUDA module a call runs: the kernel's vector bytes, 16 when every data pointer, layer and
    page stride and the page bytes are multiples of 16, else 4 when they are of 4, else 1."""

    vec: int


VECS = (16, 4, 1)


def variant(src, dst, src_pages, dst_pages, max_sms) -> tuple:
    """The fields of the CUDA Variant, read on every CUDA call. Pools the binding refuses anyway (fewer
    than 2 dims) go to the widest module for its precise error."""
    if src.dim() < 2 or dst.dim() < 2:
        return (16,)
    ses, des = src.element_size(), dst.element_size()
    page_bytes = math.prod(src.shape[2:]) * ses
    values = (
        src.data_ptr(),
        dst.data_ptr(),
        src.stride(0) * ses,
        src.stride(1) * ses,
        dst.stride(0) * des,
        dst.stride(1) * des,
        page_bytes,
    )
    for vec in VECS[:-1]:
        if all(v % vec == 0 for v in values):
            return (vec,)
    return (1,)


# ------------------------------------------------------------------------------------------- jit


def cpu_spec() -> JitSpec:
    return JitSpec("transfer_cpu", ("transfer/transfer_pages_cpu.cpp",), exports=(OP,))


def cuda_spec(arch: str, vec: int) -> JitSpec:
    """The CUDA module copying ``vec``-byte vectors (16, 4 or 1)."""
    return JitSpec(
        "transfer_cuda", ("transfer/transfer_pages_cuda.cu",), args=(("vec", vec),), target=arch, exports=(OP,)
    )


def specs(target: str) -> list[JitSpec]:
    if target == "cpu":
        return [cpu_spec()]
    return [cuda_spec(target, vec) for vec in VECS]


def _jit(device, variant):
    if device.type == "cpu":
        fn, info = jit_function(cpu_spec(), OP)

        def run_cpu(src, dst, src_pages, dst_pages, max_sms):
            _max_sms(max_sms)  # ignored on CPU, but checked as on every backend
            fn(src, dst, src_pages, dst_pages)

        return run_cpu, info
    fn, info = jit_function(cuda_spec(cuda_arch(device), variant.vec), OP)
    return TRANSFER_PAGES.with_debug_checks(device, fn), info


# ------------------------------------------------------------------------------ sample and bench


def sample(device, gen=None) -> dict:
    """bf16 pages of 4 x 2 x 16 over 3 layers, layer-first src to a page-first dst (on a GPU: device
    to device, the graph-safe case), int64 and int32 ids with padding on either side."""
    src = rand((3, 10, 4, 2, 16), torch.bfloat16, device, gen)
    dst = rand((12, 3, 4, 2, 16), torch.bfloat16, device, gen).transpose(0, 1)
    return dict(
        src=src,
        dst=dst,
        src_pages=index([7, 2, -1, 9, 0, 4], torch.int64, device),
        dst_pages=index([1, 11, 5, 4, -1, 0], torch.int32, device),
    )


def _bench_cpu(h) -> list:
    """n pages of 16 tokens x 576 bf16 (an MLA page, 18 KiB) over 8 layers, host to host, layer-first
    src to page-first dst (HiCache's host layout), against the torch reference (index_copy_)."""
    rows = []
    layers, pages, page = 8, 256, (16, 576)
    src = rand((layers, pages, *page), torch.bfloat16)
    dst = rand((pages, layers, *page), torch.bfloat16).transpose(0, 1)
    for n in h.sizes([16, 128]):
        sp, dp = torch.randperm(pages)[:n], torch.randperm(pages)[:n]
        moved = 2 * n * layers * 16 * 576 * 2
        rows += h.rows(
            OP,
            f"{n} pages x {layers} layers, 16 x 576 bf16",
            n,
            moved,
            [
                ("torch reference", lambda sp=sp, dp=dp: reference.transfer_pages(src, dst, sp, dp)),
                ("jitkv jit", lambda sp=sp, dp=dp: transfer_pages(src, dst, sp, dp)),
            ],
        )
    return rows


def _bench_gpu(h) -> list:
    """n pages of 16 x 576 bf16 (18 KiB) of one layer's pool per step, host to device and device to
    host, a pinned page-first host pool of 2048 pages against the device pool, against torch's
    contiguous pinned copy_ of the same bytes (the copy engines' ceiling). "jitkv auto" is timed eagerly
    (were it the torch reference, its host-device copy reads the plan on the host, which graph capture
    does not allow); the SM kernel forced, at max_sms 4 and 16, under graph replay."""
    rows, pages, page = [], 2048, (16, 576)
    page_bytes = 16 * 576 * 2
    for n in h.sizes([64, 512]):
        sp = torch.randperm(pages, device="cuda")[:n]
        dp = torch.randperm(pages, device="cuda")[:n]
        for direction in ("host -> device", "device -> host"):
            dev = [torch.empty((1, pages, *page), dtype=torch.bfloat16, device="cuda") for _ in range(h.layers)]
            host_base = [torch.empty((pages, 1, *page), dtype=torch.bfloat16).pin_memory() for _ in range(h.layers)]
            host = [b.transpose(0, 1) for b in host_base]
            to_dev = direction == "host -> device"
            src, dst = (host, dev) if to_dev else (dev, host)
            flat_host = [b.view(-1)[: n * 16 * 576] for b in host_base]
            flat_dev = [t.view(-1)[: n * 16 * 576] for t in dev]
            flat_src, flat_dst = (flat_host, flat_dev) if to_dev else (flat_dev, flat_host)
            cases = [
                (
                    "torch contiguous pinned copy_",
                    lambda i, a=flat_src, b=flat_dst: b[i].copy_(a[i], non_blocking=True),
                ),
                ("jitkv auto", lambda i, a=src, b=dst: transfer_pages(a[i], b[i], sp, dp)),
                # The SM kernel under graph replay at the default SM bound and at 16 SMs: whether 4 SMs
                # keep the link busy (the default's premise).
                *[
                    (
                        f"jitkv jit, max_sms={m}",
                        lambda i, a=src, b=dst, m=m: transfer_pages(a[i], b[i], sp, dp, max_sms=m, backend="jit"),
                    )
                    for m in (MAX_SMS, 16)
                ],
            ]
            rows += h.rows(
                OP,
                f"{n} pages of 16 x 576 bf16, {direction}",
                n,
                2 * n * page_bytes,
                cases,
                eager=("torch contiguous pinned copy_", "jitkv auto"),
            )
            dev = host_base = host = src = dst = flat_host = flat_dev = flat_src = flat_dst = cases = None  # freed
    return rows


TRANSFER_PAGES = Op(
    transfer_pages,
    schema="(Tensor src, Tensor(a!) dst, Tensor src_pages, Tensor dst_pages, *, int max_sms=4)",
    home="src_pages",
    check=check,
    debug_check=debug_check,
    variant=variant,
    variant_type=Variant,
    specs=specs,
    reference=reference.transfer_pages,
    sample=sample,
    bench_cpu=_bench_cpu,
    bench_gpu=_bench_gpu,
    backends={"cuda": ("jit", "torch")},
)
TRANSFER_PAGES.backend("jit")(_jit)
