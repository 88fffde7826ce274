"""cmake/check_isa_odr.py, the build's ODR check of the ISA tiers' objects.

An out-of-line std:: member that an ISA tier's object and a baseline object
both emit (the linker may keep the ISA copy for both) fails the check, as does
a weak function two tiers define; one only a tier defines passes (outside the
tiers' namespaces with a note). The objects are compiled here from a few lines
of C++ (skipped without g++ and nm).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parent.parent / "cmake" / "check_isa_odr.py"
CXX = shutil.which("g++")
NM = shutil.which("nm")

pytestmark = pytest.mark.skipif(CXX is None or NM is None, reason="needs g++ and nm")

# std::vector<uint8_t>::resize out of line: the ASan build's SIGILL on AVX2 hosts
# (an AVX-512 object's copy, kept for the baseline callers as well).
SHARED_STD = """
#include <cstddef>
#include <vector>
namespace kt::kernels::avx512 {
void grow(std::vector<unsigned char>& v, std::size_t n) { v.resize(n); }
}
"""
# A template of the tier's own namespace, not inlined at -O0: a weak symbol only
# this tier's code can name.
TIER_TEMPLATE = """
namespace kt::kernels::avx512 {
template <int N> int scaled(int x) { return N * x; }
int use(int x) { return scaled<3>(x); }
}
"""


BASE_STD = """
#include <cstddef>
#include <vector>
namespace kt::moe {
void grow(std::vector<unsigned char>& v, std::size_t n) { v.resize(n); }
}
"""


def compile_object(tmp_path: Path, name: str, source: str, sub: str = ".") -> str:
    src = tmp_path / f"{name}.cpp"
    src.write_text(source)
    (tmp_path / sub).mkdir(exist_ok=True)
    obj = tmp_path / sub / f"{name}.o"
    subprocess.run([CXX, "-std=c++17", "-O0", "-c", str(src), "-o", str(obj)], check=True)
    return str(obj)


def run_check(*specs: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), NM, *specs], capture_output=True, text=True)


def test_std_member_of_a_tier_and_the_baseline_fails(tmp_path):
    obj = compile_object(tmp_path, "shared_std", SHARED_STD)
    compile_object(tmp_path, "base_std", BASE_STD, sub="base")
    r = run_check(f"base={tmp_path / 'base'}", f"avx512={obj}")
    assert r.returncode == 1
    assert "_M_default_append" in r.stderr and "also defined by" in r.stderr


def test_std_member_of_a_tier_alone_passes_with_a_note(tmp_path):
    obj = compile_object(tmp_path, "shared_std", SHARED_STD)
    (tmp_path / "base").mkdir()
    r = run_check(f"base={tmp_path / 'base'}", f"avx512={obj}")
    assert r.returncode == 0, r.stderr
    assert "note" in r.stdout and "_M_default_append" in r.stdout


def test_tier_namespace_template_passes(tmp_path):
    obj = compile_object(tmp_path, "tier_template", TIER_TEMPLATE)
    # The object does define the weak template (else this test could not fail).
    names = subprocess.run([NM, "-C", "--defined-only", obj], capture_output=True, text=True)
    assert " W int kt::kernels::avx512::scaled<3>(int)" in names.stdout
    r = run_check(f"avx512={obj}", "avx2=")
    assert r.returncode == 0, r.stderr


def test_same_weak_function_in_two_tiers_fails(tmp_path):
    a = compile_object(tmp_path, "a", TIER_TEMPLATE)
    b = compile_object(tmp_path, "b", TIER_TEMPLATE)
    r = run_check(f"avx512={a}", f"avx512_vnni={b}")
    assert r.returncode == 1
    assert "also defined by avx512" in r.stderr


def test_objects_of_one_tier_are_joined_by_bars(tmp_path):
    clean = compile_object(tmp_path, "clean", TIER_TEMPLATE)
    bad = compile_object(tmp_path, "bad", SHARED_STD)
    compile_object(tmp_path, "base_std", BASE_STD, sub="base")
    r = run_check(f"base={tmp_path / 'base'}", f"avx512={clean}|{bad}")
    assert r.returncode == 1
    assert "bad.o" in r.stderr and "clean.o" not in r.stderr


def test_unreadable_object_skips_the_check(tmp_path):
    junk = tmp_path / "junk.o"
    junk.write_bytes(b"not an object")
    r = run_check(f"avx2={junk}")
    assert r.returncode == 0
    assert "skipped" in r.stdout
