"""Fuzz battery for the loaders and converted directories (issue #13).

Each case damages a copy of a small file set and loads everything back. The
outcome must be one of:

* a ``ValueError`` / ``FileNotFoundError`` whose message names the damaged
  file (or the checkpoint / converted directory holding it), or
* exactly the data of the undamaged files (``torch.equal`` on every packed
  tensor).

Anything else fails the case: another exception type (TypeError, KeyError,
a raw safetensors/numpy error...), a silently different result, a hang (an
alarm stops a case after 60 s), or a crash (which ends the run).

Targets and damage:

* Hugging Face safetensors directory (per-expert bf16 and gpt-oss MXFP4):
  truncation anywhere, bit flips and byte overwrites in the header, structural
  edits of the header JSON (dtype, shape, data offsets, names, deleted
  entries) and of config.json. The tensor payload of a source checkpoint has
  no checksum, so payload bytes are not damaged here (any value is valid).
* GGUF (three files: merged ``ffn_*_exps``, one tensor per expert, and ``ffn_gate_up_exps``
  with its bias): truncation anywhere, bit flips and byte overwrites in the header and
  tensor infos, edits of tensor data offsets, dims and types (except a type
  of the same size, e.g. F16 <-> BF16, which only reinterprets the payload;
  GGUF has no checksum, so nothing can tell).
* Converted directory (``kt-ops convert`` output): anything (sha256-covered
  payload included) in manifest.json and the layer files: truncation, bit
  flips, overwrites, JSON edits of the manifest, deleted or swapped files;
  also a resume (``convert`` into the damaged directory), which must give the
  exact layers again.

A fixed-seed slice runs by default (a few seconds). The long run:
``KT_OPS_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz_loaders.py -s`` (examples
per target; the seed changes unless ``KT_OPS_FUZZ_DERANDOMIZE=1``). With
``-s`` each target prints how many cases ran and how they ended.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import struct
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from checkpoints import ROLES, Q, write_gguf, write_hf, write_hf_mxfp4
from gguf import GGUFReader

from kt_ops.convert import ConvertedExperts, convert
from kt_ops.loaders import open_checkpoint

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEFAULT_EXAMPLES = 25
EXAMPLES = int(os.environ.get("KT_OPS_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
DERANDOMIZE = EXAMPLES == DEFAULT_EXAMPLES or os.environ.get("KT_OPS_FUZZ_DERANDOMIZE") == "1"
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=DERANDOMIZE,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)

#: target -> Counter of outcomes ("error", "exact", "resumed"), printed at the end.
OUTCOMES: dict[str, Counter] = {}


class Hang(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int = 60):
    def on_alarm(signum, frame):
        raise Hang(f"a fuzz case ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def packed_tensors(layers: dict) -> dict:
    """{(layer, role, field): tensor} plus the scalar fields, for exact comparison."""
    out = {}
    for L, layer in layers.items():
        for role, p in zip(ROLES, layer.projections):
            out[(L, role, "meta")] = (p.weight_format, p.group_size, p.n, p.k)
            for name, t in p.tensors().items():
                out[(L, role, name)] = t
    return out


def assert_exact(got: dict, want: dict, what) -> None:
    assert sorted(got, key=str) == sorted(want, key=str), f"{what}: other layers or tensors"
    for key, w in want.items():
        g = got[key]
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), (
                f"{what}: {key} differs (a silently different result)"
            )
        else:
            assert g == w, f"{what}: {key} is {g}, expected {w}"


def check_outcome(target: str, load, want: dict, names: tuple[str, ...], what) -> str:
    """Run ``load()``; a clear error naming one of ``names`` or the exact data."""
    try:
        with time_limit():
            got = load()
    except (ValueError, FileNotFoundError) as e:
        msg = str(e)
        assert any(n in msg for n in names), f"{what}: error does not name the file: {msg}"
        outcome = "error"
    else:
        assert_exact(packed_tensors(got), want, what)
        outcome = "exact"
    OUTCOMES.setdefault(target, Counter())[outcome] += 1
    return outcome


@pytest.fixture(scope="module", autouse=True)
def _print_outcomes():
    log = logging.getLogger("kt_ops")
    level = log.level
    log.setLevel(logging.ERROR)  # thousands of "converting it again" / bias warnings
    yield
    log.setLevel(level)
    total = 0
    for target, c in sorted(OUTCOMES.items()):
        n = sum(c.values())
        total += n
        print(
            f"\nfuzz[{target}]: {n} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
        )
    print(f"fuzz: {total} cases in all")


# --------------------------------------------------------------------------------------------
# byte-level damage
# --------------------------------------------------------------------------------------------


@st.composite
def byte_damage(draw, size: int, lo: int = 0, hi: int | None = None):
    """("truncate", n) | ("flip", pos, bit) | ("overwrite", pos, bytes) within [lo, hi)."""
    hi = size if hi is None else hi
    kind = draw(st.sampled_from(["truncate", "flip", "flip", "overwrite"]))
    if kind == "truncate":
        return ("truncate", draw(st.integers(0, size - 1)))
    pos = draw(st.integers(lo, max(lo, hi - 1)))
    if kind == "flip":
        return ("flip", pos, draw(st.integers(0, 7)))
    return ("overwrite", pos, draw(st.binary(min_size=1, max_size=8)))


def apply_bytes(data: bytes, damage) -> bytes:
    if damage[0] == "truncate":
        return data[: damage[1]]
    b = bytearray(data)
    if damage[0] == "flip":
        b[damage[1]] ^= 1 << damage[2]
    else:
        pos, new = damage[1], damage[2]
        b[pos : pos + len(new)] = new
        b = b[: len(data)] if len(b) > len(data) else b
    return bytes(b)


# --------------------------------------------------------------------------------------------
# Hugging Face safetensors sources
# --------------------------------------------------------------------------------------------


def st_header(data: bytes) -> tuple[int, dict]:
    n = struct.unpack("<Q", data[:8])[0]
    return n, json.loads(data[8 : 8 + n])


def st_rebuild(data: bytes, header: dict) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


@st.composite
def header_edit(draw, header: dict):
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    kind = draw(st.sampled_from(["dtype", "shape", "offsets", "delete", "rename", "metadata"]))
    if kind == "dtype":
        return (kind, name, draw(st.sampled_from(["F16", "BF16", "F32", "U8", "I8", "F8_E4M3"])))
    if kind == "shape":
        return (kind, name, draw(st.integers(0, 3)), draw(st.integers(-2, 2)))
    if kind == "offsets":
        return (kind, name, draw(st.integers(0, 1)), draw(st.sampled_from([-64, -2, -1, 1, 2, 64])))
    if kind == "rename":
        other = draw(st.sampled_from(names))
        return (kind, name, other)
    if kind == "metadata":
        return (kind, name, draw(st.text(max_size=8)))
    return (kind, name)


def apply_header_edit(header: dict, edit) -> dict:
    h = json.loads(json.dumps(header))
    kind, name = edit[0], edit[1]
    t = h[name]
    if kind == "dtype":
        t["dtype"] = edit[2]
    elif kind == "shape":
        if t["shape"]:
            i = edit[2] % len(t["shape"])
            t["shape"][i] = max(0, t["shape"][i] + edit[3])
            if edit[3] == 0:
                t["shape"] = t["shape"][::-1]
    elif kind == "offsets":
        t["data_offsets"][edit[2]] += edit[3]
    elif kind == "delete":
        del h[name]
    elif kind == "rename":
        other = edit[2]
        if other != name:  # swap the two names: their data trade places
            h[name], h[other] = h[other], h[name]
    elif kind == "metadata":
        h["__metadata__"] = {"x": edit[2]}
    return h


class HFSource:
    def __init__(self, root: Path, kind: str) -> None:
        self.dir = root / kind
        if kind == "mxfp4":
            write_hf_mxfp4(self.dir, E=2, H=64, I=32, num_layers=1)
        else:
            write_hf(self.dir, "qwen3_moe", E=2, H=64, I=32, num_layers=2, dense_layers=(0,))
        self.files = {p.name: p.read_bytes() for p in self.dir.iterdir()}
        self.want = packed_tensors(self.load(self.dir))

    @staticmethod
    def load(path):
        ck = open_checkpoint(path)
        return {L: ck.load_layer(L) for L in ck.moe_layers}


@pytest.fixture(scope="module")
def fuzz_root():
    with tempfile.TemporaryDirectory(prefix="kt_ops_fuzz_") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def hf_sources(fuzz_root):
    return {k: HFSource(fuzz_root, k) for k in ("bf16", "mxfp4")}


def _swap_rename_changes_data(header: dict, edit) -> bool:
    """A swap of two same-dtype, same-shape tensors' names is a payload edit (undetectable)."""
    if edit[0] != "rename" or edit[1] == edit[2]:
        return False
    a, b = header[edit[1]], header[edit[2]]
    return (a["dtype"], a["shape"]) == (b["dtype"], b["shape"])


@FUZZ
@given(data=st.data())
def test_fuzz_hf_safetensors(hf_sources, fuzz_root, data):
    src = hf_sources[data.draw(st.sampled_from(sorted(hf_sources)), label="source")]
    work = fuzz_root / "hf_case"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(src.dir, work)
    blob = src.files["model.safetensors"]
    n, header = st_header(blob)
    how = data.draw(st.sampled_from(["bytes", "header", "config"]), label="how")
    if how == "bytes":  # damage the header bytes (or truncate anywhere)
        damage = data.draw(byte_damage(len(blob), 0, 8 + n), label="damage")
        (work / "model.safetensors").write_bytes(apply_bytes(blob, damage))
        what = damage
    elif how == "header":
        edit = data.draw(header_edit(header), label="edit")
        if _swap_rename_changes_data(header, edit):
            return
        (work / "model.safetensors").write_bytes(st_rebuild(blob, apply_header_edit(header, edit)))
        what = edit
    else:
        cfg = json.loads(src.files["config.json"])
        key = data.draw(st.sampled_from(sorted(cfg)), label="key")
        value = data.draw(
            st.sampled_from([None, 0, 1, -1, 1.5, "x", [], {}, "qwen3_moe", "gpt_oss"]),
            label="value",
        )
        if data.draw(st.booleans(), label="delete"):
            del cfg[key]
        else:
            cfg[key] = value
        (work / "config.json").write_text(json.dumps(cfg))
        what = ("config", key)
        if key in (
            "hidden_size",
            "moe_intermediate_size",
            "intermediate_size",
            "num_experts",
            "num_local_experts",
        ):
            pass  # informational keys: the tensors decide the shapes
    check_outcome(f"hf_{src.dir.name}", lambda: HFSource.load(work), src.want, (str(work),), what)


# --------------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------------


class GGUFSource:
    """A small GGUF file with its experts in one of llama.cpp's forms: ``merged``
    (``ffn_{gate,up,down}_exps``), ``split`` (one tensor per expert, early Mixtral files)
    or ``fused`` (``ffn_gate_up_exps`` with its bias, Qwen3.5 MoE files)."""

    def __init__(self, root: Path, form: str = "merged") -> None:
        self.form = form
        self.path = root / f"m_{form}.gguf"
        fused = form == "fused"
        write_gguf(
            self.path,
            {"gate": Q.Q8_0, "up": Q.Q8_0 if fused else Q.Q4_0, "down": Q.F16},
            E=2,
            H=64,
            I=32,
            moe_layers=(1,),
            split_experts=form == "split",
            fused_gate_up=fused,
            bias_types=dict.fromkeys(ROLES, Q.F32) if fused else None,
        )
        self.blob = self.path.read_bytes()
        r = GGUFReader(str(self.path))
        self.data_offset = int(r.data_offset)
        base = _bounds(r.data)
        # file positions of each tensor's (dims..., type, offset) fields
        self.fields = []
        for t in r.tensors:
            parts = t.field.parts
            dims, dtype, offset = parts[3], parts[4], parts[5]
            self.fields.append(
                (
                    t.name,
                    _bounds(dims) - base,
                    len(dims),
                    _bounds(dtype) - base,
                    _bounds(offset) - base,
                )
            )
        self.want = packed_tensors(self.load(self.path))

    @staticmethod
    def load(path):
        ck = open_checkpoint(path)
        return {L: ck.load_layer(L) for L in ck.moe_layers}


def _same_size_types(a: int, b: int) -> bool:
    """Whether GGML types ``a`` and ``b`` store a tensor in the same number of bytes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        (ba, sa), (bb, sb) = (GGML_QUANT_SIZES[GGMLQuantizationType(t)] for t in (a, b))
    except (ValueError, KeyError):
        return False
    return sa * bb == sb * ba


def _bounds(a) -> int:
    try:
        from numpy.lib.array_utils import byte_bounds
    except ImportError:  # pragma: no cover - numpy < 2
        from numpy import byte_bounds
    return byte_bounds(a)[0]


@pytest.fixture(scope="module", params=["merged", "split", "fused"])
def gguf_source(fuzz_root, request):
    return GGUFSource(fuzz_root, request.param)


@FUZZ
@given(data=st.data())
def test_fuzz_gguf(gguf_source, fuzz_root, data):
    g = gguf_source
    path = fuzz_root / f"case_{g.form}.gguf"
    how = data.draw(st.sampled_from(["bytes", "offset", "dims", "type"]), label="how")
    blob = bytearray(g.blob)
    if how == "bytes":
        damage = data.draw(byte_damage(len(blob), 0, g.data_offset), label="damage")
        blob = bytearray(apply_bytes(bytes(blob), damage))
        what = damage
    else:
        name, dims_pos, ndims, type_pos, off_pos = data.draw(st.sampled_from(g.fields), label="t")
        if how == "offset":
            old = struct.unpack_from("<Q", blob, off_pos)[0]
            delta = data.draw(st.sampled_from([-64, -32, -1, 1, 16, 32, 64, 1 << 20]), label="d")
            struct.pack_into("<Q", blob, off_pos, max(0, old + delta))
        elif how == "dims":
            i = data.draw(st.integers(0, ndims - 1), label="dim")
            old = struct.unpack_from("<Q", blob, dims_pos + 8 * i)[0]
            new = data.draw(st.sampled_from([0, 1, old - 1, old + 1, old * 2, old // 2]), label="v")
            struct.pack_into("<Q", blob, dims_pos + 8 * i, max(0, new))
        else:
            new = data.draw(st.sampled_from([0, 1, 2, 6, 8, 12, 14, 30, 99]), label="type")
            old = struct.unpack_from("<I", blob, type_pos)[0]
            if _same_size_types(old, new):
                return  # e.g. F16 <-> BF16: a reinterpretation of the payload (undetectable)
            struct.pack_into("<I", blob, type_pos, new)
        what = (how, name)
    path.write_bytes(bytes(blob))
    check_outcome(f"gguf_{g.form}", lambda: GGUFSource.load(path), g.want, (str(path),), what)


# --------------------------------------------------------------------------------------------
# converted directories
# --------------------------------------------------------------------------------------------


class ConvertedSource:
    def __init__(self, root: Path, hf: HFSource) -> None:
        self.src = hf.dir
        self.dir = root / "converted"
        convert(self.src, self.dir, "int4", 32, symmetric=False, progress=False)
        self.files = {p.name: p.read_bytes() for p in self.dir.iterdir()}
        self.want = packed_tensors(self.load(self.dir))

    @staticmethod
    def load(path, layers=(1,)):
        # Every layer of the undamaged conversion is asked for: a manifest that
        # lists fewer layers (a partial conversion) must say so by an error.
        ce = ConvertedExperts(path)
        return {L: ce.load_layer(L) for L in layers}


@pytest.fixture(scope="module")
def converted_source(fuzz_root, hf_sources):
    return ConvertedSource(fuzz_root, hf_sources["bf16"])


_JSON_VALUES = [None, 0, 1, -1, 2, 16, 32, 1.5, "x", "int8", "int4", [], {}, [1], True, False]


def _json_paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _json_paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _json_paths(v, (*prefix, i))


@FUZZ
@given(data=st.data())
def test_fuzz_converted_dir(converted_source, fuzz_root, data):
    c = converted_source
    work = fuzz_root / "conv_case"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(c.dir, work)
    name = data.draw(st.sampled_from(sorted(c.files)), label="file")
    how = data.draw(st.sampled_from(["bytes", "json", "delete", "swap"]), label="how")
    if how == "json" and name == "manifest.json":
        m = json.loads(c.files[name])
        paths = [p for p in _json_paths(m) if p]
        path = data.draw(st.sampled_from(paths), label="path")
        value = data.draw(st.sampled_from(_JSON_VALUES), label="value")
        obj = m
        for p in path[:-1]:
            obj = obj[p]
        if data.draw(st.booleans(), label="delete") and isinstance(obj, dict):
            del obj[path[-1]]
        elif isinstance(obj[path[-1]], int) and not isinstance(obj[path[-1]], bool):
            obj[path[-1]] += data.draw(st.sampled_from([-1, 1, 16]), label="delta")
        else:
            obj[path[-1]] = value
        (work / name).write_text(json.dumps(m))
        what = ("json", path)
    elif how == "delete":
        (work / name).unlink()
        what = ("delete", name)
    elif how == "swap":
        other = data.draw(st.sampled_from(sorted(c.files)), label="other")
        (work / name).write_bytes(c.files[other])
        (work / other).write_bytes(c.files[name])
        what = ("swap", name, other)
    else:
        blob = c.files[name]
        damage = data.draw(byte_damage(len(blob)), label="damage")
        (work / name).write_bytes(apply_bytes(blob, damage))
        what = (name, damage)
    check_outcome("converted", lambda: ConvertedSource.load(work), c.want, (str(work),), what)
    if data.draw(st.booleans(), label="resume"):
        # A rerun into the damaged directory redoes what is damaged, or refuses clearly.
        def resume():
            convert(c.src, work, "int4", 32, symmetric=False, progress=False)
            return ConvertedSource.load(work)

        check_outcome("converted_resume", resume, c.want, (str(work),), what)
