"""kt-kernel's methods on kt_ops: the format each runs, those refused, and where each reads.

The method table of :mod:`kt_ops.compat` (its module docstring has it in
words): :data:`METHODS` maps each kt-kernel ``method`` kt_ops runs to a
:class:`MethodMapping`, :data:`REFUSED` and :data:`SFT_METHODS` name the
others. For ``KTMoEWrapper.load_weights``, :func:`source_of` decides which
reader opens a ``weight_path`` (a ``kt-ops convert`` directory whatever the
method; else the method's own source), :func:`open_source` opens it (with
advice when the path holds kt-kernel's own converted layout) and
:func:`load_experts` loads one layer from it as the method runs it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from kt_ops.formats import FORMATS, format_spec
from kt_ops.layer import ExpertWeights

if TYPE_CHECKING:  # kt_ops.loaders needs safetensors and gguf, optional dependencies
    from kt_ops.loaders import CheckpointReader

__all__ = [
    "KT_KERNEL_VERSION",
    "METHODS",
    "REFUSED",
    "SFT_HINT",
    "SFT_METHODS",
    "MethodMapping",
    "group_choices",
    "load_experts",
    "method_mapping",
    "open_source",
    "source_of",
]

#: The kt-kernel release whose ``KTMoEWrapper`` API this module follows.
KT_KERNEL_VERSION = "0.7.2"


@dataclasses.dataclass(frozen=True)
class MethodMapping:
    """How a kt-kernel ``method`` runs on kt_ops.

    Attributes:
        method: the kt-kernel name (``"AMXINT4"``, ...).
        weight_format: the kt_ops format; None for ``LLAMAFILE`` (each GGUF
            tensor keeps its own type: ``q4_k,q4_k,q6_k`` mixes stay as they are).
        source: what ``load_weights`` reads: ``"hf"`` (Hugging Face safetensors
            through :class:`kt_ops.loaders.HFCheckpoint`), ``"rawint4"``
            (compressed-tensors int4), ``"quantized"`` (GPTQ, compressed-tensors
            NVFP4, DeepSeek-V4 MXFP4: :class:`kt_ops.loaders.QuantizedCheckpoint`)
            or ``"gguf"`` (:class:`kt_ops.loaders.GGUFCheckpoint`).
        exact: True when kt_ops holds exactly the weights kt-kernel holds.
        note: one line for the table.
        group_size: the int4 group the method fixes (0: per output channel), or None
            where the wrapper's ``group_size`` picks it.
        symmetric: False for the asymmetric int4 methods (zero points).
    """

    method: str
    weight_format: Optional[str]
    source: str
    exact: bool
    note: str
    group_size: Optional[int] = None
    symmetric: bool = True


#: kt-kernel inference methods that kt_ops runs.
METHODS: dict[str, MethodMapping] = {
    m.method: m
    for m in (
        MethodMapping("BF16", "bf16", "hf", True, "bf16 HF safetensors"),
        MethodMapping("FP8", "fp8", "hf", True, "E4M3 + 128x128 weight_scale_inv, repacked"),
        MethodMapping("AMXINT8", "int8", "hf", True, "int8 per output channel"),
        MethodMapping("MOE_INT8", "int8", "hf", True, "int8 per output channel"),
        MethodMapping(
            "AMXINT4", "int4", "hf", False, "int4 per group of group_size (kt-kernel: per channel)"
        ),
        MethodMapping(
            "MOE_INT4", "int4", "hf", False, "int4 per group of group_size (kt-kernel: per channel)"
        ),
        MethodMapping("RAWINT4", "int4", "rawint4", True, "compressed-tensors int4, bf16 scales"),
        MethodMapping(
            "AMXINT4_1", "int4", "hf", True, "asymmetric int4 per output channel", 0, False
        ),
        MethodMapping(
            "AMXINT4_1KGroup",
            "int4",
            "hf",
            True,
            "asymmetric int4 per group of group_size",
            None,
            False,
        ),
        MethodMapping("GPTQ_INT4", "int4", "quantized", True, "GPTQ qweight/qzeros/scales"),
        MethodMapping("NVFP4", "nvfp4", "quantized", True, "compressed-tensors / ModelOpt NVFP4"),
        MethodMapping("MXFP4", "mxfp4", "quantized", True, "DeepSeek-V4 ffn.experts MXFP4"),
        MethodMapping(
            "FP8_PERCHANNEL", "fp8_channel", "quantized", True, "fp8 + weight_scale per channel"
        ),
        MethodMapping("MXFP8", "mxfp8", "quantized", True, "fp8 + UE8M0 weight_scale_inv per 32"),
        MethodMapping("LLAMAFILE", None, "gguf", True, "GGUF blocks, each tensor its own type"),
    )
}

#: kt-kernel inference methods kt_ops refuses: method -> (nearest kt_ops format, why).
REFUSED: dict[str, tuple[str, str]] = {
    "SYCL_GPTQ_INT4": ("int4", "it runs GPTQ experts on a SYCL device; kt_ops runs on the CPU"),
}

#: kt-kernel 0.7.2's ``mode='sft'`` methods (all refused).
SFT_METHODS = frozenset(
    {
        "AMXBF16_SFT",
        "AMXFP8_SFT",
        "MXFP4_SFT",
        "INT8_SFT",
        "AMXINT8_SFT",
        "AMXINT4_SFT",
        "AMXINT4_1_SFT",
        "RAWINT4_SFT",
        "AMXINT4_KGroup_SFT",
        "AMXINT4_1KGroup_SFT",
        "AMXBF16_SFT_SkipLoRA",
        "AMXINT8_SFT_SkipLoRA",
        "AMXINT4_SFT_SkipLoRA",
        "AMXINT4_1_SFT_SkipLoRA",
        "AMXINT4_KGroup_SFT_SkipLoRA",
        "AMXINT4_1KGroup_SFT_SkipLoRA",
    }
)

SFT_HINT = (
    "kt_ops trains LoRA on the experts through kt_ops.replace_experts(model, fmt) + "
    "kt_ops.apply_lora(model) (README, 'LoRA fine-tuning')"
)


def method_mapping(method: str) -> MethodMapping:
    """The :class:`MethodMapping` of kt-kernel inference ``method``.

    Raises:
        ValueError: ``method`` is refused (the message names the nearest kt_ops
            format and why), an SFT method, or unknown (the message lists the
            supported methods).
    """
    if method in METHODS:
        return METHODS[method]
    if method in REFUSED:
        nearest, why = REFUSED[method]
        raise ValueError(
            f"method={method!r} is not supported by kt_ops.compat: {why}. The nearest kt_ops "
            f"weight format is {nearest!r}; supported methods: {sorted(METHODS)}"
        )
    if method in SFT_METHODS:
        raise ValueError(f"method={method!r} is a kt-kernel SFT method; {SFT_HINT}")
    raise ValueError(
        f"unknown method {method!r}; kt_ops.compat runs {sorted(METHODS)} (kt-kernel "
        f"{KT_KERNEL_VERSION} methods it refuses: {sorted(REFUSED)})"
    )


def group_choices(fmt: Optional[str]) -> tuple[int, ...]:
    """The group sizes ``group_size`` picks from for format ``fmt`` (int4); () for a format
    with one group size (it keeps its own) and for LLAMAFILE (None)."""
    groups = format_spec(fmt).group_sizes if fmt is not None else ()
    return groups if len(groups) > 1 else ()


# ---------------------------------------------------------------------- weight sources

_KT_KERNEL_AMX_RE = re.compile(r"\.ffn_(?:gate|up|down)_exps\.\d+\.numa\.\d+\.(?:weight|scale)$")


def _kt_kernel_layout_error(path: Path, method: str, fmt: Optional[str]) -> Optional[ValueError]:
    """A ValueError when ``path`` holds kt-kernel's own converted layout, else None."""
    # kt_ops.loaders needs safetensors and gguf, optional dependencies of kt_ops.
    from kt_ops.loaders.compressed_tensors import safetensors_files, tensor_names

    try:
        names = tensor_names(safetensors_files(path))
    except (ValueError, OSError):
        return None
    hit = next((n for n in names if _KT_KERNEL_AMX_RE.search(n)), None)
    if hit is None:
        return None
    return ValueError(
        f"{path} holds kt-kernel's own converted {method} layout (e.g. {hit!r}), kt-kernel's "
        "internal tile layout, which kt_ops cannot read; pass the original Hugging Face "
        f"checkpoint as weight_path (kt_ops packs it as {fmt!r} while loading) or a directory "
        f"written by `kt-ops convert SRC OUT --format {fmt}`"
    )


#: What LLAMAFILE runs: the GGUF block types kt_ops repacks, and bf16 for float tensors.
_GGUF_RUN_FORMATS = frozenset({*(f for f in FORMATS if format_spec(f).is_gguf), "bf16"})


def _converted_dir(path: Path) -> bool:
    # "manifest.json": kt_ops.loaders.converted.MANIFEST_NAME (not imported: optional deps)
    return path.is_dir() and (path / "manifest.json").is_file()


def _find_gguf(path: Path, layer: int) -> Path:
    """``path`` if a file, else the ``*.gguf`` file of folder ``path`` holding block ``layer``."""
    if path.is_file():
        return path
    files = sorted(path.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"{path}: no .gguf file for method LLAMAFILE")
    if len(files) == 1:
        return files[0]
    pattern = f"blk.{layer}.ffn_gate_exps.weight"
    from gguf import GGUFReader  # optional dependency of kt_ops

    for f in files:
        try:
            if any(t.name == pattern for t in GGUFReader(str(f)).tensors):
                return f
        except Exception as e:
            raise ValueError(f"{f}: not a readable GGUF file: {e}") from e
    raise ValueError(f"{path}: no .gguf file has tensor {pattern}")


def source_of(path: Path, mapping: MethodMapping, layer: int) -> tuple[str, Path]:
    """What reads ``weight_path`` ``path`` for ``mapping``'s method: ``(source, file)``.

    ``source`` is ``"converted"`` for a ``kt-ops convert`` directory (any
    method), else ``mapping.source``; ``file`` is the path to open (for
    ``"gguf"``, the ``.gguf`` file of a folder that holds block ``layer``).
    """
    if _converted_dir(path):
        return "converted", path
    if mapping.source == "gguf":
        return "gguf", _find_gguf(path, layer)
    return mapping.source, path


def open_source(source: str, path: Path, method: str, mapping: MethodMapping) -> CheckpointReader:
    """The reader of ``source`` (:func:`source_of`) on ``path``.

    Raises what the reader raises; for a Hugging Face source that holds
    kt-kernel's own converted layout, a ValueError saying what to pass instead.
    """
    # kt_ops.loaders needs safetensors and gguf, optional dependencies of kt_ops.
    from kt_ops.loaders import (
        CompressedTensorsCheckpoint,
        ConvertedExperts,
        GGUFCheckpoint,
        HFCheckpoint,
    )

    if source == "converted":
        return ConvertedExperts(path)
    if source == "gguf":
        return GGUFCheckpoint(path)
    if source == "rawint4":
        return CompressedTensorsCheckpoint(path)
    if source == "quantized":
        from kt_ops.loaders import QuantizedCheckpoint

        return QuantizedCheckpoint(path)
    try:
        return HFCheckpoint(path)
    except (ValueError, FileNotFoundError) as e:
        better = _kt_kernel_layout_error(path, method, mapping.weight_format)
        if better is not None:
            raise better from e
        raise


def load_experts(
    reader: CheckpointReader, method: str, mapping: MethodMapping, layer: int, group_size: int
) -> ExpertWeights:
    """Layer ``layer`` of ``reader`` as ``method`` runs it.

    A Hugging Face checkpoint is packed (quantized) to the method's format,
    with ``group_size`` where the format has a choice (int4); the packed
    sources load as stored. A converted directory must hold the method's
    format (LLAMAFILE: GGUF types and bf16), else ValueError.
    """
    fmt = mapping.weight_format
    if reader.kind == "hf_safetensors":
        group = mapping.group_size
        if group is None:
            group = group_size if group_choices(fmt) else None
        return reader.load_layer(layer, fmt, group, mapping.symmetric)
    experts = reader.load_layer(layer)
    if reader.kind == "converted":
        got = {p.weight_format for p in experts.projections}
        ok = got == {fmt} if fmt is not None else got <= _GGUF_RUN_FORMATS
        if not ok:
            raise ValueError(
                f"{reader.path}: layer {layer} is converted to {sorted(got)}, method "
                f"{method!r} runs {fmt or 'GGUF types'!r}"
            )
    return experts
