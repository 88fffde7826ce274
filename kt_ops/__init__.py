"""kt_ops: the routed experts of Mixture-of-Experts models on the CPU, as PyTorch ops.

Importing this package loads the native extension, which registers
``torch.ops.kt.moe_forward``, ``moe_forward_train`` and ``moe_backward`` (CPU
kernels), and their fake kernels and autograd formula. See ``ops`` for the op
wrappers, ``layer`` for the description of a layer's experts
(:class:`ExpertWeights`, :class:`LoRAWeights`), ``nn`` for the expert module,
``hf`` for Hugging Face models, and ``config`` for the process-wide settings
(threads, ISA path, compute path, NUMA, ...; :class:`kt_ops.runtime.Config`), of
which the ``set_*`` / ``get_*`` / ``use_*`` functions here are older aliases.
"""

import torch  # noqa: F401  (first: loads libtorch*.so, which kt_ops._C links)

from kt_ops import _C  # noqa: F401  (registers the kt:: ops)
from kt_ops.formats.bf16 import pack_weights, unpack_weights
from kt_ops.info import info, print_info
from kt_ops.layer import ACTIVATIONS, ExpertWeights, LoRAWeights, activation_spec
from kt_ops.ops import (
    lora_activation_checkpointing,
    moe_forward,
    set_lora_activation_checkpointing,
)
from kt_ops.runtime import (
    Config,
    active_isa,
    compute_paths,
    config,
    get_brgemm_bf16_kernel,
    get_compute_path,
    get_num_threads,
    get_numa,
    get_parallel_backend,
    get_quant_activations,
    numa_placement,
    quant_fp32_min_tokens,
    set_brgemm_bf16_kernel,
    set_compute_path,
    set_isa,
    set_num_threads,
    set_numa,
    set_parallel_backend,
    set_quant_activations,
    supported_isas,
    use_brgemm_bf16_kernel,
    use_compute_path,
    use_isa,
    use_numa,
    use_parallel_backend,
    use_quant_activations,
)

__version__ = "0.1.0"

__all__ = [
    "config",
    "Config",
    "moe_forward",
    "ACTIVATIONS",
    "activation_spec",
    "ExpertWeights",
    "LoRAWeights",
    "pack_weights",
    "unpack_weights",
    "set_lora_activation_checkpointing",
    "lora_activation_checkpointing",
    "active_isa",
    "get_num_threads",
    "info",
    "print_info",
    "set_isa",
    "set_num_threads",
    "supported_isas",
    "use_isa",
    "get_quant_activations",
    "quant_fp32_min_tokens",
    "set_quant_activations",
    "use_quant_activations",
    "compute_paths",
    "get_brgemm_bf16_kernel",
    "get_compute_path",
    "set_brgemm_bf16_kernel",
    "set_compute_path",
    "use_brgemm_bf16_kernel",
    "use_compute_path",
    "get_numa",
    "set_numa",
    "use_numa",
    "get_parallel_backend",
    "set_parallel_backend",
    "use_parallel_backend",
    "numa_placement",
    "replace_experts",
    "apply_lora",
]


def __getattr__(name: str):
    """Lazy ``kt_ops.KTMoEWrapper`` (:class:`kt_ops.compat.KTMoEWrapper`, kt-kernel's API)."""
    if name == "KTMoEWrapper":
        from kt_ops.compat import KTMoEWrapper

        return KTMoEWrapper
    raise AttributeError(f"module 'kt_ops' has no attribute {name!r}")


def replace_experts(model, weight_format=None, **kwargs):
    """Move the routed experts of every MoE layer of ``model`` onto kt_ops.

    Alias of :func:`kt_ops.hf.replace_experts` (same arguments, errors and
    return value), imported lazily so that ``import kt_ops`` does not import
    transformers.
    """
    from kt_ops.hf import replace_experts as _replace

    return _replace(model, weight_format, **kwargs)


def apply_lora(
    model, rank: int = 16, alpha=None, target_projections=("gate", "up", "down"), **kwargs
):
    """Give the kt_ops experts of ``model`` trainable LoRA adapters (after ``replace_experts``).

    Alias of :func:`kt_ops.lora.apply_lora` (same arguments, errors and return value).
    """
    from kt_ops.lora import apply_lora as _apply

    return _apply(model, rank, alpha, target_projections, **kwargs)
