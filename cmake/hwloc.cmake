# hwloc (the thread pool's topology and NUMA binding) as an imported target, kt_ops::hwloc.
#
# pkg-config first (Debian/Ubuntu's libhwloc-dev ships hwloc.pc; PKG_CONFIG_PATH picks
# another install). Without pkg-config, or without a hwloc.pc it can see, the header and
# library are searched directly, under HWLOC_ROOT (CMake cache or environment) and the
# usual prefixes: scripts/gpu_check.sh builds on machines that have no pkg-config, from
# hwloc unpacked out of Debian's .deb files into a folder.

function(kt_find_hwloc)
  find_package(PkgConfig QUIET)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(HWLOC QUIET IMPORTED_TARGET GLOBAL hwloc)
  endif()
  if(TARGET PkgConfig::HWLOC)
    add_library(kt_ops::hwloc ALIAS PkgConfig::HWLOC)
    message(STATUS "kt_ops: hwloc ${HWLOC_VERSION} (pkg-config)")
    return()
  endif()

  set(_hints "")
  foreach(_root "${HWLOC_ROOT}" "$ENV{HWLOC_ROOT}")
    if(_root)
      list(APPEND _hints "${_root}" "${_root}/usr")
    endif()
  endforeach()
  find_path(KT_HWLOC_INCLUDE_DIR hwloc.h HINTS ${_hints} PATH_SUFFIXES include)
  find_library(KT_HWLOC_LIBRARY hwloc HINTS ${_hints}
               PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu)
  if(NOT KT_HWLOC_INCLUDE_DIR OR NOT KT_HWLOC_LIBRARY)
    message(FATAL_ERROR
      "kt_ops: hwloc not found (include: ${KT_HWLOC_INCLUDE_DIR}, library: ${KT_HWLOC_LIBRARY}). "
      "Install its development files (Debian/Ubuntu: apt-get install libhwloc-dev pkg-config), "
      "or set HWLOC_ROOT to a prefix holding include/hwloc.h and lib/libhwloc.so")
  endif()
  add_library(kt_ops_hwloc INTERFACE IMPORTED GLOBAL)
  set_target_properties(kt_ops_hwloc PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${KT_HWLOC_INCLUDE_DIR}"
    INTERFACE_LINK_LIBRARIES "${KT_HWLOC_LIBRARY}")
  add_library(kt_ops::hwloc ALIAS kt_ops_hwloc)
  message(STATUS "kt_ops: hwloc ${KT_HWLOC_LIBRARY} (no pkg-config: found under HWLOC_ROOT or the usual prefixes)")
endfunction()
