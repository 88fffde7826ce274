"""``python -m kt_ops.info``: print the topology, ISA paths and thread pool."""

from kt_ops.runtime import info


def format_info(report: dict) -> str:
    topo = report["topology"]
    feats = ", ".join(k for k, v in report["cpu_features"].items() if v) or "none"
    lines = [
        f"topology       : {topo['num_cores']} physical cores, {topo['num_pus']} PUs, "
        f"{topo['num_numa_nodes']} NUMA node(s) ({topo['source']})",
        f"cpu features   : {feats}",
        f"ISA built      : {', '.join(report['built_isas'])}",
        f"ISA supported  : {', '.join(report['supported_isas'])}",
        f"ISA active     : {report['active_isa']}",
        f"threads        : {report['num_threads']} "
        f"(workers bound to cores: {'yes' if report['workers_bound'] else 'no'})",
    ]
    return "\n".join(lines)


def main() -> None:
    print(format_info(info()))


if __name__ == "__main__":
    main()
