"""Online quantizers: dense ``[E, N, K]`` float weights -> :class:`PackedProjection`."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kt_ops.formats.bf16 import pack_weights
from kt_ops.formats.fp8 import quantize_fp8, quantize_fp8_channel, quantize_mxfp8
from kt_ops.formats.gguf_blocks import from_gguf, quantize_gguf_raw
from kt_ops.formats.mxfp4 import quantize_mxfp4
from kt_ops.formats.nvfp4 import quantize_nvfp4
from kt_ops.formats.packed import PackedProjection
from kt_ops.formats.qint import pack_codes, pack_group_params
from kt_ops.formats.spec import FORMATS, format_spec

__all__ = ["quantize_weights", "quantize_chunk"]

#: The formats that hold zeros (a zeros tensor, or the k-quants' mins in their records).
_ASYMMETRIC_FORMATS = tuple(
    f for f in FORMATS if format_spec(f).has_zeros or format_spec(f).record_mins
)


def _quantize_int8(w: Tensor) -> PackedProjection:
    E, N, K = w.shape
    amax = w.abs().amax(dim=-1, keepdim=True)  # [E, N, 1]
    scale = amax / 127
    q = torch.where(scale > 0, torch.round(w / torch.where(scale > 0, scale, 1.0)), 0.0)
    q = q.clamp(-127, 127).to(torch.int8)
    p = PackedProjection(
        pack_codes(q, 8), pack_group_params(scale, torch.float32), None, "int8", 0, N, K
    )
    return p.validate()


def _fp16(x: Tensor) -> Tensor:
    h = x.to(torch.float16)
    if not bool(torch.isfinite(h).all()):
        raise ValueError("quantize_weights: weight is too large for the fp16 int4 scales")
    return h


def _quantize_int4(w: Tensor, group_size: int, symmetric: bool) -> PackedProjection:
    E, N, K = w.shape
    per_channel = group_size == 0
    group_size = group_size or K  # 0: one group per output channel
    wg = w.view(E, N, K // group_size, group_size)
    if symmetric:
        scale16 = _fp16(wg.abs().amax(dim=-1) / 7)
        s = scale16.float().unsqueeze(-1)
        q = torch.round(wg / torch.where(s > 0, s, 1.0)) + 8
        q = torch.where(s > 0, q, 8.0).clamp(0, 15)
        zeros = None
    else:
        # GPTQ-style range that always contains 0, so the integer zero point is in [0, 15].
        mn = wg.amin(dim=-1).clamp(max=0)
        mx = wg.amax(dim=-1).clamp(min=0)
        scale16 = _fp16((mx - mn) / 15)
        s = scale16.float()
        safe = torch.where(s > 0, s, 1.0)
        z = torch.where(s > 0, torch.round(-mn / safe), 0.0).clamp(0, 15)
        q = torch.round(wg / safe.unsqueeze(-1)) + z.unsqueeze(-1)
        q = torch.where(s.unsqueeze(-1) > 0, q, 0.0).clamp(0, 15)
        zeros = pack_group_params(_fp16(s * z), torch.float16)
    p = PackedProjection(
        pack_codes(q.to(torch.uint8).view(E, N, K), 4, pad_code=8),
        pack_group_params(scale16, torch.float16),
        zeros,
        "int4",
        0 if group_size == K and per_channel else group_size,
        N,
        K,
    )
    return p.validate()


def quantize_weights(
    weight: Tensor,
    weight_format: str,
    group_size: Optional[int] = None,
    symmetric: bool = True,
) -> PackedProjection:
    """Quantize dense expert weights ``[E, N, K]`` into ``weight_format``.

    ``weight`` is any floating dtype (fp32 math; it is moved to the CPU); ``N``
    output rows, ``K`` inputs (``nn.Linear`` convention). Per format
    (docs/formats.md):

    * ``bf16``: ``kt_ops.pack_weights(weight, 'bf16')`` (round to nearest even).
    * ``int8``: symmetric per output channel, ``scale = amax / 127`` (fp32),
      ``q = round_half_even(w / scale)``.
    * ``int4``: groups of ``group_size`` (32, 64, 128; default 128) along K,
      ``K % group_size == 0``, or ``group_size=0``: one group per output channel
      (kt-kernel's ``AMXINT4`` / ``AMXINT4_1``). Symmetric: ``scale = amax / 7`` stored fp16,
      ``q = clamp(round(w / scale) + 8, 0, 15)``, no zeros. Asymmetric
      (``symmetric=False``; GPTQ/AWQ zero point): over the group range
      widened to contain 0, ``scale = (max - min) / 15`` (fp16),
      ``z = clamp(round(-min / scale), 0, 15)``, ``q = clamp(round(w /
      scale) + z, 0, 15)``, ``zeros = scale * z`` (fp16, weight units). ``q``
      and ``z`` use the stored (fp16-rounded) scale.
    * ``fp8``: E4M3 (Micikevicius et al. 2022) with 128x128 block scales
      ``amax / 448`` (fp32, DeepSeek-V3 ``weight_scale_inv`` convention).
    * ``mxfp4``: OCP MX v1.0 shared exponent per 32 along K and E2M1
      elements (nearest, ties to even, saturating).
    * ``fp8_channel``: E4M3 with one fp32 scale ``amax / 448`` per output channel.
    * ``mxfp8``: OCP MX v1.0 MXFP8, a UE8M0 exponent per 32 along K, E4M3 elements.
    * ``nvfp4``: NVIDIA NVFP4, per-expert fp32 scale ``amax / (448 * 6)``, E4M3 scale
      per 16 along K, E2M1 elements (:func:`kt_ops.formats.nvfp4.quantize_nvfp4`).
    * ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``: ``gguf.quants.quantize``
      (llama.cpp's reference quantizers), repacked with ``from_gguf``; ``K`` a
      multiple of 32.
    * ``q2_k``, ``q3_k``, ``q4_k``, ``q5_k``, ``q6_k``: a simple round-to-nearest k-quant
      quantizer of this package (the ``gguf`` package cannot quantize them)
      writing valid GGUF blocks, repacked with ``from_gguf``; ``K`` a
      multiple of 256. For production weights convert a GGUF file instead.
    * ``iq4_nl``, ``iq4_xs``: llama.cpp's IQ4_NL grid with its scale search (no
      importance matrix; :func:`kt_ops.formats.gguf_blocks.quantize_gguf_raw`); ``K`` a
      multiple of 32 / 256.
    * ``iq1_s``, ``iq1_m``, ``iq2_xxs``, ``iq2_xs``, ``iq2_s``, ``iq3_xxs``, ``iq3_s``: a
      simple quantizer onto llama.cpp's lattice grids
      (:func:`kt_ops.formats.grid.quantize_grid`: every sub-scale tried per sub-block, no
      importance matrix; relative error on Gaussian weights about 0.49, 0.44, 0.36,
      0.30, 0.26, 0.19, 0.15), for tests and small models; ``K`` a multiple of 256. Real
      weights come from GGUF files (``from_gguf``, the GGUF loader).

    Args:
        weight: ``[E, N, K]`` floating tensor, finite.
        weight_format: one of ``FORMATS``.
        group_size: ``None`` for the format's default, else one it allows
            (see ``format_spec(weight_format).group_sizes``).
        symmetric: ``False`` selects the zero-point variant of ``int4``;
            accepted (and ignored: always asymmetric) for ``q2_k``/``q4_k``/``q5_k``.

    Returns:
        A validated :class:`PackedProjection` (``n = N``, ``k = K``), its tensors
        in 2 MiB pages where they hold at least 2 MiB
        (:func:`kt_ops.formats.packed.empty_huge_pages`).

    Raises:
        ValueError: naming the argument: unknown ``weight_format``; ``weight``
            not a 3-D floating tensor, empty, or non-finite; ``group_size``
            not allowed for the format or not dividing ``K``; ``K`` not a
            multiple of the GGUF block size; ``symmetric=False`` for a format
            without zeros; weights overflowing the fp16 scales.
    """
    # Decode streams these tensors once per call: 2 MiB pages (empty_huge_pages).
    return quantize_chunk(weight, weight_format, group_size, symmetric).in_huge_pages()


def quantize_chunk(
    weight: Tensor,
    weight_format: str,
    group_size: Optional[int] = None,
    symmetric: bool = True,
) -> PackedProjection:
    """:func:`quantize_weights` of a chunk of experts, left in torch's memory.

    For callers that concatenate the chunks of a projection with
    :func:`kt_ops.formats.packed.cat_experts`, which puts the whole in huge pages
    (``ExpertWeights.from_dense``, the loaders): one copy of the packed tensors
    instead of two. The same arguments, results and errors as ``quantize_weights``.
    """
    spec = format_spec(weight_format)
    if not isinstance(weight, Tensor) or weight.dim() != 3:
        what = list(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"quantize_weights: weight must be a 3-D tensor [E, N, K], got {what}")
    if not weight.is_floating_point():
        raise ValueError(f"quantize_weights: weight must be floating point, got {weight.dtype}")
    E, N, K = weight.shape
    if min(E, N, K) < 1:
        raise ValueError(f"quantize_weights: weight has an empty dimension: {list(weight.shape)}")
    if group_size is None:
        group_size = spec.default_group_size
    if isinstance(group_size, bool) or group_size not in spec.group_sizes:
        raise ValueError(
            f"quantize_weights: group_size={group_size!r} is not allowed for {spec.name!r}; "
            f"allowed: {spec.group_sizes}"
        )
    if not symmetric and not (spec.has_zeros or spec.record_mins):
        raise ValueError(
            f"quantize_weights: symmetric=False is not supported for {spec.name!r} (it has no "
            f"zeros); formats with zeros: {', '.join(_ASYMMETRIC_FORMATS)}"
        )
    w = weight.detach().to("cpu", torch.float32).contiguous()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_weights: weight holds NaN or infinite values")
    return _pack(w, spec.name, group_size, symmetric)


def _pack(w: Tensor, name: str, group_size: int, symmetric: bool) -> PackedProjection:
    """``quantize_weights`` of checked fp32 ``w`` ``[E, N, K]`` on the CPU."""
    spec = format_spec(name)
    E, N, K = w.shape
    if spec.name == "bf16":
        return PackedProjection(pack_weights(w), None, None, "bf16", 0, N, K).validate()
    if spec.name == "int8":
        return _quantize_int8(w)
    if spec.name == "int4":
        if group_size and K % group_size:
            raise ValueError(
                f"quantize_weights: K={K} is not a multiple of group_size={group_size} for 'int4'"
            )
        return _quantize_int4(w, group_size, symmetric)
    if spec.name == "fp8":
        return quantize_fp8(w)
    if spec.name == "fp8_channel":
        return quantize_fp8_channel(w)
    if spec.name == "mxfp8":
        return quantize_mxfp8(w)
    if spec.name == "mxfp4":
        return quantize_mxfp4(w)
    if spec.name == "nvfp4":
        return quantize_nvfp4(w)
    raw = quantize_gguf_raw(w.numpy(), spec.name)
    return from_gguf(spec.name, raw, N, K)
