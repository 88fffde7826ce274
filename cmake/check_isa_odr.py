"""Post-link check of cmake/isa_kernels.cmake: ODR safety of the ISA tiers.

An inline function or template instantiation that the compiler does not inline
is emitted as a weak symbol in every object that uses it, and the linker keeps
one copy for all callers. When an AVX-512 object emits one that baseline code
also uses (a ``std::vector<uint8_t>`` member, say), the copy the linker keeps
may be the AVX-512 one, and an AVX2 host dies of SIGILL in baseline code: the
ASan build did, in ``std::vector<unsigned char>::_M_default_append`` (its
shadow poisoning was a ``vmovdqu8``).

So an ISA tier's objects may define weak functions only inside a tier's
namespace (``kt::kernels::<tier>::`` in the name or in its template
arguments: code the baseline objects cannot instantiate, as they include no
tier's headers), and no two tiers may define the same one. Style rule 5.

    python check_isa_odr.py NM TIER=OBJ[|OBJ...] [TIER=...]

Exit status 1 with one line per offending symbol; 0 when clean, or when ``NM``
cannot read the objects (a toolchain this check does not know).
"""

from __future__ import annotations

import subprocess
import sys


def weak_functions(nm: str, obj: str) -> list[str] | None:
    """Demangled names of the weak functions (``nm`` type W) ``obj`` defines."""
    try:
        out = subprocess.run(
            [nm, "-C", "--defined-only", obj], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    names = []
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] == "W":  # V, u: weak or unique data (same bytes)
            names.append(parts[2])
    return names


def problems(nm: str, tiers: dict[str, list[str]]) -> list[str] | None:
    """Offending symbols, one line each; None when ``nm`` could not read an object."""
    found: list[str] = []
    owner: dict[str, str] = {}
    markers = [f"kt::kernels::{tier}::" for tier in tiers]
    for tier, objects in tiers.items():
        for obj in objects:
            names = weak_functions(nm, obj)
            if names is None:
                return None
            for name in names:
                if not any(m in name for m in markers):
                    found.append(f"{obj} ({tier}): {name}: outside the tiers' namespaces")
                first = owner.setdefault(name, tier)
                if first != tier:
                    found.append(f"{obj} ({tier}): {name}: also defined by tier {first}")
    return found


def main(argv: list[str]) -> int:
    nm, *specs = argv
    tiers = {}
    for spec in specs:
        tier, _, objects = spec.partition("=")
        tiers[tier] = [o for o in objects.split("|") if o]
    found = problems(nm, tiers)
    if found is None:
        print(f"kt_ops: {nm} could not read the ISA objects; the ODR check is skipped")
        return 0
    if found:
        print(
            "kt_ops: ISA objects define weak functions that code built with other flags may "
            "share; the linker may keep the ISA copy for every caller (SIGILL on CPUs "
            "without that ISA). Keep such code in the tier's namespace or give it internal "
            "linkage (cmake/check_isa_odr.py):",
            file=sys.stderr,
        )
        for line in found:
            print("  " + line, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
