# Post-link check of cmake/cxx_runtime.cmake: LIB must load libstdc++.so.6, define no
# libstdc++ iostream code of its own (std::basic_ostream<char>::_M_insert<long>), and load
# libgcc_s.so.1 (the unwinder) instead of carrying one.
execute_process(COMMAND "${READELF}" -d -W "${LIB}" OUTPUT_VARIABLE _dyn RESULT_VARIABLE _rc1)
execute_process(COMMAND "${READELF}" --dyn-syms -W "${LIB}" OUTPUT_VARIABLE _syms RESULT_VARIABLE _rc2)
if(NOT _rc1 EQUAL 0 OR NOT _rc2 EQUAL 0)
  return()  # not an ELF readelf understands: nothing to say
endif()
string(FIND "${_dyn}" "libstdc++.so" _needed)
string(REGEX MATCH "[0-9a-f]+ +[0-9]+ FUNC +[A-Z]+ +[A-Z]+ +[0-9]+ _ZNSo9_M_insertIlEERSoT_" _own "${_syms}")
# The unwinder from libgcc_s.so.1: a private static copy (-static-libgcc) is hidden, so
# only its absence from the dependencies shows it.
string(FIND "${_dyn}" "libgcc_s.so" _unwinder)
set(_why "")
if(_needed EQUAL -1)
  string(APPEND _why " libstdc++.so.6 is not among its dependencies;")
endif()
if(_unwinder EQUAL -1)
  string(APPEND _why " libgcc_s.so.1 is not among its dependencies;")
endif()
if(_own)
  string(APPEND _why " it defines std::ostream::_M_insert<long> itself;")
endif()
if(_why)
  string(REGEX MATCHALL "\\(NEEDED\\)[^\n]*" _deps "${_dyn}")
  message(FATAL_ERROR
    "kt_ops:${_why} dependencies: ${_deps}. "
    "kt_ops: ${LIB} carries its own copy of libstdc++ or of the unwinder (linked "
    "statically: does the compiler add -static-libstdc++ or -static-libgcc?). Next to "
    "torch's libstdc++.so.6 such a copy crashes when an error message formats a number, or "
    "when an exception crosses it. Build with a compiler that links them as shared "
    "libraries (e.g. CXX=/usr/bin/g++), or remove those flags.")
endif()
