# Required and optional third-party packages, all from Debian 12 (scripts/bootstrap.sh installs them).
find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(tomlplusplus 3 REQUIRED)
# OpenSSL (libssl-dev): SHA-256 for the HTTP weight checker; CAF's TLS uses it too.
find_package(OpenSSL REQUIRED)
# CAF 0.17 (libcaf-dev): core, io and openssl, for the control plane (cmake/FindCAF.cmake).
find_package(CAF REQUIRED)

# cpp-httplib: Debian builds it as a shared library with TLS, zlib and brotli support on, and
# its class layouts depend on those switches: take the compile flags from its pkg-config file,
# or a client built without them corrupts the heap.
find_package(PkgConfig REQUIRED)
pkg_check_modules(WSYNC_HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
add_library(wsync_httplib INTERFACE)
target_link_libraries(wsync_httplib INTERFACE PkgConfig::WSYNC_HTTPLIB Threads::Threads)

# xxHash is used header-only (XXH_INLINE_ALL): the inline build hashes about twice as fast as
# Debian's shared library (XXH3, one thread, 1 GiB: 30-32 GB/s inline, 16 GB/s through
# libxxhash.so's SSE2 build).
find_path(WSYNC_XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
add_library(wsync_xxhash INTERFACE)
target_include_directories(wsync_xxhash SYSTEM INTERFACE "${WSYNC_XXHASH_INCLUDE_DIR}")

if(WSYNC_ENABLE_TESTS)
  find_package(GTest REQUIRED)
  find_package(rapidcheck REQUIRED)
endif()

# UCX (libucx-dev) for the "ucx" transport. AUTO builds it when found and says so when not; ON
# makes a missing UCX a configure error.
set(WSYNC_WITH_UCX AUTO CACHE STRING "Build the ucx transport: AUTO, ON or OFF")
set(WSYNC_HAVE_UCX OFF)
if(NOT WSYNC_WITH_UCX STREQUAL "OFF")
  pkg_check_modules(WSYNC_UCX IMPORTED_TARGET ucx)
  if(WSYNC_UCX_FOUND)
    set(WSYNC_HAVE_UCX ON)
  elseif(WSYNC_WITH_UCX STREQUAL "ON")
    message(FATAL_ERROR "WSYNC_WITH_UCX=ON but UCX was not found: apt-get install libucx-dev")
  else()
    message(STATUS "wsync: UCX not found (libucx-dev): the ucx transport is off")
  endif()
endif()
find_program(WSYNC_UCX_PERFTEST ucx_perftest)

# CUDA (the GPU data plane: checksum kernels now, cuda-ipc / cuda-vmm / nccl): the toolkit is not
# a Debian package, so it is used where a machine has one (/usr/local/cuda or nvcc on PATH). AUTO
# builds the GPU parts when the toolkit and nvcc are found and says so when not; ON makes them
# required; OFF leaves them out. Without them the GPU transports answer
# "blocked: built without CUDA (no CUDA toolkit found at configure time)". Sanitizer builds leave
# CUDA out (nvcc does not take the sanitizer flags). CMAKE_CUDA_ARCHITECTURES defaults to 90
# (H100/H200); set it for other GPUs.
set(WSYNC_WITH_CUDA AUTO CACHE STRING "Build the GPU data plane: AUTO, ON or OFF")
set(WSYNC_HAVE_CUDA OFF)
set(WSYNC_HAVE_NCCL OFF)
if(NOT WSYNC_SANITIZER STREQUAL "" AND NOT WSYNC_WITH_CUDA STREQUAL "ON")
  message(STATUS "wsync: CUDA is off in sanitizer builds")
elseif(NOT WSYNC_WITH_CUDA STREQUAL "OFF")
  # Through CUDACXX, not CMAKE_CUDA_COMPILER: check_language does nothing when the variable is
  # set, so an nvcc that cannot compile (an unsupported host compiler, a partial toolkit) would
  # reach enable_language and fail the configure instead of turning CUDA off.
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(ENV{CUDACXX} /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  find_package(CUDAToolkit QUIET)
  if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND AND CUDAToolkit_VERSION VERSION_LESS 12.5)
    # The kernels are C++20, which nvcc takes from 12.0 (Debian's nvidia-cuda-toolkit is 11.8),
    # and the driver functions come through cudaGetDriverEntryPointByVersion, new in 12.5.
    if(WSYNC_WITH_CUDA STREQUAL "ON")
      message(FATAL_ERROR
              "WSYNC_WITH_CUDA=ON needs CUDA 12.5 or newer; found ${CUDAToolkit_VERSION}")
    endif()
    message(STATUS "wsync: CUDA ${CUDAToolkit_VERSION} is older than 12.5: the GPU parts are off")
  elseif(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # A100 and its 8.x kin (80 runs on 86 and 89), H100/H200, and PTX of 90 for newer GPUs.
      set(CMAKE_CUDA_ARCHITECTURES 80-real 90)
    endif()
    enable_language(CUDA)
    if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)  # CMake 3.25 knows nvcc up to C++17
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(WSYNC_HAVE_CUDA ON)
    message(STATUS "wsync: CUDA ${CUDAToolkit_VERSION} found: GPU parts on "
                   "(architectures ${CMAKE_CUDA_ARCHITECTURES})")
    # NCCL beside the toolkit (/usr/local/cuda) or in the system (libnccl-dev).
    find_path(WSYNC_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(WSYNC_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    if(WSYNC_NCCL_INCLUDE_DIR AND WSYNC_NCCL_LIBRARY)
      set(WSYNC_HAVE_NCCL ON)
      message(STATUS "wsync: NCCL found: ${WSYNC_NCCL_LIBRARY}")
    endif()
  elseif(WSYNC_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "WSYNC_WITH_CUDA=ON but no CUDA toolkit with nvcc was found "
                        "(set CUDAToolkit_ROOT or CMAKE_CUDA_COMPILER)")
  else()
    message(STATUS "wsync: no CUDA toolkit found: the GPU transports answer blocked")
  endif()
endif()

# The Python module (python/): pybind11 (python3-pybind11 / pybind11-dev) and the headers of the
# interpreter it is built for (python3-dev). That interpreter is Debian's /usr/bin/python3, the one
# that sees python3-torch; a python3 earlier on PATH (pyenv, conda) usually does not. AUTO builds
# the module when both are found and says so when not; ON makes them required.
set(WSYNC_WITH_PYTHON AUTO CACHE STRING "Build the Python module: AUTO, ON or OFF")
set(WSYNC_PYTHON /usr/bin/python3 CACHE FILEPATH "Interpreter the Python module is built for")
set(WSYNC_HAVE_PYTHON OFF)
if(NOT WSYNC_SANITIZER STREQUAL "" AND NOT WSYNC_WITH_PYTHON STREQUAL "ON")
  # An extension built with a sanitizer loads only into an interpreter started with its runtime
  # preloaded; the sanitizer presets leave the module out rather than build one nobody can load.
  message(STATUS "wsync: the Python module is off in sanitizer builds")
elseif(NOT WSYNC_WITH_PYTHON STREQUAL "OFF")
  set(Python_EXECUTABLE "${WSYNC_PYTHON}")
  find_package(Python 3.9 COMPONENTS Interpreter Development.Module)
  if(Python_FOUND)
    set(PYBIND11_FINDPYTHON ON)
    find_package(pybind11 2.6 CONFIG QUIET)
  endif()
  if(Python_FOUND AND pybind11_FOUND)
    set(WSYNC_HAVE_PYTHON ON)
    message(STATUS "wsync: Python module for ${Python_EXECUTABLE} (${Python_VERSION})")
  elseif(WSYNC_WITH_PYTHON STREQUAL "ON")
    message(FATAL_ERROR "WSYNC_WITH_PYTHON=ON but ${WSYNC_PYTHON} with its headers (python3-dev) "
                        "or pybind11 (python3-pybind11) was not found")
  else()
    message(STATUS "wsync: ${WSYNC_PYTHON} headers (python3-dev) or pybind11 (python3-pybind11) "
                   "not found: the Python module is off")
  endif()
endif()
