"""The compute plan's operands and scratch are per call (csrc/kernels/plan.h).

What the plan makes from an expert's rows (its gathered bf16 rows, u8 tiles,
packed q8 rows, fp8's scaled rows and group results) stays in the call's
scratch, one slot per pool thread, keyed by (rows, expert) within the call and
emptied when the next call starts. The cases here route every token to one
expert and give down another family than gate/up (or one 128-row band, for
fp8's two slots), so a call ends with gate/up's operand in the scratch and the
next call asks for exactly its key (same expert, same row count, the same
scratch addresses): an operand kept across calls would be reused for other
hidden states. Each family that keeps something is forced in turn.
"""

from __future__ import annotations

import pytest
import torch
from reference import make_expert_weights, make_hidden, make_quant_experts

import kt_ops

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E, H, I, T = 2, 256, 128, 20  # noqa: E741  (I: one 128-row fp8 band)

#: (formats gate,up,down, compute path, quantized activations): the tile
#: families (bf16 rows, packed q8 rows, fp8's scaled rows and group results),
#: the streaming q8 kernel (u8 tiles on AVX512_VNNI) and the weight-only path.
CASES = [
    ("bf16", "brgemm", "auto"),
    ("bf16", "auto", "auto"),
    ("fp8,fp8,bf16", "brgemm", "auto"),
    ("fp8", "brgemm", "auto"),
    ("int8,int8,int4", "brgemm", "q8"),
    ("q8_0,q8_0,q4_0", "brgemm", "q8"),
    ("int8,int8,int4", "streaming", "q8"),
    ("q8_0,q8_0,q4_0", "streaming", "q8"),
    ("int4", "streaming", "fp32"),
]


def experts_for(fmt: str) -> kt_ops.ExpertWeights:
    if fmt == "bf16":
        return make_expert_weights(E, H, I, seed=3)
    return make_quant_experts(fmt, E, H, I, seed=3)


def one_expert_routing(num_tokens: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((num_tokens, 1), expert, dtype=torch.int64)
    return ids, torch.ones(num_tokens, 1)


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize(("fmt", "path", "quant"), CASES)
def test_call_does_not_reuse_previous_calls_operands(fmt, path, quant, threads):
    experts = experts_for(fmt)
    ids, w = one_expert_routing(T, 0)
    x1 = make_hidden(T, H, seed=1)
    x2 = make_hidden(T, H, seed=2)
    with (
        torch.no_grad(),
        kt_ops.config.override(compute_path=path, quant_activations=quant, num_threads=threads),
    ):
        # After a call on the other expert: no key of this routing in any slot.
        kt_ops.moe_forward(make_hidden(T, H, seed=3), *one_expert_routing(T, 1), experts)
        want = kt_ops.moe_forward(x2, ids, w, experts)
        kt_ops.moe_forward(x1, ids, w, experts)  # the same keys, other rows
        got = kt_ops.moe_forward(x2, ids, w, experts)
        # and the x1 result is x1's, not the x2 call's before it
        again = kt_ops.moe_forward(x1, ids, w, experts)
        kt_ops.moe_forward(make_hidden(T, H, seed=3), *one_expert_routing(T, 1), experts)
        fresh = kt_ops.moe_forward(x1, ids, w, experts)
    assert torch.equal(got, want)
    assert torch.equal(again, fresh)
    assert not torch.equal(got, again)
