"""Source files whose structure was edited (issue #13, item 8).

* GGUF: a tensor info's data offset that leaves the data section, is not
  aligned, or makes two tensors overlap is refused (ValueError naming the file
  and the tensor); before, some edits read shifted bytes without an error.
* Fused gate/up tensors (MXFP4 gpt-oss, dense fused): the split (interleaved
  for gpt-oss, concatenated otherwise) is decided by ``config.json``'s
  ``model_type``; a missing ``config.json`` / ``model_type``, a model type
  that disagrees with ``architectures``, or MXFP4 experts of a model type
  other than gpt-oss are refused instead of silently giving other weights.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from checkpoints import ROLES, Q, write_gguf, write_hf, write_hf_mxfp4
from gguf import GGUFReader

from kt_ops.loaders import GGUFCheckpoint, HFCheckpoint, open_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------------------------
# GGUF tensor data offsets
# --------------------------------------------------------------------------------------------


try:  # numpy >= 2
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # pragma: no cover
    _byte_bounds = np.byte_bounds


def gguf_offset_fields(path) -> dict[str, tuple[int, int]]:
    """Tensor name -> (file position of its uint64 relative data offset, that offset)."""
    r = GGUFReader(str(path))
    base = _byte_bounds(r.data)[0]
    out = {}
    for t in r.tensors:
        part = t.field.parts[-1]
        out[t.name] = (_byte_bounds(part)[0] - base, int(part[0]))
    return out


def set_offset(path, pos: int, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(struct.pack("<Q", value))


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_gguf(path, {"gate": Q.Q8_0, "up": Q.Q8_0, "down": Q.F16}, E=2, H=64, I=32)
    return path


def _edits(path):
    fields = gguf_offset_fields(path)
    names = sorted(fields, key=lambda n: fields[n][1])
    size = path.stat().st_size
    for i, name in enumerate(names):
        pos, off = fields[name]
        yield f"{name}+32", pos, off + 32
        yield f"{name}-32", pos, off - 32
        yield f"{name}+1", pos, off + 1
        yield f"{name}+4096", pos, off + 4096
        yield f"{name}=huge", pos, size * 2
        if i > 0:
            yield f"{name}=prev", pos, fields[names[i - 1]][1]
        if i + 1 < len(names):
            yield f"{name}=next", pos, fields[names[i + 1]][1]


def _load_all(path):
    ck = GGUFCheckpoint(path)
    return {L: ck.load_layer(L) for L in ck.moe_layers}


def test_edited_gguf_offsets_are_refused_or_exact(gguf_file, tmp_path):
    good = gguf_file.read_bytes()
    want = _load_all(gguf_file)
    refused = 0
    cases = list(_edits(gguf_file))
    assert len(cases) > 40
    for what, pos, value in cases:
        if value < 0:
            continue
        path = tmp_path / "edit.gguf"
        path.write_bytes(good)
        set_offset(path, pos, value)
        try:
            got = _load_all(path)
        except ValueError as e:
            assert str(path) in str(e), (what, e)
            refused += 1
            continue
        for L, layer in want.items():  # never a silently different result
            for r in ROLES:
                for name, t in getattr(layer, r).tensors().items():
                    assert torch.equal(getattr(got[L], r).tensors()[name], t), (what, L, r, name)
    assert refused == sum(1 for c in cases if c[2] >= 0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("+32", "overlap"),
        ("+1", "alignment"),
        ("=huge", "outside the data section|not a readable GGUF file"),
    ],
)
def test_gguf_offset_messages(gguf_file, tmp_path, edit, message):
    fields = gguf_offset_fields(gguf_file)
    name = "blk.0.ffn_gate_exps.weight"
    pos, off = fields[name]
    value = {"+32": off + 32, "+1": off + 1, "=huge": 1 << 40}[edit]
    path = tmp_path / "edit.gguf"
    path.write_bytes(gguf_file.read_bytes())
    set_offset(path, pos, value)
    with pytest.raises(ValueError, match=message) as info:
        GGUFCheckpoint(path)
    assert str(path) in str(info.value)


# --------------------------------------------------------------------------------------------
# Fused gate/up: config.json decides, and is checked
# --------------------------------------------------------------------------------------------


def _edit_config(src, fn):
    cfg_path = src / "config.json"
    cfg = json.loads(cfg_path.read_text())
    fn(cfg)
    cfg_path.write_text(json.dumps(cfg))


def test_mxfp4_without_config_is_refused(tmp_path):
    write_hf_mxfp4(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json.*does not exist"):
        open_checkpoint(tmp_path).load_layer(0)


@pytest.mark.parametrize("model_type", ["qwen3_moe", None])
def test_mxfp4_with_another_model_type_is_refused(tmp_path, model_type):
    write_hf_mxfp4(tmp_path)
    if model_type is None:
        _edit_config(tmp_path, lambda c: c.pop("model_type"))
        match = "has no model_type"
    else:
        _edit_config(tmp_path, lambda c: c.update(model_type=model_type))
        match = "MXFP4 layout of gpt-oss only"
    with pytest.raises(ValueError, match=match):
        HFCheckpoint(tmp_path).load_layer(0)


def test_mxfp4_with_gpt_oss_config_loads(tmp_path):
    expected = write_hf_mxfp4(tmp_path)
    _edit_config(tmp_path, lambda c: c.update(architectures=["GptOssForCausalLM"]))
    from kt_ops.formats import dequantize_weights

    got = HFCheckpoint(tmp_path).load_layer(1)
    for r in ROLES:
        assert torch.equal(dequantize_weights(getattr(got, r)), expected[1][r]), r


def test_architectures_must_agree_with_model_type(tmp_path):
    write_hf(tmp_path, "gpt_oss")
    _edit_config(tmp_path, lambda c: c.update(model_type="qwen3_moe", architectures=["GptOssX"]))
    with pytest.raises(ValueError, match="disagree"):
        HFCheckpoint(tmp_path).load_layer(1)
    _edit_config(
        tmp_path, lambda c: c.update(model_type="gpt_oss", architectures=["Qwen3MoeForCausalLM"])
    )
    with pytest.raises(ValueError, match="disagree"):
        HFCheckpoint(tmp_path).load_layer(1)


def test_dense_fused_without_model_type_is_refused(tmp_path):
    write_hf(tmp_path, "fused")
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="need config.json's model_type"):
        HFCheckpoint(tmp_path).load_layer(1)
