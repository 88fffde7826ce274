"""The quantized weight formats of kt_ops, in Python: registry, packers, loaders, reference.

docs/formats.md fixes the packed layouts; this package is their Python
statement and the reference the C++ kernels are tested against:

* :data:`FORMATS`, :func:`format_spec`: the format registry.
* :class:`PackedProjection`: one packed projection (weight, scales, zeros).
* :func:`quantize_weights`: dense ``[E, N, K]`` -> packed, online.
* :func:`from_gguf`, :func:`from_fp8`, :func:`from_mxfp4`, :func:`from_nvfp4`,
  :func:`from_int4`: lossless repacking of GGUF blocks, DeepSeek-V3 fp8, MXFP4,
  NVFP4 and GPTQ/AWQ/compressed-tensors int4 checkpoints.
* :func:`dequantize_weights`: the reference dequantizer (packed -> fp32).
* :func:`quantize_activations_q8`: the int8 activation rounding of the q8 formats.
"""

from kt_ops.formats.activations import quantize_activations_q8
from kt_ops.formats.dequant import IQ4NL_VALUES, MXFP4_Q_LUT, dequantize_weights
from kt_ops.formats.fp8 import from_fp8, from_fp8_channel, from_mxfp8
from kt_ops.formats.gguf_blocks import GGUF_FORMATS, from_gguf, quantize_gguf_raw
from kt_ops.formats.int4 import from_int4
from kt_ops.formats.mxfp4 import E2M1_VALUES, from_mxfp4
from kt_ops.formats.nvfp4 import from_nvfp4
from kt_ops.formats.packed import PackedProjection
from kt_ops.formats.qint import (
    FOUR_BIT_PLANE_BEFORE_V3,
    kquant_scale_values,
    pack_codes,
    pack_group_params,
    pack_kquant_scales,
    repack_codes,
    repack_four_bit_plane,
    unpack_codes,
    unpack_group_params,
    unpack_kquant_scales,
)
from kt_ops.formats.quantize import quantize_weights
from kt_ops.formats.spec import BLOCK_ROWS, FORMATS, K_ALIGN, FormatSpec, format_spec, padded_k

__all__ = [
    "FORMATS",
    "FormatSpec",
    "format_spec",
    "PackedProjection",
    "quantize_weights",
    "dequantize_weights",
    "from_gguf",
    "from_fp8",
    "from_fp8_channel",
    "from_mxfp8",
    "from_mxfp4",
    "from_nvfp4",
    "from_int4",
    "quantize_activations_q8",
    "quantize_gguf_raw",
    "GGUF_FORMATS",
    "E2M1_VALUES",
    "MXFP4_Q_LUT",
    "IQ4NL_VALUES",
    "BLOCK_ROWS",
    "K_ALIGN",
    "padded_k",
    "pack_codes",
    "repack_codes",
    "repack_four_bit_plane",
    "FOUR_BIT_PLANE_BEFORE_V3",
    "unpack_codes",
    "pack_group_params",
    "unpack_group_params",
    "pack_kquant_scales",
    "unpack_kquant_scales",
    "kquant_scale_values",
]
