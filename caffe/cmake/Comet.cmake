# COMET-Caffe: link our compressor library. cometctl build configures and builds sz/ first and
# passes -Dsz_DIR=<its build dir>; our sources under src/caffe/comet/ are found by upstream's glob.
find_package(sz CONFIG REQUIRED)
list(APPEND Caffe_LINKER_LIBS PUBLIC sz::sz)
get_target_property(COMET_SZ_INCLUDES sz::sz INTERFACE_INCLUDE_DIRECTORIES)
# FindCUDA's nvcc rules see directory-level include paths only.
include_directories(${COMET_SZ_INCLUDES})
message(STATUS "COMET: sz compressor from ${sz_DIR}")
# What the CUDA variant uses, in one line that cometctl build repeats (and checks against what it
# asked for): upstream's detect_cuDNN builds without cuDNN, silently, when it finds none.
if(CPU_ONLY)
  message(STATUS "COMET: CPU_ONLY ON, USE_CUDNN OFF, USE_NCCL OFF")
else()
  if(USE_CUDNN AND HAVE_CUDNN)
    set(COMET_CUDNN_SAYS "ON (cuDNN ${CUDNN_VERSION}, ${CUDNN_LIBRARY})")
  elseif(USE_CUDNN)
    set(COMET_CUDNN_SAYS "OFF (asked for, not found)")
  else()
    set(COMET_CUDNN_SAYS "OFF")
  endif()
  if(USE_NCCL)
    set(COMET_NCCL_SAYS "ON (${NCCL_LIBRARIES})")
  else()
    set(COMET_NCCL_SAYS "OFF")
  endif()
  message(STATUS "COMET: CPU_ONLY OFF, USE_CUDNN ${COMET_CUDNN_SAYS}, USE_NCCL ${COMET_NCCL_SAYS}")
endif()
