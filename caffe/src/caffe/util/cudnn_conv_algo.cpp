// COMET-Caffe: convolution algorithms for cuDNN 8 and 9 (include/caffe/util/cudnn_conv_algo.hpp).
#ifdef USE_CUDNN
#include <sstream>
#include <string>
#include <vector>

#include "caffe/util/cudnn.hpp"
#include "caffe/util/cudnn_conv_algo.hpp"

namespace caffe {
namespace cudnn {

namespace {

// The first ranked result that cuDNN supports here, within the limit and not a tensor-core variant
// (the descriptor's CUDNN_FMA_MATH keeps the run in FMA arithmetic; a result that the heuristics
// rank for tensor-op math is one it would not run as ranked); -1 if none.
template <typename Perf>
int FirstUsable(const std::vector<Perf>& ranked, int returned, size_t limit, int skip_algo) {
  for (int i = 0; i < returned; ++i) {
    const Perf& p = ranked[i];
    if (p.status != CUDNN_STATUS_SUCCESS || p.memory > limit) continue;
    if (p.mathType == CUDNN_TENSOR_OP_MATH || p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION)
      continue;
    if (static_cast<int>(p.algo) == skip_algo) continue;
    return i;
  }
  return -1;
}

// One direction's algorithm: cuDNN's ranking from `query` (a *_v7 call, given the descriptors a, b,
// conv, c in its own order), its first usable result, or `fallback` when none is.
template <typename A, typename B, typename C, typename Perf>
decltype(Perf::algo) Choose(cudnnStatus_t (*max_count)(cudnnHandle_t, int*),
                            cudnnStatus_t (*query)(cudnnHandle_t, A, B,
                                                   cudnnConvolutionDescriptor_t, C, int, int*,
                                                   Perf*),
                            cudnnHandle_t handle, A a, B b, cudnnConvolutionDescriptor_t conv, C c,
                            size_t limit, int skip_algo, decltype(Perf::algo) fallback) {
  int count = 0, returned = 0;
  CUDNN_CHECK(max_count(handle, &count));
  std::vector<Perf> ranked(count > 0 ? count : 1);
  CUDNN_CHECK(query(handle, a, b, conv, c, count, &returned, &ranked[0]));
  const int i = FirstUsable(ranked, returned, limit, skip_algo);
  return i >= 0 ? ranked[i].algo : fallback;
}

}  // namespace

ConvAlgorithms ChooseConvAlgorithms(cudnnHandle_t handle, cudnnTensorDescriptor_t x,
                                    cudnnFilterDescriptor_t w, cudnnConvolutionDescriptor_t conv,
                                    cudnnTensorDescriptor_t y, size_t workspace_limit,
                                    bool skip_precomp_gemm_fwd) {
  ConvAlgorithms a;
  a.fwd = Choose(cudnnGetConvolutionForwardAlgorithmMaxCount,
                 cudnnGetConvolutionForwardAlgorithm_v7, handle, x, w, conv, y, workspace_limit,
                 skip_precomp_gemm_fwd ? CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM : -1,
                 CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM);
  a.bwd_filter = Choose(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount,
                        cudnnGetConvolutionBackwardFilterAlgorithm_v7, handle, x, y, conv, w,
                        workspace_limit, -1, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0);
  a.bwd_data = Choose(cudnnGetConvolutionBackwardDataAlgorithmMaxCount,
                      cudnnGetConvolutionBackwardDataAlgorithm_v7, handle, w, y, conv, x,
                      workspace_limit, -1, CUDNN_CONVOLUTION_BWD_DATA_ALGO_0);

  // The workspace each chosen algorithm needs, as the calls that run it will be told.
  CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(handle, x, w, conv, y, a.fwd,
                                                      &a.fwd_workspace));
  CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, x, y, conv, w, a.bwd_filter,
                                                             &a.bwd_filter_workspace));
  CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(handle, w, y, conv, x, a.bwd_data,
                                                           &a.bwd_data_workspace));
  return a;
}

std::string DescribeConvAlgorithms(const ConvAlgorithms& a) {
  std::ostringstream os;
  os << "fwd algo " << static_cast<int>(a.fwd) << " (" << a.fwd_workspace << " B), bwd filter algo "
     << static_cast<int>(a.bwd_filter) << " (" << a.bwd_filter_workspace << " B), bwd data algo "
     << static_cast<int>(a.bwd_data) << " (" << a.bwd_data_workspace << " B)";
  return os.str();
}

}  // namespace cudnn
}  // namespace caffe
#endif  // USE_CUDNN
