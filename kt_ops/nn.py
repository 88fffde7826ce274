"""``torch.nn`` modules that run the routed experts of an MoE layer with ``kt.moe_forward``.

:class:`MoEExperts` is a drop-in replacement for the experts module of a
transformers-v5 MoE block: it is called as ``experts(hidden_states,
top_k_index, top_k_weights)`` after the router has picked the experts, and it
holds the packed expert weights as buffers (so ``state_dict``, ``deepcopy`` and
``torch.compile`` see plain tensors). :class:`MoEExpertList` adds
``len``/indexing for code that loops over ``self.experts[i](x)`` itself.

The packed base weights are frozen buffers. The modules are differentiable
with respect to their inputs (hidden states, routing weights) and, after
:meth:`MoEExperts.add_lora`, train LoRA adapters on the experts (gradients from
``kt.moe_backward``). For inference, run under ``torch.no_grad`` /
``inference_mode``: nothing is saved for backward then, and eager calls without
LoRA go to a layer parsed once (``kt::moe_forward_prepared`` on a
``torch.classes.kt.PreparedLayer``, :class:`kt_ops.ops.PreparedLayer`), which
gives the op's output bit for bit at a fraction of a decode step's call
overhead; everything else (grad mode, LoRA, subclasses, ``torch.compile``)
calls ``kt::moe_forward``.

CPU/GPU hybrid: :meth:`MoEExperts.set_gpu_experts` (or the ``gpu_experts=``
argument of the constructors) keeps some experts, typically the most used
ones (:func:`hottest_experts`), as dense PyTorch weights that follow the
module's device and dtype (``.cuda()``, ``.to(torch.bfloat16)``). Those
experts are computed with plain torch; the op gets ``gpu_experts_mask=`` and
skips them; the module returns the sum of both parts.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from kt_ops._checks import as_int
from kt_ops.formats import (
    FOUR_BIT_PLANE_BEFORE_V3,
    format_spec,
    padded_k,
    repack_four_bit_plane,
)
from kt_ops.formats.packed import PackedProjection
from kt_ops.gpu_experts import (
    GpuExperts,
    GpuResidentExperts,
    hottest_experts,
    parse_gpu_experts,
)
from kt_ops.layer import (
    DEFAULT_ACTIVATION,
    PROJECTIONS,
    ExpertWeights,
    LoRAWeights,
    layer_args,
    parse_activation,
)
from kt_ops.ops import moe_forward, new_prepared_layer
from kt_ops.runtime import numa_placement

__all__ = [
    "MoEExperts",
    "MoEExpertList",
    "MoEExpertsWithIdentity",
    "hottest_experts",
    "parse_gpu_experts",
]

_PARTS = ("weight", "scales", "zeros")
#: The per-expert bias buffers (None where a projection has none).
_BIASES = tuple(f"{proj}_bias" for proj in PROJECTIONS)
#: The packed buffers and the biases, in the op's ``weights`` order.
_PACKED_BUFFERS = tuple(f"{proj}_{part}" for proj in PROJECTIONS for part in _PARTS) + _BIASES

# What MoEExperts keeps in its __dict__ between calls (dropped when pickled or copied).
_CALL_CACHES = ("_expert_weights_cache", "_plain_layer_args_cache", "_prepared_layer")


class MoEExperts(GpuResidentExperts, nn.Module):
    """The routed experts of one MoE layer, computed on the CPU by ``kt.moe_forward``.

    Every expert ``e`` is a gated MLP: SwiGLU (Mixtral, Qwen-MoE, OLMoE,
    DeepSeek; ``activation='silu'``, the default) or GeGLU (``'gelu'``,
    ``'gelu_tanh'``; :data:`kt_ops.ACTIVATIONS`)::

        expert_e(x) = W_down[e] @ (act(W_gate[e] @ x) * (W_up[e] @ x))
        out[t]      = sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(x[t])

    Build it from dense weights with :meth:`from_dense`, from three packed
    projections with :meth:`from_packed`, or from an
    :class:`~kt_ops.layer.ExpertWeights`. The packed tensors are the buffers
    ``{gate,up,down}_{weight,scales,zeros}`` (``None`` where a format has no
    such tensor); they are part of ``state_dict``.

    The packed weights are a storage format of host memory, not values in the
    model's dtype: ``module.to(dtype)``, ``.half()``, ``.cuda()`` leave them as
    they are (on the CPU), so a model holding this module can be cast or moved
    without touching its experts. The compute dtype follows the input.

    Training: gradients flow to ``hidden_states`` and ``top_k_weights``; the
    packed weights are frozen. :meth:`add_lora` adds trainable LoRA adapters
    (parameters ``gate_lora_a`` ... ``down_lora_b``). What forward saves for
    backward follows ``activation_checkpointing`` (see
    :func:`kt_ops.set_lora_activation_checkpointing`).

    GPU-resident experts (CPU/GPU hybrid inference, :meth:`set_gpu_experts`):
    the experts selected by ``gpu_experts`` are also held as dense weights in
    the buffers ``gpu_gate_weight [n, I, H]``, ``gpu_up_weight [n, I, H]`` and
    ``gpu_down_weight [n, H, I]`` (``n`` = :attr:`num_gpu_experts`), with
    ``gpu_experts_mask`` (bool ``[E]``), ``gpu_expert_ids`` (int64 ``[n]``) and
    ``gpu_expert_slot`` (int64 ``[E]``, ``-1`` for CPU experts). Unlike the
    packed weights these follow ``.to()/.cuda()/.half()``: on a GPU model
    the hot experts run on the GPU. Forward computes them with plain torch,
    their tokens gathered by routing, and passes ``gpu_experts_mask=`` to
    the op, which skips them (:func:`kt_ops.moe_forward`); the output is the
    sum. On a CPU-only host they stay on the CPU and the same split runs
    there. With LoRA the GPU experts use the same factors (rows
    ``gpu_expert_ids`` of ``{p}_lora_a/b``), so both parts train.

    ``state_dict``: the GPU-resident buffers are **not** saved (they are a
    placement choice, derived from the packed weights): a module's
    ``state_dict`` has the same keys whatever its GPU experts, and loads into
    a module with other GPU experts or none. When ``load_state_dict`` loads
    packed weights into a module that has GPU experts, their dense weights
    are dequantized again from the loaded packed weights (same ids, dtype and
    device).

    Args:
        experts: the layer's packed experts (validated here).
        activation_checkpointing: ``True`` recomputes the gate/up
            pre-activations in backward, ``False`` saves them (``2*K*I*4``
            bytes per token), ``None`` (default) is the op's default (with
            LoRA: :func:`kt_ops.set_lora_activation_checkpointing`; without:
            recompute). An attribute: it can be changed later. (The GPU
            experts' torch path saves what autograd saves.)
        gpu_experts: experts to keep as dense GPU-resident weights: ``None``
            (default: none), a bool mask ``[E]``, expert ids (a sequence or an
            integer tensor), or an ``int`` count of hottest experts (with
            ``routing_counts``); see :meth:`set_gpu_experts`. Their weights
            are dequantized from ``experts`` (fp32 unless ``gpu_dtype``).
        routing_counts: ``[E]`` hit counts, with an ``int`` ``gpu_experts``.
        gpu_dtype: dtype of the GPU experts' weights (fp32, bf16 or fp16).
        activation: the experts' GLU: one of :data:`kt_ops.ACTIVATIONS`
            (default ``'silu'``), optionally with parameters
            (:func:`kt_ops.activation_spec`: gpt-oss's clamped SwiGLU). An
            attribute, as the op's argument. Per-expert biases come with
            ``experts`` (:meth:`ExpertWeights.with_biases`; buffers
            ``{gate,up,down}_bias``).

    Raises:
        ValueError: a packed tensor does not have the layout of its format
            and sizes (``ExpertWeights.validate``), a bad ``gpu_experts``
            / ``routing_counts`` / ``gpu_dtype`` (see :meth:`set_gpu_experts`),
            or an ``activation`` the op refuses (:func:`kt_ops.activation_spec`).
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    weight_formats: tuple[str, str, str]
    group_sizes: tuple[int, int, int]
    lora_scaling: float
    activation_checkpointing: Optional[bool]
    activation: str

    def __init__(
        self,
        experts: ExpertWeights,
        *,
        activation_checkpointing: Optional[bool] = None,
        gpu_experts: GpuExperts = None,
        routing_counts: Optional[Tensor] = None,
        gpu_dtype: Optional[torch.dtype] = None,
        activation: str = DEFAULT_ACTIVATION,
    ) -> None:
        super().__init__()
        if not isinstance(experts, ExpertWeights):
            raise ValueError(
                f"MoEExperts: experts must be a kt_ops.ExpertWeights, got {type(experts).__name__}"
            )
        try:
            parse_activation(activation)
        except ValueError as err:
            raise ValueError(f"MoEExperts: {err}") from None
        self.activation = activation
        experts.validate()
        for proj, p in zip(PROJECTIONS, experts.projections):
            for part in (*_PARTS, "bias"):
                t = getattr(p, part)
                self.register_buffer(f"{proj}_{part}", None if t is None else t.contiguous())
        self.num_experts = experts.num_experts
        self.hidden_size = experts.hidden_size
        self.intermediate_size = experts.intermediate_size
        self.weight_formats = tuple(p.weight_format for p in experts.projections)
        self.group_sizes = experts.group_sizes
        self.lora_scaling = 1.0
        self.activation_checkpointing = activation_checkpointing
        for proj in PROJECTIONS:
            self.register_parameter(f"{proj}_lora_a", None)
            self.register_parameter(f"{proj}_lora_b", None)
        self._init_gpu_experts()
        if gpu_experts is not None:
            self.set_gpu_experts(gpu_experts, routing_counts=routing_counts, dtype=gpu_dtype)

    @property
    def weight_format(self) -> str:
        """One format name, or ``'gate,up,down'`` when the projections differ."""
        g, u, d = self.weight_formats
        return g if g == u == d else f"{g},{u},{d}"

    def expert_weights(self) -> ExpertWeights:
        """The packed experts as an :class:`~kt_ops.layer.ExpertWeights` (views of the buffers).

        Built once and reused while the buffers are the same tensor objects (a
        decode step pays no Python construction); rebuilt when one is replaced.
        """
        compiling = torch.compiler.is_compiling()  # traced once: no cache (no graph break)
        buffers = tuple(map(self._buffers.__getitem__, _PACKED_BUFFERS))
        cached = None if compiling else self.__dict__.get("_expert_weights_cache")
        if (
            cached is not None
            and all(a is b for a, b in zip(cached[0], buffers))
            and cached[1].backward_panels_fresh()
        ):
            return cached[1]
        H, inter = self.hidden_size, self.intermediate_size
        dims = ((inter, H), (inter, H), (H, inter))
        experts = ExpertWeights(
            *(
                PackedProjection(
                    *(self._buffers[f"{proj}_{part}"] for part in _PARTS),
                    fmt,
                    g,
                    n,
                    k,
                    self._buffers[f"{proj}_bias"],
                )
                for proj, fmt, g, (n, k) in zip(
                    PROJECTIONS, self.weight_formats, self.group_sizes, dims
                )
            )
        )
        if not compiling:
            if self.__dict__.get("_keep_backward_panels", False):
                experts = experts.with_backward_panels()
            self.__dict__["_expert_weights_cache"] = (buffers, experts)
        return experts

    def keep_backward_panels(self, keep: bool = True) -> MoEExperts:
        """Keep the LoRA backward's transposed weights beside the packed ones.

        :meth:`kt_ops.ExpertWeights.with_backward_panels`, made at the next call
        and again after the packed buffers change (replaced, or written in place
        as by ``load_state_dict``): LoRA fine-tuning's backward reads them instead
        of transposing every routed expert's weights at every step (10-17% of the
        backward on Zen 4 at 512 tokens), for 2 bytes of host memory per weight
        (as much again as a bf16 base, twice an int8 one, four times an mxfp4 one).
        Made for bf16, int8, the fp8 formats and mxfp4 (the others: none).
        Results are bit for bit the same. ``keep=False`` drops them. Eager calls
        only (a ``torch.compile`` trace reads the weights without them); not in
        ``state_dict``. Returns ``self``.
        """
        self.__dict__["_keep_backward_panels"] = bool(keep)
        for key in _CALL_CACHES:
            self.__dict__.pop(key, None)
        return self

    def numa_placement(self) -> dict:
        """Where this layer's packed experts live per NUMA node (:func:`kt_ops.numa_placement`).

        With placement on, the first forward (or this call) binds each node's
        slice of every expert to that node, in place; the binding belongs to
        the buffers' memory, so it survives ``load_state_dict`` (a copy into
        them) and a replaced buffer is placed again on its next use.
        """
        return numa_placement(self.expert_weights())

    def _plain_layer_args(self) -> tuple:
        """The op's layer arguments without LoRA or mask, cached with :meth:`expert_weights`."""
        experts = self.expert_weights()
        cached = self.__dict__.get("_plain_layer_args_cache")
        if cached is not None and cached[0] is experts and cached[1][6] == self.activation:
            return cached[1]
        args = layer_args(experts, None, self.activation, None)
        self.__dict__["_plain_layer_args_cache"] = (experts, args)
        return args

    def lora_weights(self) -> LoRAWeights:
        """The LoRA factors as a :class:`~kt_ops.layer.LoRAWeights` (``scaling`` included)."""
        pairs = {}
        for p in PROJECTIONS:
            a = getattr(self, f"{p}_lora_a")
            pairs[p] = (a, getattr(self, f"{p}_lora_b")) if a is not None else None
        return LoRAWeights(**pairs, scaling=self.lora_scaling)

    def check_lora_allowed(self, where: str) -> None:
        """Raise ValueError when LoRA cannot be added: experts replaced from a non-gated
        module (NemotronH's relu2, run as relu(u) * u with the gate a copy of up, which
        an adapter on either projection would break)."""
        if getattr(self, "source_layout", {}).get("layout") == "non_gated":
            raise ValueError(
                f"{where}: these experts come from a non-gated module (NemotronH's relu2, run "
                "as relu(u) * u with the gate a copy of up); LoRA on them is not supported"
            )

    def add_lora(
        self,
        rank: int,
        alpha: Optional[float] = None,
        projections: Sequence[str] = PROJECTIONS,
        *,
        dtype: torch.dtype = torch.float32,
        generator: Optional[torch.Generator] = None,
    ) -> MoEExperts:
        """Add trainable LoRA adapters to every expert (Hu et al. 2021; PEFT's init and scaling).

        Projection ``p`` of expert ``e`` becomes
        ``W_p[e] x + (alpha / rank) * B_p[e] (A_p[e] x)``. The new parameters are
        ``{p}_lora_a`` (``[E, rank, in]``, Kaiming-uniform like ``nn.Linear``)
        and ``{p}_lora_b`` (``[E, out, rank]``, zeros, so the model starts as
        the base model), for ``p`` in ``projections``.

        Works on every ``weight_format`` (QLoRA style on a quantized base, e.g.
        ``MoEExperts.from_dense(gate, up, down, 'int4', group_size=32)``): the
        packed base stays frozen, and with LoRA each active expert's base is
        dequantized to fp32 per call and multiplies fp32 activations. The
        no-LoRA kernels of the integer formats round activations to int8, so
        with fresh adapters (``B = 0``) the output differs from the module
        without LoRA by that rounding (about 1e-2 relative; see
        :func:`kt_ops.moe_forward`).

        Args:
            rank: LoRA rank ``r >= 1``.
            alpha: LoRA alpha; the scaling is ``alpha / rank`` (default
                ``alpha = rank``: scaling 1).
            projections: any of ``'gate'``, ``'up'``, ``'down'``.
            dtype: fp32, bf16 or fp16 (computed in fp32 either way).
            generator: random generator for the A initialisation.

        Returns:
            ``self``.

        Raises:
            ValueError: a rank below 1, an unknown projection or dtype,
                projections that already have LoRA, or experts replaced from a
                non-gated module (NemotronH: the gate is a copy of up, which an
                adapter on either would break).
        """
        self.check_lora_allowed("MoEExperts.add_lora")
        if as_int(rank) is None or rank < 1:
            raise ValueError(f"MoEExperts.add_lora: rank must be an int >= 1, got {rank!r}")
        rank = as_int(rank)
        unknown = [p for p in projections if p not in PROJECTIONS]
        if unknown or not projections:
            raise ValueError(
                f"MoEExperts.add_lora: projections must be a non-empty subset of "
                f"{PROJECTIONS}, got {tuple(projections)}"
            )
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"MoEExperts.add_lora: dtype must be fp32, bf16 or fp16, got {dtype}")
        if any(getattr(self, f"{p}_lora_a") is not None for p in projections):
            raise ValueError(f"MoEExperts.add_lora: {tuple(projections)} already have LoRA")
        E, H, inter = self.num_experts, self.hidden_size, self.intermediate_size
        dims = {"gate": (inter, H), "up": (inter, H), "down": (H, inter)}
        for p in projections:
            n, k = dims[p]
            # nn.Linear's (and PEFT's) kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(k), 1/sqrt(k)).
            bound = 1.0 / math.sqrt(k)
            a = torch.empty(E, rank, k).uniform_(-bound, bound, generator=generator)
            setattr(self, f"{p}_lora_a", nn.Parameter(a.to(dtype)))
            setattr(self, f"{p}_lora_b", nn.Parameter(torch.zeros(E, n, rank, dtype=dtype)))
        self.lora_scaling = float(alpha if alpha is not None else rank) / rank
        return self

    def lora_parameters(self) -> dict[str, Tensor]:
        """The LoRA factors present, by argument name of ``kt_ops.moe_forward``."""
        names = (f"{p}_lora_{f}" for p in PROJECTIONS for f in ("a", "b"))
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def _refuse_old_kquant_scales(self, state_dict, prefix: str) -> None:
        """A ValueError for a state_dict of the pre-GGUF-size k-quant layout.

        kt_ops before ``manifest_version`` 2 stored ``q4_k`` / ``q5_k`` /
        ``q6_k`` scales as fp32 ``d*sc`` (and ``dmin*m`` zeros); today's
        buffers are GGUF's uint8 scale records (docs/formats.md, "k-quant
        scales"). torch would report only a size mismatch.
        """
        for proj, fmt in zip(PROJECTIONS, self.weight_formats):
            scales = state_dict.get(f"{prefix}{proj}_scales")
            if (
                format_spec(fmt).is_kquant
                and isinstance(scales, Tensor)
                and scales.dtype != torch.uint8
            ):
                raise ValueError(
                    f"MoEExperts.load_state_dict: {prefix}{proj}_scales is {scales.dtype} "
                    f"{tuple(scales.shape)}, the k-quant layout of kt_ops before manifest_version "
                    f"2 (fp32 d*sc scales and dmin*m zeros); this kt_ops keeps {fmt}'s GGUF scale "
                    "records (uint8 [E, NB, Kp/256, R]). Pack the source weights again "
                    "(MoEExperts.from_dense, or kt_ops.loaders from the GGUF file)"
                )

    def _repack_old_narrow_codes(self, state_dict, prefix: str) -> None:
        """Repack q2_k / q3_k weights of kt_ops before their 2- and 3-bit planes.

        Those held the codes in the 4-bit plane (``manifest_version`` 2); the
        repacking is lossless (:func:`kt_ops.formats.repack_four_bit_plane`).
        """
        H, inter = self.hidden_size, self.intermediate_size
        dims = {"gate": (inter, H), "up": (inter, H), "down": (H, inter)}
        for proj, fmt in zip(PROJECTIONS, self.weight_formats):
            key = f"{prefix}{proj}_weight"
            w = state_dict.get(key)
            if fmt not in FOUR_BIT_PLANE_BEFORE_V3 or not isinstance(w, Tensor) or w.dim() != 3:
                continue
            n, k = dims[proj]
            if w.dtype == torch.uint8 and w.shape[-1] == 8 * padded_k(k):
                state_dict[key] = repack_four_bit_plane(w.cpu(), fmt, n, k)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        self._refuse_old_kquant_scales(state_dict, prefix)
        self._repack_old_narrow_codes(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        packed = (f"{prefix}{proj}_{part}" for proj in PROJECTIONS for part in _PARTS)
        if self.num_gpu_experts and any(key in state_dict for key in packed):
            self._refresh_gpu_weights()

    @classmethod
    def from_dense(
        cls,
        gate: Tensor,
        up: Tensor,
        down: Tensor,
        weight_format: str = "bf16",
        *,
        activation_checkpointing: Optional[bool] = None,
        group_size: Optional[int] = None,
        symmetric: bool = True,
        gpu_experts: GpuExperts = None,
        routing_counts: Optional[Tensor] = None,
        gpu_dtype: Optional[torch.dtype] = None,
        activation: str = DEFAULT_ACTIVATION,
    ) -> MoEExperts:
        """Pack (and quantize) dense expert weights (``nn.Linear`` convention: ``[E, out, in]``).

        Args:
            gate: ``[E, I, H]`` gate projections, any floating dtype, any device
                (copied to the CPU).
            up: ``[E, I, H]`` up projections.
            down: ``[E, H, I]`` down projections.
            weight_format: target format, one of :data:`kt_ops.formats.FORMATS`
                (quantized online by :func:`kt_ops.formats.quantize_weights`, a
                few experts at a time so the fp32 temporaries stay small), or
                per-projection formats ``'gate,up,down'`` (``'q4_k,q4_k,q6_k'``
                for a Q4_K_M-like mix).
            activation_checkpointing: as in the constructor.
            group_size: group along K for the formats that take one (``None``:
                each format's default; a format with a single group size keeps
                its own; see docs/formats.md).
            symmetric: ``int4`` only: ``False`` stores zero points.
            gpu_experts, routing_counts: GPU-resident experts, as in
                :meth:`set_gpu_experts`. Their dense weights are copied from
                ``gate``/``up``/``down`` (the original weights, in their dtype
                and on their device, not the quantized values: what a GPU
                would hold), so with a quantized ``weight_format`` those
                experts are exact and the rest quantized.
            gpu_dtype: dtype of those copies (default: that of ``gate``).
            activation: the experts' ``act`` (:data:`kt_ops.ACTIVATIONS`).

        Returns:
            A new module; the packed weights are on the CPU, the GPU experts'
            copies on the device of ``gate``. The given tensors are not
            referenced.

        Raises:
            ValueError: the tensors are not 3-D, not floating point, or their
                shapes do not agree (``gate``/``up`` ``[E, I, H]``, ``down``
                ``[E, H, I]``), or ``weight_format`` is unknown.
        """
        for name, t in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(t, Tensor) or t.dim() != 3:
                shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(
                    f"MoEExperts.from_dense: {name} must be 3-D [E, N, K], got {shape}"
                )
        E, inter, H = gate.shape
        if tuple(up.shape) != (E, inter, H) or tuple(down.shape) != (E, H, inter):
            raise ValueError(
                f"MoEExperts.from_dense: expected gate and up [E, I, H] and down [E, H, I]; got "
                f"gate {tuple(gate.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}"
            )
        experts = ExpertWeights.from_dense(
            gate, up, down, weight_format, group_size=group_size, symmetric=symmetric
        )
        module = cls(
            experts, activation_checkpointing=activation_checkpointing, activation=activation
        )
        if gpu_experts is not None:
            module.set_gpu_experts(
                gpu_experts, routing_counts=routing_counts, dense=(gate, up, down), dtype=gpu_dtype
            )
        return module

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Weighted sum of the selected experts' outputs, per token.

        With GPU-resident experts (:meth:`set_gpu_experts`) the output is
        ``y_gpu + y_cpu``: ``y_gpu`` computed here with torch from the dense
        GPU-expert weights (on their device, which must be that of
        ``hidden_states``), ``y_cpu`` by the op with ``gpu_experts_mask``. When
        every expert is GPU-resident the op is not called.

        Args:
            hidden_states: ``[T, H]`` or ``[..., H]``; bf16, fp16 or fp32, on the
                CPU (or on CUDA through the op's CUDA-stream bridge, where the
                build has it).
            top_k_index: ``[T, K]`` (or ``[..., K]``) int32/int64 expert ids in
                ``[-1, E)``; ``-1`` skips a slot (experts served elsewhere).
            top_k_weights: routing weights of the shape of ``top_k_index``, fp32
                or any floating dtype (converted to fp32 unless it is the
                activation dtype).

        Returns:
            Tensor of the shape and dtype of ``hidden_states``.

        Raises:
            ValueError: the last dimension of ``hidden_states`` is not ``H``,
                or the GPU experts' weights are on another device than
                ``hidden_states``.
            RuntimeError: (from the op) a wrong dtype, device, an id outside
                ``[-1, E)``, or ``top_k_index``/``top_k_weights`` with a number
                of rows other than the number of tokens.
        """
        if not torch.compiler.is_compiling() and hidden_states.dim() == 2:
            # Eager decode: the layer parsed once (kt::moe_forward_prepared, while the
            # module still has the tensors it was made from, no LoRA and no GPU
            # experts) before any other Python: 7-10 us less of a cold call than after
            # the checks below. None wherever the path below must run (grad mode,
            # subclasses, other devices, errors: it raises them with its messages).
            prepared = self.__dict__.get("_prepared_layer")
            if prepared is not None and self._layer_unchanged(prepared[1]):
                out = prepared[0].forward(hidden_states, top_k_index, top_k_weights)
                if out is not None:
                    return out
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoEExperts: hidden_states has last dimension {hidden_states.shape[-1]}, "
                f"expected hidden_size={self.hidden_size}"
            )
        flat = hidden_states.dim() == 2  # [T, H] already: no reshape, no view back
        x = hidden_states if flat else hidden_states.reshape(-1, self.hidden_size)
        if top_k_index.dim() != 2 or top_k_weights.dim() != 2:
            top_k_index = top_k_index.reshape(-1, top_k_index.shape[-1])
            top_k_weights = top_k_weights.reshape(-1, top_k_weights.shape[-1])
        ids, weights = top_k_index, top_k_weights
        if weights.dtype != torch.float32 and weights.dtype != x.dtype:
            if not weights.is_floating_point():  # as the op: an error, not a cast
                raise RuntimeError(
                    f"MoEExperts: top_k_weights must be a floating tensor (fp32, bf16, fp16, or "
                    f"another floating dtype, converted to fp32), got {weights.dtype}"
                )
            weights = weights.float()
        if self._buffers["gpu_expert_ids"] is None:
            out = self._cpu_experts(x, ids, weights, None, prepared_tried=flat)
            return out if flat else out.view(hidden_states.shape)
        return self._hybrid_forward(x, ids, weights).view(hidden_states.shape)

    def _cpu_experts(
        self,
        x: Tensor,
        ids: Tensor,
        weights: Tensor,
        mask: Optional[Tensor],
        prepared_tried: bool = False,
    ):
        if mask is None and not torch.compiler.is_compiling():
            # Eager inference without LoRA (a decode step): the layer parsed once
            # (kt_ops.ops.PreparedLayer: kt::moe_forward_prepared) computes the op's
            # output on the routed tensors alone; None where only the op will do.
            # (forward already tried it on [T, H] hidden states: prepared_tried)
            prepared = self.__dict__.get("_prepared_layer")
            current = prepared is not None and self._layer_unchanged(prepared[1])
            if current and not prepared_tried:
                out = prepared[0].forward(x, ids, weights)
                if out is not None:
                    return out
            if not torch.is_grad_enabled() and self._no_lora():
                if not current:
                    self._prepare_layer()
                return torch.ops.kt.moe_forward.default(x, ids, weights, *self._plain_layer_args())
        return moe_forward(
            x,
            ids,
            weights,
            self.expert_weights(),
            self.lora_weights(),
            activation=self.activation,
            activation_checkpointing=self.activation_checkpointing,
            gpu_experts_mask=mask,
        )

    def _prepare_layer(self) -> None:
        """Make the prepared layer of the packed buffers (``_prepared_layer``: the
        :class:`kt_ops.ops.PreparedLayer` and what it was made from)."""
        made_from = tuple(self._buffers[n] for n in _PACKED_BUFFERS) + (self.activation,)
        # Inference only: without the backward panels (which it would keep alive).
        experts = dataclasses.replace(self.expert_weights(), backward_panels=None)
        layer = new_prepared_layer(experts, activation=self.activation)
        self.__dict__["_prepared_layer"] = None if layer is None else (layer, made_from)

    def _no_lora(self) -> bool:
        p = self._parameters
        return p["gate_lora_a"] is None and p["up_lora_a"] is None and p["down_lora_a"] is None

    def _layer_unchanged(self, made_from: tuple) -> bool:
        """Whether the module is still what its prepared layer was made from: the same
        packed tensors and activation, no LoRA, no GPU experts (about 0.4 us)."""
        b = self._buffers
        return (
            b["gate_weight"] is made_from[0]
            and b["gate_scales"] is made_from[1]
            and b["gate_zeros"] is made_from[2]
            and b["up_weight"] is made_from[3]
            and b["up_scales"] is made_from[4]
            and b["up_zeros"] is made_from[5]
            and b["down_weight"] is made_from[6]
            and b["down_scales"] is made_from[7]
            and b["down_zeros"] is made_from[8]
            and b["gate_bias"] is made_from[9]
            and b["up_bias"] is made_from[10]
            and b["down_bias"] is made_from[11]
            and self.__dict__["activation"] is made_from[12]
            and b["gpu_expert_ids"] is None
            and self._no_lora()
        )

    def __getstate__(self):
        # The per-call caches are rebuilt on use; the prepared layer cannot be pickled.
        state = self.__dict__.copy()
        for key in _CALL_CACHES:
            state.pop(key, None)
        return state

    @classmethod
    def from_packed(
        cls,
        gate: PackedProjection,
        up: PackedProjection,
        down: PackedProjection,
        *,
        activation_checkpointing: Optional[bool] = None,
        gpu_experts: GpuExperts = None,
        routing_counts: Optional[Tensor] = None,
        gpu_dtype: Optional[torch.dtype] = None,
        activation: str = DEFAULT_ACTIVATION,
    ) -> MoEExperts:
        """Build the module from three :class:`kt_ops.formats.PackedProjection`.

        ``gate``/``up`` hold ``[E, I, H]``, ``down`` ``[E, H, I]``, as produced by
        :func:`kt_ops.formats.quantize_weights`, the loaders or
        :func:`kt_ops.convert.load_converted`. Each projection keeps its own
        format and group size (GGUF Q4_K_M: ``q4_k`` gate/up, ``q6_k`` down);
        the module's ``weight_format`` is then ``'gate,up,down'``. Raises
        ``ValueError`` (from :class:`~kt_ops.layer.ExpertWeights`) when the
        shapes disagree or a tensor does not match its format's layout.

        ``gpu_experts`` / ``routing_counts`` / ``gpu_dtype``: GPU-resident
        experts as in :meth:`set_gpu_experts`, dequantized once from the packed
        projections (``gpu_dtype``, default fp32; ``.to()`` moves them later).
        ``activation``: the experts' ``act`` (:data:`kt_ops.ACTIVATIONS`).
        """
        try:
            experts = ExpertWeights(gate, up, down)
        except ValueError as err:
            raise ValueError(f"MoEExperts.from_packed: {err}") from None
        return cls(
            experts,
            activation_checkpointing=activation_checkpointing,
            gpu_experts=gpu_experts,
            routing_counts=routing_counts,
            gpu_dtype=gpu_dtype,
            activation=activation,
        )

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> MoEExperts:
        # Module.to/.half/.cuda/.float go through _apply. The packed weights are a
        # layout in host memory that the CPU kernels read, not values in the
        # model's dtype: casting would corrupt them, and a GPU copy would go unused
        # (the kernels run on the CPU and take CPU tensors only). So they are left
        # untouched. The GPU-resident experts' dense buffers (and their mask/ids) do
        # move and cast: they are ordinary weights in the model's dtype.
        packed = {name: self._buffers.pop(name) for name in _PACKED_BUFFERS}
        try:
            return super()._apply(fn, recurse)
        finally:
            self._buffers.update(packed)

    def extra_repr(self) -> str:
        text = (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, weight_format={self.weight_format!r}"
        )
        if self.activation != DEFAULT_ACTIVATION:
            text += f", activation={self.activation!r}"
        lora = [p for p in PROJECTIONS if getattr(self, f"{p}_lora_a") is not None]
        if lora:
            rank = getattr(self, f"{lora[0]}_lora_a").shape[1]
            text += f", lora={tuple(lora)}, lora_rank={rank}, lora_scaling={self.lora_scaling:g}"
        if self.num_gpu_experts:
            w = self.gpu_gate_weight
            text += (
                f", gpu_experts={self.num_gpu_experts} ({str(w.dtype).replace('torch.', '')}, "
                f"{w.device})"
            )
        return text


class _Expert:
    """Expert ``index`` of a :class:`MoEExpertList`, callable like the dense MLP it replaced."""

    def __init__(self, experts: MoEExpertList, index: int) -> None:
        self._experts = experts
        self.index = index

    def __call__(self, hidden_states: Tensor) -> Tensor:
        """Expert MLP of ``hidden_states [..., H]``; returns the same shape and dtype."""
        experts = self._experts
        x = hidden_states.reshape(-1, experts.hidden_size)
        ids = torch.full((x.shape[0], 1), self.index, dtype=torch.int32, device=x.device)
        weights = torch.ones((x.shape[0], 1), dtype=torch.float32, device=x.device)
        return experts(x, ids, weights).view(hidden_states.shape)

    forward = __call__

    def __repr__(self) -> str:
        return f"{type(self._experts).__name__}[{self.index}]"


class MoEExpertsWithIdentity(MoEExperts):
    """:class:`MoEExperts` plus ``num_identity`` zero-computation experts (LongCat-Flash).

    Ids ``E .. E + num_identity - 1`` are identity experts: a slot routed to one
    adds ``top_k_weight * x`` (``nn.Identity`` in transformers'
    ``LongcatFlashExperts``); ids of the ``E`` real experts run on kt_ops as in
    :class:`MoEExperts`, and ids beyond both still raise.
    """

    def __init__(self, experts: ExpertWeights, *, num_identity: int, **kwargs) -> None:
        if isinstance(num_identity, bool) or not isinstance(num_identity, int) or num_identity < 1:
            raise ValueError(
                f"MoEExpertsWithIdentity: num_identity must be an int >= 1, got {num_identity!r}"
            )
        super().__init__(experts, **kwargs)
        self.num_identity = num_identity

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """:meth:`MoEExperts.forward` with ids ``E .. E + num_identity - 1`` adding
        ``top_k_weight * x``: ``hidden_states [T, H]`` (or ``[..., H]``), ``top_k_index``
        and ``top_k_weights [T, K]`` -> the shape and dtype of ``hidden_states``.
        Raises as :meth:`MoEExperts.forward` (an id outside ``[-1, E + num_identity)``:
        RuntimeError naming ``topk_ids``)."""
        E = self.num_experts
        identity = (top_k_index >= E) & (top_k_index < E + self.num_identity)
        out = super().forward(hidden_states, top_k_index.masked_fill(identity, -1), top_k_weights)
        w = (top_k_weights * identity).sum(-1, keepdim=True)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        return out + (w.reshape(-1, 1) * x).reshape(out.shape).to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_identity={self.num_identity}"


class MoEExpertList(MoEExperts):
    """:class:`MoEExperts` that also behaves like the ``nn.ModuleList`` of expert MLPs it replaced.

    Code written for a list of experts keeps working: ``len(experts)`` is
    ``E``, and ``experts[i](x)`` (``i`` an int or a one-element integer tensor)
    runs expert ``i`` alone on ``x [..., H]``, returning ``[..., H]`` in the
    dtype of ``x``. That path calls the op once per expert, so it is slower
    than the fused call ``experts(hidden_states, top_k_index, top_k_weights)``.
    """

    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, index: int | Tensor) -> _Expert:
        i = operator.index(index)
        if not -self.num_experts <= i < self.num_experts:
            raise IndexError(f"expert index {i} is out of range for {self.num_experts} experts")
        return _Expert(self, i % self.num_experts)

    def __iter__(self):
        return (_Expert(self, i) for i in range(self.num_experts))
