"""Integrity of converted directories (issue #13, items 2, 3 and 6).

* Item 2: every manifest field that decides what is computed (per-projection
  ``n``/``k``, shapes, the layer -> file mapping) is checked against the layer
  file's own metadata, which its sha256 covers; edited or swapped entries are
  refused with an error naming the file, never loaded.
* Item 3: a conversion killed at any point (in particular between renaming the
  first layer file into place and writing the first manifest) resumes, and
  the result equals an uninterrupted run.
* Item 6: wrong value types anywhere in a manifest give a ValueError naming
  ``manifest.json`` and the field (``kt-ops convert`` prints one line, no
  traceback), never TypeError / AttributeError.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from checkpoints import write_hf
from test_convert import assert_same_layer

import kt_ops.convert as conv
from kt_ops.cli import main as cli_main
from kt_ops.convert import (
    MANIFEST_NAME,
    ConvertedExperts,
    convert,
    layer_file_name,
    load_converted,
    read_manifest,
)
from kt_ops.loaders import open_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory):
    src = tmp_path_factory.mktemp("integrity") / "src"
    write_hf(src, "qwen3_moe", num_layers=3, dense_layers=())
    return src


@pytest.fixture(scope="module")
def converted(hf_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity") / "out"
    convert(hf_src, out, "int8", progress=False)
    return out


def _copy(src, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit(out, fn):
    m = json.loads((out / MANIFEST_NAME).read_text())
    fn(m)
    (out / MANIFEST_NAME).write_text(json.dumps(m))


# --------------------------------------------------------------------------------------------
# Item 2: the manifest is checked against the files it describes
# --------------------------------------------------------------------------------------------


def _nk_minus_one(m):
    # I = 32 -> 31: the packed blocks (16 rows, padded K) still fit, so only the
    # comparison with the file's metadata can tell.
    for entry in m["layers"].values():
        entry["projections"]["gate"]["n"] -= 1
        entry["projections"]["up"]["n"] -= 1
        entry["projections"]["down"]["k"] -= 1


def _nk_and_shape_minus_one(m):
    _nk_minus_one(m)
    for entry in m["layers"].values():
        entry["shape"][1] -= 1


def _swap_file_and_sha(m):
    a, b = m["layers"]["0"], m["layers"]["1"]
    a["file"], b["file"] = b["file"], a["file"]
    a["sha256"], b["sha256"] = b["sha256"], a["sha256"]
    a["bytes"], b["bytes"] = b["bytes"], a["bytes"]


def _swap_group_size(m):
    m["layers"]["0"]["projections"]["gate"]["format"] = "int4"
    m["layers"]["0"]["projections"]["gate"]["group_size"] = 32
    m["format"] = "native"


@pytest.mark.parametrize(
    "edit",
    [_nk_minus_one, _nk_and_shape_minus_one, _swap_file_and_sha, _swap_group_size],
    ids=["n_k", "n_k_shape", "swap_file_sha", "format"],
)
def test_edited_manifest_is_refused(converted, tmp_path, edit):
    out = _copy(converted, tmp_path)
    _edit(out, edit)
    with pytest.raises(ValueError, match=r"(manifest\.json|layer_00\d\.safetensors)"):
        for L in (0, 1, 2):
            load_converted(out, L)
    with pytest.raises(ValueError, match=r"(manifest\.json|layer_00\d\.safetensors)"):
        list(ConvertedExperts(out, verify=False))


def test_swapped_files_on_disk_are_refused(converted, tmp_path):
    """Renaming the files of layers 0 and 1 into each other and swapping their checksums."""
    out = _copy(converted, tmp_path)
    f0, f1 = out / layer_file_name(0), out / layer_file_name(1)
    tmp = out / "swap"
    f0.rename(tmp)
    f1.rename(f0)
    tmp.rename(f1)

    def swap(m):
        a, b = m["layers"]["0"], m["layers"]["1"]
        a["sha256"], b["sha256"] = b["sha256"], a["sha256"]
        a["bytes"], b["bytes"] = b["bytes"], a["bytes"]

    _edit(out, swap)
    with pytest.raises(ValueError, match=r"layer_000\.safetensors: holds MoE layer 1"):
        load_converted(out, 0)
    with pytest.raises(ValueError, match=r"layer_001\.safetensors: holds MoE layer 0"):
        ConvertedExperts(out)[1]
    # a resume does not trust them either: both layers are converted again
    done = []
    convert(hf_src_of(out), out, "int8", progress=False, on_layer_done=lambda L, p: done.append(L))
    assert done == [0, 1]
    for L in (0, 1, 2):
        assert_same_layer(load_converted(out, L), load_converted(converted, L))


def hf_src_of(out):
    return read_manifest(out)["source"]["path"]


def test_file_without_kt_ops_metadata_is_refused(converted, tmp_path):
    """A layer file with the right sha256 in the manifest but no kt_ops metadata."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = _copy(converted, tmp_path)
    f = out / layer_file_name(2)
    with safe_open(str(f), framework="pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    save_file(tensors, str(f))
    _edit(
        out,
        lambda m: m["layers"]["2"].update(sha256=conv.sha256_file(f), bytes=f.stat().st_size),
    )
    with pytest.raises(ValueError, match=r"layer_002\.safetensors: has no 'kt_ops' metadata"):
        load_converted(out, 2)


def test_edited_manifest_through_replace_experts(tmp_path):
    """The issue's reproduction: replace_experts(converted_dir=...) with an edited manifest."""
    pytest.importorskip("transformers")
    from test_quant_models import logits, tiny_qwen3

    from kt_ops.hf import replace_experts

    src = tmp_path / "src"
    tiny_qwen3().save_pretrained(src)
    out = tmp_path / "out"
    convert(src, out, "int8", progress=False)
    want = logits(replace_experts(tiny_qwen3(), converted_dir=str(out)))
    for edit in (_nk_minus_one, _swap_file_and_sha):
        bad = _copy(out, tmp_path, edit.__name__)
        _edit(bad, edit)
        with pytest.raises(ValueError, match=r"(manifest\.json|layer_00\d\.safetensors)"):
            replace_experts(tiny_qwen3(), converted_dir=str(bad))
    # the untouched directory still gives the same logits
    assert torch.equal(logits(replace_experts(tiny_qwen3(), converted_dir=str(out))), want)


# --------------------------------------------------------------------------------------------
# Item 3: every kill point resumes
# --------------------------------------------------------------------------------------------


class _Killed(BaseException):
    pass


def _kill_points(monkeypatch, kill_at):
    """Wrap the converter's write steps; raise _Killed before/after the ``kill_at``-th step."""
    count = [0]

    def wrap(name):
        real = getattr(conv, name)

        def step(*a, **k):
            if count[0] == kill_at:
                raise _Killed(f"before {name}")
            count[0] += 1
            r = real(*a, **k)
            if count[0] == kill_at:
                raise _Killed(f"after {name}")
            count[0] += 1
            return r

        monkeypatch.setattr(conv, name, step)

    for name in ("_write_layer_file", "sha256_file", "_fsync_dir", "_write_manifest"):
        wrap(name)
    return count


def test_every_kill_point_resumes(hf_src, converted, tmp_path, monkeypatch):
    want = read_manifest(converted)["layers"]
    with monkeypatch.context() as mp:
        total = _kill_points(mp, -1)
        convert(hf_src, tmp_path / "count", "int8", progress=False)
    assert total[0] > 20
    for kill_at in range(total[0]):
        out = tmp_path / f"k{kill_at}"
        with monkeypatch.context() as mp:
            _kill_points(mp, kill_at)
            with pytest.raises(_Killed):
                convert(hf_src, out, "int8", progress=False)
        m = convert(hf_src, out, "int8", progress=False)  # resumes, whatever was left
        assert m["layers"] == want, kill_at
        names = sorted(p.name for p in out.iterdir())
        assert names == sorted([MANIFEST_NAME, *(layer_file_name(L) for L in (0, 1, 2))])
        for L in (0, 1, 2):
            assert (out / layer_file_name(L)).read_bytes() == (
                converted / layer_file_name(L)
            ).read_bytes()


def test_killed_before_first_manifest(hf_src, tmp_path, monkeypatch):
    """The issue's kill point: layer_000 renamed into place, no manifest.json yet."""
    out = tmp_path / "out"

    def killed(*a, **k):
        raise _Killed("kill -9")

    with monkeypatch.context() as mp:
        mp.setattr(conv, "_write_manifest", killed)
        with pytest.raises(_Killed):
            convert(hf_src, out, "int8", layers=[0, 1], progress=False)
    assert sorted(p.name for p in out.iterdir()) == [layer_file_name(0)]
    # rerun with fewer layers: the orphan of a layer not asked for is removed
    m = convert(hf_src, out, "int8", layers=[1], progress=False)
    assert sorted(m["layers"]) == ["1"]
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST_NAME, layer_file_name(1)])
    # a file that merely looks like a layer file still blocks the directory
    other = tmp_path / "other"
    other.mkdir()
    (other / layer_file_name(0)).write_bytes(b"not mine")
    with pytest.raises(ValueError, match="not empty"):
        convert(hf_src, other, "int8", progress=False)
    ck = open_checkpoint(hf_src)
    assert_same_layer(load_converted(out, 1), ck.load_layer(1, "int8"))


# --------------------------------------------------------------------------------------------
# Item 6: wrong value types give a ValueError naming the field and the file
# --------------------------------------------------------------------------------------------

_WRONG_VALUES = [None, 1.5, [1], "x", {}, True, -1, 2**70, {"a": 1}, [None]]


def _paths(obj, prefix=()):
    """Every (path) to a value in a JSON tree, containers included."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _set(obj, path, value):
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


def test_systematic_manifest_type_edits(hf_src, converted, tmp_path, capsys):
    """Every field of the manifest set to every wrong-typed value: a clear error or exact data."""
    base = json.loads((converted / MANIFEST_NAME).read_text())
    ck = open_checkpoint(hf_src)
    reference = {L: ck.load_layer(L, "int8") for L in (0, 1, 2)}
    out = _copy(converted, tmp_path)
    edits = errors = 0
    for path in _paths(base):
        if not path:
            continue
        for value in _WRONG_VALUES:
            m = copy.deepcopy(base)
            _set(m, path, value)
            if m == base:
                continue
            edits += 1
            (out / MANIFEST_NAME).write_text(json.dumps(m))
            try:
                experts = ConvertedExperts(out)
                assert experts.layers == [0, 1, 2], (path, value)  # no layer lost
                for L in experts.layers:
                    assert_same_layer(experts[L], reference[L])
            except (ValueError, FileNotFoundError) as e:
                assert "manifest.json" in str(e) or ".safetensors" in str(e), (path, value, e)
                errors += 1
    assert edits > 500 and errors > 0.9 * edits
    # the command line on resume: one error line, no traceback
    for path, value in [
        (("moe_layers",), 1.5),
        (("layers",), [1]),
        (("layers", "0", "file"), None),
    ]:
        m = copy.deepcopy(base)
        _set(m, path, value)
        (out / MANIFEST_NAME).write_text(json.dumps(m))
        code = cli_main(["convert", str(hf_src), str(out), "--format", "int8", "--no-progress"])
        err = capsys.readouterr().err
        assert code == 1 and "manifest.json" in err and "Traceback" not in err, err
        assert repr(".".join(path)) in err, err  # the field, by its full name


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("moe_layers",), 1.5, "moe_layers"),
        (("layers",), [1], "layers"),
        (("layers", "0", "file"), None, "layers.0.file"),
        (("layers", "0", "shape"), [4, "32", 64], "layers.0.shape"),
        (("layers", "1", "projections", "up", "tensors"), "weight", "tensors"),
        (("source",), None, "source"),
        (("group_size",), "32", "group_size"),
    ],
)
def test_wrong_type_names_the_field(converted, tmp_path, path, value, field):
    out = _copy(converted, tmp_path)
    _edit(out, lambda m: _set(m, path, value))
    with pytest.raises(ValueError, match=rf"manifest\.json: field '[^']*{field}"):
        read_manifest(out)
