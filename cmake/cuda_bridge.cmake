# The CPU/GPU bridge (csrc/hybrid/cuda_transport.cpp, csrc/ops/moe_cuda_ops.cpp):
# plain C++ with no CUDA header (csrc/hybrid/cuda_runtime_subset.h says why),
# linked to the libcudart.so.N that a CUDA build of torch installs with its
# nvidia-* runtime wheel. No CUDA toolkit, no nvcc, no libtorch_cuda.
#
# KT_OPS_CUDA_BRIDGE (CMake cache or environment): AUTO (default: on with a
# CUDA torch whose libcudart is found), ON (fail otherwise), OFF (CUDA tensors
# get the "move it to the CPU" error of csrc/ops/cuda_unsupported.cpp).
# libcudart: next to the nvidia wheels' include dirs (KT_CUDA_WHEEL_INCLUDE_DIRS
# from cmake/torch.cmake), else $CUDA_HOME or /usr/local/cuda. torch must have
# c10::Stream::native_handle() (the current stream without CUDA headers).

set(KT_OPS_CUDA_BRIDGE "AUTO" CACHE STRING "Build the CUDA-stream bridge: AUTO, ON or OFF")

function(kt_add_cuda_bridge target)
  set(_want "${KT_OPS_CUDA_BRIDGE}")
  if(DEFINED ENV{KT_OPS_CUDA_BRIDGE})
    set(_want "$ENV{KT_OPS_CUDA_BRIDGE}")
  endif()
  string(TOUPPER "${_want}" _want)
  set(_why "")
  set(_cudart "")
  list(GET KT_TORCH_INCLUDE_DIRS 0 _torch_inc)
  if(_want STREQUAL "OFF")
    set(_why "KT_OPS_CUDA_BRIDGE=OFF")
  elseif(NOT KT_TORCH_CUDA_VERSION)
    set(_why "torch is a CPU build")
  else()
    set(_roots "")
    foreach(_dir IN LISTS KT_CUDA_WHEEL_INCLUDE_DIRS)
      get_filename_component(_root "${_dir}" DIRECTORY)
      list(APPEND _roots "${_root}")
    endforeach()
    if(DEFINED ENV{CUDA_HOME})
      list(APPEND _roots "$ENV{CUDA_HOME}")
    endif()
    list(APPEND _roots "/usr/local/cuda")
    foreach(_root IN LISTS _roots)
      if(NOT _cudart)
        file(GLOB _libs "${_root}/lib/libcudart.so.*" "${_root}/lib64/libcudart.so.*")
        if(_libs)
          list(SORT _libs)
          list(GET _libs 0 _cudart)
        endif()
      endif()
    endforeach()
    file(STRINGS "${_torch_inc}/c10/core/Stream.h" _native_handle REGEX "native_handle\\(\\)")
    if(NOT _cudart)
      set(_why "no libcudart.so.N found (nvidia wheels, CUDA_HOME, /usr/local/cuda)")
    elseif(NOT _native_handle)
      set(_why "torch ${KT_TORCH_VERSION} has no c10::Stream::native_handle()")
    endif()
  endif()

  if(_why STREQUAL "")
    target_sources(${target} PRIVATE csrc/hybrid/cuda_transport.cpp csrc/ops/moe_cuda_ops.cpp)
    target_link_libraries(${target} PRIVATE "${_cudart}")
    target_compile_definitions(${target} PRIVATE KT_OPS_HAS_CUDA_BRIDGE=1)
    # torch loads libcudart before kt_ops; the rpath lets ldd (and a bare dlopen)
    # find it too when kt_ops and the nvidia wheels share a site-packages.
    get_filename_component(_libdir "${_cudart}" DIRECTORY)
    string(REGEX MATCH "/nvidia/.*$" _rel "${_libdir}")
    if(_rel)
      get_target_property(_rpath ${target} INSTALL_RPATH)
      set_target_properties(${target} PROPERTIES INSTALL_RPATH "${_rpath};$ORIGIN/..${_rel}")
    endif()
    message(STATUS "kt_ops: CUDA bridge ON (${_cudart})")
  else()
    if(_want STREQUAL "ON")
      message(FATAL_ERROR "kt_ops: KT_OPS_CUDA_BRIDGE=ON but ${_why}")
    endif()
    target_sources(${target} PRIVATE csrc/ops/cuda_unsupported.cpp)
    message(STATUS "kt_ops: CUDA bridge OFF (${_why})")
  endif()
endfunction()
