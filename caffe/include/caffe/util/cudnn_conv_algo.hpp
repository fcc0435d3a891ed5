#ifndef CAFFE_UTIL_CUDNN_CONV_ALGO_HPP_
#define CAFFE_UTIL_CUDNN_CONV_ALGO_HPP_
#ifdef USE_CUDNN

// COMET-Caffe: how the cuDNN convolution layers choose their algorithms with cuDNN 8 and 9.
//
// Upstream asked cudnnGetConvolution{Forward,BackwardFilter,BackwardData}Algorithm for the best
// algorithm within a workspace limit (CUDNN_CONVOLUTION_*_SPECIFY_WORKSPACE_LIMIT); cuDNN 8 removed
// those calls. Their successors, the *_v7 queries, return every algorithm ranked by cuDNN's
// heuristics with the workspace each needs; this takes, per direction, the first one that is
// supported, is not a tensor-core variant and needs at most the limit. The convolution descriptor
// is set to CUDNN_FMA_MATH (cudnn.hpp): plain FP32/FP64 arithmetic, no TF32 rounding, so the cuDNN
// engine computes what the CAFFE engine computes within float rounding and upstream's gradient
// checks hold. When none qualifies, the algorithms that need no workspace (IMPLICIT_GEMM, ALGO_0).

#include <cudnn.h>

#include <cstddef>
#include <string>

namespace caffe {
namespace cudnn {

struct ConvAlgorithms {
  cudnnConvolutionFwdAlgo_t fwd;
  cudnnConvolutionBwdFilterAlgo_t bwd_filter;
  cudnnConvolutionBwdDataAlgo_t bwd_data;
  size_t fwd_workspace, bwd_filter_workspace, bwd_data_workspace;  // bytes
};

// For the convolution x (*) w = y that (x, w, conv, y) describe (conv's math type must be
// CUDNN_FMA_MATH, as setConvolutionDesc leaves it): the forward algorithm (x, w -> y), the filter
// gradient's (x, dy -> dw) and the data gradient's (w, dy -> dx), each needing at most
// workspace_limit bytes. skip_precomp_gemm_fwd leaves IMPLICIT_PRECOMP_GEMM out of the forward
// choice (upstream's deconvolution found it wrong for its use of the forward pass).
ConvAlgorithms ChooseConvAlgorithms(cudnnHandle_t handle, cudnnTensorDescriptor_t x,
                                    cudnnFilterDescriptor_t w, cudnnConvolutionDescriptor_t conv,
                                    cudnnTensorDescriptor_t y, size_t workspace_limit,
                                    bool skip_precomp_gemm_fwd);

// "fwd IMPLICIT_GEMM (0 B), bwd filter ALGO_1 (4096 B), bwd data ALGO_1 (0 B)", for the log.
std::string DescribeConvAlgorithms(const ConvAlgorithms& a);

}  // namespace cudnn
}  // namespace caffe

#endif  // USE_CUDNN
#endif  // CAFFE_UTIL_CUDNN_CONV_ALGO_HPP_
