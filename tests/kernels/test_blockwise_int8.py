"""The plain-torch side of int8 block-quantized moments: zero_ext/update/blockwise_int8.py's maps, quantize /
dequantize (round trips, nearest codes, block tails, zeros, inf/nan), the tie bit in bit 7 of exp_avg_sq's codes,
the maps' C++ header, and tests/helpers/int8_reference.py's fused step (with param_remainders bitwise the fp32-master
step)."""

import runpy
from pathlib import Path

import pytest
import torch
from int8_reference import fused_adamw_int8_reference

from zero_ext.update import blockwise_int8 as q8
from zero_ext.update import master_split

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
MAPS = [pytest.param(q8.EXP_AVG_MAP, id="exp_avg"), pytest.param(q8.EXP_AVG_SQ_MAP, id="exp_avg_sq")]


def _bits(t):
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t.contiguous().view(torch.int16)


def _values(qmap, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(4 * torch.randn(n, generator=g))  # many decades per block
    return x.abs() if qmap.min() >= 0 else x


def _mantissa_bits_used(values: torch.Tensor) -> int:
    """The most mantissa bits any of the fp32 ``values`` uses (trailing zero bits not counted)."""
    low = values.abs().contiguous().view(torch.int32) & 0x7FFFFF
    return max(23 - int((m & -m).bit_length() - 1) if m else 0 for m in low.tolist())


def test_maps_are_minifloats_ending_at_one():
    """exp_avg: 0 at code 128, +-G[j] at 128 +- j, G[1..127] consecutive fp32 numbers of 3 mantissa bits with G[127]
    = 1, and -G[128] (> 1 in magnitude) at code 0; exp_avg_sq: 128 consecutive positive fp32 numbers of 3 mantissa
    bits up to 1 (no 0), so its codes fit in bits 0-6."""
    m, v = q8.EXP_AVG_MAP, q8.EXP_AVG_SQ_MAP
    assert m.numel() == 256 and v.numel() == 128
    assert bool((m[1:] > m[:-1]).all()) and bool((v[1:] > v[:-1]).all())
    assert float(m[128]) == 0.0 and float(m[255]) == 1.0 and float(m[1]) == -1.0 and float(m[0]) < -1.0
    assert torch.equal(m[129:], -m[1:128].flip(0))  # sign-magnitude: code 128 + j and 128 - j
    g = m[129:].contiguous().view(torch.int32)
    assert bool((g[1:] - g[:-1] == 1 << (23 - q8.EXP_AVG_MANTISSA_BITS)).all())  # consecutive minifloats
    h = v.contiguous().view(torch.int32)
    assert bool((h[1:] - h[:-1] == 1 << (23 - q8.EXP_AVG_SQ_MANTISSA_BITS)).all())
    assert float(v[-1]) == 1.0 and float(v[0]) > 0.0
    assert _mantissa_bits_used(m) <= q8.EXP_AVG_MANTISSA_BITS
    assert _mantissa_bits_used(v) <= q8.EXP_AVG_SQ_MANTISSA_BITS
    # thresholds are exact midpoints (a midpoint needs one mantissa bit more)
    for qmap in (m, v):
        q = qmap.double()
        assert torch.equal(q8.thresholds(qmap).double(), (q[:-1] + q[1:]) / 2)


@pytest.mark.parametrize("qmap", MAPS)
@pytest.mark.parametrize("n", [64, 1000, 4096 + 17])
def test_dequantize_then_quantize_is_the_identity(qmap, n):
    """What a checkpoint round trip does (it holds the moments dequantized): the same codes and scales back, for
    blocks whose largest-magnitude element is negative too (-1 is a value, so their absmax decodes exactly)."""
    codes, scales = q8.quantize(_values(qmap, n, seed=n), 64, qmap)
    codes2, scales2 = q8.quantize(q8.dequantize(codes, scales, 64, qmap), 64, qmap)
    assert torch.equal(codes, codes2) and torch.equal(scales, scales2)
    if qmap.min() < 0:  # blocks led by a negative element: -1 is a value, so their absmax decodes exactly
        x = _values(qmap, n, seed=n)
        x[::64] = -2.0 * x.abs().max()
        codes, scales = q8.quantize(x, 64, qmap)
        codes2, scales2 = q8.quantize(q8.dequantize(codes, scales, 64, qmap), 64, qmap)
        assert torch.equal(codes, codes2) and torch.equal(scales, scales2)


def test_header_matches_the_maps():
    """csrc/fused_adamw_int8_maps.h holds exactly these fp32 values: it is scripts/gen_int8_maps_header.py's output,
    byte for byte (the header's first lines name the command that regenerates it)."""
    repo = Path(__file__).resolve().parents[2]
    generator = runpy.run_path(str(repo / "scripts" / "gen_int8_maps_header.py"))
    assert (repo / "csrc" / "fused_adamw_int8_maps.h").read_text() == generator["cpp_maps_header"]()


@pytest.mark.parametrize("qmap", MAPS)
def test_codes_are_the_nearest_map_values(qmap):
    x = _values(qmap, 4096)
    codes, scales = q8.quantize(x, 64, qmap)
    y = x / scales.repeat_interleave(64)
    dist = (qmap[None, :].double() - y[:, None].double()).abs()
    idx = codes.view(torch.uint8).long()
    chosen = dist.gather(1, idx[:, None]).squeeze(1)
    assert bool((chosen <= dist.min(dim=1).values).all())


@pytest.mark.parametrize("qmap", MAPS)
@pytest.mark.parametrize("block", [16, 64, 256, 2048])
@pytest.mark.parametrize("n", [1, 7, 64, 97, 1025, 4096 + 13])
def test_round_trip_error_within_half_a_gap(qmap, block, n):
    """|dequantize(quantize(x)) - x| <= the map's largest distance to a value in its range, times the block's
    scale; block tails (n not a multiple of block) have their own absmax."""
    x = _values(qmap, n, seed=n)
    codes, scales = q8.quantize(x, block, qmap)
    assert codes.dtype == torch.int8 and codes.numel() == n
    assert scales.dtype == torch.float32 and scales.numel() == -(-n // block)
    ref_scales = torch.stack([x[i : i + block].abs().max() for i in range(0, n, block)])
    torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0)
    lo = -1.0 if qmap.min() < 0 else 0.0
    worst = max(float((qmap[1:] - qmap[:-1]).max()) / 2, float(qmap[0]) - lo, 1.0 - float(qmap[-1]))
    err = (q8.dequantize(codes, scales, block, qmap) - x).abs()
    assert bool((err <= (worst + 1e-6) * scales.repeat_interleave(block)[:n]).all())  # + fp32 rounding


@pytest.mark.parametrize("qmap", MAPS)
def test_zeros(qmap):
    """An all-zero block has scale 0 and dequantizes to zeros (whatever its codes); zero-initialised state
    (codes 0, scales 0) is the zero moment."""
    x = torch.zeros(200)
    x[130:140] = _values(qmap, 10)
    codes, scales = q8.quantize(x, 64, qmap)
    assert scales[0] == 0 and scales[1] == 0 and scales[2] > 0 and scales[3] == 0
    back = q8.dequantize(codes, scales, 64, qmap)
    assert bool((back[:128] == 0).all()) and bool((back[192:] == 0).all())
    zero_state = q8.dequantize(torch.zeros(200, dtype=torch.int8), torch.zeros(4), 64, qmap)
    assert bool((zero_state == 0).all())


@pytest.mark.parametrize("qmap", MAPS)
def test_nan_and_inf_poison_their_block_only(qmap):
    """Stated behaviour: a NaN makes its block's scale the canonical NaN (0x7FC00000) and the block dequantizes to
    NaN everywhere; an inf (no NaN) makes the scale inf and no element of the block finite; other blocks keep
    their values."""
    x = _values(qmap, 256)
    x[70] = float("nan")
    x[140] = float("inf")
    codes, scales = q8.quantize(x, 64, qmap)
    assert int(_bits(scales)[1]) == 0x7FC00000 and float(scales[2]) == float("inf")
    back = q8.dequantize(codes, scales, 64, qmap)
    assert bool(back[64:128].isnan().all()) and not bool(back[128:192].isfinite().any())
    clean_codes, clean_scales = q8.quantize(x[:64], 64, qmap)
    assert torch.equal(codes[:64], clean_codes) and torch.equal(scales[:1], clean_scales)
    assert bool(back[192:].isfinite().all())


def test_exp_avg_sq_codes_leave_bit_7_free():
    x = _values(q8.EXP_AVG_SQ_MAP, 10000)
    x[::97] = 0
    codes, _ = q8.quantize(x, 64, q8.EXP_AVG_SQ_MAP)
    assert int(codes.view(torch.uint8).max()) <= 127 and int(codes.min()) >= 0
    with_tie = (codes.view(torch.uint8) | 0x80).view(torch.int8)
    _, scales = q8.quantize(x, 64, q8.EXP_AVG_SQ_MAP)
    assert torch.equal(q8.dequantize(with_tie, scales, 64, q8.EXP_AVG_SQ_MAP),
                       q8.dequantize(codes, scales, 64, q8.EXP_AVG_SQ_MAP))  # fmt: skip
    assert bool(master_split.tie_of(with_tie).all()) and not bool(master_split.tie_of(codes).any())


def test_split_join_rne_is_exact_and_rounds_to_nearest_even():
    """SPEC A on a sample of patterns (every exponent, the tie patterns 0x8000 with bit 16 0 and 1): join(split)
    gives the master back, the param is master.to(bfloat16), tie only where the master was a tie rounded down."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (1 << 18,), generator=g, dtype=torch.int64)
    ties = (bits & ~0x1FFFF) | 0x8000  # bit 16 = 0: RNE rounds down
    odd_ties = ties | 0x10000  # bit 16 = 1: RNE rounds up
    bits = torch.cat([bits, ties, odd_ties])
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    master = bits.view(torch.float32)
    finite = ~master.isnan()
    param, rem, tie = master_split.split(master)
    assert torch.equal(_bits(param)[finite], _bits(master.to(torch.bfloat16))[finite])
    assert torch.equal(_bits(master_split.join(param, rem, tie))[finite], bits[finite])
    n = 1 << 18
    assert bool(tie[n : 2 * n][finite[n : 2 * n]].all()) and not bool(tie[2 * n :][finite[2 * n :]].any())
    assert bool(master_split.join(param, rem, tie)[~finite].isnan().all())


def _state(n, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    m_codes, m_scales = q8.quantize(torch.randn(n, generator=g) * 1e-2, block, q8.EXP_AVG_MAP)
    v_codes, v_scales = q8.quantize(torch.rand(n, generator=g) * 1e-4, block, q8.EXP_AVG_SQ_MAP)
    return master, m_codes, m_scales, v_codes, v_scales


def test_reference_step_is_dequantize_update_requantize():
    """One reference step equals: dequantize, fp32 AdamW (zero_ext.ops.fused_adamw_), quantize with the new
    absmax; param_out is the new master rounded to nearest even."""
    n, block = 1000, 64
    master, mc, ms, vc, vs = _state(n, block)
    grad = torch.randn(n)
    m, v, p = q8.dequantize(mc, ms, block), q8.dequantize(vc, vs, block, q8.EXP_AVG_SQ_MAP), master.clone()
    from zero_ext import ops

    ops.fused_adamw_(p, grad, m, v, step=3, **HP)
    out = torch.empty(n, dtype=torch.bfloat16)
    fused_adamw_int8_reference(master, grad, mc, ms, vc, vs, step=3, param_out=out, block=block, **HP)
    assert torch.equal(master, p) and torch.equal(out, p.to(torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip((mc, ms), q8.quantize(m, block)))
    assert all(torch.equal(a, b) for a, b in zip((vc, vs), q8.quantize(v, block, q8.EXP_AVG_SQ_MAP)))


def test_reference_with_remainders_is_bitwise_the_fp32_master_run():
    """param_remainders with int8 moments: the joined master, the moments' codes (bit 7 aside) and scales are
    bitwise those of the fp32-master run at every step; the param is the master rounded to nearest even. Masters
    on bf16 ties (low 16 bits 0x8000) are planted so the tie bit is exercised."""
    n, block = 4096 + 5, 64
    master, mc, ms, vc, vs = _state(n, block, seed=1)
    master = (_bits(master) & ~0xFFFF | 0x8000).view(torch.float32)  # every master a tie to start with
    param, rem, tie = master_split.split(master)
    vc2 = (vc.view(torch.uint8) | (tie.to(torch.uint8) << 7)).view(torch.int8)
    mc2, ms2, vs2 = mc.clone(), ms.clone(), vs.clone()
    assert bool(tie.any())
    for step in range(1, 6):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(step))
        fused_adamw_int8_reference(master, grad, mc, ms, vc, vs, step=step, block=block, **HP)
        fused_adamw_int8_reference(param, grad, mc2, ms2, vc2, vs2, step=step, remainder=rem, block=block, **HP)
        assert torch.equal(_bits(master_split.join(param, rem, master_split.tie_of(vc2))), _bits(master))
        assert torch.equal(_bits(param), _bits(master.to(torch.bfloat16)))
        assert torch.equal(vc2.view(torch.uint8) & 0x7F, vc.view(torch.uint8))
        assert torch.equal(mc2, mc) and torch.equal(ms2, ms) and torch.equal(vs2, vs)


def test_reference_found_inf_changes_nothing():
    master, mc, ms, vc, vs = _state(300, 64)
    before = [t.clone() for t in (master, mc, ms, vc, vs)]
    fused_adamw_int8_reference(master, torch.randn(300), mc, ms, vc, vs, step=1, found_inf=torch.ones(()), **HP)
    assert all(torch.equal(a, b) for a, b in zip(before, (master, mc, ms, vc, vs)))


def test_reference_writes_the_tie_bit_of_a_master_that_stays_a_tie():
    """lr = 0 and weight_decay = 0 keep every master: masters planted on ties that RNE rounds down come back with
    bit 7 set in every exp_avg_sq code and join to themselves (random masters are ties in ~2^-16 of elements)."""
    n, block = 64 * 3 + 7, 64
    master, mc, ms, vc, vs = _state(n, block, seed=2)
    master = (_bits(master) & ~0x1FFFF | 0x8000).view(torch.float32)
    param, rem, tie = master_split.split(master)
    assert bool(tie.all())
    vc = (vc.view(torch.uint8) | 0x80).view(torch.int8)
    hp = dict(HP, lr=0.0, weight_decay=0.0)
    fused_adamw_int8_reference(param, torch.randn(n), mc, ms, vc, vs, step=1, remainder=rem, block=block, **hp)
    assert bool(master_split.tie_of(vc).all())
    assert torch.equal(_bits(master_split.join(param, rem, master_split.tie_of(vc))), _bits(master))
