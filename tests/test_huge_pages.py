"""Packed weights in transparent huge pages (kt_ops.formats.packed.empty_huge_pages).

``quantize_weights``, ``ExpertWeights.from_dense``, the loaders and the
converted-directory reader return their packed tensors in 2 MiB-aligned memory
advised ``MADV_HUGEPAGE`` (where the kernel's THP mode allows it and
``KT_OPS_HUGE_PAGES`` is not ``0``); the values and the op's results are the
same as in torch's memory. What the kernel backs the memory with is read from
``/proc/self/smaps``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kt_ops
from kt_ops.formats import PackedProjection, quantize_weights
from kt_ops.formats.packed import cat_experts, empty_huge_pages, huge_pages

HUGE = 2 << 20
THP_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ENABLED = huge_pages()["enabled"]
needs_thp = pytest.mark.skipif(not ENABLED, reason="kt_ops does not use huge pages here")


def anon_huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages (kB) of the mapping that holds ``t``'s first byte (/proc/self/smaps)."""
    addr = t.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not line.startswith(("AnonHugePages", "Anonymous")):
                lo, _, hi = head.partition("-")
                try:
                    inside = int(lo, 16) <= addr < int(hi, 16)
                except ValueError:
                    pass
                continue
            if inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def big_dense(experts: int = 16, n: int = 512, k: int = 1024) -> torch.Tensor:
    """[experts, n, k] weights: 4 MiB of int4 codes at the defaults."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(experts, n, k, generator=g) * 0.02


def test_report_names_the_kernels_mode():
    hp = huge_pages()
    assert set(hp) == {"thp_mode", "enabled", "page_bytes"}
    assert hp["page_bytes"] == HUGE
    if THP_FILE.exists():
        text = THP_FILE.read_text()
        assert f"[{hp['thp_mode']}]" in text
    else:
        assert hp["thp_mode"] == "unavailable"
    assert hp["enabled"] == (
        hp["thp_mode"] in ("always", "madvise")
        and os.environ.get("KT_OPS_HUGE_PAGES", "1") in ("", "1")
    )
    assert kt_ops.info()["huge_pages"] == hp


@pytest.mark.parametrize("shape,dtype", [((0,), torch.uint8), ((3, 5), torch.float32)])
def test_small_tensors_are_torch_empty(shape, dtype):
    t = empty_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()


def test_negative_size_is_refused():
    with pytest.raises(ValueError, match="negative size"):
        empty_huge_pages((4, -1), torch.float32)


@needs_thp
def test_large_tensor_is_aligned_and_backed_by_huge_pages():
    t = empty_huge_pages((3, HUGE // 2), torch.bfloat16)  # 3 huge pages
    assert t.shape == (3, HUGE // 2) and t.dtype == torch.bfloat16
    assert t.data_ptr() % HUGE == 0
    t.fill_(1.5)  # touched: the kernel faults the pages in
    assert anon_huge_kb(t) >= HUGE // 1024
    assert float(t.float().sum()) == 1.5 * t.numel()


@needs_thp
@pytest.mark.parametrize("fmt", ["bf16", "int4", "q4_k"])
def test_quantize_weights_returns_huge_page_tensors(fmt):
    p = quantize_weights(big_dense(), fmt)
    assert p.weight.nbytes >= HUGE
    assert p.weight.data_ptr() % HUGE == 0
    assert anon_huge_kb(p.weight) > 0
    p.validate()


@needs_thp
def test_from_dense_in_chunks_concatenates_into_huge_pages(monkeypatch):
    import kt_ops.layer as layer

    monkeypatch.setattr(layer, "_QUANTIZE_CHUNK_ELEMS", 512 * 1024)  # one expert per chunk
    d = big_dense(4)
    w = kt_ops.ExpertWeights.from_dense(d, d, d.transpose(1, 2).contiguous(), "int8")
    for p in w.projections:
        assert p.weight.data_ptr() % HUGE == 0
    whole = quantize_weights(d, "int8")
    assert torch.equal(w.gate.weight, whole.weight) and torch.equal(w.gate.scales, whole.scales)


def test_cat_experts_is_torch_cat():
    parts = [torch.randn(2, 300, 1000), torch.randn(3, 300, 1000)]
    out = cat_experts(parts)
    assert torch.equal(out, torch.cat(parts))
    one = cat_experts(parts[:1])
    assert torch.equal(one, parts[0]) and one.data_ptr() != parts[0].data_ptr()
    if ENABLED:
        assert out.data_ptr() % HUGE == 0 and one.data_ptr() % HUGE == 0
        assert cat_experts([out]) is out  # already on a huge-page boundary: not copied


def test_in_huge_pages_keeps_values_bias_and_results():
    p = quantize_weights(big_dense(), "int4")
    plain = PackedProjection(
        p.weight.clone(),
        p.scales.clone(),
        None,
        p.weight_format,
        p.group_size,
        p.n,
        p.k,
        bias=torch.randn(p.num_experts, p.n),
    )
    moved = plain.in_huge_pages()
    assert torch.equal(moved.weight, plain.weight) and torch.equal(moved.scales, plain.scales)
    assert moved.bias is plain.bias
    if ENABLED:
        assert moved.weight.data_ptr() % HUGE == 0
    d = big_dense(4, 512, 512)
    huge = kt_ops.ExpertWeights.from_dense(d, d, d, "q4_k")
    small = kt_ops.ExpertWeights(
        *(
            PackedProjection(
                q.weight.clone(), q.scales.clone(), None, q.weight_format, q.group_size, q.n, q.k
            )
            for q in huge.projections
        )
    )
    x = torch.randn(5, 512)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]])
    tw = torch.rand(5, 2)
    assert torch.equal(kt_ops.moe_forward(x, ids, tw, huge), kt_ops.moe_forward(x, ids, tw, small))


def _mapped(ptr: int) -> bool:
    """Whether a mapping of this process holds address ``ptr`` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, _, hi = line.split(" ", 1)[0].partition("-")
            if int(lo, 16) <= ptr < int(hi, 16):
                return True
    return False


def test_huge_page_tensors_pickle_and_free():
    p = quantize_weights(big_dense(), "int8")
    back = pickle.loads(pickle.dumps(p))
    assert torch.equal(back.weight, p.weight) and torch.equal(back.scales, p.scales)
    if not ENABLED:
        return
    # The tensor owns a mapping of its own, unmapped with it (the kernel may merge
    # it with a neighbour in /proc/self/maps, so only the address is checked).
    ptr = p.weight.data_ptr()
    assert ptr % HUGE == 0 and _mapped(ptr)
    del p, back
    assert not _mapped(ptr)


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "THP_MEM_ALLOC_ENABLE": "0", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


PROBE = """
import torch, kt_ops
from kt_ops.formats import quantize_weights
from kt_ops.formats.packed import huge_pages
p = quantize_weights(torch.randn(4, 512, 1024) * 0.02, "bf16")
print(huge_pages()["enabled"], p.weight.data_ptr() % (2 << 20) == 0)
"""


def test_env_zero_turns_it_off():
    r = _run(PROBE, {"KT_OPS_HUGE_PAGES": "0"})
    assert r.returncode == 0, r.stderr
    enabled, aligned = r.stdout.split()
    assert enabled == "False" and aligned == "False"


def test_malformed_env_is_an_error_naming_it():
    r = _run(PROBE, {"KT_OPS_HUGE_PAGES": "yes"})
    assert r.returncode != 0
    assert "KT_OPS_HUGE_PAGES='yes' must be 1" in r.stderr
