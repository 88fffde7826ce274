"""Tiny fake checkpoints for the loader and converter tests, written on the fly.

Every writer returns the dense values it stored (fp32, after rounding to the
stored dtype), ``{layer: {"gate": [E, I, H], "up": [E, I, H], "down": [E, H, I]}}``,
computed here independently of the loaders:

* :func:`write_hf` — Hugging Face safetensors directories with the naming
  patterns of Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V3 (``mlp.experts.{e}.*_proj``),
  Mixtral (``block_sparse_moe.experts.{e}.w1/w3/w2``) and transformers-v5
  fused tensors (plain, transposed, gpt-oss interleaved), optionally sharded.
* :func:`write_hf_fp8` — DeepSeek-V3 style fp8 (per expert or fused).
* :func:`write_hf_mxfp4` — gpt-oss style MXFP4 blocks/scales.
* :func:`write_compressed_int4` — compressed-tensors ``pack-quantized`` int4
  (kt-kernel's ``RAWINT4``: ``weight_packed`` int32, ``weight_scale`` bf16).
* :func:`write_gguf` — GGUF files with stacked expert tensors (Q8_0/Q4_0 from
  ``gguf.quants.quantize``, k-quants as random valid blocks, F16/BF16/F32).
"""

# ruff: noqa: E741

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import gguf
import numpy as np
import torch
from reference import set_iq1_m_d
from safetensors.torch import save_file

ROLES = ("gate", "up", "down")

#: Naming patterns: style -> (block name, {role: projection name}).
PER_EXPERT_STYLES = {
    "qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "qwen2_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "olmoe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "deepseek_v3": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
}

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dense_experts(E: int, I: int, H: int, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 expert weights ``{gate, up: [E, I, H], down: [E, H, I]}``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "gate": torch.randn(E, I, H, generator=g) / H**0.5,
        "up": torch.randn(E, I, H, generator=g) / H**0.5,
        "down": torch.randn(E, H, I, generator=g) / I**0.5,
    }


def save_tensors(out: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> dict[str, Path]:
    """Write ``model.safetensors`` (or ``shards`` files + index); returns name -> file."""
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(out / "model.safetensors"))
        return {k: out / "model.safetensors" for k in names}
    weight_map = {}
    where = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(out / fname))
        for k in part:
            weight_map[k] = fname
            where[k] = out / fname
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return where


def write_config(out: Path, **cfg) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))


def _other_tensors(num_layers: int, H: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Non-expert tensors every fake model has (must be ignored by the loaders)."""
    t = {"model.embed_tokens.weight": torch.randn(16, H).to(dtype)}
    for L in range(num_layers):
        t[f"model.layers.{L}.self_attn.q_proj.weight"] = torch.randn(H, H).to(dtype)
        t[f"model.layers.{L}.input_layernorm.weight"] = torch.ones(H).to(dtype)
    return t


def write_hf(
    out: Path,
    style: str = "qwen3_moe",
    *,
    E: int = 4,
    H: int = 64,
    I: int = 32,
    num_layers: int = 3,
    dense_layers: tuple[int, ...] = (0,),
    dtype: torch.dtype = torch.bfloat16,
    shards: int = 1,
    seed: int = 0,
    drop: Optional[str] = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """A safetensors model directory whose layers not in ``dense_layers`` are MoE.

    ``style``: a key of :data:`PER_EXPERT_STYLES`, ``"fused"`` (``gate_up_proj``
    ``[E, 2I, H]``, gate rows then up rows; ``down_proj`` ``[E, H, I]``),
    ``"fused_transposed"`` (``[E, H, 2I]``, ``[E, I, H]``) or ``"gpt_oss"``
    (transposed, gate/up interleaved, with biases). ``drop``: a tensor name to
    leave out (for the missing-tensor test). Returns the stored values (fp32).
    """
    tensors = _other_tensors(num_layers, H, dtype)
    expected = {}
    for L in range(num_layers):
        p = f"model.layers.{L}."
        if L in dense_layers:
            t = dense_experts(1, 2 * I, H, seed + 1000 + L)
            tensors[p + "mlp.gate_proj.weight"] = t["gate"][0].to(dtype)
            tensors[p + "mlp.up_proj.weight"] = t["up"][0].to(dtype)
            tensors[p + "mlp.down_proj.weight"] = t["down"][0].to(dtype)
            continue
        w = {r: v.to(dtype) for r, v in dense_experts(E, I, H, seed + L).items()}
        expected[L] = {r: v.float() for r, v in w.items()}
        if style in PER_EXPERT_STYLES:
            block, names = PER_EXPERT_STYLES[style]
            tensors[p + f"{block}.gate.weight"] = torch.randn(E, H).to(dtype)  # router
            for e in range(E):
                for r in ROLES:
                    tensors[p + f"{block}.experts.{e}.{names[r]}.weight"] = w[r][e].clone()
            if style == "qwen2_moe":
                for r, nm in names.items():
                    shape = (I, H) if r != "down" else (H, I)
                    tensors[p + f"mlp.shared_expert.{nm}.weight"] = torch.randn(shape).to(dtype)
                tensors[p + "mlp.shared_expert_gate.weight"] = torch.randn(1, H).to(dtype)
            if style == "deepseek_v3":
                for r, nm in names.items():
                    shape = (I, H) if r != "down" else (H, I)
                    tensors[p + f"mlp.shared_experts.{nm}.weight"] = torch.randn(shape).to(dtype)
        elif style == "fused":
            tensors[p + "mlp.gate.weight"] = torch.randn(E, H).to(dtype)
            tensors[p + "mlp.experts.gate_up_proj"] = torch.cat([w["gate"], w["up"]], dim=1)
            tensors[p + "mlp.experts.down_proj"] = w["down"]
        elif style == "fused_transposed":
            gate_up = torch.cat([w["gate"], w["up"]], dim=1)  # [E, 2I, H]
            tensors[p + "mlp.experts.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
            tensors[p + "mlp.experts.down_proj"] = w["down"].transpose(1, 2).contiguous()
        elif style == "gpt_oss":
            gate_up = torch.stack([w["gate"], w["up"]], dim=2).reshape(E, 2 * I, H)
            tensors[p + "mlp.experts.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
            # Biases that show their split: gate_up_proj_bias[e, j] = (e * 2I + j) / 100.
            gu_bias = torch.arange(E * 2 * I, dtype=torch.float32).reshape(E, 2 * I) / 100
            tensors[p + "mlp.experts.gate_up_proj_bias"] = gu_bias.to(dtype)
            tensors[p + "mlp.experts.down_proj"] = w["down"].transpose(1, 2).contiguous()
            tensors[p + "mlp.experts.down_proj_bias"] = -torch.arange(E * H).reshape(E, H).to(dtype)
        else:
            raise ValueError(style)
    if drop is not None:
        del tensors[drop]
    model_type = {"fused": "qwen3_moe", "fused_transposed": "aria_text"}.get(style, style)
    write_config(
        out,
        model_type=model_type,
        num_hidden_layers=num_layers,
        hidden_size=H,
        moe_intermediate_size=I,
        num_experts=E,
    )
    save_tensors(out, tensors, shards)
    return expected


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[..., N, K]`` -> (float8_e4m3fn weight, fp32 scale_inv ``[..., ceil(N/128),
    ceil(K/128)]``) with per-128x128-block absmax scaling (DeepSeek-V3 style)."""
    *lead, N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    pad = torch.zeros(*lead, nb * 128, kb * 128)
    pad[..., :N, :K] = w
    blocks = pad.reshape(*lead, nb, 128, kb, 128)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12)  # [..., nb, kb]
    scale = amax / 448.0
    s_full = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :N, :K]
    w8 = (w / s_full).to(torch.float8_e4m3fn)
    return w8, scale.float()


def fp8_dequantize(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    N, K = w8.shape[-2:]
    s_full = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :N, :K]
    return w8.float() * s_full


def write_hf_fp8(
    out: Path,
    *,
    E: int = 4,
    H: int = 192,
    I: int = 96,
    num_layers: int = 2,
    fused: bool = False,
    drop_scale: bool = False,
    seed: int = 0,
) -> dict[int, dict[str, torch.Tensor]]:
    """DeepSeek-V3 style fp8 checkpoint (every layer MoE); returns the dequantized values."""
    tensors = _other_tensors(num_layers, H, torch.bfloat16)
    expected = {}
    for L in range(num_layers):
        p = f"model.layers.{L}.mlp.experts."
        w = dense_experts(E, I, H, seed + L)
        q = {r: fp8_quantize(v) for r, v in w.items()}
        expected[L] = {r: fp8_dequantize(*q[r]) for r in ROLES}
        if fused:
            gw = torch.cat([q["gate"][0], q["up"][0]], dim=1)
            gs = torch.cat([q["gate"][1], q["up"][1]], dim=1)
            tensors[p + "gate_up_proj"] = gw
            tensors[p + "gate_up_proj_scale_inv"] = gs
            tensors[p + "down_proj"] = q["down"][0]
            tensors[p + "down_proj_scale_inv"] = q["down"][1]
            continue
        for e in range(E):
            for r, nm in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                tensors[p + f"{e}.{nm}.weight"] = q[r][0][e].clone()
                if not (drop_scale and e == 1 and r == "up"):
                    tensors[p + f"{e}.{nm}.weight_scale_inv"] = q[r][1][e].clone()
    write_config(
        out,
        model_type="deepseek_v3",
        num_hidden_layers=num_layers,
        hidden_size=H,
        moe_intermediate_size=I,
        n_routed_experts=E,
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    )
    save_tensors(out, tensors)
    return expected


def write_compressed_int4(
    out: Path,
    *,
    E: int = 4,
    H: int = 128,
    I: int = 64,
    num_layers: int = 2,
    group_size: int = 32,
    seed: int = 0,
) -> dict[int, dict[str, torch.Tensor]]:
    """A compressed-tensors ``pack-quantized`` int4 checkpoint (every layer MoE).

    Per expert and projection: ``...weight_packed`` int32 ``[N, K/8]`` (eight 4-bit
    codes a word, first code in the low bits, code = q + 8 for q in [-8, 7]),
    ``...weight_scale`` bf16 ``[N, K/group_size]`` (absmax / 7) and
    ``...weight_shape`` int32 ``[N, K]``: what kt-kernel's ``RAWINT4`` reads.
    Returns the dequantized values ``scale * q`` (fp32).
    """
    tensors = _other_tensors(num_layers, H, torch.bfloat16)
    expected = {}
    for L in range(num_layers):
        p = f"model.layers.{L}.mlp.experts."
        expected[L] = {}
        for r, w in dense_experts(E, I, H, seed + L).items():
            _, N, K = w.shape
            g = w.view(E, N, K // group_size, group_size)
            s = (g.abs().amax(-1, keepdim=True) / 7).to(torch.bfloat16).float()
            q = torch.round(g / s.clamp_min(1e-30)).clamp(-8, 7)
            expected[L][r] = (q * s).view(E, N, K)
            u = (q + 8).to(torch.uint8).view(E, N, K)
            packed = (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous().view(torch.int32)
            for e in range(E):
                base = p + f"{e}.{r}_proj."
                tensors[base + "weight_packed"] = packed[e].clone()
                tensors[base + "weight_scale"] = s[e].view(N, K // group_size).to(torch.bfloat16)
                tensors[base + "weight_shape"] = torch.tensor([N, K], dtype=torch.int32)
    write_config(out, model_type="kimi_k2", num_hidden_layers=num_layers, hidden_size=H)
    save_tensors(out, tensors)
    return expected


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Independent MXFP4 decode (numpy, float64).

    ``[..., N, G, 16]`` bytes and ``[..., N, G]`` UE8M0 scales -> fp32 ``[..., N, 32G]``.
    """
    b = blocks.numpy().astype(np.int64)
    lut = np.array(E2M1, dtype=np.float64)
    vals = np.empty(b.shape[:-1] + (32,), dtype=np.float64)
    vals[..., 0::2] = lut[b & 15]
    vals[..., 1::2] = lut[b >> 4]
    vals *= 2.0 ** (scales.numpy().astype(np.float64) - 127.0)[..., None]
    return torch.from_numpy(vals.reshape(*vals.shape[:-2], -1)).float()


def write_hf_mxfp4(
    out: Path,
    *,
    E: int = 4,
    H: int = 64,
    I: int = 32,
    num_layers: int = 2,
    seed: int = 0,
) -> dict[int, dict[str, torch.Tensor]]:
    """gpt-oss style MXFP4 checkpoint (gate/up interleaved rows); returns dequantized values."""
    g = torch.Generator().manual_seed(seed)
    tensors = _other_tensors(num_layers, H, torch.bfloat16)
    expected = {}
    for L in range(num_layers):
        p = f"model.layers.{L}.mlp.experts."
        gu_blocks = torch.randint(0, 256, (E, 2 * I, H // 32, 16), generator=g, dtype=torch.uint8)
        gu_scales = torch.randint(118, 127, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8)
        dn_blocks = torch.randint(0, 256, (E, H, I // 32, 16), generator=g, dtype=torch.uint8)
        dn_scales = torch.randint(118, 127, (E, H, I // 32), generator=g, dtype=torch.uint8)
        tensors[p + "gate_up_proj_blocks"] = gu_blocks
        tensors[p + "gate_up_proj_scales"] = gu_scales
        tensors[p + "gate_up_proj_bias"] = torch.zeros(E, 2 * I)
        tensors[p + "down_proj_blocks"] = dn_blocks
        tensors[p + "down_proj_scales"] = dn_scales
        tensors[p + "down_proj_bias"] = torch.zeros(E, H)
        gate_up = mxfp4_dequantize(gu_blocks, gu_scales)  # [E, 2I, H], rows interleaved
        expected[L] = {
            "gate": gate_up[:, 0::2].contiguous(),
            "up": gate_up[:, 1::2].contiguous(),
            "down": mxfp4_dequantize(dn_blocks, dn_scales),
        }
    write_config(
        out,
        model_type="gpt_oss",
        num_hidden_layers=num_layers,
        hidden_size=H,
        intermediate_size=I,
        num_local_experts=E,
        quantization_config={"quant_method": "mxfp4"},
    )
    save_tensors(out, tensors)
    return expected


# ---------------------------------------------------------------------- GGUF

Q = gguf.GGMLQuantizationType


def random_blocks(qtype: Q, shape_elems: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random but valid raw blocks for a tensor of ``shape_elems`` (last dim = row length)."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    *lead, K = shape_elems
    raw = rng.integers(0, 256, size=(*lead, K // bs, ts), dtype=np.uint8)

    def set_f16(off: int, lo: float, hi: float) -> None:
        v = rng.uniform(lo, hi, size=raw.shape[:-1]).astype(np.float16)
        raw[..., off : off + 2] = v[..., None].view(np.uint8)

    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q2_K):
        off_d, off_m = (0, 2) if qtype != Q.Q2_K else (80, 82)
        set_f16(off_d, 1e-3, 1e-2)
        set_f16(off_m, 1e-4, 1e-3)
    elif qtype == Q.Q6_K:
        set_f16(208, 1e-4, 1e-3)
    elif qtype == Q.Q3_K:
        set_f16(108, 1e-4, 1e-3)
    elif qtype == Q.IQ4_NL:  # d * kvalues_iq4nl[q], |v| <= 127
        set_f16(0, 1e-4, 1e-3)
    elif qtype == Q.IQ4_XS:  # d * (ls - 32) * v
        set_f16(0, 1e-5, 1e-4)
    elif qtype in (Q.Q4_1, Q.Q5_1):  # W = d * q + m
        set_f16(0, 1e-4, 1e-3)
        set_f16(2, -1e-2, 1e-3)
    elif qtype == Q.Q5_0:  # W = d * (q - 16)
        set_f16(0, 1e-4, 1e-3)
    elif qtype in (Q.IQ1_S, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S):
        set_f16(0, 1e-4, 1e-3)  # d first; grid indices, signs and sub-scales: any bytes
    elif qtype == Q.IQ1_M:  # d's 4 nibbles in the top nibbles of the 4 uint16 scales
        set_iq1_m_d(raw, rng.uniform(1e-4, 1e-3, size=raw.shape[:-1]))
    elif qtype == Q.NVFP4:  # d[4] UE4M3 (0x00-0x7E; 0x20-0x37 ~ 2^-3 .. 2^-1), qs[32]
        raw[..., 0:4] = rng.integers(0x20, 0x38, size=(*raw.shape[:-1], 4), dtype=np.uint8)
    elif qtype == Q.TQ1_0:  # ternary: qs[48], qh[4], d
        set_f16(52, 1e-3, 1e-2)
    elif qtype == Q.TQ2_0:  # ternary: qs[64], d
        set_f16(64, 1e-3, 1e-2)
    else:
        raise ValueError(qtype)
    return raw.reshape(*lead, K // bs * ts)


def gguf_raw(qtype: Q, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Raw tensor data for dense fp32 ``w [E, N, K]`` in ``qtype`` (uint8 bytes or floats)."""
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16)
    if qtype == Q.F64:  # a type kt_ops refuses
        return w.astype(np.float64)
    if qtype in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.MXFP4):
        return gguf.quants.quantize(w.astype(np.float32), qtype)
    return random_blocks(qtype, w.shape, rng)


def _values(qtype: Q, raw: np.ndarray) -> np.ndarray:
    """The fp32 values of ``raw`` (data of ``qtype``, as :func:`gguf_raw` makes it)."""
    if raw.dtype == np.uint8:
        return gguf.quants.dequantize(raw, qtype)
    return raw.astype(np.float32)


def _add_tensor(writer: gguf.GGUFWriter, name: str, qtype: Q, raw: np.ndarray) -> np.ndarray:
    """Add ``raw`` (data of ``qtype``, as :func:`gguf_raw` makes it) as tensor ``name``;
    return its values as fp32 (gguf.quants.dequantize of block data)."""
    if raw.dtype == np.uint8:
        writer.add_tensor(name, raw, raw_dtype=qtype)
    else:
        writer.add_tensor(name, raw)
    return _values(qtype, raw)


def write_gguf_tensors(path: Path, arch: str, tensors: dict[str, tuple[Q, np.ndarray]]) -> None:
    """A one-block GGUF file of ``arch`` holding ``tensors`` {name: (qtype, data as
    :func:`gguf_raw` makes it)}, in that order: for files the loaders must refuse."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (qtype, raw) in tensors.items():
        _add_tensor(writer, name, qtype, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(
    path: Path,
    types: dict[str, Q],
    *,
    E: int = 4,
    H: int = 256,
    I: int = 256,
    moe_layers: tuple[int, ...] = (0, 1),
    seed: int = 0,
    drop: Optional[str] = None,
    arch: str = "qwen3moe",
    bias_types: Optional[dict[str, Q]] = None,
    split_experts: bool = False,
    fused_gate_up: bool = False,
) -> dict[int, dict[str, dict]]:
    """A GGUF file with ``blk.{L}.ffn_{gate,up,down}_exps.weight`` of the given types
    (and, per role of ``bias_types``, ``blk.{L}.ffn_{role}_exps.bias`` ``[E, N]`` of that
    float type, as gpt-oss's). ``split_experts``: one 2-D tensor per expert instead,
    ``blk.{L}.ffn_{role}.{x}.weight`` (llama.cpp's files before the experts were merged,
    e.g. Mixtral's), holding the same data. ``fused_gate_up``: gate and up (of one type) in
    one ``blk.{L}.ffn_gate_up_exps.weight`` ``[E, 2I, ...]``, gate's rows first (llama.cpp's
    qwen35moe files).

    Returns ``{layer: {role: {"raw": data as written, "dense": fp32 [E, N, K] torch
    (gguf.quants.dequantize of the raw data), "bias": fp32 [E, N] torch or None}}}``.
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    num_layers = max(moe_layers) + 1
    writer.add_block_count(num_layers)
    writer.add_expert_count(E)
    writer.add_tensor("token_embd.weight", rng.standard_normal((16, H)).astype(np.float32))
    expected = {}
    for L in moe_layers:
        expected[L] = {}
        for r in ROLES:
            N, K = (I, H) if r != "down" else (H, I)
            w = (rng.standard_normal((E, N, K)) / K**0.5).astype(np.float32)
            raw = gguf_raw(types[r], w, rng)
            name = f"blk.{L}.ffn_{r}_exps.weight"
            if name == drop:
                continue
            if split_experts:
                for x in range(E):
                    _add_tensor(writer, f"blk.{L}.ffn_{r}.{x}.weight", types[r], raw[x])
                dense = _values(types[r], raw)
            elif fused_gate_up and r in ("gate", "up"):
                dense = _values(types[r], raw)
                if r == "up":  # gate's rows, then up's
                    both = np.concatenate([expected[L]["gate"]["raw"], raw], axis=1)
                    _add_tensor(writer, f"blk.{L}.ffn_gate_up_exps.weight", types[r], both)
            else:
                dense = _add_tensor(writer, name, types[r], raw)
            expected[L][r] = {"raw": raw, "dense": torch.from_numpy(np.array(dense)), "bias": None}
            if bias_types and r in bias_types:
                b = gguf_raw(bias_types[r], rng.standard_normal((E, N)), rng)
                if fused_gate_up and r in ("gate", "up"):  # ffn_gate_up_exps.bias [E, 2I]
                    expected[L][r]["raw_bias"] = b
                    if r == "up":
                        both = np.concatenate([expected[L]["gate"]["raw_bias"], b], axis=1)
                        _add_tensor(writer, f"blk.{L}.ffn_gate_up_exps.bias", bias_types[r], both)
                    b = _values(bias_types[r], b)
                else:
                    b = _add_tensor(writer, f"blk.{L}.ffn_{r}_exps.bias", bias_types[r], b)
                expected[L][r]["bias"] = torch.from_numpy(np.array(b, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
