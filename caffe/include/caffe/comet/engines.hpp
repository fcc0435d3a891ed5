#ifndef CAFFE_COMET_ENGINES_HPP_
#define CAFFE_COMET_ENGINES_HPP_

// COMET-Caffe: which engine the train net's layers get while the activation store is on.
//
// cuDNN's Backward for ReLU, Sigmoid, TanH, Softmax, LRN (cuDNN's LRN across channels, its LCN
// within a channel) and average pooling takes
// both the layer's input and its output (layer_facts.cpp's cuDNN rows), where Caffe's own Backward
// reads the output's sign (ReLU), the output (Sigmoid, TanH, Softmax), or nothing (average
// pooling; LRN recomputes what it needs). With cuDNN's engines the store can free, mask or
// compress almost nothing: on the first GPU run (docs/gpu-check.md) CaffeNet's stored activations
// fell from 873 MB to 9 MB and its device peak was 1.09x lower instead of 1.71x. So, with COMET on,
// those layers whose engine is left to the build (DEFAULT) are given Caffe's engine; convolutions
// keep cuDNN (its Backward reads the input, as Caffe's does). comet { cudnn_engines: true } keeps
// every cuDNN engine; a layer that names its engine keeps it.

#include <string>
#include <vector>

#include "caffe/proto/caffe.pb.h"

namespace caffe {

// Gives Caffe's engine to the layers of net described above when solver has COMET on and
// cudnn_engines false; returns their names (empty: nothing changed). Solver::InitTrainNet calls it
// (patch 0029) before the train net is built; test nets are left as they are.
std::vector<std::string> CometChooseEngines(const SolverParameter& solver, NetParameter* net);

}  // namespace caffe

#endif  // CAFFE_COMET_ENGINES_HPP_
