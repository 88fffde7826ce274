"""NUMA placement (README, "NUMA"): kt_ops.set_numa / KT_OPS_NUMA, the split of
every expert across the nodes, the per-node threads, the binding of the pages.

This machine has one NUMA node. Several-node behaviour is tested in fresh
interpreters on synthetic hwloc topologies (``KT_OPS_HWLOC_SYNTHETIC``, read
once per process) of 2 and 4 nodes: the partition (slices cover each
projection's rows once, on 16-row block boundaries), the per-node thread
mapping, and the results, which must be bit-identical to this process's
one-node results for every format family, T = 0/1/odd, 1/2/3 threads, both
compute paths and both quantized-activation paths, LoRA forward and backward.

Where the pages went: hwloc binds nothing on a synthetic topology (its binding
calls succeed without effect and the location query knows nothing), so there
the tests check what the binding requested (each part's nodeset) and that the
report says nothing was bound. The real binding runs on this machine with
``set_numa('on')`` (one part, bound to node 0), checked with
``hwloc_get_area_memlocation`` and ``hwloc_get_area_membind``.
"""

from __future__ import annotations

import json

import pytest
import torch
from reference import make_expert_weights, make_hidden, make_quant_experts, make_routing

import kt_ops
from kt_ops.layer import LoRAWeights

# (format, H, I): several 16-row blocks, block counts that 2 and 4 nodes do not
# divide evenly (I = 88: 6 blocks; H = 72: 5 blocks), a layer with fewer I
# blocks than nodes (I = 24: 2 blocks), K a multiple of the group size for the
# grouped formats and of 256 for the k-quants, odd K where the format allows it.
CASES = [
    ("bf16", 72, 88),
    ("bf16", 40, 24),
    ("int8", 50, 40),
    ("int4", 96, 96),  # group 32, asymmetric: zero points too
    ("fp8", 200, 136),
    ("mxfp4", 96, 64),
    ("q8_0", 96, 64),
    ("q4_k", 256, 256),
    ("q4_k,q4_k,q6_k", 256, 256),
]
TOKENS = (0, 1, 7, 33)
E, TOP_K = 6, 2


def _layer(fmt: str, H: int, inter: int) -> kt_ops.ExpertWeights:
    if fmt == "int4":
        return make_quant_experts("int4", E, H, inter, group_size=32, symmetric=False, seed=3)
    return make_expert_weights(E, H, inter, seed=3, weight_format=fmt)


def _modes(fmt: str):
    """(compute path, quant activations, activation dtype) combinations for a format."""
    if fmt == "bf16":
        return [
            ("streaming", "auto", torch.float32),
            ("brgemm", "auto", torch.bfloat16),  # streams where oneDNN's brgemm does not run
        ]
    # and the tile kernels where the format has them (int8's w8a8 / u8s8, fp8's bf16 tiles;
    # formats without one stream there too)
    return [
        ("streaming", "q8", torch.float32),
        ("streaming", "fp32", torch.bfloat16),
        ("brgemm", "auto", torch.bfloat16),
    ]


def compute_all() -> dict[str, torch.Tensor]:
    """Every case's output under the current settings (threads, NUMA mode, topology)."""
    outs: dict[str, torch.Tensor] = {}
    for fmt, H, inter in CASES:
        experts = _layer(fmt, H, inter)
        for path, quant, dtype in _modes(fmt):
            with kt_ops.use_compute_path(path), kt_ops.use_quant_activations(quant):
                for T in TOKENS:
                    ids, w = make_routing(T, E, TOP_K, seed=T, skip_fraction=0.2)
                    x = make_hidden(T, H, dtype, seed=T)
                    key = f"{fmt}/{H}x{inter}/{path}/{quant}/{dtype}/T{T}"
                    outs[key] = kt_ops.moe_forward(x, ids, w, experts)
        # The experts served elsewhere (gpu_experts_mask) are skipped on every node.
        mask = torch.zeros(E, dtype=torch.bool)
        mask[1] = mask[4] = True
        ids, w = make_routing(7, E, TOP_K, seed=9)
        x = make_hidden(7, H, torch.float32, seed=9)
        outs[f"{fmt}/{H}x{inter}/mask"] = kt_ops.moe_forward(
            x, ids, w, experts, gpu_experts_mask=mask
        )
    return outs


def compute_lora() -> dict[str, torch.Tensor]:
    """LoRA forward and backward (the exact path), and LoRA inference on the split driver."""
    outs: dict[str, torch.Tensor] = {}
    for fmt, H, inter in (("bf16", 72, 88), ("int4", 96, 96)):
        experts = _layer(fmt, H, inter)
        g = torch.Generator().manual_seed(5)
        r = 4

        def factor(*shape, g=g):
            return (torch.randn(*shape, generator=g) * 0.1).requires_grad_()

        lora = LoRAWeights(
            gate=(factor(E, r, H), factor(E, inter, r)),
            down=(factor(E, r, inter), factor(E, H, r)),
            scaling=2.0,
        )
        ids, w = make_routing(7, E, TOP_K, seed=2)
        w = w.clone().requires_grad_()
        x = make_hidden(7, H, torch.float32, seed=2).requires_grad_()
        # No gradient under quant_activations='q8': the inference driver (split by node,
        # LoRA terms in its epilogues; the down term's h Ad^T between the two phases).
        with torch.no_grad(), kt_ops.use_quant_activations("q8"):
            outs[f"{fmt}/lora/q8"] = kt_ops.moe_forward(x, ids, w, experts, lora)
        out = kt_ops.moe_forward(x, ids, w, experts, lora)
        out.square().sum().backward()
        outs[f"{fmt}/lora/out"] = out.detach()
        outs[f"{fmt}/lora/dx"] = x.grad
        outs[f"{fmt}/lora/dw"] = w.grad
        for name in ("gate", "down"):
            a, b = getattr(lora, name)
            outs[f"{fmt}/lora/d{name}_a"] = a.grad
            outs[f"{fmt}/lora/d{name}_b"] = b.grad
    return outs


def placements() -> dict[str, dict]:
    return {
        f"{fmt}/{H}x{inter}": kt_ops.numa_placement(_layer(fmt, H, inter))
        for fmt, H, inter in CASES
    }


_SCRIPT = r"""
import json, torch, kt_ops
from test_numa import compute_all, compute_lora, placements
result = {"numa": kt_ops.info()["numa"], "placements": placements(), "threads": {}}
outs = {}
for n in THREADS:
    kt_ops.set_num_threads(n)
    result["threads"][n] = kt_ops.info()["numa"]["threads_per_node"]
    for key, out in compute_all().items():
        outs[f"t{n}/{key}"] = out
    if n == THREADS[0]:
        outs.update(compute_lora())
from kt_ops.info import format_info
result["lines"] = format_info(kt_ops.info())
torch.save(outs, OUT_PATH)
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def one_node_outputs() -> dict[str, torch.Tensor]:
    """This process's results: one NUMA node, placement off (auto)."""
    with kt_ops.use_numa("off"):
        outs = compute_all()
        outs.update(compute_lora())
    return outs


def _run(python_subprocess, tmp_path, synthetic: str, threads, env=None):
    out_path = tmp_path / "numa_outputs.pt"
    code = _SCRIPT.replace("OUT_PATH", repr(str(out_path))).replace("THREADS", repr(tuple(threads)))
    full_env = {"KT_OPS_HWLOC_SYNTHETIC": synthetic, **(env or {})}
    proc = python_subprocess(code, env=full_env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result, torch.load(out_path)


def _assert_bit_identical(theirs: dict, ours: dict, threads) -> None:
    for n in threads:
        for key, want in ours.items():
            got = theirs.get(f"t{n}/{key}", theirs.get(key))
            assert got is not None, key
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(got, want), f"{key} with {n} threads differs from one node"


def _assert_partition(placement: dict, nodes: list[int], H: int, inter: int) -> None:
    assert placement["active"] is True and placement["parts"] == len(nodes)
    for proj, rows in (("gate", inter), ("up", inter), ("down", H)):
        parts = placement[proj]
        assert [p["node"] for p in parts] == nodes
        # Contiguous, in node order, covering [0, rows) exactly once, on 16-row blocks.
        assert parts[0]["rows"][0] == 0 and parts[-1]["rows"][1] == rows
        for a, b in zip(parts, parts[1:]):
            assert a["rows"][1] == b["rows"][0]
        blocks = [-(-(p["rows"][1] - p["rows"][0]) // 16) for p in parts]
        assert sum(blocks) == -(-rows // 16)
        for p in parts[:-1]:
            assert p["rows"][1] % 16 == 0 or p["rows"][1] == rows
        assert max(blocks) - min(blocks) <= 1  # even: sizes differ by one block at most
        for p in parts:
            # A synthetic topology: the binding requested the node's nodeset
            # (its OS index), and nothing was bound or can be located.
            assert p["nodeset"] == [p["node"]]
            assert p["bound"] is False and p["location"] is None and p["bound_to"] is None


# --------------------------------------------------------------------------
# Several nodes (synthetic topologies)
# --------------------------------------------------------------------------


def test_two_nodes_bit_identical(python_subprocess, tmp_path, one_node_outputs):
    threads = (1, 2, 3, 4)
    result, theirs = _run(python_subprocess, tmp_path, "node:2 core:2 pu:1", threads)
    numa = result["numa"]
    assert numa["mode"] == "auto" and numa["active"] is True
    assert numa["nodes"] == [0, 1] and numa["memory_binding"] is False
    assert numa["threads_per_node"] == [2, 2]  # the default pool: one thread per core
    # Threads spread round robin over the nodes: thread i computes for node i % 2.
    assert result["threads"] == {"1": [1, 0], "2": [1, 1], "3": [2, 1], "4": [2, 2]}
    for name, placement in result["placements"].items():
        H, inter = (int(v) for v in name.split("/")[1].split("x"))
        _assert_partition(placement, [0, 1], H, inter)
    assert (
        "NUMA placement : on (mode auto); node 0: 2 thread(s), node 1: 2 thread(s)"
        in (result["lines"])
    )
    _assert_bit_identical(theirs, one_node_outputs, threads)


def test_four_nodes_bit_identical(python_subprocess, tmp_path, one_node_outputs):
    threads = (1, 2, 3)  # 3 threads: node 3 has none, the others take its blocks
    result, theirs = _run(python_subprocess, tmp_path, "node:4 core:1 pu:1", threads)
    numa = result["numa"]
    assert numa["active"] is True and numa["nodes"] == [0, 1, 2, 3]
    assert result["threads"] == {"1": [1, 0, 0, 0], "2": [1, 1, 0, 0], "3": [1, 1, 1, 0]}
    for name, placement in result["placements"].items():
        H, inter = (int(v) for v in name.split("/")[1].split("x"))
        _assert_partition(placement, [0, 1, 2, 3], H, inter)
    # I = 24 is 2 blocks: two of the four nodes hold no gate/up rows.
    small = result["placements"]["bf16/40x24"]["gate"]
    assert [p["rows"] for p in small] == [[0, 16], [16, 24], [24, 24], [24, 24]]
    _assert_bit_identical(theirs, one_node_outputs, threads)


def test_two_nodes_odd_cores_and_smt(python_subprocess, tmp_path, one_node_outputs):
    # 3 cores of 2 PUs per node: 5 threads put 3 on node 0, 2 on node 1.
    result, theirs = _run(python_subprocess, tmp_path, "node:2 core:3 pu:2", (5,))
    assert result["threads"] == {"5": [3, 2]}
    _assert_bit_identical(theirs, one_node_outputs, (5,))


def test_numa_off_on_several_nodes(python_subprocess, tmp_path, one_node_outputs):
    result, theirs = _run(
        python_subprocess, tmp_path, "node:2 core:2 pu:1", (3,), env={"KT_OPS_NUMA": "off"}
    )
    numa = result["numa"]
    assert numa["mode"] == "off" and numa["active"] is False
    assert numa["nodes"] == [0] and result["threads"] == {"3": [3]}
    for placement in result["placements"].values():
        assert placement["active"] is False and placement["parts"] == 1
    assert "NUMA placement : off (mode off; one part per expert)" in result["lines"]
    _assert_bit_identical(theirs, one_node_outputs, (3,))


_SWITCH_SCRIPT = r"""
import json, kt_ops
from test_numa import _layer
report = []
experts = _layer("int4", 96, 96)
for mode in ("off", "on", "auto", "off"):
    kt_ops.set_numa(mode)
    numa = kt_ops.info()["numa"]
    report.append([mode, numa["active"], numa["threads_per_node"],
                   kt_ops.numa_placement(experts)["parts"]])
print(json.dumps(report))
"""


def test_set_numa_switches_threads_and_split(python_subprocess):
    proc = python_subprocess(_SWITCH_SCRIPT, env={"KT_OPS_HWLOC_SYNTHETIC": "node:2 core:2 pu:1"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == [
        ["off", False, [4], 1],
        ["on", True, [2, 2], 2],
        ["auto", True, [2, 2], 2],
        ["off", False, [4], 1],
    ]


def test_bad_env_mode_is_reported(python_subprocess):
    code = "import kt_ops\ntry:\n    kt_ops.get_numa()\nexcept ValueError as e:\n    print(e)\n"
    proc = python_subprocess(code, env={"KT_OPS_NUMA": "yes"})
    assert proc.returncode == 0, proc.stderr
    assert "KT_OPS_NUMA" in proc.stdout and "'auto', 'on' or 'off'" in proc.stdout


# --------------------------------------------------------------------------
# This process (one node)
# --------------------------------------------------------------------------


def test_set_numa_validates_and_restores():
    before = kt_ops.get_numa()
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        kt_ops.set_numa("2")
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        kt_ops.set_numa(None)  # type: ignore[arg-type]
    with kt_ops.use_numa("on"):
        assert kt_ops.get_numa() == "on"
        assert kt_ops.info()["numa"]["active"] is True
    assert kt_ops.get_numa() == before


def test_info_reports_numa():
    numa = kt_ops.info()["numa"]
    assert set(numa) == {
        "mode",
        "active",
        "nodes",
        "threads_per_node",
        "memory_binding",
        "placed",
        "slices",
    }
    assert sum(numa["threads_per_node"]) == kt_ops.get_num_threads()
    from kt_ops.info import format_info

    assert "NUMA placement : " in format_info(kt_ops.info())


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("blocks", [0, 1, 2, 5, 6, 48, 128])
def test_split_blocks_partition(blocks, parts):
    bounds = kt_ops._C._testing.split_blocks(blocks, parts)
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == blocks
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert all(s >= 0 for s in sizes) and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first parts take the extra block


@pytest.mark.parametrize("fmt,H,inter", [c for c in CASES if c[0] in ("bf16", "int8", "q4_k")])
def test_one_node_on_is_bit_identical(fmt, H, inter):
    # 'on' with one node binds the weights to node 0 and keeps the one-part
    # schedule: results as with 'off', bit for bit.
    experts = _layer(fmt, H, inter)
    ids, w = make_routing(7, E, TOP_K, seed=1)
    x = make_hidden(7, H, torch.float32, seed=1)
    with kt_ops.use_numa("off"):
        want = kt_ops.moe_forward(x, ids, w, experts)
    with kt_ops.use_numa("on"):
        got = kt_ops.moe_forward(x, ids, w, experts)
    assert torch.equal(got, want)


def _big_layer() -> kt_ops.ExpertWeights:
    # Large enough that every expert's rows span whole pages (64 KiB bf16 blocks).
    return make_expert_weights(4, 2048, 64, seed=0)


def test_one_node_binding_and_location():
    if kt_ops.info()["topology"]["num_numa_nodes"] != 1:
        pytest.skip("checks the binding of the one-node case")
    experts = _big_layer()
    with kt_ops.use_numa("on"):
        placement = kt_ops.numa_placement(experts)
    if not placement["memory_binding"]:
        pytest.skip("hwloc cannot bind memory here (no NUMA memory policy)")
    assert placement["parts"] == 1
    for proj in ("gate", "up", "down"):
        (part,) = placement[proj]
        assert part["node"] == 0 and len(part["nodeset"]) == 1
        assert part["bound"] is True
        assert part["location"] == [0]  # hwloc_get_area_memlocation: the pages are on node 0
        assert part["bound_to"] == [0]  # hwloc_get_area_membind: policy BIND to node 0
    assert kt_ops.runtime.memory_nodes(experts.down.weight) == [0]
    assert kt_ops._C.bound_nodes(experts.down.weight) == [0]
    # Writing into the tensor (load_state_dict's copy_) keeps the binding.
    experts.down.weight.copy_(experts.down.weight.flip(0))
    assert kt_ops._C.bound_nodes(experts.down.weight) == [0]


def test_placement_cache_follows_storage_lifetime():
    # The cache keeps weak references: freed weights drop out of the report,
    # and new weights (possibly at the same address) are placed again.
    with kt_ops.use_numa("on"):
        before = kt_ops.info()["numa"]["placed"]["tensors"]
        experts = _big_layer()
        kt_ops.numa_placement(experts)
        assert kt_ops.info()["numa"]["placed"]["tensors"] == before + 3
        placed = kt_ops.info()["numa"]["placed"]
        if kt_ops.info()["numa"]["memory_binding"]:
            assert placed["tensors_bound"] >= 3
        del experts
        assert kt_ops.info()["numa"]["placed"]["tensors"] == before
        for _ in range(3):  # allocations that may reuse the freed addresses
            experts = _big_layer()
            placement = kt_ops.numa_placement(experts)
            if placement["memory_binding"]:
                assert placement["down"][0]["bound_to"] == [0]
            assert kt_ops.info()["numa"]["placed"]["tensors"] == before + 3
            del experts


def test_module_numa_placement():
    from kt_ops.nn import MoEExperts

    module = MoEExperts(make_expert_weights(E, 72, 88, seed=0))
    with kt_ops.use_numa("off"):
        report = module.numa_placement()
    assert report["active"] is False and report["parts"] == 1
    assert [p["rows"] for p in report["gate"]] == [(0, 88)]
    assert [p["rows"] for p in report["down"]] == [(0, 72)]
