"""jitkv.compat.flashinfer: each shim against FlashInfer's documented rule written out per token (page
table walked in Python, RoPE in float32, stored = fp8(satfinite(x * quant_scale))), bitwise over whole
poisoned caches and outputs."""

from __future__ import annotations

import types

import pytest
import torch

import jitkv
from jitkv.compat import flashinfer
from jitkv.ops import rope
from jitkv.ops import store_cache as store_cache_op
from jitkv.tests.compat.rope_rule import rotate, table
from jitkv.tests.conftest import assert_bitwise, gpu, rand

DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16


def _page_table(lens, page_size, num_pages, device):
    """FlashInfer's page table for requests of ``lens`` tokens (pages in random order), and per appended
    token its request and position: the last ``min(len, 3)`` tokens of each request are appended, then a
    padding token (batch index -1)."""
    order = torch.randperm(num_pages)
    indptr, indices, batch, pos = [0], [], [], []
    for b, length in enumerate(lens):
        pages = -(-length // page_size)
        indices += order[indptr[-1] : indptr[-1] + pages].tolist()
        indptr.append(indptr[-1] + pages)
        for p in range(max(0, length - 3), length):
            batch.append(b)
            pos.append(p)
    batch.append(-1)
    pos.append(0)
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return as_t(indices), as_t(indptr), as_t(batch), as_t(pos)


def _slot(i, indices, indptr, batch, pos, page_size):
    """The (page, row) of appended token i, FlashInfer's rule, or None for padding."""
    b = int(batch[i])
    if b < 0:
        return None
    p = int(pos[i])
    return int(indices[int(indptr[b]) + p // page_size]), p % page_size


def _quant(x, scale, fp8):
    m = FP8_MAX[fp8]
    return (x.float() * scale).clamp(-m, m).to(fp8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("one_tensor", [False, True])
def test_append_paged_kv_cache(device, layout, one_tensor):
    ps, pages, h, d = 4, 12, 2, 32
    indices, indptr, batch, pos = _page_table([5, 9, 2], ps, pages, device)
    n = batch.numel()
    key, value = rand((n, h, d), BF16, device), rand((n, h, d), BF16, device)
    inner = (h, ps) if layout == "HND" else (ps, h)
    cache = rand((pages, 2, *inner, d), BF16, device)
    want = cache.clone()
    for i in range(n):
        at = _slot(i, indices, indptr, batch, pos, ps)
        if at is None:
            continue
        for side, src in ((0, key), (1, value)):
            dst = want[at[0], side]
            (dst[:, at[1]] if layout == "HND" else dst[at[1]]).copy_(src[i])
    paged = cache if one_tensor else (cache[:, 0], cache[:, 1])
    flashinfer.append_paged_kv_cache(key, value, batch, pos, paged, indices, indptr, None, kv_layout=layout)
    assert_bitwise(cache, want)


@pytest.mark.parametrize("device", DEVICES)
def test_append_paged_mla_kv_cache(device):
    ps, pages = 4, 10
    indices, indptr, batch, pos = _page_table([6, 3, 7], ps, pages, device)
    n = batch.numel()
    ckv, kpe = rand((n, 512), BF16, device), rand((n, 64), BF16, device)
    ckv_cache, kpe_cache = rand((pages, ps, 512), BF16, device), rand((pages, ps, 64), BF16, device)
    want_c, want_k = ckv_cache.clone(), kpe_cache.clone()
    for i in range(n):
        at = _slot(i, indices, indptr, batch, pos, ps)
        if at is not None:
            want_c[at], want_k[at] = ckv[i], kpe[i]
    flashinfer.append_paged_mla_kv_cache(ckv, kpe, batch, pos, ckv_cache, kpe_cache, indices, indptr, None)
    assert_bitwise(ckv_cache, want_c)
    assert_bitwise(kpe_cache, want_k)


def _rope_inputs(device, n, hq, hk, rope, nope, mla):
    q_rope, q_nope = rand((n, hq, rope), BF16, device), rand((n, hq, nope), BF16, device)
    if mla:
        return q_rope, q_nope, rand((n, rope), BF16, device), rand((n, nope), BF16, device), None
    return (
        q_rope,
        q_nope,
        rand((n, hk, rope), BF16, device),
        rand((n, hk, nope), BF16, device),
        rand((n, hk, rope + nope), BF16, device),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mla", [False, "apart", "one buffer"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("outputs", ["allocated", "given apart", "given adjacent"])
def test_rope_quantize_fp8_append_paged_kv_cache(device, mla, layout, is_neox, outputs, monkeypatch):
    """FlashInfer's rule: RoPE on q_rope / k_rope at pos_ids, every Q value fp8(q * quant_scale_q), K as
    [rope | nope] and V quantized with quant_scale_kv into the pages (MLA: ckv / kpe caches, separate
    tensors or the column views of one buffer, which rope_set_mla_kv_buffer writes); scales that are
    powers of two (the module docstring: then the bytes are FlashInfer's)."""
    if mla and layout == "HND":
        pytest.skip("kv_layout applies to GQA/MHA only")
    ps, pages, hq, hk, rope, nope = 4, 12, 4, 2, 32, 48
    indices, indptr, batch, pos = _page_table([5, 9, 2], ps, pages, device)
    n = batch.numel()
    q_rope, q_nope, k_rope, k_nope, v = _rope_inputs(device, n, hq, hk, rope, nope, mla)
    cs, pos_ids = table(64, rope).to(device), torch.randint(0, 64, (n,), device=device)
    sq, skv = 0.5, 4.0
    if mla in ("one buffer", "one buffer, every other page"):  # the latter: no one row stride (scratch rows)
        buf = (
            rand((pages, ps, nope + rope), E4M3, device)
            if mla == "one buffer"
            else rand((2 * pages, ps, nope + rope), E4M3, device)[::2]
        )
        caches = (buf[..., :nope], buf[..., nope:])
    elif mla:
        caches = (rand((pages, ps, nope), E4M3, device), rand((pages, ps, rope), E4M3, device))
    else:
        shape = (pages, hk, ps, rope + nope) if layout == "HND" else (pages, ps, hk, rope + nope)
        caches = (rand(shape, E4M3, device), rand(shape, E4M3, device))
    want = [c.clone() for c in caches]
    want_qr, want_qn = torch.empty_like(q_rope, dtype=E4M3), _quant(q_nope, sq, E4M3)
    for i in range(n):
        want_qr[i] = _quant(rotate(q_rope[i], pos_ids[i], cs, is_neox), sq, E4M3)
        at = _slot(i, indices, indptr, batch, pos, ps)
        if at is None:
            continue
        k = _quant(torch.cat([rotate(k_rope[i], pos_ids[i], cs, is_neox), k_nope[i].float()], -1), skv, E4M3)
        if mla:
            want[0][at] = k[rope:]
            want[1][at] = k[:rope]
            continue
        for c, vals in zip(want, (k, _quant(v[i], skv, E4M3))):
            (c[at[0], :, at[1]] if layout == "HND" else c[at]).view(torch.uint8).copy_(vals.view(torch.uint8))
    kw = {}
    if outputs == "given apart":
        kw = dict(q_rope_out=rand(q_rope.shape, E4M3, device), q_nope_out=rand(q_nope.shape, E4M3, device))
    elif outputs == "given adjacent":
        both = rand((n, hq, rope + nope), E4M3, device)
        kw = dict(q_rope_out=both[..., :rope], q_nope_out=both[..., rope:])
    mla_calls = []
    real = flashinfer.rope_set_mla_kv_buffer
    monkeypatch.setattr(flashinfer, "rope_set_mla_kv_buffer", lambda *a, **kw: mla_calls.append(1) or real(*a, **kw))
    got_qr, got_qn = flashinfer.rope_quantize_fp8_append_paged_kv_cache(
        q_rope,
        k_rope,
        q_nope,
        k_nope,
        v,
        cs,
        pos_ids,
        caches,
        indices,
        indptr,
        batch,
        pos,
        is_neox=is_neox,
        quant_scale_q=sq,
        quant_scale_kv=skv,
        page_size=ps,
        kv_layout=layout,
        **kw,
    )
    assert_bitwise(got_qr, want_qr)
    assert_bitwise(got_qn, want_qn)
    if kw:
        assert got_qr.data_ptr() == kw["q_rope_out"].data_ptr() and got_qn.data_ptr() == kw["q_nope_out"].data_ptr()
    if device == "cpu":  # MLA: rope_set_mla_kv_buffer, q_nope quantized in the same call
        assert mla_calls == [1] * bool(mla)
    for got, w in zip(caches, want):
        assert_bitwise(got, w)


def test_other_scales_differ_from_multiplying_only_at_ties():
    """A scale that is no power of two: x / fp32(1 / s) against x * s, at most one fp8 step apart and
    equal almost everywhere (the module docstring)."""
    ps, pages, hq, hk, rope = 4, 12, 4, 2, 64
    indices, indptr, batch, pos = _page_table([9, 9, 9], ps, pages, "cpu")
    n = batch.numel()
    q_rope, _, k_rope, _, v = _rope_inputs("cpu", n, hq, hk, rope, 0, False)
    caches = (torch.zeros(pages, ps, hk, rope, dtype=E4M3), torch.zeros(pages, ps, hk, rope, dtype=E4M3))
    cs, pos_ids = table(64, rope), torch.randint(0, 64, (n,))
    got_q, _ = flashinfer.rope_quantize_fp8_append_paged_kv_cache(
        q_rope,
        k_rope,
        None,
        None,
        v,
        cs,
        pos_ids,
        caches,
        indices,
        indptr,
        batch,
        pos,
        quant_scale_q=0.37,
        quant_scale_kv=0.37,
        page_size=ps,
    )
    want_q = torch.stack([_quant(rotate(q_rope[i], pos_ids[i], cs, True), 0.37, E4M3) for i in range(n)])
    step = (got_q.view(torch.uint8).int() - want_q.view(torch.uint8).int()).abs()
    assert int(step.max()) <= 1 and float((step != 0).float().mean()) < 0.01


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("given", [False, True])
def test_rope_quantize_without_nope_parts(device, given):
    """GQA with q_nope and k_nope None (FlashInfer's call for heads rotated whole): every Q value
    fp8(rope(q) * quant_scale_q), K as rope(k) and V quantized into the pages; the q_nope_out returned has
    no columns. With q_rope_out given, it is the tensor written."""
    ps, pages, hq, hk, d = 4, 12, 4, 2, 32
    indices, indptr, batch, pos = _page_table([5, 9, 2], ps, pages, device)
    n = batch.numel()
    q_rope, k_rope, v = rand((n, hq, d), BF16, device), rand((n, hk, d), BF16, device), rand((n, hk, d), BF16, device)
    cs, pos_ids = table(64, d).to(device), torch.randint(0, 64, (n,), device=device)
    caches = tuple(rand((pages, ps, hk, d), E4M3, device) for _ in "kv")
    want = [c.clone() for c in caches]
    want_q = torch.stack([_quant(rotate(q_rope[i], pos_ids[i], cs, True), 2.0, E4M3) for i in range(n)])
    for i in range(n):
        at = _slot(i, indices, indptr, batch, pos, ps)
        if at is not None:
            want[0][at] = _quant(rotate(k_rope[i], pos_ids[i], cs, True), 0.5, E4M3)
            want[1][at] = _quant(v[i], 0.5, E4M3)
    out = rand((n, hq, d), E4M3, device) if given else None
    got_q, got_nope = flashinfer.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, None, None, v, cs, pos_ids, caches, indices, indptr, batch, pos,
        quant_scale_q=2.0, quant_scale_kv=0.5, page_size=ps, q_rope_out=out,
    )  # fmt: skip
    assert_bitwise(got_q, want_q)
    assert got_nope.shape == (n, hq, 0) and got_nope.dtype == E4M3
    assert not given or got_q.data_ptr() == out.data_ptr()
    for got, w in zip(caches, want):
        assert_bitwise(got, w)


def test_bad_input():
    indices, indptr, batch, pos = _page_table([3], 4, 4, "cpu")
    q, qn, k, kn, v = _rope_inputs("cpu", batch.numel(), 2, 2, 16, 0, False)
    caches = (rand((4, 4, 2, 16), E4M3, "cpu"), rand((4, 4, 2, 16), E4M3, "cpu"))
    args = (
        q,
        k,
        qn,
        kn,
        v,
        table(8, 16),
        torch.zeros(batch.numel(), dtype=torch.int64),
        caches,
        indices,
        indptr,
        batch,
        pos,
    )
    op = "rope_quantize_fp8_append_paged_kv_cache"
    with pytest.raises(ValueError, match=rf"^{op}: cos_sin_cache: expected float32"):
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(*args[:5], table(8, 16).half(), *args[6:], page_size=4)
    with pytest.raises(ValueError, match=rf"^{op}: v: GQA/MHA needs V, got None"):
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(*args[:4], None, *args[5:], page_size=4)
    with pytest.raises(ValueError, match=rf"^{op}: paged_kv_cache\[0\]: expected a 4-D torch.float8_e5m2 cache"):
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(*args, quantize_dtype=torch.float8_e5m2, page_size=4)
    with pytest.raises(ValueError, match=r"^append_paged_kv_cache: kv_layout: expected one of NHD, HND"):
        flashinfer.append_paged_kv_cache(k, v, batch, pos, caches, indices, indptr, None, kv_layout="NDH")
    # MLA: rows of other widths than the parts' (the ops take wider rows), one buffer's views or apart.
    q, qn, k, kn, _ = _rope_inputs("cpu", batch.numel(), 2, 1, 16, 32, True)
    for ckv, kpe, at, want in (
        (40, 16, 0, "32 values like k_nope, got 40"),
        (32, 24, 1, "16 values like k_rope, got 24"),
    ):
        buf = rand((4, 4, ckv + kpe), E4M3, "cpu")
        for mla_caches in ((buf[..., :ckv], buf[..., ckv:]), (buf[..., :ckv].clone(), buf[..., ckv:].clone())):
            before = [c.clone() for c in mla_caches]
            with pytest.raises(ValueError, match=rf"^{op}: paged_kv_cache\[{at}\]: expected rows of {want}$"):
                flashinfer.rope_quantize_fp8_append_paged_kv_cache(
                    q, k, qn, kn, None, *args[5:7], mla_caches, *args[8:], page_size=4
                )
            for c, b in zip(mla_caches, before):
                assert_bitwise(c, b)
    # MLA caches the scratch-row form cannot take: one buffer's views with pages apart, overlapping caches.
    buf = rand((8, 4, 48), E4M3, "cpu")
    q_out = rand((batch.numel(), 2, 48), E4M3, "cpu")
    for mla_caches, want in (
        ((buf[::2, :, :32], buf[::2, :, 32:]), r"paged_kv_cache: the ckv and kpe views of one buffer need its pages"),
        ((buf[:4, :, :32], buf[:4, :, 16:32]), r"paged_kv_cache\[1\]: shares memory with paged_kv_cache\[0\]"),
    ):
        before, q_before = buf.clone(), q_out.clone()
        with pytest.raises(ValueError, match=rf"^{op}: {want}"):
            flashinfer.rope_quantize_fp8_append_paged_kv_cache(
                q, k, qn, kn, None, *args[5:7], mla_caches, *args[8:], page_size=4,
                q_rope_out=q_out[..., 32:], q_nope_out=q_out[..., :32],
            )  # fmt: skip
        assert_bitwise(buf, before)
        assert_bitwise(q_out, q_before)


def test_shims_name_arguments_that_are_not_tensors():
    """What a shim reads itself before an op checks it raises TypeError naming FlashInfer's argument, not an
    AttributeError; the caches are unchanged."""
    indices, indptr, batch, pos = _page_table([3], 4, 4, "cpu")
    n = batch.numel()
    q, qn, k, kn, v = _rope_inputs("cpu", n, 2, 2, 16, 16, False)
    caches = (rand((4, 4, 2, 32), E4M3, "cpu"), rand((4, 4, 2, 32), E4M3, "cpu"))
    before = [c.clone() for c in caches]
    args = dict(q_rope=q, k_rope=k, q_nope=qn, k_nope=kn, v=v, cos_sin_cache=table(8, 16), pos_ids=pos.long())
    args |= dict(paged_kv_cache=caches, kv_indices=indices, kv_indptr=indptr, batch_indices=batch, positions=pos)
    op = "rope_quantize_fp8_append_paged_kv_cache"
    pair = r"expected a \(k_cache, v_cache\) pair of torch.Tensors"
    for change, want in (
        (dict(q_rope=q.tolist()), "q_rope: expected a torch.Tensor, got list"),
        (dict(k_rope=None), "k_rope: expected a torch.Tensor, got NoneType"),
        (dict(cos_sin_cache=1.0), "cos_sin_cache: expected a torch.Tensor, got float"),
        (dict(q_nope=3), "q_nope: expected a torch.Tensor or None, got int"),
        (dict(q_rope_out=[1]), "q_rope_out: expected a torch.Tensor or None, got list"),
        (dict(paged_kv_cache=caches[0]), f"paged_kv_cache: {pair}, got Tensor"),
        (dict(paged_kv_cache=caches + caches[:1]), f"paged_kv_cache: {pair}, got a tuple of Tensor, Tensor, Tensor"),
        (dict(paged_kv_cache=(caches[0], None)), f"paged_kv_cache: {pair}, got a tuple of Tensor, NoneType"),
    ):
        with pytest.raises(TypeError, match=rf"^{op}: {want}$"):
            flashinfer.rope_quantize_fp8_append_paged_kv_cache(**(args | change), page_size=4)
    with pytest.raises(TypeError, match=rf"^append_paged_kv_cache: paged_kv_cache: {pair} or a \[pages, 2"):
        flashinfer.append_paged_kv_cache(v, v, batch, pos, [caches[0]], indices, indptr, None)
    mla = (rand((4, 4, 16), BF16, "cpu"), rand((4, 4, 8), BF16, "cpu"))
    rows = (rand((n, 16), BF16, "cpu"), rand((n, 8), BF16, "cpu"))
    for at, name in enumerate(("append_ckv", "append_kpe", "ckv_cache", "kpe_cache")):
        given = [*rows, *mla]
        given[at] = given[at].tolist()
        with pytest.raises(TypeError, match=rf"^append_paged_mla_kv_cache: {name}: expected a torch.Tensor, got list$"):
            flashinfer.append_paged_mla_kv_cache(*given[:2], batch, pos, *given[2:], indices, indptr, None)
    for got, want in zip(caches, before):
        assert_bitwise(got, want)


def _random_page_table(n, requests, pages, page_size, dtype, device):
    """Random indices with every edge page_slots clamps or skips: padding tokens, requests past kv_indptr,
    positions past a request's pages and past kv_indices, negative positions; every other of the first
    tokens is decode's, one per request (batch_indices[t] = t, whose kv_indptr entry the CUDA walks load
    beside batch_indices: cuda/paged.cuh indptr_guess), the later of them past kv_indptr."""
    gen = torch.Generator().manual_seed(n)
    lens = torch.randint(0, 4, (requests,), generator=gen)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    indices = torch.randint(0, pages, (int(indptr[-1]),), generator=gen)
    batch = torch.randint(-1, requests + 2, (n,), generator=gen)
    decode = torch.arange(0, min(n, 2 * requests + 4), 2)
    batch[decode] = decode
    pos = torch.randint(-2 * page_size, 5 * page_size, (n,), generator=gen)
    return [t.to(dtype).to(device) for t in (batch, pos, indices, indptr)]


def _one_token_per_slot(n, pages, page_size, dtype, empty, device="cuda"):
    """_random_page_table (kv_indices emptied where ``empty``) with one token per slot: a slot's later
    tokens made padding, so that the one-launch and two-launch forms write the same bytes whatever order
    their threads store in. Returns (batch_indices, positions, kv_indices, kv_indptr, the tokens' slots
    before the padding, a list)."""
    batch, pos, indices, indptr = _random_page_table(n, 5, pages, page_size, dtype, device)
    if empty:
        indices = indices[:0]
    slots = flashinfer.page_slots_torch(batch.cpu(), pos.cpu(), indices.cpu(), indptr.cpu(), page_size).tolist()
    seen, taken = set(), []
    for s in slots:
        taken.append(s >= 0 and s in seen)
        seen.add(s)
    batch[torch.tensor(taken, device=device)] = -1
    return batch, pos, indices, indptr, slots


def _record_page_slots(monkeypatch):
    """A list that gets the arguments of each call of flashinfer's _page_slots (the two-launch form's
    first launch), which still runs."""
    made, real = [], flashinfer._page_slots
    monkeypatch.setattr(flashinfer, "_page_slots", lambda *a: made.append(a) or real(*a))
    return made


def _refuse(monkeypatch, *names):
    """flashinfer's functions ``names`` made to fail the test if called (the two-launch form's)."""

    def refused(*a, **k):
        raise AssertionError("the two-launch form ran")

    for name in names:
        monkeypatch.setattr(flashinfer, name, refused)


@gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("empty", [False, True])
def test_page_slots_kernel_gives_the_torch_forms_slots(dtype, n, empty):
    """The CUDA kernel (csrc/compat/page_slots_cuda.cu) against page_slots_torch on the same tables, the
    edges included; the kernel, not the torch form, ran."""
    batch, pos, indices, indptr = _random_page_table(n, 5, 9, 4, dtype, "cuda")
    if empty:
        indices = indices[:0]
    got = flashinfer.page_slots(batch, pos, indices, indptr, 4)
    assert flashinfer._KERNELS[torch.cuda.current_device()] is not None
    want = flashinfer.page_slots_torch(*(t.cpu() for t in (batch, pos, indices, indptr)), 4)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)
    if n > 1:  # the table had both kinds of token
        assert bool((want == -1).any()) and (empty or bool((want >= 0).any()))


def test_page_slots_bad_input():
    batch, pos, indices, indptr = _random_page_table(6, 3, 9, 4, torch.int32, "cpu")
    f = flashinfer.page_slots
    with pytest.raises(TypeError, match=r"^page_slots: batch_indices: expected an integer tensor, got dtype float32$"):
        f(batch.float(), pos, indices, indptr, 4)
    with pytest.raises(TypeError, match=r"^page_slots: kv_indptr: expected an integer tensor, got list"):
        f(batch, pos, indices, indptr.tolist(), 4)
    with pytest.raises(ValueError, match=r"^page_slots: positions: expected a 1-D tensor, got shape \[6, 1\]"):
        f(batch, pos.view(6, 1), indices, indptr, 4)
    with pytest.raises(ValueError, match=r"^page_slots: positions: expected 6 entries \(batch_indices'\), got 5"):
        f(batch, pos[:5], indices, indptr, 4)
    with pytest.raises(
        ValueError, match=r"^page_slots: kv_indices: expected a tensor on cpu like batch_indices, got one on meta$"
    ):
        f(batch, pos, indices.to("meta"), indptr, 4)
    with pytest.raises(ValueError, match=r"^page_slots: kv_indptr: expected at least 1 entry, got 0"):
        f(batch, pos, indices, indptr[:0], 4)
    with pytest.raises(TypeError, match=r"^page_slots: page_size: expected an int, got float"):
        f(batch, pos, indices, indptr, 4.0)
    with pytest.raises(ValueError, match=r"^page_slots: page_size: expected >= 1, got 0"):
        f(batch, pos, indices, indptr, 0)
    # The torch form keeps every slot of a valid table in range: padding -1, else page * 4 + row; any
    # integer type is a page_size.
    slots = f(batch, pos, indices, indptr, 4)
    assert torch.equal(f(batch, pos, indices, indptr, torch.tensor(4)), slots)
    assert bool(((slots == -1) | ((slots >= 0) & (slots < 9 * 4))).all())


@gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("page_size", [4, 5])
@pytest.mark.parametrize(
    "case", ["gqa NHD", "gqa HND", "mla", "mla one buffer", "mla strided pages", "e5m2", "empty table"]
)
def test_rope_quantize_reads_the_page_table_in_its_kernel(dtype, page_size, case, monkeypatch):
    """On CUDA the fused shim reads the page table in a kernel: one launch of rope_store_cache's page-table
    build (csrc/rope, JITKV_PAGE_TABLE), or rope_set_mla_kv_buffer's for MLA caches, one buffer's views or
    two tensors (its kpe_rows); separate MLA caches whose pages are not page_size rows apart get their rows
    from store_cache's page-table build (_rope_mla_apart). Its q_out and whole caches against the form
    without page-table builds (page_slots, then the ops) on the same inputs, the table's every edge
    included (_random_page_table)."""
    n, pages, hq, hk, rope, nope = 300, 9, 4, 2, 32, 48
    mla, fp8 = case.startswith("mla"), torch.float8_e5m2 if case == "e5m2" else E4M3
    batch, pos, indices, indptr, slots = _one_token_per_slot(n, pages, page_size, dtype, case == "empty table")
    q_rope, q_nope, k_rope, k_nope, v = _rope_inputs("cuda", n, hq, hk, rope, nope, mla)
    cs, pos_ids = table(64, rope).cuda(), torch.randint(0, 64, (n,), device="cuda")
    if mla:
        shapes = ((pages, page_size, nope), (pages, page_size, rope))
    else:
        inner = (hk, page_size) if case == "gqa HND" else (page_size, hk)
        shapes = ((pages, *inner, rope + nope),) * 2
    caches = tuple(rand(s, fp8, "cuda") for s in shapes)
    if case == "mla one buffer":
        buf = rand((pages, page_size, nope + rope), fp8, "cuda")
        caches = (buf[..., :nope], buf[..., nope:])
    bases = want_bases = ()
    if case == "mla strided pages":  # a row's gap after each page, compared too
        bases = tuple(rand((pages, page_size + 1, s[-1]), fp8, "cuda") for s in shapes)
        caches = tuple(b[:, :page_size] for b in bases)
    want = [c.clone() for c in caches]
    if bases:
        want_bases = tuple(b.clone() for b in bases)
        want = [b[:, :page_size] for b in want_bases]
    if case == "mla one buffer":  # the two-launch form writes the same buffer's clone
        want_buf = buf.clone()
        want = [want_buf[..., :nope], want_buf[..., nope:]]

    def call(paged):
        return flashinfer.rope_quantize_fp8_append_paged_kv_cache(
            q_rope,
            k_rope,
            q_nope,
            k_nope,
            v,
            cs,
            pos_ids,
            paged,
            indices,
            indptr,
            batch,
            pos,
            quantize_dtype=fp8,
            quant_scale_q=2.0,
            quant_scale_kv=0.25,
            page_size=page_size,
            kv_layout="HND" if case == "gqa HND" else "NHD",
        )

    with monkeypatch.context() as m:
        m.setattr(flashinfer, "_table_build", lambda *a: None)
        want_q = call(want)

    # Strided pages: the op into scratch rows, then store_cache's page-table build appends them.
    apart = ("rope_set_mla_kv_buffer",) if case != "mla strided pages" else ()
    _refuse(monkeypatch, "_page_slots", "rope_store_cache", *apart)
    got_q = call(caches)
    for got, w in zip((*got_q, *caches, *bases), (*want_q, *want, *want_bases)):
        assert_bitwise(got, w)
    if case != "empty table":  # the table had both kinds of token
        assert -1 in slots and max(slots) >= 0


@gpu
def test_rope_quantize_above_the_token_bound_runs_two_launches(monkeypatch):
    """Above _PAGED_MAX_TOKENS the shim makes the slots first (page_slots' kernel), then runs rope_store_cache."""
    n, ps = 12, 4
    batch, pos, indices, indptr = _random_page_table(n, 3, 9, ps, torch.int32, "cuda")
    q_rope, _, k_rope, _, v = _rope_inputs("cuda", n, 2, 2, 16, 0, False)
    caches = tuple(rand((9, ps, 2, 16), E4M3, "cuda") for _ in "kv")
    made = _record_page_slots(monkeypatch)
    args = (q_rope, k_rope, None, None, v, table(64, 16).cuda(), torch.zeros(n, dtype=torch.int64, device="cuda"))
    args += (caches, indices, indptr, batch, pos)
    flashinfer.rope_quantize_fp8_append_paged_kv_cache(*args, page_size=ps)
    assert not made
    monkeypatch.setattr(flashinfer, "_PAGED_MAX_TOKENS", n - 1)
    flashinfer.rope_quantize_fp8_append_paged_kv_cache(*args, page_size=ps)
    assert len(made) == 1


@gpu
def test_rope_quantize_takes_two_launches_for_a_page_size_not_the_caches(monkeypatch):
    """The page-table build addresses a page's rows by the caches' block stride, so a page_size that is not
    the caches' block size takes page_slots' slots, then rope_store_cache: the same bytes as that form."""
    n, ps = 12, 4
    batch, pos, indices, indptr, _ = _one_token_per_slot(n, 9, ps, torch.int32, False)
    q_rope, _, k_rope, _, v = _rope_inputs("cuda", n, 2, 2, 16, 0, False)
    caches = tuple(rand((5, 2 * ps, 2, 16), E4M3, "cuda") for _ in "kv")
    want = [c.clone() for c in caches]
    made = _record_page_slots(monkeypatch)
    head = (q_rope, k_rope, None, None, v, table(64, 16).cuda(), torch.randint(0, 64, (n,), device="cuda"))

    def call(paged):
        return flashinfer.rope_quantize_fp8_append_paged_kv_cache(
            *head, paged, indices, indptr, batch, pos, page_size=ps
        )

    with monkeypatch.context() as m:
        m.setattr(flashinfer, "_table_build", lambda *a: None)
        want_q = call(want)
    made.clear()
    got_q = call(caches)
    assert len(made) == 1
    for got, w in zip((*got_q, *caches), (*want_q, *want)):
        assert_bitwise(got, w)


@gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("page_size", [4, 5])
@pytest.mark.parametrize("case", ["NHD", "HND", "mla", "bulk", "empty table"])
def test_append_reads_the_page_table_in_its_kernel(dtype, page_size, case, monkeypatch):
    """On CUDA the append shims are one launch: store_cache's page-table build (csrc/store_cache,
    JITKV_PAGE_TABLE; its row kernel for NHD and MLA, its latency kernel for HND, its bulk kernel at
    n = 9000 on GPUs of up to 140 SMs) walks the table itself. Whole caches against the two-launch form
    (page_slots, then store_cache) on the same inputs, the table's every edge included (_random_page_table)."""
    n, pages, h, d = (9000 if case == "bulk" else 300), 9, 2, 64
    batch, pos, indices, indptr, slots = _one_token_per_slot(n, pages, page_size, dtype, case == "empty table")
    if case == "mla":
        k, v = rand((n, 512), BF16, "cuda"), rand((n, 64), BF16, "cuda")
        caches = (rand((pages, page_size, 512), BF16, "cuda"), rand((pages, page_size, 64), BF16, "cuda"))
    else:
        k, v = rand((n, h, d), BF16, "cuda"), rand((n, h, d), BF16, "cuda")
        inner = (h, page_size) if case == "HND" else (page_size, h)
        caches = tuple(rand((pages, *inner, d), BF16, "cuda") for _ in "kv")
    want = [c.clone() for c in caches]

    def call(paged):
        if case == "mla":
            flashinfer.append_paged_mla_kv_cache(k, v, batch, pos, *paged, indices, indptr, None)
        else:
            kv_layout = "HND" if case == "HND" else "NHD"
            flashinfer.append_paged_kv_cache(k, v, batch, pos, paged, indices, indptr, None, kv_layout=kv_layout)

    with monkeypatch.context() as m:
        m.setattr(flashinfer, "_table_build", lambda *a: None)
        call(want)

    _refuse(monkeypatch, "_page_slots", "store_cache")
    call(caches)
    for got, w in zip(caches, want):
        assert_bitwise(got, w)
    if case != "empty table":  # the table had both kinds of token
        assert -1 in slots and max(slots) >= 0


def test_table_builds_read_the_environment_once_until_reset(monkeypatch):
    """Whether a page-table build may run (JITKV_DEBUG, JITKV_BACKEND) is decided once per op, device and
    variant, as the ops decide their backends, and forgotten with theirs by jitkv.ops.reset()."""
    made = []

    def make(device, variant):
        made.append(variant)
        return "runner"

    dev = torch.device("cuda", 0)  # only its index is read
    op = types.SimpleNamespace(name="test op", variant_type=lambda *fields: "v")  # a variant from its fields
    try:
        for env, value in (("JITKV_DEBUG", "1"), ("JITKV_BACKEND", "triton")):
            monkeypatch.setenv(env, value)
            jitkv.ops.reset()
            assert flashinfer._table_build(op, dev, ("f",), make) is None
            monkeypatch.delenv(env)
            assert flashinfer._table_build(op, dev, ("f",), make) is None and made == []
            jitkv.ops.reset()
            assert flashinfer._table_build(op, dev, ("f",), make) == "runner" and made == ["v"]
            monkeypatch.setenv(env, value)
            assert flashinfer._table_build(op, dev, ("f",), make) == "runner" and made == ["v"]
            monkeypatch.delenv(env)
            jitkv.ops.reset()
            made.clear()
    finally:
        monkeypatch.undo()
        jitkv.ops.reset()


@gpu
def test_append_takes_two_launches_where_the_table_build_cannot_run(monkeypatch):
    """Views the page-table build cannot address (heads of 8 bytes), JITKV_DEBUG=1 and a forced backend
    take page_slots, then store_cache; the bytes are the same."""
    ps, pages = 4, 12
    indices, indptr, batch, pos = _page_table([5, 9, 2], ps, pages, "cuda")
    made = _record_page_slots(monkeypatch)
    for d, env in ((4, {}), (64, {"JITKV_DEBUG": "1"}), (64, {"JITKV_BACKEND": "triton"})):
        key, value = rand((batch.numel(), 2, d), BF16, "cuda"), rand((batch.numel(), 2, d), BF16, "cuda")
        cache = rand((pages, 2, ps, 2, d), BF16, "cuda")
        want = cache.clone()
        with monkeypatch.context() as m:
            m.setattr(flashinfer, "_table_build", lambda *a: None)
            flashinfer.append_paged_kv_cache(key, value, batch, pos, want, indices, indptr, None)
        made.clear()
        with monkeypatch.context() as m:
            for name, value_ in env.items():
                m.setenv(name, value_)
            jitkv.ops.reset()  # the shims read the environment once, as the ops do
            flashinfer.append_paged_kv_cache(key, value, batch, pos, cache, indices, indptr, None)
        jitkv.ops.reset()
        assert len(made) == 1, (d, env)
        assert_bitwise(cache, want)


@gpu
@pytest.mark.parametrize("op", ["store_cache", "rope_store_cache", "rope_set_mla_kv_buffer"])
def test_page_table_builds_check_their_tables(op):
    """The page-table builds' bindings check the table themselves (cuda/paged.cuh parse_page_table), where
    only a direct call meets them (the shims check it first): each bad entry raises, naming it, before
    anything is written."""
    n, ps, pages, h, d = 6, 4, 9, 2, 64
    batch, pos, indices, indptr = _random_page_table(n, 3, pages, ps, torch.int32, "cuda")
    dev = batch.device
    if op == "store_cache":
        k, v = rand((n, h, d), BF16, "cuda"), rand((n, h, d), BF16, "cuda")
        caches = tuple(rand((pages, ps, h, d), BF16, "cuda") for _ in "kv")
        args = (k, v, *caches, batch, "auto", None, None, None, None)
        fn = store_cache_op.table_runner(dev, store_cache_op.Variant(*store_cache_op.variant(*args)))

        def call(b, p, i, ip, size):
            return fn(k, v, *caches, b, p, i, ip, size)

    elif op == "rope_set_mla_kv_buffer":
        kv_c, k_pe, q_pe, q_nope = (rand(s, BF16, "cuda") for s in ((n, d), (n, 32), (n, 4, 32), (n, 4, d)))
        caches = (rand((pages * ps, d + 32), E4M3, "cuda"),)
        q_out = torch.empty(n, 4, d + 32, dtype=E4M3, device="cuda")
        pos_ids = torch.randint(0, 64, (n,), device="cuda")
        args = (*caches, batch, kv_c, k_pe, pos_ids, table(64, 32).cuda(), True, q_pe, q_nope, q_out, 1.0, None)
        args += ("fp8_e4m3", 1.0, None)
        fn = rope.mla_paged_runner(dev, rope.MlaVariant(*rope.variant_mla(*args)))

        def call(b, p, i, ip, size):
            return fn(args[0], b, *args[2:], table=(p, i, ip, size, None))

    else:
        q, k, v = rand((n, 4, d), BF16, "cuda"), rand((n, h, d), BF16, "cuda"), rand((n, h, d), BF16, "cuda")
        caches = tuple(rand((pages, ps, h, d), E4M3, "cuda") for _ in "kv")
        q_out = torch.empty(n, 4, d, dtype=E4M3, device="cuda")
        pos_ids = torch.randint(0, 64, (n,), device="cuda")
        args = (q, k, v, *caches, batch, pos_ids, table(64, d).cuda(), True, d, None, None, 1e-6, q_out, 1.0, None)
        args += ("fp8_e4m3", 1.0, 1.0, None, None)
        fn = rope.paged_runner(dev, rope.Variant(*rope.variant(*args)))

        def call(b, p, i, ip, size):
            return fn(*args[:5], b, *args[6:], table=(p, i, ip, size))

    before = [c.clone() for c in caches]
    home = "kv_buffer" if op == "rope_set_mla_kv_buffer" else "k_cache"
    bad = [
        (dict(i=indices.float()), TypeError, "kv_indices: expected dtype int32 or int64, got float32"),
        (dict(ip=indptr.view(1, -1)), ValueError, r"kv_indptr: expected a 1-D tensor, got shape \[1, 4\]"),
        (dict(p=torch.arange(2 * n, device="cuda")[::2]), ValueError, "positions: expected a contiguous tensor"),
        (dict(ip=indptr.cpu()), ValueError, f"kv_indptr: expected a tensor on cuda:0 like {home}, got one on cpu"),
        (dict(p=pos[:-1]), ValueError, f"batch_indices, positions: expected {n} entries each, got {n} and {n - 1}"),
        (dict(ip=indptr[:0]), ValueError, "kv_indptr: expected at least 1 entry, got 0"),
        (dict(size=0), ValueError, r"page_size: expected 1 \.\.\. 2\^31 - 1, got 0"),
        (dict(size=2**31), ValueError, r"page_size: expected 1 \.\.\. 2\^31 - 1, got 2147483648"),
    ]
    for change, error, message in bad:
        given = dict(b=batch, p=pos, i=indices, ip=indptr, size=ps) | change
        with pytest.raises(error, match=rf"^{op}: {message}"):
            call(**given)
    if op == "rope_store_cache":  # its kernel addresses pages by the caches' block stride: no loc_map, no skip_slot
        for at, name, value in ((19, "loc_map", torch.arange(pages * ps, device="cuda")), (20, "skip_slot", 0)):
            changed = args[:at] + (value,) + args[at + 1 :]
            with pytest.raises(ValueError, match=rf"^{op}: {name}: this module was built for another slot source"):
                fn(*changed[:5], batch, *changed[6:], table=(pos, indices, indptr, ps))
    if op == "rope_set_mla_kv_buffer":  # no skip_slot either: FlashInfer's padding is batch_indices < 0
        with pytest.raises(ValueError, match=rf"^{op}: skip_slot: this module was built for another slot source"):
            fn(*args[:-1], 0, table=(pos, indices, indptr, ps, None))
        kv_c_rows = rand((pages * ps, d), E4M3, "cuda")  # separate caches: the rope parts in kpe_rows
        kpe = rand((pages * ps, 32), E4M3, "cuda")
        caches += (kv_c_rows, kpe)
        before += [kv_c_rows.clone(), kpe.clone()]
        bad_rows = [
            (kpe.view(torch.uint8), TypeError, "kpe_rows: expected dtype float8_e4m3fn .the dtype of kv_buffer"),
            (kpe[:-1], ValueError, "kpe_rows: expected 2-D rows, as many as kv_buffer's"),
            (kpe[:, :16], ValueError, "kpe_rows: expected rows of at least k_pe's width"),
            (kv_c_rows[:, :32], ValueError, "kpe_rows: shares memory with kv_buffer"),
            (q_out.view(-1, 32)[: pages * ps], ValueError, "q_out: shares memory with kpe_rows"),
        ]
        for rows, error, message in bad_rows:
            with pytest.raises(error, match=rf"^{op}: {message}"):
                fn(kv_c_rows, batch, *args[2:], table=(pos, indices, indptr, ps, rows))
        with pytest.raises(ValueError, match=rf"^{op}: kv_buffer: row width 32 is smaller than nope = {d}"):
            fn(kpe, batch, *args[2:], table=(pos, indices, indptr, ps, kpe.clone()))
    torch.cuda.synchronize()
    for got, want in zip(caches, before):
        assert_bitwise(got, want)
    assert call(batch, pos, indices, indptr, ps) is None  # the same call with the good table runs


@gpu
def test_page_table_shims_raise_the_ops_errors():
    """Where a page-table build's variant or binding refuses a shim's call, the op's own check raises first
    (as the ops do, ops/_op.py), naming the argument; nothing is written."""
    ps, pages = 4, 12
    indices, indptr, batch, pos = _page_table([5, 9, 2], ps, pages, "cuda")
    n = batch.numel()
    key = rand((n, 2, 64), BF16, "cuda")
    cache = rand((pages, 2, ps, 2, 64), BF16, "cuda")
    before = cache.clone()
    with pytest.raises(TypeError, match=r"^store_cache: v: expected a torch.Tensor, got list$"):
        flashinfer.append_paged_kv_cache(key, key.tolist(), batch, pos, cache, indices, indptr, None)
    assert_bitwise(cache, before)

    q_rope, q_nope, k_rope, k_nope, v = _rope_inputs("cuda", n, 4, 2, 32, 32, False)
    caches = tuple(rand((pages, ps, 2, 64), E4M3, "cuda") for _ in "kv")
    before = [c.clone() for c in caches]
    args = (q_rope, k_rope, q_nope, k_nope, v.tolist(), table(64, 32).cuda(), torch.zeros_like(pos), caches)
    with pytest.raises(TypeError, match=r"^rope_store_cache: v: expected a torch.Tensor, got list$"):
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(*args, indices, indptr, batch, pos, page_size=ps)
    for got, want in zip(caches, before):
        assert_bitwise(got, want)

    q_rope, q_nope, k_rope, k_nope, _ = _rope_inputs("cuda", n, 4, 1, 32, 64, True)  # MLA, both cache forms
    buf = rand((pages, ps, 96), E4M3, "cuda")
    apart = (rand((pages, ps, 64), E4M3, "cuda"), rand((pages, ps, 32), E4M3, "cuda"))
    for caches in ((buf[..., :64], buf[..., 64:]), apart):
        before = [c.clone() for c in caches]
        args = (q_rope, k_rope, q_nope, k_nope, None, table(64, 32).cuda(), pos.float(), caches)
        with pytest.raises(TypeError, match=r"^rope_set_mla_kv_buffer: positions: expected dtype int32 or int64"):
            flashinfer.rope_quantize_fp8_append_paged_kv_cache(*args, indices, indptr, batch, pos, page_size=ps)
        for got, want in zip(caches, before):
            assert_bitwise(got, want)


def _table_shim(form, ps, pages, n):
    """A shim form that runs a page-table build on CUDA: (its caches' base tensors, call(table, bases)
    running the shim on FlashInfer's ``table`` = (batch_indices, positions, kv_indices, kv_indptr,
    page_size) into those bases)."""
    q_rope, q_nope, k_rope, k_nope, v = _rope_inputs("cuda", n, 4, 2, 32, 32, form.startswith("rope mla"))
    cs, pos_ids = table(64, 32).cuda(), torch.randint(0, 64, (n,), device="cuda")
    rope_fp8 = flashinfer.rope_quantize_fp8_append_paged_kv_cache
    if form == "append":
        return [rand((pages, ps, 2, 64), BF16, "cuda") for _ in "kv"], lambda t, c: flashinfer.append_paged_kv_cache(
            v, v, t[0], t[1], tuple(c), t[2], t[3], None
        )
    if form == "append mla":
        caches = [rand((pages, ps, 32), BF16, "cuda") for _ in "kv"]
        return caches, lambda t, c: flashinfer.append_paged_mla_kv_cache(
            q_rope[:, 0], q_rope[:, 1], t[0], t[1], *c, *t[2:4], None
        )
    if form == "rope":
        caches = [rand((pages, ps, 2, 64), E4M3, "cuda") for _ in "kv"]
        return caches, lambda t, c: rope_fp8(
            q_rope, k_rope, q_nope, k_nope, v, cs, pos_ids, tuple(c), *t[2:4], *t[:2], page_size=t[4]
        )

    def views(c):  # the MLA caches: one buffer's column views, or two tensors
        return (c[0][..., :32], c[0][..., 32:]) if form == "rope mla one buffer" else tuple(c)

    caches = [rand((pages, ps, w), E4M3, "cuda") for w in ((64,) if form == "rope mla one buffer" else (32, 32))]
    return caches, lambda t, c: rope_fp8(
        q_rope, k_rope, q_nope, k_nope, None, cs, pos_ids, views(c), *t[2:4], *t[:2], is_neox=False, page_size=t[4]
    )


@gpu
@pytest.mark.parametrize("form", ["append", "append mla", "rope", "rope mla one buffer", "rope mla apart"])
def test_table_shims_leave_the_table_to_their_builds(form, monkeypatch):
    """The shims hand FlashInfer's table to the page-table builds unchecked (their bindings check it): a
    table of other integer dtypes or of strided entries, which the bindings refuse, is checked in Python
    and passed again as the kernels read it (one launch, the int32 table's bytes); a bad table raises
    page_slots' error, naming the entry, with the caches unchanged."""
    ps, pages = 4, 12
    indices, indptr, batch, pos = _page_table([5, 9, 2], ps, pages, "cuda")
    caches, call = _table_shim(form, ps, pages, batch.numel())
    want = [c.clone() for c in caches]
    want_q = call((batch, pos, indices, indptr, ps), want)
    _refuse(monkeypatch, "_page_slots", "_rope_mla_apart")

    def strided(t):
        return torch.stack([t, t], 1)[:, 0]

    for other in ((batch.short(), strided(pos), indices.to(torch.uint8), strided(indptr), ps),):
        got = [c.clone() for c in caches]
        got_q = call(other, got)
        for g, w in zip((*got, *(got_q or ())), (*want, *(want_q or ()))):
            assert_bitwise(g, w)
    bad = [
        (dict(b=batch.float()), TypeError, "batch_indices: expected an integer tensor, got dtype float32$"),
        (dict(p=pos.view(-1, 1)), ValueError, r"positions: expected a 1-D tensor, got shape \[\d+, 1\]$"),
        (dict(p=pos[:-1]), ValueError, r"positions: expected \d+ entries \(batch_indices'\), got \d+$"),
        (dict(ip=indptr[:0]), ValueError, "kv_indptr: expected at least 1 entry, got 0$"),
        (
            dict(i=indices.cpu()),
            ValueError,
            "kv_indices: expected a tensor on cuda:0 like batch_indices, got one on cpu$",
        ),
    ]
    if form.startswith("rope"):
        bad.append((dict(size=0), ValueError, "page_size: expected >= 1, got 0$"))
    for change, error, message in bad:
        given = dict(b=batch, p=pos, i=indices, ip=indptr, size=ps) | change
        got = [c.clone() for c in caches]
        with pytest.raises(error, match=f"^page_slots: {message}"):
            call(tuple(given.values()), got)
        for g, c in zip(got, caches):
            assert_bitwise(g, c)
