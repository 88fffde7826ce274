"""Convert a checkpoint's routed experts to packed kt_ops weights: ``kt-ops convert``.

``kt-ops convert SRC OUT --format int4 --group-size 128`` (or :func:`convert`)
reads SRC, a Hugging Face model directory (bf16/fp16/fp32, fp8, MXFP4: see
:mod:`kt_ops.loaders.hf_checkpoint`) or a ``.gguf`` file (see
:mod:`kt_ops.loaders.gguf_file`), one MoE layer at a time, and writes OUT: a
safetensors file per MoE layer and ``manifest.json``, the directory that
:mod:`kt_ops.loaders.converted` defines (layout, checks) and reads back
(:class:`ConvertedExperts`, :func:`load_converted`, re-exported here).

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
so a run killed at any point resumes. Resuming into a ``manifest_version`` 1
directory is refused.

**Memory.** One layer's packed weights plus one chunk of dense experts (see
:mod:`kt_ops.loaders`); never the whole model.

The tensors written are bit-identical to ``open_checkpoint(SRC).load_layer(L,
...)`` with the same arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import kt_ops
from kt_ops._checks import as_int
from kt_ops.formats import FORMATS, PackedProjection, format_spec
from kt_ops.layer import PROJECTIONS, ExpertWeights
from kt_ops.loaders import open_checkpoint
from kt_ops.loaders._common import check_format
from kt_ops.loaders.converted import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    ConvertedExperts,
    _check_file_agrees,
    _file_meta,
    _PathLike,
    layer_file_name,
    load_converted,
    read_manifest,
    sha256_file,
)

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

_TMP_SUFFIX = ".tmp"


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


def _write_manifest(out_dir: Path, manifest: dict) -> None:
    data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    _atomic_write_bytes(out_dir / MANIFEST_NAME, data)


def _projection_meta(p: PackedProjection) -> dict:
    return {
        "format": p.weight_format,
        "group_size": p.group_size,
        "n": int(p.n),
        "k": int(p.k),
        "tensors": sorted(_saved_tensors(p)),
    }


def _saved_tensors(p: PackedProjection) -> dict[str, torch.Tensor]:
    """The tensors of a projection in a layer file: the packed ones and its bias (gpt-oss)."""
    out = dict(p.tensors())
    if p.bias is not None:
        out["bias"] = p.bias
    return out


def _write_layer_file(path: Path, experts: ExpertWeights, meta: dict) -> None:
    """Write one layer's packed projections to ``path`` (safetensors), flushed to disk."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for role, p in zip(PROJECTIONS, experts.projections):
        for name, t in _saved_tensors(p).items():
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
        not_ints = [L for L in layers if as_int(L) is None]
        if not_ints:
            raise ValueError(f"layers={list(layers)!r}: expected layer indices (ints)")
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
    for L in todo:  # fail before any work, e.g. a GGUF Q6_K tensor asked as q4_k
        source.check_weight_format(L, weight_format)
    for p in out.iterdir():  # leftovers of an interrupted run
        if p.name.startswith(".") and p.name.endswith(_TMP_SUFFIX):
            p.unlink()

    from tqdm.auto import tqdm  # optional dependency (comes with huggingface_hub)

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
            projections = {r: _projection_meta(p) for r, p in zip(PROJECTIONS, packed.projections)}
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
