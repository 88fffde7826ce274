"""Run a Hugging Face MoE model's routed experts on kt_ops.

Builds a small Qwen3-MoE model from a config with seeded random weights (no
download), moves its experts onto ``torch.ops.kt.moe_forward`` and generates a
few tokens. With a real checkpoint, load it with ``from_pretrained`` instead and
call ``kt_ops.replace_experts(model)`` the same way.

    python examples/hf_moe_inference.py
"""

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import kt_ops


def main() -> None:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 8))
    with torch.no_grad():
        reference = model.generate(prompt, max_new_tokens=8, do_sample=False)

    kt_ops.replace_experts(model)  # routed experts -> kt_ops; router/attention stay in PyTorch
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)

    kt_ops.print_info()
    print("reference:", reference[0, 8:].tolist())
    print("kt_ops   :", tokens[0, 8:].tolist())


if __name__ == "__main__":
    main()
