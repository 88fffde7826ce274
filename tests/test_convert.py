"""The converter (``kt_ops.convert`` / ``kt-ops convert``) and reading converted directories.

* Loading a converted directory gives bit-identical tensors to the source
  loader's online ``load_layer`` (``torch.equal`` on every tensor), for float,
  fp8, MXFP4 and GGUF sources.
* An interrupted run resumes without redoing (or touching) finished layers;
  altered finished files are redone.
* Mixing formats / group sizes / sources in one directory is refused.
* Missing, truncated, altered or invalid converted files raise errors naming
  the file.
"""

# ruff: noqa: E741

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoints import ROLES, Q, write_gguf, write_hf, write_hf_fp8, write_hf_mxfp4
from safetensors import safe_open
from safetensors.torch import save_file

import kt_ops
import kt_ops.convert as conv
from kt_ops import ExpertWeights
from kt_ops.cli import main as cli_main
from kt_ops.convert import (
    MANIFEST_NAME,
    ConvertedExperts,
    convert,
    layer_file_name,
    load_converted,
    read_manifest,
    sha256_file,
)
from kt_ops.formats import format_spec, pack_codes, unpack_codes
from kt_ops.loaders import open_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_same_layer(a: ExpertWeights, b: ExpertWeights) -> None:
    assert isinstance(a, ExpertWeights) and isinstance(b, ExpertWeights)
    for r, pa, pb in zip(ROLES, a.projections, b.projections):
        assert (pa.weight_format, pa.group_size, pa.n, pa.k) == (
            pb.weight_format,
            pb.group_size,
            pb.n,
            pb.k,
        ), r
        ta, tb = pa.tensors(), pb.tensors()
        assert sorted(ta) == sorted(tb), r
        for name in ta:
            assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), (r, name)
        assert (pa.bias is None) == (pb.bias is None), r
        assert pa.bias is None or torch.equal(pa.bias, pb.bias), r


@pytest.fixture
def hf_src(tmp_path):
    src = tmp_path / "src"
    write_hf(src, "qwen3_moe", num_layers=4, dense_layers=(0,))
    return src


def test_convert_hf_int4_bit_identical(hf_src, tmp_path):
    out = tmp_path / "out"
    m = convert(hf_src, out, "int4", 32, symmetric=False)
    assert m["format"] == "int4" and m["group_size"] == 32 and m["symmetric"] is False
    assert m["kt_ops_version"] == kt_ops.__version__
    assert m["source"] == {"path": str(hf_src.resolve()), "kind": "hf_safetensors", "dtype": "bf16"}
    assert m["moe_layers"] == [1, 2, 3] and sorted(m["layers"]) == ["1", "2", "3"]
    assert read_manifest(out) == m
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([MANIFEST_NAME, *(layer_file_name(L) for L in (1, 2, 3))])
    entry = m["layers"]["2"]
    assert entry["shape"] == [4, 32, 64]
    assert entry["sha256"] == sha256_file(out / entry["file"])
    assert entry["projections"]["down"] == {
        "format": "int4",
        "group_size": 32,
        "n": 64,
        "k": 32,
        "tensors": ["scales", "weight", "zeros"],
    }
    ck = open_checkpoint(hf_src)
    experts = ConvertedExperts(out)
    assert experts.complete and len(experts) == 3 and experts.layers == [1, 2, 3]
    assert (experts.num_experts, experts.intermediate_size, experts.hidden_size) == (4, 32, 64)
    seen = []
    for L, layer in experts:
        seen.append(L)
        assert_same_layer(layer, ck.load_layer(L, "int4", 32, symmetric=False))
    assert seen == [1, 2, 3]
    assert_same_layer(load_converted(out, 3), experts[3])


def test_convert_default_group_size_recorded(hf_src, tmp_path):
    m = convert(hf_src, tmp_path / "o", "q8_0", layers=[2])
    assert m["group_size"] == 32 and sorted(m["layers"]) == ["2"]
    # asking again with the explicit default is the same conversion
    convert(hf_src, tmp_path / "o", "q8_0", 32, layers=[3])
    assert ConvertedExperts(tmp_path / "o").layers == [2, 3]


@pytest.mark.parametrize(
    "kind", ["fp8", "mxfp4", "gguf", "gguf_iq", "gguf_int8", "mixtral_native", "gpt_oss_biases"]
)
def test_convert_sources_bit_identical(tmp_path, kind):
    src = tmp_path / "src"
    fmt = None
    if kind == "fp8":
        write_hf_fp8(src)
    elif kind == "mxfp4":
        write_hf_mxfp4(src)
    elif kind == "mixtral_native":
        write_hf(src, "mixtral", dtype=torch.float32)
    elif kind == "gpt_oss_biases":  # the per-expert biases travel with the packed layer
        write_hf(src, "gpt_oss")
    else:
        src = tmp_path / "m.gguf"
        if kind == "gguf":
            types = {"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K}
            write_gguf(src, types, E=2, H=256, I=256, moe_layers=(0, 1))
        elif kind == "gguf_iq":  # a dynamic IQ1_S / IQ1_M / IQ2_XXS mix: the blocks as stored
            types = {"gate": Q.IQ1_S, "up": Q.IQ1_M, "down": Q.IQ2_XXS}
            write_gguf(src, types, E=2, H=256, I=256, moe_layers=(0, 1))
        else:
            write_gguf(src, dict.fromkeys(ROLES, Q.F16), H=64, I=32, moe_layers=(0, 1))
            fmt = "int8"
    out = tmp_path / "out"
    m = convert(src, out, fmt)
    ck = open_checkpoint(src)
    assert m["source"]["kind"] == ck.kind and m["format"] == (fmt or "native")
    for L in ck.moe_layers:
        assert_same_layer(load_converted(out, L), ck.load_layer(L, fmt))
    if kind == "gpt_oss_biases":
        assert load_converted(out, ck.moe_layers[0]).down.bias.abs().sum() > 0
    if kind == "gguf":
        formats = {r: m["layers"]["0"]["projections"][r]["format"] for r in ROLES}
        assert formats == {"gate": "q4_k", "up": "q4_k", "down": "q6_k"}
        # GGUF's own size: 144 (Q4_K) and 210 (Q6_K) bytes per 256 weights, as in the file.
        layer = load_converted(out, 0)
        per_256 = {"gate": 144, "up": 144, "down": 210}
        for r in ROLES:
            assert getattr(layer, r).nbytes == 2 * 256 * 256 // 256 * per_256[r]
    if kind == "gguf_iq":  # GGUF's size: 50 / 56 / 66 (IQ1_S / IQ1_M / IQ2_XXS) per 256 weights
        layer = load_converted(out, 0)
        per_256 = {"gate": 50, "up": 56, "down": 66}
        assert layer.weight_format == "iq1_s,iq1_m,iq2_xxs"
        for r in ROLES:
            assert getattr(layer, r).nbytes == 2 * 256 * 256 // 256 * per_256[r]


def test_resume_after_interruption(hf_src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_write = conv._write_layer_file

    def crash_on_layer_2(path, packed, meta):
        if meta["layer"] == 2:
            path.write_bytes(b"half a layer")  # the crash leaves a partial temp file
            raise KeyboardInterrupt("simulated crash")
        real_write(path, packed, meta)

    monkeypatch.setattr(conv, "_write_layer_file", crash_on_layer_2)
    with pytest.raises(KeyboardInterrupt):
        convert(hf_src, out, "int8")
    m = read_manifest(out)
    assert sorted(m["layers"]) == ["1"]
    assert any(p.name.endswith(".tmp") for p in out.iterdir())
    f1 = out / layer_file_name(1)
    stat1, sha1 = f1.stat(), sha256_file(f1)
    monkeypatch.setattr(conv, "_write_layer_file", real_write)

    done = []
    m = convert(hf_src, out, "int8", on_layer_done=lambda L, p: done.append(L))
    assert done == [2, 3]  # layer 1 was verified and skipped
    assert f1.stat().st_mtime_ns == stat1.st_mtime_ns and f1.stat().st_ino == stat1.st_ino
    assert sha256_file(f1) == sha1 == m["layers"]["1"]["sha256"]
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())
    ck = open_checkpoint(hf_src)
    for L in (1, 2, 3):
        assert_same_layer(load_converted(out, L), ck.load_layer(L, "int8"))

    # an altered finished layer is detected by its checksum and redone
    f2 = out / layer_file_name(2)
    good = f2.read_bytes()
    f2.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    done.clear()
    convert(hf_src, out, "int8", on_layer_done=lambda L, p: done.append(L))
    assert done == [2] and f2.read_bytes() == good


def test_interrupted_by_callback_keeps_finished_layers(hf_src, tmp_path):
    out = tmp_path / "out"

    def stop_after_first(L, path):
        raise RuntimeError(f"stop after {L}")

    with pytest.raises(RuntimeError, match="stop after 1"):
        convert(hf_src, out, "bf16", on_layer_done=stop_after_first)
    assert sorted(read_manifest(out)["layers"]) == ["1"]
    m = convert(hf_src, out, "bf16")
    assert sorted(m["layers"]) == ["1", "2", "3"]


def test_convert_argument_errors(hf_src, tmp_path):
    """Bad arguments of convert(): a ValueError (FileNotFoundError for a missing source)
    naming the argument, before anything is written."""
    out = tmp_path / "out"
    for layers in (["a"], [1.7], [True]):
        with pytest.raises(ValueError, match=r"layers=.*expected layer indices"):
            convert(hf_src, out, "int8", layers=layers)
    for group_size in (-32, 1.5, "32", True):
        with pytest.raises(ValueError, match=r"group_size=.*expected a non-negative int"):
            convert(hf_src, out, "int4", group_size)
    with pytest.raises(ValueError, match=r"layers \[7\] of .* have no routed experts"):
        convert(hf_src, out, "int8", layers=[7])
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        convert(tmp_path / "no-such-dir", out, "int8")
    assert not out.exists() or not any(out.iterdir())


def test_refuses_mixing(hf_src, tmp_path):
    out = tmp_path / "out"
    convert(hf_src, out, "int4", 32, layers=[1])
    with pytest.raises(ValueError, match=r"manifest\.json.*format 'int4', not 'int8'"):
        convert(hf_src, out, "int8")
    with pytest.raises(ValueError, match="group_size 32, not 64"):
        convert(hf_src, out, "int4", 64)
    with pytest.raises(ValueError, match="symmetric True, not False"):
        convert(hf_src, out, "int4", 32, symmetric=False)
    other = tmp_path / "other"
    write_hf(other, "qwen3_moe", num_layers=4)
    with pytest.raises(ValueError, match="source path"):
        convert(other, out, "int4", 32)
    g = tmp_path / "m.gguf"
    write_gguf(g, dict.fromkeys(ROLES, Q.F16), H=64, I=32, moe_layers=(1,))
    with pytest.raises(ValueError, match="source"):
        convert(g, out, "int4", 32)
    assert sorted(read_manifest(out)["layers"]) == ["1"]  # untouched
    # a non-empty directory without a manifest
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        convert(hf_src, junk, "int8")
    with pytest.raises(ValueError, match="no routed experts"):
        convert(hf_src, tmp_path / "x", "int8", layers=[0])
    with pytest.raises(ValueError, match="int3"):
        convert(hf_src, tmp_path / "y", "int3")


def test_failed_first_layer_leaves_no_manifest(hf_src, tmp_path):
    """A run that fails before finishing a layer does not pin the directory to its arguments."""
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="group"):
        convert(hf_src, out, "int4")  # default group 128 does not divide H = 64
    assert not (out / MANIFEST_NAME).exists()
    assert sorted(convert(hf_src, out, "int4", 32)["layers"]) == ["1", "2", "3"]
    g = tmp_path / "m.gguf"
    write_gguf(g, {"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K}, E=2, moe_layers=(0,))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down_exps\.weight is Q6_K"):
        convert(g, tmp_path / "g", "q4_k")  # checked before any layer is converted
    assert list((tmp_path / "g").iterdir()) == []


def test_load_errors_name_the_file(hf_src, tmp_path):
    out = tmp_path / "out"
    convert(hf_src, out, "int8")
    f = out / layer_file_name(2)
    good = f.read_bytes()

    f.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(ValueError, match=r"layer_002\.safetensors.*truncated or altered"):
        load_converted(out, 2)
    f.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))  # one byte altered
    with pytest.raises(ValueError, match=r"layer_002\.safetensors.*sha256"):
        ConvertedExperts(out)[2]
    f.unlink()  # missing
    with pytest.raises(FileNotFoundError, match=r"layer_002\.safetensors"):
        load_converted(out, 2)
    with pytest.raises(FileNotFoundError, match=r"layer_002\.safetensors"):
        list(ConvertedExperts(out))
    # not valid safetensors, though the manifest agrees with the bytes
    f.write_bytes(b"\xff" * 64)
    m = json.loads((out / MANIFEST_NAME).read_text())
    m["layers"]["2"]["sha256"] = sha256_file(f)
    (out / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"layer_002\.safetensors.*not a valid safetensors"):
        load_converted(out, 2)
    # a layer that was never converted, a missing or broken manifest
    with pytest.raises(ValueError, match="layer 0 was not converted"):
        load_converted(out, 0)
    assert load_converted(out, 1).gate.weight_format == "int8"
    (out / MANIFEST_NAME).write_text("{")
    with pytest.raises(ValueError, match=r"manifest\.json"):
        ConvertedExperts(out)
    os.remove(out / MANIFEST_NAME)
    with pytest.raises(FileNotFoundError, match=r"manifest\.json"):
        load_converted(out, 1)


def test_cli_convert(hf_src, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["convert", str(hf_src), str(out), "--format", "int4", "--group-size", "32"]
    assert cli_main([*args, "--asymmetric", "--layers", "1", "--layers", "3", "--no-progress"]) == 0
    assert ConvertedExperts(out).layers == [1, 3]
    assert cli_main([*args, "--asymmetric", "--layers", "1-3", "--no-progress"]) == 0
    experts = ConvertedExperts(out)
    assert experts.complete and experts.symmetric is False
    assert "3/3 MoE layers" in capsys.readouterr().out
    assert cli_main([*args, "--no-progress"]) == 1  # symmetric now: refused
    assert "symmetric" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path / "none"), str(out)]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["convert", "--help"])
    assert "--group-size" in capsys.readouterr().out
    assert conv.parse_layers(["0-2,5", "7"]) == [0, 1, 2, 5, 7]
    with pytest.raises(ValueError, match="--layers"):
        conv.parse_layers(["a-b"])


def _set_manifest_version(out, version: int) -> None:
    path = out / MANIFEST_NAME
    m = json.loads(path.read_text())
    m["manifest_version"] = version
    path.write_text(json.dumps(m))


def test_manifest_version_1_directories(hf_src, tmp_path):
    # manifest_version 1 stored k-quants as fp32 d*sc scales + dmin*m zeros; versions 2
    # and 3 keep GGUF's own scales. A version-1 directory with k-quants is refused, naming it.
    g = tmp_path / "m.gguf"
    write_gguf(g, {"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K}, E=2, moe_layers=(0,))
    out = tmp_path / "k"
    assert convert(g, out)["manifest_version"] == 3
    _set_manifest_version(out, 1)
    old = r"manifest_version 1 directory: layer 0 down is q6_k in the old k-quant layout.*convert"
    with pytest.raises(ValueError, match=old):
        ConvertedExperts(out)
    with pytest.raises(ValueError, match=old):
        load_converted(out, 0)
    with pytest.raises(ValueError, match=old):
        convert(g, out)  # not resumed either
    # No other layout changed: a version-1 int8 directory still loads, bit-identically,
    # but a conversion is not resumed into it.
    o8 = tmp_path / "i8"
    convert(hf_src, o8, "int8")
    _set_manifest_version(o8, 1)
    assert_same_layer(load_converted(o8, 2), open_checkpoint(hf_src).load_layer(2, "int8"))
    with pytest.raises(ValueError, match="manifest_version 1, not 3"):
        convert(hf_src, o8, "int8")
    _set_manifest_version(o8, 4)
    with pytest.raises(ValueError, match="manifest_version 4; this kt_ops reads 1, 2, 3"):
        ConvertedExperts(o8)


def test_manifest_version_2_directories_repack_q2_k_and_q3_k(tmp_path):
    # manifest_version 2 held q2_k / q3_k codes in the 4-bit plane; version 3 in 2- and
    # 3-bit planes. A version-2 directory loads, its codes repacked, bit-identically.
    g = tmp_path / "m.gguf"
    write_gguf(g, {"gate": Q.Q2_K, "up": Q.Q3_K, "down": Q.Q2_K}, E=2, moe_layers=(0,))
    out = tmp_path / "k"
    assert convert(g, out)["manifest_version"] == 3
    want = open_checkpoint(g).load_layer(0)
    assert_same_layer(load_converted(out, 0), want)
    # Rewrite the layer file as version 2 wrote it (the same metadata and checksums).
    path = out / "layer_000.safetensors"
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for role in ROLES:
        p = getattr(want, role)
        codes = unpack_codes(p.weight, format_spec(p.weight_format).bits, p.n, p.k)
        tensors[f"{role}.weight"] = pack_codes(codes, 4)
    save_file(tensors, path, metadata=meta)
    m = json.loads((out / MANIFEST_NAME).read_text())
    m["manifest_version"] = 2
    m["layers"]["0"]["sha256"] = sha256_file(path)
    m["layers"]["0"]["bytes"] = path.stat().st_size
    (out / MANIFEST_NAME).write_text(json.dumps(m))
    assert_same_layer(load_converted(out, 0), want)
    assert_same_layer(ConvertedExperts(out).load_layer(0), want)
