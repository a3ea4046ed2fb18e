"""rope_store_cache and rope_set_mla_kv_buffer: bitwise equality with the torch reference over every
destination (q or q_out, k_out, both caches / the MLA buffer), poisoned with random bytes first, on
every backend of every device present; the reference against transformers' RoPE and Qwen3 RMSNorm; bad
input named; the Triton kernels under the interpreter."""

from __future__ import annotations

import warnings

import pytest
import torch

import jitkv
from jitkv import reference
from jitkv.ops import OPS, rope
from jitkv.ops.rope import cos_sin_table
from jitkv.tests.conftest import BACKENDS, DEV_BACKENDS, assert_bitwise, gpu, rand, slots
from jitkv.tests.triton.interpreter import run_under_interpreter

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
NUM_SLOTS = 256
MAX_POS = 300
CUDA_BACKENDS = ("jit", "triton", "torch")


def _cache(layout, num_slots, h, d, dtype, device, block_size=8):
    nb = num_slots // block_size
    if layout == "flat3d":
        return rand((num_slots, h, d), dtype, device)
    if layout == "flat2d":
        return rand((num_slots, h * d), dtype, device)
    if layout == "nhd":
        return rand((nb, block_size, h, d), dtype, device)
    return rand((nb, h, block_size, d), dtype, device).permute(0, 2, 1, 3)  # hnd


def _mha(
    device,
    *,
    n=37,
    extra=3,
    hq=4,
    hk=2,
    d=64,
    dv=None,
    src=BF16,
    rot=None,
    cs_dtype=torch.float32,
    norm=False,
    q_out=None,
    kv="auto",
    per_head=False,
    layout="flat3d",
    k_out=True,
    idx=torch.int64,
    num_slots=NUM_SLOTS,
):
    """Keyword arguments of one rope_store_cache call on fresh random data; positions span the table."""
    dv = dv or d
    cache_dtype = src if kv == "auto" else (E5M2 if kv == "fp8_e5m2" else E4M3)
    kw = dict(
        q=rand((n + extra, hq, d), src, device),
        k=rand((n + extra, hk, d), src, device),
        v=rand((n + extra, hk, dv), src, device),
        k_cache=_cache(layout, num_slots, hk, d, cache_dtype, device),
        v_cache=_cache(layout, num_slots, hk, dv, cache_dtype, device),
        slot_mapping=slots(num_slots, n, idx, device),
        positions=torch.randint(0, MAX_POS, (n + extra,), dtype=idx).to(device),
        cos_sin_cache=cos_sin_table(MAX_POS, rot or d, dtype=cs_dtype, device=device),
        is_neox=True,
    )
    if rot is not None:
        kw["rotary_dim"] = rot
    if norm:
        kw.update(q_norm_weight=rand((d,), src, device), k_norm_weight=rand((d,), src, device), eps=1e-5)
    if q_out is not None:
        kw["q_out"] = rand((n + extra, hq, d), q_out, device)
        if q_out in (E4M3, E5M2):
            kw["q_scale"] = torch.tensor([0.05], device=device)
    if k_out:
        kw["k_out"] = rand((n + extra, hk, d), src, device)
    if kv != "auto":
        kw["kv_cache_dtype"] = kv
        if per_head:
            kw.update(k_scale=(torch.rand(hk) + 0.02).to(device), v_scale=(torch.rand(hk) + 0.02).to(device))
        else:
            kw.update(k_scale=0.037, v_scale=torch.tensor([0.11], device=device))
    return kw


MHA_DESTINATIONS = ("q", "q_out", "k_out", "k_cache", "v_cache")


def _clone(t):
    """A copy with t's strides (a permuted cache stays permuted)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _cuda_jit_refuses(op_name, backend, kw):
    """On CUDA with the jit backend forced: the reason the CUDA kernel refuses this call's variant
    (checked: the call raises BackendUnavailable naming it), else None."""
    if backend != "jit" or kw[OPS[op_name].home].device.type != "cuda":
        return None
    op = OPS[op_name]
    v = op.variant_type(*op.variant(*op.args_of(kw)))
    why = rope.cuda_refusal(v) if op_name == "rope_store_cache" else rope.cuda_mla_refusal(v)
    if why is not None:
        fn = jitkv.rope_store_cache if op_name == "rope_store_cache" else jitkv.rope_set_mla_kv_buffer
        with pytest.raises(jitkv.BackendUnavailable, match="the CUDA kernel cannot take this call"):
            fn(**kw, backend=backend)
    return why


def _run_mha(backend, kw):
    """The op against the reference, every destination bitwise; None where the forced CUDA jit
    backend refuses the variant (and raised for it)."""
    if _cuda_jit_refuses("rope_store_cache", backend, kw):
        return None
    got = {**kw, **{d: _clone(kw[d]) for d in MHA_DESTINATIONS if d in kw}}
    want = {**kw, **{d: _clone(kw[d]) for d in MHA_DESTINATIONS if d in kw}}
    jitkv.rope_store_cache(**got, backend=backend)
    reference.rope_store_cache(**want)
    for d in MHA_DESTINATIONS:
        if d in kw:
            assert_bitwise(got[d], want[d])
    return got


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot", [None, 32])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("cs_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("q_out", [None, BF16, E4M3])
@pytest.mark.parametrize("kv,per_head", [("auto", False), ("fp8_e4m3", True)])
def test_matrix(device, backend, is_neox, rot, norm, cs_dtype, q_out, kv, per_head):
    kw = _mha(device, rot=rot, norm=norm, cs_dtype=cs_dtype, q_out=q_out, kv=kv, per_head=per_head)
    kw["is_neox"] = is_neox
    kw["slot_mapping"][::5] = -1  # padding: K/V not written, q still rotated
    got = _run_mha(backend, kw)
    if got is not None and q_out is not None:
        assert_bitwise(got["q"], kw["q"])  # q is never written with q_out


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("src", [torch.float16, torch.float32])
@pytest.mark.parametrize("kv", ["auto", "fp8_e5m2"])
@pytest.mark.parametrize("d,rot", [(128, 128), (128, 64), (80, 48), (72, 72), (40, 8), (136, 64)])
def test_dtypes_and_head_dims(device, backend, src, kv, d, rot):
    """fp16/fp32 sources, head dims that are not powers of two (80, 72, 40, 136: vector tails; 136: 17 norm
    groups, padded to 32), partial rotary, the norm where D allows it, e5m2 caches and an fp8 q_out."""
    kw = _mha(device, src=src, d=d, rot=rot, kv=kv, norm=d % 8 == 0, q_out=E5M2 if kv != "auto" else None)
    kw["is_neox"] = d != 72
    _run_mha(backend, kw)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("src,d", [(BF16, 128), (torch.float32, 80)])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_norm_over_the_float32_range(device, backend, src, d, eps):
    """Heads scaled by 2^-75 ... 2^64, so that mean(x^2) + eps runs from float32 subnormals through
    overflow to inf (1 / sqrt(inf) = 0; split lanes and exchanging lanes, a power-of-two D and not), and
    all-zero heads where eps > 0: the same bytes as the reference. (A head whose squares all underflow
    under eps = 0 would have 1 / sqrt(0) = inf and NaN outputs, whose payload is unspecified: under eps =
    0 no head is scaled below 2^-70.)"""
    if backend == "triton" and eps == 0:
        pytest.skip("Triton's NVIDIA builds may flush float32 subnormals (the squares under eps = 0)")
    kw = _mha(device, n=11, hq=8, hk=4, d=d, src=src, norm=True)
    _scale_heads_across_float32(kw, eps)
    _run_mha(backend, kw)


def _scale_heads_across_float32(kw, eps):
    """Scales each q and k head by 2^-75 ... 2^64 (at least 2^-70 under eps = 0) and, where eps > 0, zeros
    head 1 of every third token (test_norm_over_the_float32_range)."""
    kw["eps"] = eps
    exps = torch.tensor([-75 if eps > 0 else -70, -70, -60, -50, -20, 0, 20, 50, 60, 62, 64], dtype=torch.float32)
    for name in ("q", "k"):
        x = kw[name]
        scale = torch.exp2(exps[torch.randint(0, len(exps), x.shape[:2])]).to(x.device)
        x.copy_((x.float() * scale.unsqueeze(-1)).to(x.dtype))
        if eps > 0:
            x[::3, 1] = 0


@gpu
@pytest.mark.parametrize(
    "src,d,rot,is_neox",
    [(BF16, 128, None, True), (BF16, 128, 64, True), (BF16, 64, None, False), (torch.float32, 80, None, True)],
)
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_norm_at_four_heads_per_thread(src, d, rot, is_neox, kv):
    """The CUDA kernels' build of kBulkHpt heads per thread with the norm (each thread folding four heads'
    group sums, lanes.cuh gather_fold): enough tokens of 8 + 2 x 4 heads to take it (rope/geometry.h
    heads_per_thread: 2048 threads per SM at one head per thread), split and exchanging lanes, partial
    rotary, GPT-J, bf16 and e4m3 caches, heads across the float32 range and zero heads: the reference's
    bytes."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    n = 2048 * sms // (16 * 8) + 1  # 16 heads of at least 8 lanes each
    kw = _mha("cuda", n=n, hq=8, hk=4, d=d, src=src, rot=rot, kv=kv, norm=True, num_slots=2 * n)
    kw["is_neox"] = is_neox
    kw["slot_mapping"][::5] = -1
    _scale_heads_across_float32(kw, 1e-6)
    _run_mha("jit", kw)


# Scales the CUDA kernels divide by with one multiply (fp8.cuh with_divider: a power of two whose
# reciprocal is a normal float), the edges either side of that range, and scales that are not powers of two.
FP8_SCALES = [1.0, 0.5, 2.0**-126, 2.0**126, 2.0**127, 2.0**-127, 2.0**-149, 0.375]


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("kv,q_out", [("fp8_e4m3", E4M3), ("fp8_e5m2", E5M2)])
@pytest.mark.parametrize("scale", FP8_SCALES)
def test_fp8_scales_powers_of_two_and_the_edges(device, backend, kv, q_out, scale):
    """One scale for q_out, K and V (a Python float, a 1-element tensor), the source scaled by it so that
    its quotients land in the fp8 range (at most by 2^120: no bf16 source overflows, the largest scales'
    quotients land in fp8's subnormals); then per-head scales mixing every kind: the reference's bytes."""
    factor = min(64 * scale, 2.0**120)
    kw = _mha(device, n=40, hq=8, hk=len(FP8_SCALES), kv=kv, q_out=q_out, norm=False)
    for name in ("q", "k", "v"):
        kw[name].copy_((kw[name].double() * factor).to(kw[name].dtype))
    kw.update(q_scale=scale, k_scale=scale, v_scale=torch.tensor([scale], device=device))
    _run_mha(backend, kw)
    kw.update(k_scale=torch.tensor(FP8_SCALES, device=device), v_scale=torch.tensor(FP8_SCALES[::-1], device=device))
    _run_mha(backend, kw)
    mla = _mla(device, n=20, kv=kv, q=q_out)
    for name in ("kv_c", "k_pe", "q_nope", "q_pe"):
        mla[name].copy_((mla[name].double() * factor).to(mla[name].dtype))
    mla.update(scale=scale, q_scale=torch.tensor([scale], device=device))
    _run_mla(backend, mla)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("hq,hk", [(1, 1), (3, 1), (5, 3), (8, 4)])
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (64, 128), (256, 256)])
def test_head_counts(device, backend, hq, hk, d, dv):
    """Head counts whose q, k and v lanes would share warps (the CUDA kernel starts each kind of head at a
    warp, leaving gaps of idle lanes), a V head dim above K's; with 8 and 4 heads also enough tokens for the
    CUDA kernel's build of 4 heads per thread."""
    for n in (3, 1200) if (hq, hk) == (8, 4) else (3,):
        kw = _mha(device, n=n, hq=hq, hk=hk, d=d, dv=dv, q_out=BF16, norm=True)
        kw["slot_mapping"][::3] = -1
        _run_mha(backend, kw)


@gpu
@pytest.mark.parametrize("per_sm", [1, 100, 200, 300, 1400, 1700, 2100])
@pytest.mark.parametrize(
    "kv,q_out,per_head", [("auto", None, False), ("fp8_e4m3", E4M3, False), ("fp8_e5m2", E5M2, True)]
)
@pytest.mark.parametrize("hq,hk", [(32, 8), (6, 2), (5, 1)])
def test_launch_geometries(per_sm, kv, q_out, per_head, hq, hk):
    """The CUDA kernel's block sizes and heads per thread (rope/geometry.h block_threads,
    heads_per_thread, pair_heads): hq + 2 hk heads of 128 without the norm (Llama-3-8B's 768 threads a
    token; head counts that 4, only 2, or neither divides) at as many tokens as fill this GPU to about
    per_sm threads per SM, on either side of each threshold; per-head scales in the e5m2 case."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    n = max(1, per_sm * sms // ((hq + 2 * hk) * 16))
    kw = _mha("cuda", n=n, hq=hq, hk=hk, d=128, kv=kv, q_out=q_out, per_head=per_head, num_slots=2 * n + 64)
    kw["slot_mapping"][::5] = -1
    _run_mha("jit", kw)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("layout", ["flat3d", "flat2d", "nhd", "hnd"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_cache_layouts(device, backend, layout, kv):
    """Every cache layout; a 2-D q (heads from k), a V head dim of its own; slots of every block."""
    kw = _mha(device, layout=layout, kv=kv, dv=32, n=60)
    kw["q"] = kw["q"].flatten(1)
    _run_mha(backend, kw)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("idx", [torch.int32, torch.int64])
def test_padding_skip_slot_and_loc_map(device, backend, idx):
    kw = _mha(device, idx=idx, n=50, kv="fp8_e4m3", norm=True)
    sm = kw["slot_mapping"]
    sm[::6] = -1
    sm[4] = 7
    loc_map = torch.randperm(NUM_SLOTS * 2)[: NUM_SLOTS * 2].remainder(NUM_SLOTS).to(idx)
    loc_map[:NUM_SLOTS] = torch.randperm(NUM_SLOTS).to(idx)
    loc_map[sm[1].item()] = -1  # mapped below 0: skipped
    _run_mha(backend, {**kw, "skip_slot": 7, "loc_map": loc_map.to(device)})


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_packed_qkv_views_and_k_out_is_k(device, backend):
    """q, k, v as views of one packed qkv tensor (token stride (Hq + 2 Hk) D, q rotated in place); k_out is
    k itself; then q and k given as 2-D [n, H*D] views."""
    n, hq, hk, d = 29, 8, 2, 64
    qkv = rand((n, (hq + 2 * hk) * d), BF16, device)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=1)
    kw = _mha(device, n=n, extra=0, hq=hq, hk=hk, d=d, k_out=False, norm=True)
    kw.update(q=q.view(n, hq, d), k=k.view(n, hk, d), v=v.view(n, hk, d))
    want_qkv = qkv.clone()
    wq, wk, wv = want_qkv.split([hq * d, hk * d, hk * d], dim=1)
    want = {
        **kw,
        "q": wq.view(n, hq, d),
        "k": wk.view(n, hk, d),
        "v": wv.view(n, hk, d),
        "k_out": wk.view(n, hk, d),
        "k_cache": kw["k_cache"].clone(),
        "v_cache": kw["v_cache"].clone(),
    }
    reference.rope_store_cache(**want)
    jitkv.rope_store_cache(**{**kw, "k_out": kw["k"]}, backend=backend)
    assert_bitwise(qkv, want_qkv)
    assert_bitwise(kw["k_cache"], want["k_cache"])
    assert_bitwise(kw["v_cache"], want["v_cache"])
    kw2 = _mha(device, n=n, hq=hq, hk=hk, d=d)
    _run_mha(backend, {**kw2, "q": kw2["q"].flatten(1), "k": kw2["k"].flatten(1), "v": kw2["v"].flatten(1)})


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_empty_index_writes_nothing(device, backend):
    kw = _mha(device, n=0, extra=4)
    before = {d: kw[d].clone() for d in MHA_DESTINATIONS if d in kw}
    jitkv.rope_store_cache(**kw, backend=backend)
    for d, t in before.items():
        assert_bitwise(kw[d], t)


@pytest.mark.parametrize("backend", BACKENDS["cpu"])
@pytest.mark.parametrize("what", ["position past the table", "negative position", "slot", "loc_map"])
def test_out_of_range_raises_before_writing_cpu(backend, what):
    kw = _mha("cpu", n=20, extra=0, q_out=None)
    if what == "position past the table":
        kw["positions"][13] = MAX_POS
        want = rf"rope_store_cache: positions: position 13 has value {MAX_POS}, out of range for a cos_sin_cache"
    elif what == "negative position":
        kw["positions"][2] = -1
        want = r"rope_store_cache: positions: position 2 has value -1"
    elif what == "slot":
        kw["slot_mapping"][19] = NUM_SLOTS
        want = rf"slot_mapping: position 19 has slot {NUM_SLOTS}"
    else:
        kw["loc_map"] = torch.arange(NUM_SLOTS)
        kw["loc_map"][kw["slot_mapping"][3]] = NUM_SLOTS
        want = r"loc_map: slot_mapping position 3 .*maps to"
    before = {d: kw[d].clone() for d in MHA_DESTINATIONS if d in kw}
    with pytest.raises(IndexError, match=want):
        jitkv.rope_store_cache(**kw, backend=backend)
    for d, t in before.items():
        assert_bitwise(kw[d], t)


# ------------------------------------------------------------------------------------------- MLA

MLA_DESTINATIONS = ("kv_buffer", "q_pe", "q_out", "k_pe_out")


def _mla(
    device,
    *,
    n=33,
    extra=2,
    h=4,
    nope=512,
    rope=64,
    src=BF16,
    kv="auto",
    buf_dtype=None,
    q="in_place",
    cs_dtype=torch.float32,
    idx=torch.int64,
    width=None,
    num_slots=NUM_SLOTS,
):
    widths = {"fp8_ds_mla": 656}
    width = width or widths.get(kv, nope + rope + 8)
    buf_dtype = buf_dtype or (src if kv == "auto" else torch.uint8)
    kw = dict(
        kv_buffer=rand((num_slots, width), buf_dtype, device),
        loc=slots(num_slots, n, idx, device),
        kv_c=rand((n + extra, nope), src, device),
        k_pe=rand((n + extra, rope), src, device),
        positions=torch.randint(0, MAX_POS, (n + extra,), dtype=idx).to(device),
        cos_sin_cache=cos_sin_table(MAX_POS, rope, dtype=cs_dtype, device=device),
        is_neox=False,
        k_pe_out=rand((n + extra, rope), src, device),
        kv_cache_dtype=kv,
    )
    if kv in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        kw["scale"] = torch.tensor([0.07], device=device)
    if q != "none":
        kw["q_pe"] = rand((n + extra, h, rope), src, device)
    if q not in ("none", "in_place"):
        kw["q_nope"] = rand((n + extra, h, nope), src, device)
        kw["q_out"] = rand((n + extra, h, nope + rope), q, device)
        if q in (E4M3, E5M2):
            kw["q_scale"] = 0.125
    return kw


def _run_mla(backend, kw):
    if _cuda_jit_refuses("rope_set_mla_kv_buffer", backend, kw):
        return None
    got = {**kw, **{d: kw[d].clone() for d in MLA_DESTINATIONS if d in kw}}
    want = {**kw, **{d: kw[d].clone() for d in MLA_DESTINATIONS if d in kw}}
    jitkv.rope_set_mla_kv_buffer(**got, backend=backend)
    reference.rope_set_mla_kv_buffer(**want)
    for d in MLA_DESTINATIONS:
        if d in kw:
            assert_bitwise(got[d], want[d])
    return got


MLA_FORMATS = [
    ("auto", BF16, None),
    ("auto", torch.float16, None),
    ("auto", torch.float32, None),
    ("fp8_e4m3", BF16, None),
    ("fp8_e4m3", BF16, E4M3),
    ("fp8_e5m2", torch.float16, E5M2),
    ("fp8", BF16, None),
    ("fp8_ds_mla", BF16, None),
    ("fp8_ds_mla", torch.float16, None),
]


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("kv,src,buf_dtype", MLA_FORMATS)
@pytest.mark.parametrize("q", ["in_place", "copy", "e4m3"])
@pytest.mark.parametrize("is_neox", [False, True])
def test_mla_formats(device, backend, kv, src, buf_dtype, q, is_neox):
    q = {"copy": src, "e4m3": E4M3}.get(q, q)
    kw = _mla(device, kv=kv, src=src, buf_dtype=buf_dtype, q=q)
    kw["is_neox"] = is_neox
    kw["loc"][::4] = -1
    got = _run_mla(backend, kw)
    if got is not None and "q_out" in kw:
        assert_bitwise(got["q_pe"], kw["q_pe"])


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("nope,rope", [(128, 32), (256, 16), (96, 40)])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("idx", [torch.int32, torch.int64])
def test_mla_widths_padding_and_skip_slot(device, backend, nope, rope, kv, idx):
    """nope / rope widths other than 512 / 64, no queries, 3-D [n, 1, W] views, a bf16 cos_sin_cache."""
    kw = _mla(device, nope=nope, rope=rope, kv=kv, q="none", idx=idx, cs_dtype=BF16)
    kw["loc"][::5] = -1
    kw["loc"][2] = 9
    kw.update(
        kv_buffer=kw["kv_buffer"].unsqueeze(1), kv_c=kw["kv_c"].unsqueeze(1), k_pe=kw["k_pe"].unsqueeze(1), skip_slot=9
    )
    _run_mla(backend, kw)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_mla_strided_rows_and_k_pe_out_is_k_pe(device, backend):
    """kv_c and k_pe as column views of one [n, 576] latent (vLLM's kv_a_proj output), k_pe rotated in
    place through k_pe_out = k_pe."""
    n = 40
    latent = rand((n, 576), BF16, device)
    kw = _mla(device, n=n, extra=0, kv="fp8_e4m3")
    kv_c, k_pe = latent.split([512, 64], dim=1)
    want_latent = latent.clone()
    want = {
        **kw,
        "kv_c": want_latent[:, :512],
        "k_pe": want_latent[:, 512:],
        "k_pe_out": want_latent[:, 512:],
        "kv_buffer": kw["kv_buffer"].clone(),
        "q_pe": kw["q_pe"].clone(),
    }
    reference.rope_set_mla_kv_buffer(**want)
    jitkv.rope_set_mla_kv_buffer(**{**kw, "kv_c": kv_c, "k_pe": k_pe, "k_pe_out": k_pe}, backend=backend)
    assert_bitwise(latent, want_latent)
    assert_bitwise(kw["kv_buffer"], want["kv_buffer"])
    assert_bitwise(kw["q_pe"], want["q_pe"])


@pytest.mark.parametrize("backend", BACKENDS["cpu"])
def test_mla_out_of_range_raises_before_writing_cpu(backend):
    kw = _mla("cpu", n=10, extra=0, q=BF16)
    kw["loc"][7] = NUM_SLOTS + 3
    before = {d: kw[d].clone() for d in MLA_DESTINATIONS if d in kw}
    with pytest.raises(IndexError, match=rf"loc: position 7 has slot {NUM_SLOTS + 3}"):
        jitkv.rope_set_mla_kv_buffer(**kw, backend=backend)
    kw["loc"][7] = 0
    kw["positions"][5] = MAX_POS + 1
    with pytest.raises(IndexError, match=r"rope_set_mla_kv_buffer: positions: position 5 has value"):
        jitkv.rope_set_mla_kv_buffer(**kw, backend=backend)
    for d, t in before.items():
        assert_bitwise(kw[d], t)


# ------------------------------------------------------------------------ the reference itself


def test_fixed_order_sum_is_the_documented_tree():
    """The RMSNorm's sum of squares, step by step in float32 as docs/design.md §9 writes it: each group
    of 8 folded by halves, then the group sums (zero-padded to a power of two) by halves."""
    x = torch.randn(3, 5, 48) * torch.logspace(-3, 3, 48)
    got = reference.rms_norm_fixed_order(x, torch.ones(48), 0.0)
    for row in x.reshape(-1, 48):
        s = [v * v for v in row.view(-1, 1).unbind(0)]  # 1-element float32 tensors: float32 arithmetic
        groups = []
        for g in range(6):
            a = s[8 * g : 8 * g + 8]
            groups.append(((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])))
        groups += [torch.zeros(1)] * 2
        while len(groups) > 1:
            half = len(groups) // 2
            groups = [groups[j] + groups[j + half] for j in range(half)]
        # IEEE float32 division and sqrt, as float64 results rounded once (torch's CPU sqrt is not exact)
        mean = (groups[0].double() / 48).float()
        r = (1 / torch.sqrt(mean.double()).float().double()).float()
        want = row * r
        idx = (x.reshape(-1, 48) == row).all(1).nonzero()[0, 0]
        assert_bitwise(got.reshape(-1, 48)[idx], want)


@pytest.mark.parametrize("is_neox", [True, False])
def test_reference_is_transformers_rope_and_qwen3_norm(is_neox):
    """Up to float32 rounding, the reference is HF's Qwen3RMSNorm then apply_rotary_pos_emb (NeoX) or
    DeepSeek's interleaved rope (GPT-J), with cos/sin from the same table."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    n, h, d = 11, 3, 64
    x, pos = torch.randn(n, h, d), torch.randint(0, MAX_POS, (n,))
    table = cos_sin_table(MAX_POS, d)
    norm = Qwen3RMSNorm(d, eps=1e-6)
    norm.weight.data = torch.randn(d)
    got = reference.rope_rows(x, pos, table, is_neox=is_neox, norm_weight=norm.weight.data, eps=1e-6)
    cos, sin = table[pos].chunk(2, dim=-1)
    y = norm(x)
    if is_neox:
        want, _ = apply_rotary_pos_emb(
            y[None].transpose(1, 2),
            y[None].transpose(1, 2),
            torch.cat([cos, cos], -1)[None],
            torch.cat([sin, sin], -1)[None],
        )
        want = want.transpose(1, 2)[0]
    else:
        a, b = y[..., 0::2], y[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        want = torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)
    assert transformers is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------- bad input


def _good(device):
    return _mha(device, n=6, extra=0, norm=True, q_out=E4M3, kv="fp8_e4m3")


BAD = [  # (case, change, exception, message after "rope_store_cache: ")
    (
        "rotary_dim odd",
        lambda a: a.update(rotary_dim=33),
        ValueError,
        r"rotary_dim: expected an even number in \[2, 64\] \(head_dim\), got 33",
    ),
    (
        "rotary_dim > D",
        lambda a: a.update(rotary_dim=66, cos_sin_cache=cos_sin_table(MAX_POS, 66)),
        ValueError,
        r"rotary_dim: expected an even number in \[2, 64\] \(head_dim\), got 66",
    ),
    (
        "cos_sin_cache width",
        lambda a: a.update(rotary_dim=32),
        ValueError,
        r"cos_sin_cache: expected \[max_pos, rotary_dim\] = \[max_pos, 32\] \(cos half then sin half\), "
        r"got \[300, 64\]",
    ),
    (
        "cos_sin_cache dtype",
        lambda a: a.update(cos_sin_cache=a["cos_sin_cache"].half()),
        TypeError,
        r"cos_sin_cache: expected dtype float32 or bfloat16, got float16$",
    ),
    (
        "cos_sin_cache 1-D",
        lambda a: a.update(cos_sin_cache=a["cos_sin_cache"][0]),
        ValueError,
        r"cos_sin_cache: expected shape \[max_pos, rotary_dim\], got \[64\]",
    ),
    (
        "q_norm_weight length",
        lambda a: a.update(q_norm_weight=a["q_norm_weight"][:32]),
        ValueError,
        r"q_norm_weight: expected shape \[head_dim\] = \[64\], got \[32\]",
    ),
    (
        "k_norm_weight dtype",
        lambda a: a.update(k_norm_weight=a["k_norm_weight"].half()),
        TypeError,
        r"k_norm_weight: expected dtype bfloat16 or float32, got float16$",
    ),
    (
        "norm with D not a multiple of 8",
        lambda a: a.update(
            q=rand((6, 4, 36), BF16, "cpu"),
            k=rand((6, 2, 36), BF16, "cpu"),
            v=rand((6, 2, 36), BF16, "cpu"),
            k_cache=rand((NUM_SLOTS, 2, 36), E4M3, "cpu"),
            v_cache=rand((NUM_SLOTS, 2, 36), E4M3, "cpu"),
            cos_sin_cache=cos_sin_table(MAX_POS, 36),
            q_out=rand((6, 4, 36), E4M3, "cpu"),
            k_out=None,
            q_norm_weight=rand((36,), BF16, "cpu"),
            k_norm_weight=None,
        ),
        ValueError,
        r"q_norm_weight: the fixed-order RMSNorm sums groups of 8 dims; head_dim 36 is not a multiple of 8",
    ),
    (
        "k head dim",
        lambda a: a.update(k=rand((6, 2, 32), BF16, "cpu")),
        ValueError,
        r"k: expected head_dim 64, got shape \[6, 2, 32\]",
    ),
    ("v head dim vs v_cache", lambda a: a.update(v=rand((6, 2, 32), BF16, "cpu")), ValueError, r"v_cache: "),
    (
        "k heads vs k_cache",
        lambda a: a.update(k=rand((6, 4, 64), BF16, "cpu"), k_out=None),
        ValueError,
        r"k_cache: expected 4 heads like k, got 2",
    ),
    (
        "q_out shape",
        lambda a: a.update(q_out=rand((6, 4, 32), E4M3, "cpu")),
        ValueError,
        r"q_out: expected shape \[tokens, 4, 64\], got \[6, 4, 32\]",
    ),
    (
        "q_out dtype",
        lambda a: a.update(q_out=rand((6, 4, 64), torch.float16, "cpu")),
        TypeError,
        r"q_out: expected dtype bfloat16, float8_e4m3fn or float8_e5m2 \(q's dtype, or fp8 with q_scale\), got float16",
    ),
    (
        "fp8 q_out without q_scale",
        lambda a: a.update(q_scale=None),
        ValueError,
        r"q_scale: required for an fp8 kv_cache_dtype",
    ),
    (
        "q_scale without fp8 q_out",
        lambda a: a.update(q_out=None),
        ValueError,
        r"q_scale: only an fp8 q_out takes a scale; q_out is None",
    ),
    (
        "k_out dtype",
        lambda a: a.update(k_out=a["k_out"].float()),
        TypeError,
        r"k_out: expected dtype bfloat16 \(the dtype of k\), got float32",
    ),
    ("k_out rows", lambda a: a.update(k_out=a["k_out"][:3]), ValueError, r"k_out: expected at least 6 rows"),
    (
        "positions too short",
        lambda a: a.update(positions=a["positions"][:4]),
        ValueError,
        r"positions: expected at least 6 entries \(one per token\), got 4",
    ),
    (
        "positions float",
        lambda a: a.update(positions=a["positions"].float()),
        TypeError,
        r"positions: expected dtype int32 or int64, got float32",
    ),
    ("is_neox missing a bool", lambda a: a.update(is_neox=1), TypeError, r"is_neox: expected a bool, got int"),
    ("eps a str", lambda a: a.update(eps="1e-6"), TypeError, r"eps: expected a float, got str"),
    (
        "q float16",
        lambda a: a.update(q=a["q"].half()),
        TypeError,
        r"q: expected dtype bfloat16, float16 or float32, got float16|k: expected dtype float16",
    ),
    (
        "q_out is k_cache",
        lambda a: a.update(q_out=a["k_cache"][:6].view(6, 4, 32)[..., :64].reshape(6, 4, 32)),
        ValueError,
        r"q_out: ",
    ),
    (
        "q_out shares k_cache's memory",
        lambda a: a.update(q_out=a["k_cache"].view(-1)[: 6 * 256].view(6, 4, 64)),
        ValueError,
        r"q_out: shares memory with k_cache",
    ),
]


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(device, backend, case):
    _, change, exc, message = case
    if device != "cpu":
        pytest.skip("the cases build CPU tensors")
    args = _good(device)
    change(args)
    before = {d: args[d].clone() for d in MHA_DESTINATIONS if isinstance(args.get(d), torch.Tensor)}
    with pytest.raises(exc, match=rf"^rope_store_cache: (?:{message})"):
        jitkv.rope_store_cache(**args, backend=backend)
    for d, t in before.items():
        assert_bitwise(args[d], t)


MLA_BAD = [
    (
        "k_pe odd width",
        lambda a: a.update(
            k_pe=rand((6, 63), BF16, "cpu"),
            k_pe_out=None,
            q_pe=None,
            q_nope=None,
            q_out=None,
            cos_sin_cache=cos_sin_table(MAX_POS, 64)[:, :63],
        ),
        ValueError,
        r"k_pe: expected an even width \(RoPE rotates pairs of dims\), got 63",
    ),
    (
        "cos_sin_cache width",
        lambda a: a.update(cos_sin_cache=cos_sin_table(MAX_POS, 32)),
        ValueError,
        r"cos_sin_cache: expected \[max_pos, rotary_dim\] = \[max_pos, 64\]",
    ),
    (
        "q_out without q_nope",
        lambda a: a.update(q_nope=None),
        ValueError,
        r"q_nope: q_out = \[q_nope \| rope\(q_pe\)\] needs both q_nope and q_pe, got None",
    ),
    (
        "q_nope without q_out",
        lambda a: a.update(q_out=None),
        ValueError,
        r"q_nope: only copied into q_out; expected q_out with it, got None",
    ),
    (
        "q_pe heads vs q_nope",
        lambda a: a.update(q_nope=rand((6, 2, 512), BF16, "cpu")),
        ValueError,
        r"q_nope: expected shape \[tokens, 4, nope\] \(q_pe's heads\), got \[6, 2, 512\]",
    ),
    (
        "q_out width",
        lambda a: a.update(q_out=rand((6, 4, 512), BF16, "cpu")),
        ValueError,
        r"q_out: expected shape \[tokens, 4, 576\], got \[6, 4, 512\]",
    ),
    (
        "q_pe width",
        lambda a: a.update(q_pe=rand((6, 4, 32), BF16, "cpu")),
        ValueError,
        r"q_pe: expected shape \[tokens, heads, 64\] \(k_pe's width\), got \[6, 4, 32\]",
    ),
    (
        "k_pe_out dtype",
        lambda a: a.update(k_pe_out=a["k_pe_out"].half()),
        TypeError,
        r"k_pe_out: expected dtype bfloat16 \(the dtype of k_pe\), got float16",
    ),
    (
        "kv_c dtype",
        lambda a: a.update(kv_c=a["kv_c"].half()),
        TypeError,
        r"kv_c: expected dtype bfloat16 \(the dtype of kv_buffer\), got float16",
    ),
    (
        "ds_mla widths",
        lambda a: a.update(
            kv_cache_dtype="fp8_ds_mla",
            kv_buffer=rand((NUM_SLOTS, 656), torch.uint8, "cpu"),
            kv_c=rand((6, 256), BF16, "cpu"),
            q_nope=None,
            q_out=None,
        ),
        ValueError,
        r"kv_c: fp8_ds_mla takes rows of 512 values, got 256",
    ),
    (
        "e4m3 without scale",
        lambda a: a.update(kv_cache_dtype="fp8_e4m3", kv_buffer=rand((NUM_SLOTS, 576), E4M3, "cpu")),
        ValueError,
        r"scale: required for an fp8 kv_cache_dtype",
    ),
]


@pytest.mark.parametrize("backend", BACKENDS["cpu"])
@pytest.mark.parametrize("case", MLA_BAD, ids=[c[0] for c in MLA_BAD])
def test_mla_bad_input(backend, case):
    _, change, exc, message = case
    args = _mla("cpu", n=6, extra=0, q=BF16)
    change(args)
    before = {d: args[d].clone() for d in MLA_DESTINATIONS if isinstance(args.get(d), torch.Tensor)}
    with pytest.raises(exc, match=rf"^rope_set_mla_kv_buffer: {message}"):
        jitkv.rope_set_mla_kv_buffer(**args, backend=backend)
    for d, t in before.items():
        assert_bitwise(args[d], t)


def test_cuda_variants():
    """The variant fields a CUDA kernel is built for, read from the arguments."""
    from jitkv.codes import KvFormat, RopeQ, SrcDtype
    from jitkv.ops import OPS
    from jitkv.ops.rope import MlaVariant, Variant, variant, variant_mla

    kw = _mha("cpu", d=128, rot=64, norm=True, q_out=E4M3, kv="fp8_e4m3", dv=64)
    got = Variant(*variant(*OPS["rope_store_cache"].args_of(kw)))
    assert got == Variant(
        128, 64, 64, True, True, True, SrcDtype.BF16, SrcDtype.F32, SrcDtype.BF16, RopeQ.E4M3, KvFormat.E4M3, True
    )
    kw = _mla("cpu", kv="fp8_ds_mla", q="none")
    got = MlaVariant(*variant_mla(*OPS["rope_set_mla_kv_buffer"].args_of(kw)))
    assert got == MlaVariant(512, 64, False, SrcDtype.BF16, SrcDtype.F32, RopeQ.NONE, KvFormat.DS_MLA, True)


def test_cuda_norm_builds():
    """The norms a CUDA module is built for: which heads (codes.RopeNorm bits: 1 q, 2 k) and the weights'
    dtype as JitSpec args, and weights the kernel has no build for refused before building."""
    from jitkv.codes import KvFormat, RopeQ, SrcDtype
    from jitkv.ops.rope import Variant, cuda_refusal, cuda_spec

    def v(q_norm, k_norm, w):
        return Variant(128, 128, 128, True, q_norm, k_norm, SrcDtype.BF16, SrcDtype.F32, w, RopeQ.COPY, KvFormat.COPY)

    args = [
        dict(cuda_spec("9.0a", v(q, k, w)).args)
        for q, k, w in [
            (False, False, SrcDtype.NONE),
            (True, False, SrcDtype.BF16),
            (False, True, SrcDtype.F32),
            (True, True, SrcDtype.BF16),
        ]
    ]
    assert [(a["norms"], a["norm_dtype"]) for a in args] == [(0, 0), (1, 1), (2, 3), (3, 1)]
    assert cuda_refusal(v(True, True, SrcDtype.F32)) is None
    assert cuda_refusal(v(True, True, SrcDtype.F16)) == "norm weights are float32 or of the sources' dtype"


# ------------------------------------------------------------------------------ GPU-only cases


_RCP_SQRT_CHECK = r"""
#include <cstdio>
#include "rope/lanes.cuh"

// Every float32 bit pattern m: rcp_sqrt_rn(m) against __frcp_rn(__fsqrt_rn(m)), bit for bit.
__global__ void check(unsigned long long* bad, unsigned* first) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < (1ull << 32); i += gridDim.x * blockDim.x) {
    const float m = __uint_as_float(unsigned(i));
    const unsigned got = __float_as_uint(jitkv::rope::rcp_sqrt_rn(m)), want = __float_as_uint(__frcp_rn(__fsqrt_rn(m)));
    if (got != want && !(isnan(__uint_as_float(got)) && isnan(__uint_as_float(want)))) {
      atomicAdd(bad, 1ull);
      atomicMin(first, unsigned(i));
    }
  }
}

int main() {
  unsigned long long* bad;
  unsigned* first;
  cudaMallocManaged(&bad, sizeof *bad);
  cudaMallocManaged(&first, sizeof *first);
  *bad = 0, *first = ~0u;
  check<<<4096, 256>>>(bad, first);
  if (cudaDeviceSynchronize() != cudaSuccess) return 2;
  std::printf("%llu mismatches, first at 0x%08x\n", *bad, *first);
  return *bad != 0;
}
"""


@gpu
def test_rcp_sqrt_rn_is_the_ieee_functions_for_every_float(tmp_path):
    """The norm's 1 / sqrt(m) (lanes.cuh rcp_sqrt_rn: m scaled into range, the hardware approximations and
    one Newton step each, no branches) gives the bits of __frcp_rn(__fsqrt_rn(m)) for all 2^32 float32 m
    (any NaN for a NaN): a standalone program over every bit pattern, built for this GPU."""
    import subprocess

    from jitkv.jit import toolchain
    from jitkv.tests.jit.test_headers import includes

    (tmp_path / "check.cu").write_text(_RCP_SQRT_CHECK)
    arch = toolchain.sm_name(toolchain.cuda_arch(torch.device("cuda")))
    build = [toolchain.nvcc(), f"-arch={arch}", "-std=c++17", "-O3", *includes(tmp_path), "check.cu", "-o", "check"]
    built = subprocess.run(build, cwd=tmp_path, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    run = subprocess.run([str(tmp_path / "check")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("0 mismatches"), run.stdout


@gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("n", [1, 64, 3000])
def test_every_cuda_backend_same_bytes(kv, n):
    kw = _mha("cuda", n=n, hq=32, hk=8, d=128, norm=True, q_out=E4M3 if kv != "auto" else None, kv=kv, per_head=True)
    kw["slot_mapping"] = slots(NUM_SLOTS * 16, n, torch.int64, "cuda")
    kw["k_cache"], kw["v_cache"] = (_cache("nhd", NUM_SLOTS * 16, 8, 128, kw["k_cache"].dtype, "cuda") for _ in "kv")
    outs = [_run_mha(backend, kw) for backend in CUDA_BACKENDS]
    for d in MHA_DESTINATIONS:
        if d in kw:
            assert_bitwise(outs[0][d], outs[1][d])


@gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_cuda_graph_replay(backend):
    """A captured rope_store_cache replays with new sources, positions, slots and device scales."""
    kw = _mha("cuda", n=64, norm=True, q_out=E4M3, kv="fp8_e4m3", per_head=True)
    jitkv.rope_store_cache(**kw, backend=backend)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        jitkv.rope_store_cache(**kw, backend=backend)
    for _ in range(3):
        fresh = _mha("cuda", n=64, norm=True, q_out=E4M3, kv="fp8_e4m3", per_head=True)
        for name in ("q", "k", "v", "slot_mapping", "positions", "k_scale", "v_scale", "q_scale"):
            kw[name].copy_(fresh[name])
        want = {**kw, **{d: kw[d].clone() for d in MHA_DESTINATIONS if d in kw}}
        reference.rope_store_cache(**want)
        graph.replay()
        torch.cuda.synchronize()
        for d in MHA_DESTINATIONS:
            if d in kw:
                assert_bitwise(kw[d], want[d])


@gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_out_of_range_gpu_clamped_or_raises_under_debug(backend, monkeypatch):
    """CUDA clamps a position outside the table into it (the reference's non-strict rule) and skips an
    out-of-range slot; JITKV_DEBUG=1 raises IndexError on the host first."""
    kw = _mha("cuda", n=16, extra=0)
    kw["positions"][3] = MAX_POS + 5
    _run_mha(backend, kw)
    monkeypatch.setenv("JITKV_DEBUG", "1")
    jitkv.ops.reset()
    try:
        with pytest.raises(IndexError, match=r"rope_store_cache: positions: position 3 has value"):
            jitkv.rope_store_cache(**kw, backend=backend)
    finally:
        monkeypatch.undo()
        jitkv.ops.reset()


@gpu
@pytest.mark.parametrize("kv,src,buf_dtype", MLA_FORMATS)
def test_mla_every_cuda_backend_same_bytes(kv, src, buf_dtype):
    kw = _mla("cuda", n=200, h=16, kv=kv, src=src, buf_dtype=buf_dtype, q=E4M3)
    outs = [_run_mla(backend, kw) for backend in CUDA_BACKENDS]
    for d in MLA_DESTINATIONS:
        if d in kw:
            assert_bitwise(outs[0][d], outs[1][d])


@gpu
def test_cuda_kernel_runs_by_default_and_unaligned_views_take_triton():
    """auto picks the CUDA kernel for an aligned Llama-shaped call; a q view 2 bytes off 16 runs Triton
    (the kernel answered NEEDS_ANY_ALIGNMENT before launching), same bytes either way."""
    jitkv.ops.reset()
    kw = _mha("cuda", n=20, hq=8, hk=2, d=128, norm=True)
    _run_mha(None, kw)
    assert jitkv.backend_info("rope_store_cache")["cuda:0"]["backend"] == "jit"
    packed = rand((20 + 3, 8 * 128 + 1), BF16, "cuda")
    kw["q"] = packed[:, 1:].view(23, 8, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jitkv.JitkvFallbackWarning)  # warned once per process and reason
        _run_mha(None, kw)
    info = jitkv.backend_info("rope_store_cache")["cuda:0"]
    assert info["backend"] == "triton" and "not aligned" in info["reason"]
    jitkv.ops.reset()


@gpu
@pytest.mark.parametrize("geometry", ["one head", "four heads", "below wide blocks", "wide blocks"])
@pytest.mark.parametrize("q", ["in_place", "e4m3"])
def test_mla_launch_geometries(geometry, q):
    """The MLA kernel's heads per thread and blocks (rope/geometry.h heads_per_thread, kMlaThreadsPerSm =
    128; mla_block_threads: 512-thread blocks at kBulkHpt heads once they give every SM 2048 threads):
    DeepSeek's 128 query heads at the fewest tokens of each geometry (one token under each threshold
    for "below"), with padding rows."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    # A token's threads at one and at four heads per thread (mla_kernels.cuh MlaShape::token_threads).
    at_one, at_four = (9312, 2400) if q == "e4m3" else (1120, 352)
    wide = -(-2048 * sms // at_four)
    n = {"one head": 1, "four heads": -(-128 * sms // at_one), "below wide blocks": wide - 1, "wide blocks": wide}
    n = n[geometry]
    kw = _mla("cuda", n=n, h=128, kv="fp8_e4m3", q=E4M3 if q == "e4m3" else q, num_slots=2 * n + 64)
    kw["loc"][::5] = -1
    assert _run_mla("jit", kw) is not None


@gpu
def test_mla_deepseek_shape_every_format():
    """128 query heads, q_out = [q_nope | rope(q_pe)] in e4m3, every row format, on the CUDA kernel."""
    for kv, src, buf_dtype in MLA_FORMATS:
        if src == torch.float32:
            continue
        kw = _mla("cuda", n=70, h=128, kv=kv, src=src, buf_dtype=buf_dtype, q=E4M3)
        kw["loc"][::3] = -1
        assert _run_mla("jit", kw) is not None


# --------------------------------------------------------------------- Triton under the interpreter


def test_triton_kernels_under_interpreter():
    """The Triton kernels under TRITON_INTERPRET=1 against the reference (CI has no GPU)."""
    run_under_interpreter(f"{__name__}:triton_interpreter_cases")


def triton_interpreter_cases():
    """Run by test_triton_kernels_under_interpreter in a process with TRITON_INTERPRET=1."""
    from jitkv.ops import OPS
    from jitkv.ops.rope import check, check_mla
    from jitkv.triton.rope import rope_set_mla_kv_buffer_triton, rope_store_cache_triton

    mha_cases = [
        dict(norm=True, q_out=E4M3, kv="fp8_e4m3", per_head=True, layout="hnd"),
        dict(rot=32, cs_dtype=BF16, layout="nhd", dv=32),
        dict(src=torch.float16, d=80, rot=48, norm=True, q_out=torch.float16, kv="fp8_e5m2"),
        dict(src=torch.float32, d=40, rot=8, k_out=False, layout="flat2d"),
    ]
    for i, case in enumerate(mha_cases):
        kw = _mha("cpu", n=13, **case)
        kw["is_neox"] = i % 2 == 0
        kw["slot_mapping"][::4] = -1
        got = {**kw, **{d: _clone(kw[d]) for d in MHA_DESTINATIONS if d in kw}}
        want = {**kw, **{d: _clone(kw[d]) for d in MHA_DESTINATIONS if d in kw}}
        rope_store_cache_triton(*check(*OPS["rope_store_cache"].args_of(got)))
        reference.rope_store_cache(**want)
        for d in MHA_DESTINATIONS:
            if d in kw:
                assert_bitwise(got[d], want[d])
    for i, (kv, src, buf_dtype) in enumerate(MLA_FORMATS):
        q = [E4M3, src, "in_place", "none"][i % 4]
        kw = _mla(
            "cpu",
            n=9,
            nope=512 if kv == "fp8_ds_mla" else 96,
            rope=64 if kv == "fp8_ds_mla" else 24,
            kv=kv,
            src=src,
            buf_dtype=buf_dtype,
            q=q,
        )
        kw["is_neox"] = i % 2 == 1
        kw["loc"][::3] = -1
        got = {**kw, **{d: kw[d].clone() for d in MLA_DESTINATIONS if d in kw}}
        want = {**kw, **{d: kw[d].clone() for d in MLA_DESTINATIONS if d in kw}}
        rope_set_mla_kv_buffer_triton(*check_mla(*OPS["rope_set_mla_kv_buffer"].args_of(got)))
        reference.rope_set_mla_kv_buffer(**want)
        for d in MLA_DESTINATIONS:
            if d in kw:
                assert_bitwise(got[d], want[d])
