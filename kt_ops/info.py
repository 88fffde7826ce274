"""The runtime report: topology, CPU features, ISA paths, kernels, thread pool.

``python -m kt_ops info`` (or ``kt_ops.print_info()``, ``kt-ops info``) prints it.
"""

from __future__ import annotations

from kt_ops import _C

__all__ = ["info", "print_info", "format_info"]


def info() -> dict:
    """Report the detected topology, CPU features, thread count, ISA paths and kernels.

    Returns a dict with keys ``topology`` (cores, NUMA nodes, PUs, source),
    ``cpu_features``, ``num_threads``, ``workers_bound``, ``built_isas``,
    ``supported_isas``, ``active_isa``, ``cuda_bridge`` (whether this build runs
    the ops on CUDA tensors, :mod:`kt_ops.hybrid`) and ``kernels``: per weight format, the
    kernel that runs its own path and the kernel of its weight-only fp32 path
    (``None`` where the format has one path) on the active ISA, after the
    fallback chain (e.g. ``{'int4': ['avx2/qint_q8', 'avx2/qint_fp32'], ...}``),
    ``compute_path`` (:func:`kt_ops.set_compute_path`: ``'auto'``,
    ``'streaming'`` or ``'brgemm'``), ``brgemm_cpu_class`` (the CPU class whose
    thresholds ``'auto'`` follows: ``'avx512'``, ``'avx512_intel'`` or ``'amx'``,
    :meth:`kt_ops.formats.FormatSpec.brgemm_min_tokens_for`) and ``brgemm``: per weight format, the
    brgemm kernel and the tokens per expert from which it runs under that path
    on the active ISA (``None`` where it does not run; :func:`kt_ops.compute_paths`),
    and ``numa``: the NUMA placement (:func:`kt_ops.set_numa`): ``mode``,
    ``active``, ``nodes`` (one part of every expert per node), ``threads_per_node``,
    ``memory_binding`` (whether hwloc can bind pages here; False on a synthetic
    topology), ``placed`` (live placed tensors, those the OS bound, bytes per
    node) and ``slices`` (``{rows: [(begin, end) per node]}`` for the row
    counts of the layers placed so far: I for gate/up, H for down), and
    ``huge_pages`` (:func:`kt_ops.formats.packed.huge_pages`: ``thp_mode``, ``enabled``,
    ``page_bytes``: whether packed weights are allocated in 2 MiB pages), and
    ``parallel``: which threads run kt_ops' parallel work
    (:func:`kt_ops.set_parallel_backend`): ``setting``, ``uses`` (``'openmp'``
    or ``'pool'`` for a call from this thread now), ``reason``,
    ``openmp_runtime`` (the file of torch's OpenMP runtime, ``''`` if none) and
    ``openmp_max_threads`` (this thread's OpenMP team size) and ``jobs``
    (``{'openmp': n, 'pool': m}``: parallel jobs run so far on each, process-wide)
    and ``caller_moves`` (pool jobs whose calling thread was moved to its home
    PUs for the job: off a bound worker's core, or, under NUMA placement, to
    node 0).
    """
    active = _C.active_isa()
    return {
        "topology": _C.topology(),
        "cpu_features": _C.cpu_features(),
        "num_threads": _C.get_num_threads(),
        "workers_bound": _C.workers_bound(),
        "built_isas": list(_C.built_isas()),
        "supported_isas": list(_C.supported_isas()),
        "active_isa": active,
        "cuda_bridge": bool(_C.cuda_bridge_built()),
        "kernels": dict(_C.kernel_names(active)),
        "compute_path": _C.compute_path(),
        "brgemm_cpu_class": _C.brgemm_cpu_class(),
        "brgemm": dict(_C.compute_paths(active)),
        "numa": dict(_C.numa_report()),
        "huge_pages": dict(_C.huge_pages()),
        "parallel": dict(_C.parallel_report()),
    }


def format_info(report: dict) -> str:
    """The report of :func:`info` as the lines ``print_info`` prints."""
    topo = report["topology"]
    feats = ", ".join(k for k, v in report["cpu_features"].items() if v) or "none"
    lines = [
        f"topology       : {topo['num_cores']} physical cores, {topo['num_pus']} PUs, "
        f"{topo['num_numa_nodes']} NUMA node(s) ({topo['source']})",
        f"core share     : {_share_line(topo)}",
        f"cpu features   : {feats}",
        f"ISA built      : {', '.join(report['built_isas'])}",
        f"ISA supported  : {', '.join(report['supported_isas'])}",
        f"ISA active     : {report['active_isa']}",
        f"threads        : {report['num_threads']} "
        f"(workers bound to cores: {'yes' if report['workers_bound'] else 'no'})",
        "CUDA bridge    : "
        + ("built (CUDA tensors run through it)" if report.get("cuda_bridge") else "not built"),
    ]
    cls = report.get("brgemm_cpu_class")
    lines.append(
        f"compute path   : {report['compute_path']}"
        + (f" (brgemm thresholds of the {cls} class)" if cls else "")
    )
    par = report.get("parallel")
    if par is not None:
        lines.append(f"parallel       : {par['uses']} (setting {par['setting']}: {par['reason']})")
    numa = report.get("numa")
    if numa is not None:
        lines.append(f"NUMA placement : {_numa_line(numa)}")
    hp = report.get("huge_pages")
    if hp is not None:
        state = "on" if hp["enabled"] else "off"
        lines.append(f"huge pages     : {state} (THP mode {hp['thp_mode']}; KT_OPS_HUGE_PAGES)")
    for fmt, (own, fp32) in report["kernels"].items():
        brg = report["brgemm"][fmt]
        extra = f" (fp32 path: {fp32})" if fp32 else ""
        if brg["brgemm_kernel"]:
            extra += f" (from {brg['brgemm_min_tokens']} tokens/expert: {brg['brgemm_kernel']})"
        lines.append(f"kernels {fmt:<7}: {own}" + extra)
    return "\n".join(lines)


def _share_line(topo: dict) -> str:
    """This process's share of the host's cores (several local ranks split them)."""
    i, n = topo.get("core_share", (0, 1))
    host = topo.get("host_cores", topo["num_cores"])
    if n <= 1:
        return f"the whole host ({host} cores; KT_OPS_CORE_SHARE, LOCAL_RANK unset)"
    cores = ", ".join(str(c["core"]) for c in topo["cores"])
    return f"part {i} of {n} ({topo['core_share_source']}): cores {cores} of the host's {host}"


def _numa_line(numa: dict) -> str:
    if not numa["active"]:
        return f"off (mode {numa['mode']}; one part per expert)"
    nodes = ", ".join(
        f"node {n}: {t} thread(s)" for n, t in zip(numa["nodes"], numa["threads_per_node"])
    )
    text = f"on (mode {numa['mode']}); {nodes}; memory binding: " + (
        "yes" if numa["memory_binding"] else "no (not supported on this topology)"
    )
    placed = numa["placed"]
    if placed["tensors"]:
        mib = ", ".join(f"{b / 2**20:.1f}" for b in placed["bytes_per_node"])
        text += f"; placed: {placed['tensors']} tensors, MiB per node [{mib}]"
    for rows, ranges in numa["slices"].items():
        text += f"; {rows} rows -> " + " ".join(f"[{a},{b})" for a, b in ranges)
    return text


def print_info() -> None:
    """Print the detected topology, CPU features, ISA paths, kernels and thread count."""
    print(format_info(info()))


def main() -> None:
    print_info()


if __name__ == "__main__":
    main()
