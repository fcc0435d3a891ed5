# COMET-Caffe: link our compressor library. cometctl build configures and builds sz/ first and
# passes -Dsz_DIR=<its build dir>; our sources under src/caffe/comet/ are found by upstream's glob.
find_package(sz CONFIG REQUIRED)
list(APPEND Caffe_LINKER_LIBS PUBLIC sz::sz)
get_target_property(COMET_SZ_INCLUDES sz::sz INTERFACE_INCLUDE_DIRECTORIES)
# FindCUDA's nvcc rules see directory-level include paths only.
include_directories(${COMET_SZ_INCLUDES})
message(STATUS "COMET: sz compressor from ${sz_DIR}")
