"""Post-link check of cmake/isa_kernels.cmake: ODR safety of the ISA tiers.

An inline function or template instantiation that the compiler does not inline
is emitted as a weak symbol in every object that uses it, and the linker keeps
one copy for all callers. When an AVX-512 object emits one that baseline code
also uses (a ``std::vector<uint8_t>`` member, say), the copy the linker keeps
may be the AVX-512 one, and an AVX2 host dies of SIGILL in baseline code: the
ASan build did, in ``std::vector<unsigned char>::_M_default_append`` (its
shadow poisoning was a ``vmovdqu8``).

So no weak function may be defined by objects compiled with different flags:
the baseline objects (``base``) and each ISA tier are one group each. A
tier's weak function outside every tier's namespace (``kt::kernels::<tier>::``
in its name or template arguments) that no other group defines is safe today
and reported as a note: another compiler's inlining could make it shared.
Style rule 5.

    python check_isa_odr.py NM base=DIR TIER=OBJ[|OBJ...] [TIER=...]

``base=DIR``: every ``*.o`` under DIR (the extension's own object directory).
Exit status 1 with one line per offending symbol; 0 when clean, or when ``NM``
cannot read the objects (a toolchain this check does not know).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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


def problems(nm: str, groups: dict[str, list[str]]) -> tuple[list[str], list[str]] | None:
    """(errors, notes), one line each; None when ``nm`` could not read an object.

    ``groups``: ``{'base': objects, tier: objects, ...}``.
    """
    errors: list[str] = []
    notes: list[tuple[str, str]] = []  # (name, line)
    shared: set[str] = set()
    markers = [f"kt::kernels::{g}::" for g in groups if g != "base"]
    owner: dict[str, str] = {}
    for group, objects in groups.items():
        for obj in objects:
            names = weak_functions(nm, obj)
            if names is None:
                return None
            for name in names:
                first = owner.setdefault(name, group)
                if first != group:
                    errors.append(f"{obj} ({group}): {name}: also defined by {first}")
                    shared.add(name)
                if group != "base" and not any(m in name for m in markers):
                    notes.append((name, f"{obj} ({group}): {name}: outside the tiers' namespaces"))
    # A shared symbol is an error already, not a note.
    return errors, [line for name, line in notes if name not in shared]


def main(argv: list[str]) -> int:
    nm, *specs = argv
    groups = {}
    for spec in specs:
        group, _, objects = spec.partition("=")
        if group == "base":
            groups[group] = sorted(str(p) for p in Path(objects).rglob("*.o"))
        else:
            groups[group] = [o for o in objects.split("|") if o]
    result = problems(nm, groups)
    if result is None:
        print(f"kt_ops: {nm} could not read the ISA objects; the ODR check is skipped")
        return 0
    found, notes = result
    for line in notes:
        print(f"kt_ops: note: ISA object with a weak function no other object defines: {line}")
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
