"""The weight formats and their packed shapes (docs/formats.md).

One name per format, shared by the op (``weight_format=``), the packers, the
loaders and the converter. The facts of each format come from the one format
table of the extension (``csrc/formats/format_table.cpp``, read through
``kt_ops._C.formats()``): there is no second registry to keep in sync.
:func:`format_spec` returns them; the shape helpers here are the single Python
statement of the packed tensor shapes that :meth:`PackedProjection.validate`
checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kt_ops import _C

__all__ = [
    "BLOCK_ROWS",
    "K_ALIGN",
    "FORMATS",
    "FormatSpec",
    "format_spec",
    "ceil_div",
    "padded_k",
]

#: Output rows per packed block (``NB = ceil(N / 16)`` blocks per expert).
BLOCK_ROWS = 16
#: K is padded with zero weights to a multiple of this (``Kp = ceil(K/32)*32``).
K_ALIGN = 32


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers."""
    return -(-a // b)


def padded_k(k: int) -> int:
    """``Kp = ceil(k / 32) * 32``: the K extent of every packed layout except ``bf16``."""
    return ceil_div(k, K_ALIGN) * K_ALIGN


@dataclass(frozen=True)
class FormatSpec:
    """Static description of one weight format (one row of the table in docs/formats.md).

    Attributes:
        name: the format name (one of :data:`FORMATS`).
        layout: ``'bf16'`` (n16k2 bf16), ``'qint'`` (integer code planes),
            ``'fp8'`` (E4M3 bytes, ``[E, NB, Kp, 16]``) or ``'grid'`` (GGUF's
            i-quant bytes as stored, ``[E, NB, 16 * K/256 * type_size]``: iq1_s,
            iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s; decoded per block by the
            kernels).
        bits: bits per stored weight code (16 for bf16; the grid formats: the
            whole bits of their names, 1 for iq1_s / iq1_m).
        signed: the codes the kernels multiply are signed bytes: two's-complement
            8-bit codes (int8, q8_0) or the IQ4_NL table's values (iq4_nl,
            iq4_xs); False for the float layouts (bf16, fp8) and the unsigned codes.
        lut: the stored code goes through a 16-entry table before the affine
            step (``code_table`` names it).
        code_table: ``'e2m1'`` (mxfp4, nvfp4: E2M1 code ``c`` -> ``q = 2*e2m1(c) +
            12``), ``'iq4nl'`` (iq4_nl, iq4_xs: ``c`` -> ``IQ4NL_VALUES[c]``, llama.cpp's
            ``kvalues_iq4nl``) or ``None``.
        scale_dtype: dtype of the ``scales`` tensor (``None`` for bf16;
            ``torch.uint8`` UE8M0 exponents for mxfp4).
        has_zeros: the format can carry a ``zeros`` tensor (``W = scale*q - zero``).
        zeros_optional: ``zeros`` may be absent (int4: symmetric packing);
            when ``has_zeros`` and not ``zeros_optional`` it is required.
        group_sizes: allowed ``group_size`` values (0 = per output channel;
            fp8: 128 = 128x128 blocks).
        default_group_size: the one used when none is given.
        activation: ``'q8'`` (int8 activations in blocks of 32, see
            ``quantize_activations_q8``) or ``'fp32'``: what the format's own
            kernel multiplies.
        fp32_min_tokens: the compute-path policy of ``'auto'``
            (:func:`kt_ops.set_quant_activations`): experts with at least this
            many tokens take the weight-only fp32 path; ``None``: never. On
            the tiers whose q8 kernels have no VNNI (ref, avx2, avx512).
        fp32_min_tokens_vnni: the same where the format's streaming kernel has
            its fast form: the integer formats on ``avx512_vnni`` (int8 and
            q8_0: ``None``, the vpdpbusd kernel wins at every count measured),
            the fp8 layout on AVX-512 CPUs with VBMI (E4M3 by byte tables:
            ``None``, it wins up to 128 tokens measured);
            :func:`kt_ops.quant_fp32_min_tokens` gives the active tier's.
        brgemm_min_tokens: the compute-path policy of ``'auto'``
            (:func:`kt_ops.set_compute_path`) per CPU class (``'avx512'``:
            AVX-512 with AVX512_BF16 / VNNI; ``'avx512_intel'``: the same on an Intel
            CPU without AMX, whose ``vdpbf16ps`` runs at a quarter of its FMA's
            instruction rate; ``'amx'``; ``kt_ops.info()['brgemm_cpu_class']`` names
            this CPU's): experts with at least
            this many tokens run on oneDNN's brgemm; ``None``: never (as
            ``((class, n), ...)`` pairs; :meth:`brgemm_min_tokens_for` reads one).
        bits_per_weight: storage per weight at the default group size, scales
            and zeros included (int4: symmetric, group 128), ignoring padding.
        source: where the element format comes from.
        scale_record_bytes: GGUF k-quants (``q2_k``, ``q3_k``, ``q4_k``,
            ``q5_k``, ``q6_k``) and ``iq4_xs``: bytes of one scale record (16 rows x
            one 256-k super-block: 256 for q4_k/q5_k, 288 for q6_k/q3_k, 320 for
            q2_k, 160 for iq4_xs);
            ``scales`` is uint8 ``[E, NB, Kp/256, scale_record_bytes]``
            (docs/formats.md, "k-quant scales"). 0 otherwise.
        super_block: K per scale record (256 for the k-quants and iq4_xs, else 0).
        record_mins: the records hold mins (``dmin*m``, q2_k/q4_k/q5_k): the
            format is asymmetric without a ``zeros`` tensor.
        zero_offset: the implicit zero of unsigned codes without zeros or
            mins, ``W = scale * (q - zero_offset)``: ``2^(bits-1)`` (int4,
            q4_0: 8; q6_k: 32), 4 for q3_k (its 3-bit codes in the 4-bit
            plane), 12 for the E2M1 formats' kernel codes; 0 otherwise.
        gguf_block: the GGUF (ggml) block types: ``(weights, bytes)`` of one
            ggml block of the type the format repacks losslessly (as
            ``gguf.GGML_QUANT_SIZES``); ``None`` for the other formats.
        fp8_row_scales: the fp8 layout with one scale per row and group
            (``fp8_channel``: per output channel, fp32; ``mxfp8``: per 32 along K,
            UE8M0 bytes): ``scales`` ``[E, NB, G, 16]`` as the qint formats'.
    """

    name: str
    layout: str
    bits: int
    signed: bool
    scale_dtype: Optional[torch.dtype]
    has_zeros: bool
    zeros_optional: bool
    group_sizes: tuple[int, ...]
    default_group_size: int
    activation: str
    fp32_min_tokens: Optional[int]
    fp32_min_tokens_vnni: Optional[int]
    brgemm_min_tokens: tuple[tuple[str, Optional[int]], ...]
    bits_per_weight: float
    source: str
    scale_record_bytes: int = 0
    super_block: int = 0
    record_mins: bool = False
    gguf_block: Optional[tuple[int, int]] = None
    fp8_row_scales: bool = False
    zero_offset: float = 0.0
    code_table: Optional[str] = None

    def brgemm_min_tokens_for(self, cpu_class: str) -> Optional[int]:
        """The ``'auto'`` brgemm threshold on ``cpu_class`` (``'avx512'``, ``'avx512_intel'``
        or ``'amx'``)."""
        table = dict(self.brgemm_min_tokens)
        if cpu_class not in table:
            raise ValueError(
                f"brgemm_min_tokens_for: cpu_class must be one of {sorted(table)}, "
                f"got {cpu_class!r}"
            )
        return table[cpu_class]

    @property
    def lut(self) -> bool:
        """True when the stored code goes through a 16-entry table (``code_table``)."""
        return self.code_table is not None

    @property
    def zeros_required(self) -> bool:
        """True when every packed projection of this format has a ``zeros`` tensor."""
        return self.has_zeros and not self.zeros_optional

    @property
    def is_kquant(self) -> bool:
        """True where ``scales`` are GGUF super-block records: the k-quants and iq4_xs."""
        return self.scale_record_bytes > 0

    @property
    def is_grid(self) -> bool:
        """True for the i-quants on lattice grids (iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s,
        iq3_xxs, iq3_s): the packed weight holds GGUF's blocks as stored, 16 rows per
        block, no scales."""
        return self.layout == "grid"

    @property
    def is_gguf(self) -> bool:
        """True for the GGUF block types (mxfp4, nvfp4, q8_0, q4_0, q2_k ... q6_k, iq4_nl,
        iq4_xs): ``gguf_block`` is set."""
        return self.gguf_block is not None

    def num_groups(self, k: int, group_size: int) -> int:
        """``G``: scale groups along K (1 for per-channel, ``Kp / group_size`` otherwise)."""
        if self.layout != "qint" and not self.fp8_row_scales:
            raise ValueError(f"num_groups: format {self.name!r} has no qint groups")
        return 1 if group_size == 0 else padded_k(k) // group_size

    def weight_shape(self, e: int, n: int, k: int) -> tuple[int, ...]:
        """Shape of the packed ``weight`` tensor of ``[e, n, k]`` dense weights."""
        nb = ceil_div(n, BLOCK_ROWS)
        if self.layout == "bf16":
            return (e, nb, ceil_div(k, 2), BLOCK_ROWS, 2)
        if self.layout == "fp8":
            return (e, nb, padded_k(k), BLOCK_ROWS)
        if self.is_grid:  # 16 rows of GGUF blocks per block
            return (e, nb, BLOCK_ROWS * (k // self.gguf_block[0]) * self.gguf_block[1])
        return (e, nb, BLOCK_ROWS * padded_k(k) * self.bits // 8)

    def weight_dtype(self) -> torch.dtype:
        """dtype of the packed ``weight`` tensor (bf16 or uint8)."""
        return torch.bfloat16 if self.layout == "bf16" else torch.uint8

    def scales_shape(self, e: int, n: int, k: int, group_size: int) -> Optional[tuple[int, ...]]:
        """Shape of ``scales`` (and of ``zeros`` where present); ``None`` for bf16 and
        the grid formats (their scales are inside the blocks)."""
        if self.layout in ("bf16", "grid"):
            return None
        if self.layout == "fp8" and not self.fp8_row_scales:
            return (e, ceil_div(n, 128), ceil_div(k, 128))
        if self.is_kquant:  # one record per 16 rows x 256 k (needs K % 256 == 0)
            return (
                e,
                ceil_div(n, BLOCK_ROWS),
                padded_k(k) // self.super_block,
                self.scale_record_bytes,
            )
        return (e, ceil_div(n, BLOCK_ROWS), self.num_groups(k, group_size), BLOCK_ROWS)

    def bits_per_weight_for(self, group_size: int, zeros: bool = False) -> float:
        """Storage bits per weight at ``group_size`` (with a zeros tensor if ``zeros``).

        Ignores padding and, for per-channel formats, the one scale per row.
        """
        if self.layout == "bf16":
            return 16.0
        if self.is_grid:
            return self.bits_per_weight
        if (self.layout == "fp8" and not self.fp8_row_scales) or group_size == 0:
            return float(self.bits)
        if self.is_kquant:
            return self.bits + 8 * self.scale_record_bytes / (BLOCK_ROWS * self.super_block)
        scale_bits = torch.finfo(self.scale_dtype).bits if self.scale_dtype.is_floating_point else 8
        n_params = 1 + int(self.zeros_required or (zeros and self.has_zeros))
        return self.bits + n_params * scale_bits / group_size


def _spec_from_row(row: dict) -> FormatSpec:
    sd = row["scale_dtype"]
    return FormatSpec(
        name=row["name"],
        layout=row["layout"],
        bits=row["bits"],
        signed=row["signed"],
        scale_dtype=getattr(torch, sd) if sd else None,
        has_zeros=row["has_zeros"],
        zeros_optional=row["zeros_optional"],
        group_sizes=tuple(row["group_sizes"]),
        default_group_size=row["default_group_size"],
        activation=row["activation"],
        fp32_min_tokens=row["fp32_min_tokens"],
        fp32_min_tokens_vnni=row["fp32_min_tokens_vnni"],
        brgemm_min_tokens=tuple(sorted(row["brgemm_min_tokens"].items())),
        bits_per_weight=row["bits_per_weight"],
        source=row["source"],
        scale_record_bytes=row["scale_record_bytes"],
        super_block=row["super_block"],
        record_mins=row["record_mins"],
        gguf_block=row["gguf_block"],
        fp8_row_scales=row["fp8_row_scales"],
        zero_offset=row["zero_offset"],
        code_table=row["code_table"],
    )


_SPECS = {row["name"]: _spec_from_row(row) for row in _C.formats()}

#: Every weight format, in the order of docs/formats.md (the extension's format table).
FORMATS = tuple(_SPECS)


def format_spec(name: str) -> FormatSpec:
    """The :class:`FormatSpec` of weight format ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`FORMATS` (the message lists them).
    """
    spec = _SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown weight_format {name!r}; known formats: {', '.join(FORMATS)}")
    return spec
