# One C++ runtime in the process: the libstdc++.so.6 that torch uses.
#
# A toolchain that links libstdc++ (and libgcc) statically into shared objects gave _C a
# private copy of libstdc++: on the GPU machines scripts/gpu_check.sh runs on, /opt/gcc/bin/g++
# searches its own lib folder first, which holds libstdc++.a and no libstdc++.so, so a plain
# -lstdc++ linked the archive (a g++ -static-libstdc++ -static-libgcc wrapper does the same). Its iostreams, never initialised next to torch's,
# crashed (or silently dropped the numbers) when an error message formatted a number:
# six CUDA-bridge and wrapper tests died with SIGSEGV in std::ostream::_M_insert<long>.
#
# kt_add_shared_cxx_runtime(target): names the shared libstdc++ on the link line, so every
# libstdc++ symbol resolves there and a static archive the driver appends adds nothing (and
# the same for libgcc_s, the unwinder), and checks after the link (readelf) that
# libstdc++.so.6 is a dependency and that neither iostream nor unwinder code was linked in;
# the build fails otherwise, saying why.

function(kt_add_shared_cxx_runtime target)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang" OR APPLE)
    return()
  endif()
  # libgcc_s too: with -static-libgcc the landing pads' _Unwind_Resume came from a private
  # copy of the unwinder that never saw the exception libstdc++.so.6 raised (std::terminate).
  # By path where the compiler's own search path holds only the static archive (the GPU
  # machines' /opt/gcc: libstdc++.a and no libstdc++.so, so -lstdc++ linked a copy).
  set(_stdcxx stdc++)
  foreach(_name libstdc++.so libstdc++.so.6)
    execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -print-file-name=${_name}
                    OUTPUT_VARIABLE _path OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(IS_ABSOLUTE "${_path}" AND EXISTS "${_path}")
      set(_stdcxx "${_path}")
      break()
    endif()
  endforeach()
  message(STATUS "kt_ops: C++ runtime linked as ${_stdcxx}")
  target_link_libraries(${target} PRIVATE "${_stdcxx}" gcc_s)
  find_program(KT_READELF NAMES readelf "${CMAKE_CXX_COMPILER_TARGET}-readelf")
  if(KT_READELF)
    add_custom_command(TARGET ${target} POST_BUILD
      COMMAND "${CMAKE_COMMAND}" -DREADELF=${KT_READELF} -DLIB=$<TARGET_FILE:${target}>
              -P "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/check_cxx_runtime.cmake"
      VERBATIM)
  endif()
endfunction()
