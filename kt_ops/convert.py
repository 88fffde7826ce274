"""Convert a checkpoint's routed experts to packed kt_ops weights, and read them back.

``kt-ops convert SRC OUT --format int4 --group-size 128`` (or :func:`convert`)
reads SRC, a Hugging Face model directory (bf16/fp16/fp32, fp8, MXFP4: see
:mod:`kt_ops.loaders.hf_checkpoint`) or a ``.gguf`` file (see
:mod:`kt_ops.loaders.gguf_file`), one MoE layer at a time, and writes OUT:

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

**Crash safety and resuming.** Each layer is written to a hidden temporary
file, flushed, then renamed into place; the manifest is rewritten the same way
(temporary file + ``os.replace``) after every layer (it first appears with the
first finished layer). A rerun into the same OUT
skips every layer whose file is listed in the manifest, whose sha256 still
matches and whose own metadata agrees with its entry (it does not touch those
files), and redoes the others. A manifest
with another format, group size, symmetry, source path or kind, kt_ops
version or manifest version is refused (ValueError), as is a non-empty OUT without a manifest,
unless everything in it is the converter's own: temporary files and layer
files whose ``kt_ops`` metadata names the layer of their file name (left by a
run killed between renaming its first layer into place and writing the first
manifest). Those are rewritten (or removed when their layer is not asked for),
so a run killed at any point resumes.

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

**Memory.** One layer's packed weights plus one chunk of dense experts (see
:mod:`kt_ops.loaders`); never the whole model.

**Format versions.** ``manifest_version`` 2 (this kt_ops) stores the GGUF
k-quants (``q4_k``, ``q5_k``, ``q6_k``) with GGUF's own super-block scales
(docs/formats.md). Directories of version 1 still load when they hold no
k-quant projection (no other layout changed); one that does is refused with a
ValueError naming ``manifest_version 1`` and the layer: convert the source
again. Resuming into a version-1 directory is refused.

**Reading back.** :func:`load_converted` and :class:`ConvertedExperts` verify
each file's sha256 against the manifest before loading it and raise a
FileNotFoundError / ValueError naming the file when it is missing, truncated,
altered, not valid safetensors, or does not match its manifest entry. The
tensors are bit-identical to ``open_checkpoint(SRC).load_layer(L, ...)`` with
the same arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import kt_ops
from kt_ops.formats import FORMATS, PackedProjection, format_spec
from kt_ops.loaders import open_checkpoint
from kt_ops.loaders._common import PROJECTIONS, check_format

__all__ = [
    "MANIFEST_NAME",
    "ConvertedExperts",
    "convert",
    "layer_file_name",
    "load_converted",
    "main",
    "read_manifest",
    "sha256_file",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
#: 2: the GGUF k-quants (q4_k, q5_k, q6_k) store GGUF's own super-block scales
#: (uint8 scale records, 4.5 / 5.5 / 6.5625 bits per weight). 1: they stored
#: fp32 ``d*sc`` scales and ``dmin*m`` zeros (6 / 7 / 8 bits per weight).
MANIFEST_VERSION = 2
#: Versions this kt_ops reads: a version-1 directory still loads where it holds no
#: k-quant projection (every other layout is unchanged); one with k-quants is refused
#: (:func:`_check_layout_version`), as is resuming into any version-1 directory.
_READABLE_VERSIONS = (1, 2)
_KQUANT_V2 = tuple(f for f in FORMATS if format_spec(f).is_kquant)
_TMP_SUFFIX = ".tmp"
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


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.parent / f".{path.name}{_TMP_SUFFIX}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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
            or not set(names) <= {"weight", "scales", "zeros"}
            or len(set(names)) != len(names)
        ):
            raise _bad(
                where, f"{f}.tensors", names, "a list of weight and optionally scales, zeros"
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
    if not isinstance(layers, dict):
        raise _bad(path, "layers", layers, 'an object {"L": entry}')
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


def _write_manifest(out_dir: Path, manifest: dict) -> None:
    data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    _atomic_write_bytes(out_dir / MANIFEST_NAME, data)


def _projection_meta(p: PackedProjection) -> dict:
    return {
        "format": p.weight_format,
        "group_size": p.group_size,
        "n": int(p.n),
        "k": int(p.k),
        "tensors": sorted(p.tensors()),
    }


def _write_layer_file(path: Path, packed: dict[str, PackedProjection], meta: dict) -> None:
    """Write one layer's packed projections to ``path`` (safetensors), flushed to disk."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for role in PROJECTIONS:
        for name, t in packed[role].tensors().items():
            t = t.detach().contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:  # safetensors refuses tensors that share storage
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            tensors[f"{role}.{name}"] = t
    save_file(tensors, str(path), metadata={"kt_ops": json.dumps(meta, sort_keys=True)})
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


_LAYER_FILE_RE = re.compile(r"^layer_(\d{3,})\.safetensors$")


def _layer_of_name(name: str) -> Optional[int]:
    m = _LAYER_FILE_RE.match(name)
    return int(m[1]) if m and layer_file_name(int(m[1])) == name else None


def _own_orphan(path: Path) -> bool:
    """Whether ``path`` is a layer file of this converter (name and ``kt_ops`` metadata agree)."""
    layer = _layer_of_name(path.name)
    if layer is None or not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return _file_meta(path, f)["layer"] == layer
    except Exception:
        return False


def _layer_ok(out_dir: Path, layer: int, entry: Any) -> bool:
    """Whether a manifest entry's file exists, has the recorded sha256 and agrees with it."""
    if not isinstance(entry, dict) or "file" not in entry or "sha256" not in entry:
        return False
    path = out_dir / entry["file"]
    if not (path.is_file() and sha256_file(path) == entry["sha256"]):
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = _file_meta(path, f)
            keys = set(f.keys())
        _check_file_agrees(path, layer, entry, meta, keys)
    except Exception:
        return False
    return True


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


def _check_compatible(out_dir: Path, m: dict, want: dict) -> None:
    path = out_dir / MANIFEST_NAME
    checks = [
        ("format", m.get("format"), want["format"]),
        ("group_size", m.get("group_size"), want["group_size"]),
        ("symmetric", m.get("symmetric"), want["symmetric"]),
        ("source path", (m.get("source") or {}).get("path"), want["source"]["path"]),
        ("source kind", (m.get("source") or {}).get("kind"), want["source"]["kind"]),
        ("kt_ops_version", m.get("kt_ops_version"), want["kt_ops_version"]),
        ("manifest_version", m.get("manifest_version"), want["manifest_version"]),
    ]
    for what, have, asked in checks:
        if have != asked:
            raise ValueError(
                f"{path}: this directory holds a conversion with {what} {have!r}, not {asked!r}; "
                "use another output directory (or delete this one)"
            )


def convert(
    src: _PathLike,
    out_dir: _PathLike,
    weight_format: Optional[str] = None,
    group_size: Optional[int] = None,
    symmetric: bool = True,
    layers: Optional[Sequence[int]] = None,
    *,
    progress: Optional[bool] = None,
    on_layer_done: Optional[Callable[[int, Path], None]] = None,
) -> dict:
    """Convert the routed experts of ``src`` into ``out_dir`` (see the module docstring).

    Args:
        src: a Hugging Face model directory / safetensors file, or a ``.gguf`` file.
        out_dir: output directory (created if needed; must be empty or hold a
            compatible earlier conversion, which is resumed).
        weight_format: a ``kt_ops.formats.FORMATS`` name, or None for the source's
            own format (``fp8``/``mxfp4``/GGUF types repacked, float sources ``bf16``).
        group_size, symmetric: quantization options (``quantize_weights``); a None
            group size is recorded as the format's ``default_group_size``.
        layers: MoE layer indices to convert (default: all of them).
        progress: show a tqdm bar (default: when stderr is a terminal).
        on_layer_done: called as ``on_layer_done(layer, file)`` after each layer is
            written and recorded in the manifest (not for skipped layers).

    Returns:
        The final manifest (dict).

    Raises:
        FileNotFoundError: ``src`` does not exist.
        ValueError: bad format / layer arguments, an unreadable or unsupported
            source, or an ``out_dir`` that holds something else (another format,
            group size, symmetry, source, or no manifest but other files).
    """
    check_format(weight_format)
    if group_size is not None and (
        isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 0
    ):
        raise ValueError(f"group_size={group_size!r}: expected a non-negative int or None")
    if weight_format is not None and group_size is None:
        group_size = format_spec(weight_format).default_group_size
    source = open_checkpoint(src)
    if layers is None:
        todo = list(source.moe_layers)
    else:
        todo = sorted(set(int(L) for L in layers))
        bad = [L for L in todo if L not in source.moe_layers]
        if bad:
            raise ValueError(
                f"layers {bad} of {src} have no routed experts; MoE layers: {source.moe_layers}"
            )
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    want = {
        "manifest_version": MANIFEST_VERSION,
        "kt_ops_version": kt_ops.__version__,
        "format": weight_format or "native",
        "group_size": group_size,
        "symmetric": bool(symmetric),
        "source": {
            "path": str(Path(src).resolve()),
            "kind": source.kind,
            "dtype": source.source_dtype,
        },
        "num_layers": source.num_layers,
        "moe_layers": list(source.moe_layers),
        "layers": {},
    }
    if (out / MANIFEST_NAME).exists():
        manifest = read_manifest(out)
        _check_compatible(out, manifest, want)
    else:
        others = [
            p.name for p in out.iterdir() if not p.name.endswith(_TMP_SUFFIX) and not _own_orphan(p)
        ]
        if others:
            raise ValueError(
                f"output directory {out} is not empty ({', '.join(sorted(others)[:5])}) and has "
                f"no {MANIFEST_NAME}; refusing to write into it"
            )
        # Layer files without a manifest were left by a run killed between
        # renaming its first layer into place and writing the manifest: they
        # are not trusted (no manifest records their arguments) and are
        # rewritten, or removed if not asked for now.
        for p in out.iterdir():
            if _own_orphan(p) and _layer_of_name(p.name) not in todo:
                p.unlink()
        manifest = want  # written once the first layer is done
    check = getattr(source, "check_weight_format", None)
    if check is not None:  # fail before any work, e.g. a GGUF Q6_K tensor asked as q4_k
        for L in todo:
            check(L, weight_format)
    for p in out.iterdir():  # leftovers of an interrupted run
        if p.name.startswith(".") and p.name.endswith(_TMP_SUFFIX):
            p.unlink()

    from tqdm.auto import tqdm

    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(
        total=len(todo), desc=f"kt-ops convert ({want['format']})", unit="layer", disable=not show
    )
    try:
        for L in todo:
            entry = manifest["layers"].get(str(L))
            if entry is not None and _layer_ok(out, L, entry):
                bar.update(1)
                continue
            if entry is not None:
                logger.warning("%s: layer %d is missing or altered; converting it again", out, L)
            packed = source.load_layer(L, weight_format, group_size, symmetric)
            projections = {r: _projection_meta(packed[r]) for r in PROJECTIONS}
            E, inter, hidden = source.layer_shape(L)
            name = layer_file_name(L)
            final = out / name
            tmp = out / f".{name}{_TMP_SUFFIX}"
            meta = {"layer": L, "shape": [E, inter, hidden], "projections": projections}
            _write_layer_file(tmp, packed, meta)
            digest = sha256_file(tmp)
            size = tmp.stat().st_size
            del packed
            os.replace(tmp, final)
            _fsync_dir(out)
            manifest["layers"][str(L)] = {
                "file": name,
                "sha256": digest,
                "bytes": size,
                "shape": [E, inter, hidden],
                "projections": projections,
            }
            _write_manifest(out, manifest)
            bar.update(1)
            if on_layer_done is not None:
                on_layer_done(L, final)
    finally:
        bar.close()
    return manifest


# ---------------------------------------------------------------------- reading back


def _load_entry(out: Path, manifest: dict, layer: int, verify: bool) -> dict[str, PackedProjection]:
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
    out_dict = {}
    for role in PROJECTIONS:
        pm = meta["projections"][role]
        ts = {n: tensors[f"{role}.{n}"] for n in pm["tensors"]}
        try:
            p = PackedProjection(
                weight=ts["weight"],
                scales=ts.get("scales"),
                zeros=ts.get("zeros"),
                weight_format=pm["format"],
                group_size=pm["group_size"],
                n=pm["n"],
                k=pm["k"],
            ).validate()
            if p.weight.dim() < 1 or p.weight.shape[0] != E:
                raise ValueError(f"{E} experts in the metadata, {p.weight.shape[0]} in the weight")
        except Exception as e:
            raise ValueError(f"{path} (layer {layer}) {role}: invalid packed tensors: {e}") from e
        out_dict[role] = p
    return out_dict


def load_converted(
    out_dir: _PathLike, layer: int, *, verify: bool = True
) -> dict[str, PackedProjection]:
    """Load one layer of a converted directory.

    Args:
        out_dir: a directory written by :func:`convert`.
        layer: a converted MoE layer index.
        verify: check the file's sha256 against the manifest first (default).

    Returns:
        ``{"gate": PackedProjection [E, I, H], "up": [E, I, H], "down": [E, H, I]}``,
        bit-identical to the source loader's ``load_layer`` with the conversion's
        arguments.

    Raises:
        FileNotFoundError: no manifest, or the layer's file is missing.
        ValueError: the layer was not converted, or its file is truncated, altered
            (sha256 mismatch) or not valid safetensors (the message names the file).
    """
    out = Path(out_dir)
    return _load_entry(out, read_manifest(out), int(layer), verify)


class ConvertedExperts:
    """A converted directory: iterate its layers or index them.

    ``ConvertedExperts(out_dir)[L]`` and ``.load_layer(L)`` load layer ``L``
    (verified, as :func:`load_converted`); iterating yields ``(layer, dict)`` in
    layer order, one layer in memory at a time. Attributes: ``path``,
    ``manifest``, ``weight_format`` (``"native"`` or a format name),
    ``group_size``, ``symmetric``, ``layers`` (converted MoE layers),
    ``moe_layers`` (all MoE layers of the source), ``complete``,
    ``num_experts``, ``hidden_size``, ``intermediate_size`` (first converted
    layer; ``layer_shape(L)`` for any).

    Raises FileNotFoundError / ValueError as :func:`read_manifest`.
    """

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

    def load_layer(self, layer: int) -> dict[str, PackedProjection]:
        """Load (and verify) one layer: ``{"gate", "up", "down": PackedProjection}``."""
        return _load_entry(self.path, self.manifest, int(layer), self.verify)

    def __getitem__(self, layer: int) -> dict[str, PackedProjection]:
        return self.load_layer(layer)

    def __iter__(self) -> Iterator[tuple[int, dict[str, PackedProjection]]]:
        for L in self.layers:
            yield L, self.load_layer(L)

    def __len__(self) -> int:
        return len(self.layers)

    def __contains__(self, layer: object) -> bool:
        return layer in self.layers

    def __repr__(self) -> str:
        return (
            f"ConvertedExperts({str(self.path)!r}, format={self.weight_format!r}, "
            f"layers={len(self.layers)}/{len(self.moe_layers)})"
        )


# ---------------------------------------------------------------------- command line


def parse_layers(tokens: Sequence[str]) -> list[int]:
    """``["0-3,7", "9"]`` -> ``[0, 1, 2, 3, 7, 9]``; ValueError on anything else."""
    out: set[int] = set()
    for tok in tokens:
        for part in str(tok).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                if "-" in part:
                    a, b = part.split("-", 1)
                    lo, hi = int(a), int(b)
                    if lo > hi or lo < 0:
                        raise ValueError
                    out.update(range(lo, hi + 1))
                else:
                    v = int(part)
                    if v < 0:
                        raise ValueError
                    out.add(v)
            except ValueError:
                raise ValueError(
                    f"--layers: {part!r} is not a layer index or range like 0-3"
                ) from None
    return sorted(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``kt-ops convert SRC OUT [--format F] [--group-size G] [--symmetric|--asymmetric]
    [--layers 0-3,7] [--no-progress]``; returns the exit status (0 ok, 1 error: the
    message goes to stderr)."""
    parser = argparse.ArgumentParser(
        prog="kt-ops convert",
        description="Convert the routed experts of a Hugging Face safetensors checkpoint or a "
        "GGUF file to packed kt_ops weights (one safetensors file per MoE layer plus "
        "manifest.json). Rerunning into the same OUT resumes.",
    )
    parser.add_argument("src", help="Hugging Face model directory or .gguf file")
    parser.add_argument("out", help="output directory")
    parser.add_argument(
        "--format",
        dest="weight_format",
        choices=[*FORMATS, "native"],
        default="native",
        help="packed format (default: native = the source's own: fp8/mxfp4/GGUF types "
        "repacked, float weights bf16)",
    )
    parser.add_argument("--group-size", type=int, default=None, help="quantization group size")
    sym = parser.add_mutually_exclusive_group()
    sym.add_argument(
        "--symmetric",
        dest="symmetric",
        action="store_true",
        default=True,
        help="symmetric quantization, implicit zero point (default)",
    )
    sym.add_argument(
        "--asymmetric",
        dest="symmetric",
        action="store_false",
        help="asymmetric quantization with a zeros tensor (int4)",
    )
    parser.add_argument(
        "--layers",
        action="append",
        default=None,
        help="MoE layers to convert, e.g. 0-3,7 (repeatable; default: all)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        layers = parse_layers(args.layers) if args.layers else None
        fmt = None if args.weight_format == "native" else args.weight_format
        manifest = convert(
            args.src,
            args.out,
            fmt,
            args.group_size,
            args.symmetric,
            layers,
            progress=False if args.no_progress else None,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"kt-ops convert: error: {e}", file=sys.stderr)
        return 1
    done = len(manifest["layers"])
    total = len(manifest["moe_layers"])
    print(f"{args.out}: {done}/{total} MoE layers converted ({manifest['format']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
