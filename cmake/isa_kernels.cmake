# One object library per ISA tier, each compiled with only that tier's flags
# (style rule 5: ODR safety). A tier is a directory csrc/kernels/<name>/ whose
# vec.h (its vector traits) names its compiler flags on a line
#   // ISA flags: -mavx2 -mfma ...
# Code in these files lives in its own namespace and is reached only through
# the tier table of csrc/kernels/dispatch.cpp after a CPUID check; a tier the
# compiler cannot target is left out (its weak entry points stay null).
# After the link, cmake/check_isa_odr.py fails the build if objects compiled
# with different flags (the extension's own, each tier's) define the same weak
# function (an inline function the linker could pick, ISA copy included, for
# callers compiled without that ISA).
include(CheckCXXCompilerFlag)

function(kt_isa_library name flags)
  foreach(f ${flags})
    string(MAKE_C_IDENTIFIER "KT_HAS_FLAG${f}" var)
    check_cxx_compiler_flag(${f} ${var})
    if(NOT ${var})
      message(STATUS "kt_ops: compiler cannot target ${name} (${f}); that path is not built")
      return()
    endif()
  endforeach()
  file(GLOB srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/csrc/kernels/${name}/*.cpp)
  add_library(kt_kernels_${name} OBJECT ${srcs})
  target_include_directories(kt_kernels_${name} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/csrc)
  target_compile_options(kt_kernels_${name} PRIVATE -O3 ${flags} -Wall -Wextra)
  set(KT_ISA_OBJECTS ${KT_ISA_OBJECTS} $<TARGET_OBJECTS:kt_kernels_${name}> PARENT_SCOPE)
  set(KT_ISA_BUILT ${KT_ISA_BUILT} ${name} PARENT_SCOPE)
  set(KT_ISA_ODR_ARGS ${KT_ISA_ODR_ARGS} "${name}=$<JOIN:$<TARGET_OBJECTS:kt_kernels_${name}>,|>"
      PARENT_SCOPE)
endfunction()

function(kt_add_isa_kernels target)
  set(KT_ISA_OBJECTS "")
  set(KT_ISA_BUILT "")
  set(KT_ISA_ODR_ARGS "")
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64|amd64")
    file(GLOB headers CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/csrc/kernels/*/vec.h)
    list(SORT headers)
    foreach(h ${headers})
      get_filename_component(dir ${h} DIRECTORY)
      get_filename_component(name ${dir} NAME)
      file(STRINGS ${h} line REGEX "^// ISA flags:")
      if(NOT line)
        continue()  # ref: portable C++, part of the main target
      endif()
      string(REGEX REPLACE "^// ISA flags:[ ]*" "" flags "${line}")
      separate_arguments(flags)
      kt_isa_library(${name} "${flags}")
    endforeach()
  endif()
  target_sources(${target} PRIVATE ${KT_ISA_OBJECTS})
  if(KT_ISA_ODR_ARGS AND CMAKE_NM)
    add_custom_command(TARGET ${target} POST_BUILD
      COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/check_isa_odr.py"
              "${CMAKE_NM}" "base=${CMAKE_CURRENT_BINARY_DIR}/CMakeFiles/${target}.dir"
              ${KT_ISA_ODR_ARGS}
      VERBATIM)
  endif()
  message(STATUS "kt_ops: ISA paths built: ref ${KT_ISA_BUILT}")
endfunction()
