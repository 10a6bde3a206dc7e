# The fake CUDA runtime (tests/fake_cuda) built as the libcudart.so.N that
# the torch wheel links, and pytorch_replay: PyTorch's own CUDA caching
# allocator (libc10_cuda.so from the wheel) replaying a trace on the CPU over
# it. benchmarks/bench_beside_pytorch.py runs pytorch_replay; a Python
# process that preloads the fake (benchmarks/pytorch_allocator/over_fake.py)
# runs torch itself over it: snapshot_over_fake.py and
# tests/python/test_torch_over_fake.py. Built where the torch wheel has CUDA
# (libc10_cuda.so); a CPU-only wheel has no CUDA allocator to run.
if(NOT Python3_EXECUTABLE)
  find_package(Python3 COMPONENTS Interpreter)
endif()
if(Python3_EXECUTABLE)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c "import os, torch; print(os.path.dirname(torch.__file__))"
    OUTPUT_VARIABLE _torch_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
set(_c10_cuda "${_torch_dir}/lib/libc10_cuda.so")
if(NOT _torch_dir OR NOT EXISTS "${_c10_cuda}" OR NOT CMAKE_OBJDUMP)
  message(STATUS "cotenant: pytorch_replay not built (needs a torch wheel with CUDA for "
                 "${Python3_EXECUTABLE}, and objdump)")
  return()
endif()
execute_process(COMMAND ${CMAKE_OBJDUMP} -p "${_c10_cuda}" OUTPUT_VARIABLE _c10_cuda_headers)
if(NOT _c10_cuda_headers MATCHES "NEEDED +libcudart\\.so\\.([0-9]+)")
  message(STATUS "cotenant: pytorch_replay not built (${_c10_cuda} links no libcudart.so.N)")
  return()
endif()
set(_cudart_major ${CMAKE_MATCH_1})
if(NOT _cudart_major STREQUAL CUDAToolkit_VERSION_MAJOR)
  message(STATUS "cotenant: pytorch_replay not built (torch links libcudart.so.${_cudart_major}; "
                 "the toolkit's headers are CUDA ${CUDAToolkit_VERSION_MAJOR})")
  return()
endif()

# The fake as libcudart.so.N, in a directory of its own so that nothing but
# pytorch_replay (and a process told to look there) finds it. Its symbols
# carry the version node the wheel's libraries ask for. The directory also
# holds libcuda.so.1, a link to the same library: torch's lazy driver stubs
# dlopen that name and find the driver entries they look up there.
set(_fake_cudart_dir ${CMAKE_BINARY_DIR}/fake_cudart)
set(_version_script ${CMAKE_BINARY_DIR}/fake_cudart.map)
file(WRITE ${_version_script}
  "libcudart.so.${_cudart_major} {\n  global: cuda*; __cuda*; cuInit; cuDeviceGetCount; cuGetErrorName; cuDevicePrimaryCtxGetState;\n          fake_cuda_*; extern \"C++\" { fake_cuda::*; };\n  local: *;\n};\n")
add_library(cotenant_fake_cudart SHARED ${PROJECT_SOURCE_DIR}/tests/fake_cuda/fake_cuda.cpp
  ${PROJECT_SOURCE_DIR}/benchmarks/pytorch_allocator/fake_cudart_control.cpp)
target_include_directories(cotenant_fake_cudart PUBLIC ${PROJECT_SOURCE_DIR}/tests/fake_cuda)
target_include_directories(cotenant_fake_cudart SYSTEM PUBLIC ${CUDAToolkit_INCLUDE_DIRS})
target_link_libraries(cotenant_fake_cudart PRIVATE Threads::Threads)
target_link_options(cotenant_fake_cudart PRIVATE "LINKER:--version-script=${_version_script}")
set_target_properties(cotenant_fake_cudart PROPERTIES
  OUTPUT_NAME cudart SOVERSION ${_cudart_major} LIBRARY_OUTPUT_DIRECTORY ${_fake_cudart_dir}
  LINK_DEPENDS ${_version_script})
add_custom_command(TARGET cotenant_fake_cudart POST_BUILD
  COMMAND ${CMAKE_COMMAND} -E create_symlink libcudart.so.${_cudart_major} ${_fake_cudart_dir}/libcuda.so.1)

add_executable(pytorch_replay ${PROJECT_SOURCE_DIR}/benchmarks/pytorch_allocator/pytorch_replay.cpp)
target_include_directories(pytorch_replay SYSTEM PRIVATE "${_torch_dir}/include")
target_link_libraries(pytorch_replay PRIVATE cotenant_fake_cudart "${_c10_cuda}" "${_torch_dir}/lib/libc10.so")
target_compile_options(pytorch_replay PRIVATE -Wall -Wextra)
# The fake's directory first: libc10_cuda.so's libcudart.so.N is then the fake,
# loaded by this program before the wheel's libraries are.
set_target_properties(pytorch_replay PROPERTIES
  BUILD_RPATH "${_fake_cudart_dir};${_torch_dir}/lib" RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR})
message(STATUS "cotenant: pytorch_replay over ${_c10_cuda} (libcudart.so.${_cudart_major} is the fake)")
