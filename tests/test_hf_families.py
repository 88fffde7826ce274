"""Hugging Face families beyond the common layouts, served by ``replace_experts``: gpt-oss
(biases, alpha, clamps, +1), DeepSeek-V4 / GLM-5-Next / HY-V4 (clamp before SiLU), MiniMax-M3
(gpt-oss's GLU without biases), Step-3.7 (a clamp after SiLU that only some layers set), Gemma 4
(GeGLU, tanh GELU), DBRX (experts stacked as 2-D mlp.w1/v1/w2), LongCat-Flash (identity
experts), NemotronH (non-gated relu2), Inkling2 (softcapped SwiGLU), and the blocks replaced
around kt_ops experts: JetMoE, Llama 4 (inputs scaled by the routing scores) and MuseSpark's
post-expert norm; gpt-oss's MXFP4 checkpoint end to end. Each against the unmodified module or
model.

The GLU is read from the module's attributes and confirmed by the probe (which tries the
candidates of ``ExpertsInfo.glu_candidates`` in turn); every instance whose scalar
attributes differ is probed on its own, so a per-layer clamp cannot slip through.
"""

# ruff: noqa: E741
from __future__ import annotations

import copy

import pytest
import torch
from test_hf import TinyModel, dense_weights, rel_err, round_experts_to_bf16_, store

transformers = pytest.importorskip("transformers")

import kt_ops  # noqa: E402
from kt_ops.hf import UnsupportedExpertsError, find_experts, replace_experts  # noqa: E402
from kt_ops.lora import apply_lora  # noqa: E402
from kt_ops.nn import MoEExperts  # noqa: E402
from kt_ops.peft_adapters import adapter_tensors  # noqa: E402

E, H, I = 8, 64, 32
INPUT_IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
TINY = dict(
    vocab_size=128, hidden_size=H, intermediate_size=I, moe_intermediate_size=I,
    num_local_experts=E, num_experts_per_tok=2, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)  # fmt: skip


def _tiny_causal_lm(model_type: str):
    config = transformers.AutoConfig.for_model(model_type, **TINY)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    round_experts_to_bf16_(model)
    return model


@pytest.mark.parametrize(
    "model_type, spec, biased",
    [
        ("gpt_oss", "silu(alpha=1.702,limit=7.0,up_offset=1.0)", True),
        ("deepseek_v4", "silu(limit=10.0)", False),
    ],
)
def test_causal_lm_matches_the_unmodified_model(model_type: str, spec: str, biased: bool):
    model = _tiny_causal_lm(model_type)
    biases = [p for n, p in model.named_parameters() if ".experts." in n and n.endswith("bias")]
    assert len(biases) == (4 if biased else 0)  # gate_up and down of 2 MoE layers
    with torch.no_grad():  # transformers starts them at zero: make them count
        for p in biases:
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    reference = copy.deepcopy(model)
    replace_experts(model)
    replaced = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert len(replaced) == 2 and all(m.activation == spec for m in replaced)
    assert all((m.down_bias is not None) == biased for m in replaced)
    with torch.inference_mode():
        want, got = reference(INPUT_IDS).logits, model(INPUT_IDS).logits
    assert rel_err(got, want) < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Training reaches the embeddings through the experts (their backward): as the
    # unmodified model's.
    assert_embedding_grads_match(model, reference)


def test_gpt_oss_quantized_and_gpu_experts_refused():
    model = _tiny_causal_lm("gpt_oss")
    reference = copy.deepcopy(model)
    with pytest.raises(UnsupportedExpertsError, match="per-expert biases"):
        replace_experts(model, gpu_experts=[0, 1])
    assert not any(isinstance(m, MoEExperts) for m in model.modules())  # left untouched
    replace_experts(model, "int8")
    with torch.inference_mode():
        assert rel_err(model(INPUT_IDS).logits, reference(INPUT_IDS).logits) < 5e-2


def _experts_of(module_path: str, config_cls: str, **config):
    mod = __import__(f"transformers.models.{module_path}", fromlist=["x"])
    cfg = getattr(mod, config_cls)(**config)
    return mod, cfg


def _stored(module, seed: int):
    store(module, *dense_weights(seed), concatenated=True, transposed=False)
    return module


@pytest.mark.parametrize(
    "module_path, config_cls, experts_cls, config, spec",
    [
        ("glm5_next.modeling_glm5_next", "Glm5NextTextConfig", "Glm5NextTextExperts",
         dict(swiglu_limit=0.5), "silu(limit=0.5)"),
        ("hy_v4.modeling_hy_v4", "HYV4Config", "HYV4Experts",
         dict(swiglu_limit=0.5), "silu(limit=0.5)"),
        ("minimax_m3_vl.modeling_minimax_m3_vl", "MiniMaxM3VLTextConfig", "MiniMaxM3VLExperts",
         dict(swiglu_limit=0.5, swiglu_alpha=1.702),
         "silu(alpha=1.7020000219345093,limit=0.5,up_offset=1.0)"),
    ],
)  # fmt: skip
def test_clamped_experts_classes(module_path, config_cls, experts_cls, config, spec):
    mod = __import__(f"transformers.models.{module_path}", fromlist=["x"])
    cfg = getattr(mod, config_cls)(
        hidden_size=H, moe_intermediate_size=I, intermediate_size=I, num_local_experts=E,
        hidden_act="silu", **config,
    )  # fmt: skip
    cls = getattr(mod, experts_cls)
    experts = [_stored(cls(cfg), seed) for seed in range(2)]
    torch.manual_seed(0)
    model = TinyModel(*experts)
    reference = copy.deepcopy(model)
    x = torch.randn(5, H) * 4
    replace_experts(model)
    got = [m.activation for m in model.modules() if isinstance(m, MoEExperts)]
    assert len(got) == 2 and kt_ops.layer.parse_activation(got[0]) == kt_ops.layer.parse_activation(
        spec
    )
    with torch.no_grad():
        assert rel_err(model(x), reference(x)) < 1e-4


def test_a_clamp_set_on_some_layers_only_is_probed_on_each():
    """Step-3.7's swiglu_limits: layer 0 unclamped, layer 1 clamps silu(gate) after the
    activation. Each layer is probed (their `limit` attributes differ), so layer 1 gets its
    clamp instead of layer 0's plain SwiGLU (the silent wrong result of issue 29)."""
    mod = __import__("transformers.models.step3p7.modeling_step3p7", fromlist=["x"])
    cfg = mod.Step3p7TextConfig(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, hidden_act="silu"
    )
    plain, clamped = mod.Step3p7Experts(cfg, None), mod.Step3p7Experts(cfg, 0.3)
    model = TinyModel(_stored(plain, 0), _stored(clamped, 1))
    reference = copy.deepcopy(model)
    infos = find_experts(model)
    assert infos[0].glu_candidates == ("silu",)
    assert infos[1].glu_candidates == ("silu(limit=0.3)", "silu(act_limit=0.3)", "silu")
    replace_experts(model)
    acts = [m.activation for m in model.modules() if isinstance(m, MoEExperts)]
    assert acts == ["silu", "silu(act_limit=0.3)"]
    x = torch.randn(5, H) * 4
    with torch.no_grad():
        assert rel_err(model(x), reference(x)) < 1e-4


@pytest.mark.parametrize(
    "module_path, config_cls, experts_cls",
    [
        ("gemma4.modeling_gemma4", "Gemma4TextConfig", "Gemma4TextExperts"),
        ("diffusion_gemma.modeling_diffusion_gemma", "DiffusionGemmaTextConfig",
         "DiffusionGemmaTextExperts"),
    ],
)  # fmt: skip
def test_gemma4_gelu_tanh_experts(module_path, config_cls, experts_cls):
    """Gemma 4's experts: GeGLU with the tanh GELU (hidden_activation gelu_pytorch_tanh)."""
    mod = __import__(f"transformers.models.{module_path}", fromlist=["x"])
    cfg = getattr(mod, config_cls)(hidden_size=H, moe_intermediate_size=I, num_experts=E)
    experts = [_stored(getattr(mod, experts_cls)(cfg), seed) for seed in range(2)]
    torch.manual_seed(0)
    model = TinyModel(*experts)
    reference = copy.deepcopy(model)
    replace_experts(model)
    assert [m.activation for m in model.modules() if isinstance(m, MoEExperts)] == ["gelu_tanh"] * 2
    x = torch.randn(5, H) * 4
    with torch.no_grad():
        assert rel_err(model(x), reference(x)) < 1e-4


def test_dbrx_stacked_experts():
    config = transformers.DbrxConfig(
        d_model=H, n_heads=4, n_layers=2, vocab_size=128, max_seq_len=64,
        ffn_config={"ffn_hidden_size": I, "moe_num_experts": E, "moe_top_k": 2},
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    round_experts_to_bf16_(model)
    infos = find_experts(model)
    assert [(i.layout, i.num_experts, i.hidden_size, i.intermediate_size) for i in infos] == [
        ("stacked", E, H, I)
    ] * 2
    reference = copy.deepcopy(model)
    replace_experts(model)
    with torch.inference_mode():
        want, got = reference(INPUT_IDS).logits, model(INPUT_IDS).logits
    assert rel_err(got, want) < 1e-4 and torch.equal(got.argmax(-1), want.argmax(-1))
    assert_embedding_grads_match(model, reference)
    # LoRA trains on it (its B factors get gradients); a PEFT adapter of this layout is
    # refused with a reason.
    model.zero_grad()
    apply_lora(model, rank=2)
    model(INPUT_IDS).logits.float().pow(2).mean().backward()
    lora_b = [p for n, p in model.named_parameters() if n.endswith("lora_b")]
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)

    with pytest.raises(ValueError, match="'stacked' layout"):
        adapter_tensors(model)


def test_longcat_zero_computation_experts():
    """LongCat-Flash: ids E .. E + zero_expert_num - 1 are identity experts (their slot adds
    top_k_weight * x); gate_up_proj holds rows for them that no expert uses."""
    mod = __import__("transformers.models.longcat_flash.modeling_longcat_flash", fromlist=["x"])
    cfg = transformers.AutoConfig.for_model(
        "longcat_flash", hidden_size=H, expert_ffn_hidden_size=I, n_routed_experts=E,
        zero_expert_num=2, hidden_act="silu",
    )  # fmt: skip
    experts = mod.LongcatFlashExperts(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_((torch.randn(E + 2, 2 * I, H, generator=g) / 8).bfloat16())
        experts.down_proj.copy_((torch.randn(E, H, I, generator=g) / 6).bfloat16())
    model = TinyModel(experts)
    reference = copy.deepcopy(model)
    assert find_experts(model)[0].identity_experts == 2
    replace_experts(model)
    new = model.layers[0].experts
    assert type(new).__name__ == "MoEExpertsWithIdentity" and new.num_experts == E
    x = torch.randn(6, H, generator=g)
    ids = torch.tensor([[0, 8], [9, 3], [8, 9], [7, 1], [2, 9], [5, 8]])
    w = torch.rand(6, 2, generator=g)
    with torch.no_grad():
        assert rel_err(new(x, ids, w), reference.layers[0].experts(x, ids, w)) < 1e-5
        with pytest.raises(RuntimeError, match="topk_ids"):
            new(x, ids.clamp(max=10) + (ids == 9).long(), w)  # id 10: past the identity ones


def test_openai_privacy_filter_experts():
    """gpt-oss's GLU and biases with gate and up concatenated (not interleaved)."""
    mod = __import__(
        "transformers.models.openai_privacy_filter.modeling_openai_privacy_filter", fromlist=["x"]
    )
    cfg = mod.OpenAIPrivacyFilterConfig(
        hidden_size=H, intermediate_size=I, num_local_experts=E, swiglu_limit=0.5
    )
    experts = [mod.OpenAIPrivacyFilterExperts(cfg) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in experts:
            for p in m.parameters():
                p.copy_((torch.randn(p.shape, generator=g) / 6).bfloat16())
    torch.manual_seed(0)
    model = TinyModel(*experts)
    reference = copy.deepcopy(model)
    infos = find_experts(model)
    assert all(i.biased and i.concatenated and i.transposed for i in infos)
    replace_experts(model)
    acts = {m.activation for m in model.modules() if isinstance(m, MoEExperts)}
    assert acts == {"silu(alpha=1.702,limit=0.5,up_offset=1.0)"}
    x = torch.randn(5, H, generator=g) * 4
    with torch.no_grad():
        assert rel_err(model(x), reference(x)) < 1e-4


class _SometimesBiasedExperts(torch.nn.Module):
    """Fused experts (concatenated, not transposed) whose biases exist on some instances only,
    as a model whose later layers alone have them."""

    def __init__(self, biased: bool, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = torch.nn.Parameter(
            (torch.randn(E, 2 * I, H, generator=g) / 8).bfloat16().float()
        )
        self.down_proj = torch.nn.Parameter(
            (torch.randn(E, H, I, generator=g) / 6).bfloat16().float()
        )
        self.has_bias = biased
        if biased:
            self.gate_up_proj_bias = torch.nn.Parameter(torch.randn(E, 2 * I, generator=g))
            self.down_proj_bias = torch.nn.Parameter(torch.randn(E, H, generator=g))

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(top_k_index.shape[1]):
                e = int(top_k_index[t, k])
                gu = self.gate_up_proj[e] @ x[t]
                d_bias = 0.0
                if self.has_bias:
                    gu = gu + self.gate_up_proj_bias[e]
                    d_bias = self.down_proj_bias[e]
                h = torch.nn.functional.silu(gu[:I]) * gu[I:]
                out[t] += top_k_weights[t, k] * (self.down_proj[e] @ h + d_bias)
        return out


def test_biases_on_later_layers_only_are_probed_and_kept():
    model = TinyModel(_SometimesBiasedExperts(False, 0), _SometimesBiasedExperts(True, 1))
    reference = copy.deepcopy(model)
    assert [i.biased for i in find_experts(model)] == [False, True]
    replace_experts(model)
    new = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert new[0].down_bias is None and new[1].down_bias is not None
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3)) * 2
    with torch.no_grad():
        assert rel_err(model(x), reference(x)) < 1e-4


def assert_embedding_grads_match(model, reference) -> None:
    """One backward through both models (train mode): the gradients reaching the input
    embeddings agree within 1e-4 (fp32, bf16-exact expert weights)."""
    model.train()
    reference.train()
    for m in (model, reference):
        m(INPUT_IDS).logits.float().pow(2).mean().backward()
    g, w = (m.get_input_embeddings().weight.grad for m in (model, reference))
    assert rel_err(g, w) < 1e-4


def _tiny_nemotron_h():
    config = transformers.AutoConfig.for_model(
        "nemotron_h", vocab_size=128, hidden_size=H, intermediate_size=I,
        moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=2,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hybrid_override_pattern="E*E", moe_shared_expert_intermediate_size=I,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    round_experts_to_bf16_(model)
    return model


def test_nemotron_h_non_gated_relu2_experts():
    # NemotronH: down(relu(up(x))^2) without a gate, run as relu(g) * u with g a copy of up.
    model = _tiny_nemotron_h()
    reference = copy.deepcopy(model)
    infos = find_experts(model)
    assert [i.non_gated for i in infos] == [True, True] and infos[0].activation == "relu"
    replace_experts(model)
    replaced = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert len(replaced) == 2 and all(m.activation == "relu" for m in replaced)
    with torch.inference_mode():
        want, got = reference(INPUT_IDS).logits, model(INPUT_IDS).logits
    assert rel_err(got, want) < 1e-4
    # The backward reaches the embeddings, equal to the dense model's (W_g = W_u).
    assert_embedding_grads_match(model, reference)
    with pytest.raises(ValueError, match="non-gated module"):
        apply_lora(model, rank=2)


def _tiny_inkling2():
    text = transformers.AutoConfig.for_model("inkling2").text_config
    small = dict(
        vocab_size=128, unpadded_vocab_size=128, hidden_size=H, num_hidden_layers=2,
        layer_types=["hybrid_sliding", "hybrid"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=16,
        moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=2, rel_extent=16,
        d_rel=4, eos_token_id=0, n_layers_per_attn_res_block=1, mlp_gate_softcap=1.0,
        mlp_up_softcap=2.0,
    )  # fmt: skip
    config = type(text)(**{**text.to_dict(), **small})
    torch.manual_seed(0)
    model = transformers.models.inkling2.modeling_inkling2.Inkling2ForCausalLM(config).eval()
    round_experts_to_bf16_(model)
    return model


def test_inkling2_softcapped_swiglu():
    # h = cg tanh(g / cg) * sigmoid(g) * cu tanh(u / cu), the caps read from the act_fn.
    model = _tiny_inkling2()
    reference = copy.deepcopy(model)
    spec = kt_ops.activation_spec("silu", gate_softcap=1.0, up_softcap=2.0)
    assert [i.activation for i in find_experts(model)] == [spec, spec]
    replace_experts(model)
    with torch.inference_mode():
        want, got = reference(INPUT_IDS).logits, model(INPUT_IDS).logits
    assert rel_err(got, want) < 1e-4
    assert_embedding_grads_match(model, reference)


def test_jetmoe_block():
    # JetMoE's MoE block (input_linear / output_linear parallel experts, its own router
    # and output bias), replaced as a whole by a JetMoeBlock around kt_ops experts.
    from kt_ops.hf_experts import JetMoeBlock

    config = transformers.AutoConfig.for_model(
        "jetmoe", vocab_size=128, hidden_size=H, intermediate_size=I, num_local_experts=E,
        num_experts_per_tok=2, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (layer.mlp.input_linear, layer.mlp.output_linear):
                lin.weight.copy_(lin.weight.bfloat16().float())
            layer.mlp.bias.normal_(0, 0.1)
    reference = copy.deepcopy(model)
    infos = find_experts(model)
    assert [i.layout for i in infos] == ["jetmoe", "jetmoe"]
    replace_experts(model)
    assert all(isinstance(layer.mlp, JetMoeBlock) for layer in model.model.layers)
    with torch.inference_mode():
        out = model(INPUT_IDS, output_router_logits=True)
        ref = reference(INPUT_IDS, output_router_logits=True)
    assert rel_err(out.logits, ref.logits) < 1e-4
    assert len(out.router_logits) == len(ref.router_logits) > 0  # still recorded
    for a, b in zip(out.router_logits, ref.router_logits):
        assert rel_err(a, b) < 1e-4
    assert_embedding_grads_match(model, reference)
    # kt_ops LoRA on the block's experts.
    apply_lora(model, rank=2)
    assert model.model.layers[0].mlp.kt_experts.gate_lora_a is not None
    assert find_experts(model) == []  # already replaced


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_block_scales_the_expert_inputs(top_k: int):
    # Llama 4 calls its experts on every expert's copy of the tokens, each already scaled
    # by its sigmoid routing score (sum_k expert_k(s_k x), not sum_k s_k expert_k(x)), with
    # transposed [E, H, 2I] / [E, I, H] weights: the block is replaced as a whole.
    from kt_ops.hf_experts import Llama4MoeBlock

    config = transformers.AutoConfig.for_model(
        "llama4_text", vocab_size=128, hidden_size=H, intermediate_size=I,
        intermediate_size_mlp=2 * I, num_local_experts=E, num_experts_per_tok=top_k,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        interleave_moe_layer_step=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (
                layer.feed_forward.experts.gate_up_proj,
                layer.feed_forward.experts.down_proj,
            ):
                p.normal_(0, 0.05).copy_(p.bfloat16().float())  # zeros by default
    reference = copy.deepcopy(model)
    infos = find_experts(model)
    assert [(i.layout, i.transposed) for i in infos] == [("llama4", True)] * 2
    replace_experts(model)
    assert all(isinstance(layer.feed_forward, Llama4MoeBlock) for layer in model.model.layers)
    with torch.inference_mode():
        out = model(INPUT_IDS, output_router_logits=True)
        ref = reference(INPUT_IDS, output_router_logits=True)
    assert rel_err(out.logits, ref.logits) < 1e-4
    # Against kt_ops' usual weighted sum, the scaled inputs make a real difference.
    block = model.model.layers[0].feed_forward
    x = torch.randn(5, H)
    scores, logits = block.router(x)
    ids = logits.topk(top_k, dim=1).indices
    weighted = block.kt_experts(x, ids, scores.gather(1, ids)) + block.shared_expert(x)
    assert rel_err(weighted, block(x)[0]) > 1e-2
    assert_embedding_grads_match(model, reference)
    apply_lora(model, rank=2)
    assert model.model.layers[0].feed_forward.kt_experts.gate_lora_a is not None
    assert find_experts(model) == []  # already replaced


def test_muse_spark_post_expert_norm():
    # MuseSpark: a norm after each expert, before its routing weight:
    # sum_k w_k * norm(expert_k(x)). The experts run on kt_ops one (token, slot) pair per
    # row, the model's own norm (kept, trainable) in PyTorch.
    from kt_ops.hf_experts import PostNormExperts

    config = transformers.AutoConfig.for_model(
        "muse_spark_text", vocab_size=128, hidden_size=H, intermediate_size=2 * I,
        moe_intermediate_size=I, moe_hidden_size=48, num_local_experts=E,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["sparse"] * 2,
        layer_rope_theta=[10000.0, 0], bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval()  # the text model: no LM head
    round_experts_to_bf16_(model)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "MuseSparkExperts":
                m.post_expert_norm.weight.normal_(0, 0.5)  # zeros (a plain RMSNorm) by default
    reference = copy.deepcopy(model)
    assert [i.post_expert_norm for i in find_experts(model)] == [True, True]
    replace_experts(model)
    wrapped = [m for m in model.modules() if isinstance(m, PostNormExperts)]
    assert len(wrapped) == 2
    with torch.inference_mode():
        got, want = (m(INPUT_IDS).last_hidden_state for m in (model, reference))
    assert rel_err(got, want) < 1e-4
    # Without the norm the output is a different function: the wrapper's norm matters.
    x = torch.randn(5, 48)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(5)])
    w = torch.rand(5, 2)
    plain = wrapped[0].kt_experts(x, ids, w)
    assert rel_err(plain, wrapped[0](x, ids, w)) > 1e-1
    # Gradients against a fixed random probe (the squared norm of a final RMSNorm's output
    # has none): the embeddings' and the post-expert norms' own weights.
    probe = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    for m in (model, reference):
        (m(INPUT_IDS).last_hidden_state * probe).sum().backward()
    assert rel_err(*(m.get_input_embeddings().weight.grad for m in (model, reference))) < 1e-4
    norm_grads = [
        [m.post_expert_norm.weight.grad for m in net.modules() if hasattr(m, "post_expert_norm")]
        for net in (model, reference)
    ]
    assert len(norm_grads[0]) == 2 and len(norm_grads[1]) == 2
    for g, w in zip(*norm_grads):
        assert rel_err(g, w) < 1e-4
    apply_lora(model, rank=2)
    assert wrapped[0].kt_experts.gate_lora_a is not None
    assert find_experts(model) == []  # already replaced


@pytest.mark.parametrize("via", ["checkpoint", "converted"])
def test_gpt_oss_mxfp4_checkpoint_end_to_end(tmp_path, via: str):
    # gpt-oss as published: MXFP4 experts (gate/up rows interleaved) read by kt_ops, with the
    # model's per-expert biases and its clamped GLU, against the transformers model holding
    # the dequantized experts; straight from the checkpoint, and through kt-ops convert.
    from checkpoints import write_hf_mxfp4

    from kt_ops.convert import convert

    model = _tiny_causal_lm("gpt_oss")
    deq = write_hf_mxfp4(tmp_path / "ckpt", E=E, H=H, I=I, num_layers=2)
    with torch.no_grad():
        for L, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            gate_up = torch.empty(E, 2 * I, H)
            gate_up[:, 0::2], gate_up[:, 1::2] = deq[L]["gate"], deq[L]["up"]
            experts.gate_up_proj.copy_(gate_up.transpose(1, 2))  # [E, H, 2I]
            experts.down_proj.copy_(deq[L]["down"].transpose(1, 2))  # [E, I, H]
            experts.gate_up_proj_bias.normal_(0, 0.1)
            experts.down_proj_bias.normal_(0, 0.1)
    reference = copy.deepcopy(model)
    source = tmp_path / "ckpt"
    if via == "converted":
        convert(source, tmp_path / "converted")
        source = tmp_path / "converted"
    replace_experts(model, checkpoint=str(source))
    replaced = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert [m.weight_format for m in replaced] == ["mxfp4", "mxfp4"]
    assert all(m.down_bias is not None for m in replaced)
    before = kt_ops.config.quant_activations
    try:
        kt_ops.config.quant_activations = "fp32"  # the weights exact: only the order of sums
        with torch.inference_mode():
            got, want = model(INPUT_IDS).logits, reference(INPUT_IDS).logits
    finally:
        kt_ops.config.quant_activations = before
    assert rel_err(got, want) < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
