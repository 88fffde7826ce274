"""Checkpoints published quantized, read as stored (kt_ops.loaders.QuantizedCheckpoint).

Producers, independent of kt_ops' packers:

* compressed-tensors (``pack-quantized`` int4 per group and per channel, symmetric and
  with zero points; ``nvfp4-pack-quantized``; ``float-quantized`` fp8 per block and per
  channel): its own ``calculate_qparams`` and compressors write the tensors, and its
  ``decompress`` (with the fp32 scales) is the reference dequantization.
* GPTQ (v1 ``z - 1`` and v2 zero points, with and without ``desc_act``) and AWQ (GEMM):
  no producer installs on a CPU here, so this file packs them from the published
  layouts (AutoGPTQ ``pack``, AutoAWQ ``WQLinear_GEMM``); the AWQ tensors are also
  decoded by compressed-tensors' ``AutoAWQConverter``.
* DeepSeek-V4 MXFP4 experts, from the release's tensor names and the OCP MX spec.

Each case: the packed experts dequantize to the producer's values (bit for bit where
the scheme is exact), and a tiny Qwen3-MoE model through ``replace_experts(model,
checkpoint=...)`` matches the same model holding the producer-dequantized experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kt_ops
from kt_ops.formats import dequantize_weights
from kt_ops.loaders import QuantizedCheckpoint, open_checkpoint
from tests.checkpoints import E2M1, save_tensors

transformers = pytest.importorskip("transformers")

E, H, I, LAYERS = 4, 64, 32, 2  # noqa: E741
PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def tiny_model() -> torch.nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=64,
        moe_intermediate_size=I,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=E,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).float().eval()


def expert_weights(model, L: int) -> dict[str, torch.Tensor]:
    ex = model.model.layers[L].mlp.experts
    gate, up = ex.gate_up_proj.detach().float().split(I, dim=1)
    return {"gate": gate, "up": up, "down": ex.down_proj.detach().float()}


def set_expert_weights(model, L: int, w: dict[str, torch.Tensor]) -> None:
    ex = model.model.layers[L].mlp.experts
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.cat([w["gate"], w["up"]], dim=1))
        ex.down_proj.copy_(w["down"])


# ------------------------------------------------------------------ producers


def compressed_tensors_producer(kind: str):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    fmt, args = {
        "ct_int4_group_asym": (
            "pack-quantized",
            dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
        ),
        "ct_int4_group_sym": (
            "pack-quantized",
            dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
        ),
        "ct_int4_channel_asym": (
            "pack-quantized",
            dict(num_bits=4, type="int", symmetric=False, strategy="channel"),
        ),
        "ct_nvfp4": (
            "nvfp4-pack-quantized",
            dict(num_bits=4, type="float", strategy="tensor_group", group_size=16),
        ),
        "ct_fp8_block": (
            "float-quantized",
            dict(num_bits=8, type="float", strategy="block", block_structure=[128, 128]),
        ),
        "ct_fp8_channel": ("float-quantized", dict(num_bits=8, type="float", strategy="channel")),
        "ct_mxfp8": (
            "mxfp8-quantized",
            dict(
                num_bits=8, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8
            ),
        ),
        "ct_mxfp4": (
            "mxfp4-pack-quantized",
            dict(
                num_bits=4, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8
            ),
        ),
    }[kind]
    qargs = QuantizationArgs(**args)
    scheme = QuantizationScheme(targets=["Linear"], weights=qargs)
    comp = BaseCompressor.get_value_from_registry(fmt)

    def produce(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        N, K = w.shape
        if qargs.strategy == "block":
            mn, mx = w.amin().view(1, 1), w.amax().view(1, 1)
        else:
            wg = w.view(N, -1, qargs.group_size or K)
            mn, mx = wg.amin(-1), wg.amax(-1)
        gscale = generate_gparam(w.amin(), w.amax()) if fmt.startswith("nvfp4") else None
        scale, zp = calculate_qparams(mn, mx, qargs, global_scale=gscale)
        if fmt == "pack-quantized":  # checkpoints store bf16 scales (the model dtype)
            scale = scale.to(torch.bfloat16)
        sd = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
        if gscale is not None:
            sd["weight_global_scale"] = gscale
        out = comp.compress(sd, scheme)
        dec = dict(out)
        if not fmt.startswith("mx"):  # (MX: UE8M0 bytes, which decompress decodes)
            dec["weight_scale"] = out["weight_scale"].float()
        if fmt.startswith("nvfp4"):  # decompress in fp32: the exact values
            from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
            from compressed_tensors.quantization.lifecycle.forward import dequantize

            codes = unpack_fp4_from_uint8(out["weight_packed"], N, K, dtype=torch.float32)
            ref = dequantize(codes, dec["weight_scale"], args=qargs, global_scale=gscale)
        else:  # (MX: bf16, which holds E4M3 / E2M1 times 2^k exactly)
            ref = comp.decompress(dec, scheme)["weight"].float()
        return dict(out), ref

    config = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": qargs.model_dump()}},
        "ignore": ["lm_head"],
        "version": ct.__version__,
    }
    return produce, config


def _pack_words(fields: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit fields along ``dim`` -> int32 words (first field in the low bits)."""
    f = fields.to(torch.int64).movedim(dim, -1)
    f = f.reshape(*f.shape[:-1], -1, 8)
    words = (f << (4 * torch.arange(8))).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim)


def gptq_producer(kind: str):
    """AutoGPTQ's layout: qweight [K/8, N], qzeros [G, N/8], scales [G, N] fp16, g_idx [K]."""
    sym = kind in ("gptq_v1_sym", "gptq_desc_act")
    v1 = kind != "gptq_v2_asym"
    gs = 32

    def produce(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        N, K = w.shape
        G = K // gs
        g_idx = torch.arange(K) // gs
        if kind == "gptq_desc_act":  # act order: groups over a permutation of the columns
            perm = torch.randperm(K, generator=torch.Generator().manual_seed(N + K))
            g_idx = torch.empty(K, dtype=torch.int64)
            g_idx[perm] = torch.arange(K) // gs
        s = torch.empty(N, G)
        z = torch.empty(N, G, dtype=torch.int64)
        for g in range(G):
            cols = w[:, g_idx == g]
            if sym:
                s[:, g] = cols.abs().amax(1) / 7
                z[:, g] = 8
            else:
                mn, mx = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
                s[:, g] = (mx - mn) / 15
                z[:, g] = torch.round(-mn / s[:, g]).clamp(0, 15).long()
        s = s.half()
        q = torch.round(w / s.float()[:, g_idx]) + z[:, g_idx]
        q = q.clamp(0, 15).long()
        tensors = {
            "qweight": _pack_words(q.t(), 0),  # [K/8, N]
            "qzeros": _pack_words((z - (1 if v1 else 0)).t() & 15, 1),  # [G, N/8]
            "scales": s.t().contiguous(),
            "g_idx": g_idx.to(torch.int32),
        }
        ref = s.float()[:, g_idx] * (q - z[:, g_idx]).float()
        return tensors, ref

    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": gs,
        "desc_act": kind == "gptq_desc_act",
        "sym": sym,
        "checkpoint_format": "gptq" if v1 else "gptq_v2",
    }
    return produce, config


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_producer(kind: str):
    """AutoAWQ GEMM: qweight [K, N/8] (columns interleaved 0 2 4 6 1 3 5 7 in a word)."""
    from_ct = pytest.importorskip("compressed_tensors.entrypoints.convert.converters.autoawq")
    gs = 32

    def produce(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        N, K = w.shape
        wg = w.view(N, K // gs, gs)
        mn, mx = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((mx - mn) / 15).half()
        z = torch.round(-mn / s.float()).clamp(0, 15).long()
        q = (torch.round(wg / s.float().unsqueeze(-1)) + z.unsqueeze(-1)).clamp(0, 15)
        q = q.long().view(N, K)
        order = (torch.arange(N // 8).view(-1, 1) * 8 + torch.tensor(AWQ_ORDER)).flatten()
        tensors = {
            "qweight": _pack_words(q.t()[:, order], 1),
            "qzeros": _pack_words(z.t()[:, order], 1),
            "scales": s.t().contiguous(),
        }
        # compressed-tensors' AutoAWQ decoder: signed codes and zero points, scales [N, G]
        conv = from_ct.AutoAWQConverter.__new__(from_ct.AutoAWQConverter)
        conv.bits, conv.zero_point = 4, True
        qw, sc, zp = conv._convert_gemm_module(
            tensors["qweight"], tensors["scales"], tensors["qzeros"]
        )
        ref = (qw.float() - zp.float().repeat_interleave(gs, 1)) * sc.float().repeat_interleave(
            gs, 1
        )
        return tensors, ref

    config = {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True}
    config["version"] = "gemm"
    return produce, config


def dsv4_producer(kind: str):
    """DeepSeek-V4 experts: ``weight`` int8 [N, K/2] (two E2M1 codes, low nibble first) and
    ``scale`` UE8M0 [N, K/32] (OCP MX v1.0)."""
    lut = torch.tensor(E2M1)

    def produce(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        N, K = w.shape
        p = kt_ops.formats.quantize_weights(w.unsqueeze(0), "mxfp4")  # any E2M1 codes will do
        vals = dequantize_weights(p)[0]
        e = torch.floor(torch.log2(w.view(N, -1, 32).abs().amax(-1))).long() - 2 + 127
        e = e.clamp(1, 254)
        x = torch.pow(2.0, (e - 127).float()).repeat_interleave(32, 1)
        codes = torch.bucketize((vals / x).abs(), lut[:8]) + 8 * (vals < 0)
        codes = codes.clamp(0, 15).to(torch.uint8)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
        ref = lut[codes.long()] * x
        return {"weight": packed, "scale": e.to(torch.uint8)}, ref

    return produce, None


def modelopt_producer(kind: str):
    """ModelOpt's NVFP4 export: ``weight`` (the packed codes), ``weight_scale`` (E4M3 per 16),
    ``weight_scale_2`` (fp32); made from compressed-tensors' NVFP4 (the converter in
    compressed-tensors maps ``weight_scale_2`` to ``1 / weight_global_scale``)."""
    ct_produce, _ = compressed_tensors_producer("ct_nvfp4")
    lut = torch.tensor(E2M1)

    def produce(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        got, _ = ct_produce(w)
        s2 = (1.0 / got["weight_global_scale"].float()).reshape(())
        packed = got["weight_packed"]
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()
        scale = (got["weight_scale"].float() * s2).repeat_interleave(16, 1)
        tensors = {"weight": packed, "weight_scale": got["weight_scale"], "weight_scale_2": s2}
        return tensors, lut[codes] * scale

    return produce, {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}


def renamed_producer(kind: str):
    """Checkpoints kt-kernel reads without a ``quantization_config``, made from
    compressed-tensors' tensors: MiniMax-M3's MXFP8 (``weight_scale_inv`` uint8 per 32,
    ``block_sparse_moe.experts.{i}.w1``) and GLM-4.7-FP8's fp8 per output channel."""
    source = {"minimax_mxfp8": "ct_mxfp8", "glm_fp8_channel": "ct_fp8_channel"}[kind]
    produce_ct, _ = compressed_tensors_producer(source)

    def produce(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        got, ref = produce_ct(w)
        if kind == "minimax_mxfp8":
            got["weight_scale_inv"] = got.pop("weight_scale")
        return got, ref

    return produce, None


PRODUCERS = {
    **{
        k: compressed_tensors_producer
        for k in (
            "ct_int4_group_asym",
            "ct_int4_group_sym",
            "ct_int4_channel_asym",
            "ct_nvfp4",
            "ct_fp8_block",
            "ct_fp8_channel",
            "ct_mxfp8",
            "ct_mxfp4",
        )
    },
    "minimax_mxfp8": renamed_producer,
    "glm_fp8_channel": renamed_producer,
    **{k: gptq_producer for k in ("gptq_v1_sym", "gptq_v2_asym", "gptq_desc_act")},
    "awq": awq_producer,
    "dsv4_mxfp4": dsv4_producer,
    "modelopt_nvfp4": modelopt_producer,
}
#: The format each scheme loads as (int4 where not listed).
NATIVE = {"ct_nvfp4": "nvfp4", "modelopt_nvfp4": "nvfp4", "ct_fp8_block": "fp8"}
NATIVE.update({"ct_fp8_channel": "fp8_channel", "glm_fp8_channel": "fp8_channel"})
NATIVE.update({"ct_mxfp8": "mxfp8", "minimax_mxfp8": "mxfp8", "ct_mxfp4": "mxfp4"})
NATIVE.update({"gptq_desc_act": "bf16", "dsv4_mxfp4": "mxfp4"})
EXACT = set(PRODUCERS) - {"gptq_desc_act"}
#: Where each kind's experts live and what its projections are called.
NAMING = {
    "dsv4_mxfp4": ("ffn", {"gate": "w1", "up": "w3", "down": "w2"}),
    "minimax_mxfp8": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
}


def write_checkpoint(out: Path, kind: str, model) -> dict[int, dict[str, torch.Tensor]]:
    """The experts of ``model`` (a tiny model, or ``{layer: {role: [E, N, K]}}``) through the
    producer, as a checkpoint with per-expert tensors; returns the producer's dequantized
    experts per layer."""
    produce, qconfig = PRODUCERS[kind](kind)
    block, names = NAMING.get(kind, ("mlp", PROJ))
    tensors, refs = {}, {}
    layers = (
        model if isinstance(model, dict) else {L: expert_weights(model, L) for L in range(LAYERS)}
    )
    for L, w in layers.items():
        refs[L] = {}
        for role, t in w.items():
            deq = []
            for e in range(E):
                got, ref = produce(t[e].contiguous())
                for suffix, v in got.items():
                    tensors[f"model.layers.{L}.{block}.experts.{e}.{names[role]}.{suffix}"] = v
                deq.append(ref)
            refs[L][role] = torch.stack(deq)
    save_tensors(out, tensors)
    cfg = {"model_type": "qwen3_moe", "num_hidden_layers": max(layers) + 1}
    if qconfig is not None:
        cfg["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(cfg))
    return refs


@pytest.mark.parametrize("kind", sorted(PRODUCERS))
def test_checkpoint_dequantizes_to_the_producer_and_runs_the_model(tmp_path, kind):
    model = tiny_model()
    refs = write_checkpoint(tmp_path / "ckpt", kind, model)
    reader = open_checkpoint(tmp_path / "ckpt")
    assert isinstance(reader, QuantizedCheckpoint)
    assert reader.native_format == NATIVE.get(kind, "int4")
    assert reader.layers == list(range(LAYERS)) and reader.layer_shape(1) == (E, I, H)
    for L in range(LAYERS):
        layer = reader.load_layer(L)
        for role, proj in zip(("gate", "up", "down"), layer.projections):
            # GPTQ act order: down (K = 32) has one group, so its g_idx are in natural
            # order and it stays exact int4.
            one_group = kind == "gptq_desc_act" and role == "down"
            assert proj.weight_format == ("int4" if one_group else reader.native_format)
            got, want = dequantize_weights(proj), refs[L][role]
            if kind in EXACT or one_group:
                assert torch.equal(got, want), (L, role, (got - want).abs().max())
            else:  # bf16 of the exact fp32 values
                assert torch.equal(got, want.to(torch.bfloat16).float()), (L, role)
    # The whole model: producer-dequantized experts in torch vs. the checkpoint on kt_ops.
    for L in range(LAYERS):
        set_expert_weights(model, L, refs[L])
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        kt_ops.replace_experts(model, checkpoint=str(tmp_path / "ckpt"), check=False)
        got = model(ids).logits
    replaced = model.model.layers[0].mlp.experts
    assert isinstance(replaced, kt_ops.nn.MoEExperts)
    if kind != "gptq_desc_act":  # the stored format, not a requantization
        assert replaced.weight_format == reader.native_format
    rel = ((got - want).norm() / want.norm()).item()
    # The same weights on both sides, so what differs is the activations' rounding: the
    # 4-bit formats multiply int8 (q8) activations, 4-6e-4 of the logits measured (Zen 4);
    # gptq desc_act, requantized to bf16 weights, 4.4e-4; the fp8 family decodes exactly
    # and sums fp32 activations in fp32 (this model's dtype), 1.8e-7. Bounds ~5x those.
    bound = {"int4": 3e-3, "nvfp4": 3e-3, "mxfp4": 3e-3, "bf16": 2e-3}
    assert rel < bound.get(reader.native_format, 1e-6), (reader.native_format, rel)


def test_requantize_from_a_quantized_checkpoint(tmp_path):
    model = tiny_model()
    refs = write_checkpoint(tmp_path / "ckpt", "gptq_v2_asym", model)
    reader = open_checkpoint(tmp_path / "ckpt")
    layer = reader.load_layer(0, "bf16")
    got = dequantize_weights(layer.projections[0])
    assert torch.equal(got, refs[0]["gate"].to(torch.bfloat16).float())
    layer8 = reader.load_layer(0, "int8")
    assert layer8.projections[2].weight_format == "int8"


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda qc: qc.update(bits=8), "GPTQ bits=8"),
        (lambda qc: qc.update(checkpoint_format="marlin"), "checkpoint_format='marlin'"),
    ],
)
def test_bad_gptq_configs_are_refused(tmp_path, edit, match):
    model = tiny_model()
    write_checkpoint(tmp_path / "ckpt", "gptq_v1_sym", model)
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    edit(cfg["quantization_config"])
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        open_checkpoint(tmp_path / "ckpt")


def test_group_size_and_g_idx_are_checked(tmp_path):
    model = tiny_model()
    write_checkpoint(tmp_path / "ckpt", "gptq_v2_asym", model)
    cfg_path = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["group_size"] = 64  # the tensors have groups of 32
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"group_size=64 gives 1 for K=64 \(a mismatched"):
        open_checkpoint(tmp_path / "ckpt").load_layer(0)
    write_checkpoint(tmp_path / "act", "gptq_desc_act", model)
    from safetensors.torch import load_file, save_file

    f = tmp_path / "act" / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.0.mlp.experts.1.up_proj.g_idx"]
    save_file(tensors, str(f))
    with pytest.raises(ValueError, match=r"experts.1.up_proj.g_idx is missing \(GPTQ desc_act\)"):
        open_checkpoint(tmp_path / "act").load_layer(0)


def test_missing_and_truncated_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model()
    write_checkpoint(tmp_path / "ckpt", "awq", model)
    f = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(str(f))
    name = "model.layers.1.mlp.experts.2.down_proj.qzeros"
    del tensors[name]
    save_file(tensors, str(f))
    with pytest.raises(ValueError, match=r"qzeros is missing \(AWQ zero_point\)"):
        open_checkpoint(tmp_path / "ckpt").load_layer(1)
    # A wrong qweight shape names the tensor and the shape expected.
    tensors[name] = torch.zeros(2, 4, dtype=torch.int32)
    tensors["model.layers.1.mlp.experts.2.down_proj.qweight"] = torch.zeros(8, 8, dtype=torch.int32)
    save_file(tensors, str(f))
    with pytest.raises(ValueError, match="down_proj.qweight"):
        open_checkpoint(tmp_path / "ckpt").load_layer(1)
    # A truncated file: the reader refuses it with the file's name.
    write_checkpoint(tmp_path / "ckpt2", "awq", model)
    f2 = tmp_path / "ckpt2" / "model.safetensors"
    f2.write_bytes(f2.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model.safetensors"):
        open_checkpoint(tmp_path / "ckpt2").load_layer(1)


# ------------------------------------------------------------------ KTMoEWrapper methods


def _wrapper(method: str, path, **kw):
    from kt_ops.compat import KTMoEWrapper

    return KTMoEWrapper(
        layer_idx=1,
        num_experts=E,
        num_experts_per_tok=2,
        hidden_size=H,
        moe_intermediate_size=I,
        gpu_experts_mask=None,
        cpuinfer_threads=2,
        threadpool_count=1,
        weight_path=str(path),
        chunked_prefill_size=64,
        method=method,
        **kw,
    )


def _dense_forward(w: dict[str, torch.Tensor], x, ids, tw, limit: float = 0.0) -> torch.Tensor:
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = w["gate"][e] @ x[t], w["up"][e] @ x[t]
            if limit:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            out[t] += tw[t, j] * (w["down"][e] @ (torch.nn.functional.silu(g) * u))
    return out


@pytest.mark.parametrize(
    "method,kind",
    [
        ("GPTQ_INT4", "gptq_v2_asym"),
        ("NVFP4", "ct_nvfp4"),
        ("MXFP4", "dsv4_mxfp4"),
        ("FP8_PERCHANNEL", "glm_fp8_channel"),
        ("MXFP8", "minimax_mxfp8"),
    ],
)
def test_kt_kernel_methods_load_the_checkpoints_exactly(tmp_path, method, kind):
    model = tiny_model()
    refs = write_checkpoint(tmp_path / "ckpt", kind, model)
    limit = 0.5 if method == "MXFP4" else 0.0  # DeepSeek-V4's clamped SwiGLU
    w = _wrapper(method, tmp_path / "ckpt", swiglu_limit=limit)
    w.load_weights()
    for role, proj in zip(("gate", "up", "down"), w.experts.projections):
        assert torch.equal(dequantize_weights(proj), refs[1][role]), role
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(5)])
    tw = torch.rand(5, 2, generator=g)
    got = w.forward(x, ids, tw, None)
    want = _dense_forward(refs[1], x, ids, tw, limit)
    assert ((got - want).norm() / want.norm()).item() < 3e-2


def test_amxint4_1_is_asymmetric_per_channel(tmp_path):
    from tests.checkpoints import write_hf

    write_hf(tmp_path / "m", E=E, H=H, I=I, num_layers=2)
    w = _wrapper("AMXINT4_1", tmp_path / "m")
    w.load_weights()
    gate = w.experts.projections[0]
    assert (gate.weight_format, gate.group_size, gate.zeros is not None) == ("int4", 0, True)
    w = _wrapper("AMXINT4_1KGroup", tmp_path / "m", group_size=32)
    w.load_weights()
    assert w.experts.group_sizes == (32, 32, 32) and w.experts.projections[2].zeros is not None


@pytest.mark.parametrize(
    "kind", ["gptq_v2_asym", "ct_nvfp4", "dsv4_mxfp4", "minimax_mxfp8", "glm_fp8_channel"]
)
def test_kt_ops_convert_reads_quantized_checkpoints(tmp_path, kind):
    from kt_ops.convert import ConvertedExperts, convert

    model = tiny_model()
    write_checkpoint(tmp_path / "ckpt", kind, model)
    manifest = convert(tmp_path / "ckpt", tmp_path / "out", progress=False)
    scheme = {"minimax_mxfp8": "mxfp8_scale_inv", "glm_fp8_channel": "ct_fp8_channel"}
    assert manifest["source"]["kind"] == f"quantized_{scheme.get(kind, kind.split('_v')[0])}"
    reader = open_checkpoint(tmp_path / "ckpt")
    conv = ConvertedExperts(tmp_path / "out")
    for L in range(LAYERS):
        a, b = reader.load_layer(L), conv.load_layer(L)
        for pa, pb in zip(a.projections, b.projections):
            for ta, tb in zip(pa.tensors().values(), pb.tensors().values()):
                assert torch.equal(ta, tb)
    # ... and the converted directory feeds replace_experts like the checkpoint does.
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    other = tiny_model()
    with torch.no_grad():
        kt_ops.replace_experts(model, checkpoint=str(tmp_path / "ckpt"), check=False)
        kt_ops.replace_experts(other, converted_dir=str(tmp_path / "out"), check=False)
        assert torch.equal(model(ids).logits, other(ids).logits)
