# The installed PyTorch as an imported target, kt_ops::torch, WITHOUT
# find_package(Torch).
#
# find_package(Torch) of a CUDA build of torch runs Caffe2's cuda.cmake: it
# wants a full CUDA toolkit (FindCUDA, nvrtc), copies CMAKE_CXX_STANDARD to the
# CUDA language and links libtorch_cuda.so. The CPU extension needs none of
# that. Instead, ask the Python interpreter that builds kt_ops (setup.py passes
# Python_EXECUTABLE) for what torch.utils.cpp_extension uses itself:
#   include_paths(), library_paths() (the CPU ones), torch._C._GLIBCXX_USE_CXX11_ABI,
#   torch.__version__ and torch.version.cuda.
# Works alike for CPU and CUDA builds of torch, from 2.4 to 2.14.
#
# Defines:
#   kt_ops::torch          INTERFACE target: torch's headers (as SYSTEM), the ABI
#                          definition, and libtorch, libtorch_cpu, libc10, libtorch_python
#   KT_TORCH_VERSION       e.g. 2.14.1
#   KT_TORCH_CUDA_VERSION  torch.version.cuda, empty for a CPU build
#   KT_TORCH_LIBRARY_DIR   torch/lib
#   KT_TORCH_CXX_STANDARD  17, or 20 where torch's headers require C++20
#   KT_TORCH_HAS_BRGEMM    ON where ATen/native/CPUBlas.h declares the bf16 brgemm (torch >= 2.6)
#   KT_CUDA_WHEEL_INCLUDE_DIRS  CUDA runtime headers installed by the nvidia-* wheels of a
#                          CUDA torch (the CUDA bridge, cmake/cuda_bridge.cmake; empty otherwise)

set(_kt_torch_query [=[
import os, sys
import torch
from torch.utils import cpp_extension as ce
print("version=" + torch.__version__.split("+")[0])
print("cuda=" + (torch.version.cuda or ""))
print("abi=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))
print("includes=" + ";".join(ce.include_paths()))
print("libdir=" + os.path.join(os.path.dirname(torch.__file__), "lib"))
inc = []
try:
    import nvidia
    for base in nvidia.__path__:
        for sub in sorted(os.listdir(base)):
            d = os.path.join(base, sub, "include")
            if os.path.isfile(os.path.join(d, "cuda_runtime_api.h")):
                inc.append(d)
except ImportError:
    pass
print("cuda_wheel_includes=" + ";".join(inc))
]=])

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "${_kt_torch_query}"
  OUTPUT_VARIABLE _kt_torch_out
  ERROR_VARIABLE _kt_torch_err
  RESULT_VARIABLE _kt_torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _kt_torch_rc EQUAL 0)
  message(FATAL_ERROR
    "kt_ops: cannot import torch with ${Python_EXECUTABLE}:\n${_kt_torch_err}\n"
    "Install torch first and build with pip install --no-build-isolation")
endif()

string(REPLACE "\n" ";" _kt_torch_lines "${_kt_torch_out}")
foreach(_line IN LISTS _kt_torch_lines)
  if(_line MATCHES "^([a-z_]+)=(.*)$")
    set(_kt_torch_${CMAKE_MATCH_1} "${CMAKE_MATCH_2}")
  endif()
endforeach()
# ";" inside a list element would split it: the query joined paths with ";" on purpose.
set(KT_TORCH_VERSION "${_kt_torch_version}")
set(KT_TORCH_CUDA_VERSION "${_kt_torch_cuda}")
set(KT_TORCH_LIBRARY_DIR "${_kt_torch_libdir}")
set(KT_TORCH_INCLUDE_DIRS "${_kt_torch_includes}")
set(KT_CUDA_WHEEL_INCLUDE_DIRS "${_kt_torch_cuda_wheel_includes}")

if(KT_TORCH_VERSION VERSION_LESS 2.4)
  message(FATAL_ERROR "kt_ops needs torch >= 2.4 (torch.library.register_fake); found ${KT_TORCH_VERSION}")
endif()

set(_kt_torch_libs "")
foreach(_lib torch torch_cpu c10 torch_python)
  unset(KT_TORCH_LIB_${_lib} CACHE)  # a build dir reused with another torch must not keep the old one
  find_library(KT_TORCH_LIB_${_lib} NAMES ${_lib} PATHS "${KT_TORCH_LIBRARY_DIR}"
               NO_DEFAULT_PATH REQUIRED)
  list(APPEND _kt_torch_libs "${KT_TORCH_LIB_${_lib}}")
endforeach()

# The C++ standard follows torch: C++20 where its headers ask for it (torch 2.14's
# ATen.h: "#error C++20 or later compatible compiler is required"), else C++17.
set(KT_TORCH_CXX_STANDARD 17)
list(GET KT_TORCH_INCLUDE_DIRS 0 _kt_torch_inc0)
file(STRINGS "${_kt_torch_inc0}/ATen/ATen.h" _kt_aten_cxx REGEX "__cplusplus < 202002L")
if(_kt_aten_cxx)
  set(KT_TORCH_CXX_STANDARD 20)
endif()

# oneDNN's brgemm ukernel through libtorch (at::native::cpublas::brgemm with a
# bf16 VNNI overload and brgemm_release): declared in CPUBlas.h from torch 2.6
# on (2.4 has none). A header check, not a version number: KT_TORCH_HAS_BRGEMM.
set(KT_TORCH_HAS_BRGEMM OFF)
set(_kt_cpublas "${_kt_torch_inc0}/ATen/native/CPUBlas.h")
if(EXISTS "${_kt_cpublas}")
  file(READ "${_kt_cpublas}" _kt_cpublas_text)
  string(REGEX MATCH "const at::BFloat16\\* B,[ \n]*float\\* C,[ \n]*bool is_vnni"
         _kt_brgemm_bf16 "${_kt_cpublas_text}")
  string(FIND "${_kt_cpublas_text}" "brgemm_release" _kt_brgemm_release)
  if(_kt_brgemm_bf16 AND NOT _kt_brgemm_release EQUAL -1)
    set(KT_TORCH_HAS_BRGEMM ON)
  endif()
endif()

add_library(kt_torch INTERFACE)
add_library(kt_ops::torch ALIAS kt_torch)
target_include_directories(kt_torch SYSTEM INTERFACE ${KT_TORCH_INCLUDE_DIRS})
target_compile_definitions(kt_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_kt_torch_abi})
target_link_libraries(kt_torch INTERFACE ${_kt_torch_libs})

if(KT_TORCH_CUDA_VERSION)
  set(_kt_kind "CUDA ${KT_TORCH_CUDA_VERSION} build")
else()
  set(_kt_kind "CPU build")
endif()
message(STATUS "kt_ops: torch ${KT_TORCH_VERSION} (${_kt_kind}), C++${KT_TORCH_CXX_STANDARD}, "
               "CXX11 ABI ${_kt_torch_abi}, ${KT_TORCH_LIBRARY_DIR}, "
               "oneDNN brgemm in CPUBlas.h: ${KT_TORCH_HAS_BRGEMM}")
if(KT_CUDA_WHEEL_INCLUDE_DIRS)
  message(STATUS "kt_ops: CUDA runtime headers from the nvidia wheels: ${KT_CUDA_WHEEL_INCLUDE_DIRS}")
endif()
