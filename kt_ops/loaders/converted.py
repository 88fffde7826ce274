"""A ``kt-ops convert`` directory: its layout, its checks, and :class:`ConvertedExperts`.

:func:`kt_ops.convert.convert` writes the directory; this module defines and
reads it:

* ``layer_{L:03d}.safetensors`` per MoE layer ``L``, with tensors
  ``gate.weight``, ``gate.scales``, ``gate.zeros``, ``up.*``, ``down.*`` (those
  the format has; layouts in docs/formats.md) and the projection descriptions
  as JSON in the safetensors metadata key ``"kt_ops"``;
* ``manifest.json``: ``manifest_version``, ``kt_ops_version``, ``format`` (the
  requested format, ``"native"`` for the source's own), ``group_size``
  (requested, None for the format's default), ``symmetric``, ``source``
  (``path``, ``kind``: ``hf_safetensors`` or ``gguf``, ``dtype``),
  ``num_layers``, ``moe_layers``, and ``layers``: ``{"L": {"file", "sha256",
  "bytes", "shape": [E, I, H], "projections": {"gate": {"format",
  "group_size", "n", "k", "tensors"}, ...}}}``.

**Integrity.** :func:`read_manifest` checks the type and value of every
manifest field and the consistency of each entry (``file`` must be
``layer_{L:03d}.safetensors``, ``n``/``k`` must follow from ``shape``);
anything else is a ValueError naming ``manifest.json`` and the field. The
layer file's own metadata (``kt_ops``: ``layer``, ``shape``, ``projections``;
covered by the file's sha256) is the source of truth when loading: its layer
index must be the one asked for, and the manifest entry's ``shape`` and
``projections`` must equal it, so an edited manifest (``n``/``k``, swapped
``file``/``sha256`` pairs) is refused, never loaded. Files without that
metadata are refused; every version of the converter wrote it.

**Format versions.** ``manifest_version`` 3 (this kt_ops) stores ``q2_k`` and ``q3_k``
codes in 2- and 3-bit planes; version 2 stored them in the 4-bit plane, and stores the GGUF
k-quants (``q4_k``, ``q5_k``, ``q6_k``; later ``q2_k``, ``q3_k``, ``iq4_xs``) with GGUF's
own super-block scales (docs/formats.md), as version 3 does. Directories of version 2 load,
their ``q2_k`` / ``q3_k`` codes repacked on load (lossless). Directories of version 1 still
load when they hold no k-quant projection (no other layout changed); one that does is
refused with a ValueError naming ``manifest_version 1`` and the layer: convert the source
again.

**Reading back.** :func:`load_converted` and :class:`ConvertedExperts` verify
each file's sha256 against the manifest before loading it and raise a
FileNotFoundError / ValueError naming the file when it is missing, truncated,
altered, not valid safetensors, or does not match its manifest entry. The
tensors are bit-identical to ``open_checkpoint(SRC).load_layer(L, ...)`` with
the same arguments.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional, Union

from safetensors import safe_open

from kt_ops.formats import (
    FORMATS,
    FOUR_BIT_PLANE_BEFORE_V3,
    PackedProjection,
    format_spec,
    repack_four_bit_plane,
)
from kt_ops.layer import PROJECTIONS, ExpertWeights, join_weight_format
from kt_ops.loaders._common import check_format
from kt_ops.loaders.base import CheckpointReader, expert_weights

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "ConvertedExperts",
    "layer_file_name",
    "load_converted",
    "read_manifest",
    "sha256_file",
]

MANIFEST_NAME = "manifest.json"
#: 3: q2_k and q3_k codes in 2- and 3-bit planes (2.625 / 3.5625 bits per weight). 2: the
#: GGUF k-quants (q4_k, q5_k, q6_k) store GGUF's own super-block scales (uint8 scale
#: records, 4.5 / 5.5 / 6.5625 bits per weight), q2_k / q3_k codes in the 4-bit plane.
#: 1: k-quants stored fp32 ``d*sc`` scales and ``dmin*m`` zeros (6 / 7 / 8 bits per weight).
MANIFEST_VERSION = 3
#: Versions this kt_ops reads: a version-1 directory still loads where it holds no
#: k-quant projection (every other layout is unchanged); one with k-quants is refused
#: (:func:`_check_layout_version`), as is resuming into any version-1 directory. A
#: version-2 directory loads, its q2_k / q3_k codes repacked from the 4-bit plane on
#: load (:func:`kt_ops.formats.repack_four_bit_plane`: lossless; the file's bytes are
#: checked first).
_READABLE_VERSIONS = (1, 2, 3)
_KQUANT_V2 = tuple(f for f in FORMATS if format_spec(f).is_kquant)
_PathLike = Union[str, Path]


def layer_file_name(layer: int) -> str:
    """File name of MoE layer ``layer`` in a converted directory: ``layer_{L:03d}.safetensors``."""
    return f"layer_{layer:03d}.safetensors"


def sha256_file(path: _PathLike) -> str:
    """Hex sha256 of a file's bytes (read in 8 MiB pieces)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(8 << 20)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def read_manifest(out_dir: _PathLike) -> dict:
    """The parsed ``manifest.json`` of a converted directory.

    Raises FileNotFoundError when it is absent and ValueError (naming the file
    and the field) when it is not JSON, lacks a field, or has a field of the
    wrong type or value (see :func:`_validate_manifest`).
    """
    path = Path(out_dir) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {out_dir} is not a converted directory")
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(m, dict) or not all(k in m for k in ("manifest_version", "format", "layers")):
        raise ValueError(f"{path}: not a kt_ops manifest (needs manifest_version, format, layers)")
    version = m["manifest_version"]
    if isinstance(version, bool) or version not in _READABLE_VERSIONS:
        raise ValueError(
            f"{path}: manifest_version {version!r}; this kt_ops reads "
            f"{', '.join(map(str, _READABLE_VERSIONS))}"
        )
    _validate_manifest(path, m)
    _check_layout_version(path, m)
    return m


def _check_layout_version(path: Path, m: dict) -> None:
    """Refuse a version-1 directory that holds k-quants (their old fp32-scale layout)."""
    if m["manifest_version"] >= 2:
        return
    for L in sorted(m["layers"], key=int):
        for role, pm in sorted(m["layers"][L]["projections"].items()):
            if pm["format"] in _KQUANT_V2:
                raise ValueError(
                    f"{path}: manifest_version 1 directory: layer {L} {role} is "
                    f"{pm['format']} in the old k-quant layout (fp32 d*sc scales and dmin*m "
                    "zeros, 6 / 7 / 8 bits per weight), which this kt_ops no longer reads; it "
                    "stores k-quants as GGUF's own super-block scales (manifest_version "
                    f"{MANIFEST_VERSION}). Convert the source again into a new directory "
                    "(kt-ops convert SRC NEW_OUT)"
                )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad(where: Any, field: str, value: Any, expected: str) -> ValueError:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return ValueError(f"{where}: field {field!r} is {text}; expected {expected}")


def _check_layer_desc(where: Any, prefix: str, shape: Any, projections: Any) -> None:
    """Check ``shape`` ``[E, I, H]`` and ``projections`` of one layer, and that they agree.

    Used for the manifest's entries and for each layer file's own metadata.
    """
    if not (
        isinstance(shape, list) and len(shape) == 3 and all(_is_int(v) and v > 0 for v in shape)
    ):
        raise _bad(where, f"{prefix}shape", shape, "[E, I, H], three positive ints")
    E, inter, hidden = shape
    if not isinstance(projections, dict) or sorted(projections) != sorted(PROJECTIONS):
        raise _bad(where, f"{prefix}projections", projections, "an object with gate, up, down")
    nk = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    for role in PROJECTIONS:
        p = projections[role]
        f = f"{prefix}projections.{role}"
        if not isinstance(p, dict):
            raise _bad(where, f, p, "an object with format, group_size, n, k, tensors")
        if not isinstance(p.get("format"), str) or p["format"] not in FORMATS:
            raise _bad(where, f"{f}.format", p.get("format"), f"one of {', '.join(FORMATS)}")
        gs = p.get("group_size")
        if not _is_int(gs) or gs not in format_spec(p["format"]).group_sizes:
            raise _bad(
                where,
                f"{f}.group_size",
                gs,
                f"one of {format_spec(p['format']).group_sizes} for {p['format']}",
            )
        for dim, want in zip(("n", "k"), nk[role]):
            if not _is_int(p.get(dim)) or p.get(dim) != want:
                raise _bad(where, f"{f}.{dim}", p.get(dim), f"{want} (from {prefix}shape {shape})")
        names = p.get("tensors")
        if (
            not isinstance(names, list)
            or not all(isinstance(n, str) for n in names)
            or "weight" not in names
            or not set(names) <= {"weight", "scales", "zeros", "bias"}
            or len(set(names)) != len(names)
        ):
            raise _bad(
                where,
                f"{f}.tensors",
                names,
                "a list of weight and optionally scales, zeros, bias",
            )
        extra = set(p) - {"format", "group_size", "n", "k", "tensors"}
        if extra:
            raise _bad(where, f"{f}", sorted(extra), "no other keys")


def _validate_manifest(path: Path, m: dict) -> None:
    """Raise ValueError naming ``path`` and the field unless ``m`` is a well-formed manifest.

    Checks every field's type and the consistency of each layer entry (file
    name, checksum, shape against the projections' ``n``/``k``). Whether an
    entry matches its file is checked when the file is loaded
    (:func:`_load_entry`): the layer file's own metadata, covered by its
    sha256, is the source of truth.
    """
    if not isinstance(m["format"], str) or (m["format"] != "native" and m["format"] not in FORMATS):
        raise _bad(path, "format", m["format"], f"'native' or one of {', '.join(FORMATS)}")
    if not isinstance(m.get("kt_ops_version"), str):
        raise _bad(path, "kt_ops_version", m.get("kt_ops_version"), "a version string")
    gs = m.get("group_size")
    if gs is not None and (not _is_int(gs) or gs < 0):
        raise _bad(path, "group_size", gs, "a non-negative int or null")
    if not isinstance(m.get("symmetric"), bool):
        raise _bad(path, "symmetric", m.get("symmetric"), "true or false")
    src = m.get("source")
    if not isinstance(src, dict):
        raise _bad(path, "source", src, "an object with path, kind, dtype")
    for key in ("path", "kind"):
        if not isinstance(src.get(key), str):
            raise _bad(path, f"source.{key}", src.get(key), "a string")
    if src.get("dtype") is not None and not isinstance(src.get("dtype"), str):
        raise _bad(path, "source.dtype", src.get("dtype"), "a string or null")
    num_layers = m.get("num_layers")
    if not _is_int(num_layers) or num_layers < 0:
        raise _bad(path, "num_layers", num_layers, "a non-negative int")
    moe = m.get("moe_layers")
    if (
        not isinstance(moe, list)
        or not all(_is_int(v) and v >= 0 for v in moe)
        or moe != sorted(set(moe))
    ):
        raise _bad(path, "moe_layers", moe, "a sorted list of distinct layer indices")
    layers = m["layers"]
    if not isinstance(layers, dict) or not layers:
        # The converter writes its first manifest with its first finished layer.
        raise _bad(path, "layers", layers, 'an object {"L": entry} of at least one layer')
    for key, entry in layers.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and key == str(int(key))):
            raise _bad(path, "layers", key, "layer indices as keys ('0', '1', ...)")
        L = int(key)
        f = f"layers.{key}"
        if L not in moe:
            raise _bad(path, f, L, f"a layer of moe_layers {moe}")
        if not isinstance(entry, dict):
            raise _bad(path, f, entry, "an object with file, sha256, bytes, shape, projections")
        if entry.get("file") != layer_file_name(L):
            raise _bad(path, f"{f}.file", entry.get("file"), repr(layer_file_name(L)))
        digest = entry.get("sha256")
        if not (
            isinstance(digest, str)
            and len(digest) == 64
            and all(c in "0123456789abcdef" for c in digest)
        ):
            raise _bad(path, f"{f}.sha256", digest, "64 lower-case hex digits")
        if not _is_int(entry.get("bytes")) or entry["bytes"] < 0:
            raise _bad(path, f"{f}.bytes", entry.get("bytes"), "a non-negative int")
        _check_layer_desc(path, f"{f}.", entry.get("shape"), entry.get("projections"))
        if m["format"] != "native":
            for role in PROJECTIONS:
                fmt = entry["projections"][role]["format"]
                if fmt != m["format"]:
                    raise _bad(path, f"{f}.projections.{role}.format", fmt, repr(m["format"]))


def _file_meta(path: Path, f: Any) -> dict:
    """The ``kt_ops`` metadata of an open layer file, checked (ValueError naming the file)."""
    raw = (f.metadata() or {}).get("kt_ops")
    if raw is None:
        raise ValueError(
            f"{path}: has no 'kt_ops' metadata (layer, shape, projections); it was not written "
            "by kt-ops convert"
        )
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: its 'kt_ops' metadata is not JSON ({e})") from e
    if not isinstance(meta, dict):
        raise _bad(path, "kt_ops metadata", meta, "an object with layer, shape, projections")
    if not _is_int(meta.get("layer")) or meta["layer"] < 0:
        raise _bad(path, "kt_ops metadata layer", meta.get("layer"), "a layer index")
    _check_layer_desc(path, "kt_ops metadata ", meta.get("shape"), meta.get("projections"))
    return meta


def _check_file_agrees(path: Path, layer: int, entry: dict, meta: dict, keys: set) -> None:
    """The layer file's own metadata (covered by its sha256) must match the manifest entry."""
    if meta["layer"] != layer:
        raise ValueError(
            f"{path}: holds MoE layer {meta['layer']} (its own metadata) but the manifest lists "
            f"it for layer {layer}; the manifest does not match the files"
        )
    for field in ("shape", "projections"):
        if meta[field] != entry.get(field):
            raise ValueError(
                f"{path} (layer {layer}): the manifest's {field} {entry.get(field)!r} differs "
                f"from the file's own {meta[field]!r}; the manifest was edited or does not "
                "belong to these files"
            )
    want = {f"{r}.{n}" for r in PROJECTIONS for n in meta["projections"][r]["tensors"]}
    if keys != want:
        raise ValueError(
            f"{path} (layer {layer}): holds tensors {sorted(keys)}; its metadata lists "
            f"{sorted(want)}"
        )


def _load_entry(out: Path, manifest: dict, layer: int, verify: bool) -> ExpertWeights:
    """Load one layer; the manifest entry must agree with the file's own metadata.

    The manifest was checked by :func:`read_manifest`. The sha256 (with
    ``verify``) covers the file, whose metadata records its layer index, shape
    and projections: those decide what is loaded, and any manifest field that
    differs is an error. So an edited manifest (``n``/``k``, swapped files and
    checksums) cannot change what is computed.
    """
    entry = manifest["layers"].get(str(layer))
    if entry is None:
        have = sorted(int(k) for k in manifest["layers"])
        raise ValueError(
            f"{out / MANIFEST_NAME}: layer {layer} was not converted; converted layers: {have}"
        )
    path = out / entry["file"]
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} (layer {layer}) is missing from the converted directory; rerun kt-ops "
            "convert into it to rewrite the layer"
        )
    size = path.stat().st_size
    if not verify and size != entry["bytes"]:  # the cheap check; the sha256 covers it
        raise ValueError(
            f"{path} (layer {layer}) has {size} bytes, the manifest records {entry['bytes']}: "
            "the file is truncated or altered; rerun kt-ops convert into the directory to "
            "rewrite it"
        )
    if verify:
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise ValueError(
                f"{path} (layer {layer}) does not match the manifest (sha256 {digest}, expected "
                f"{entry['sha256']}): the file is truncated or altered; rerun kt-ops convert "
                "into the directory to rewrite it"
            )
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            meta = _file_meta(path, f)
            tensors = {k: f.get_tensor(k) for k in keys}
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"{path} (layer {layer}): not a valid safetensors file: {e}") from e
    _check_file_agrees(path, layer, entry, meta, keys)
    E = meta["shape"][0]
    out = {}
    for role in PROJECTIONS:
        pm = meta["projections"][role]
        ts = {n: tensors[f"{role}.{n}"] for n in pm["tensors"]}
        try:
            if manifest["manifest_version"] < 3 and pm["format"] in FOUR_BIT_PLANE_BEFORE_V3:
                ts["weight"] = repack_four_bit_plane(ts["weight"], pm["format"], pm["n"], pm["k"])
            p = PackedProjection(
                weight=ts["weight"],
                scales=ts.get("scales"),
                zeros=ts.get("zeros"),
                weight_format=pm["format"],
                group_size=pm["group_size"],
                n=pm["n"],
                k=pm["k"],
                bias=ts.get("bias"),
            ).validate()
            if p.weight.dim() < 1 or p.weight.shape[0] != E:
                raise ValueError(f"{E} experts in the metadata, {p.weight.shape[0]} in the weight")
        except Exception as e:
            raise ValueError(f"{path} (layer {layer}) {role}: invalid packed tensors: {e}") from e
        out[role] = p
    return expert_weights(**out, where=f"{path} (layer {layer})")


def load_converted(out_dir: _PathLike, layer: int, *, verify: bool = True) -> ExpertWeights:
    """Load one layer of a converted directory.

    Args:
        out_dir: a directory written by :func:`kt_ops.convert.convert`.
        layer: a converted MoE layer index.
        verify: check the file's sha256 against the manifest first (default).

    Returns:
        :class:`~kt_ops.layer.ExpertWeights` (gate, up ``[E, I, H]``, down ``[E, H, I]``),
        bit-identical to the source loader's ``load_layer`` with the conversion's
        arguments.

    Raises:
        FileNotFoundError: no manifest, or the layer's file is missing.
        ValueError: the layer was not converted, or its file is truncated, altered
            (sha256 mismatch) or not valid safetensors (the message names the file).
    """
    out = Path(out_dir)
    return _load_entry(out, read_manifest(out), int(layer), verify)


class ConvertedExperts(CheckpointReader):
    """A converted directory: iterate its layers or index them.

    ``ConvertedExperts(out_dir)[L]`` and ``.load_layer(L)`` load layer ``L``
    (verified, as :func:`load_converted`); iterating yields ``(layer,
    ExpertWeights)`` in layer order, one layer in memory at a time. Attributes:
    ``path``, ``kind`` (``"converted"``), ``manifest``, ``weight_format``
    (``"native"`` or a format name),
    ``group_size``, ``symmetric``, ``layers`` (converted MoE layers),
    ``moe_layers`` (all MoE layers of the source), ``complete``,
    ``num_experts``, ``hidden_size``, ``intermediate_size`` (first converted
    layer; ``layer_shape(L)`` for any).

    Raises FileNotFoundError / ValueError as :func:`read_manifest`.
    """

    kind = "converted"

    def __init__(self, out_dir: _PathLike, *, verify: bool = True) -> None:
        self.path = Path(out_dir)
        self.verify = verify
        self.manifest = read_manifest(self.path)
        m = self.manifest
        self.weight_format = m["format"]
        self.group_size = m.get("group_size")
        self.symmetric = m.get("symmetric")
        self.layers = sorted(int(k) for k in m["layers"])
        self.moe_layers = list(m.get("moe_layers", self.layers))
        self.complete = set(self.moe_layers) <= set(self.layers)
        if self.layers:
            self.num_experts, self.intermediate_size, self.hidden_size = self.layer_shape(
                self.layers[0]
            )
        else:
            self.num_experts = self.intermediate_size = self.hidden_size = 0

    def layer_shape(self, layer: int) -> tuple[int, int, int]:
        """``(E, I, H)`` of a converted layer (from the manifest)."""
        entry = self.manifest["layers"].get(str(layer))
        if entry is None:
            raise ValueError(f"{self.path}: layer {layer} was not converted; have {self.layers}")
        try:
            E, inter, hidden = entry["shape"]
            return int(E), int(inter), int(hidden)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{self.path / MANIFEST_NAME}: malformed shape for layer {layer}"
            ) from e

    def check_weight_format(self, layer: int, weight_format: Optional[str]) -> None:
        """A layer loads as converted: ``weight_format`` must be None or its format."""
        check_format(weight_format)
        self.layer_shape(layer)
        if weight_format is None:
            return
        entry = self.manifest["layers"][str(layer)]["projections"]
        have = [entry[r]["format"] for r in PROJECTIONS]
        if any(f != weight_format for f in have):
            raise ValueError(
                f"{self.path}: layer {layer} is converted to {join_weight_format(*have)!r}, not "
                f"{weight_format!r}; a converted directory loads as converted (weight_format=None)"
            )

    def load_layer(
        self,
        layer: int,
        weight_format: Optional[str] = None,
        group_size: Optional[int] = None,
        symmetric: bool = True,
    ) -> ExpertWeights:
        """Load (and verify) one layer as converted.

        ``weight_format`` must be None or the layer's format (a converted
        directory is not requantized); ``group_size`` and ``symmetric`` are not
        used. Raises as :func:`load_converted`.
        """
        layer = int(layer)
        if weight_format is not None:
            self.check_weight_format(layer, weight_format)
        return _load_entry(self.path, self.manifest, layer, self.verify)

    def __getitem__(self, layer: int) -> ExpertWeights:
        return self.load_layer(layer)

    def __iter__(self) -> Iterator[tuple[int, ExpertWeights]]:
        for L in self.layers:
            yield L, self.load_layer(L)

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return (
            f"ConvertedExperts({str(self.path)!r}, format={self.weight_format!r}, "
            f"layers={len(self.layers)}/{len(self.moe_layers)})"
        )
