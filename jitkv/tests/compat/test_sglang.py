"""jitkv.compat.sglang: each shim against sglang's rule written out with torch indexing, bitwise over
the whole destination, on caches poisoned with random bytes; row 0 (sglang's padding row) is a
real row, negative and out-of-range rows are errors."""

from __future__ import annotations

import pytest
import torch

from jitkv.compat import sglang
from jitkv.tests.conftest import assert_bitwise, gpu, rand, slots

DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]
COPY_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t):
    """Same-width integer view: assignments through it copy bytes (float8 and NaN payloads included)."""
    return t.view(_INT[t.element_size()])


def _rows_with_zero(num_rows, n, idx_dtype, device):
    """n unique rows, row 0 (the padding row sglang's pools send dummy tokens to) among them."""
    idx = slots(num_rows, n, idx_dtype)
    if not (idx == 0).any():
        idx[n // 2] = 0
    return idx.to(device)


# ------------------------------------------------------------------------------------- store_cache


def _pool_buffers(size, heads, head_dim, dtype, device):
    """K and V buffers as sglang's MHA pool holds them ([size + 1, H, D], row 0 the padding row) and
    hands them to store_cache ([rows, H*D] views)."""
    row = heads * head_dim
    return [rand((size + 1, heads, head_dim), dtype, device).view(-1, row) for _ in range(2)]


def _pool_sources(n, heads, head_dim, dtype, device, rank):
    """k and v as row-strided views (slices of one wider tensor), [n, H*D] as sglang passes them or
    [n, H, D]."""
    row = heads * head_dim
    fused = rand((n, 3 * row), dtype, device)
    k, v = fused[:, row : 2 * row], fused[:, 2 * row :]
    return (k, v) if rank == 2 else (k.view(n, heads, head_dim), v.view(n, heads, head_dim))


def _expected_store(k, v, k_cache, v_cache, indices):
    """sglang's rule with torch indexing: cache[indices[i]] = row i (every index is a real row)."""
    n = indices.numel()
    for src, cache in ((k, k_cache), (v, v_cache)):
        _bits(cache)[indices.long()] = _bits(src[:n]).reshape(n, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", COPY_DTYPES)
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rank", [2, 3])
def test_store_cache(device, dtype, idx_dtype, rank):
    heads, head_dim, size, n = 8, 128, 500, 77
    k, v = _pool_sources(n, heads, head_dim, dtype, device, rank)
    k_cache, v_cache = _pool_buffers(size, heads, head_dim, dtype, device)
    indices = _rows_with_zero(size + 1, n, idx_dtype, device)
    got, want = [k_cache.clone(), v_cache.clone()], [k_cache.clone(), v_cache.clone()]
    sglang.store_cache(k, v, *got, indices)
    _expected_store(k, v, *want, indices)
    assert not torch.equal(_bits(want[0][0]), _bits(k_cache[0]))  # row 0 is written
    for g, w in zip(got, want):
        assert_bitwise(g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_store_cache_keywords(device):
    """row_bytes equal to the row size, a num_split and size_limit = all rows change nothing."""
    k, v = _pool_sources(20, 4, 64, torch.bfloat16, device, 2)
    k_cache, v_cache = _pool_buffers(100, 4, 64, torch.bfloat16, device)
    indices = _rows_with_zero(101, 20, torch.int64, device)
    got, want = [k_cache.clone(), v_cache.clone()], [k_cache.clone(), v_cache.clone()]
    sglang.store_cache(k, v, *got, indices, row_bytes=4 * 64 * 2, num_split=2, size_limit=101)
    _expected_store(k, v, *want, indices)
    for g, w in zip(got, want):
        assert_bitwise(g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_store_cache_strided_indices(device):
    """sglang's kernel takes a strided 1-D index."""
    k, v = _pool_sources(16, 2, 64, torch.float16, device, 2)
    k_cache, v_cache = _pool_buffers(64, 2, 64, torch.float16, device)
    indices = _rows_with_zero(65, 32, torch.int32, device)[::2]
    got, want = [k_cache.clone(), v_cache.clone()], [k_cache.clone(), v_cache.clone()]
    sglang.store_cache(k, v, *got, indices)
    _expected_store(k, v, *want, indices)
    for g, w in zip(got, want):
        assert_bitwise(g, w)


def _small_store(device):
    k, v = _pool_sources(8, 2, 64, torch.bfloat16, device, 2)
    k_cache, v_cache = _pool_buffers(31, 2, 64, torch.bfloat16, device)
    return [k, v, k_cache, v_cache, _rows_with_zero(28, 8, torch.int64, device)]  # 32 rows; below any size_limit used


@pytest.mark.parametrize("bad_slot,size_limit", [(-1, 0), (32, 0), (28, 28)])
def test_store_cache_out_of_range_raises_cpu(bad_slot, size_limit):
    """A negative index (sglang has no padding value), one past the rows, or one at size_limit:
    IndexError before anything is written (sglang's kernel device-asserts)."""
    args = _small_store("cpu")
    args[4][5] = bad_slot
    before = [args[2].clone(), args[3].clone()]
    with pytest.raises(IndexError, match=rf"position 5 has slot {bad_slot}\b"):
        sglang.store_cache(*args, size_limit=size_limit)
    assert_bitwise(args[2], before[0])
    assert_bitwise(args[3], before[1])


@gpu
@pytest.mark.parametrize("bad_slot,size_limit", [(-1, 0), (32, 0), (28, 28)])
def test_store_cache_out_of_range_skipped_cuda(bad_slot, size_limit):
    """On CUDA jitkv skips such a row instead of sglang's device assert; the others are written."""
    args = _small_store("cuda")
    args[4][5] = bad_slot
    got, want = [args[2].clone(), args[3].clone()], [args[2].clone(), args[3].clone()]
    sglang.store_cache(*args[:2], *got, args[4], size_limit=size_limit)
    keep = torch.arange(8, device="cuda") != 5
    _expected_store(args[0][keep], args[1][keep], *want, args[4][keep])
    for g, w in zip(got, want):
        assert_bitwise(g, w)


@gpu
def test_store_cache_negative_raises_cuda_under_debug(monkeypatch):
    monkeypatch.setenv("JITKV_DEBUG", "1")
    args = _small_store("cuda")
    args[4][3] = -2
    before = args[2].clone()
    with pytest.raises(IndexError, match=r"store_cache: indices: position 3 has slot -2\b"):
        sglang.store_cache(*args)
    assert_bitwise(args[2], before)


BAD = [
    # (name, call(args), exception, message)
    ("row_bytes", lambda a: sglang.store_cache(*a, row_bytes=512), ValueError, r"store_cache: row_bytes\b"),
    ("cache dtype", lambda a: sglang.store_cache(*a[:2], a[2].half(), *a[3:]), TypeError, r"store_cache: k_cache\b"),
    ("index float", lambda a: sglang.store_cache(*a[:4], a[4].float()), TypeError, r"store_cache: slot_mapping\b"),
    ("v row size", lambda a: sglang.store_cache(a[0], a[1][:, :64], *a[2:]), ValueError, r"store_cache: v_cache\b"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_store_cache_bad_input(device, case):
    _, call, exc, message = case
    args = _small_store(device)
    before = [args[2].clone(), args[3].clone()]
    with pytest.raises(exc, match=message):
        call(args)
    assert_bitwise(args[2], before[0])
    assert_bitwise(args[3], before[1])


# ------------------------------------------------------------------------------- set_mla_kv_buffer

MLA_SHAPES = [
    (torch.bfloat16, 512, 64),
    (torch.float16, 512, 64),
    (torch.uint8, 528, 128),
    (torch.float8_e4m3fn, 512, 64),
]


def _mla_case(dtype, nope, rope, n, num_rows, device, three_d, tail=0):
    """kv_buffer [num_rows, (1,) nope + rope + tail] and [n, (1,) nope] / [n, (1,) rope] sources."""
    mid = (1,) if three_d else ()
    buf = rand((num_rows, *mid, nope + rope + tail), dtype, device)
    return buf, rand((n, *mid, nope), dtype, device), rand((n, *mid, rope), dtype, device)


def _expected_mla(buf, loc, k_nope, k_rope):
    """sglang's rule with torch indexing: buf[loc[i], :nope + rope] = [k_nope[i] | k_rope[i]]."""
    n = loc.numel()
    rows = torch.cat([k_nope.reshape(n, -1), k_rope.reshape(n, -1)], dim=1)
    _bits(buf).reshape(buf.shape[0], -1)[loc.long(), : rows.shape[1]] = _bits(rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,nope,rope", MLA_SHAPES)
@pytest.mark.parametrize("three_d", [True, False])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("tail", [0, 40])
def test_set_mla_kv_buffer(device, dtype, nope, rope, three_d, idx_dtype, tail):
    n, num_rows = 133, 1025
    buf, k_nope, k_rope = _mla_case(dtype, nope, rope, n, num_rows, device, three_d, tail)
    loc = _rows_with_zero(num_rows, n, idx_dtype, device)
    got, want = buf.clone(), buf.clone()
    sglang.set_mla_kv_buffer(got, loc, k_nope, k_rope)
    _expected_mla(want, loc, k_nope, k_rope)
    assert not torch.equal(_bits(want[0]), _bits(buf[0]))  # row 0 is written
    assert_bitwise(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_set_mla_kv_buffer_knobs_ignored(device):
    buf, k_nope, k_rope = _mla_case(torch.bfloat16, 512, 64, 9, 64, device, True)
    loc = _rows_with_zero(64, 9, torch.int64, device)
    got, want = buf.clone(), buf.clone()
    sglang.set_mla_kv_buffer(got, loc, k_nope, k_rope, 5, 1, 1)
    _expected_mla(want, loc, k_nope, k_rope)
    assert_bitwise(got, want)


@pytest.mark.parametrize("bad_slot", [-1, 64])
def test_set_mla_kv_buffer_out_of_range_raises_cpu(bad_slot):
    """sglang's kernel writes out of bounds for these; jitkv raises before writing anything."""
    buf, k_nope, k_rope = _mla_case(torch.bfloat16, 512, 64, 9, 64, "cpu", False)
    loc = _rows_with_zero(64, 9, torch.int64, "cpu")
    loc[7] = bad_slot
    before = buf.clone()
    with pytest.raises(IndexError, match=rf"position 7 has slot {bad_slot}\b"):
        sglang.set_mla_kv_buffer(buf, loc, k_nope, k_rope)
    assert_bitwise(buf, before)


@gpu
@pytest.mark.parametrize("bad_slot", [-1, 64])
def test_set_mla_kv_buffer_out_of_range_skipped_cuda(bad_slot):
    buf, k_nope, k_rope = _mla_case(torch.bfloat16, 512, 64, 9, 64, "cuda", False)
    loc = _rows_with_zero(64, 9, torch.int64, "cuda")
    loc[7] = bad_slot
    got, want = buf.clone(), buf.clone()
    sglang.set_mla_kv_buffer(got, loc, k_nope, k_rope)
    keep = torch.arange(9, device="cuda") != 7
    _expected_mla(want, loc[keep], k_nope[keep], k_rope[keep])
    assert_bitwise(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_set_mla_kv_buffer_bad_input(device):
    buf, k_nope, k_rope = _mla_case(torch.bfloat16, 512, 64, 9, 64, device, False)
    loc = _rows_with_zero(64, 9, torch.int64, device)
    before = buf.clone()
    with pytest.raises(TypeError, match=r"set_mla_kv_buffer: cache_k_rope\b"):
        sglang.set_mla_kv_buffer(buf, loc, k_nope, k_rope.half())
    with pytest.raises(ValueError, match=r"set_mla_kv_buffer: kv_buffer: row width 560 is smaller"):
        sglang.set_mla_kv_buffer(buf[:, :560], loc, k_nope, k_rope)
    assert_bitwise(buf, before)


# -------------------------------------------------------------- apply_rope_with_cos_sin_cache_inplace


def _rope_case(device, n=21, hq=4, hk=2, d=64, dtype=torch.bfloat16, size=64):
    q, k, v = (rand((n, h, d), dtype, device) for h in (hq, hk, hk))
    k_buffer, v_buffer = _pool_buffers(size, hk, d, dtype, device)
    return q, k, v.view(n, hk * d), k_buffer, v_buffer, torch.randint(0, 500, (n,), device=device)


def test_apply_rope_names_positions_that_are_not_a_tensor():
    """Without fused_args the shim reads positions' device for its padding slots: a list raises the
    op's TypeError naming positions (not an AttributeError); q and k unchanged."""
    from jitkv.tests.compat.rope_rule import table

    q, k, _, _, _, positions = _rope_case("cpu")
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(TypeError, match=r"^rope_store_cache: positions: expected a torch.Tensor, got list$"):
        sglang.apply_rope_with_cos_sin_cache_inplace(q, k, table(500, 64), positions.tolist(), is_neox=True)
    assert_bitwise(q, q0)
    assert_bitwise(k, k0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rope_dim", [0, 32])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_apply_rope_with_cos_sin_cache_inplace(device, is_neox, rope_dim, fused, idx_dtype):
    """sglang's rule: q and k rotated in place over rope_dim (0: the table's width) dims at their
    positions; with fused_args, k_buffer[cache_loc] = rotated k, v_buffer[cache_loc] = value (row 0 a real
    row); nothing else written."""
    from jitkv.tests.compat.rope_rule import rotate, table

    q, k, v, k_buffer, v_buffer, positions = _rope_case(device)
    positions = positions.to(idx_dtype)
    cs = table(500, rope_dim or 64).to(device)
    loc = _rows_with_zero(k_buffer.shape[0], q.shape[0], idx_dtype, device)
    want_q, want_k, want_kb, want_vb = q.clone(), k.clone(), k_buffer.clone(), v_buffer.clone()
    for t in range(q.shape[0]):
        want_q[t] = rotate(q[t], positions[t], cs, is_neox, rope_dim or None).to(q.dtype)
        want_k[t] = rotate(k[t], positions[t], cs, is_neox, rope_dim or None).to(k.dtype)
        if fused:
            _bits(want_kb)[loc[t]] = _bits(want_k[t]).reshape(-1)
            _bits(want_vb)[loc[t]] = _bits(v[t])
    args = sglang.FusedSetKVBufferArg(v, k_buffer, v_buffer, loc) if fused else None
    sglang.apply_rope_with_cos_sin_cache_inplace(
        q, k, cs, positions, is_neox=is_neox, rope_dim=rope_dim, fused_args=args
    )
    for got, want in ((q, want_q), (k, want_k), (k_buffer, want_kb), (v_buffer, want_vb)):
        assert_bitwise(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_only_padding_is_one_kept_tensor(device):
    """A RoPE-only call pads its slots with a view of one kept -1 tensor per device and dtype (no fill
    kernel per call); a longer call grows it, and the tensor it replaced stays alive for kernels queued
    before."""
    like = torch.zeros(1, dtype=torch.int32, device=device)
    small = sglang._padding_slots(5, like)
    again = sglang._padding_slots(7, like)
    assert small.data_ptr() == again.data_ptr() and bool((again == -1).all())
    big = sglang._padding_slots(5000, like)
    assert big.numel() == 5000 and bool((big == -1).all()) and big.data_ptr() != small.data_ptr()
    assert any(t.data_ptr() == small.data_ptr() for t in sglang._RETIRED)
    assert sglang._padding_slots(3, like.long()).dtype == torch.int64


@gpu
def test_rope_only_under_graph_capture():
    """RoPE-only calls captured in a CUDA graph, with a padding tensor made before the capture and with
    one the capture needs longer (its own fill, recorded and run at replay), rotate as eager calls do."""
    from jitkv.tests.compat.rope_rule import table

    q, k, _, _, _, positions = _rope_case("cuda")
    cs = table(500, 64).cuda()
    want_q, want_k = q.clone(), k.clone()
    sglang.apply_rope_with_cos_sin_cache_inplace(want_q, want_k, cs, positions, is_neox=True)
    key = (positions.device, positions.dtype)
    for kept in (len(q), 1):  # the kept tensor long enough; too short, so that the capture fills its own
        sglang._PADDING[key] = sglang._padding_slots(len(q), positions)[:kept]
        gq, gk = q.clone(), k.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sglang.apply_rope_with_cos_sin_cache_inplace(gq, gk, cs, positions, is_neox=True)
        torch.cuda.synchronize()
        gq.copy_(q)
        gk.copy_(k)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(gq, want_q)
        assert_bitwise(gk, want_k)


def test_apply_rope_negative_cache_loc_raises_first():
    q, k, v, k_buffer, v_buffer, positions = _rope_case("cpu")
    cs = torch.randn(500, 64)
    loc = slots(k_buffer.shape[0], q.shape[0])
    loc[3] = -1
    before = [t.clone() for t in (q, k, k_buffer, v_buffer)]
    with pytest.raises(IndexError, match=r"apply_rope_with_cos_sin_cache_inplace: cache_loc: position 3 has slot -1"):
        sglang.apply_rope_with_cos_sin_cache_inplace(
            q, k, cs, positions, is_neox=True, fused_args=sglang.FusedSetKVBufferArg(v, k_buffer, v_buffer, loc)
        )
    for got, want in zip((q, k, k_buffer, v_buffer), before):
        assert_bitwise(got, want)


# ----------------------------------------------------------------------------------------- HiCache


def _item_rule(src, dst, idx_src, idx_dst, element_dim):
    """sglang's one-layer rule: dst.view(-1, element_dim)[idx_dst[i]] = src.view(-1, element_dim)[idx_src[i]]."""
    want = dst.cpu().clone()
    want.view(-1, element_dim)[idx_dst.cpu()] = src.cpu().view(-1, element_dim)[idx_src.cpu()]
    return want


def _host(t, device):
    """A host cache as sglang allocates it: pinned when a GPU is in the copy."""
    return t.pin_memory() if device == "cuda" else t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_transfer_hicache_one_layer(device, dtype):
    """Host -> device load of one layer's K and V (sglang's load_to_device_per_layer), items of 8 x 128."""
    items, heads, dim = 40, 8, 128
    k_dev, v_dev = rand((items, heads, dim), dtype, device), rand((items, heads, dim), dtype, device)
    k_host, v_host = (_host(rand((items * 2, heads, dim), dtype), device) for _ in range(2))
    idx_src = slots(items * 2, 10, torch.int64, device)
    idx_dst = _rows_with_zero(items, 10, torch.int64, device)
    want = [
        _item_rule(k_host, k_dev, idx_src, idx_dst, heads * dim),
        _item_rule(v_host, v_dev, idx_src, idx_dst, heads * dim),
    ]
    sglang.transfer_hicache_one_layer(
        k_dev, v_dev, idx_dst, k_host, v_host, idx_src, element_dim=heads * dim, block_quota=3, unroll=2
    )
    if device == "cuda":
        torch.cuda.synchronize()
    assert_bitwise(k_dev.cpu(), want[0])
    assert_bitwise(v_dev.cpu(), want[1])


@pytest.mark.parametrize("device", DEVICES)
def test_transfer_hicache_one_layer_mla(device):
    items, width = 30, 576
    dev = rand((items, 1, width), torch.bfloat16, device)
    host = _host(rand((items, 1, width), torch.bfloat16), device)
    idx_src, idx_dst = slots(items, 7, torch.int32, device), _rows_with_zero(items, 7, torch.int64, device)
    want = _item_rule(dev, host, idx_src, idx_dst, width)
    sglang.transfer_hicache_one_layer_mla(host, idx_dst, dev, idx_src)  # device -> host backup
    if device == "cuda":
        torch.cuda.synchronize()
    assert_bitwise(host.cpu(), want)


def _all_layer_rule(src_alloc, dst_alloc, layer_offsets, strides, idx_src, idx_dst, item_bytes):
    """sglang's all-layer rule on raw bytes: item j of layer l at base + offset[l] + j * stride."""
    want = dst_alloc.cpu().clone()
    sb, db = src_alloc.cpu().contiguous().view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)
    (s_off, d_off), (s_stride, d_stride) = layer_offsets, strides
    for layer in range(len(s_off)):
        for i, j in zip(idx_src.tolist(), idx_dst.tolist()):
            a, b = s_off[layer] + i * s_stride, d_off[layer] + j * d_stride
            db[b : b + item_bytes] = sb[a : a + item_bytes]
    return want


@pytest.mark.parametrize("device", DEVICES)
def test_transfer_hicache_all_layer(device):
    """Device (layer-first [L, items, H, D]) -> host (page-first [items, L, H, D], passed transposed):
    sglang's backup of all layers, addressed as its pointer tables and strides would address them."""
    layers, items, heads, dim, dtype = 3, 24, 2, 64, torch.float16
    item = heads * dim * 2
    k_dev, v_dev = (rand((layers, items, heads, dim), dtype, device) for _ in range(2))
    k_host, v_host = (_host(rand((items * 2, layers, heads, dim), dtype), device) for _ in range(2))
    idx_src, idx_dst = slots(items, 9, torch.int64, device), _rows_with_zero(items * 2, 9, torch.int64, device)
    offsets = ([layer * items * item for layer in range(layers)], [layer * item for layer in range(layers)])
    strides = (item, layers * item)
    want = [
        _all_layer_rule(s, d, offsets, strides, idx_src, idx_dst, item) for s, d in ((k_dev, k_host), (v_dev, v_host))
    ]
    sglang.transfer_hicache_all_layer(
        k_host.transpose(0, 1),
        v_host.transpose(0, 1),
        idx_dst,
        k_dev,
        v_dev,
        idx_src,
        kv_cache_src_stride_bytes=strides[0],
        kv_cache_dst_stride_bytes=strides[1],
        element_size=item,
        block_quota=2,
    )
    if device == "cuda":
        torch.cuda.synchronize()
    assert_bitwise(k_host.cpu(), want[0])
    assert_bitwise(v_host.cpu(), want[1])


@pytest.mark.parametrize("device", DEVICES)
def test_transfer_hicache_all_layer_mla(device):
    """Host page-first -> device layer-first, one MLA pool of 1152-byte items."""
    layers, items = 2, 20
    dev = rand((layers, items, 1, 576), torch.bfloat16, device)
    host = _host(rand((items, layers, 1, 576), torch.bfloat16), device)
    idx_src, idx_dst = slots(items, 6, torch.int32, device), _rows_with_zero(items, 6, torch.int32, device)
    offsets = ([layer * 1152 for layer in range(layers)], [layer * items * 1152 for layer in range(layers)])
    want = _all_layer_rule(host, dev, offsets, (layers * 1152, 1152), idx_src, idx_dst, 1152)
    sglang.transfer_hicache_all_layer_mla(
        dev, idx_dst, host.transpose(0, 1), idx_src, cache_src_stride_bytes=layers * 1152, cache_dst_stride_bytes=1152
    )
    if device == "cuda":
        torch.cuda.synchronize()
    assert_bitwise(dev.cpu(), want)


def test_transfer_hicache_bad_input():
    dev, host = rand((2, 8, 64), torch.bfloat16), rand((8, 2, 64), torch.bfloat16)
    idx = torch.tensor([1, 2])
    pointers = torch.tensor([dev.data_ptr(), dev[1].data_ptr()], dtype=torch.int64)
    with pytest.raises(TypeError, match=r"^transfer_hicache_all_layer_mla: ptr_src: per-layer pointer tables"):
        sglang.transfer_hicache_all_layer_mla(
            host.transpose(0, 1), idx, pointers, idx, cache_src_stride_bytes=128, cache_dst_stride_bytes=256
        )
    with pytest.raises(ValueError, match=r"^transfer_hicache_all_layer_mla: cache_dst_stride_bytes: expected 256"):
        sglang.transfer_hicache_all_layer_mla(
            host.transpose(0, 1), idx, dev, idx, cache_src_stride_bytes=128, cache_dst_stride_bytes=128
        )
    with pytest.raises(ValueError, match=r"^transfer_hicache_all_layer_mla: element_size: expected 128"):
        sglang.transfer_hicache_all_layer_mla(
            host.transpose(0, 1), idx, dev, idx, cache_src_stride_bytes=128, cache_dst_stride_bytes=256, element_size=64
        )
    before = host.clone()
    with pytest.raises(IndexError, match=r"^transfer_hicache_one_layer_mla: indices_src: position 1 has slot -1"):
        sglang.transfer_hicache_one_layer_mla(host[:, 0], idx, dev[0], torch.tensor([0, -1]))
    assert_bitwise(host, before)
