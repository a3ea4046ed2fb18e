"""The CPU kernels' vector paths (jitkv/cpu/isa.h): for every path this host runs (AVX-512, AVX2,
scalar), a child process with ``JITKV_CPU_ISA`` set and its own cache builds the five CPU modules,
checks that each reports that path, and runs every CPU op against the torch reference over the whole
destination, poisoned first with random bytes: row lengths that end in each vector tail, strided
sources, flat / paged NHD / paged HND caches, streamed (non-temporal) writes, fp8 conversion of every
bf16 and fp16 value and of fp32 specials, and of every bf16 and fp16 value and fp32 values at fp8
rounding edges under some 700 scales (the vector paths' multiply, power-of-two and division cases).
Also ``toolchain.cpu_isa()``'s handling of the variable."""

from __future__ import annotations

import os
import subprocess
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import jitkv
from jitkv.codes import DsMla
from jitkv.jit import ensure_built, get_function, toolchain
from jitkv.tests.conftest import assert_bitwise, every_16_bit_value, rand, slots
from jitkv.tests.jit.conftest import run_py

HOST_ISA = toolchain.host_cpu_isa()
ISAS = toolchain.host_cpu_isas()
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Element counts per row segment around the vector widths: below 8, the 8-lane (AVX2) and 16-lane
# (AVX-512) steps, 32 / 64 byte blocks and their tails.
LENGTHS = [1, 7, 13, 40, 64, 100, 129]


@pytest.mark.parametrize("isa", ISAS)
def test_every_cpu_op_matches_the_reference_on_each_isa(isa, tmp_path):
    res = run_py(
        f"from jitkv.tests.jit.test_cpu_isa import check_isa; check_isa({isa!r})",
        tmp_path,
        JITKV_CPU_ISA=isa,
        JITKV_LOG_LEVEL="WARNING",
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert f"checked {isa}" in res.stdout


def test_cpu_isa_env(monkeypatch):
    monkeypatch.setattr(toolchain, "_ISA_WARNED", set())
    for asked, want in (("", HOST_ISA), ("native", HOST_ISA), ("SCALAR", "scalar"), (" scalar ", "scalar")):
        monkeypatch.setenv("JITKV_CPU_ISA", asked)
        assert toolchain.cpu_isa() == want
        assert toolchain.cpu_isa_cflags() == ([] if want == HOST_ISA else ["-mno-avx"])
    monkeypatch.setenv("JITKV_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="JITKV_CPU_ISA='sse9': expected native, avx512, avx2, scalar"):
        toolchain.cpu_isa()
    monkeypatch.setattr(toolchain, "host_cpu_isa", lambda: "scalar")
    monkeypatch.setenv("JITKV_CPU_ISA", "avx2")
    with pytest.warns(RuntimeWarning, match="JITKV_CPU_ISA=avx2: this CPU lacks it; building for scalar"):
        assert toolchain.cpu_isa() == "scalar"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        assert toolchain.cpu_isa() == "scalar" and toolchain.cpu_isa_cflags() == []


def test_isa_flags_are_part_of_the_key(monkeypatch):
    import importlib

    store_cache = importlib.import_module("jitkv.ops.store_cache")
    keys = set()
    for isa in ISAS:
        monkeypatch.setenv("JITKV_CPU_ISA", isa)
        keys.add(store_cache.cpu_spec().key())
    assert len(keys) == len(ISAS)


@pytest.mark.parametrize(
    "cpu_list, count", [("0-1", 2), ("0", 1), ("0-7,64-71", 16), ("0,2,4", 3), ("", 0), ("3-1", 0), ("x", 0)]
)
def test_cpu_list_count(cpu_list, count):
    """The CPUs of a sysfs shared_cpu_list, which cap the L3 the streaming rule counts (0: no cap)."""
    assert toolchain.cpu_list_count(cpu_list) == count


def test_llc_share_without_a_cpu_list(monkeypatch):
    """An L3 whose sysfs directory lists no shared_cpu_list counts whole, as caches.h's llc_share does
    with no CPU count; with one, at most 16 MiB a CPU."""
    files = {"level": "3", "type": "Unified", "size": "307200K"}

    def read(directory, name):
        if name not in files:
            raise FileNotFoundError(name)
        return files[name]

    monkeypatch.setattr(toolchain.os, "listdir", lambda root: ["index3"])
    monkeypatch.setattr(toolchain, "_read", read)
    assert toolchain.host_cache_bytes(3) == 300 << 20
    files["shared_cpu_list"] = "0-1"
    assert toolchain.host_cache_bytes(3) == 32 << 20


@pytest.mark.parametrize("level", [2, 3])
def test_streaming_rule_uses_the_cores_caches(level):
    """The streaming rule's L2 and LLC (caches.h) are cpu0's caches as sysfs lists them, not sysconf's
    (which may give a whole package's L3: ten times a core's on an AMD EPYC guest), the L3 at most
    16 MiB for each CPU sysfs says shares it (a Xeon guest's 2 vCPUs list the socket's 300 MiB)."""
    want = toolchain.host_cache_bytes(level)
    if want is None:
        pytest.skip(f"sysfs lists no level-{level} cache here")
    import importlib

    spec = importlib.import_module("jitkv.ops.store_cache").cpu_spec()
    ensure_built(spec)
    assert get_function(spec, "cpu_cache_bytes")(level) == want


# ----------------------------------------------------------------------------------------------------
# What the child process runs.


def check_isa(isa: str) -> None:
    """Every CPU module reports ``isa``; every check below passes. Prints the seed (fresh data each run)."""
    seed = torch.seed()
    print(f"seed {seed}", flush=True)
    torch.set_num_threads(min(torch.get_num_threads(), 2))  # bounds the streamed cases' payload (2 threads' L2)
    import importlib

    assert toolchain.cpu_isa() == isa, toolchain.cpu_isa()
    # The family modules by name: jitkv.ops.store_cache is the op (jitkv.ops exports each family's names).
    families = ("store_cache", "mla", "mla_gather", "indexer", "rope")
    specs = [importlib.import_module(f"jitkv.ops.{name}").cpu_spec() for name in families]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # the builds side by side
        list(pool.map(ensure_built, specs))
    for spec in specs:
        got = get_function(spec, "cpu_isa")()
        assert got == isa, f"{spec.op}: built for {got}, asked {isa}"
    for check in CHECKS:
        check()
    print(f"checked {isa}")


def _poison(t: torch.Tensor) -> torch.Tensor:
    t.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8))
    return t


def _agree(what: str, bases: tuple, call) -> None:
    """call(backend, *bases) writes into (views of) contiguous bases; poisoned alike, jit and torch
    leave every byte of every base the same."""
    for b in bases:
        _poison(b)
    want = tuple(b.clone() for b in bases)
    call("torch", *want)
    call("jit", *bases)
    for i, (g, w) in enumerate(zip(bases, want)):
        try:
            assert_bitwise(g, w)
        except AssertionError as e:
            raise AssertionError(f"{what}, destination {i}: {e}") from None


def _with_padding(n: int, num_slots: int) -> torch.Tensor:
    """n distinct random slots with every 5th position padding (-1)."""
    s = slots(num_slots, n)
    s[::5] = -1
    return s


def _streamed_rows(row_bytes: int) -> int:
    """Rows (a fifth of them padding) whose payload per thread passes the L2 size, where the scatters
    stream (cpu/scatter.h want_streaming, with the L2 of cpu/caches.h: sysfs, else sysconf, which
    getconf reads and os.sysconf does not name)."""
    l2 = toolchain.host_cache_bytes(2)
    if l2 is None:
        out = subprocess.run(["getconf", "LEVEL2_CACHE_SIZE"], capture_output=True, text=True).stdout.strip()
        l2 = int(out) if out.isdigit() and int(out) > 0 else 1 << 20
    return -(-l2 * torch.get_num_threads() * 3 // (2 * row_bytes))


# store_cache ----------------------------------------------------------------------------------------


def _kv_cache(layout: str, num_slots: int, h: int, d: int, dtype, d_pad: int) -> torch.Tensor:
    """The contiguous storage of a flat [slots, H, D], paged NHD [nb, 16, H, D] or paged HND
    [nb, H, 16, D] cache whose rows of D values are D + d_pad apart (``_kv_view`` gives the cache)."""
    if layout == "flat":
        return torch.empty(num_slots, h, d + d_pad, dtype=dtype)
    shape = (num_slots // 16, 16, h) if layout == "nhd" else (num_slots // 16, h, 16)
    return torch.empty(*shape, d + d_pad, dtype=dtype)


def _kv_view(layout: str, base: torch.Tensor, d: int) -> torch.Tensor:
    return (base.permute(0, 2, 1, 3) if layout == "hnd" else base)[..., :d]


def _store_cache_case(
    what, n, h, d, src_dtype, cache_dtype, layout, *, kv="auto", scales=(None, None), src_pad=0, d_pad=0, k=None
):
    num_slots = 16 * (-(-2 * n // 16))
    k = rand((n, h, d + src_pad), src_dtype)[..., :d] if k is None else k
    v = rand((n, h, d), src_dtype)
    sm = _with_padding(n, num_slots)

    def call(backend, kb, vb):
        jitkv.store_cache(
            k,
            v,
            _kv_view(layout, kb, d),
            _kv_view(layout, vb, d),
            sm,
            kv_cache_dtype=kv,
            k_scale=scales[0],
            v_scale=scales[1],
            backend=backend,
        )

    bases = tuple(_kv_cache(layout, num_slots, h, d, cache_dtype, d_pad) for _ in "kv")
    _agree(f"store_cache {what} n={n} H={h} D={d} {src_dtype}->{kv} {layout}", bases, call)


def check_store_cache_copy():
    for dtype, h, d in ((torch.bfloat16, 8, 128), (torch.float32, 2, 24), (torch.uint8, 5, 13), (torch.float16, 1, 7)):
        for layout in ("flat", "nhd", "hnd"):
            _store_cache_case("copy", 37, h, d, dtype, dtype, layout)
    for d in LENGTHS:  # one segment per head: a strided source, a padded cache row
        _store_cache_case("copy, strided source", 21, 3, d, torch.bfloat16, torch.bfloat16, "flat", src_pad=8)
        _store_cache_case("copy, padded cache", 21, 3, d, torch.bfloat16, torch.bfloat16, "nhd", d_pad=5)
    # Streamed: whole lines, then (D = 40 in 64-value rows) partial ones.
    _store_cache_case("copy, streamed", _streamed_rows(2 * 8 * 128 * 2), 8, 128, torch.bfloat16, torch.bfloat16, "hnd")
    _store_cache_case(
        "copy, streamed",
        _streamed_rows(2 * 8 * 40 * 2),
        8,
        40,
        torch.bfloat16,
        torch.bfloat16,
        "flat",
        src_pad=8,
        d_pad=24,
    )


def check_store_cache_fp8():
    for kv, fp8 in FP8.items():
        for src_dtype in (torch.bfloat16, torch.float16, torch.float32):
            for d in LENGTHS:
                per_head = (torch.rand(3) + 0.05, torch.rand(3) * 4 + 0.5)
                for scales in ((0.37, 2.5), per_head):
                    _store_cache_case("", 13, 3, d, src_dtype, torch.uint8, "flat", kv=kv, scales=scales)
                    # Rows enough for each quantizer to check for one multiply (fp8.h kOnceValues, 8192).
                    n = -(-2 * 8192 // d)
                    _store_cache_case("many rows", n, 3, d, src_dtype, torch.uint8, "flat", kv=kv, scales=scales)
            _store_cache_case("strided", 37, 4, 100, src_dtype, fp8, "hnd", kv=kv, scales=(0.5, 0.25), src_pad=4)
            _store_cache_case(
                "per-head", 37, 4, 128, src_dtype, fp8, "nhd", kv=kv, scales=(torch.rand(4) + 0.1, torch.tensor([3.0]))
            )
        for d, layout, d_pad in ((128, "hnd", 0), (100, "flat", 28)):
            _store_cache_case(
                "streamed",
                _streamed_rows(2 * 8 * d),
                8,
                d,
                torch.bfloat16,
                fp8,
                layout,
                kv=kv,
                scales=(0.5, 0.25),
                d_pad=d_pad,
            )


def check_fp8_every_16_bit_value():
    """store_cache's conversion of every bf16 / fp16 pattern, per-tensor and per-head scales; heads of 125
    values (each segment's tail) and of 128 (whole lines: a row's per-head segments in one call)."""
    for dtype in (torch.bfloat16, torch.float16):
        for d in (125, 128):
            x = every_16_bit_value(dtype, 8 * d)
            k = x.view(x.shape[0], 8, d)
            for kv in FP8:
                for scales in ((1.0, 0.37), (torch.exp2(torch.arange(-10.0, 14.0, 3.0)), 1e-3)):
                    _store_cache_case(
                        "every value", k.shape[0], 8, d, dtype, torch.uint8, "flat", kv=kv, scales=scales, k=k
                    )


def _fp32_specials() -> torch.Tensor:
    """NaNs of both signs and several payloads, ±inf, ±0, fp32 subnormals, the fp8 formats' maxima,
    their rounding edges and values above them, fp8 subnormal edges; then random bit patterns."""
    bits = [
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0xFFC00000,
        0x7F800001,
        0xFFFFFFFF,
        0x7FBFFFFF,
        0,
        0x80000000,
        0x00000001,
        0x807FFFFF,
        0x00400000,
        0x00800000,
        0x7F7FFFFF,
        0xFF7FFFFF,
    ]
    vals = [
        448.0,
        449.0,
        464.0,
        465.0,
        480.0,
        1e6,
        -448.0,
        -500.0,
        57344.0,
        61440.0,
        61441.0,
        -1e30,
        2.0**-6,
        2.0**-9,
        2.0**-10,
        3 * 2.0**-10,
        2.0**-14,
        2.0**-16,
        2.0**-17,
        3 * 2.0**-17,
        1.5 * 2.0**-7,
        0.0625 * 1.0625,
    ]
    special = torch.cat(
        [
            torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32),
            torch.tensor(vals, dtype=torch.float32),
        ]
    )
    randbits = torch.randint(-(2**31), 2**31, (8 * 1000 - special.numel(),), dtype=torch.int64).to(torch.int32)
    return torch.cat([special, randbits.view(torch.float32)])


def check_fp8_fp32_specials():
    k = _fp32_specials().view(-1, 4, 50)
    for kv in FP8:
        for scales in ((1.0, 1.0), (0.37, 3e5), (torch.tensor([1.0, 2.0**-20, 0.5, 7.0]), 1.0)):
            _store_cache_case(
                "fp32 specials", k.shape[0], 4, 50, torch.float32, torch.uint8, "flat", kv=kv, scales=scales, k=k
            )


def _fp8_scales() -> torch.Tensor:
    """Scales for every case of the vector paths' quotient (jitkv/cpu/fp8_format.h, "Vector paths"): each power of two
    (the FMA path, and the division path past its edges); significands the Markstein step meets
    (1 + 2^-23, 2 - 2^-23, 3, 0.1, 1/3, 448 / 1.5, ..., at several exponents, and 400 random scales from
    2^-80 to 2^90); the division path's edges 2^-85 and 2^100 with their neighbours, FLT_MIN, fp32
    subnormals, FLT_MAX."""
    pow2 = torch.exp2(torch.arange(-149.0, 128.0, dtype=torch.float64)).float()
    odd = torch.tensor([1 + 2**-23, 2 - 2**-23, 1.5, 3.0, 0.1, 1 / 3, 448 / 1.5, 57344 / 1.5, 0.37, 1e-3, 7.0])
    odd = torch.cat([odd * 2.0**e for e in (-84, -40, 0, 30, 99)]).float()
    edge = torch.tensor([2.0**-85, 2.0**100, 2.0**-126], dtype=torch.float32)
    edges = torch.cat([edge, edge.nextafter(torch.zeros(3)), edge.nextafter(torch.full((3,), torch.inf))])
    tiny = torch.tensor([1e-40, 2.0**-149, 3.4028234663852886e38], dtype=torch.float32)
    exps = torch.randint(-80, 91, (400,), dtype=torch.int32)
    rnd = ((exps + 127) << 23 | torch.randint(0, 1 << 23, (400,), dtype=torch.int32)).view(torch.float32)
    return torch.cat([pow2, odd, edges, tiny, rnd])


def _fp8_midpoints() -> torch.Tensor:
    """The midpoints between neighbouring positive fp8 values of both formats, and past their maxima."""
    out = []
    for fp8 in FP8.values():
        vals = torch.arange(0, 0x7F, dtype=torch.uint8).view(fp8).float()
        vals = vals[vals.isfinite()].unique()
        out.append((vals[1:] + vals[:-1]) / 2)
        out.append(vals[-1:] + (vals[-1] - vals[-2]) / 2)
    return torch.cat(out)


def _fp8_quotients_agree(what: str, k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor) -> None:
    """k and v [n, H, D] into fp8 caches by store_cache with per-head scales (K: the first H of
    ``scales``, V: the next H), byte for byte against torch's (x.float() / scale).clamp(-max, max).to(fp8)."""
    n, h, _ = k.shape
    ks, vs = scales[:h].contiguous(), scales[h:].contiguous()
    for kv, fp8 in FP8.items():
        kc, vc = torch.empty_like(k, dtype=torch.uint8), torch.empty_like(v, dtype=torch.uint8)
        jitkv.store_cache(k, v, kc, vc, torch.arange(n), kv_cache_dtype=kv, k_scale=ks, v_scale=vs, backend="jit")
        m = torch.finfo(fp8).max
        for x, got, s, side in ((k, kc, ks, "K"), (v, vc, vs, "V")):
            want = (x.float() / s.view(1, h, 1)).clamp(-m, m).to(fp8).view(torch.uint8)
            bad = (got != want).nonzero()
            if bad.numel():
                t, i, d = bad[0].tolist()
                raise AssertionError(
                    f"{what} -> {kv} {side}: {bad.shape[0]} codes differ; first x={x[t, i, d].item()!r} "
                    f"scale={s[i].item()!r}: got {got[t, i, d].item():#04x}, torch {want[t, i, d].item():#04x}"
                )


def check_fp8_quotients():
    """Every bf16 and fp16 value against every scale of _fp8_scales, per-head (so each head's segment
    takes the vector paths of its scale); fp32 sources: per scale s, RN(m * s) and its neighbours within
    2 ulps for each fp8 midpoint m (quotients at the rounding edges, ties where m * s is exact), both
    signs, and random values around the scale."""
    scales = _fp8_scales()
    h = -(-scales.numel() // 2)
    scales = torch.cat([scales, scales[: 2 * h - scales.numel()]])
    for dtype in (torch.bfloat16, torch.float16):
        x = every_16_bit_value(dtype, 256).view(-1, 1, 256).expand(-1, h, -1).contiguous()
        _fp8_quotients_agree(f"every {dtype} value", x, x, scales)
    s = scales.view(-1, 1)
    x = (_fp8_midpoints() * s.double()).float()
    near = [x]
    for _ in range(2):
        near = [near[0].nextafter(torch.zeros(())), *near, near[-1].nextafter(torch.full((), torch.inf))]
    rnd = (torch.randn(s.shape[0], 256).double() * 100 * s.double()).float()
    x = torch.cat([*near, *(-t for t in near), rnd], dim=1)  # row i: scale i's values
    _fp8_quotients_agree("fp32 at fp8 midpoints", x[:h].unsqueeze(0), x[h:].unsqueeze(0), scales)


# set_mla_kv_buffer -------------------------------------------------------------------------------------


def _mla_case(what, nope, rope, width, n, *, src_dtype=torch.bfloat16, kv="auto", scale=None, k_nope=None):
    num_slots = 2 * n + 3
    k_nope = rand((n, nope), src_dtype) if k_nope is None else k_nope
    k_rope = rand((n, rope), src_dtype)
    loc = _with_padding(n, num_slots)
    buf = torch.empty(num_slots, width, dtype=src_dtype if kv == "auto" else torch.uint8)

    def call(backend, b):
        if kv == "auto":
            jitkv.set_mla_kv_buffer(b, loc, k_nope, k_rope, backend=backend)
        else:
            jitkv.set_mla_kv_buffer(b, loc, k_nope, k_rope, kv_cache_dtype=kv, scale=scale, backend=backend)

    _agree(f"set_mla_kv_buffer {what} n={n} {nope}+{rope} in {width} {src_dtype}->{kv}", (buf,), call)


def check_mla_copy():
    cases = (
        (512, 64, 576, torch.bfloat16),
        (500, 50, 560, torch.bfloat16),
        (7, 3, 16, torch.float32),
        (100, 28, 130, torch.uint8),
        (13, 1, 20, torch.float16),
    )
    for nope, rope, width, dtype in cases:
        _mla_case("copy", nope, rope, width, 29, src_dtype=dtype)
    for nope, rope in ((512, 64), (500, 50), (500, 12)):  # streamed; the line straddling nope, a partial last line
        _mla_case("copy, streamed", nope, rope, 576, _streamed_rows(1152))


def check_mla_fp8():
    for kv in FP8:
        for src_dtype in (torch.bfloat16, torch.float16):
            for nope, rope in ((512, 64), (100, 13), (7, 40), (129, 1)):
                _mla_case("", nope, rope, nope + rope + 3, 29, src_dtype=src_dtype, kv=kv, scale=0.37)
            _mla_case(
                "every value",
                512,
                64,
                600,
                128,
                src_dtype=src_dtype,
                kv=kv,
                scale=torch.tensor([0.02]),
                k_nope=every_16_bit_value(src_dtype, 512),
            )
        _mla_case("streamed", 512, 64, 576, _streamed_rows(576), kv=kv, scale=1.5)
        _mla_case("streamed", 500, 40, 576, _streamed_rows(576), kv=kv, scale=1.5)
    for src_dtype in (torch.bfloat16, torch.float16):
        _mla_case("", DsMla.NOPE, DsMla.ROPE, DsMla.BYTES + 5, 29, src_dtype=src_dtype, kv="fp8_ds_mla")
        _mla_case(
            "every value",
            DsMla.NOPE,
            DsMla.ROPE,
            DsMla.BYTES,
            128,
            src_dtype=src_dtype,
            kv="fp8_ds_mla",
            k_nope=every_16_bit_value(src_dtype, DsMla.NOPE),
        )
    _mla_case("streamed", DsMla.NOPE, DsMla.ROPE, 704, _streamed_rows(704), kv="fp8_ds_mla")


# gather_mla_cache -------------------------------------------------------------------------------------


def _gather_case(fmt, cache, out_width, lens):
    """Requests of `lens` tokens over random blocks of `cache` [nb, bs, W]; a table entry of each kind
    that gives zero rows (-1, past the cache); out has rows no request covers."""
    nb, bs = cache.shape[0], cache.shape[1]
    need = max(-(-n // bs) for n in lens)
    table = torch.stack([torch.randperm(nb)[:need] for _ in lens]).int()
    table[0, 0], table[-1, -1] = -1, nb
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.empty(int(cu[-1]) + 5, out_width, dtype=cache.dtype if fmt == "auto" else torch.bfloat16)
    scale = None if fmt in ("auto", "fp8_ds_mla") else 0.0371

    def call(backend, o):
        jitkv.gather_mla_cache(o, cache, table, cu, kv_cache_dtype=fmt, scale=scale, backend=backend)

    _agree(f"gather_mla_cache {fmt} W={cache.shape[2]} {cache.dtype}", (out,), call)


def check_mla_gather():
    lens = [37, 5, 64]
    for dtype, width in ((torch.bfloat16, 576), (torch.bfloat16, 13), (torch.float32, 24), (torch.uint8, 100)):
        _gather_case("auto", rand((8, 16, width), dtype), width, lens)
    for fmt, fp8 in FP8.items():
        for width in (576, *LENGTHS):
            cache = rand((8, 16, width), torch.uint8)
            every = min(256, 16 * width)  # every fp8 byte in each block (the first `every` of a narrow one)
            cache.view(8, -1)[:, :every] = torch.arange(every, dtype=torch.uint8)
            _gather_case(fmt, cache.view(fp8) if width == 576 else cache, width, lens)
    cache = rand((8, 16, DsMla.BYTES), torch.uint8)
    scales = (torch.rand(8, 16, 4) + 1e-3) * torch.exp2(torch.randint(-12, 4, (8, 16, 4)).float())
    cache[..., DsMla.SCALE_OFFSET : DsMla.ROPE_OFFSET] = scales.view(torch.uint8)
    cache[:, 0, :256] = torch.arange(256, dtype=torch.uint8)
    _gather_case("fp8_ds_mla", cache, DsMla.NOPE + DsMla.ROPE, lens)


# indexer ------------------------------------------------------------------------------------------------


def check_indexer():
    bs, nb = 16, 40
    layout = jitkv.INDEXER_K_CACHE
    for dtype in (torch.bfloat16, torch.float16):
        for k in (
            (torch.randn(77, 128) * torch.exp2(torch.randint(-12, 12, (77, 1)).float())).to(dtype),
            every_16_bit_value(dtype, 128),
        ):
            sm = _with_padding(k.shape[0], nb * bs)
            for fmt in (None, "ue8m0"):

                def call(backend, c, k=k, sm=sm, fmt=fmt):
                    jitkv.indexer_k_quant_and_cache(k, c, sm, block_size=bs, scale_fmt=fmt, backend=backend)

                _agree(
                    f"indexer_k_quant_and_cache {dtype} {k.shape[0]} rows {fmt}",
                    (layout.allocate(nb, bs, "cpu"),),
                    call,
                )
    n = _streamed_rows(layout.token_bytes)  # the values streamed, the scales stored
    blocks = 2 * n // bs
    k, sm = rand((n, 128), torch.bfloat16), _with_padding(n, blocks * bs)

    def call_streamed(backend, c):
        jitkv.indexer_k_quant_and_cache(k, c, sm, block_size=bs, scale_fmt="ue8m0", backend=backend)

    _agree(f"indexer_k_quant_and_cache streamed n={n}", (layout.allocate(blocks, bs, "cpu"),), call_streamed)
    cache = rand((nb, layout.block_stride(bs)), torch.uint8)
    table = torch.randperm(nb)[:12].int().view(2, 6)
    table[0, 4], table[1, 1] = nb, -1  # zero rows: a block past the cache, a negative one
    cu = torch.tensor([0, 70, 90], dtype=torch.int32)

    def gather(backend, dst_k, dst_scale):
        jitkv.gather_indexer_k_quant_cache(cache, dst_k, dst_scale, table, cu, block_size=bs, backend=backend)

    _agree("gather_indexer_k_quant_cache", (torch.empty(95, 128, dtype=torch.uint8), torch.empty(95)), gather)


# rope ---------------------------------------------------------------------------------------------


def check_rope() -> None:
    """rope_store_cache and rope_set_mla_kv_buffer on head dims ending in each vector tail (8, 40, 72,
    136), partial rotary, NeoX and GPT-J, the fixed-order norm, every source dtype, fp8 and bf16 outputs."""
    from jitkv.ops.rope import cos_sin_table

    for d, rot, neox, dtype in (
        (8, 8, True, torch.bfloat16),
        (40, 24, False, torch.float16),
        (72, 72, True, torch.float32),
        (136, 40, False, torch.bfloat16),
        (128, 128, True, torch.float16),
    ):
        n, hq, hk = 37, 5, 2  # 5 normed q heads: a batch of the norm (rope_cpu.cpp kNormBatch) and a tail
        q, k, v = rand((n, hq, d), dtype), rand((n, hk, d), dtype), rand((n, hk, d), dtype)
        cs, pos, sm = cos_sin_table(64, rot), torch.randint(0, 64, (n,)), _with_padding(n, 96)
        weights = dict(q_norm_weight=rand((d,), dtype), k_norm_weight=rand((d,), dtype))
        for kv, cache_dtype, q_dtype in (("auto", dtype, dtype), ("fp8_e4m3", torch.float8_e4m3fn, torch.float8_e5m2)):
            fp8 = dict(k_scale=0.3, v_scale=1.7) if kv != "auto" else {}
            q_scale = dict(q_scale=0.05) if q_dtype != dtype else {}

            def call(backend, q_out, k_out, kc, vc):
                jitkv.rope_store_cache(
                    q,
                    k,
                    v,
                    kc,
                    vc,
                    sm,
                    pos,
                    cs,
                    is_neox=neox,
                    rotary_dim=rot,
                    q_out=q_out,
                    k_out=k_out,
                    kv_cache_dtype=kv,
                    backend=backend,
                    **weights,
                    **fp8,
                    **q_scale,
                )

            _agree(
                f"rope_store_cache D{d} rot{rot} {kv}",
                (
                    torch.empty(n, hq, d, dtype=q_dtype),
                    torch.empty(n, hk, d, dtype=dtype),
                    torch.empty(96, hk, d, dtype=cache_dtype),
                    torch.empty(96, hk, d, dtype=cache_dtype),
                ),
                call,
            )
    for kv, nope, r in (("auto", 40, 24), ("fp8_e4m3", 100, 56), ("fp8_ds_mla", DsMla.NOPE, DsMla.ROPE)):
        n, h = 29, 3
        kv_c, k_pe, q_pe, q_nope = (
            rand((n, nope), torch.bfloat16),
            rand((n, r), torch.bfloat16),
            rand((n, h, r), torch.bfloat16),
            rand((n, h, nope), torch.bfloat16),
        )
        cs, pos, loc = cos_sin_table(64, r), torch.randint(0, 64, (n,)), _with_padding(n, 64)
        width = DsMla.BYTES if kv == "fp8_ds_mla" else nope + r
        buf_dtype = torch.bfloat16 if kv == "auto" else torch.uint8

        def call_mla(backend, buf, q_out, k_pe_out):
            jitkv.rope_set_mla_kv_buffer(
                buf,
                loc,
                kv_c,
                k_pe,
                pos,
                cs,
                is_neox=kv != "auto",
                q_pe=q_pe,
                q_nope=q_nope,
                q_out=q_out,
                q_scale=0.5,
                k_pe_out=k_pe_out,
                kv_cache_dtype=kv,
                scale=0.7 if kv == "fp8_e4m3" else None,
                backend=backend,
            )

        _agree(
            f"rope_set_mla_kv_buffer {kv}",
            (
                torch.empty(64, width, dtype=buf_dtype),
                torch.empty(n, h, nope + r, dtype=torch.float8_e4m3fn),
                torch.empty(n, r, dtype=torch.bfloat16),
            ),
            call_mla,
        )


def check_rope_streamed() -> None:
    """The rope ops' cache rows by streaming stores (payload per thread past the L2 size, every head on a
    line): bf16 and e4m3 K / V heads of 128 values, and MLA rows of 576 values whose rope part starts on
    a line (512 + 64) or inside one (500 + 76: the line straddling nope, and the fp8 rope part not
    streamed)."""
    from jitkv.ops.rope import cos_sin_table

    d, hq, hk = 128, 4, 8
    for kv, cache_dtype, es in (("auto", torch.bfloat16, 2), ("fp8_e4m3", torch.float8_e4m3fn, 1)):
        n = _streamed_rows(2 * hk * d * es)
        num_slots = 16 * (-(-2 * n // 16))
        q, k, v = rand((n, hq, d), torch.bfloat16), rand((n, hk, d), torch.bfloat16), rand((n, hk, d), torch.bfloat16)
        cs, pos, sm = cos_sin_table(64, d), torch.randint(0, 64, (n,)), _with_padding(n, num_slots)
        fp8 = dict(k_scale=0.3, v_scale=torch.rand(hk) + 0.5) if kv != "auto" else {}

        def call(backend, q_out, kc, vc):
            jitkv.rope_store_cache(
                q, k, v, kc, vc, sm, pos, cs, is_neox=True, q_out=q_out, kv_cache_dtype=kv, backend=backend, **fp8
            )

        bases = (
            torch.empty(n, hq, d, dtype=torch.bfloat16),
            *(_kv_cache("nhd", num_slots, hk, d, cache_dtype, 0) for _ in "kv"),
        )
        _agree(f"rope_store_cache streamed {kv} n={n}", bases, call)
    for kv, nope, r in (("auto", 512, 64), ("auto", 500, 76), ("fp8_e4m3", 512, 64), ("fp8_e4m3", 500, 76)):
        es = 2 if kv == "auto" else 1
        n = _streamed_rows(576 * es)
        num_slots = 2 * n
        kv_c, k_pe = rand((n, nope), torch.bfloat16), rand((n, r), torch.bfloat16)
        cs, pos, loc = cos_sin_table(64, r), torch.randint(0, 64, (n,)), _with_padding(n, num_slots)

        def call_mla(backend, buf):
            scale = 0.7 if kv != "auto" else None
            jitkv.rope_set_mla_kv_buffer(
                buf, loc, kv_c, k_pe, pos, cs, is_neox=False, kv_cache_dtype=kv, scale=scale, backend=backend
            )

        buf = torch.empty(num_slots, 576, dtype=torch.bfloat16 if kv == "auto" else torch.uint8)
        _agree(f"rope_set_mla_kv_buffer streamed {kv} {nope}+{r} n={n}", (buf,), call_mla)


CHECKS = (
    check_store_cache_copy,
    check_store_cache_fp8,
    check_fp8_every_16_bit_value,
    check_fp8_fp32_specials,
    check_fp8_quotients,
    check_mla_copy,
    check_mla_fp8,
    check_mla_gather,
    check_indexer,
    check_rope,
    check_rope_streamed,
)
