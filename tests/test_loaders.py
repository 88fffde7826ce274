"""Weight loaders: Hugging Face safetensors (every naming pattern, fp8, MXFP4) and GGUF files.

Tiny checkpoints are written on the fly (tests/checkpoints.py). Loaded weights
are checked two ways: ``dequantize_weights(loaded)`` against the dense values
written (exact for bf16 sources loaded as bf16 and for native fp8 / MXFP4 /
GGUF repacking, which are lossless; within the quantization error otherwise),
and ``torch.equal`` against ``quantize_weights`` of those dense values, which
catches a swapped gate/up, a transposition or a wrong expert order.
"""

# ruff: noqa: E741

from __future__ import annotations

import logging
import re
import warnings

import gguf
import numpy as np
import pytest
import torch
from checkpoints import (
    ROLES,
    Q,
    gguf_raw,
    write_compressed_int4,
    write_gguf,
    write_gguf_tensors,
    write_hf,
    write_hf_fp8,
    write_hf_mxfp4,
)
from reference import dense_weights, reference_quant_moe_forward

import kt_ops
import kt_ops.loaders._common as common
import kt_ops.loaders.hf_checkpoint as hf_mod
from kt_ops import ExpertWeights
from kt_ops.convert import convert
from kt_ops.formats import (
    PackedProjection,
    dequantize_weights,
    quantize_weights,
    unpack_kquant_scales,
)
from kt_ops.loaders import (
    CheckpointReader,
    CompressedTensorsCheckpoint,
    ConvertedExperts,
    GGUFCheckpoint,
    HFCheckpoint,
    open_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_packed_equal(a: PackedProjection, b: PackedProjection) -> None:
    assert (a.weight_format, a.group_size, a.n, a.k) == (b.weight_format, b.group_size, b.n, b.k)
    ta, tb = a.tensors(), b.tensors()
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name


def check_layer(
    out: ExpertWeights, expected: dict, fmt: str, group_size=None, symmetric=True
) -> None:
    """``out`` equals quantize_weights of the dense expectation, projection by projection."""
    assert isinstance(out, ExpertWeights)
    for r, p in zip(ROLES, out.projections):
        assert_packed_equal(p, quantize_weights(expected[r], fmt, group_size, symmetric))


# ---------------------------------------------------------------------- HF safetensors

STYLES = ["qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "mixtral", "fused", "fused_transposed"]


@pytest.mark.parametrize("style", [*STYLES, "gpt_oss"])
def test_hf_naming_patterns(tmp_path, style, caplog):
    E, H, I = 4, 64, 32
    with caplog.at_level(logging.WARNING):
        expected = write_hf(tmp_path, style, E=E, H=H, I=I)
        ck = HFCheckpoint(tmp_path)
    assert ck.moe_layers == [1, 2] and ck.num_layers == 3
    assert (ck.num_experts, ck.hidden_size, ck.intermediate_size) == (E, H, I)
    assert ck.layer_shape(2) == (E, I, H)
    assert ck.source_dtype == "bf16" and ck.native_format == "bf16"
    assert ck.has_expert_bias == (style == "gpt_oss")
    # bf16 source -> bf16: lossless
    out = ck.load_layer(1)
    if style == "gpt_oss":  # the biases, split as the interleaved gate/up rows
        gu = (torch.arange(E * 2 * I, dtype=torch.float32).reshape(E, 2 * I) / 100).bfloat16()
        assert torch.equal(out.gate.bias, gu[:, 0::2].float())
        assert torch.equal(out.up.bias, gu[:, 1::2].float())
        assert torch.equal(out.down.bias, -torch.arange(E * H).reshape(E, H).float())
    else:
        assert not out.has_bias
    for r in ROLES:
        assert getattr(out, r).weight_format == "bf16"
        assert torch.equal(dequantize_weights(getattr(out, r)), expected[1][r]), r
    # int8: same bits as quantizing the written values
    check_layer(ck.load_layer(2, "int8"), expected[2], "int8")


@pytest.mark.parametrize(
    "name, edit",
    [
        ("down_proj_bias", lambda b: b.t().contiguous()),  # [H, E]: as many values
        ("gate_up_proj_bias", lambda b: b[:, 1:].contiguous()),
        ("down_proj_bias", lambda b: b[None]),
    ],
)
def test_hf_bad_expert_bias_shape_is_named(tmp_path, name, edit):
    # A bias of the wrong shape (found by tests/test_fuzz_loaders.py: a transposed one
    # had been reported by the layer's checks without the checkpoint's name).
    from safetensors.torch import load_file, save_file

    write_hf(tmp_path, "gpt_oss", E=2, H=64, I=32)
    path = next(p for p in tmp_path.glob("*.safetensors") if p.stat().st_size)
    ts = load_file(path)
    key = next(k for k in ts if k.endswith(f"layers.1.mlp.experts.{name}"))
    ts[key] = edit(ts[key])
    save_file(ts, path)
    ck = HFCheckpoint(tmp_path)
    with pytest.raises(ValueError, match=rf"{tmp_path}.*expert bias .*{name} has shape"):
        ck.load_layer(1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_hf_sharded_fp16_fp32_int4(tmp_path, dtype):
    expected = write_hf(tmp_path, "qwen3_moe", dtype=dtype, shards=3, seed=5)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ck = HFCheckpoint(tmp_path)
    assert ck.source_dtype == {torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    for sym in (True, False):
        out = ck.load_layer(1, "int4", 32, symmetric=sym)
        check_layer(out, expected[1], "int4", 32, sym)
        for r in ROLES:
            ref = expected[1][r]
            err = (dequantize_weights(getattr(out, r)) - ref).abs().max()
            assert err <= ref.abs().max() / 7 * 0.51 + 1e-3, (r, sym, err)


def test_hf_single_safetensors_file_without_config(tmp_path):
    expected = write_hf(tmp_path / "m", "mixtral")
    ck = HFCheckpoint(tmp_path / "m" / "model.safetensors")
    check_layer(ck.load_layer(2, "q8_0"), expected[2], "q8_0")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_transformers_save_pretrained(tmp_path, arch):
    """A real transformers model's save_pretrained output loads with the model's own experts."""
    transformers = pytest.importorskip("transformers")
    common_cfg = dict(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts_per_tok=2,
    )
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, num_experts=4, **common_cfg
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, **common_cfg)
        model = transformers.MixtralForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    ck = HFCheckpoint(tmp_path)
    assert ck.moe_layers == [0, 1] and ck.source_dtype == "fp32"
    for L in ck.moe_layers:
        experts = model.model.layers[L].mlp.experts
        gate_up = experts.gate_up_proj.detach()  # [E, 2I, H], gate rows then up rows
        want = {"gate": gate_up[:, :32], "up": gate_up[:, 32:], "down": experts.down_proj.detach()}
        check_layer(ck.load_layer(L, "int8"), want, "int8")


def test_hf_fp8_native_and_requantized(tmp_path):
    # H, I not multiples of 128: partial scale blocks
    E, H, I = 2, 192, 96
    expected = write_hf_fp8(tmp_path, E=E, H=H, I=I)
    ck = HFCheckpoint(tmp_path)
    assert ck.source_dtype == "fp8" and ck.native_format == "fp8"
    out = ck.load_layer(0)  # native: repacked, no dequantization
    for r in ROLES:
        assert getattr(out, r).weight_format == "fp8"
        assert torch.equal(dequantize_weights(getattr(out, r)), expected[0][r]), r
    check_layer(ck.load_layer(1, "int8"), expected[1], "int8")
    check_layer(ck.load_layer(1, "bf16"), expected[1], "bf16")


def test_hf_fp8_fused(tmp_path):
    expected = write_hf_fp8(tmp_path, E=2, H=256, I=128, fused=True, num_layers=1)
    ck = HFCheckpoint(tmp_path)
    out = ck.load_layer(0, "fp8")
    for r in ROLES:
        assert torch.equal(dequantize_weights(getattr(out, r)), expected[0][r]), r
    check_layer(ck.load_layer(0, "int8"), expected[0], "int8")


def test_hf_fp8_missing_scale_inv(tmp_path):
    write_hf_fp8(tmp_path, drop_scale=True)
    with pytest.raises(ValueError, match=r"experts\.1\.up_proj\.weight_scale_inv"):
        HFCheckpoint(tmp_path)


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_hf_fp8_malformed_scale_inv(tmp_path, bad):
    """A weight_scale_inv of the wrong shape or dtype is named, with what was expected."""
    from safetensors.torch import load_file, save_file

    write_hf_fp8(tmp_path, E=4, H=192, I=96)
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"  # [2, 1]: H=192, I=96
    t = tensors[name]
    tensors[name] = t[:1] if bad == "shape" else t.to(torch.int32)
    save_file(tensors, str(f))
    got = r"I32 \[2, 1\]" if bad == "dtype" else r"F32 \[1, 1\]"
    with pytest.raises(ValueError, match=rf"{re.escape(name)} is {got}.*expected a float tensor"):
        HFCheckpoint(tmp_path).load_layer(1)


def test_hf_mxfp4_native_and_requantized(tmp_path):
    expected = write_hf_mxfp4(tmp_path)
    ck = HFCheckpoint(tmp_path)
    assert ck.source_dtype == "mxfp4" and ck.has_expert_bias
    out = ck.load_layer(1)
    for r in ROLES:
        assert getattr(out, r).weight_format == "mxfp4"
        assert torch.equal(dequantize_weights(getattr(out, r)), expected[1][r]), r
    check_layer(ck.load_layer(0, "bf16"), expected[0], "bf16")
    for r, v in ck.load_dense(0).items():
        assert torch.equal(v, expected[0][r]), r


def test_chunked_packing_equals_whole_layer(tmp_path, monkeypatch):
    """Packing one expert at a time concatenates to exactly the whole-layer result."""
    expected = write_hf(tmp_path, "fused", E=5)
    ck = HFCheckpoint(tmp_path)
    calls = []
    real = hf_mod.quantize_chunk

    def spy(w, *a, **kw):
        calls.append(w.shape[0])
        return real(w, *a, **kw)

    monkeypatch.setattr(hf_mod, "quantize_chunk", spy)
    monkeypatch.setattr(common, "CHUNK_BYTES", 1)
    out = ck.load_layer(1, "int4", 32, symmetric=False)
    assert calls == [1] * 15  # 5 experts x 3 projections, one expert per chunk
    check_layer(out, expected[1], "int4", 32, False)


def test_hf_load_layer_reads_only_that_layer(tmp_path, monkeypatch):
    """Bounded memory: load_layer(L) reads no tensor outside layer L's experts."""
    write_hf(tmp_path, "deepseek_v3", shards=2)
    ck = HFCheckpoint(tmp_path)
    read: list[str] = []
    import kt_ops.loaders.safetensors_io as st_io  # where the reader opens its files

    real_open = st_io.safe_open

    class Spy:
        def __init__(self, h):
            self.h = h

        def __enter__(self):
            self.inner = self.h.__enter__()
            return self

        def __exit__(self, *exc):
            return self.h.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

        def get_slice(self, name):
            read.append(name)
            return self.inner.get_slice(name)

        def keys(self):
            return self.inner.keys()

    monkeypatch.setattr(st_io, "safe_open", lambda *a, **kw: Spy(real_open(*a, **kw)))
    ck.load_layer(2, "int8")
    assert read and all(n.startswith("model.layers.2.mlp.experts.") for n in read), read
    assert set(read) == set(ck.tensor_names(2))


def test_hf_missing_expert_tensor(tmp_path):
    write_hf(tmp_path, "qwen3_moe", drop="model.layers.2.mlp.experts.3.up_proj.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        HFCheckpoint(tmp_path)


def test_hf_missing_fused_tensor(tmp_path):
    write_hf(tmp_path, "fused", drop="model.layers.1.mlp.experts.down_proj")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj"):
        HFCheckpoint(tmp_path)


def _assert_corrupt_safetensors_named(f, reader) -> None:
    """``reader(f.parent)`` names ``f`` when it is truncated or shorter than a header."""
    f.write_bytes(f.read_bytes()[:-100])  # truncated
    with pytest.raises(ValueError, match=rf"{re.escape(f.name)}.*not a valid safetensors"):
        reader(f.parent)
    f.write_bytes(b"\x00" * 7)  # shorter than a header
    with pytest.raises(ValueError, match=re.escape(f.name)):
        reader(f.parent)


def test_hf_corrupt_files(tmp_path):
    write_hf(tmp_path / "t", "qwen3_moe")
    _assert_corrupt_safetensors_named(tmp_path / "t" / "model.safetensors", HFCheckpoint)
    # sharded: a shard listed in the index is missing
    write_hf(tmp_path / "s", "qwen3_moe", shards=2)
    (tmp_path / "s" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        HFCheckpoint(tmp_path / "s")
    # sharded: a shard is corrupt
    write_hf(tmp_path / "c", "qwen3_moe", shards=2)
    (tmp_path / "c" / "model-00001-of-00002.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match="model-00001-of-00002"):
        ck = HFCheckpoint(tmp_path / "c")
        for L in ck.moe_layers:
            ck.load_layer(L)
    (tmp_path / "c" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        HFCheckpoint(tmp_path / "c")


def test_hf_refusals(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        HFCheckpoint(tmp_path / "nope")
    write_hf(tmp_path / "d", "qwen3_moe", dense_layers=(0, 1, 2))
    with pytest.raises(ValueError, match="no routed expert tensors"):
        HFCheckpoint(tmp_path / "d")
    write_hf(tmp_path / "q", "qwen3_moe")
    cfg = (tmp_path / "q" / "config.json").read_text()
    (tmp_path / "q" / "config.json").write_text(
        cfg[:-1] + ', "quantization_config": {"quant_method": "gptq"}}'
    )
    with pytest.raises(ValueError, match="gptq"):
        HFCheckpoint(tmp_path / "q")
    write_hf(tmp_path / "ok", "qwen3_moe")
    ck = HFCheckpoint(tmp_path / "ok")
    with pytest.raises(ValueError, match="layer 0 has no routed experts"):
        ck.load_layer(0)
    with pytest.raises(ValueError, match="int3"):
        ck.load_layer(1, "int3")


# ---------------------------------------------------------------------- GGUF


def test_gguf_k_quants_native(tmp_path):
    path = tmp_path / "m.gguf"
    types = {"gate": Q.Q4_K, "up": Q.Q5_K, "down": Q.Q6_K}
    expected = write_gguf(path, types, E=2, H=256, I=256, moe_layers=(1, 2))
    ck = GGUFCheckpoint(path)
    assert ck.moe_layers == [1, 2] and ck.num_layers == 3
    assert (ck.num_experts, ck.hidden_size, ck.intermediate_size) == (2, 256, 256)
    assert ck.tensor_types(1) == {"gate": "Q4_K", "up": "Q5_K", "down": "Q6_K"}
    assert ck.native_formats(1) == {"gate": "q4_k", "up": "q5_k", "down": "q6_k"}
    for L in (1, 2):
        out = ck.load_layer(L)
        for r in ROLES:
            assert getattr(out, r).weight_format == types[r].name.lower()
            want = expected[L][r]["dense"]
            assert torch.equal(dequantize_weights(getattr(out, r)), want), (L, r)
            # Near copy of the blocks: GGUF's size, and its scale bytes as they are.
            raw = np.asarray(expected[L][r]["raw"]).reshape(2, 256, -1, {"Q4_K": 144,
                  "Q5_K": 176, "Q6_K": 210}[types[r].name])  # fmt: skip
            assert getattr(out, r).nbytes == raw.size
            head = raw[..., 192:210] if r == "down" else raw[..., 0:16]
            got = unpack_kquant_scales(getattr(out, r).scales, getattr(out, r).weight_format, 256)
            assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(head)))


def test_gguf_q8_0_q4_0_native(tmp_path):
    path = tmp_path / "m.gguf"
    types = {"gate": Q.Q8_0, "up": Q.Q8_0, "down": Q.Q4_0}
    expected = write_gguf(path, types, E=4, H=64, I=32, moe_layers=(0,))
    ck = open_checkpoint(path)
    assert isinstance(ck, GGUFCheckpoint) and ck.source_dtype == "q8_0"
    out = ck.load_layer(0)
    for r in ROLES:
        want = torch.from_numpy(gguf.quants.dequantize(expected[0][r]["raw"], types[r]))
        assert torch.equal(dequantize_weights(getattr(out, r)), want), r
    # explicit format must match each quantized tensor
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down_exps\.weight is Q4_0"):
        ck.load_layer(0, "q8_0")


def test_gguf_split_experts_load_as_merged(tmp_path):
    # Files converted before llama.cpp merged the experts (Mixtral-8x7B's GGUFs: arch
    # "llama", one 2-D tensor per expert) load as the same data in merged tensors would.
    types = {"gate": Q.Q4_K, "up": Q.F16, "down": Q.Q6_K}
    split, merged = tmp_path / "split.gguf", tmp_path / "merged.gguf"
    kw = dict(E=3, H=256, I=256, moe_layers=(0, 2), arch="llama")
    expected = write_gguf(split, types, split_experts=True, **kw)
    write_gguf(merged, types, **kw)  # the same seed: the same blocks
    ck, ref = GGUFCheckpoint(split), GGUFCheckpoint(merged)
    assert ck.moe_layers == [0, 2] and ck.num_layers == 3 and ck.architecture == "llama"
    assert (ck.num_experts, ck.hidden_size, ck.intermediate_size) == (3, 256, 256)
    assert ck.tensor_types(2) == {"gate": "Q4_K", "up": "F16", "down": "Q6_K"}
    assert ck.native_formats(2) == {"gate": "q4_k", "up": "bf16", "down": "q6_k"}
    for L in (0, 2):
        got, want = ck.load_layer(L), ref.load_layer(L)
        for r in ROLES:
            a, b = getattr(got, r), getattr(want, r)
            assert a.weight_format == b.weight_format and torch.equal(a.weight, b.weight), r
            assert torch.equal(a.scales, b.scales) if b.scales is not None else a.scales is None
        assert torch.equal(dequantize_weights(got.down), expected[L]["down"]["dense"])
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    ids, weights = torch.randint(0, 3, (5, 2)), torch.rand(5, 2)
    out = ck.load_layer(0)
    assert torch.equal(kt_ops.moe_forward(x, ids, weights, out),
                       kt_ops.moe_forward(x, ids, weights, ref.load_layer(0)))  # fmt: skip


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.BF16])
def test_gguf_fused_gate_up_experts(tmp_path, qtype):
    # blk.{L}.ffn_gate_up_exps.weight (llama.cpp's qwen35moe / qwen3next files): gate's
    # rows then up's, each repacked exactly as a tensor of its own would be.
    types = {"gate": qtype, "up": qtype, "down": Q.Q6_K}
    fused, separate = tmp_path / "fused.gguf", tmp_path / "separate.gguf"
    kw = dict(E=3, H=256, I=256, moe_layers=(1,), arch="qwen35moe")
    expected = write_gguf(fused, types, fused_gate_up=True, **kw)
    write_gguf(separate, types, **kw)
    ck, ref = GGUFCheckpoint(fused), GGUFCheckpoint(separate)
    assert (
        "blk.1.ffn_gate_up_exps.weight" in ck._tensors
        and "blk.1.ffn_gate_exps.weight" not in ck._tensors
    )
    assert (ck.num_experts, ck.hidden_size, ck.intermediate_size) == (3, 256, 256)
    assert ck.tensor_types(1) == {"gate": qtype.name, "up": qtype.name, "down": "Q6_K"}
    got, want = ck.load_layer(1), ref.load_layer(1)
    for r in ROLES:
        a, b = getattr(got, r), getattr(want, r)
        assert a.weight_format == b.weight_format and torch.equal(a.weight, b.weight), r
        assert torch.equal(a.scales, b.scales) if b.scales is not None else a.scales is None
    if qtype != Q.BF16:
        assert torch.equal(dequantize_weights(got.up), expected[1]["up"]["dense"])
    # Its bias (blk.{L}.ffn_gate_up_exps.bias [E, 2I], as llama.cpp's gate_up_exps_b):
    # split as the rows are.
    path = tmp_path / "fused_bias.gguf"
    biases = {"gate": Q.F32, "up": Q.F32, "down": Q.F32}
    expected = write_gguf(path, types, fused_gate_up=True, bias_types=biases, **kw)
    ck = GGUFCheckpoint(path)
    assert "blk.1.ffn_gate_up_exps.bias" in ck._tensors and ck.has_expert_bias
    out = ck.load_layer(1)
    for r in ROLES:
        assert torch.equal(getattr(out, r).bias, expected[1][r]["bias"]), r


def _write_scaled_gguf(path, weights, scales, *, E=3, H=128, I=64, seed=0):  # noqa: E741
    """One block: ``weights`` {tensor suffix: qtype} (``gate_exps`` / ``up_exps`` /
    ``down_exps`` or ``gate_up_exps``) with random data, and ``scales`` {suffix: fp32 array}
    written as ``blk.0.ffn_{suffix}.scale``. Returns {name: raw data}."""
    rng = np.random.default_rng(seed)
    raws, tensors = {}, {}
    for suffix, qtype in weights.items():
        n = {"down_exps": H, "gate_up_exps": 2 * I}.get(suffix, I)
        k = I if suffix == "down_exps" else H
        w = (rng.standard_normal((E, n, k)) / k**0.5).astype(np.float32)
        raws[suffix] = gguf_raw(qtype, w, rng)
        tensors[f"blk.0.ffn_{suffix}.weight"] = (qtype, raws[suffix])
    for suffix, s in scales.items():
        tensors[f"blk.0.ffn_{suffix}.scale"] = (Q.F32, np.asarray(s, dtype=np.float32))
    write_gguf_tensors(path, "qwen3moe", tensors)
    return raws


def test_gguf_expert_scales_fold_into_nvfp4_and_float_weights(tmp_path):
    # llama.cpp's optional per-expert output scales (blk.{L}.ffn_*_exps.scale [E]; its
    # build_moe_ffn multiplies each expert's products by them: NVFP4's per-tensor scale).
    g = {"gate_exps": [0.5, 3.0, 1e-3], "up_exps": [2.0, 0.25, 7.0], "down_exps": [1.5, 1, 0.1]}
    weights = {"gate_exps": Q.NVFP4, "up_exps": Q.NVFP4, "down_exps": Q.F16}
    raws = _write_scaled_gguf(tmp_path / "s.gguf", weights, g)
    _write_scaled_gguf(tmp_path / "plain.gguf", weights, {})
    out = GGUFCheckpoint(tmp_path / "s.gguf").load_layer(0)
    plain = GGUFCheckpoint(tmp_path / "plain.gguf").load_layer(0)
    for r in ("gate", "up"):
        s = torch.tensor(g[f"{r}_exps"]).view(-1, 1, 1, 1)
        a, b = getattr(out, r), getattr(plain, r)
        assert torch.equal(a.weight, b.weight)  # the codes as stored; b * g per block
        assert torch.equal(a.scales, b.scales * s)
        want = torch.from_numpy(gguf.quants.dequantize(raws[f"{r}_exps"], Q.NVFP4)) * s[..., 0]
        torch.testing.assert_close(dequantize_weights(a), want, rtol=2e-7, atol=0)
    dense = torch.from_numpy(raws["down_exps"].astype(np.float32))
    want = quantize_weights(dense * torch.tensor(g["down_exps"]).view(-1, 1, 1), "bf16")
    assert torch.equal(out.down.weight, want.weight)
    # The op computes with the scaled weights.
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    ids, w = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2]]), torch.rand(4, 2)
    ref = reference_quant_moe_forward(x, ids, w, *dense_weights(out), activation="fp32")
    got = kt_ops.moe_forward(x, ids, w, out)
    assert ((got - ref.out).norm() / ref.out.norm()).item() < 0.02
    # A fused gate/up tensor takes one scale for both halves.
    fused = {"gate_up_exps": Q.NVFP4, "down_exps": Q.NVFP4}
    _write_scaled_gguf(tmp_path / "f.gguf", fused, {"gate_up_exps": [2.0, 4.0, 0.5]})
    _write_scaled_gguf(tmp_path / "fp.gguf", fused, {})
    a, b = (
        GGUFCheckpoint(tmp_path / "f.gguf").load_layer(0),
        GGUFCheckpoint(tmp_path / "fp.gguf").load_layer(0),
    )
    s = torch.tensor([2.0, 4.0, 0.5]).view(-1, 1, 1, 1)
    assert torch.equal(a.gate.scales, b.gate.scales * s) and torch.equal(
        a.up.scales, b.up.scales * s
    )
    assert torch.equal(a.down.scales, b.down.scales)
    # ... and its down projection a scale of its own.
    _write_scaled_gguf(tmp_path / "fd.gguf", fused, {"down_exps": [2.0, 4.0, 0.5]})
    a = GGUFCheckpoint(tmp_path / "fd.gguf").load_layer(0)
    assert torch.equal(a.down.scales, b.down.scales * s) and torch.equal(
        a.gate.scales, b.gate.scales
    )


def test_gguf_expert_scale_errors(tmp_path):
    nv = {"gate_exps": Q.NVFP4, "up_exps": Q.NVFP4, "down_exps": Q.Q8_0}
    cases = [
        (nv, {"down_exps": [1.0, 2.0, 3.0]},
         r"expert scale blk\.0\.ffn_down_exps\.scale scales blk\.0\.ffn_down_exps\.weight, of "
         r"type Q8_0; kt_ops folds per-expert scales into NVFP4, float and requantized"),
        (nv, {"gate_exps": [1.0, 2.0]}, r"ffn_gate_exps\.scale is F32 with dims \(2,\); expected"),
        ({"gate_up_exps": Q.NVFP4, "down_exps": Q.NVFP4}, {"up_exps": [1.0, 1.0, 1.0]},
         r"a block with gate and up fused takes ffn_gate_up_exps\.scale"),
        (nv, {"gate_up_exps": [1.0, 1.0, 1.0]}, r"one with them apart ffn_gate_exps\.scale"),
    ]  # fmt: skip
    for i, (weights, scales, match) in enumerate(cases):
        path = tmp_path / f"bad{i}.gguf"
        _write_scaled_gguf(path, weights, scales)
        with pytest.raises(ValueError, match=match):
            GGUFCheckpoint(path)
    # Scales of 1 need no fold: any type takes them.
    path = tmp_path / "ones.gguf"
    _write_scaled_gguf(path, nv, {"down_exps": [1.0, 1.0, 1.0]})
    _write_scaled_gguf(tmp_path / "none.gguf", nv, {})
    a, b = GGUFCheckpoint(path).load_layer(0), GGUFCheckpoint(tmp_path / "none.gguf").load_layer(0)
    assert torch.equal(a.down.weight, b.down.weight) and torch.equal(a.down.scales, b.down.scales)
    path = tmp_path / "nan.gguf"
    _write_scaled_gguf(path, nv | {"down_exps": Q.F16}, {"up_exps": [1.0, float("nan"), 1.0]})
    ck = GGUFCheckpoint(path)
    with pytest.raises(
        ValueError, match=r"nan\.gguf: tensor blk\.0\.ffn_up_exps\.weight: expert scale .*NaN"
    ):
        ck.load_layer(0)


def _write_split_gguf(path, experts, *, merged_down=False):
    """A one-block GGUF with per-expert tensors ``{(role, x): (qtype, N, K)}`` (random data);
    ``merged_down`` adds a merged ``ffn_down_exps`` too."""
    rng = np.random.default_rng(0)
    tensors = {
        f"blk.0.ffn_{role}.{x}.weight": (qtype, gguf_raw(qtype, rng.standard_normal((n, k)), rng))
        for (role, x), (qtype, n, k) in experts.items()
    }
    if merged_down:
        tensors["blk.0.ffn_down_exps.weight"] = (
            Q.Q8_0, gguf_raw(Q.Q8_0, rng.standard_normal((2, 64, 64)), rng)
        )  # fmt: skip
    write_gguf_tensors(path, "llama", tensors)


def test_gguf_fused_gate_up_errors(tmp_path):
    rng = np.random.default_rng(0)

    def write(path, tensors):
        out = {}
        for name, shape in tensors.items():
            qtype = Q.F32 if name.endswith(".bias") else Q.Q8_0
            full = f"blk.0.{name}" if name.endswith(".bias") else f"blk.0.{name}.weight"
            out[full] = (qtype, gguf_raw(qtype, rng.standard_normal(shape), rng))
        write_gguf_tensors(path, "qwen35moe", out)

    down = {"ffn_down_exps": (2, 64, 32)}
    cases = [
        ({"ffn_gate_up_exps": (2, 63, 64), **down},
         r"ffn_gate_up_exps\.weight has dims \(64, 63, 2\)"),
        ({"ffn_gate_up_exps": (2, 64, 64), "ffn_up_exps": (2, 32, 64), **down},
         r"block 0 holds blk\.0\.ffn_gate_up_exps\.weight and also blk\.0\.ffn_up_exps"),
        ({"ffn_gate_up_exps": (2, 64, 64)},
         r"ffn_down_exps\.weight is missing \(block 0 has blk\.0\.ffn_gate_up_exps\.weight\)"),
        ({"ffn_gate_up_exps": (2, 96, 64), **down}, r"ffn_down_exps\.weight has dims"),
        ({"ffn_gate_up_exps": (2, 64, 64), "ffn_gate_up_exps.bias": (2, 63), **down},
         r"ffn_gate_up_exps\.bias has dims \(63, 2\); expected \(2I, E\)"),
        ({"ffn_gate_up_exps": (2, 64, 64), "ffn_up_exps.bias": (2, 32),
          "ffn_gate_up_exps.bias": (2, 64), **down}, r"either fused or not"),
        ({"ffn_gate_up_exps": (2, 64, 64), "ffn_gate_up_exps.bias": (2, 64),
          "ffn_gate_exps.bias": (2, 32), **down}, r"either fused or not"),
        ({"ffn_gate_up_exps": (2, 64, 64), "ffn_gate_up_exps.bias": (2, 48), **down},
         r"ffn_gate_up_exps\.bias \(gate rows\) has dims \(ne0, ne1\) = \(24, 2\)"),
    ]  # fmt: skip
    for i, (tensors, match) in enumerate(cases):
        path = tmp_path / f"bad{i}.gguf"
        write(path, tensors)
        with pytest.raises(ValueError, match=match):
            GGUFCheckpoint(path)


def test_gguf_split_experts_errors(tmp_path):
    def layer(E, qtype=Q.Q8_0, H=64, I=32):  # noqa: E741
        return {(r, x): (qtype, *((I, H) if r != "down" else (H, I))) for r in ROLES
                for x in range(E)}  # fmt: skip

    gap = layer(3)
    del gap[("up", 1)]
    cases = [
        (gap, {}, r"blk\.0\.ffn_up\.1\.weight is missing \(block 0 has 2 of the 3"),
        ({**layer(2), ("gate", 1): (Q.Q4_0, 32, 64)}, {},
         r"blk\.0\.ffn_gate\.1\.weight is Q4_0.*blk\.0\.ffn_gate\.0\.weight Q8_0.*same type"),
        ({**layer(2), ("down", 1): (Q.Q8_0, 64, 64)}, {}, r"ffn_down\.1\.weight is Q8_0 with dims"),
        ({**layer(2, I=64)}, {"merged_down": True}, r"block 0 holds both merged"),
        ({k: v for k, v in layer(2).items() if k[0] != "down"}, {},
         r"blk\.0\.ffn_down\.\{x\}\.weight is missing \(block 0 has blk\.0\.ffn_gate\.\{0\.\.1\}"),
        ({**layer(2), ("gate", 7): (Q.Q8_0, 32, 64)}, {}, r"ffn_gate\.2\.weight is missing"),
        ({**layer(2), ("up", 2): (Q.Q8_0, 32, 64)}, {}, r"ffn_up\.\{0\.\.2\}\.weight has dims"),
    ]  # fmt: skip
    for i, (experts, kw, match) in enumerate(cases):
        path = tmp_path / f"bad{i}.gguf"
        _write_split_gguf(path, experts, **kw)
        with pytest.raises(ValueError, match=match):
            GGUFCheckpoint(path)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.F32])
def test_gguf_float_tensors_quantized_online(tmp_path, qtype):
    path = tmp_path / "f.gguf"
    expected = write_gguf(path, dict.fromkeys(ROLES, qtype), E=4, H=64, I=32, moe_layers=(0,))
    ck = GGUFCheckpoint(path)
    assert ck.native_format == "bf16"
    dense = {r: expected[0][r]["dense"] for r in ROLES}
    check_layer(ck.load_layer(0, "int8"), dense, "int8")
    check_layer(ck.load_layer(0), dense, "bf16")


def test_gguf_unsupported_type(tmp_path):
    path = tmp_path / "f64.gguf"
    write_gguf(path, {"gate": Q.Q4_K, "up": Q.F64, "down": Q.Q6_K}, moe_layers=(0,))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up_exps\.weight.*F64.*Q4_K") as ei:
        GGUFCheckpoint(path)
    msg = str(ei.value)
    assert "Q8_0" in msg and "Q2_K" in msg and "Q5_1" in msg and "supported" in msg
    assert "requantized: TQ1_0" in msg and "TQ2_0" in msg and "IQ2_XXS" in msg
    assert "IQ1_M" in msg.split("; requantized")[0]  # a native type


REQUANTIZED = [Q.TQ1_0, Q.TQ2_0]


@pytest.mark.parametrize("qtype", REQUANTIZED, ids=lambda t: t.name)
def test_gguf_ternary_types_load_exactly_as_q2_k(tmp_path, qtype):
    """TQ1_0 / TQ2_0 tensors (W = d (q - 1)) load as q2_k holding gguf's values exactly
    (sc = m = 1, dmin = d), with no warning; another format requantizes them, warning
    (the lattice-grid i-quants load natively: test_gguf_types_beyond_q4_k_native)."""
    path = tmp_path / "tq.gguf"
    types = {"gate": qtype, "up": qtype, "down": Q.Q2_K}
    expected = write_gguf(path, types, E=2, H=256, I=256, moe_layers=(0,))
    ck = GGUFCheckpoint(path)
    assert ck.native_format == "q2_k" and ck.source_dtype == qtype.name.lower()
    assert ck.native_formats(0) == dict.fromkeys(ROLES, "q2_k")
    dense = {r: expected[0][r]["dense"] for r in ROLES}
    for r in ("gate", "up"):  # every ternary value (TQ2_0's code 3 too: W = 2 d)
        assert bool(torch.isfinite(dense[r]).all()) and dense[r].abs().max() > 0
        d = dense[r].abs().amax(-1, keepdim=True)
        assert len(torch.unique(torch.round(dense[r] / d, decimals=3))) >= 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exact: nothing to warn about
        out = ck.load_layer(0)
        assert_packed_equal(out.gate, ck.load_layer(0, "q2_k").gate)
    for r in ROLES:
        assert torch.equal(dequantize_weights(getattr(out, r)), dense[r]), r
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    ids, weights = torch.randint(0, 2, (8, 2)), torch.rand(8, 2)
    want = reference_quant_moe_forward(x, ids, weights, *dense_weights(out), activation="fp32")
    got = kt_ops.moe_forward(x, ids, weights, out)
    assert ((got - want.out).norm() / want.out.norm()).item() < 0.02  # the q8 activations
    # The native Q2_K down only loads as q2_k; gate and up requantize elsewhere (lossy).
    with pytest.raises(ValueError, match=r"ffn_down_exps\.weight is Q2_K"):
        ck.load_layer(0, "q8_0")


def test_gguf_requantized_to_an_explicit_format(tmp_path):
    path = tmp_path / "iq_mix.gguf"
    types = {"gate": Q.TQ2_0, "up": Q.TQ2_0, "down": Q.TQ1_0}  # requantized to q8_0
    expected = write_gguf(path, types, E=2, H=256, I=256, moe_layers=(0,))
    ck = GGUFCheckpoint(path)
    dense = {r: expected[0][r]["dense"] for r in ROLES}
    with pytest.warns(UserWarning, match="requantized to 'q8_0'"):
        out = ck.load_layer(0, "q8_0")
    check_layer(out, dense, "q8_0")
    for r in ROLES:
        got = dequantize_weights(getattr(out, r))
        assert float((got - dense[r]).norm() / dense[r].norm()) < 0.01, r
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    ids, weights = torch.randint(0, 2, (8, 2)), torch.rand(8, 2)
    want = reference_quant_moe_forward(x, ids, weights, *dense_weights(out), activation="fp32")
    got = kt_ops.moe_forward(x, ids, weights, out)
    assert ((got - want.out).norm() / want.out.norm()).item() < 0.02  # the q8 activations


@pytest.mark.parametrize("qtype", [Q.TQ2_0, Q.IQ2_XXS, Q.IQ1_M], ids=lambda t: t.name)
def test_gguf_grid_corrupt_scale_is_named(tmp_path, qtype):
    # Requantized or repacked (TQ2_0) or held as stored (IQ2_XXS; IQ1_M, whose d is spread
    # over its scale words): an inf d is refused, naming the tensor.
    path = tmp_path / "iq_nan.gguf"
    write_gguf(path, dict.fromkeys(ROLES, qtype), E=2, H=256, I=256, moe_layers=(0,))
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up_exps.weight")
    raw = bytearray(path.read_bytes())
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    at = int(t.data_offset) + block_bytes * 5  # the sixth block
    if qtype == Q.IQ1_M:  # inf = 0x7C00: d's nibbles 2 and 3 in words 2 and 3's top nibbles
        raw[at + 53] = (raw[at + 53] & 0x0F) | 0xC0
        raw[at + 55] = (raw[at + 55] & 0x0F) | 0x70
    else:  # d at byte 0 (IQ2_XXS) or 64 (TQ2_0: qs[64] first)
        at += 64 if qtype == Q.TQ2_0 else 0
        raw[at : at + 2] = np.float16(np.inf).tobytes()
    path.write_bytes(bytes(raw))
    ck = GGUFCheckpoint(path)
    if qtype == Q.TQ2_0:  # requantized to q8_0, or repacked into q2_k exactly
        with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"ffn_up_exps.*NaN or inf"):
            ck.load_layer(0, "q8_0")
        with pytest.raises(ValueError, match=r"ffn_up_exps.*non-finite fp16 d/dmin in a q2_k"):
            ck.load_layer(0)
    else:
        name = qtype.name.lower()
        with pytest.raises(ValueError, match=rf"ffn_up_exps.*non-finite fp16 d in a {name}"):
            ck.load_layer(0)


@pytest.mark.parametrize(
    "types",
    [
        # Q2_K and Q3_K (GGUF Q2_K / Q3_K_M files): their codes held in the 4-bit plane.
        {"gate": Q.Q2_K, "up": Q.Q3_K, "down": Q.Q2_K},
        # IQ4_XS with IQ4_NL (bartowski's / unsloth's IQ4_XS files): their codes as stored,
        # the IQ4_NL grid in the kernels.
        {"gate": Q.IQ4_XS, "up": Q.IQ4_XS, "down": Q.IQ4_NL},
        # A Q4_K_M file of a model whose expert width is not a multiple of 256 (I = 1408:
        # DeepSeek-V2-Lite, GLM-4.5-Air): llama.cpp falls back to Q5_0 for ffn_down_exps.
        {"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q5_0},
        # The other fallbacks (Q5_K -> Q5_1) and the legacy Q4_1.
        {"gate": Q.Q5_1, "up": Q.Q4_1, "down": Q.Q5_1},
        # NVFP4 (llama.cpp's NVFP4 files): E2M1 codes as stored, UE4M3 scales as fp32;
        # beside MXFP4 (64-weight blocks: I = 160 is no multiple, so down is MXFP4).
        {"gate": Q.NVFP4, "up": Q.NVFP4, "down": Q.MXFP4},
        # The lattice-grid i-quants (unsloth's dynamic UD-IQ1_S / UD-IQ2_XXS files of
        # DeepSeek-R1 and kin): their blocks as stored, decoded per block by the kernels.
        {"gate": Q.IQ1_S, "up": Q.IQ2_XXS, "down": Q.IQ3_XXS},
        {"gate": Q.IQ3_S, "up": Q.IQ2_XXS, "down": Q.IQ2_XXS},
        # Their types with scales per 16 weights (UD-IQ1_M, IQ2_XS / IQ2_M files).
        {"gate": Q.IQ1_M, "up": Q.IQ2_XS, "down": Q.IQ2_S},
    ],
    ids=[
        "q2_k_q3_k",
        "iq4",
        "q4_k_m_fallback",
        "q4_1_q5_1",
        "nvfp4",
        "iq1_iq2_iq3",
        "iq3_s",
        "iq1_m_iq2_xs_iq2_s",
    ],  # fmt: skip
)
def test_gguf_types_beyond_q4_k_native(tmp_path, types):
    # Exactly gguf.quants.dequantize's weights, and the op computes with them (the
    # kernels in detail: tests/test_quant_forward.py).
    path = tmp_path / "low.gguf"
    # I = 160: rows of 32-weight blocks that are not a multiple of 256 (the k-quants' blocks)
    I = 160 if types["down"] in (Q.Q5_0, Q.Q5_1, Q.MXFP4) else 256  # noqa: E741
    expected = write_gguf(path, types, E=2, H=256, I=I, moe_layers=(0,))
    ck = GGUFCheckpoint(path)
    assert ck.tensor_types(0) == {r: t.name for r, t in types.items()}
    fmts = [types[r].name.lower() for r in ROLES]
    assert ck.native_formats(0) == dict(zip(ROLES, fmts))
    out = ck.load_layer(0)
    assert out.weight_format == ",".join(fmts)
    for r in ROLES:
        raw = np.asarray(expected[0][r]["raw"])
        want = torch.from_numpy(gguf.quants.dequantize(raw, types[r]))
        assert torch.equal(expected[0][r]["dense"], want)
        assert torch.equal(dequantize_weights(getattr(out, r)), want), r
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    ids, weights = torch.randint(0, 2, (8, 2)), torch.rand(8, 2)
    want = reference_quant_moe_forward(x, ids, weights, *dense_weights(out), activation="fp32")
    got = kt_ops.moe_forward(x, ids, weights, out)
    assert ((got - want.out).norm() / want.out.norm()).item() < 0.02  # the q8 activations
    other = next(r for r in ROLES if types[r] != types["gate"])
    with pytest.raises(
        ValueError, match=rf"blk\.0\.ffn_{other}_exps\.weight is {types[other].name}"
    ):
        ck.load_layer(0, fmts[0])


def test_gguf_gpt_oss_mxfp4_experts_with_biases(tmp_path):
    # gpt-oss GGUF files (llama.cpp's "gpt-oss" arch): MXFP4 experts, exact as stored, and
    # per-expert biases blk.{L}.ffn_{gate,up,down}_exps.bias [E, n] of a float type, loaded
    # into PackedProjection.bias; the op with gpt-oss's clamped SwiGLU against the reference.
    from reference import quant_mismatch_report, reference_for

    path = tmp_path / "gpt-oss.gguf"
    types = dict.fromkeys(ROLES, Q.MXFP4)
    bias_types = {"gate": Q.F32, "up": Q.BF16, "down": Q.F16}
    expected = write_gguf(
        path, types, E=4, H=96, I=64, moe_layers=(0, 1), arch="gpt-oss", bias_types=bias_types
    )
    ck = GGUFCheckpoint(path)
    assert ck.architecture == "gpt-oss" and ck.has_expert_bias
    assert ck.native_format == "mxfp4" and ck.tensor_types(1) == dict.fromkeys(ROLES, "MXFP4")
    w = ck.load_layer(1)
    assert w.weight_format == "mxfp4" and w.has_bias
    for r in ROLES:
        assert torch.equal(dequantize_weights(getattr(w, r)), expected[1][r]["dense"]), r
        assert torch.equal(getattr(w, r).bias, expected[1][r]["bias"]), r
    spec = kt_ops.activation_spec("silu", alpha=1.702, limit=7.0, up_offset=1.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 96, generator=g)
    ids, weights = torch.randint(0, 4, (9, 2), generator=g), torch.rand(9, 2, generator=g)
    out = kt_ops.moe_forward(x, ids, weights, w, activation=spec)
    ref = reference_for(w, x, ids, weights, act=spec)
    assert quant_mismatch_report(out, ref) is None
    plain = kt_ops.moe_forward(x, ids, weights, w.with_biases(None, None, None), activation=spec)
    assert quant_mismatch_report(plain, ref) is not None  # the biases count


@pytest.mark.parametrize(
    "edit, match",
    [
        ("type", r"ffn_up_exps\.bias has GGML type Q8_0; expert biases load from F32"),
        ("dims", r"ffn_up_exps\.bias has dims \(ne0, ne1\) = \(32, 4\); expected \(64, 4\)"),
        ("orphan", r"blk\.3\.ffn_down_exps\.bias belongs to block 3, which has no expert"),
        ("nan", r"ffn_up_exps\.bias holds NaN or infinite values"),
    ],
)
def test_gguf_bad_expert_biases(tmp_path, edit, match):
    path = tmp_path / "b.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    rng = np.random.default_rng(0)
    E, H, I = 4, 64, 64  # noqa: E741
    for r in ROLES:
        n, k = (H, I) if r == "down" else (I, H)
        raw = gguf.quants.quantize(rng.standard_normal((E, n, k)).astype(np.float32), Q.MXFP4)
        writer.add_tensor(f"blk.0.ffn_{r}_exps.weight", raw, raw_dtype=Q.MXFP4)
    up = rng.standard_normal((E, I)).astype(np.float32)
    if edit == "type":
        writer.add_tensor("blk.0.ffn_up_exps.bias", gguf.quants.quantize(up, Q.Q8_0),
                          raw_dtype=Q.Q8_0)  # fmt: skip
    elif edit == "dims":
        writer.add_tensor("blk.0.ffn_up_exps.bias", up[:, :32].copy())
    elif edit == "orphan":
        writer.add_tensor("blk.3.ffn_down_exps.bias", np.zeros((E, H), dtype=np.float32))
    else:
        up[1, 2] = np.nan
        writer.add_tensor("blk.0.ffn_up_exps.bias", up)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=match):
        GGUFCheckpoint(path).load_layer(0)


def test_gguf_truncated_and_not_gguf(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path, {"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K}, moe_layers=(0,))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(ValueError, match=r"t\.gguf.*not a readable GGUF"):
        GGUFCheckpoint(path)
    path.write_bytes(data[:40])  # truncated inside the header
    with pytest.raises(ValueError, match=r"t\.gguf"):
        GGUFCheckpoint(path)
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOTGGUF" * 10)
    with pytest.raises(ValueError, match=r"x\.gguf"):
        open_checkpoint(bad)
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        GGUFCheckpoint(tmp_path / "missing.gguf")


def test_gguf_missing_expert_tensor(tmp_path):
    path = tmp_path / "m.gguf"
    types = dict.fromkeys(ROLES, Q.Q8_0)
    write_gguf(path, types, H=64, I=32, moe_layers=(0, 1), drop="blk.1.ffn_up_exps.weight")
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up_exps\.weight is missing"):
        GGUFCheckpoint(path)


def test_open_checkpoint_dispatch(tmp_path):
    write_hf(tmp_path / "hf", "olmoe")
    assert isinstance(open_checkpoint(tmp_path / "hf"), HFCheckpoint)
    write_gguf(tmp_path / "g.bin", dict.fromkeys(ROLES, Q.Q8_0), H=64, I=32, moe_layers=(0,))
    assert isinstance(open_checkpoint(tmp_path / "g.bin"), GGUFCheckpoint)  # by magic
    with pytest.raises(FileNotFoundError, match="none"):
        open_checkpoint(tmp_path / "none")


# ---------------------------------------------------------------------- the reader interface


def _edited_compressed_int4(path, edit) -> None:
    """Rewrite the compressed-tensors checkpoint at ``path`` with ``edit(tensors)`` applied."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))


_CT = "model.layers.1.mlp.experts.2."


@pytest.mark.parametrize(
    "case,edit,message",
    [
        ("missing_scale", lambda t: t.pop(_CT + "up_proj.weight_scale"),
         rf"tensor {re.escape(_CT)}up_proj\.weight_scale is missing"),
        ("missing_projection", lambda t: t.pop(_CT + "down_proj.weight_packed"),
         r"layer 1 expert 2 has no down_proj\.weight_packed"),
        ("codes_dtype", lambda t: t.update({_CT + "gate_proj.weight_packed":
                                            t[_CT + "gate_proj.weight_packed"].float()}),
         rf"{re.escape(_CT)}gate_proj\.weight_packed is torch\.float32 .* expected int32"),
        ("scale_rows", lambda t: t.update({_CT + "up_proj.weight_scale":
                                           t[_CT + "up_proj.weight_scale"][:-1]}),
         rf"{re.escape(_CT)}up_proj\.weight_scale has shape \[63, 4\]; expected \[64, K/group\]"),
        ("group_size", lambda t: [t.update({k: v[:, :1].repeat(1, 8)}) for k, v in list(t.items())
                                  if k.startswith("model.layers.1.") and k.endswith("weight_scale")
                                  and "down_proj" not in k],
         r"layer 1 gate: RAWINT4 group size 16 .*kt_ops int4 takes groups of"),
    ],
)  # fmt: skip
def test_compressed_tensors_refusals(tmp_path, case, edit, message):
    """A malformed compressed-tensors (RAWINT4) tensor is named in a ValueError, at load."""
    path = tmp_path / "ct"
    write_compressed_int4(path, E=4, H=128, I=64)
    _edited_compressed_int4(path, edit)
    reader = CompressedTensorsCheckpoint(path)
    reader.load_layer(0)  # the other layer loads
    with pytest.raises(ValueError, match=message):
        reader.load_layer(1)


def test_compressed_tensors_corrupt_files(tmp_path):
    write_compressed_int4(tmp_path / "ct", E=4, H=128, I=64)
    f = tmp_path / "ct" / "model.safetensors"
    _assert_corrupt_safetensors_named(f, CompressedTensorsCheckpoint)
    f.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*\\.safetensors files"):
        CompressedTensorsCheckpoint(tmp_path / "ct")


def test_every_reader_has_the_one_interface(tmp_path):
    """layers, layer_shape, check_weight_format, load_layer -> ExpertWeights, for every reader."""
    E, H, I = 4, 128, 64
    write_hf(tmp_path / "hf", "qwen3_moe", E=E, H=H, I=I)
    write_gguf(tmp_path / "m.gguf", dict.fromkeys(ROLES, Q.Q8_0), E=E, H=H, I=I, moe_layers=(1,))
    write_compressed_int4(tmp_path / "ct", E=E, H=H, I=I)
    convert(tmp_path / "hf", tmp_path / "conv", "int8", layers=[2], progress=False)
    readers = {
        "hf_safetensors": (HFCheckpoint(tmp_path / "hf"), [1, 2], "bf16"),
        "gguf": (GGUFCheckpoint(tmp_path / "m.gguf"), [1], "q8_0"),
        "compressed_tensors_int4": (CompressedTensorsCheckpoint(tmp_path / "ct"), [0, 1], "int4"),
        "converted": (ConvertedExperts(tmp_path / "conv"), [2], "int8"),
    }
    for kind, (reader, layers, fmt) in readers.items():
        assert isinstance(reader, CheckpointReader) and reader.kind == kind
        assert reader.layers == layers and layers[-1] in reader and 99 not in reader, kind
        L = layers[-1]
        assert reader.layer_shape(L) == (E, I, H), kind
        reader.check_weight_format(L, None)
        reader.check_weight_format(L, fmt)
        with pytest.raises(ValueError, match="int3"):
            reader.check_weight_format(L, "int3")
        experts = reader.load_layer(L)
        assert isinstance(experts, ExpertWeights), kind
        assert experts.weight_format == fmt and experts.num_experts == E, kind
        assert (experts.intermediate_size, experts.hidden_size) == (I, H), kind
        assert experts.projections == (experts.gate, experts.up, experts.down)
    # the packed sources load as stored: another format is refused, not requantized
    for kind in ("gguf", "compressed_tensors_int4", "converted"):
        reader, layers, _ = readers[kind]
        with pytest.raises(ValueError, match="'bf16'"):
            reader.load_layer(layers[-1], "bf16")
