"""LoRA training across processes: torchrun ranks (gloo, CPU) under DDP and FSDP2.

Each test launches ``torchrun --standalone --nproc-per-node 2`` on
``tests/distributed_worker.py`` and checks, from the ranks' reports:

* the LoRA gradients after one step on two micro-batches equal one process's
  gradients on the whole batch (reduction-order tolerance);
* one copy of the experts: the ranks map the same ``kt-ops convert`` files, never
  write them (no private dirty pages: DDP does not broadcast the packed buffers,
  which ``replace_experts`` put on its ignore list), and each rank's proportional
  share (PSS) of them is about 1/2 of what it maps;
* no oversubscription: each rank's kt_ops pool takes part ``LOCAL_RANK`` of 2 of the
  host's cores (``kt_ops.distributed.core_share``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is needed",
)

TESTS = Path(__file__).resolve().parent
RANKS = 2


def torchrun(mode: str, work: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_OPS_")}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(TESTS.parent), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={RANKS}", str(TESTS / "distributed_worker.py"), mode, str(work)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=work)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    return [json.loads((work / f"rank{i}.json").read_text()) for i in range(RANKS)]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_lora_step_across_ranks(tmp_path, mode):
    if mode == "fsdp2":
        pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard)")
        from torch.distributed import fsdp

        if not hasattr(fsdp, "fully_shard"):
            pytest.skip("this torch has no FSDP2 fully_shard")
    reports = torchrun(mode, tmp_path)
    r0 = reports[0]
    # Equal gradients: the all-reduced (DDP) / reduce-scattered (FSDP2) LoRA
    # gradients of 2 micro-batches against one process on the concatenated batch.
    assert r0["num_lora_grads"] >= 5 * 2  # A (gate/up share it), B of gate/up/down, 2 layers
    assert r0["grad_rel"] < 1e-5, r0
    for i, r in enumerate(reports):
        # One copy per host: mapped, read, never written; PSS about half of RSS.
        m = r["experts_mapped"]
        assert m["Rss"] > 0, r
        assert m["Private_Dirty"] == 0, r  # no broadcast wrote into the experts
        assert m["Pss"] <= 0.75 * m["Rss"], r
        assert m["Rss"] <= r["experts_file_bytes"] + 4096 * 64, r
        # The cores shared out: part i of 2, and that many threads.
        share = r["core_share"]
        assert (share["index"], share["count"]) == (i, RANKS), share
        assert share["source"] == "LOCAL_RANK/LOCAL_WORLD_SIZE"
        assert r["threads"] == len(share["cores"]) >= 1
        if share["host_cores"] >= RANKS:  # disjoint shares
            other = reports[1 - i]["core_share"]["cores"]
            assert not set(share["cores"]) & set(other)
        if mode == "ddp":
            assert r["ddp_ignored"] > 0


def test_the_one_copy_check_sees_a_broadcast(tmp_path):
    # The control of the PSS check above: without the ignore list that replace_experts
    # sets, DDP's buffer broadcast writes into the mapped experts of every rank.
    reports = torchrun("ddp_without_ignore_list", tmp_path)
    assert all(r["experts_mapped"]["Private_Dirty"] > 0 for r in reports), reports


def test_core_share_environment(python_subprocess):
    code = (
        "import kt_ops, json; from kt_ops.distributed import core_share; "
        "print(json.dumps(dict(core_share(), threads=kt_ops.get_num_threads())))"
    )
    env = {
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "KT_OPS_HWLOC_SYNTHETIC": "node:2 core:4 pu:1",
    }
    r = python_subprocess(code, env=env)
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert (s["index"], s["count"], s["host_cores"]) == (1, 2, 8)
    assert s["cores"] == [4, 5, 6, 7] and s["threads"] == 4  # the second node's cores
    env["KT_OPS_CORE_SHARE"] = "off"
    s = json.loads(python_subprocess(code, env=env).stdout.strip().splitlines()[-1])
    assert (s["count"], len(s["cores"]), s["source"]) == (1, 8, "none")
    env["KT_OPS_CORE_SHARE"] = "2/3"
    s = json.loads(python_subprocess(code, env=env).stdout.strip().splitlines()[-1])
    assert (s["index"], s["count"], s["cores"]) == (2, 3, [5, 6, 7])
    env["KT_OPS_CORE_SHARE"] = "3/3"
    r = python_subprocess(code, env=env)
    assert r.returncode != 0 and "KT_OPS_CORE_SHARE='3/3' must be" in r.stderr
    # Launcher variables that contradict each other are an error, not the whole host.
    env.pop("KT_OPS_CORE_SHARE")
    for rank, size in (("2", "2"), ("x", "2"), ("0", "0")):
        env.update(LOCAL_RANK=rank, LOCAL_WORLD_SIZE=size)
        r = python_subprocess(code, env=env)
        assert r.returncode != 0 and f"LOCAL_RANK='{rank}' and LOCAL_WORLD_SIZE='{size}'" in (
            r.stderr
        ), r.stderr
    env["KT_OPS_CORE_SHARE"] = "off"  # the way out
    assert python_subprocess(code, env=env).returncode == 0
    del env["LOCAL_WORLD_SIZE"], env["KT_OPS_CORE_SHARE"]  # LOCAL_RANK alone: the whole host
    s = json.loads(python_subprocess(code, env=env).stdout.strip().splitlines()[-1])
    assert (s["count"], len(s["cores"])) == (1, 8)
