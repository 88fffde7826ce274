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
skips every layer whose file is listed in the manifest and whose sha256 still
matches (it does not touch those files), and redoes the others. A manifest
with another format, group size, symmetry, source path or kind, or kt_ops
version is refused (ValueError), as is a non-empty OUT without a manifest.

**Memory.** One layer's packed weights plus one chunk of dense experts (see
:mod:`kt_ops.loaders`); never the whole model.

**Reading back.** :func:`load_converted` and :class:`ConvertedExperts` verify
each file's sha256 against the manifest before loading it and raise a
FileNotFoundError / ValueError naming the file when it is missing, truncated,
altered or not valid safetensors. The tensors are bit-identical to
``open_checkpoint(SRC).load_layer(L, ...)`` with the same arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
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
MANIFEST_VERSION = 1
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

    Raises FileNotFoundError when it is absent and ValueError when it is not a
    JSON object with ``manifest_version``, ``format`` and ``layers``.
    """
    path = Path(out_dir) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {out_dir} is not a converted directory")
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(m, dict) or not all(k in m for k in ("manifest_version", "format", "layers")):
        raise ValueError(f"{path}: not a kt_ops manifest (needs manifest_version, format, layers)")
    if m["manifest_version"] != MANIFEST_VERSION:
        raise ValueError(
            f"{path}: manifest_version {m['manifest_version']!r}; this kt_ops reads "
            f"{MANIFEST_VERSION}"
        )
    return m


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


def _layer_ok(out_dir: Path, entry: Any) -> bool:
    """Whether a manifest entry's file exists and still has the recorded sha256."""
    if not isinstance(entry, dict) or "file" not in entry or "sha256" not in entry:
        return False
    path = out_dir / entry["file"]
    return path.is_file() and sha256_file(path) == entry["sha256"]


def _check_compatible(out_dir: Path, m: dict, want: dict) -> None:
    path = out_dir / MANIFEST_NAME
    checks = [
        ("format", m.get("format"), want["format"]),
        ("group_size", m.get("group_size"), want["group_size"]),
        ("symmetric", m.get("symmetric"), want["symmetric"]),
        ("source path", (m.get("source") or {}).get("path"), want["source"]["path"]),
        ("source kind", (m.get("source") or {}).get("kind"), want["source"]["kind"]),
        ("kt_ops_version", m.get("kt_ops_version"), want["kt_ops_version"]),
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
        others = [p.name for p in out.iterdir() if not p.name.endswith(_TMP_SUFFIX)]
        if others:
            raise ValueError(
                f"output directory {out} is not empty ({', '.join(sorted(others)[:5])}) and has "
                f"no {MANIFEST_NAME}; refusing to write into it"
            )
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
            if entry is not None and _layer_ok(out, entry):
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
    entry = manifest["layers"].get(str(layer))
    if entry is None:
        have = sorted(int(k) for k in manifest["layers"])
        raise ValueError(
            f"{out / MANIFEST_NAME}: layer {layer} was not converted; converted layers: {have}"
        )
    try:
        path = out / entry["file"]
        projections = entry["projections"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{out / MANIFEST_NAME}: malformed entry for layer {layer}") from e
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} (layer {layer}) is missing from the converted directory; rerun kt-ops "
            "convert into it to rewrite the layer"
        )
    if verify:
        digest = sha256_file(path)
        if digest != entry.get("sha256"):
            raise ValueError(
                f"{path} (layer {layer}) does not match the manifest (sha256 {digest}, expected "
                f"{entry.get('sha256')}): the file is truncated or altered; rerun kt-ops convert "
                "into the directory to rewrite it"
            )
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise ValueError(f"{path} (layer {layer}): not a valid safetensors file: {e}") from e
    out_dict = {}
    for role in PROJECTIONS:
        try:
            meta = projections[role]
            names = meta["tensors"]
            if "weight" not in names:
                raise KeyError("weight")
            ts = {n: tensors[f"{role}.{n}"] for n in names}
            p = PackedProjection(
                weight=ts["weight"],
                scales=ts.get("scales"),
                zeros=ts.get("zeros"),
                weight_format=meta["format"],
                group_size=meta["group_size"],
                n=meta["n"],
                k=meta["k"],
            )
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"{path} (layer {layer}): tensor or manifest field {e} of projection {role!r} "
                "is missing"
            ) from e
        try:
            p.validate()
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
