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

}  // namespace

ConvAlgorithms ChooseConvAlgorithms(cudnnHandle_t handle, cudnnTensorDescriptor_t x,
                                    cudnnFilterDescriptor_t w, cudnnConvolutionDescriptor_t conv,
                                    cudnnTensorDescriptor_t y, size_t workspace_limit,
                                    bool skip_precomp_gemm_fwd) {
  ConvAlgorithms a;
  int count = 0, returned = 0;

  CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(handle, &count));
  std::vector<cudnnConvolutionFwdAlgoPerf_t> fwd(count > 0 ? count : 1);
  CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(handle, x, w, conv, y, count, &returned,
                                                     &fwd[0]));
  int i = FirstUsable(fwd, returned, workspace_limit,
                      skip_precomp_gemm_fwd ? CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM : -1);
  a.fwd = i >= 0 ? fwd[i].algo : CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;

  CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(handle, &count));
  std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> bf(count > 0 ? count : 1);
  CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, x, y, conv, w, count,
                                                            &returned, &bf[0]));
  i = FirstUsable(bf, returned, workspace_limit, -1);
  a.bwd_filter = i >= 0 ? bf[i].algo : CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0;

  CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(handle, &count));
  std::vector<cudnnConvolutionBwdDataAlgoPerf_t> bd(count > 0 ? count : 1);
  CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, w, y, conv, x, count,
                                                          &returned, &bd[0]));
  i = FirstUsable(bd, returned, workspace_limit, -1);
  a.bwd_data = i >= 0 ? bd[i].algo : CUDNN_CONVOLUTION_BWD_DATA_ALGO_0;

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
