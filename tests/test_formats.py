"""kt_ops.formats: the packed layouts of docs/formats.md, the packers, loaders and reference.

* Layout: hand-made codes land at the documented byte / nibble / bit (literal
  offsets worked out by hand from docs/formats.md, not recomputed by a formula).
* Round trips: codes -> planes -> codes; dense -> quantize -> dequantize within
  each format's error bound.
* Agreement with independent decoders: ``gguf.quants.dequantize`` (exact),
  ``torch.float8_e4m3fn`` (exact), an E2M1 table and transformers' MXFP4
  dequantizer (exact).
* Odd shapes (N % 16, K % 32) and zero padding; every bad input raises a
  ValueError naming the argument.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kt_ops.formats import (
    E2M1_VALUES,
    FORMATS,
    GGUF_FORMATS,
    IQ4NL_VALUES,
    PackedProjection,
    dequantize_weights,
    format_spec,
    from_fp8,
    from_gguf,
    from_mxfp4,
    pack_codes,
    pack_group_params,
    pack_kquant_scales,
    quantize_activations_q8,
    quantize_gguf_raw,
    quantize_weights,
    unpack_codes,
    unpack_group_params,
    unpack_kquant_scales,
)
from kt_ops.formats.gguf_blocks import _pack_scale_min_k4, ternary_as_q2_k

gguf = pytest.importorskip("gguf")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kquant_head(
    fmt: str, E: int, N: int, S: int, d: float, sc: int, dmin=0.0, m=0
) -> torch.Tensor:
    """GGUF scale bytes per row and super-block (q4_K/q5_K ``d, dmin, scales[12]``; q6_K,
    q3_K ``int8 scales[16], d``; q2_K ``scales[16], d, dmin``; IQ4_XS ``int8 scales[8], d``)
    with one ``d`` (fp16) and sub-scale ``sc`` (and ``dmin``, min ``m``)."""
    d16 = torch.tensor([d], dtype=torch.float16).view(torch.uint8)
    dm16 = torch.tensor([dmin], dtype=torch.float16).view(torch.uint8)
    if fmt in ("q6_k", "q3_k", "iq4_xs"):
        subs = 8 if fmt == "iq4_xs" else 16
        one = torch.cat([torch.full((subs,), sc, dtype=torch.int8).view(torch.uint8), d16])
    elif fmt == "q2_k":
        one = torch.cat([torch.full((16,), sc | (m << 4), dtype=torch.uint8), d16, dm16])
    else:
        sc6 = np.full((8,), sc, dtype=np.uint8)
        m6 = np.full((8,), m, dtype=np.uint8)
        packed = torch.from_numpy(_pack_scale_min_k4(sc6, m6))
        one = torch.cat([d16, dm16, packed])
    return one.expand(E, N, S, one.numel()).contiguous()


def _packed_codes(codes: torch.Tensor, fmt: str, scale: float = 1.0, zero: float = 0.0):
    """A PackedProjection of ``fmt`` holding ``codes`` with constant scales (and zeros)."""
    spec = format_spec(fmt)
    E, N, K = codes.shape
    gs = spec.default_group_size
    if spec.is_kquant:  # d = scale, sc = 1 (and dmin = zero, m = 1)
        head = _kquant_head(fmt, E, N, K // 256, scale, 1, zero, 1)
        s = pack_kquant_scales(head, fmt)
        return PackedProjection(pack_codes(codes, spec.bits), s, None, fmt, gs, N, K).validate()
    g = 1 if gs == 0 else -(-K // 32) * 32 // gs
    s = pack_group_params(torch.full((E, N, g), scale), spec.scale_dtype)
    z = pack_group_params(torch.full((E, N, g), zero), spec.scale_dtype) if spec.has_zeros else None
    return PackedProjection(pack_codes(codes, spec.bits), s, z, fmt, gs, N, K).validate()


# ---------------------------------------------------------------------------------- registry


def test_registry_matches_the_table_of_docs_formats_md():
    assert FORMATS == (
        "bf16",
        "int8",
        "int4",
        "fp8",
        "fp8_channel",
        "mxfp8",
        "mxfp4",
        "nvfp4",
        "q8_0",
        "q4_0",
        "q4_1",
        "q5_0",
        "q5_1",
        "q2_k",
        "q3_k",
        "q4_k",
        "q5_k",
        "q6_k",
        "iq4_nl",
        "iq4_xs",
        "iq1_s",
        "iq1_m",
        "iq2_xxs",
        "iq2_xs",
        "iq2_s",
        "iq3_xxs",
        "iq3_s",
    )
    table = {  # format: (bits, scale dtype, zeros, groups, activations, bits/weight)
        "bf16": (16, None, False, (0,), "fp32", 16.0),
        "int8": (8, torch.float32, False, (0,), "q8", 8.0),
        "int4": (4, torch.float16, True, (0, 32, 64, 128), "q8", 4.125),
        "fp8": (8, torch.float32, False, (128,), "fp32", 8.0),
        "fp8_channel": (8, torch.float32, False, (0,), "fp32", 8.0),
        "mxfp8": (8, torch.uint8, False, (32,), "fp32", 8.25),
        "mxfp4": (4, torch.uint8, False, (32,), "q8", 4.25),
        "nvfp4": (4, torch.float32, False, (16,), "q8", 6.0),
        "q8_0": (8, torch.float16, False, (32,), "q8", 8.5),
        "q4_0": (4, torch.float16, False, (32,), "q8", 4.5),
        # q4_1 / q5_1: GGUF's min m as an fp16 zero per 32 (W = d*q - (-m)); GGUF's sizes
        "q4_1": (4, torch.float16, True, (32,), "q8", 5.0),
        "q5_0": (5, torch.float16, False, (32,), "q8", 5.5),
        "q5_1": (5, torch.float16, True, (32,), "q8", 6.0),
        # q2_k / q3_k: 2- and 3-bit codes in the 4-bit plane, records of 320 / 288 bytes
        "q2_k": (2, torch.uint8, False, (16,), "q8", 2.625),
        "q3_k": (3, torch.uint8, False, (16,), "q8", 3.5625),
        # GGUF's own sizes: 4.5, 5.5 and 6.5625 bits per weight (scale records)
        "q4_k": (4, torch.uint8, False, (32,), "q8", 4.5),
        "q5_k": (5, torch.uint8, False, (32,), "q8", 5.5),
        "q6_k": (6, torch.uint8, False, (16,), "q8", 6.5625),
        # IQ4_NL: q4_0's layout through a table; IQ4_XS: int8 sub-scales (GGUF: 6-bit, 4.25)
        "iq4_nl": (4, torch.float16, False, (32,), "q8", 4.5),
        "iq4_xs": (4, torch.uint8, False, (32,), "q8", 4.3125),
    }
    for name, (bits, sdt, zeros, groups, act, bpw) in table.items():
        s = format_spec(name)
        assert (s.name, s.bits, s.scale_dtype, s.has_zeros) == (name, bits, sdt, zeros)
        assert (s.group_sizes, s.activation, s.bits_per_weight) == (groups, act, bpw)
        assert s.default_group_size in s.group_sizes
        assert s.bits_per_weight_for(s.default_group_size) == bpw
    assert format_spec("int8").signed and format_spec("q8_0").signed
    assert not format_spec("q4_0").signed and format_spec("mxfp4").lut
    tables = {f: format_spec(f).code_table for f in FORMATS if format_spec(f).lut}
    assert tables == {"mxfp4": "e2m1", "nvfp4": "e2m1", "iq4_nl": "iq4nl", "iq4_xs": "iq4nl"}
    # IQ4_NL's values are signed bytes: the kernels multiply them as 8-bit signed codes.
    assert format_spec("iq4_nl").signed and format_spec("iq4_xs").signed
    assert IQ4NL_VALUES == tuple(gguf.quants.IQ4_NL.kvalues)
    assert format_spec("int4").zeros_optional and not format_spec("q4_k").has_zeros
    assert format_spec("q4_1").zeros_required and format_spec("q5_1").zeros_required
    kq = {f: (format_spec(f).scale_record_bytes, format_spec(f).record_mins) for f in FORMATS}
    assert {f: v for f, v in kq.items() if v != (0, False)} == {
        "q2_k": (320, True),
        "q3_k": (288, False),
        "q4_k": (256, True),
        "q5_k": (256, True),
        "q6_k": (288, False),
        "iq4_xs": (160, False),
    }
    # GGUF's block sizes: 144, 176, 210 bytes per 256 weights.
    for fmt, gguf_bytes in (("q4_k", 144), ("q5_k", 176), ("q6_k", 210)):
        assert format_spec(fmt).bits_per_weight == 8 * gguf_bytes / 256
    assert format_spec("int4").bits_per_weight_for(32, zeros=True) == 5.0
    # The implicit zeros: q3_k's 3-bit codes sit at q + 4 (ggml: q - (high ? 0 : 4)).
    offsets = {f: format_spec(f).zero_offset for f in FORMATS if format_spec(f).zero_offset}
    assert offsets == {
        "int4": 8, "mxfp4": 12, "nvfp4": 12, "q4_0": 8, "q5_0": 16, "q3_k": 4, "q6_k": 32
    }  # fmt: skip
    with pytest.raises(ValueError, match="unknown weight_format 'tq2_0'.*bf16, int8"):
        format_spec("tq2_0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        format_spec("int8").bits = 4


def test_gguf_block_types_are_rows_of_the_table():
    """GGUF-ness is one field of the spec rows; every list of GGUF types derives from it."""
    gguf_types = [f for f in FORMATS if format_spec(f).is_gguf]
    assert gguf_types == [
        "mxfp4", "nvfp4", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k",
        "q5_k", "q6_k", "iq4_nl", "iq4_xs", "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s",
        "iq3_xxs", "iq3_s",
    ]  # fmt: skip
    assert GGUF_FORMATS == tuple(gguf_types)
    for f in FORMATS:
        block = format_spec(f).gguf_block
        if block is None:
            continue
        assert block == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[f.upper()]], f
        # q3_k / iq4_xs: their 6-bit scales as int8 in the records; nvfp4: fp32 block scales
        if f in ("q3_k", "iq4_xs", "nvfp4"):  # more than GGUF's size
            assert format_spec(f).bits_per_weight > 8 * block[1] / block[0], f
        else:
            assert format_spec(f).bits_per_weight == 8 * block[1] / block[0], f
    from kt_ops.loaders.gguf_file import GGUF_NATIVE_FORMATS

    assert list(GGUF_NATIVE_FORMATS.values()) == gguf_types
    assert all(t.name.lower() == f for t, f in GGUF_NATIVE_FORMATS.items())


# ---------------------------------------------------------------------------- byte layouts


def test_8bit_code_lands_at_documented_byte():
    # n = 17 -> block nb = 1, row r = 1; k = 13 -> word c = 3, byte j = 1:
    # offset 64*3 + 4*1 + 1 = 197 of block 1. Signed -3 is stored as 0xFD.
    q = torch.zeros(1, 20, 40, dtype=torch.int16)
    q[0, 17, 13] = -3
    q[0, 2, 6] = 0x5A  # nb 0, r 2, c 1, j 2: 64 + 8 + 2 = 74
    w = pack_codes(q, 8)
    assert w.shape == (1, 2, 64 * 16) and w.dtype == torch.uint8
    assert w[0, 1, 197] == 0xFD and w[0, 0, 74] == 0x5A
    assert int((w != 0).sum()) == 2


def test_4bit_codes_land_in_documented_nibbles():
    # k = 13: word c = 1 (k 8..15), high half (k 12..15), byte j = 1: offset 64 + 4*r + 1.
    # k = 6: word 0, high half, j = 2; k = 33: word 4, low half, j = 1.
    q = torch.zeros(1, 20, 40, dtype=torch.uint8)
    q[0, 17, 13] = 5  # nb 1, r 1 -> byte 69 high nibble
    q[0, 2, 6] = 9  # nb 0, r 2 -> byte 10 high nibble
    q[0, 0, 33] = 12  # nb 0, r 0 -> byte 256 + 1 = 257 low nibble
    q[0, 0, 1] = 3  # nb 0, r 0 -> byte 1 low nibble
    w = pack_codes(q, 4)
    assert w.shape == (1, 2, 64 * 8)
    assert w[0, 1, 69] == 0x50 and w[0, 0, 10] == 0x90 and w[0, 0, 257] == 0x0C
    assert w[0, 0, 1] == 0x03
    assert int((w != 0).sum()) == 4


def test_5bit_high_plane_bit_positions():
    # K = 64 = Kp: low plane 8 * 64 = 512 bytes, high plane 2 words of 64 bytes.
    # q[3, 45] = 16: k 45 -> high word 1, h = (45 - 32) // 4 = 3, j = 1, row 3:
    # byte 512 + 64 + 12 + 1 = 589, bit 3. q[3, 2] = 31: also low nibble 15 at
    # byte 4*3 + 2 = 14 (low half) and high bit h = 0 of byte 512 + 12 + 2 = 526.
    q = torch.zeros(1, 16, 64, dtype=torch.uint8)
    q[0, 3, 45] = 16
    q[0, 3, 2] = 31
    w = pack_codes(q, 5)
    assert w.shape == (1, 1, 640)
    assert w[0, 0, 589] == 0x08 and w[0, 0, 526] == 0x01 and w[0, 0, 14] == 0x0F
    assert int((w != 0).sum()) == 3
    q[0, 3, 2] = 0
    q[0, 3, 63] = 16  # h = 31 // 4 = 7, j = 3: byte 512 + 64 + 12 + 3 = 591, bit 7
    assert pack_codes(q, 5)[0, 0, 591] == 0x80


def test_6bit_high_plane_bit_positions():
    # K = 32: low plane 256 bytes, high plane 2 words (k 0..15, 16..31).
    # q[2, 27] = 48: word 1, h = (27 - 16) // 4 = 2, j = 3, row 2: byte 256 + 64 + 8 + 3
    # = 331, bits 4, 5 -> 0x30. q[2, 27] = 63 also sets the low nibble of byte
    # 64*3 + 8 + 3 = 203 (k 24..27 is the low half of word 3).
    q = torch.zeros(1, 16, 32, dtype=torch.uint8)
    q[0, 2, 27] = 48
    w = pack_codes(q, 6)
    assert w.shape == (1, 1, 384)
    assert w[0, 0, 331] == 0x30 and int((w != 0).sum()) == 1
    q[0, 2, 27] = 63
    q[0, 0, 1] = 0x10  # word 0, h 0, j 1, row 0: byte 256 + 1, bits 0, 1 -> 0x01
    w = pack_codes(q, 6)
    assert w[0, 0, 331] == 0x30 and w[0, 0, 203] == 0x0F and w[0, 0, 257] == 0x01
    assert int((w != 0).sum()) == 3


def test_reference_dequantizer_reads_hand_written_bytes():
    # One non-zero byte per plane, written by hand, decoded by dequantize_weights.
    w = torch.zeros(1, 1, 2560, dtype=torch.uint8)  # q5_k, 16 x 256: low plane 2048 bytes
    w[0, 0, 69] = 0x50  # row 1, k = 8 + 4 + 1 = 13, low bits 5
    w[0, 0, 2048 + 77] = 0x08  # row 3, k = 32 + 4*3 + 1 = 45, bit 4
    w[0, 0, 20 * 64 + 4 + 1] = 0x04  # row 1, k = 160 + 1 (sub-block 5), code 4
    # Scale record (docs/formats.md): d fp16 [16] | dmin fp16 [16] | GGUF scales[12][16 rows].
    s = torch.zeros(1, 1, 1, 256, dtype=torch.uint8)
    s[0, 0, 0, 1:32:2] = 0x3C  # d = 1.0 (fp16 0x3C00) for every row
    s[0, 0, 0, 32 + 2 * 5 + 1] = 0x3C  # dmin = 1.0 for row 5
    s[0, 0, 0, 64 : 64 + 32] = 1  # scales[0], scales[1]: sc_0 = sc_1 = 1, every row
    s[0, 0, 0, 64 + 16 * 4 + 5] = 2  # scales[4] of row 5: m_0 = 2 -> W[5, 0:32] = -2
    s[0, 0, 0, 64 + 16 * 9 + 1] = 0x03  # scales[9] of row 1: sc_5 = 3 (low nibble)
    p = PackedProjection(w, s, None, "q5_k", 32, 16, 256)
    d = dequantize_weights(p)
    assert d[0, 1, 13] == 5 and d[0, 3, 45] == 16 and d[0, 1, 161] == 12
    assert (d[0, 5, :32] == -2).all() and int((d != 0).sum()) == 3 + 32
    # q6_k: implicit zero 32, so code 0 reads -32 and 48 reads 16.
    w6 = torch.zeros(1, 1, 3072, dtype=torch.uint8)  # 16 x 256, low plane 2048 bytes
    w6[0, 0, 2048 + 64 + 2 * 4 + 3] = 0x30  # row 2, k 16 + 4*2 + 3 = 27, bits 4, 5
    s6 = torch.zeros(1, 1, 1, 288, dtype=torch.uint8)  # d fp16 [16] | int8 scales[16][16 rows]
    s6[0, 0, 0, 1:32:2] = 0x38  # d = 0.5
    s6[0, 0, 0, 32:] = 1  # sc_j = 1
    s6[0, 0, 0, 32 + 16 * 3 + 4] = 0xFE  # row 4, sub-block 3 (k 48..63): sc = -2
    p6 = PackedProjection(w6, s6, None, "q6_k", 16, 16, 256)
    d6 = dequantize_weights(p6)
    assert d6[0, 2, 27] == 8.0 and (d6[0, 4, 48:64] == 32.0).all()
    assert int((d6 != -16.0).sum()) == 1 + 16
    # fp8: packed[e, nb, k, r] = bits(W8[16nb + r, k]); 0x38 = 1.0, 0xC0 = -2.0
    w8 = torch.zeros(1, 2, 32, 16, dtype=torch.uint8)
    w8[0, 1, 9, 3] = 0x38  # n = 19, k = 9
    w8[0, 0, 0, 0] = 0xC0
    p8 = PackedProjection(w8, torch.tensor([[[3.0]]]), None, "fp8", 128, 20, 32)
    d8 = dequantize_weights(p8)
    assert d8[0, 19, 9] == 3.0 and d8[0, 0, 0] == -6.0 and int((d8 != 0).sum()) == 2


# ----------------------------------------------------------------------- codes round trip


@settings(max_examples=20, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 5, 6, 8]),
    e=st.integers(1, 2),
    n=st.integers(1, 40),
    k=st.integers(1, 100),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_codes_round_trip(bits, e, n, k, seed):
    g = _gen(seed)
    if bits == 8:
        q = torch.randint(-128, 128, (e, n, k), generator=g)
    else:
        q = torch.randint(0, 1 << bits, (e, n, k), generator=g)
    pad = 7 if bits >= 3 else 2
    w = pack_codes(q, bits, pad_code=pad)
    kp = -(-k // 32) * 32
    assert w.shape == (e, -(-n // 16), 16 * kp * bits // 8)
    assert torch.equal(unpack_codes(w, bits, n, k, signed=bits == 8), q.to(torch.int32))
    # The padding (rows n.., columns k..) holds the pad code.
    full = unpack_codes(w, bits, -(-n // 16) * 16, kp)
    assert torch.equal(full[:, :n, :k], q.to(torch.int32) & 0xFF)
    assert int((full != pad).sum()) == int((q.to(torch.int32) & 0xFF != pad).sum())


@pytest.mark.parametrize(
    "fmt", ["int8", "int4", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]
)
def test_reference_decoder_agrees_with_the_packer(fmt):
    # The packer (reshape/permute) and the reference dequantizer (index arithmetic)
    # are written independently; unit scales make W the code (minus the implicit zero).
    spec = format_spec(fmt)
    n, k = 21, 256 if fmt != "int4" else 128
    if spec.code_table == "iq4nl":  # W = the table's value of each 4-bit code
        q = torch.randint(0, 16, (2, n, k), generator=_gen(1))
        d = dequantize_weights(_packed_codes(q, fmt))
        assert torch.equal(d, torch.tensor(IQ4NL_VALUES, dtype=torch.float32)[q])
        return
    lo = -127 if spec.signed else 0
    q = torch.randint(lo, 1 << min(spec.bits, 7), (2, n, k), generator=_gen(1))
    d = dequantize_weights(_packed_codes(q, fmt))
    implicit = 0 if (spec.signed or spec.has_zeros or spec.record_mins) else spec.zero_offset
    assert implicit == {"q3_k": 4, "q6_k": 32}.get(fmt, 0)  # int4 here: zeros of 0
    assert torch.equal(d, (q - implicit).float())


# ------------------------------------------------------------------ quantize / dequantize


def test_bf16_is_pack_weights():
    w = torch.randn(2, 21, 45, generator=_gen(2))
    p = quantize_weights(w, "bf16")
    assert p.scales is None and p.zeros is None and p.weight.dtype == torch.bfloat16
    assert p.weight.shape == (2, 2, 23, 16, 2) and (p.n, p.k, p.group_size) == (21, 45, 0)
    assert torch.equal(dequantize_weights(p), w.bfloat16().float())


def test_int8_per_channel_round_to_nearest_even():
    w = torch.randn(2, 21, 45, generator=_gen(3), dtype=torch.float64)  # any float dtype
    w[0, 0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # amax 127 -> scale 1: ties to even
    w[1, 3] = 0.0  # an all-zero row
    p = quantize_weights(w, "int8")
    assert p.scales.shape == (2, 2, 1, 16) and p.scales.dtype == torch.float32
    assert p.weight.shape == (2, 2, 64 * 16) and p.group_size == 0
    d = dequantize_weights(p)
    assert d[0, 0, :4].tolist() == [127.0, 0.0, 2.0, -2.0]
    assert torch.equal(d[1, 3], torch.zeros(45))
    wf = w.float()
    scale = wf.abs().amax(-1, keepdim=True) / 127
    assert ((d - wf).abs() <= scale / 2 * (1 + 1e-6)).all()
    codes = unpack_codes(p.weight, 8, 21, 45, signed=True)
    assert torch.equal(codes.float(), torch.round(wf / torch.where(scale > 0, scale, 1)))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_symmetric(group_size):
    E, N, K = 2, 19, 256
    w = torch.randn(E, N, K, generator=_gen(4)) * 0.02
    w[1, 5, :group_size] = 0.0  # an all-zero group
    p = quantize_weights(w, "int4", group_size=group_size)
    G = K // group_size
    assert p.zeros is None and p.scales.shape == (E, 2, G, 16) and p.scales.dtype == torch.float16
    wg = w.view(E, N, G, group_size)
    scale16 = (wg.abs().amax(-1) / 7).half()
    assert torch.equal(p.scales[:, :, :, :16].transpose(2, 3).reshape(E, 32, G)[:, :N], scale16)
    s = scale16.float().unsqueeze(-1)
    d = dequantize_weights(p).view(E, N, G, group_size)
    assert ((d - wg).abs() <= s / 2 * (1 + 1e-5)).all()
    assert torch.equal(d[1, 5, 0], torch.zeros(group_size))
    q = unpack_codes(p.weight, 4, N, K).view(E, N, G, group_size).float()
    expect = (torch.round(wg / torch.where(s > 0, s, 1)) + 8).clamp(0, 15)
    assert torch.equal(q, torch.where(s > 0, expect, 8.0))


def test_int4_asymmetric_zero_point():
    E, N, K, gs = 2, 19, 128, 32
    w = torch.randn(E, N, K, generator=_gen(5)) * 0.02 + 0.01
    w[0, 0, :gs] = torch.linspace(0.1, 0.2, gs)  # all positive: range widened to [0, max]
    w[0, 1, :gs] = -0.3  # constant negative group
    p = quantize_weights(w, "int4", group_size=gs, symmetric=False)
    assert p.zeros is not None and p.zeros.dtype == torch.float16
    assert p.zeros.shape == p.scales.shape == (E, 2, K // gs, 16)
    wg = w.view(E, N, K // gs, gs)
    mn, mx = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    s = ((mx - mn) / 15).half().float()
    z = torch.round(-mn / s).clamp(0, 15)
    zeros = p.zeros.transpose(2, 3).reshape(E, 32, -1)[:, :N].float()
    assert torch.equal(zeros, (s * z).half().float())
    d = dequantize_weights(p).view(E, N, K // gs, gs)
    bound = s * (0.5 + 16 * 2.0**-11) + zeros.abs() * 2.0**-11
    assert ((d - wg).abs() <= bound.unsqueeze(-1)).all()
    assert (d[0, 1, 0] - -0.3).abs().max() <= 0.3 * 2.0**-10


def test_fp8_quantizer_matches_torch_e4m3_conversion():
    E, N, K = 2, 130, 200  # crosses the 128-row/col block edges; K % 32 != 0
    w = torch.randn(E, N, K, generator=_gen(6))
    w[:, :128, :128] *= 1e-3  # one block much smaller than its neighbours
    w[1, 128:, 128:] = 0.0  # an all-zero block
    p = quantize_weights(w, "fp8")
    assert p.weight.shape == (E, 9, 224, 16) and p.scales.shape == (E, 2, 2)
    assert p.group_size == 128
    wp = torch.nn.functional.pad(w, (0, 56, 0, 126)).view(E, 2, 128, 2, 128)
    scale = wp.abs().amax(dim=(2, 4)) / 448
    assert torch.equal(p.scales, scale)
    s = scale[:, torch.arange(N) // 128][:, :, torch.arange(K) // 128]
    x = torch.where(s > 0, w / torch.where(s > 0, s, 1), 0.0)
    expect = x.to(torch.float8_e4m3fn).float() * s
    d = dequantize_weights(p)
    assert torch.equal(d, expect)
    # 3 mantissa bits: relative error 2^-4 for normals, 2^-10 * scale for subnormals.
    assert ((d - w).abs() <= torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)).all()


def test_from_fp8_keeps_bits_and_scales():
    E, N, K = 2, 21, 45
    bits = torch.randint(0, 256, (E, N, K), generator=_gen(7), dtype=torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    scale_inv = torch.rand(E, 1, 1, generator=_gen(8)) + 0.5
    for weight in (bits, bits.view(torch.float8_e4m3fn)):
        p = from_fp8(weight, scale_inv.bfloat16())
        assert p.scales.dtype == torch.float32
        assert torch.equal(p.scales, scale_inv.bfloat16().float())
        ref = bits.view(torch.float8_e4m3fn).float() * scale_inv.bfloat16().float()
        assert torch.equal(dequantize_weights(p), ref)
    # padding: the same tensors read as the padded [16*NB, Kp] hold zeros there
    full = dequantize_weights(PackedProjection(p.weight, p.scales, None, "fp8", 128, 32, 64))
    assert int((full[:, N:] != 0).sum()) == 0 and int((full[:, :, K:] != 0).sum()) == 0


def _e2m1_nearest(v: np.ndarray) -> np.ndarray:
    """Independent E2M1 rounding: brute-force nearest table value, ties to the even code."""
    table = np.array(E2M1_VALUES[:8])
    dist = np.abs(np.abs(v)[..., None] - table)
    best = dist.min(-1, keepdims=True)
    cand = np.where(dist == best, np.arange(8), 99)
    even = np.where(cand % 2 == 0, cand, 99).min(-1)
    code = np.where(even < 99, even, cand.min(-1))  # ties are always between adjacent codes
    code = np.where(np.abs(v) > 6, 7, code)
    return code + 8 * ((v < 0) & (code > 0))


def test_mxfp4_quantizer_against_independent_e2m1_rounding():
    E, N, K = 2, 21, 45  # K % 32 != 0: padded with zeros
    w = torch.randn(E, N, K, generator=_gen(9), dtype=torch.float64)
    # exact ties in units of the block scale 2^(E-127), amax 6.0 -> E = 2 - 2 + 127
    w[0, 0, :12] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5, -0.25, -3.5, 0.1])
    w[0, 0, 12:32] = 0.0
    w[1, 2, :32] = 0.0  # all-zero block -> E = 0
    p = quantize_weights(w, "mxfp4")
    assert p.scales.dtype == torch.uint8 and p.scales.shape == (E, 2, 2, 16)
    d = dequantize_weights(p)
    assert d[0, 0, :12].tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -4, 0, -4, 0]
    wn = torch.nn.functional.pad(w, (0, 64 - K)).view(E, N, 2, 32).numpy()
    amax = np.abs(wn).max(-1)
    with np.errstate(divide="ignore"):
        ebyte = np.where(amax > 0, np.clip(np.floor(np.log2(amax)) - 2 + 127, 0, 254), 0)
    scales = p.scales.transpose(2, 3).reshape(E, 32, 2)[:, :N].numpy()
    assert (scales == ebyte).all()
    x = 2.0 ** (ebyte[..., None] - 127)
    codes = _e2m1_nearest(wn / x)
    expect = np.array(E2M1_VALUES)[codes] * x
    assert torch.equal(d, torch.from_numpy(expect.reshape(E, N, 64)[:, :, :K]).float())
    got = unpack_codes(p.weight, 4, N, K).numpy()
    assert (got == codes.reshape(E, N, 64)[:, :, :K]).all()


def test_mxfp4_matches_gguf_shared_exponent_and_values():
    # gguf.quants MXFP4 (llama.cpp) uses the same shared exponent; on random data
    # (no exact ties) its elements round identically.
    w = torch.randn(3, 16, 64, generator=_gen(10))
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.MXFP4)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    p = quantize_weights(w, "mxfp4")
    assert torch.equal(dequantize_weights(p), torch.from_numpy(ref))
    e_gguf = torch.from_numpy(raw.reshape(3, 16, 2, 17)[..., 0].copy())
    assert torch.equal(p.scales.transpose(2, 3).reshape(3, 16, 2), e_gguf)


def test_from_mxfp4_against_an_e2m1_table():
    E, N, G = 2, 21, 3
    blocks = torch.randint(0, 256, (E, N, G, 16), generator=_gen(11), dtype=torch.uint8)
    scales = torch.randint(0, 255, (E, N, G), generator=_gen(12), dtype=torch.uint8)
    scales[0, 0] = torch.tensor([0, 1, 254], dtype=torch.uint8)  # extremes: subnormal, overflow
    p = from_mxfp4(blocks, scales)
    assert (p.n, p.k, p.group_size) == (N, 32 * G, 32)
    codes = torch.stack([blocks & 15, blocks >> 4], -1).view(E, N, G, 32).long()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    x = torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    expect = (table[codes] * x).float().view(E, N, 32 * G)
    d = dequantize_weights(p)
    assert torch.equal(d, expect)
    assert torch.equal(from_mxfp4(blocks.view(E, N, G * 16), scales).weight, p.weight)


@pytest.mark.slow  # importing transformers takes seconds
def test_from_mxfp4_matches_transformers_dequantizer():
    hf = pytest.importorskip("transformers.integrations.mxfp4")
    blocks = torch.randint(0, 256, (2, 21, 3, 16), generator=_gen(11), dtype=torch.uint8)
    scales = torch.randint(0, 255, (2, 21, 3), generator=_gen(12), dtype=torch.uint8)
    scales[0, 0] = torch.tensor([0, 1, 254], dtype=torch.uint8)
    ref = hf.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    assert torch.equal(dequantize_weights(from_mxfp4(blocks, scales)), ref.transpose(1, 2))


# ------------------------------------------------------------------------------- GGUF


def _random_gguf_raw(name: str, E: int, n: int, k: int, seed: int) -> np.ndarray:
    """Random block bytes with every fp16 d / dmin replaced by a random finite value."""
    bs, ts = gguf.constants.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, name.upper())]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(E, n, k // bs, ts), dtype=np.uint8)
    offsets = {"mxfp4": [], "nvfp4": [], "q8_0": [0], "q4_0": [0], "q4_1": [0, 2],
               "q5_0": [0], "q5_1": [0, 2], "q2_k": [80, 82], "q3_k": [108], "q4_k": [0, 2],
               "q5_k": [0, 2], "q6_k": [208], "iq4_nl": [0], "iq4_xs": [0], "iq1_s": [0],
               "iq1_m": [], "iq2_xxs": [0], "iq2_xs": [0], "iq2_s": [0], "iq3_xxs": [0],
               "iq3_s": [0]}[name]  # fmt: skip
    for off in offsets:
        h = rng.integers(0, 1 << 16, size=raw.shape[:-1], dtype=np.uint16)
        h = np.where((h & 0x7C00) == 0x7C00, h & 0x83FF, h)  # exponent 31 (inf/nan) -> 0
        raw[..., off : off + 2] = h.astype("<u2")[..., None].view(np.uint8)
    if name == "iq1_m":  # d: the scale words' top nibbles; bit 14 clear keeps it finite
        raw[..., 55] &= 0xBF
    if name == "mxfp4":  # every exponent byte but 255 (NaN in OCP MX; refused)
        raw[..., 0] = rng.integers(0, 255, size=raw.shape[:-1], dtype=np.uint8)
    if name == "nvfp4":  # every UE4M3 scale byte, subnormals and 0 included (0x7F+ refused)
        raw[..., 0:4] = rng.integers(0, 0x7F, size=(*raw.shape[:-1], 4), dtype=np.uint8)
    return raw.reshape(E, n, -1)


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_from_gguf_matches_gguf_dequantize_exactly(name):
    # Exact (bit-identical), not merely close: the repacked scales d*sc and dmin*m
    # are exact fp32 products (11-bit fp16 mantissa times an integer < 2^8), and the
    # reference evaluates the same fp32 expression as gguf.quants (d*sc * q - dmin*m;
    # d * (q - 8); d*sc * (q - 32), d*(sc - 32) * (q - 4), all of whose products are exact).
    E, n, k = 2, 21, 512
    raw = _random_gguf_raw(name, E, n, k, seed=FORMATS.index(name))
    qt = getattr(gguf.GGMLQuantizationType, name.upper())
    with np.errstate(over="ignore"):  # mxfp4: exponents near 254 times 6 overflow to inf
        ref = torch.from_numpy(gguf.quants.dequantize(raw, qt))
    assert ref.shape == (E, n, k)
    p = from_gguf(name, raw, n, k)
    spec = format_spec(name)
    bs, ts = gguf.constants.GGML_QUANT_SIZES[qt]
    if spec.is_grid:  # GGUF's rows as stored, 16 to a block, the padding rows zero bytes
        assert p.scales is None and p.zeros is None
        assert (
            p.group_size
            == spec.default_group_size
            == (16 if name in ("iq1_m", "iq2_xs", "iq2_s") else 32)
        )
        assert p.weight.shape == (E, 2, 16 * k // bs * ts)
        rows = p.weight.view(E, 32, -1)
        assert torch.equal(rows[:, :n], torch.from_numpy(raw)) and not rows[:, n:].any()
        assert torch.equal(dequantize_weights(p), ref)
        assert torch.equal(from_gguf(qt, torch.from_numpy(raw.reshape(-1)), n, k).weight, p.weight)
        return
    assert p.weight.shape == (E, 2, 2 * k * spec.bits) and p.scales.dtype == spec.scale_dtype
    assert (p.zeros is not None) == spec.has_zeros
    assert p.group_size == spec.default_group_size
    assert torch.equal(dequantize_weights(p), ref)
    # Same result from a tensor, a flat array and the gguf enum.
    p2 = from_gguf(qt, torch.from_numpy(raw.reshape(-1)), n, k)
    assert torch.equal(p2.weight, p.weight) and torch.equal(p2.scales, p.scales)
    blk = raw.reshape(E, n, k // bs, ts)
    if name in ("q2_k", "q4_k", "q5_k", "q6_k"):
        # GGUF's size: the 16 padded rows aside, exactly the bytes of its blocks, and the
        # scale bytes are GGUF's own (d, dmin, scales[12] / scales[16], d), only regrouped.
        assert p.nbytes == E * 32 * (k // bs) * ts  # n = 21 -> 2 blocks of 16 rows
        if name == "q2_k":  # scales[16], d, dmin: GGUF's bytes
            head = np.concatenate([blk[..., 0:16], blk[..., 80:84]], axis=-1)
        else:
            head = blk[..., 192:210] if name == "q6_k" else blk[..., 0:16]
        assert torch.equal(unpack_kquant_scales(p.scales, name, n), torch.from_numpy(head))
    elif name == "q3_k":
        # 3-bit codes (96 bytes a row and super-block: GGUF's) and a record of 18 bytes a
        # row (its 12 bytes of 6-bit scales as 16 int8).
        assert p.nbytes == E * 32 * (k // bs) * (96 + p.scales.shape[-1] // 16)
        got = unpack_kquant_scales(p.scales, name, n)
        # int8 sc - 32, d: the d bytes are GGUF's, the scales in [-32, 31]
        assert torch.equal(got[..., 16:18], torch.from_numpy(blk[..., 108:110].copy()))
        sc = got[..., :16].view(torch.int8)
        assert int(sc.min()) >= -32 and int(sc.max()) <= 31
    elif name in ("iq4_nl", "q4_1", "q5_0", "q5_1"):  # GGUF's size: codes, d (and -m)
        assert p.nbytes == E * 32 * (k // bs) * ts
        if name in ("q4_1", "q5_1"):  # the zeros are -m, m GGUF's fp16 bytes 2..4
            m = torch.from_numpy(blk[..., 2:4].copy()).view(torch.float16)[..., 0]
            z = unpack_group_params(p.zeros, n)
            assert torch.equal(z.view(torch.int16), (-m).view(torch.int16))
    elif name == "iq4_xs":  # its 128 code bytes, d and 8 int8 ls - 32 (GGUF: 6 bits each)
        assert p.nbytes == E * 32 * (k // bs) * (128 + 10)
        got = unpack_kquant_scales(p.scales, name, n)
        assert torch.equal(got[..., 8:10], torch.from_numpy(blk[..., 0:2].copy()))
        sc = got[..., :8].view(torch.int8).to(torch.int32) + 32
        h = torch.from_numpy(blk[..., 2:4].copy()).view(torch.int16).to(torch.int32) & 0xFFFF
        ls = torch.from_numpy(blk[..., 4:8].copy()).to(torch.int32)
        for j in range(8):  # ggml's ls_j, spelled out
            want = ((ls[..., j // 2] >> (4 * (j % 2))) & 15) | (((h[..., 0] >> (2 * j)) & 3) << 4)
            assert torch.equal(sc[..., j], want), j


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_gguf_quantizers_round_trip(name):
    E, N, K = 2, 19, 512
    w = torch.randn(E, N, K, generator=_gen(13))
    w[0, 0] = 0.0
    raw = quantize_gguf_raw(w.numpy(), name)
    qt = getattr(gguf.GGMLQuantizationType, name.upper())
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qt))
    # nvfp4's quantize_weights is NVIDIA's recipe with a per-expert scale
    # (kt_ops.formats.nvfp4), not GGUF's blocks: those are checked through from_gguf.
    p = from_gguf(name, raw, N, K) if name == "nvfp4" else quantize_weights(w, name)
    d = dequantize_weights(p)
    assert torch.equal(d, ref)  # valid GGUF blocks, repacked losslessly
    if name in ("mxfp4", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"):  # llama.cpp's quantizer
        assert np.array_equal(raw, gguf.quants.quantize(w.numpy(), qt))
    rel = ((d - w).pow(2).mean() / w.pow(2).mean()).sqrt().item()
    bound = {
        "mxfp4": 0.15, "nvfp4": 0.12, "q8_0": 0.01, "q4_0": 0.15, "q4_1": 0.12, "q5_0": 0.06,
        "q5_1": 0.06, "q2_k": 0.4, "q3_k": 0.2, "q4_k": 0.12, "q5_k": 0.06, "q6_k": 0.03,
        "iq4_nl": 0.1, "iq4_xs": 0.1, "iq1_s": 0.55, "iq1_m": 0.5, "iq2_xxs": 0.4,
        "iq2_xs": 0.34, "iq2_s": 0.3, "iq3_xxs": 0.22, "iq3_s": 0.17,
    }[name]  # fmt: skip
    assert rel < bound, rel
    assert torch.equal(d[0, 0], torch.zeros(K))


def test_odd_shapes_keep_zero_padding():
    E, N, K = 2, 21, 45
    w = torch.randn(E, N, K, generator=_gen(14))
    for fmt in ("int8", "mxfp4", "fp8", "bf16"):
        p = quantize_weights(w, fmt)
        assert p.n == N and p.k == K
        # the same tensors read as the padded [16*NB, Kp] must hold zeros in the padding
        kpad = 46 if fmt == "bf16" else 64
        full = dequantize_weights(
            PackedProjection(p.weight, p.scales, p.zeros, fmt, p.group_size, 32, kpad)
        )
        assert torch.equal(full[:, :N, :K], dequantize_weights(p))
        assert int((full[:, N:] != 0).sum()) == 0 and int((full[:, :, K:] != 0).sum()) == 0
    # implicit-zero formats pad with the code of weight 0 (8 for 4 bit)
    p = quantize_weights(torch.randn(1, 5, 64, generator=_gen(15)), "int4", group_size=32)
    full = unpack_codes(p.weight, 4, 16, 64)
    assert int((full[:, 5:] != 8).sum()) == 0


# ------------------------------------------------------------------------- activations


def test_quantize_activations_q8():
    x = torch.zeros(3, 40)
    x[0, :5] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5])  # scale 1: ties to even
    x[1, 32:35] = torch.tensor([1.0, -2.0, 0.3])  # a block of 8 real + 24 padded
    y = quantize_activations_q8(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert y[0, :5].tolist() == [127.0, 0.0, 2.0, 2.0, -0.0]
    assert torch.equal(y[2], torch.zeros(40))  # amax = 0
    s = 2.0 / 127
    expect = torch.round(torch.tensor([1.0, -2.0, 0.3]) * (127 / torch.tensor(2.0))) * s
    assert torch.equal(y[1, 32:35], expect)
    xr = torch.randn(2, 3, 77, generator=_gen(16)).bfloat16()
    yr = quantize_activations_q8(xr)
    xf = torch.nn.functional.pad(xr.float(), (0, 19)).view(2, 3, 3, 32)
    sx = xf.abs().amax(-1, keepdim=True) / 127
    # |x - xq*sx| <= sx/2, plus the fp32 rounding of 127/amax (ties in bf16 inputs are common)
    bound = (sx * (0.5 + 1e-4)).expand(2, 3, 3, 32).reshape(2, 3, 96)[..., :77]
    assert ((yr - xr.float()).abs() <= bound).all()
    q = torch.nn.functional.pad(yr, (0, 19)).view(2, 3, 3, 32) / sx
    assert (q - q.round()).abs().max() < 1e-4 and q.abs().max() <= 127 + 1e-4


# -------------------------------------------------------------------------- the dataclass


def test_packed_projection_properties():
    w = torch.randn(3, 21, 64, generator=_gen(17))
    p = quantize_weights(w, "int4", group_size=32, symmetric=False)
    assert p.num_experts == 3 and set(p.tensors()) == {"weight", "scales", "zeros"}
    assert p.nbytes == 3 * 2 * (16 * 64 // 2 + 2 * 2 * 2 * 16)
    assert p.bits_per_weight == pytest.approx(8 * p.nbytes / (3 * 21 * 64))
    assert set(quantize_weights(torch.randn(1, 4, 8), "bf16").tensors()) == {"weight"}


def test_select_experts_picks_along_the_expert_dimension():
    w = torch.randn(3, 21, 64, generator=_gen(19))
    ids = torch.tensor([2, 0, 2])
    for p in (
        quantize_weights(w, "int4", group_size=32, symmetric=False),
        quantize_weights(w, "q8_0"),
    ):
        got = p.select_experts(ids).validate()
        assert (got.weight_format, got.group_size, got.n, got.k) == (
            p.weight_format,
            p.group_size,
            p.n,
            p.k,
        )
        assert torch.equal(dequantize_weights(got), dequantize_weights(p)[ids])
        assert got.zeros is None if p.zeros is None else torch.equal(got.zeros, p.zeros[ids])


# --------------------------------------------------------------------------- bad inputs


def test_validate_names_the_bad_field():
    good = quantize_weights(torch.randn(2, 20, 64, generator=_gen(18)), "int8")
    z = torch.zeros(2, 2, 1, 16)

    def bad(**kw):
        fields = dict(
            weight=good.weight,
            scales=good.scales,
            zeros=None,
            weight_format="int8",
            group_size=0,
            n=20,
            k=64,
        )
        fields.update(kw)
        return PackedProjection(**fields)

    cases = [
        (dict(weight_format="int3"), "weight_format"),
        (dict(n=0), r"\.n "),
        (dict(k=-1), r"\.k "),
        (dict(group_size=32), "group_size"),
        (dict(weight=good.weight.float()), "weight"),
        (dict(weight=good.weight[:, :1]), "weight"),
        (dict(n=40), "weight"),
        (dict(scales=None), "scales"),
        (dict(scales=good.scales.half()), "scales"),
        (dict(scales=torch.ones(2, 2, 1, 32)[..., ::2]), "scales must be contiguous"),
        (dict(zeros=z), "zeros"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            bad(**kw).validate()
            pytest.fail(f"validate accepted {kw}")
    q4k = quantize_weights(torch.randn(1, 16, 256, generator=_gen(19)), "q4_k")
    z4 = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match="zeros must be None"):  # mins live in the records
        PackedProjection(q4k.weight, q4k.scales, z4, "q4_k", 32, 16, 256).validate()
    # The old layout (fp32 d*sc [E, NB, G, 16] + zeros) is refused, naming the expected records.
    with pytest.raises(ValueError, match=r"scales has torch.float32.*uint8 \[1, 1, 1, 256\]"):
        PackedProjection(q4k.weight, z4, None, "q4_k", 32, 16, 256).validate()
    with pytest.raises(ValueError, match="k=128 is not a multiple of the 'q4_k' super-block"):
        PackedProjection(q4k.weight[..., :1024], q4k.scales, None, "q4_k", 32, 16, 128).validate()
    with pytest.raises(ValueError, match="group_size"):
        PackedProjection(q4k.weight, q4k.scales, None, "int4", 128, 16, 160).validate()


def test_quantize_weights_rejects_bad_input():
    w = torch.randn(1, 16, 96)
    cases = [
        (dict(weight=w.numpy(), weight_format="int8"), "weight"),
        (dict(weight=w[0], weight_format="int8"), "weight"),
        (dict(weight=w.to(torch.int32), weight_format="int8"), "weight"),
        (dict(weight=torch.full((1, 2, 32), float("nan")), weight_format="int8"), "weight"),
        (dict(weight=torch.zeros(1, 0, 32), weight_format="int8"), "weight"),
        (dict(weight=w, weight_format="int2"), "weight_format"),
        (dict(weight=w, weight_format="int4", group_size=16), "group_size"),
        (dict(weight=w, weight_format="int4", group_size=64), "K=96.*group_size=64"),
        (dict(weight=w, weight_format="q8_0", group_size=0), "group_size"),
        (dict(weight=w, weight_format="int8", symmetric=False), "symmetric"),
        (dict(weight=torch.randn(1, 2, 48), weight_format="q8_0"), "K=48"),
        (dict(weight=w, weight_format="q6_k"), "K=96"),
        (dict(weight=torch.full((1, 2, 32), 1e6), weight_format="int4", group_size=32), "weight"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            quantize_weights(**kw)


@pytest.mark.parametrize("qtype", ["tq1_0", "tq2_0"])
def test_ternary_blocks_are_q2_k_blocks_of_the_same_values(qtype):
    # GGUF's ternary types as q2_K blocks (sc = m = 1, dmin = d): gguf's own dequantizer
    # gives the same fp32 values for both, every byte of the ternary blocks random.
    qt = getattr(gguf.GGMLQuantizationType, qtype.upper())
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(3, 5, gguf.GGML_QUANT_SIZES[qt][1]), dtype=np.uint8)
    raw[..., -2:] = rng.uniform(-1, 1, size=(3, 5, 1)).astype(np.float16).view(np.uint8)
    q2 = ternary_as_q2_k(qt, raw)
    assert q2.shape == (3, 5, 84)
    want = gguf.quants.dequantize(raw, qt)
    assert np.array_equal(gguf.quants.dequantize(q2, gguf.GGMLQuantizationType.Q2_K), want)
    with pytest.raises(ValueError, match="TQ1_0 / TQ2_0 blocks, got q4_0"):
        ternary_as_q2_k("q4_0", raw)
    with pytest.raises(ValueError, match=r"got tq2_0 \(3, 5, 54\)"):
        ternary_as_q2_k("tq2_0", raw[..., :54])


def test_from_gguf_rejects_bad_input():
    raw = _random_gguf_raw("q4_0", 1, 4, 64, seed=0)
    cases = [
        (("q8_1", raw, 4, 64), "qtype"),
        ((gguf.GGMLQuantizationType.TQ2_0, raw, 4, 64), "qtype"),
        ((3, raw, 4, 64), "qtype"),
        (("q4_0", raw, 0, 64), "n must"),
        (("q4_0", raw, 4, 48), "k=48"),
        (("q4_0", raw[:, :3], 4, 64), "raw has 108 bytes"),
        (("q4_0", raw.view(np.int8), 4, 64), "raw must"),
        (("q4_0", [1, 2], 4, 64), "raw must"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            from_gguf(*args)
    mx = _random_gguf_raw("mxfp4", 1, 4, 64, seed=2)
    assert from_gguf("mxfp4", mx, 4, 64) is not None
    mx[0, 3, 17] = 255  # the second block's exponent byte: NaN in OCP MX
    with pytest.raises(ValueError, match="MXFP4 exponent byte 255"):
        from_gguf("mxfp4", mx, 4, 64)
    # NVFP4: UE4M3 scale bytes are 0x00-0x7E; 0x7F (E4M3's NaN) and bit 7 are refused.
    nv = _random_gguf_raw("nvfp4", 1, 4, 128, seed=3)
    assert from_gguf("nvfp4", nv, 4, 128) is not None
    for byte in (0x7F, 0x80, 0xB8):
        bad_nv = nv.copy()
        bad_nv[0, 2, 36 + 3] = byte  # the second block's last scale
        with pytest.raises(ValueError, match=f"NVFP4 scale byte 0x{byte:02X}"):
            from_gguf("nvfp4", bad_nv, 4, 128)
    bad = raw.copy()
    bad[0, 0, 0:2] = np.array([0x00, 0x7C], dtype=np.uint8)  # fp16 +inf d
    with pytest.raises(ValueError, match="raw has a non-finite"):
        from_gguf("q4_0", bad, 4, 64)
    # Every k-quant's d (and dmin) is checked where its block stores it.
    for name, offs in (("q2_k", (80, 82)), ("q3_k", (108,)), ("q4_k", (0, 2)), ("q6_k", (208,)),
                       ("iq4_nl", (0, 18)), ("iq4_xs", (0,)), ("q4_1", (0, 2)), ("q5_0", (0,)),
                       ("q5_1", (0, 2))):  # fmt: skip
        good = _random_gguf_raw(name, 1, 2, 256, seed=1)
        assert from_gguf(name, good, 2, 256) is not None
        for off in offs:
            bad = good.copy()
            bad[0, 1, off : off + 2] = np.array([0x00, 0xFE], dtype=np.uint8)  # fp16 NaN
            with pytest.raises(ValueError, match=f"raw has a non-finite fp16 d/dmin in a {name}"):
                from_gguf(name, bad, 2, 256)


def test_from_fp8_and_from_mxfp4_reject_bad_input():
    bits = torch.zeros(1, 4, 8, dtype=torch.uint8)
    s = torch.ones(1, 1, 1)
    nan, nan_pos = bits.clone(), bits.clone()
    nan[0, 1, 2] = 0xFF  # S.1111.111 with the sign set
    nan_pos[0, 3, 7] = 0x7F
    cases = [
        ((bits.float(), s), "weight must be torch.float8_e4m3fn"),
        ((bits.view(torch.float8_e5m2), s), "weight must"),
        ((bits[0], s), "weight must be a 3-D"),
        ((nan, s), "weight holds NaN"),
        ((nan_pos.view(torch.float8_e4m3fn), s), "weight holds NaN"),
        ((bits, torch.ones(1, 2, 1)), "scale_inv has shape"),
        ((bits, torch.ones(1, 1, 1, dtype=torch.int32)), "scale_inv must"),
        ((bits, torch.full((1, 1, 1), float("inf"))), "scale_inv holds"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            from_fp8(*args)
    blocks = torch.zeros(1, 4, 2, 16, dtype=torch.uint8)
    scales = torch.full((1, 4, 2), 127, dtype=torch.uint8)
    bad_scale = scales.clone()
    bad_scale[0, 3, 1] = 255
    cases = [
        ((blocks.to(torch.int8), scales), "blocks must be a uint8"),
        ((blocks[..., :8], scales), "blocks has shape"),
        ((blocks, scales[:, :3]), "blocks has shape"),
        ((blocks, scales.float()), "scales must be a uint8"),
        ((blocks, scales[0]), "scales must be"),
        ((blocks, bad_scale), "scales holds the UE8M0 NaN"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            from_mxfp4(*args)


def test_activation_and_code_helpers_reject_bad_input():
    with pytest.raises(ValueError, match="x must"):
        quantize_activations_q8(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="block must"):
        quantize_activations_q8(torch.ones(2, 3), block=0)
    with pytest.raises(ValueError, match="bits=7"):
        pack_codes(torch.zeros(1, 1, 1, dtype=torch.uint8), 7)
    with pytest.raises(ValueError, match="outside"):
        pack_codes(torch.full((1, 1, 1), 8), 3)
    with pytest.raises(ValueError, match="outside"):
        pack_codes(torch.full((1, 1, 1), 16), 4)
    with pytest.raises(ValueError, match="unpack_codes: weight"):
        unpack_codes(torch.zeros(1, 1, 10, dtype=torch.uint8), 4, 16, 32)


def test_unpacking_params_checks_the_row_count():
    """unpack_group_params / unpack_kquant_scales refuse a row count that does not fit the
    blocks (a slice would silently return another shape)."""
    from kt_ops.formats.qint import pack_group_params, unpack_group_params

    p = pack_group_params(torch.randn(2, 20, 3), torch.float32)
    assert unpack_group_params(p, 20).shape == (2, 20, 3)
    for n in (33, 16, -1, 2.0):
        with pytest.raises(ValueError, match=r"n=.* does not fit 2 blocks of 16 rows"):
            unpack_group_params(p, n)
    with pytest.raises(ValueError, match=r"expected \[E, NB, G, 16\]"):
        unpack_group_params(p[..., :8], 20)
    q = quantize_weights(torch.randn(1, 20, 256), "q4_k")
    assert unpack_kquant_scales(q.scales, "q4_k", 20).shape[:2] == (1, 20)
    with pytest.raises(ValueError, match="unpack_kquant_scales: n=40"):
        unpack_kquant_scales(q.scales, "q4_k", 40)
