"""Reference dequantizer: packed weights -> dense fp32 ``[E, n, k]``, straight from docs/formats.md.

This is what the kernel tests compare against, so it deliberately shares no
code with the packers (``qint.pack_codes`` works with reshapes and permutes):
every weight is located by the byte/bit index formulas of the document,
evaluated for all ``(r, k)`` of a 16-row block at once and gathered.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kt_ops.formats.packed import PackedProjection
from kt_ops.formats.spec import BLOCK_ROWS, format_spec, padded_k

__all__ = ["dequantize_weights", "MXFP4_Q_LUT", "IQ4NL_VALUES"]

#: mxfp4: E2M1 code c -> unsigned code q = 2*e2m1(c) + 12 (docs/formats.md, qint / mxfp4).
MXFP4_Q_LUT = (12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)
#: iq4_nl / iq4_xs: code c -> its value (llama.cpp ggml-quants.c ``kvalues_iq4nl``).
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _rk(kp: int) -> tuple[Tensor, Tensor]:
    """Row ``r`` ``[16, 1]`` and column ``k`` ``[1, Kp]`` index grids of one block."""
    r = torch.arange(BLOCK_ROWS, dtype=torch.int64).view(BLOCK_ROWS, 1)
    k = torch.arange(kp, dtype=torch.int64).view(1, kp)
    return r, k


def _gather(block: Tensor, idx: Tensor) -> Tensor:
    """``block[e, nb, idx]`` for an index grid ``[16, Kp]`` -> ``[E, NB, 16, Kp]``."""
    E, nb, _ = block.shape
    return block[:, :, idx.reshape(-1)].view(E, nb, *idx.shape)


def _decode_codes(weight: Tensor, bits: int, kp: int) -> Tensor:
    """Stored code bits of every ``(e, nb, r, k)``: int64 ``[E, NB, 16, Kp]``, unsigned."""
    w = weight.to(torch.int64)
    r, k = _rk(kp)
    if bits == 8:
        # word c = k // 4, byte j = k % 4 of row r: offset 64c + 4r + j
        return _gather(w, (k // 4) * 64 + r * 4 + k % 4)
    if bits <= 3:
        # low plane: word c = k // 16, byte j = k % 4, bits 2h, 2h+1 with h = (k % 16) // 4
        low = _gather(w, (k // 16) * 64 + r * 4 + k % 4)
        q = (low >> (2 * ((k % 16) // 4))) & 3
        high_base = 4 * kp  # the low plane is 16 * Kp * 2 / 8 bytes
    else:
        # low plane: word c = k // 8, byte j = k % 4, nibble hi = (k // 4) % 2
        low = _gather(w, (k // 8) * 64 + r * 4 + k % 4)
        q = (low >> (4 * ((k // 4) % 2))) & 15
        high_base = 8 * kp  # the low plane is 16 * Kp * 4 / 8 bytes
    if bits in (3, 5):
        # word w = k // 32, byte j = k % 4, bit h = (k % 32) // 4 -> bit 2 (3 bit) / 4 (5 bit) of q
        high = _gather(w, high_base + (k // 32) * 64 + r * 4 + k % 4)
        q = q | (((high >> ((k % 32) // 4)) & 1) << (bits - 1))
    elif bits == 6:
        # word w = k // 16, byte j = k % 4, bits 2h, 2h+1 with h = (k % 16) // 4 -> bits 4, 5
        high = _gather(w, high_base + (k // 16) * 64 + r * 4 + k % 4)
        q = q | (((high >> (2 * ((k % 16) // 4))) & 3) << 4)
    return q


def _expand_groups(p: Tensor, kp: int, group_size: int) -> Tensor:
    """``[E, NB, G, 16]`` -> ``[E, NB, 16, Kp]`` with ``out[..., r, k] = p[..., k // gs, r]``."""
    _, k = _rk(kp)
    g = torch.zeros_like(k) if group_size == 0 else k // group_size
    return p[:, :, g.reshape(-1), :].transpose(2, 3)


def _kquant_params(rec: Tensor, spec, kp: int) -> tuple[Tensor, Tensor]:
    """k-quant records ``[E, NB, Kp/256, R]`` -> fp32 scale and zero ``[E, NB, 16, Kp]``.

    By the byte offsets of docs/formats.md: sub-block ``j`` (``g = k // group``,
    super-block ``s = k // 256``) of row ``r`` has ``d`` = fp16 bytes ``2r, 2r+1``;
    q4_k/q5_k: ``dmin`` at ``32 + 2r``, GGUF ``scales[i]`` at ``64 + 16i + r``
    decoded by ``get_scale_min_k4``; q6_k, q3_k: int8 ``sc_j`` at ``32 + 16j + r``;
    q2_k: ``dmin`` at ``32 + 2r``, ``sc_j | m_j << 4`` at ``64 + 16j + r``; iq4_xs
    as q6_k with sub-blocks of 32.
    """
    r, k = _rk(kp)
    E, nb, S, R = rec.shape
    flat = rec.reshape(E, nb, S * R).to(torch.int64)
    base = (k // 256) * R  # record of super-block s

    def f16(off: Tensor) -> Tensor:
        bits = _gather(flat, off) | (_gather(flat, off + 1) << 8)
        return bits.to(torch.int16).view(torch.float16).float()

    d = f16(base + 2 * r)
    if spec.name == "q2_k":  # sub-blocks of 16, sc | m << 4
        j = (k % 256) // 16
        b = _gather(flat, base + 64 + 16 * j + r)
        return d * (b & 15).float(), f16(base + 32 + 2 * r) * (b >> 4).float()
    if not spec.record_mins:  # q6_k, q3_k (16 k per sub-block), iq4_xs (32)
        j = (k % 256) // spec.default_group_size
        sc = _gather(flat, base + 32 + 16 * j + r)
        sc = sc - ((sc & 0x80) << 1)  # int8
        return d * sc.float(), torch.zeros_like(d)
    dmin = f16(base + 32 + 2 * r)
    j = (k % 256) // 32

    def byte(i: Tensor) -> Tensor:
        return _gather(flat, base + 64 + 16 * i + r)

    jl = j % 4  # j < 4: scales[j] & 63, mins scales[j + 4] & 63
    b_j, b_j4, b_j8 = byte(jl), byte(jl + 4), byte(jl + 8)
    low = j < 4
    sc = torch.where(low, b_j & 63, (b_j8 & 15) | ((b_j >> 6) << 4))
    mn = torch.where(low, b_j4 & 63, (b_j8 >> 4) | ((b_j4 >> 6) << 4))
    return d * sc.float(), dmin * mn.float()


def _dequantize_grid(spec, n: int, k: int, weight: Tensor) -> Tensor:
    """A grid format's ``[E, NB, 16 * row_bytes]`` blocks -> ``[E, n, k]`` by
    ``gguf.quants.dequantize`` of the rows (they are GGUF's bytes as stored)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    E, nb, _ = weight.shape
    rows = weight.reshape(E, nb * BLOCK_ROWS, -1)[:, :n].contiguous().numpy()
    values = dequantize(rows, GGMLQuantizationType[spec.name.upper()])
    return torch.from_numpy(values.reshape(E, n, k).astype("float32"))


def _rows(x: Tensor, n: int, k: int) -> Tensor:
    """``[E, NB, 16, Kp]`` -> ``[E, n, k]`` (drop the padding rows and columns)."""
    E, nb, r, kp = x.shape
    return x.reshape(E, nb * r, kp)[:, :n, :k].contiguous()


def dequantize_weights(p: PackedProjection) -> Tensor:
    """The dense fp32 ``[E, n, k]`` weights a :class:`PackedProjection` holds.

    Per format (docs/formats.md):

    * ``bf16``: ``W[n, k] = packed[n // 16, k // 2, n % 16, k % 2]``.
    * qint (``int8``, ``int4``, ``mxfp4``, ``nvfp4``, ``q8_0``, ``q4_0``, ``q2_k`` ...
      ``q6_k``, ``iq4_nl``, ``iq4_xs``): codes from the bit planes, then
      ``W = scale[g] * q - zero[g]`` with ``g = k // group_size`` in fp32
      (k-quants: ``scale = d*sc``, ``zero = dmin*m`` decoded from the
      super-block records, exact).
      8-bit codes are signed (``zero = 0``); unsigned codes without a zeros
      tensor have the implicit ``zero = scale * 2^(bits-1)``, evaluated as
      ``scale * (q - 2^(bits-1))`` (exact, hence bit-identical to ggml's
      ``d * (q - 8)`` / ``d*sc * (q - 32)``). ``mxfp4``: ``q = 2*e2m1(c) + 12``
      and ``scale = 2^(E-128)``, ``zero = 12 * scale`` (OCP MX v1.0 value
      ``2^(E-127) * e2m1(c)``), evaluated in float64 then rounded to fp32
      (exact except where the value overflows fp32, which gives inf);
      ``nvfp4`` likewise with its fp32 ``scale`` (half the NVFP4 ``b * g``).
      ``iq4_nl`` / ``iq4_xs``: ``W = scale * IQ4NL_VALUES[c]`` (``scale`` the fp16 ``d``
      per 32, or iq4_xs' ``d * (ls - 32)`` from its records), as ggml's
      ``dequantize_row_iq4_nl`` / ``_iq4_xs``.
    * grid (``iq1_s``, ``iq1_m``, ``iq2_xxs``, ``iq2_xs``, ``iq2_s``, ``iq3_xxs``,
      ``iq3_s``): the rows of GGUF blocks
      through ``gguf.quants.dequantize`` (llama.cpp's ``dequantize_row_<type>``).
    * ``fp8``: ``W = float(E4M3 bits) * scale[n // 128, k // 128]`` in fp32;
      ``fp8_channel`` / ``mxfp8``: times the scale of row ``n`` and group ``k //
      group_size`` (``mxfp8``: ``2^(E-127)``).

    Raises:
        ValueError: ``p`` fails :meth:`PackedProjection.validate`.
    """
    p.validate()
    spec = format_spec(p.weight_format)
    tensors = {name: t.cpu() for name, t in p.tensors().items()}
    out = torch.empty(p.num_experts, p.n, p.k, dtype=torch.float32)
    for e in range(p.num_experts):  # one expert at a time bounds the int64 temporaries
        one = {name: t[e : e + 1] for name, t in tensors.items()}
        out[e] = _dequantize_one(spec, p.group_size, p.n, p.k, **one)[0]
    return out


def _dequantize_one(spec, group_size, n, k, weight, scales=None, zeros=None) -> Tensor:
    w = weight
    if spec.layout == "bf16":
        nn = torch.arange(n).view(n, 1)
        kk = torch.arange(k).view(1, k)
        return w[:, nn // 16, kk // 2, nn % 16, kk % 2].float()
    if spec.is_grid:  # GGUF's own blocks: the gguf package's dequantizer
        return _dequantize_grid(spec, n, k, w)
    kp = padded_k(k)
    if spec.layout == "fp8":
        nn = torch.arange(n).view(n, 1)
        kk = torch.arange(k).view(1, k)
        # packed[e, nb, k, r] = bits(W[16 nb + r, k])
        bits = w[:, nn // BLOCK_ROWS, kk, nn % BLOCK_ROWS]
        vals = bits.to(torch.uint8).view(torch.float8_e4m3fn).float()
        if spec.fp8_row_scales:  # scales [E, NB, G, 16]: per row and group
            g = kk // (group_size or kp)
            s = scales[:, nn // BLOCK_ROWS, g, nn % BLOCK_ROWS]
            if s.dtype == torch.uint8:  # mxfp8: UE8M0, 2^(E-127)
                return (vals.double() * torch.pow(2.0, s.double() - 127)).float()
            return vals * s.float()
        return vals * scales.float()[:, nn // 128, kk // 128]
    q = _decode_codes(w, spec.bits, kp)
    if spec.code_table == "iq4nl":  # iq4_nl, iq4_xs: the table's signed values
        qv = torch.tensor(IQ4NL_VALUES, dtype=torch.float32)[q]
        if spec.is_kquant:
            scale = _kquant_params(scales, spec, kp)[0]
        else:
            scale = _expand_groups(scales, kp, group_size).float()
        return _rows(scale * qv, n, k)
    if spec.is_kquant:
        scale, zero = _kquant_params(scales, spec, kp)
        if spec.record_mins:
            return _rows(scale * q.float() - zero, n, k)
        return _rows(scale * (q - int(spec.zero_offset)).float(), n, k)
    scale = _expand_groups(scales, kp, group_size)
    if spec.code_table == "e2m1":  # mxfp4, nvfp4: E2M1 codes through the table
        qv = torch.tensor(MXFP4_Q_LUT, dtype=torch.float64)[q]
        if scales.dtype == torch.uint8:  # UE8M0 exponents (mxfp4)
            s = torch.pow(2.0, scale.to(torch.float64) - 128.0)
        else:  # nvfp4: the fp32 scale itself
            s = scale.to(torch.float64)
        return _rows(s * qv - 12.0 * s, n, k).float()
    scale = scale.float()
    if spec.signed:  # two's-complement byte
        return _rows(scale * (q - ((q & 0x80) << 1)).float(), n, k)
    if zeros is None:
        return _rows(scale * (q - int(spec.zero_offset)).float(), n, k)
    zero = _expand_groups(zeros, kp, group_size).float()
    return _rows(scale * q.float() - zero, n, k)
