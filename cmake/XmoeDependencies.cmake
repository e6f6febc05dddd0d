# Required: threads, OpenMP, BLAS (OpenBLAS), yaml-cpp, fmt, spdlog, nlohmann_json, CLI11.
# Optional features (CUDA, MPI, NCCL, tests, benchmarks) turn themselves off with a line in the
# configure summary when what they need is missing; they never break the build.
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
# OpenBLAS built on OpenMP shares xmoe's OpenMP thread pool. The pthreads build keeps a pool of
# its own whose spinning threads fight OpenMP's on small machines (measured: ~35% of a CPU
# training step lost in sched_yield on 2 cores), so the OpenMP build is preferred when present.
find_library(XMOE_OPENBLAS_OPENMP NAMES openblas
             PATHS /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp NO_DEFAULT_PATH)
if(XMOE_OPENBLAS_OPENMP)
  set(BLAS_LIBRARIES ${XMOE_OPENBLAS_OPENMP})
  set(XMOE_BLAS_FLAVOR "OpenMP")
  find_path(XMOE_CBLAS_INCLUDE cblas.h
            PATHS /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp NO_DEFAULT_PATH)
else()
  set(BLA_VENDOR OpenBLAS)
  find_package(BLAS REQUIRED)
  set(XMOE_BLAS_FLAVOR "pthreads or unknown; install libopenblas-openmp-dev for the OpenMP build")
endif()
find_path(XMOE_CBLAS_INCLUDE cblas.h PATHS /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-pthread
          /usr/include/openblas /usr/include/${CMAKE_LIBRARY_ARCHITECTURE} /usr/include)
if(NOT XMOE_CBLAS_INCLUDE)
  message(FATAL_ERROR "cblas.h not found: install OpenBLAS (Debian: libopenblas-dev)")
endif()
find_package(yaml-cpp REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 QUIET CONFIG)
if(NOT CLI11_FOUND)
  find_path(XMOE_CLI11_INCLUDE CLI/CLI.hpp REQUIRED)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  target_include_directories(CLI11::CLI11 INTERFACE ${XMOE_CLI11_INCLUDE})
endif()

# SentencePiece (Debian: libsentencepiece-dev): `xmoe prepare --tokenizer x.model` and `xmoe
# tokenizer train`. Without it those refuse with the package to install (data/sentencepiece/).
set(XMOE_SENTENCEPIECE_REASON "")
if(XMOE_SENTENCEPIECE)
  find_path(XMOE_SENTENCEPIECE_INCLUDE sentencepiece_processor.h)
  find_library(XMOE_SENTENCEPIECE_LIBRARY sentencepiece)
  find_library(XMOE_SENTENCEPIECE_TRAIN_LIBRARY sentencepiece_train)
  if(NOT XMOE_SENTENCEPIECE_INCLUDE OR NOT XMOE_SENTENCEPIECE_LIBRARY
     OR NOT XMOE_SENTENCEPIECE_TRAIN_LIBRARY)
    set(XMOE_SENTENCEPIECE OFF)
    set(XMOE_SENTENCEPIECE_REASON
        "libsentencepiece not found (Debian: libsentencepiece-dev); .model tokenizers refused")
  endif()
endif()

set(XMOE_MPI_REASON "")
if(XMOE_MPI)
  find_package(MPI COMPONENTS CXX QUIET)
  if(NOT MPI_CXX_FOUND)
    set(XMOE_MPI OFF)
    set(XMOE_MPI_REASON "MPI not found (Debian: libopenmpi-dev openmpi-bin)")
  endif()
endif()

set(XMOE_CUDA_REASON "")
if(XMOE_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90a)
    endif()
    enable_language(CUDA)
    # CMake 3.25 predates nvcc's C++20 support: teach it the flag.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
    set(CMAKE_CUDA_STANDARD 20)
    find_package(CUDAToolkit REQUIRED)
  else()
    set(XMOE_CUDA OFF)
    set(XMOE_CUDA_REASON "nvcc not found")
  endif()
endif()

# CUTLASS (header-only; the nvidia-cutlass wheel that scripts/install-deps.sh installs): the sm90
# grouped GEMM of the expert layers. Looked for in XMOE_CUTLASS_DIR, then .deps/cutlass (a copy for
# machines without the wheel, e.g. the GPU machine), then the wheel python3 imports. Each is a
# CUTLASS source tree: include/ and tools/util/include/. Without it cuBLAS does every GEMM.
option(XMOE_CUTLASS "Build the CUTLASS sm90 grouped GEMM (needs XMOE_CUDA)" ON)
set(XMOE_CUTLASS_REASON "")
if(XMOE_CUTLASS AND NOT XMOE_CUDA)
  set(XMOE_CUTLASS OFF)
  set(XMOE_CUTLASS_REASON "needs XMOE_CUDA")
elseif(XMOE_CUTLASS)
  set(_cutlass_roots ${XMOE_CUTLASS_DIR} ${CMAKE_SOURCE_DIR}/.deps/cutlass)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c
              "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))"
      OUTPUT_VARIABLE _cutlass_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    list(APPEND _cutlass_roots ${_cutlass_wheel})
  endif()
  foreach(_root IN LISTS _cutlass_roots)
    if(NOT XMOE_CUTLASS_INCLUDE AND EXISTS ${_root}/include/cutlass/gemm/group_array_problem_shape.hpp
       AND EXISTS ${_root}/tools/util/include/cutlass/util/packed_stride.hpp)
      set(XMOE_CUTLASS_INCLUDE ${_root}/include ${_root}/tools/util/include)
    endif()
  endforeach()
  if(NOT XMOE_CUTLASS_INCLUDE)
    set(XMOE_CUTLASS OFF)
    set(XMOE_CUTLASS_REASON "CUTLASS headers not found (pip install --no-deps nvidia-cutlass, or set XMOE_CUTLASS_DIR)")
  elseif(NOT CMAKE_CUDA_ARCHITECTURES MATCHES "90a")
    set(XMOE_CUTLASS OFF)
    set(XMOE_CUTLASS_REASON "needs sm_90a in CMAKE_CUDA_ARCHITECTURES (${CMAKE_CUDA_ARCHITECTURES})")
  endif()
endif()

# cuDNN's fused attention (SDPA forward and backward) for bf16 on the GPU, through the header-only
# cuDNN frontend (the nvidia-cudnn-frontend wheel's headers, which scripts/install-deps.sh copies
# into .deps/cudnn-frontend). cudnn.h and libcudnn come with the CUDA toolkit here and as system
# packages on the GPU machine. Without them the attention runs on xmoe's own kernels.
option(XMOE_CUDNN "Run bf16 attention on cuDNN's fused SDPA (needs XMOE_CUDA)" ON)
set(XMOE_CUDNN_REASON "")
if(XMOE_CUDNN AND NOT XMOE_CUDA)
  set(XMOE_CUDNN OFF)
  set(XMOE_CUDNN_REASON "needs XMOE_CUDA")
elseif(XMOE_CUDNN)
  find_path(XMOE_CUDNN_INCLUDE cudnn.h HINTS ${CUDNN_ROOT}/include $ENV{CUDNN_ROOT}/include
            ${CUDAToolkit_INCLUDE_DIRS} /usr/include/${CMAKE_LIBRARY_ARCHITECTURE})
  find_library(XMOE_CUDNN_LIBRARY NAMES cudnn libcudnn.so.9 HINTS ${CUDNN_ROOT}/lib
               $ENV{CUDNN_ROOT}/lib ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_DIR}/../lib)
  find_path(XMOE_CUDNN_FRONTEND_INCLUDE cudnn_frontend.h
            HINTS ${XMOE_CUDNN_FRONTEND_DIR}/include ${CMAKE_SOURCE_DIR}/.deps/cudnn-frontend/include
            NO_DEFAULT_PATH)
  if(NOT XMOE_CUDNN_INCLUDE OR NOT XMOE_CUDNN_LIBRARY)
    set(XMOE_CUDNN OFF)
    set(XMOE_CUDNN_REASON "cudnn.h / libcudnn not found (set CUDNN_ROOT)")
  elseif(NOT XMOE_CUDNN_FRONTEND_INCLUDE)
    set(XMOE_CUDNN OFF)
    set(XMOE_CUDNN_REASON "cuDNN frontend headers not found (scripts/install-deps.sh, or set XMOE_CUDNN_FRONTEND_DIR)")
  endif()
endif()

set(XMOE_NCCL_REASON "")
if(XMOE_NCCL)
  if(NOT XMOE_CUDA)
    set(XMOE_NCCL OFF)
    set(XMOE_NCCL_REASON "needs XMOE_CUDA")
  elseif(NOT XMOE_MPI)
    set(XMOE_NCCL OFF)
    set(XMOE_NCCL_REASON "needs XMOE_MPI (the NCCL id is broadcast over MPI)")
  else()
    find_path(XMOE_NCCL_INCLUDE nccl.h HINTS ${NCCL_ROOT}/include $ENV{NCCL_ROOT}/include
              ${CUDAToolkit_INCLUDE_DIRS})
    find_library(XMOE_NCCL_LIBRARY nccl HINTS ${NCCL_ROOT}/lib $ENV{NCCL_ROOT}/lib
                 ${CUDAToolkit_LIBRARY_DIR})
    if(NOT XMOE_NCCL_INCLUDE OR NOT XMOE_NCCL_LIBRARY)
      set(XMOE_NCCL OFF)
      set(XMOE_NCCL_REASON "nccl.h / libnccl not found (set NCCL_ROOT)")
    endif()
  endif()
endif()

set(XMOE_TESTS_REASON "")
if(XMOE_TESTS)
  find_package(GTest QUIET)
  if(NOT GTest_FOUND)
    set(XMOE_TESTS OFF)
    set(XMOE_TESTS_REASON "GoogleTest not found (Debian: libgtest-dev)")
  endif()
endif()

set(XMOE_BENCH_REASON "")
if(XMOE_BENCH)
  find_package(benchmark QUIET)
  if(NOT benchmark_FOUND)
    set(XMOE_BENCH_GBENCH OFF)
  else()
    set(XMOE_BENCH_GBENCH ON)
  endif()
endif()
