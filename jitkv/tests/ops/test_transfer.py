"""transfer_pages, pack_pages, unpack_pages: whole-destination bitwise equality with the torch reference
on every backend (CPU: jit, torch; CUDA: the jit SM copy kernel, torch) and, on a GPU, device to device,
host to device and device to host; the rule checked without the reference; layer-first and page-first
pools, tuples of pools, padding, duplicates, out-of-range ids, max_sms, CUDA graphs, bad input with the
argument named; the pack format and its round trip; the CUDA kernel's vector width."""

from __future__ import annotations

import math

import pytest
import torch

import jitkv
from jitkv import reference
from jitkv.ops import transfer as transfer_ops
from jitkv.tests.conftest import HAS_CUDA, assert_bitwise, gpu, rand

OP = "transfer_pages"
CPU_BACKENDS = ["jit", "torch"]
GPU_BACKENDS = ["jit", "torch"]
DEV_BACKENDS = [("cpu", "jit"), ("cpu", "torch")] + ([("cuda", b) for b in GPU_BACKENDS] if HAS_CUDA else [])
# (dtype, page shape after the page-size dim): GQA rows of 8 x 128 bf16, 1152-byte MLA rows (576 bf16,
# and as bytes), fp8_ds_mla's 656-byte records, odd byte widths, 12-byte fp32 rows.
PAGES = [
    (torch.bfloat16, (8, 128)),
    (torch.bfloat16, (576,)),
    (torch.uint8, (1152,)),
    (torch.float8_e4m3fn, (656,)),
    (torch.uint8, (37,)),
    (torch.float32, (3,)),
]
PAGE_IDS = [f"{str(d).split('.')[1]}-{'x'.join(map(str, p))}" for d, p in PAGES]


def _pool(layout, layers, pages, page, dtype, device="cpu", pin=False):
    """A pool poisoned with random bytes: layer-first [L, P, ...], or page-first [P, L, ...] passed as
    its transpose(0, 1)."""
    if layout == "layer_first":
        t = rand((layers, pages, *page), dtype)
    else:
        t = rand((pages, layers, *page), dtype)
    t = t.pin_memory() if pin else t.to(device)
    return t if layout == "layer_first" else t.transpose(0, 1)


def _ids(values, dtype, device):
    return torch.tensor(values, dtype=dtype, device=device)


def _by_hand(src, dst, src_pages, dst_pages):
    """dst after the op's rule written as a loop over the pairs (no reference): padding skipped, the
    last pair of a destination page wins."""
    want = dst.cpu().clone()
    s_all = src.cpu()
    for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
        if s >= 0 and d >= 0:
            want[:, d] = s_all[:, s]
    return want


def _expected(src, dst, src_pages, dst_pages):
    want = dst.clone()
    reference.transfer_pages(src, want, src_pages, dst_pages, strict=False)
    return want


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("dtype,page", PAGES, ids=PAGE_IDS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("src_layout,dst_layout", [("layer_first", "page_first"), ("page_first", "layer_first")])
def test_matches_reference_and_rule(device, backend, dtype, page, page_size, src_layout, dst_layout):
    layers, n = 3, 9
    src = _pool(src_layout, layers, 13, (page_size, *page), dtype, device)
    dst = _pool(dst_layout, layers, 17, (page_size, *page), dtype, device)
    sp = torch.randint(0, 13, (n,))
    dp = torch.randperm(17)[:n]
    sp[2], dp[5] = -1, -3  # padding on either side
    sp, dp = sp.to(device), dp.int().to(device)
    want, by_hand = _expected(src, dst, sp, dp), _by_hand(src, dst, sp, dp)
    jitkv.transfer_pages(src, dst, sp, dp, backend=backend)
    assert_bitwise(dst, want)
    assert_bitwise(dst.cpu(), by_hand)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("src_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dst_dtype", [torch.int32, torch.int64])
def test_index_dtypes(device, backend, src_dtype, dst_dtype):
    src = _pool("layer_first", 2, 8, (16, 4, 32), torch.float16, device)
    dst = _pool("layer_first", 2, 8, (16, 4, 32), torch.float16, device)
    sp, dp = _ids([3, 0, 7, -1], src_dtype, device), _ids([1, 6, -1, 2], dst_dtype, device)
    by_hand = _by_hand(src, dst, sp, dp)
    jitkv.transfer_pages(src, dst, sp, dp, backend=backend)
    assert_bitwise(dst.cpu(), by_hand)


@pytest.mark.parametrize("device,backend", [d for d in DEV_BACKENDS if d != ("cuda", "jit")])
def test_duplicate_destinations_one_wins(device, backend):
    """Pairs naming one destination page: that page holds one of their source pages whole (never a
    mix), every other page is exact (the CUDA kernel's racing pairs: test_duplicates_gpu)."""
    src = _pool("layer_first", 4, 10, (16, 1152), torch.uint8, device)
    dst = _pool("page_first", 4, 10, (16, 1152), torch.uint8, device)
    sp, dp = _ids([1, 2, 3, 4, 5], torch.int64, device), _ids([7, 0, 7, 9, 7], torch.int64, device)
    before = dst.cpu().clone()
    jitkv.transfer_pages(src, dst, sp, dp, backend=backend)
    got, s = dst.cpu(), src.cpu()
    assert any(torch.equal(got[:, 7], s[:, k]) for k in (1, 3, 5))
    assert torch.equal(got[:, 0], s[:, 2]) and torch.equal(got[:, 9], s[:, 4])
    untouched = [p for p in range(10) if p not in (0, 7, 9)]
    assert torch.equal(got[:, untouched], before[:, untouched])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_host_ids_last_valid_pair_wins(backend):
    """Ids read on the host (the CPU kernel; the copy engines share its plan): 400 pairs in random
    order over a pool of 300 pages (several words of the plan's bitset), with duplicates and padding;
    each destination page gets its last valid pair's source page, exactly."""
    gen = torch.Generator().manual_seed(5)
    src = _pool("layer_first", 2, 50, (4, 8), torch.bfloat16)
    dst = _pool("page_first", 2, 300, (4, 8), torch.bfloat16)
    sp, dp = torch.randint(0, 50, (400,), generator=gen), torch.randint(0, 300, (400,), generator=gen)
    sp[::37], dp[5::41] = -1, -2
    by_hand = _by_hand(src, dst, sp, dp)
    jitkv.transfer_pages(src, dst, sp, dp, backend=backend)
    assert_bitwise(dst, by_hand)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "sp,dp,message",
    [
        ([0, 8, 1], [1, 2, 3], r"src_pages: position 1 has page 8, out of range for a pool of 8 pages$"),
        ([0, 1, 2], [1, 2, 6], r"dst_pages: position 2 has page 6, out of range for a pool of 6 pages$"),
        ([0, 1, 2**31 - 1], [1, 2, 3], r"src_pages: position 2 has page 2147483647, out of range"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_out_of_range_raises_before_copying_cpu(backend, sp, dp, message, dtype):
    src = _pool("layer_first", 2, 8, (4, 24), torch.bfloat16)
    dst = _pool("page_first", 2, 6, (4, 24), torch.bfloat16)
    before = dst.clone()
    with pytest.raises(IndexError, match=rf"^{OP}: {message}"):
        jitkv.transfer_pages(src, dst, _ids(sp, dtype, "cpu"), _ids(dp, dtype, "cpu"), backend=backend)
    assert_bitwise(dst, before)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_out_of_range_in_a_padded_pair_is_padding(backend):
    """A pair with a negative id is skipped whatever its other id (no IndexError)."""
    src = _pool("layer_first", 2, 8, (4, 24), torch.bfloat16)
    dst = _pool("layer_first", 2, 6, (4, 24), torch.bfloat16)
    sp, dp = _ids([99, -1, 3], torch.int64, "cpu"), _ids([-1, 99, 5], torch.int64, "cpu")
    by_hand = _by_hand(src, dst, sp, dp)
    jitkv.transfer_pages(src, dst, sp, dp, backend=backend)
    assert_bitwise(dst, by_hand)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_empty_and_all_padding(device, backend):
    src = _pool("layer_first", 2, 4, (8, 16), torch.float32, device)
    dst = _pool("layer_first", 2, 4, (8, 16), torch.float32, device)
    before = dst.clone()
    for ids in ([], [-1, -1]):
        jitkv.transfer_pages(src, dst, _ids(ids, torch.int64, device), _ids(ids, torch.int32, device), backend=backend)
        assert_bitwise(dst, before)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_one_layer_of_a_per_layer_cache(device, backend):
    """One layer's cache [P, ...] as a pool of one layer (cache.view(1, P, ...))."""
    src, dst = rand((12, 16, 576), torch.bfloat16, device), rand((12, 16, 576), torch.bfloat16, device)
    sp, dp = _ids([4, 11, 0], torch.int64, device), _ids([2, 3, 11], torch.int64, device)
    want = dst.clone()
    want[dp] = src[sp]
    jitkv.transfer_pages(src.view(1, 12, 16, 576), dst.view(1, 12, 16, 576), sp, dp, backend=backend)
    assert_bitwise(dst, want)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_tuple_of_pools(device, backend):
    """(k_pool, v_pool) to (k_host, v_host) in one call: each pair as its own call would write it."""
    page = (16, 2, 64)
    k, v = (_pool("layer_first", 3, 9, page, torch.bfloat16, device) for _ in range(2))
    hk, hv = (_pool("page_first", 3, 20, page, torch.bfloat16, device) for _ in range(2))
    sp, dp = _ids([8, 1, -1, 4], torch.int32, device), _ids([19, 0, 3, 7], torch.int64, device)
    want = [_expected(k, hk, sp, dp), _expected(v, hv, sp, dp)]
    jitkv.transfer_pages((k, v), (hk, hv), sp, dp, backend=backend)
    assert_bitwise(hk, want[0])
    assert_bitwise(hv, want[1])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_tuple_checks_every_pair_before_copying(backend):
    """An id past the second pool raises before the first pool is written; a bad second pair is named."""
    k, v = _pool("layer_first", 2, 9, (4, 8), torch.float16), _pool("layer_first", 2, 9, (4, 8), torch.float16)
    hk, hv = _pool("layer_first", 2, 9, (4, 8), torch.float16), _pool("layer_first", 2, 5, (4, 8), torch.float16)
    before = hk.clone()
    sp, dp = _ids([0, 1], torch.int64, "cpu"), _ids([2, 7], torch.int64, "cpu")
    with pytest.raises(IndexError, match=rf"^{OP}: dst_pages: position 1 has page 7, out of range for a pool of 5"):
        jitkv.transfer_pages((k, v), (hk, hv), sp, dp, backend=backend)
    assert_bitwise(hk, before)
    with pytest.raises(ValueError, match=rf"^{OP}: dst\[1\]: expected dtype float16 and page shape \[4, 8\] like src"):
        jitkv.transfer_pages((k, v), (hk, hv.float()), sp, dp, backend=backend)
    assert_bitwise(hk, before)
    with pytest.raises(ValueError, match=rf"^{OP}: dst: expected 2 pools like src, got 1$"):
        jitkv.transfer_pages((k, v), (hk,), sp, dp, backend=backend)
    with pytest.raises(TypeError, match=rf"^{OP}: dst: expected a tuple of 2 pools like src, got Tensor$"):
        jitkv.transfer_pages((k, v), hk, sp, dp, backend=backend)


# ------------------------------------------------------------------------------------ pack format


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_pack_format_and_round_trip(device, backend):
    """pack_pages writes out[i, l] = src[l, src_pages[i]] (page-first); unpack_pages puts them back."""
    layers, page = 3, (16, 576)
    src = _pool("layer_first", layers, 11, page, torch.bfloat16, device)
    sp = _ids([9, 0, 4, 10], torch.int64, device)
    out = rand((4, layers, *page), torch.bfloat16, device)
    jitkv.pack_pages(src, sp, out, backend=backend)
    for i, p in enumerate(sp.tolist()):
        assert torch.equal(out[i].view(torch.int16), src[:, p].view(torch.int16))
    dst = _pool("page_first", layers, 7, page, torch.bfloat16, device)
    dp = _ids([6, 1, -1, 3], torch.int32, device)
    want = _by_hand(out.transpose(0, 1), dst, torch.arange(4), dp.cpu())
    jitkv.unpack_pages(out, dst, dp, backend=backend)
    assert_bitwise(dst.cpu(), want)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_pack_tuple_format(device, backend):
    """A tuple of K pools packs into [N, K, L, *page]: page i holds pool 0's L layers, then pool 1's."""
    page = (8, 2, 32)
    k, v = (_pool("page_first", 2, 6, page, torch.float16, device) for _ in range(2))
    sp = _ids([5, 2, -1], torch.int32, device)
    out = rand((3, 2, 2, *page), torch.float16, device)
    before = out.clone()
    jitkv.pack_pages((k, v), sp, out, backend=backend)
    for i, p in enumerate(sp.tolist()):
        if p < 0:
            assert_bitwise(out[i], before[i])  # padding leaves its page of out as it was
            continue
        assert torch.equal(out[i, 0].view(torch.int16), k[:, p].view(torch.int16))
        assert torch.equal(out[i, 1].view(torch.int16), v[:, p].view(torch.int16))
    hk, hv = (_pool("layer_first", 2, 4, page, torch.float16, device) for _ in range(2))
    dp = _ids([3, 0, 1], torch.int64, device)
    want_k = _by_hand(out[:, 0].transpose(0, 1), hk, torch.arange(3), dp.cpu())
    want_v = _by_hand(out[:, 1].transpose(0, 1), hv, torch.arange(3), dp.cpu())
    jitkv.unpack_pages(out, (hk, hv), dp, backend=backend)
    assert_bitwise(hk.cpu(), want_k)
    assert_bitwise(hv.cpu(), want_v)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(out=a["out"][:, :, :8]), r"out: expected dtype bfloat16 and shape \[3, 2, 16, 64\]"),
        (lambda a: a.update(out=a["out"].half()), r"out: expected dtype bfloat16 and shape \[3, 2, 16, 64\]"),
        (
            lambda a: a.update(out=a["out"].transpose(0, 1).contiguous().transpose(0, 1)),
            r"out: expected a contiguous tensor \(the pack format\)",
        ),
    ],
)
def test_pack_bad_buffer(change, message):
    a = dict(
        src=_pool("layer_first", 2, 5, (16, 64), torch.bfloat16),
        src_pages=_ids([1, 2, 3], torch.int64, "cpu"),
        out=rand((3, 2, 16, 64), torch.bfloat16),
    )
    change(a)
    with pytest.raises(ValueError, match=rf"^pack_pages: {message}"):
        jitkv.pack_pages(**a)


def test_unpack_bad_buffer():
    dst = (_pool("layer_first", 2, 5, (16, 64), torch.bfloat16), _pool("layer_first", 2, 5, (16, 64), torch.bfloat16))
    buf = rand((3, 2, 16, 64), torch.bfloat16)  # the format of one pool, not of a tuple of 2
    with pytest.raises(ValueError, match=r"^unpack_pages: buf: expected dtype bfloat16 and shape \[3, 2, 2, 16, 64\]"):
        jitkv.unpack_pages(buf, dst, _ids([0, 1, 2], torch.int64, "cpu"))
    with pytest.raises(TypeError, match=r"^unpack_pages: dst\[1\]: expected a torch.Tensor, got NoneType$"):
        jitkv.unpack_pages(buf, (dst[0], None), _ids([0, 1, 2], torch.int64, "cpu"))


def test_torch_compile_tuples_and_pack():
    """Under torch.compile(fullgraph=True) a tuple of pools and a pack go through the registered op, one
    call per pool, and write what eager calls write."""
    k, v = _pool("layer_first", 2, 6, (4, 8), torch.float32), _pool("layer_first", 2, 6, (4, 8), torch.float32)
    hk, hv = _pool("page_first", 2, 6, (4, 8), torch.float32), _pool("page_first", 2, 6, (4, 8), torch.float32)
    sp, dp = _ids([1, 5, -1], torch.int64, "cpu"), _ids([0, 2, 3], torch.int32, "cpu")
    out = rand((3, 2, 2, 4, 8), torch.float32)
    want_k, want_v, want_out = hk.clone(), hv.clone(), out.clone()
    jitkv.transfer_pages((k, v), (want_k, want_v), sp, dp)
    jitkv.pack_pages((k, v), sp, want_out)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="eager")
    def call(k, v, hk, hv, sp, dp, out):
        jitkv.transfer_pages((k, v), (hk, hv), sp, dp)
        jitkv.pack_pages((k, v), sp, out)

    call(k, v, hk, hv, sp, dp, out)
    assert_bitwise(hk, want_k)
    assert_bitwise(hv, want_v)
    assert_bitwise(out, want_out)


# -------------------------------------------------------------------------------------- bad input


def _args(device="cpu"):
    return dict(
        src=_pool("layer_first", 2, 8, (16, 4, 32), torch.bfloat16, device),
        dst=_pool("page_first", 2, 8, (16, 4, 32), torch.bfloat16, device),
        src_pages=_ids([1, 2, 3], torch.int64, device),
        dst_pages=_ids([4, 5, 6], torch.int32, device),
    )


BAD = [  # (case, change to the arguments, exception, message after "transfer_pages: ")
    (
        "dtype mismatch",
        lambda a: a.update(dst=a["dst"].half()),
        ValueError,
        r"dst: expected dtype bfloat16 and page shape \[16, 4, 32\] like src, got float16 and \[16, 4, 32\]$",
    ),
    (
        "page shape mismatch",
        lambda a: a.update(dst=a["dst"][..., :16]),
        ValueError,
        r"dst: expected a dense page part \(every dim after dim 1 contiguous\), got shape \[2, 8, 16, 4, 16\] "
        r"with stride 32 at dim 3$",
    ),
    (
        "page shape differs",
        lambda a: a.update(dst=rand((2, 8, 4, 16, 32), torch.bfloat16)),
        ValueError,
        r"dst: expected dtype bfloat16 and page shape \[16, 4, 32\] like src, got bfloat16 and \[4, 16, 32\]$",
    ),
    (
        "non-dense page part",
        lambda a: a.update(src=rand((2, 8, 4, 16, 32), torch.bfloat16).transpose(2, 3)),
        ValueError,
        r"src: expected a dense page part \(every dim after dim 1 contiguous\), got shape \[2, 8, 16, 4, 32\] "
        r"with stride 512 at dim 3$",
    ),
    (
        "pool of one dim",
        lambda a: a.update(src=rand((8,), torch.bfloat16)),
        ValueError,
        r"src: expected a pool \[num_layers, num_pages, \*page\], got shape \[8\]$",
    ),
    ("layers differ", lambda a: a.update(dst=a["dst"][:1]), ValueError, r"dst: expected 2 layers like src, got 1$"),
    (
        "lengths differ",
        lambda a: a.update(dst_pages=a["dst_pages"][:2]),
        ValueError,
        r"dst_pages: expected 3 entries like src_pages, got 2$",
    ),
    (
        "ids 2-D",
        lambda a: a.update(src_pages=a["src_pages"].view(3, 1)),
        ValueError,
        r"src_pages: expected a 1-D tensor, got shape \[3, 1\]$",
    ),
    (
        "ids float",
        lambda a: a.update(dst_pages=a["dst_pages"].float()),
        TypeError,
        r"dst_pages: expected dtype int32 or int64, got float32$",
    ),
    (
        "ids strided",
        lambda a: a.update(src_pages=_ids([1, 0, 2, 0, 3, 0], torch.int64, "cpu")[::2]),
        ValueError,
        r"src_pages: expected a contiguous tensor, got stride 2$",
    ),
    (
        "ids a list",
        lambda a: a.update(src_pages=[1, 2, 3]),
        TypeError,
        r"src_pages: expected a torch.Tensor, got list$",
    ),
    ("src None", lambda a: a.update(src=None), TypeError, r"src: expected a torch.Tensor, got NoneType$"),
    ("max_sms 0", lambda a: a.update(max_sms=0), ValueError, r"max_sms: expected an int >= 1, got 0$"),
    ("max_sms float", lambda a: a.update(max_sms=2.0), TypeError, r"max_sms: expected None or an int, got float$"),
    (
        "expanded dst",
        lambda a: a.update(dst=a["dst"][:, :1].expand(2, 8, 16, 4, 32)),
        ValueError,
        r"dst: dim 1 of size 8 has stride 0",
    ),
]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(backend, case):
    _, change, exc, message = case
    a = _args()
    change(a)
    before = a["dst"].clone() if isinstance(a["dst"], torch.Tensor) else None
    with pytest.raises(exc, match=rf"^{OP}: {message}"):
        jitkv.transfer_pages(**a, backend=backend)
    if before is not None and a["dst"].stride() == before.stride():
        assert_bitwise(a["dst"], before)


# ------------------------------------------------------------------------------------------- GPU

DIRECTIONS = ["h2d", "d2h", "d2d"]


def _pools_for(direction, layers, pages, page, dtype):
    """(src, dst) for a direction: the host pool pinned and page-first (HiCache's host layout)."""
    on = {"h2d": ("host", "cuda"), "d2h": ("cuda", "host"), "d2d": ("cuda", "cuda")}[direction]
    return [
        _pool("page_first", layers, pages, page, dtype, pin=True)
        if where == "host"
        else _pool("layer_first", layers, pages, page, dtype, "cuda")
        for where in on
    ]


@gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype,page", PAGES, ids=PAGE_IDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_directions_gpu(backend, direction, dtype, page, page_size):
    """Host to device, device to host, device to device: the whole destination bitwise, against the
    rule and the reference. Pages of 16 rows are whole 16-byte vectors; pages of one row take the 4-byte
    (fp32 x 3: 12 bytes) and 1-byte (37 bytes) vector modules too."""
    src, dst = _pools_for(direction, 3, 20, (page_size, *page), dtype)
    sp, dp = torch.randperm(20)[:9], torch.randperm(20)[:9]
    sp[1], dp[4] = -1, -1
    sp, dp = sp.cuda(), dp.int().cuda()
    want = _by_hand(src, dst, sp.cpu(), dp.cpu())
    ref = dst.cpu().clone()
    reference.transfer_pages(src.cpu(), ref, sp.cpu(), dp.cpu(), strict=False)
    jitkv.transfer_pages(src, dst, sp, dp, backend=backend)
    torch.cuda.synchronize()
    assert_bitwise(dst.cpu(), want)
    assert_bitwise(dst.cpu(), ref)


@gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(
    "max_sms,layers,n,page",
    [
        (1, 40, 100, (2, 64)),  # a part of one chunk per run, 4000 runs on 24 warps
        (4, 3, 9, (64, 8, 128)),  # 64 chunks per run (128 KiB pages)
        (2, 5, 20, (1, 1032)),  # 129 vectors: a full chunk and one vector of the next
        (None, 61, 3, (1, 576)),  # one run's chunk per layer
        (1000, 5, 300, (4, 576)),  # max_sms past the device's SMs: capped, not refused
    ],
)
def test_chunks_gpu(direction, max_sms, layers, n, page):
    """The kernel's work: chunks of 128 vectors, runs cut into them, two chunks per warp at a time in a
    grid-stride loop over more chunks than the bounded grid has warps, at every SM bound: every run once
    and whole, however its pages and layers fall into chunks."""
    src, dst = _pools_for(direction, layers, 2 * n + 3, page, torch.bfloat16)
    sp, dp = torch.randperm(2 * n + 3)[:n], torch.randperm(2 * n + 3)[:n]
    sp[n // 2] = -1
    sp, dp = sp.cuda(), dp.int().cuda()
    want = _by_hand(src, dst, sp.cpu(), dp.cpu())
    jitkv.transfer_pages(src, dst, sp, dp, max_sms=max_sms, backend="jit")
    torch.cuda.synchronize()
    assert_bitwise(dst.cpu(), want)


@gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_duplicates_gpu(backend, direction):
    """Pairs naming one destination page race on the SM kernel: each 16-byte vector of that page comes
    from one of their source pages (later pairs with padding or an id past its pool do not count);
    every other page is exact."""
    src, dst = _pools_for(direction, 3, 12, (16, 1152), torch.uint8)
    before = dst.cpu().clone()
    sp = _ids([1, 2, 3, 4, 5, 6, 7, -1, 30], torch.int64, "cuda")
    dp = _ids([7, 0, 7, 9, 7, 0, 0, 7, 7], torch.int32, "cuda")
    jitkv.transfer_pages(src, dst, sp, dp, backend=backend)
    torch.cuda.synchronize()
    got, s = dst.cpu(), src.cpu()
    for page, sources in ((7, (1, 3, 5)), (0, (2, 6, 7))):
        vecs = got[:, page].reshape(-1, 16)
        from_any = torch.zeros(vecs.shape[0], dtype=torch.bool)
        for k in sources:
            from_any |= (vecs == s[:, k].reshape(-1, 16)).all(dim=1)
        assert bool(from_any.all()), f"page {page}: a vector from none of pages {sources}"
    assert torch.equal(got[:, 9], s[:, 4])
    untouched = [p for p in range(12) if p not in (0, 7, 9)]
    assert torch.equal(got[:, untouched], before[:, untouched])


@gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("src_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dst_dtype", [torch.int32, torch.int64])
def test_tuples_and_index_dtypes_gpu(backend, direction, src_dtype, dst_dtype):
    """(k, v) pools in one call in every direction, int32 and int64 ids on either side: each pool as
    its own call would write it."""
    page = (16, 2, 64)
    (k, hk), (v, hv) = (_pools_for(direction, 3, 10, page, torch.bfloat16) for _ in range(2))
    sp, dp = _ids([8, 1, -1, 4, 9], src_dtype, "cuda"), _ids([9, 0, 3, 7, -2], dst_dtype, "cuda")
    want = [_by_hand(k, hk, sp.cpu(), dp.cpu()), _by_hand(v, hv, sp.cpu(), dp.cpu())]
    jitkv.transfer_pages((k, v), (hk, hv), sp, dp, backend=backend)
    torch.cuda.synchronize()
    assert_bitwise(hk.cpu(), want[0])
    assert_bitwise(hv.cpu(), want[1])


@gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_pack_round_trip_gpu(direction):
    """pack_pages of a device pool into a pinned host buffer (or a device one) and back, on the kernel."""
    layers, page = 3, (16, 576)
    src = _pool("layer_first", layers, 11, page, torch.bfloat16, "cuda")
    sp = _ids([9, 0, 4, 10], torch.int64, "cuda")
    out = rand((4, layers, *page), torch.bfloat16)
    out = out.pin_memory() if direction != "d2d" else out.cuda()
    jitkv.pack_pages(src, sp, out, max_sms=2, backend="jit")
    torch.cuda.synchronize()
    for i, p in enumerate(sp.tolist()):
        assert torch.equal(out[i].cpu().view(torch.int16), src[:, p].cpu().view(torch.int16))
    dst = _pool("layer_first", layers, 7, page, torch.bfloat16, "cuda")
    dp = _ids([6, 1, -1, 3], torch.int32, "cuda")
    want = _by_hand(out.cpu().transpose(0, 1), dst, torch.arange(4), dp.cpu())
    jitkv.unpack_pages(out, dst, dp, backend="jit")
    torch.cuda.synchronize()
    assert_bitwise(dst.cpu(), want)


@gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_out_of_range_skipped_gpu(monkeypatch, backend):
    """CUDA: an id past its pool is skipped; under JITKV_DEBUG=1 IndexError first, dst unchanged."""
    monkeypatch.delenv("JITKV_DEBUG", raising=False)
    jitkv.ops.reset()
    src, dst = _pools_for("h2d", 2, 8, (16, 64), torch.bfloat16)
    sp, dp = _ids([0, 8, 2, 3], torch.int64, "cuda"), _ids([1, 2, 30, -5], torch.int64, "cuda")
    want = _by_hand(src, dst, _ids([0, -1, -1, -1], torch.int64, "cpu"), _ids([1, -1, -1, -1], torch.int64, "cpu"))
    jitkv.transfer_pages(src, dst, sp, dp, backend=backend)
    torch.cuda.synchronize()
    assert_bitwise(dst.cpu(), want)
    monkeypatch.setenv("JITKV_DEBUG", "1")
    jitkv.ops.reset()
    before = dst.clone()
    try:
        with pytest.raises(IndexError, match=rf"^{OP}: src_pages: position 1 has page 8, out of range"):
            jitkv.transfer_pages(src, dst, sp, dp, backend=backend)
    finally:
        jitkv.ops.reset()
    assert_bitwise(dst, before)


@gpu
def test_device_rules_gpu():
    """A CPU pool in a copy with a GPU must be pinned; ids live on the GPU pool's device."""
    a = _args("cuda")
    a["src"] = a["src"].cpu()
    with pytest.raises(ValueError, match=rf"^{OP}: src: expected a pinned CPU tensor \(pin_memory\(\)\) for a copy"):
        jitkv.transfer_pages(**a)
    a = _args("cuda")
    a["dst"] = a["dst"].cpu()
    with pytest.raises(ValueError, match=rf"^{OP}: dst: expected a pinned CPU tensor \(pin_memory\(\)\) for a copy"):
        jitkv.transfer_pages(**a, backend="jit")
    a = _args("cuda")
    a.update(src_pages=a["src_pages"].cpu(), dst_pages=a["dst_pages"].cpu(), src=a["src"].cpu())
    with pytest.raises(ValueError, match=rf"^{OP}: src: expected a pinned CPU tensor \(pin_memory\(\)\) for a copy"):
        jitkv.transfer_pages(**a)  # host ids (the copy engines): the host pool must be pinned too
    a = _args("cpu")
    a.update(src_pages=a["src_pages"].cuda(), dst_pages=a["dst_pages"].cuda())
    with pytest.raises(ValueError, match=rf"^{OP}: src_pages: expected a tensor on cpu like src and dst"):
        jitkv.transfer_pages(**a)


@gpu
@pytest.mark.parametrize("backend,direction", [("jit", "d2d"), ("jit", "h2d"), ("jit", "d2h"), ("torch", "d2d")])
def test_cuda_graph_replay(backend, direction):
    """Captured once, replayed with new ids (the kernel reads them on the device; no host sync in any
    direction). The torch reference is graph-safe device to device only."""
    src, dst = _pools_for(direction, 2, 16, (16, 576), torch.bfloat16)
    sp, dp = _ids([1, 2, -1, 4], torch.int64, "cuda"), _ids([5, 6, 7, -1], torch.int32, "cuda")
    jitkv.transfer_pages(src, dst, sp, dp, backend=backend)  # resolves (and builds) the backend before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        jitkv.transfer_pages(src, dst, sp, dp, max_sms=2, backend=backend)
    sp.copy_(_ids([9, -1, 3, 15], torch.int64, "cuda"))
    dp.copy_(_ids([0, 1, 15, 8], torch.int32, "cuda"))
    want = _by_hand(src, dst, sp.cpu(), dp.cpu())
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(dst.cpu(), want)


@gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("v_page", [(16, 2, 64), (16, 2, 32)], ids=["one-launch", "per-pool"])
def test_kv_tuple_one_launch_or_per_pool_gpu(direction, v_page):
    """(K, V) of one page size go in one launch (the binding checks all four pools first), of two page
    sizes one launch per pool: both write what each pool's own call would."""
    (k, hk), (v, hv) = (
        _pools_for(direction, 3, 10, (16, 2, 64), torch.bfloat16),
        _pools_for(direction, 3, 10, v_page, torch.bfloat16),
    )
    sp, dp = _ids([8, 1, -1, 4, 9], torch.int64, "cuda"), _ids([9, 0, 3, 7, 2], torch.int32, "cuda")
    want = [_by_hand(k, hk, sp.cpu(), dp.cpu()), _by_hand(v, hv, sp.cpu(), dp.cpu())]
    jitkv.transfer_pages((k, v), (hk, hv), sp, dp)
    torch.cuda.synchronize()
    assert_bitwise(hk.cpu(), want[0])
    assert_bitwise(hv.cpu(), want[1])


@gpu
def test_kv_tuple_unpinned_second_pool_copies_nothing_gpu():
    """A (K, V) tuple whose V host pool is not pinned: ValueError naming it, K not copied either."""
    k, hk = _pools_for("d2h", 2, 6, (16, 2, 64), torch.bfloat16)
    v = _pool("layer_first", 2, 6, (16, 2, 64), torch.bfloat16, "cuda")
    hv = _pool("page_first", 2, 6, (16, 2, 64), torch.bfloat16)
    before = hk.clone()
    ids = _ids([0, 1, 2], torch.int64, "cuda")
    with pytest.raises(ValueError, match=rf"^{OP}: dst\[1\]: expected a pinned CPU tensor"):
        jitkv.transfer_pages((k, v), (hk, hv), ids, ids)
    torch.cuda.synchronize()
    assert_bitwise(hk, before)


# ------------------------------------------------------------------------- host ids: copy engines


@gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("page", [(64, 1152), (64, 8, 128)], ids=["72KiB", "128KiB"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("kv", [False, True], ids=["one-pool", "kv-tuple"])
def test_host_ids_copy_engines_gpu(direction, page, layout, kv):
    """Ids on the host with a GPU pool: the copy engines (pages of CE_MIN_PAGE_BYTES or more; a (K, V)
    tuple in one batch), adjacent runs merged (consecutive ids, and a page-first pool's layers),
    duplicates resolved on the host (the last valid pair wins), padding skipped; the whole destination
    bitwise against the rule by hand, and backend_info names the copy engine."""
    dtype = torch.uint8 if len(page) == 2 else torch.bfloat16
    pools = []
    for _ in range(2 if kv else 1):
        src, dst = _pools_for(direction, 3, 12, page, dtype)
        if layout == "page_first" and direction == "d2d":
            src = _pool("page_first", 3, 12, page, dtype, "cuda")
            dst = _pool("page_first", 3, 12, page, dtype, "cuda")
        pools.append((src, dst))
    assert math.prod(page) * dst.element_size() >= transfer_ops.CE_MIN_PAGE_BYTES
    sp = _ids([1, 2, 3, 4, 5, 6, 7, -1, 9, 10], torch.int64, "cpu")
    dp = _ids([7, 8, 9, 0, 7, 1, 2, 3, -1, 4], torch.int32, "cpu")
    want = [_by_hand(s, d, sp, dp) for s, d in pools]
    jitkv.ops.reset()
    if kv:
        jitkv.transfer_pages(tuple(s for s, _ in pools), tuple(d for _, d in pools), sp, dp)
    else:
        jitkv.transfer_pages(src, dst, sp, dp)
    torch.cuda.synchronize()
    for (_, d), w in zip(pools, want):
        assert_bitwise(d.cpu(), w)
    info = jitkv.backend_info(OP)["cuda:0"]
    assert info["mechanism"] == "copy engine" and info["reason"] == "page ids on the host: the copy engines"


@gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_host_ids_small_pages_take_the_sm_kernel_gpu(direction):
    """Ids on the host, pages under CE_MIN_PAGE_BYTES: the SM kernel with the pairs resolved on the host
    (padding skipped, the last valid pair of a destination page wins: pages 1 and 2 are named twice);
    an id past its pool raises IndexError before anything is copied (host ids: no sync to check them)."""
    src, dst = _pools_for(direction, 2, 9, (1, 576), torch.bfloat16)
    sp, dp = _ids([8, 0, 3, -1, 6, 4, 7], torch.int64, "cpu"), _ids([1, 2, 8, 5, 2, 1, -1], torch.int32, "cpu")
    want = _by_hand(src, dst, sp, dp)
    jitkv.ops.reset()
    jitkv.transfer_pages(src, dst, sp, dp)
    torch.cuda.synchronize()
    assert_bitwise(dst.cpu(), want)
    info = jitkv.backend_info(OP)["cuda:0"]
    assert info["mechanism"] == "SM copy kernel" and info["reason"] == transfer_ops.HOST_IDS_SM
    before = dst.cpu().clone()
    with pytest.raises(IndexError, match=rf"^{OP}: dst_pages: position 1 has page 9, out of range"):
        jitkv.transfer_pages(src, dst, sp, _ids([1, 9, 8, 5, 0, 0, 0], torch.int64, "cpu"))
    torch.cuda.synchronize()
    assert_bitwise(dst.cpu(), before)


@gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("kv", [False, True], ids=["one-pool", "kv-tuple"])
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("n", [300, 9000], ids=["mid-block", "three-launches"])
def test_host_ids_parameter_blocks_gpu(direction, kv, captured, n):
    """Host pairs past the small parameter block: 300 (the mid block) and 9,000 (launches of at most
    INLINE_PAIRS) over a pool of n + 1,000 one-token pages, with padding and destination pages named
    twice far apart (in different launches), eager and replayed from a graph: the last valid pair wins
    and every other page is left as it was, exactly."""
    T = jitkv.codes.Transfer
    assert T.INLINE_PAIRS_SMALL < 300 <= T.INLINE_PAIRS_MID and 9000 > 2 * T.INLINE_PAIRS
    pages = n + 1000
    pools = [_pools_for(direction, 2, pages, (37,), torch.uint8) for _ in range(2 if kv else 1)]
    g = torch.Generator().manual_seed(3)
    sp = torch.randint(-1, pages, (n,), generator=g)
    dp = torch.randperm(pages, generator=g)[:n]
    dp[n - 100 :] = dp[:100]  # named again far later: these pairs win
    sp[n // 2] = -1
    want = [_by_hand(s, d, sp, dp) for s, d in pools]
    src = tuple(s for s, _ in pools) if kv else pools[0][0]
    dst = tuple(d for _, d in pools) if kv else pools[0][1]
    if captured:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            jitkv.transfer_pages(src, dst, sp, dp.to(torch.int32))
        graph.replay()
    else:
        jitkv.transfer_pages(src, dst, sp, dp.to(torch.int32))
    torch.cuda.synchronize()
    for (_, d), w in zip(pools, want):
        assert_bitwise(d.cpu(), w)


@gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_host_ids_back_to_back_gpu(direction):
    """Host pairs past the middle parameter block, eight calls queued without a sync, alternating the
    current stream and a side stream, of 1,100 to 20,000 pairs (one to five launches each, the pairs in
    their parameter blocks): every destination gets its own call's pairs, padding skipped, bitwise."""
    assert 1100 > jitkv.codes.Transfer.INLINE_PAIRS_MID
    g = torch.Generator().manual_seed(5)
    calls = []
    for n in (1100, 3000, 9000, 1500, 20000, 1200, 5000, 2000):
        pages = n + 500
        src, dst = _pools_for(direction, 2, pages, (37,), torch.uint8)
        sp = torch.randperm(pages, generator=g)[:n]
        dp = torch.randperm(pages, generator=g)[:n].to(torch.int32)
        sp[n // 3] = -1
        calls.append((src, dst, sp, dp, _by_hand(src, dst, sp, dp)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for i, (src, dst, sp, dp, _) in enumerate(calls):
        with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
            jitkv.transfer_pages(src, dst, sp, dp)
    torch.cuda.synchronize()
    for _, dst, _, _, want in calls:
        assert_bitwise(dst.cpu(), want)


@gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("kv", [False, True], ids=["one-pool", "kv-tuple"])
def test_host_ids_follow_the_page_size_gpu(direction, kv):
    """Host ids of pages the copy engines take, then of pages the SM kernel takes, and back, in one
    process: each call asks first the mechanism that copied the one before (the route), which hands the
    other's pages on, so every call copies its pairs exactly once, whole destination bitwise, and
    backend_info names the mechanism that ran."""
    sp, dp = _ids([3, 0, -1, 5, 2], torch.int64, "cpu"), _ids([1, 4, 0, 2, 1], torch.int32, "cpu")
    big, small = (64, 8, 128), (16, 8, 128)
    assert math.prod(big) * 2 >= transfer_ops.CE_MIN_PAGE_BYTES > math.prod(small) * 2
    sets = {
        page: [_pools_for(direction, 2, 6, page, torch.bfloat16) for _ in range(2 if kv else 1)]
        for page in (big, small)
    }
    jitkv.ops.reset()
    for page, mechanism in (
        (big, "copy engine"),
        (big, "copy engine"),
        (small, "SM copy kernel"),
        (small, "SM copy kernel"),
        (big, "copy engine"),
        (small, "SM copy kernel"),
    ):
        pools = sets[page]
        for _, d in pools:
            d.copy_(rand(tuple(d.shape), d.dtype, d.device))  # fresh poison: each call's copy shows
        want = [_by_hand(s, d, sp, dp) for s, d in pools]
        src = tuple(s for s, _ in pools) if kv else pools[0][0]
        dst = tuple(d for _, d in pools) if kv else pools[0][1]
        jitkv.transfer_pages(src, dst, sp, dp)
        torch.cuda.synchronize()
        for (_, d), w in zip(pools, want):
            assert_bitwise(d.cpu(), w)
        assert jitkv.backend_info(OP)["cuda:0"]["mechanism"] == mechanism, page


@gpu
def test_host_ids_refuse_pools_of_2_31_pages_gpu():
    """Host ids travel as int32 in the launch: a pool of 2^31 pages (a stride-0 view here) is refused,
    naming the way out, before anything is copied."""
    src = torch.zeros((1, 1, 4), dtype=torch.uint8).pin_memory().expand(1, 2**31, 4)
    dst = _pool("layer_first", 1, 4, (4,), torch.uint8, "cuda")
    before = dst.cpu().clone()
    ids = _ids([0, 1], torch.int64, "cpu")
    with pytest.raises(ValueError, match=rf"^{OP}: src_pages: ids on the host take pools of fewer than 2\^31 pages"):
        jitkv.transfer_pages(src, dst, ids, ids)
    torch.cuda.synchronize()
    assert_bitwise(dst.cpu(), before)


@gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("page", [(16, 1152), (64, 1152)], ids=["18KiB", "72KiB-copy-engines-eager"])
def test_host_ids_under_graph_capture_gpu(direction, page):
    """Host ids while a stream is captured: a kernel node holding the pairs, pages the copy engines take
    eagerly included (a captured batch would be a memcpy node per run); replays copy the pages the
    ids named at capture, even after the id tensors change."""
    src, dst = _pools_for(direction, 2, 8, page, torch.uint8)
    sp, dp = _ids([1, 2, 5], torch.int64, "cpu"), _ids([0, 1, 6], torch.int64, "cpu")
    jitkv.transfer_pages(src, dst, sp, dp)
    torch.cuda.synchronize()
    dst.random_(0, 256)
    want = _by_hand(src, dst, sp, dp)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        jitkv.transfer_pages(src, dst, sp, dp)
    assert jitkv.backend_info(OP)["cuda:0"]["mechanism"] == "SM copy kernel"
    sp.fill_(7)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(dst.cpu(), want)


@gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_host_ids_kv_tuple_small_pages_gpu(direction):
    """A (K, V) tuple with host ids and small pages: checked and resolved on the host, one launch of the
    SM kernel (destination page 1 named twice: the last pair wins); both pools bitwise; an id past
    its pool, and a pageable V host pool, raise before anything is copied, naming the argument."""
    (k, hk), (v, hv) = (_pools_for(direction, 2, 9, (16, 2, 64), torch.bfloat16) for _ in range(2))
    sp, dp = _ids([8, 0, -1, 3, 6], torch.int32, "cpu"), _ids([1, 2, 8, 5, 1], torch.int64, "cpu")
    want = [_by_hand(k, hk, sp, dp), _by_hand(v, hv, sp, dp)]
    jitkv.transfer_pages((k, v), (hk, hv), sp, dp)
    torch.cuda.synchronize()
    assert_bitwise(hk.cpu(), want[0])
    assert_bitwise(hv.cpu(), want[1])
    with pytest.raises(IndexError, match=rf"^{OP}: src_pages: position 0 has page 9, out of range"):
        jitkv.transfer_pages((k, v), (hk, hv), _ids([9], torch.int64, "cpu"), _ids([0], torch.int64, "cpu"))
    if direction == "d2d":
        return
    name = "dst" if direction == "d2h" else "src"
    src, dst = [k, v], [hk, hv]
    host = dst if direction == "d2h" else src
    host[1] = host[1].clone()  # pageable
    before = [t.cpu().clone() for t in (*src, *dst)]
    with pytest.raises(ValueError, match=rf"^{OP}: {name}\[1\]: expected a pinned CPU tensor"):
        jitkv.transfer_pages(tuple(src), tuple(dst), sp, dp)
    torch.cuda.synchronize()
    for t, b in zip((*src, *dst), before):
        assert_bitwise(t.cpu(), b)


@gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("smaller", ["src", "dst"])
def test_host_ids_kv_tuple_smaller_second_pools_gpu(direction, smaller):
    """A (K, V) tuple with host ids and small pages whose V pool has fewer pages than K's: an id in
    range of K's pool but past V's raises IndexError before either pool is written; ids in range of
    both copy both pools bitwise (V's pool larger than K's: K's range check covers it)."""
    (k, hk), (v, hv) = (_pools_for(direction, 2, 9, (16, 2, 64), torch.bfloat16) for _ in range(2))
    small = _pools_for(direction, 2, 5, (16, 2, 64), torch.bfloat16)[0 if smaller == "src" else 1]
    src, dst = (k, small if smaller == "src" else v), (hk, small if smaller == "dst" else hv)
    before = [t.cpu().clone() for t in (*src, *dst)]
    sp, dp = _ids([1, 6], torch.int64, "cpu"), _ids([2, 3], torch.int32, "cpu")
    if smaller == "dst":
        sp, dp = dp.to(torch.int64), sp.to(torch.int32)
    message = rf"^{OP}: {smaller}_pages: position 1 has page 6, out of range for a pool of 5"
    with pytest.raises(IndexError, match=message):
        jitkv.transfer_pages(src, dst, sp, dp)
    torch.cuda.synchronize()
    for t, b in zip((*src, *dst), before):
        assert_bitwise(t.cpu(), b)
    sp, dp = _ids([4, 0, 3], torch.int64, "cpu"), _ids([1, 4, -1], torch.int32, "cpu")
    want = [_by_hand(s, d, sp, dp) for s, d in zip(src, dst)]
    jitkv.transfer_pages(src, dst, sp, dp)
    torch.cuda.synchronize()
    for d, w in zip(dst, want):
        assert_bitwise(d.cpu(), w)
    src, dst = src[::-1], dst[::-1]  # the smaller pool first: its range check covers the other's
    for t in src:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    want = [_by_hand(s, d, sp, dp) for s, d in zip(src, dst)]
    jitkv.transfer_pages(src, dst, sp, dp)
    torch.cuda.synchronize()
    for d, w in zip(dst, want):
        assert_bitwise(d.cpu(), w)


@gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_host_ids_without_the_cuda_modules_gpu(direction, monkeypatch, request):
    """Host ids where neither CUDA module is available (a failed build), simulated: no copy-engine
    module, and a GPU runner without the host-ids binding, from runners made after the failure (the
    host-ids path is decided when the CPU runner first meets the GPU). The ids are range checked on the
    host (IndexError before anything is copied), moved to the GPU, and the GPU's own runner copies (here
    the jit one this process has); the same bytes, padding and the last pair of a destination page as
    everywhere."""
    src, dst = _pools_for(direction, 2, 9, (1, 576), torch.bfloat16)
    sp, dp = _ids([8, 0, 3, -1, 6], torch.int64, "cpu"), _ids([1, 2, 8, 5, 1], torch.int32, "cpu")
    want = _by_hand(src, dst, sp, dp)
    torch_runner = transfer_ops.TRANSFER_PAGES.runner(torch.device("cuda", 0), "torch")
    monkeypatch.setattr(transfer_ops, "_copy_engine", lambda device, index: None)
    monkeypatch.setattr(transfer_ops.TRANSFER_PAGES, "cuda_runner", lambda index, backend, key: torch_runner)
    request.addfinalizer(jitkv.ops.reset)  # the next test's runners are made without the patches
    jitkv.ops.reset()
    jitkv.transfer_pages(src, dst, sp, dp)
    torch.cuda.synchronize()
    assert_bitwise(dst.cpu(), want)
    assert jitkv.backend_info(OP)["cuda:0"]["reason"] not in (transfer_ops.HOST_IDS_SM, transfer_ops.HOST_IDS_CE)
    before = dst.cpu().clone()
    with pytest.raises(IndexError, match=rf"^{OP}: src_pages: position 0 has page 9, out of range"):
        jitkv.transfer_pages(src, dst, _ids([9], torch.int64, "cpu"), _ids([0], torch.int64, "cpu"))
    torch.cuda.synchronize()
    assert_bitwise(dst.cpu(), before)


@gpu
def test_host_ids_unpinned_refused():
    """Host ids with an unpinned host pool: ValueError naming it, nothing copied."""
    src = _pool("layer_first", 2, 4, (16, 1152), torch.uint8)
    dst = _pool("layer_first", 2, 4, (16, 1152), torch.uint8, "cuda")
    before = dst.cpu().clone()
    ids = _ids([0, 1], torch.int64, "cpu")
    for backend in (None, "jit", "torch"):
        with pytest.raises(ValueError, match=rf"^{OP}: src: expected a pinned CPU tensor"):
            jitkv.transfer_pages(src, dst, ids, ids, backend=backend)
    assert_bitwise(dst.cpu(), before)


# ---------------------------------------------------------------------------------- vector width


def test_one_cuda_module():
    """One CUDA module holds the kernel for every vector width (the binding picks it per call), and
    the copy-engine module is built beside it."""
    assert transfer_ops.specs("9.0a") == [transfer_ops.cuda_spec("9.0a"), transfer_ops.copy_engine_spec("9.0a")]


@gpu
@pytest.mark.parametrize("shift", [2, 1], ids=["4-byte", "1-byte"])
def test_misaligned_views_gpu(shift):
    """Pools whose base is 4 (then 2) bytes past a 16-byte boundary: the binding takes narrower
    vectors (a 16-byte access there is a misaligned-address fault) and the copy is exact, both pools
    and a (K, V) tuple."""
    flat = rand((2 * 8 * 16 * 576 + 2,), torch.bfloat16, "cuda")
    shifted = flat[shift : shift + 2 * 8 * 16 * 576].view(2, 8, 16, 576)
    pool = _pool("page_first", 2, 8, (16, 576), torch.bfloat16, "cuda")
    sp, dp = torch.tensor([3, 0, 6], device="cuda"), torch.tensor([7, 2, 5], device="cuda")
    want = _by_hand(pool, shifted, sp.cpu(), dp.cpu())
    jitkv.transfer_pages(pool, shifted, sp, dp, backend="jit")
    torch.cuda.synchronize()
    assert_bitwise(shifted.cpu(), want)
    other = _pool("layer_first", 2, 8, (16, 576), torch.bfloat16, "cuda")
    want_pair = [_by_hand(shifted, other, dp.cpu(), sp.cpu()), _by_hand(pool, pool, dp.cpu(), sp.cpu())]
    jitkv.transfer_pages((shifted, pool), (other, pool), dp, sp, backend="jit")
    torch.cuda.synchronize()
    assert_bitwise(other.cpu(), want_pair[0])
    assert_bitwise(pool.cpu(), want_pair[1])
