"""transfer_pages: KV pages between a device pool and a host pool (and host to host), and pack_pages /
unpack_pages, a request's pages in one buffer for a handoff to another GPU (docs/design.md §2)."""

from __future__ import annotations

import functools
import math

import torch
from torch.compiler import is_compiling

from .. import checks, codes, reference
from ..jit import JitSpec, JitUnavailable, cuda_arch, get_function
from ._op import Op, jit_function
from ._samples import index, rand

__all__ = ["pack_pages", "transfer_pages", "unpack_pages"]

OP = "transfer_pages"
LINK_SMS = codes.Transfer.LINK_SMS  # the kernel's default SM bound for a copy with a host pool
# The bindings' answers (codes.Status) as plain ints: an enum member's lookup costs a per-call call more.
_DONE, _COPY_ENGINES, _PER_POOL = int(codes.Status.DONE), int(codes.Status.COPY_ENGINES), int(codes.Status.PER_POOL)


def transfer_pages(src, dst, src_pages, dst_pages, *, max_sms=None, backend=None):
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
        src_pages, dst_pages: ``[N]`` int32 or int64 page ids, dense, on the GPU (the SM kernel,
            graph-safe) or on the host (an engine's CPU-side plan; see Devices). A pair with a negative id in
            either is padding and is skipped. An id past its pool: IndexError before anything is
            copied for host ids; skipped for GPU ids (``JITKV_DEBUG=1`` raises on the host first),
            docs/design.md §3. Pairs naming one destination page: with host ids the last valid one
            wins; with GPU ids they race and the page gets 16-byte vectors of any of their sources.
        max_sms: the most SMs the CUDA kernel uses (an int >= 1; the device's count caps it). None
            (the default): 4 (``codes.Transfer.LINK_SMS``) for a copy with a host pool, which runs
            beside the forward pass and must not take its SMs while the link, which a few SMs
            saturate, bounds it; every SM for a copy inside the GPU (a pack for a handoff), which HBM
            bounds. Ignored on CPU, by the copy engines and by the torch backend.
        backend: "jit", "torch" or None (auto; also ``JITKV_BACKEND``).

    Devices: a copy between a GPU and pinned host memory, within one GPU, or between two host pools.
    The page ids live on the CUDA pool's device (the SM kernel: no host sync, graph-safe) or on the
    host (an engine's CPU-side plan, as vLLM's block_mapping: pages of ``CE_MIN_PAGE_BYTES`` or more
    go to the copy engines, which use no SM; smaller ones, and any while a graph is captured, to the SM
    kernel, the pairs passed in its launch's parameter block, so nothing is staged and a captured graph
    keeps the pairs of the capture).
    A CPU pool in a copy with a GPU must be pinned (``pin_memory()``): ValueError otherwise, as the
    copy engines read and write only page-locked host memory at full speed and a pageable pool would
    silently stage through a bounce buffer. Pools on two different GPUs: ValueError naming both.
    ``backend_info`` names the mechanism that ran last on each GPU ("SM copy kernel" or "copy engine").

    src and dst may be one pool (pages moved inside it); a page both read and written by one call
    gets unspecified bytes.

    Raises:
        TypeError: an argument that is no tensor (or tuple of them), ids not int32/int64, max_sms
        neither None nor an int.
        ValueError: src and dst of different dtypes or page shapes (naming both) or layer counts, a
        page part that is not dense, a pool of fewer than 2 dims, ids not 1-D or dense or of different
        lengths, a device rule above broken, tuples of different lengths, max_sms < 1, host ids
        beside a GPU with a pool of 2^31 pages or more (their pairs travel as int32; pass GPU ids).
        IndexError: an id past its pool (host ids; GPU ids under JITKV_DEBUG=1), before anything is
        copied.

    Algorithm: CPU (host to host) — the pairs resolved serially first (padding skipped, range checked,
    the last pair of each destination page kept), then one memcpy of page_bytes per (pair, layer) run,
    OpenMP over the runs above a payload threshold. CUDA, GPU ids: an SM copy kernel, one launch per
    pool pair on the current stream, no host sync (graph-safe in every direction): runs cut into
    chunks of 128 vectors (16 bytes when every pointer, stride and page_bytes allows, else 4 or 1),
    each warp moving two chunks at a time in a grid-stride loop (all their loads before the stores), so
    that large pages spread over the grid and small ones load at once; host pools read and written in
    place through their pinned mapping (UVA); a grid of at most ``max_sms`` x 3 CTAs of 8 warps. CUDA,
    host ids: the pairs resolved on the host as on CPU; pages of ``CE_MIN_PAGE_BYTES`` or more: one
    run per (pair, layer), runs that follow on in both pools merged, all (a tuple's too) in
    ``cudaMemcpyBatchAsync`` calls of 16, 32, 64, then 128 runs on the current stream (the engines
    start on the first while the host submits the rest); smaller pages, or a graph being captured: the SM
    kernel above, the resolved pairs (int32: pools of fewer than 2^31 pages) in the launch's parameter
    block, up to 4,000 a launch (``codes.Transfer``). The torch reference (gather, then
    ``index_copy_`` of byte views) is the fallback; it reads the plan on the host for host pools.
    """
    # An engine's per-layer call first: a (K, V) tuple straight to the bindings, which check every
    # argument (_run_pair), else plain tensors (type(), as isinstance on a tensor costs more).
    pools = type(src)
    if (pools is tuple or pools is list) and type(dst) is pools and len(src) == 2 and not is_compiling():
        try:
            if _run_pair(src, dst, src_pages, dst_pages, max_sms, backend):
                return
        except (TypeError, ValueError):
            _tuple_lengths(src, dst)  # the argument named as every path names it
            _check_tuples(src, dst, src_pages, dst_pages, max_sms)
            raise
    if (type(src) is not torch.Tensor or type(dst) is not torch.Tensor) and (
        isinstance(src, (tuple, list)) or isinstance(dst, (tuple, list))
    ):
        _transfer_tuples(src, dst, src_pages, dst_pages, max_sms, backend)
        return
    TRANSFER_PAGES.run((src, dst, src_pages, dst_pages, max_sms), backend)


def _transfer_tuples(src, dst, src_pages, dst_pages, max_sms, backend):
    """Each (src[j], dst[j]) pair, all checked (and on CPU ids, range checked) before any is copied
    (the calls _run_pair does not take)."""
    _tuple_lengths(src, dst)
    if len(src) == 1:  # one pool: its own call checks everything before it copies
        TRANSFER_PAGES.run((src[0], dst[0], src_pages, dst_pages, max_sms), backend)
        return
    if not is_compiling() and not _checked_by_the_copy_engines(src, dst, src_pages, dst_pages, max_sms):
        _check_tuples(src, dst, src_pages, dst_pages, max_sms)
        if src_pages.is_cpu:  # host pools, or no copy-engine module: the reference's range check
            _check_host_ids(None, None, zip(src, dst), src_pages, dst_pages)
    for s, d in zip(src, dst):
        TRANSFER_PAGES.run((s, d, src_pages, dst_pages, max_sms), backend)


def _tuple_lengths(src, dst):
    """TypeError / ValueError unless src and dst are tuples (or lists) of one length, at least 1."""
    if not isinstance(src, (tuple, list)):
        raise TypeError(f"{OP}: src: expected a tuple of pools like dst, got {type(src).__name__}")
    if not isinstance(dst, (tuple, list)):
        raise TypeError(f"{OP}: dst: expected a tuple of {len(src)} pools like src, got {type(dst).__name__}")
    if not src:
        raise ValueError(f"{OP}: src: expected at least one pool, got an empty tuple")
    if len(dst) != len(src):
        raise ValueError(f"{OP}: dst: expected {len(src)} pools like src, got {len(dst)}")


def _check_tuples(src, dst, src_pages, dst_pages, max_sms):
    """Every pool pair of tuples of one length (_tuple_lengths) checked, and max_sms."""
    for j, (s, d) in enumerate(zip(src, dst)):
        _check(s, d, src_pages, dst_pages, f"src[{j}]", f"dst[{j}]")
    _max_sms(max_sms)


def _checked_by_the_copy_engines(src, dst, src_pages, dst_pages, max_sms) -> bool:
    """Host ids beside a GPU whose copy-engine module is built: its C++ check of every pool pair (the
    Python check's rules, and the ids range checked) before any pool is copied, tens of µs less than
    the Python check; on bad input the Python check raises first, naming the argument. True when it
    ran."""
    try:
        if not src_pages.is_cpu:
            return False
        device, index = _gpu_of((*src, *dst))
    except AttributeError:
        return False
    ce = None if device is None else _copy_engine(device, index)
    if ce is None:
        return False
    try:
        _max_sms(max_sms)
        _check_host_ids(ce, index, zip(src, dst), src_pages, dst_pages)
    except (TypeError, ValueError):
        _check_tuples(src, dst, src_pages, dst_pages, max_sms)
        raise
    return True


def _run_pair(src, dst, src_pages, dst_pages, max_sms, backend) -> bool:
    """A (K, V) tuple in one call, the jit backend running: host ids through the host-ids route
    (_host_ids_route: one launch of the SM kernel, or the copy engines' batches where they take the
    pages), GPU ids in one launch of the SM kernel. Every argument is checked by the binding before
    anything is copied. False where the per-pool path must run instead: the bindings missing, or pools
    of two page sizes or layer counts that the copy engines do not take (Status.PER_POOL).

    This is the engines' per-layer call, so it reads each argument once and finds the launcher in
    the op's runner cache without a lock; the bindings read the shapes and pick the vector width."""
    if backend is not None and backend != "jit":
        return False
    try:
        (s0, s1), (d0, d1) = src, dst
        index = src_pages.get_device()
        host_ids = index < 0
        if host_ids:  # the GPU of the pools, if any
            index = s0.get_device()
            if index < 0:
                index = d0.get_device()
                if index < 0:
                    return False
    except (AttributeError, TypeError, ValueError):
        return False  # the per-pool path names the bad argument
    runner = TRANSFER_PAGES.cuda_runner(index, backend, ())
    if host_ids:
        route = _host_ids_route(runner, index)
        return route is not None and route(s0, d0, src_pages, dst_pages, max_sms, s1, d1) != _PER_POOL
    pair = getattr(runner, "pair", None)
    if pair is None:
        return False
    return pair(s0, d0, s1, d1, src_pages, dst_pages, 0 if max_sms is None else _max_sms(max_sms)) != _PER_POOL


def pack_pages(src, src_pages, out, *, max_sms=None, backend=None):
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
    view, pages = _buffer_as_pool("pack_pages", "src", src, "src_pages", src_pages, "out", out)
    transfer_pages(src, view, src_pages, pages, max_sms=max_sms, backend=backend)


def unpack_pages(buf, dst, dst_pages, *, max_sms=None, backend=None):
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
    view, pages = _buffer_as_pool("unpack_pages", "dst", dst, "dst_pages", dst_pages, "buf", buf)
    transfer_pages(view, dst, pages, dst_pages, max_sms=max_sms, backend=backend)


def _buffer_as_pool(op, pools_name, pools, ids_name, ids, buf_name, buf):
    """A pack buffer as the pool (or tuple of pools) that pairs with ``pools`` in transfer_pages, and
    its pages ``0..N-1`` (N: the ids' count) on the ids' device, after checking pools, ids and buffer."""
    seq = _pools(op, pools_name, pools)
    n = checks.tensor(op, ids_name, ids).numel()
    is_tuple = isinstance(pools, (tuple, list))
    views = _buffer_views(op, buf_name, buf, seq, n, is_tuple)
    return (views if is_tuple else views[0]), torch.arange(n, dtype=ids.dtype, device=ids.device)


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
    """max_sms checked (None or an int >= 1), returned."""
    if max_sms is None:
        return None
    if isinstance(max_sms, bool) or not isinstance(max_sms, int):
        raise TypeError(f"{OP}: max_sms: expected None or an int, got {type(max_sms).__name__}")
    if max_sms < 1:
        raise ValueError(f"{OP}: max_sms: expected an int >= 1, got {max_sms}")
    return max_sms


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
    """The ids on the CUDA pool's device (the SM kernel) or on the host (two host pools, or the copy
    engines); a CPU pool beside a GPU pinned; the CUDA pools on one GPU."""
    pools = ((sname, src), (dname, dst))
    if dev.type == "cpu":
        if src.is_cuda and dst.is_cuda:
            checks.same_device(OP, dname, dst, src.device, sname)
        if src.is_cuda or dst.is_cuda:
            _pinned(pools, src.device if src.is_cuda else dst.device)
        return
    if src.is_cpu and dst.is_cpu:
        raise ValueError(
            f"{OP}: src_pages: expected a tensor on cpu like {sname} and {dname} (a host-to-host transfer), "
            f"got one on {dev}"
        )
    _pinned(pools, dev)
    for name, t in pools:
        if not t.is_cpu:
            checks.same_device(OP, name, t, dev, "src_pages")


def _pinned(pools, dev):
    for name, t in pools:
        if t.is_cpu and not t.is_pinned():
            raise ValueError(
                f"{OP}: {name}: expected a pinned CPU tensor (pin_memory()) for a copy with {dev}, "
                "got one that is not pinned"
            )


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


# ------------------------------------------------------------------------------------------- jit


def cpu_spec() -> JitSpec:
    return JitSpec("transfer_cpu", ("transfer/transfer_pages_cpu.cpp",), exports=(OP,))


def cuda_spec(arch: str) -> JitSpec:
    """The CUDA module: the SM copy kernel for 16-, 4- and 1-byte vectors, the binding choosing per call."""
    return JitSpec("transfer_cuda", ("transfer/transfer_pages_cuda.cu",), target=arch, exports=(OP, PAIR, HOST_IDS))


def copy_engine_spec(arch: str) -> JitSpec:
    """The copy-engine path (host code: cudaMemcpyBatchAsync), built per target like the kernels."""
    return JitSpec("transfer_ce", ("transfer/transfer_pages_ce.cu",), target=arch, exports=(CE, CE_CHECK))


CE, CE_CHECK = "transfer_pages_ce", "transfer_pages_check"
PAIR, HOST_IDS = "transfer_pages_pair", "transfer_pages_host_ids"


def specs(target: str) -> list[JitSpec]:
    if target == "cpu":
        return [cpu_spec()]
    return [cuda_spec(target), copy_engine_spec(target)]


def _jit(device, variant):
    if device.type == "cpu":
        fn, info = jit_function(cpu_spec(), OP)
        calls = {}  # GPU index -> its host-ids call (_host_ids_call), made once per runner

        def run_cpu(src, dst, src_pages, dst_pages, max_sms):
            index = src.get_device()
            if index < 0:
                index = dst.get_device()
            if index >= 0:  # host ids beside a GPU: each pool's device read once
                call = calls.get(index) or calls.setdefault(index, _host_ids_call(index))
                call(src, dst, src_pages, dst_pages, max_sms)
            else:
                _max_sms(max_sms)  # ignored on CPU, but checked as on every backend
                fn(src, dst, src_pages, dst_pages)

        return run_cpu, info
    spec = cuda_spec(cuda_arch(device))
    fn, info = jit_function(spec, OP)

    def run_cuda(src, dst, src_pages, dst_pages, max_sms):
        fn(src, dst, src_pages, dst_pages, 0 if max_sms is None else max_sms)  # 0: the binding's default

    run_cuda.pair = get_function(spec, PAIR)  # a (K, V) tuple in one launch (_run_pair; not under JITKV_DEBUG)
    run = TRANSFER_PAGES.with_debug_checks(device, run_cuda)
    run.host_ids = get_function(spec, HOST_IDS)  # host ids for the SM kernel: the binding range checks them
    return run, {"mechanism": "SM copy kernel", **info}


# Pages of at least this many bytes go to the copy engines when the ids are on the host; smaller ones
# to the SM kernel, the ids moved to the GPU first: a copy engine pays a fixed cost per run that small
# pages do not amortize. docs/performance.md "CE_MIN_PAGE_BYTES" has the measurement and its command.
CE_MIN_PAGE_BYTES = 64 << 10
_CE: dict[int, tuple | None] = {}


HOST_IDS_CE = "page ids on the host: the copy engines"
HOST_IDS_SM = "page ids on the host: the SM kernel, the pairs in its parameter block"


def _host_ids_call(index):
    """How one pool's host ids beside GPU ``index`` are copied: the SM binding's route of the GPU's
    runner (_host_ids_route), or, without the CUDA module, _host_ids_without_binding."""
    route = _host_ids_route(TRANSFER_PAGES.cuda_runner(index, None, ()), index)
    return route if route is not None else functools.partial(_host_ids_without_binding, index)


def _host_ids_without_binding(index, src, dst, src_pages, dst_pages, max_sms):
    """Host ids beside GPU ``index`` without the CUDA module's SM binding: the copy engines where they
    take the pages or while a stream is captured, else the ids range checked, moved to the GPU, and the
    GPU's backend copies (its runner records itself in backend_info)."""
    _max_sms(max_sms)
    ce = _copy_engine(_device(index), index)
    if ce is not None and _copy_engines_take(math.prod(src.shape[2:]) * src.element_size()):
        ce[0](src, dst, None, None, src_pages, dst_pages, index, 0)
        _note(index, HOST_IDS_CE, "copy engine", ce[2])
        return
    if ce is not None and torch.cuda.is_current_stream_capturing():  # the ids cannot be moved now
        ce[0](src, dst, None, None, src_pages, dst_pages, index, 0)
        _note(index, HOST_IDS_CE, "copy engine", ce[2])
        return
    if ce is None:  # the reference's range check takes checked arguments; the C++ one checks them itself
        check(src, dst, src_pages, dst_pages, max_sms)
    _check_host_ids(ce, index, ((src, dst),), src_pages, dst_pages)
    ids = _ids_on(_device(index), src_pages, dst_pages)
    TRANSFER_PAGES.run((src, dst, ids[0], ids[1], max_sms), None)  # the GPU's own choice (torch, the module missing)


def _copy_engines_take(page_bytes) -> bool:
    """Whether host ids of pages of ``page_bytes`` go to the copy engines: CE_MIN_PAGE_BYTES or more,
    and no graph being captured (a captured batch is one memcpy node per run, which replays at half the
    SM kernel's rate: docs/performance.md "Host ids in the parameter block"). Both bindings apply the
    same rule (transfer/host_pool.cuh copy_engines_take); this one serves the path without the SM one."""
    return page_bytes >= CE_MIN_PAGE_BYTES and not torch.cuda.is_current_stream_capturing()


# A page size no pool reaches: the SM binding's copy-engine threshold where the copy-engine module is missing.
_NO_CE = 1 << 62


def _host_ids_route(runner, index):
    """Host ids beside GPU ``index`` through ``runner``'s SM binding and the copy-engine module, made
    once per runner (None when it has no SM binding): route(src, dst, src_pages, dst_pages, max_sms,
    src2=None, dst2=None) -> a Status. Each binding checks every argument, then copies, or, having
    copied nothing, hands the call to the other (the SM binding Status.COPY_ENGINES for pages of
    CE_MIN_PAGE_BYTES or more outside a capture, the copy-engine binding Status.SM_KERNEL for the rest)
    or, the SM binding, refuses a tuple one launch cannot move (Status.PER_POOL). The route first asks
    the binding that copied its last call: an engine's calls repeat one page size, so that is the one
    that copies, and a change of page size costs one binding's checks once. backend_info notes the
    mechanism that ran."""
    route = getattr(runner, "host_ids_route", None)
    if route is not None or not hasattr(runner, "host_ids"):
        return route
    host_ids = runner.host_ids
    ce = _copy_engine(_device(index), index)
    ce_min = _NO_CE if ce is None else CE_MIN_PAGE_BYTES
    sm_note, ce_note = _note_args(index, HOST_IDS_SM, "SM copy kernel", {}), None
    if ce is not None:
        ce_note = _note_args(index, HOST_IDS_CE, "copy engine", ce[2])
    last_ce = False  # the copy engines copied the last call

    def route(src, dst, src_pages, dst_pages, max_sms, src2=None, dst2=None):
        nonlocal last_ce
        ms = 0 if max_sms is None else _max_sms(max_sms)
        if last_ce:
            if ce[0](src, dst, src2, dst2, src_pages, dst_pages, index, CE_MIN_PAGE_BYTES) == _DONE:
                TRANSFER_PAGES.note(*ce_note)
                return _DONE
            last_ce = False
        status = host_ids(src, dst, src2, dst2, src_pages, dst_pages, ms, ce_min)
        if status == _DONE:
            TRANSFER_PAGES.note(*sm_note)
        elif status == _COPY_ENGINES:
            ce[0](src, dst, src2, dst2, src_pages, dst_pages, index, 0)  # 0: copy (the SM binding chose)
            TRANSFER_PAGES.note(*ce_note)
            last_ce = True
        return status

    runner.host_ids_route = route
    return route


def _gpu_of(pools):
    """(device, index) of the first CUDA pool (index: the current device for a bare "cuda"), or
    (None, None) when every pool is on the host."""
    device = next((t.device for t in pools if t.is_cuda), None)
    if device is None:
        return None, None
    return device, device.index if device.index is not None else torch.cuda.current_device()


def _check_host_ids(ce, index, pairs, src_pages, dst_pages):
    """IndexError for a host id past its pool, naming it, before any of the (src, dst) ``pairs`` is
    copied: the copy-engine module's C++ plan ``ce`` of GPU ``index`` where it is built (a few µs),
    else the reference's torch check."""
    for s, d in pairs:
        if ce is not None:
            ce[1](s, d, src_pages, dst_pages, index)
        else:
            reference.check_pages(src_pages, dst_pages, s.shape[1], d.shape[1])


def _ids_on(device, src_pages, dst_pages):
    """Host ids on ``device`` in one copy, staged in pinned memory so that the host does not wait for
    the link (the caching host allocator keeps the staging buffer until the copy has run)."""
    ids = torch.stack((src_pages.to(torch.int64), dst_pages.to(torch.int64)))
    return ids.pin_memory().to(device, non_blocking=True)


def _copy_engine(device, index):
    """(copy, check, backend_info fields) of the copy-engine module for GPU ``index``, built or loaded
    once per process, or None when it cannot be built (the SM kernel then takes every call)."""
    if index not in _CE:
        try:
            spec = copy_engine_spec(cuda_arch(device))
            copy, info = jit_function(spec, CE)
            _CE[index] = (copy, get_function(spec, CE_CHECK), info)
        except JitUnavailable:
            _CE[index] = None
    return _CE[index]


_DEVICES: dict[int, torch.device] = {}


def _device(index) -> torch.device:
    """torch.device("cuda", index), made once per index (a host-ids call needs one on every call)."""
    device = _DEVICES.get(index)
    if device is None:
        device = _DEVICES[index] = torch.device("cuda", index)
    return device


def _note_args(index, reason, mechanism, info) -> tuple:
    """TRANSFER_PAGES.note's arguments for a host-ids path of GPU ``index``, made once per GPU and path
    by its caller (the runner of GPU ids records its own when it is made)."""
    device = _device(index)
    return device, "jit", reason, {"mechanism": mechanism, **info}, str(device)


def _note(index, reason, mechanism, info):
    """backend_info of GPU ``index``: the path this host-ids call took, recorded when it differs from
    what backend_info holds (the paths without the SM binding; its route keeps its own arguments)."""
    TRANSFER_PAGES.note(*_note_args(index, reason, mechanism, info))


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


# The GPU section's pages (issue shapes: an MLA token row, and MHA pages of H8 D128 K and V), the
# request sizes in tokens, and the layer counts (one layer's cache, a 61-layer model's).
_GPU_PAGES = (
    ("MLA 1-token pages (1 x 576 bf16)", (1, 576), 1),
    ("MHA 16-token pages (K and V, 16 x 8 x 128 bf16)", (16, 8, 128), 2),
    ("MHA 64-token pages (K and V, 64 x 8 x 128 bf16)", (64, 8, 128), 2),
)
_GPU_TOKENS = {1: (64, 1024, 16384), 61: (64, 1024)}
_LOOP_MAX_RUNS = 70_000  # the per-block memcpy loop past this many runs takes seconds per timing


def _bench_gpu(h) -> list:
    """Host <-> device page transfers, eager µs per call (as an engine's offload or load runs), between
    a pinned page-first host pool and a layer-first device pool twice the pages moved, scattered ids;
    the baseline is torch's contiguous pinned copy_ of the same bytes (the link's practical ceiling).
    Beside it: the SM kernel (ids on the GPU, 4 SMs), host ids (the copy engines for pages of
    CE_MIN_PAGE_BYTES or more), the copy engines forced, and vLLM swap_blocks' cudaMemcpyAsync per
    (block, layer); then pack_pages on the device against the device copy, and a GEMM's slowdown
    beside each mechanism."""
    from ..benchmark.transfer import gemm_slowdown_rows

    rows = []
    for layers, tokens in _GPU_TOKENS.items():
        for label, page, npools in _GPU_PAGES:
            for t in h.sizes(list(tokens)):
                n = t // page[0]
                for to_dev in (True, False):
                    pools = _transfer_pools(layers, 2 * n, page, npools)
                    rows += _transfer_rows(h, f"{label}, {layers} layer(s), {t} tokens", t, n, pools, to_dev)
                    pools = None
    rows += _pack_rows(h)
    rows += gemm_slowdown_rows(_transfer_pools(1, 2048, (16, 8, 128), 2), transfer_pages, _copy_engine)
    return rows


def _transfer_pools(layers, pages, page, npools):
    """npools (device pool [L, P, *page], pinned page-first host pool as [L, P, *page]) of bf16."""
    out = []
    for _ in range(npools):
        dev = torch.empty((layers, pages, *page), dtype=torch.bfloat16, device="cuda").normal_()
        host = torch.empty((pages, layers, *page), dtype=torch.bfloat16).pin_memory()
        out.append((dev, host.transpose(0, 1)))
    return out


def _transfer_rows(h, case, t, n, pools, to_dev):
    from ..benchmark.transfer import block_memcpy

    dev_pools = tuple(d for d, _ in pools)
    host_pools = tuple(x for _, x in pools)
    src, dst = (host_pools, dev_pools) if to_dev else (dev_pools, host_pools)
    pages = dev_pools[0].shape[1]
    sp_h, dp_h = torch.randperm(pages)[:n], torch.randperm(pages)[:n]
    sp_d, dp_d = sp_h.cuda(), dp_h.cuda()
    page_bytes = math.prod(dev_pools[0].shape[2:]) * 2
    payload = n * page_bytes * dev_pools[0].shape[0] * len(pools)
    flat_h = torch.empty(payload, dtype=torch.uint8).pin_memory()
    flat_d = torch.empty(payload, dtype=torch.uint8, device="cuda")
    flat_src, flat_dst = (flat_h, flat_d) if to_dev else (flat_d, flat_h)
    device = dev_pools[0].device
    ce = (_copy_engine(device, device.index) or (None,))[0]
    cases = [
        ("torch contiguous pinned copy_", lambda i: flat_dst.copy_(flat_src, non_blocking=True)),
        (f"jitkv, GPU ids (SM kernel, {LINK_SMS} SMs)", lambda i: transfer_pages(src, dst, sp_d, dp_d)),
        ("jitkv, host ids", lambda i: transfer_pages(src, dst, sp_h, dp_h)),
    ]
    # Under graph replay (no host cost between calls): what the GPU takes for the copy alone.
    graphed = [
        ("torch contiguous pinned copy_, graph", lambda i: flat_dst.copy_(flat_src, non_blocking=True)),
        (f"jitkv, GPU ids (SM kernel, {LINK_SMS} SMs), graph", lambda i: transfer_pages(src, dst, sp_d, dp_d)),
        ("jitkv, host ids, graph", lambda i: transfer_pages(src, dst, sp_h, dp_h)),
    ]
    if ce is not None:
        cases.append(
            (
                "jitkv copy engines forced, host ids",
                lambda i: ce(
                    src[0], dst[0], *((src[1], dst[1]) if len(src) > 1 else (None, None)), sp_h, dp_h, device.index, 0
                ),
            )
        )
    if n * dev_pools[0].shape[0] * len(pools) <= _LOOP_MAX_RUNS:
        cases.append(
            (
                "cudaMemcpyAsync per block and layer (vLLM swap_blocks)",
                lambda i: [block_memcpy(a, b, sp_h, dp_h, device.index) for a, b in zip(src, dst)],
            )
        )
    direction = "host -> device" if to_dev else "device -> host"
    names = tuple(c[0] for c in cases)
    rows = h.rows(OP, f"{case}, {direction}", t, 2 * payload, cases, eager=names, ceiling=False)
    return rows + h.rows(OP, f"{case}, {direction}", t, 2 * payload, graphed, ceiling=False)


def _pack_rows(h):
    """pack_pages / unpack_pages of 1024 tokens of 16-token MHA pages over 61 layers, device to device,
    graph-timed against the device copy of the same bytes."""
    rows, layers, n, page = [], 61, 64, (16, 8, 128)
    pools = [torch.empty((layers, 2 * n, *page), dtype=torch.bfloat16, device="cuda").normal_() for _ in range(2)]
    buf = torch.empty((n, 2, layers, *page), dtype=torch.bfloat16, device="cuda")
    sp = torch.randperm(2 * n, device="cuda")[:n]
    moved = 2 * buf.numel() * 2
    cases = [
        ("jitkv pack_pages", lambda i: pack_pages(tuple(pools), sp, buf)),
        ("jitkv unpack_pages", lambda i: unpack_pages(buf, tuple(pools), sp)),
    ]
    case = f"{n} MHA pages of 16 tokens (K and V), {layers} layers, on the device"
    rows += h.rows("pack_pages", case, n * 16, moved, cases)
    return rows


TRANSFER_PAGES = Op(
    transfer_pages,
    schema="(Tensor src, Tensor(a!) dst, Tensor src_pages, Tensor dst_pages, *, int? max_sms=None)",
    home="src_pages",
    check=check,
    debug_check=debug_check,
    specs=specs,
    reference=reference.transfer_pages,
    sample=sample,
    bench_cpu=_bench_cpu,
    bench_gpu=_bench_gpu,
    backends={"cuda": ("jit", "torch")},
)
TRANSFER_PAGES.backend("jit")(_jit)
