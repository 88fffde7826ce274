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
``inference_mode``: nothing is saved for backward then.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor, nn

from kt_ops.ops import join_weight_format, moe_forward, pack_weights, split_weight_format

if TYPE_CHECKING:
    from kt_ops.formats import PackedProjection

__all__ = ["MoEExperts", "MoEExpertList"]

_PACKED = ("gate_weight", "up_weight", "down_weight")
#: Quantization data of the packed projections (None buffers for formats without them).
_QUANT = ("gate_scales", "up_scales", "down_scales", "gate_zeros", "up_zeros", "down_zeros")
_PROJECTIONS = ("gate", "up", "down")


def _packed_shape(num_experts: int, n: int, k: int, weight_format: str) -> tuple[int, ...]:
    """Shape of one projection ``[num_experts, n, k]`` packed in ``weight_format`` (one name)."""
    if weight_format != "bf16":
        from kt_ops.formats import format_spec

        return tuple(format_spec(weight_format).weight_shape(num_experts, n, k))
    # bf16: pack_weights on the meta device.
    return tuple(pack_weights(torch.empty(num_experts, n, k, device="meta"), weight_format).shape)


#: Elements of dense weights packed per step by ``from_dense`` (a few experts of a large model).
_PACK_CHUNK_ELEMS = 1 << 24


def _pack_in_chunks(weight: Tensor, weight_format: str) -> Tensor:
    """``pack_weights(weight)`` for a CPU result, a few experts at a time.

    Packing is independent per expert, so slices of experts are packed into
    one preallocated tensor: the temporaries stay small (tens of MB instead of
    several copies of a whole layer) and are recycled between chunks.
    """
    E, N, K = weight.shape
    step = max(1, _PACK_CHUNK_ELEMS // max(1, N * K))
    if step >= E:
        return pack_weights(weight.cpu(), weight_format)
    first = pack_weights(weight[:step].cpu(), weight_format)
    out = torch.empty((E, *first.shape[1:]), dtype=first.dtype)
    out[:step].copy_(first)
    del first
    for e in range(step, E, step):
        out[e : e + step].copy_(pack_weights(weight[e : e + step].cpu(), weight_format))
    return out


def _quantize_in_chunks(
    weight: Tensor, weight_format: str, group_size: Optional[int], symmetric: bool
) -> PackedProjection:
    """``quantize_weights(weight)`` a few experts at a time (bounded fp32 temporaries)."""
    from kt_ops.formats import PackedProjection, quantize_weights

    E, N, K = weight.shape
    step = max(1, _PACK_CHUNK_ELEMS // max(1, N * K))
    parts = [
        quantize_weights(weight[e : e + step].cpu(), weight_format, group_size, symmetric)
        for e in range(0, E, step)
    ]
    if len(parts) == 1:
        return parts[0]

    def cat(name: str) -> Optional[Tensor]:
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.cat(ts)

    first = parts[0]
    return PackedProjection(
        cat("weight"), cat("scales"), cat("zeros"), first.weight_format, first.group_size, N, K
    )


class MoEExperts(nn.Module):
    """The routed experts of one MoE layer, computed on the CPU by ``kt.moe_forward``.

    Every expert ``e`` is a SwiGLU MLP (Mixtral, Qwen-MoE, OLMoE, DeepSeek)::

        expert_e(x) = W_down[e] @ (silu(W_gate[e] @ x) * (W_up[e] @ x))
        out[t]      = sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(x[t])

    Build it from dense weights with :meth:`from_dense`, or pass tensors that
    :func:`kt_ops.pack_weights` produced. The packed weights are the buffers
    ``gate_weight``, ``up_weight`` (packed ``[E, I, H]``) and ``down_weight``
    (packed ``[E, H, I]``); they are part of ``state_dict``.

    The packed weights are a storage format of host memory, not values in the
    model's dtype: ``module.to(dtype)``, ``.half()``, ``.cuda()`` leave them as
    they are (bf16, on the CPU), so a model holding this module can be cast or
    moved without touching its experts. The compute dtype follows the input.

    Training: gradients flow to ``hidden_states`` and ``top_k_weights``; the
    packed weights are frozen. :meth:`add_lora` adds trainable LoRA adapters
    (parameters ``gate_lora_a`` ... ``down_lora_b``). What forward saves for
    backward follows ``activation_checkpointing`` (see
    :func:`kt_ops.set_lora_activation_checkpointing`).

    Args:
        gate_weight: packed gate projections of ``[E, I, H]`` weights.
        up_weight: packed up projections of ``[E, I, H]`` weights.
        down_weight: packed down projections of ``[E, H, I]`` weights.
        hidden_size: ``H``.
        intermediate_size: ``I``, the expert MLP width.
        weight_format: format the tensors were packed in (``'bf16'``, a
            quantized format, or ``'gate,up,down'`` per-projection formats;
            see :func:`kt_ops.ops.split_weight_format`).
        activation_checkpointing: ``True`` recomputes the gate/up
            pre-activations in backward, ``False`` saves them (``2*K*I*4``
            bytes per token), ``None`` (default) is the op's default (with
            LoRA: :func:`kt_ops.set_lora_activation_checkpointing`; without:
            recompute). An attribute: it can be changed later.

    Raises:
        ValueError: a packed tensor does not have the shape that
            ``pack_weights`` gives for ``[E, I, H]`` / ``[E, H, I]`` in
            ``weight_format``, the format is unknown, or a size is not positive.
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    weight_format: str
    lora_scaling: float
    activation_checkpointing: Optional[bool]

    def __init__(
        self,
        gate_weight: Tensor,
        up_weight: Tensor,
        down_weight: Tensor,
        *,
        hidden_size: int,
        intermediate_size: int,
        weight_format: str = "bf16",
        activation_checkpointing: Optional[bool] = None,
        scales: Optional[tuple[Tensor, Tensor, Tensor]] = None,
        zeros: Optional[tuple[Tensor, Tensor, Tensor]] = None,
        group_size: int = 0,
    ) -> None:
        super().__init__()
        if hidden_size <= 0 or intermediate_size <= 0:
            raise ValueError(
                f"MoEExperts: hidden_size and intermediate_size must be positive, got "
                f"{hidden_size} and {intermediate_size}"
            )
        num_experts = int(gate_weight.shape[0]) if gate_weight.dim() > 0 else 0
        H, inter = int(hidden_size), int(intermediate_size)
        gate_fmt, up_fmt, down_fmt = split_weight_format(weight_format)
        expected = {
            "gate_weight": _packed_shape(num_experts, inter, H, gate_fmt),
            "up_weight": _packed_shape(num_experts, inter, H, up_fmt),
            "down_weight": _packed_shape(num_experts, H, inter, down_fmt),
        }
        for name, t in zip(_PACKED, (gate_weight, up_weight, down_weight)):
            if tuple(t.shape) != expected[name]:
                raise ValueError(
                    f"MoEExperts: {name} has shape {tuple(t.shape)}, expected {expected[name]} "
                    f"(pack_weights of [E={num_experts}, "
                    f"{'H, I' if name == 'down_weight' else 'I, H'}] with H={H}, I={inter}, "
                    f"weight_format={weight_format!r})"
                )
            self.register_buffer(name, t.contiguous())
        self.num_experts = num_experts
        self.hidden_size = H
        self.intermediate_size = inter
        self.weight_format = weight_format
        self.group_size = int(group_size)
        for names, tensors in ((_QUANT[:3], scales), (_QUANT[3:], zeros)):
            for name, t in zip(names, tensors if tensors is not None else (None,) * 3):
                self.register_buffer(name, None if t is None else t.contiguous())
        self.lora_scaling = 1.0
        self.activation_checkpointing = activation_checkpointing
        for proj in _PROJECTIONS:
            self.register_parameter(f"{proj}_lora_a", None)
            self.register_parameter(f"{proj}_lora_b", None)

    def add_lora(
        self,
        rank: int,
        alpha: Optional[float] = None,
        projections: Sequence[str] = _PROJECTIONS,
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
            ValueError: a rank below 1, an unknown projection or dtype, or
                projections that already have LoRA.
        """
        if int(rank) < 1:
            raise ValueError(f"MoEExperts.add_lora: rank must be >= 1, got {rank}")
        unknown = [p for p in projections if p not in _PROJECTIONS]
        if unknown or not projections:
            raise ValueError(
                f"MoEExperts.add_lora: projections must be a non-empty subset of "
                f"{_PROJECTIONS}, got {tuple(projections)}"
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
        names = (f"{p}_lora_{f}" for p in _PROJECTIONS for f in ("a", "b"))
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

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
    ) -> MoEExperts:
        """Pack (and quantize) dense expert weights (``nn.Linear`` convention: ``[E, out, in]``).

        Args:
            gate: ``[E, I, H]`` gate projections, any floating dtype, any device
                (copied to the CPU).
            up: ``[E, I, H]`` up projections.
            down: ``[E, H, I]`` down projections.
            weight_format: target format, one of :data:`kt_ops.formats.FORMATS`
                (``'bf16'``: rounded to nearest even; the others are quantized
                online by :func:`kt_ops.formats.quantize_weights`, a few
                experts at a time so the fp32 temporaries stay small), or
                per-projection formats ``'gate,up,down'`` (``'q4_k,q4_k,q6_k'``
                for a Q4_K_M-like mix; ``group_size`` then applies to ``int4``).
            activation_checkpointing: as in the constructor.
            group_size: group along K for the grouped formats (``None``: the
                format's default; see docs/formats.md).
            symmetric: ``int4`` only: ``False`` stores zero points.

        Returns:
            A new module on the CPU; the dense tensors are not referenced.

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
        names = split_weight_format(weight_format)
        if names[0] != "bf16":
            from kt_ops.formats import format_spec

            mixed = len(set(names)) > 1

            def group_for(fmt: str) -> Optional[int]:
                # Mixed: formats with a single group size (GGUF types) keep their own.
                return None if mixed and len(format_spec(fmt).group_sizes) == 1 else group_size

            projections = [
                _quantize_in_chunks(w.detach(), fmt, group_for(fmt), symmetric)
                for fmt, w in zip(names, (gate, up, down))
            ]
            module = cls.from_packed(*projections)
            module.activation_checkpointing = activation_checkpointing
            return module
        packed = [_pack_in_chunks(w.detach(), "bf16") for w in (gate, up, down)]
        return cls(
            *packed,
            hidden_size=H,
            intermediate_size=inter,
            weight_format=weight_format,
            activation_checkpointing=activation_checkpointing,
        )

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Weighted sum of the selected experts' outputs, per token.

        Args:
            hidden_states: ``[T, H]`` or ``[..., H]``; bf16, fp16 or fp32, on the CPU.
            top_k_index: ``[T, K]`` (or ``[..., K]``) int32/int64 expert ids in
                ``[-1, E)``; ``-1`` skips a slot (experts served elsewhere).
            top_k_weights: routing weights of the shape of ``top_k_index``, fp32
                or any floating dtype (converted to fp32 unless it is the
                activation dtype).

        Returns:
            Tensor of the shape and dtype of ``hidden_states``.

        Raises:
            ValueError: the last dimension of ``hidden_states`` is not ``H``.
            RuntimeError: (from the op) a wrong dtype, device, an id outside
                ``[-1, E)``, or ``top_k_index``/``top_k_weights`` with a number
                of rows other than the number of tokens.
        """
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoEExperts: hidden_states has last dimension {hidden_states.shape[-1]}, "
                f"expected hidden_size={self.hidden_size}"
            )
        x = hidden_states.reshape(-1, self.hidden_size)
        ids = top_k_index.reshape(-1, top_k_index.shape[-1])
        weights = top_k_weights.reshape(-1, top_k_weights.shape[-1])
        if weights.dtype != torch.float32 and weights.dtype != x.dtype:
            weights = weights.float()
        out = moe_forward(
            x,
            ids,
            weights,
            self.gate_weight,
            self.up_weight,
            self.down_weight,
            self.intermediate_size,
            self.weight_format,
            **self._format_op_kwargs(),
            **self.lora_parameters(),
            lora_scaling=self.lora_scaling,
            activation_checkpointing=self.activation_checkpointing,
        )
        return out.view(hidden_states.shape)

    def _format_op_kwargs(self) -> dict:
        """The quantization arguments of ``moe_forward`` (empty for bf16)."""
        if self.weight_format == "bf16":
            return {}
        kwargs = {name: self._buffers.get(name) for name in _QUANT}
        kwargs["group_size"] = self.group_size
        return kwargs

    @classmethod
    def from_packed(cls, gate: PackedProjection, up: PackedProjection, down: PackedProjection):
        """Build the module from three :class:`kt_ops.formats.PackedProjection`.

        ``gate``/``up`` hold ``[E, I, H]``, ``down`` ``[E, H, I]``, as produced by
        :func:`kt_ops.formats.quantize_weights`, the loaders or
        :func:`kt_ops.convert.load_converted`. The projections may be in
        different quantized formats (GGUF Q4_K_M: ``q4_k`` gate/up, ``q6_k``
        down); the module's ``weight_format`` is then ``'gate,up,down'``.
        Raises ``ValueError`` when the shapes disagree, bf16 is mixed with
        quantized formats, or two projections in formats with a choice of
        group size (``int4``) use different group sizes.
        """
        projs = (gate, up, down)
        fmt = join_weight_format(*(p.weight_format for p in projs))
        try:
            split_weight_format(fmt)
        except ValueError as err:
            raise ValueError(f"MoEExperts.from_packed: {err}") from None
        # One op-level group_size: formats with a single group size (GGUF types,
        # int8, fp8) keep theirs when mixed; the others must agree.
        from kt_ops.formats import format_spec

        free = {
            p.group_size
            for p in projs
            if p.weight_format != "bf16" and len(format_spec(p.weight_format).group_sizes) > 1
        }
        single_format = len({p.weight_format for p in projs}) == 1
        groups = {p.group_size for p in projs}
        if (single_format and len(groups) != 1) or len(free) > 1:
            raise ValueError(
                "MoEExperts.from_packed: gate/up/down must share one group size, got "
                f"{[(p.weight_format, p.group_size) for p in projs]}"
            )
        if (up.n, up.k) != (gate.n, gate.k) or (down.n, down.k) != (gate.k, gate.n):
            raise ValueError(
                "MoEExperts.from_packed: expected gate and up [E, I, H] and down [E, H, I]; got "
                f"gate [{gate.n}, {gate.k}], up [{up.n}, {up.k}], down [{down.n}, {down.k}]"
            )
        zeros = tuple(p.zeros for p in projs)
        return cls(
            gate.weight,
            up.weight,
            down.weight,
            hidden_size=gate.k,
            intermediate_size=gate.n,
            weight_format=fmt,
            scales=None if fmt == "bf16" else tuple(p.scales for p in projs),
            zeros=None if all(z is None for z in zeros) else zeros,
            group_size=free.pop() if free else gate.group_size,
        )

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> MoEExperts:
        # Module.to/.half/.cuda/.float go through _apply. The packed weights are a
        # layout in host memory that the CPU kernels read, not values in the
        # model's dtype: casting would corrupt them, and a GPU copy would go unused
        # (the op runs on CPU tensors only; CUDA hidden states raise a clear error
        # naming the argument, there is no host round trip). So they are left untouched.
        packed = {name: self._buffers.pop(name) for name in _PACKED + _QUANT}
        try:
            return super()._apply(fn, recurse)
        finally:
            self._buffers.update(packed)

    def extra_repr(self) -> str:
        text = (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, weight_format={self.weight_format!r}"
        )
        lora = [p for p in _PROJECTIONS if getattr(self, f"{p}_lora_a") is not None]
        if lora:
            rank = getattr(self, f"{lora[0]}_lora_a").shape[1]
            text += f", lora={tuple(lora)}, lora_rank={rank}, lora_scaling={self.lora_scaling:g}"
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
        ids = torch.full((x.shape[0], 1), self.index, dtype=torch.int32)
        weights = torch.ones((x.shape[0], 1), dtype=torch.float32)
        return experts(x, ids, weights).view(hidden_states.shape)

    forward = __call__

    def __repr__(self) -> str:
        return f"{type(self._experts).__name__}[{self.index}]"


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
