// COMET-Caffe: every row of the layer-facts registry (comet/layer_facts.cpp), proven against the
// layer itself in the spirit of GradientChecker. Each configuration builds the layer, runs
// Forward, poisons every blob whose data the row says Backward does not read (filled with NaN in
// one run, freed in another, so that even touching the pointer fails) and replaces what it reads
// only by sign with 1/0, runs Backward, and requires bottom and parameter diffs bit-identical to
// an unpoisoned run. Every type in Caffe's layer registry must be checked here or listed with
// the reason it cannot be. The rows of the CAFFE engines are checked on the CPU and, where a GPU
// is, on the GPU too; the rows of the cuDNN engines (a cuDNN build) on the GPU.
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

#include "caffe/blob.hpp"
#include "caffe/comet/layer_access.hpp"
#include "caffe/comet/layer_facts.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/common.hpp"
#include "caffe/filler.hpp"
#include "caffe/layer_factory.hpp"
#include "caffe/layers/conv_layer.hpp"
#include "caffe/layers/elu_layer.hpp"
#include "caffe/layers/exp_layer.hpp"
#include "caffe/layers/lrn_layer.hpp"
#include "caffe/layers/pooling_layer.hpp"
#include "caffe/layers/relu_layer.hpp"
#include "caffe/layers/sigmoid_layer.hpp"
#include "caffe/layers/softmax_layer.hpp"
#include "caffe/layers/tanh_layer.hpp"
#ifdef USE_CUDNN
#include "caffe/layers/cudnn_conv_layer.hpp"
#include "caffe/layers/cudnn_lrn_layer.hpp"
#include "caffe/layers/cudnn_pooling_layer.hpp"
#include "caffe/layers/cudnn_relu_layer.hpp"
#endif
#include "caffe/syncedmem.hpp"
#include "caffe/util/math_functions.hpp"

#include "caffe/test/test_caffe_main.hpp"

namespace caffe {

namespace {

// One way to build a layer: its parameter (text), its bottoms, and which of them take gradients.
struct FactConfig {
  std::string name;
  std::string param;                     // LayerParameter text without name and blobs
  std::vector<std::vector<int> > shapes;  // bottoms
  std::vector<int> int_range;            // per bottom: > 0 = integer values in [0, range)
  std::vector<bool> positive;            // per bottom: values in [0.2, 1.2) instead of N(0, 1)
  std::vector<bool> propagate;
  int tops;
  bool in_place;
  bool cudnn;  // the cuDNN engine (else CAFFE, whatever DEFAULT means in this build)
  // Builds the layer instead of the layer factory (cuDNN max pooling, which the factory never makes).
  shared_ptr<Layer<float> > (*make)(const LayerParameter&);
};

class Configs {
 public:
  // A configuration named after its type, in a fluent style.
  Configs& Add(const std::string& name, const std::string& param, int tops = 1) {
    FactConfig c;
    c.name = name;
    c.param = param;
    c.tops = tops;
    c.in_place = false;
    c.cudnn = false;
    c.make = NULL;
    list_.push_back(c);
    return *this;
  }
  Configs& CuDNN() { list_.back().cudnn = true; return *this; }
  Configs& Make(shared_ptr<Layer<float> > (*make)(const LayerParameter&)) {
    list_.back().make = make;
    return *this;
  }
  Configs& Bottom(const std::vector<int>& shape, int int_range = 0, bool positive = false,
                  bool propagate = true) {
    FactConfig& c = list_.back();
    c.shapes.push_back(shape);
    c.int_range.push_back(int_range);
    c.positive.push_back(positive);
    c.propagate.push_back(propagate && int_range == 0);
    return *this;
  }
  Configs& Positive(const std::vector<int>& shape) { return Bottom(shape, 0, true); }
  Configs& Label(const std::vector<int>& shape, int range) { return Bottom(shape, range); }
  Configs& Fixed(const std::vector<int>& shape, bool positive = false) {
    return Bottom(shape, 0, positive, false);
  }
  Configs& InPlace() { list_.back().in_place = true; return *this; }
  const std::vector<FactConfig>& list() const { return list_; }

 private:
  std::vector<FactConfig> list_;
};

std::vector<int> S(int a, int b = -1, int c = -1, int d = -1) {
  std::vector<int> s(1, a);
  if (b >= 0) s.push_back(b);
  if (c >= 0) s.push_back(c);
  if (d >= 0) s.push_back(d);
  return s;
}

const char* kW = " weight_filler { type: 'gaussian' std: 0.5 } bias_filler { type: 'constant' "
                 "value: 0.1 } ";

Configs AllConfigs() {
  const std::vector<int> img = S(2, 3, 5, 5), vec = S(2, 3);
  const std::string w(kW);
  Configs c;
  // neurons
  c.Add("ReLU", "type: 'ReLU'").Bottom(img);
  c.Add("ReLU", "type: 'ReLU'").Bottom(img).InPlace();
  c.Add("ReLU", "type: 'ReLU' relu_param { negative_slope: 0.1 }").Bottom(img);
  c.Add("ReLU", "type: 'ReLU' relu_param { negative_slope: 0.1 }").Bottom(img).InPlace();
  c.Add("PReLU", "type: 'PReLU' prelu_param { filler { type: 'constant' value: 0.3 } }")
      .Bottom(img);
  c.Add("PReLU", "type: 'PReLU' prelu_param { filler { type: 'constant' value: 0.3 } }")
      .Bottom(img).InPlace();
  c.Add("ELU", "type: 'ELU'").Bottom(img);
  c.Add("ELU", "type: 'ELU'").Bottom(img).InPlace();
  c.Add("ELU", "type: 'ELU' elu_param { alpha: -0.5 }").Bottom(img);  // reads the input's sign
  c.Add("AbsVal", "type: 'AbsVal'").Bottom(img);
  c.Add("BNLL", "type: 'BNLL'").Bottom(img);
  c.Add("Clip", "type: 'Clip' clip_param { min: -0.5 max: 0.5 }").Bottom(img);
  c.Add("Log", "type: 'Log'").Positive(img);
  c.Add("Log", "type: 'Log' log_param { base: 2 scale: 2 shift: 0.5 }").Positive(img);
  c.Add("Exp", "type: 'Exp'").Bottom(img);
  c.Add("Exp", "type: 'Exp' exp_param { base: 2 scale: 0.5 }").Bottom(img).InPlace();
  c.Add("Power", "type: 'Power' power_param { power: 1 scale: 2 shift: 1 }").Bottom(img);
  c.Add("Power", "type: 'Power' power_param { power: 2 scale: 0.5 shift: 1 }").Bottom(img);
  c.Add("Power", "type: 'Power' power_param { power: 3 }").Bottom(img);
  c.Add("Power", "type: 'Power' power_param { power: 0.5 scale: 1 shift: 1 }").Positive(img);
  c.Add("Power", "type: 'Power' power_param { power: 2 scale: 0 shift: 1 }").Bottom(img);
  c.Add("Sigmoid", "type: 'Sigmoid'").Bottom(img);
  c.Add("Sigmoid", "type: 'Sigmoid'").Bottom(img).InPlace();
  c.Add("TanH", "type: 'TanH'").Bottom(img);
  c.Add("Swish", "type: 'Swish' swish_param { beta: 1.5 }").Bottom(img);
  c.Add("Swish", "type: 'Swish' swish_param { beta: 1.5 }").Bottom(img).InPlace();
  c.Add("Softmax", "type: 'Softmax'").Bottom(img);
  c.Add("MVN", "type: 'MVN'").Bottom(img);
  c.Add("MVN", "type: 'MVN' mvn_param { across_channels: true eps: 0.01 }").Bottom(img);
  c.Add("MVN", "type: 'MVN' mvn_param { normalize_variance: false across_channels: true }")
      .Bottom(img);
  c.Add("Dropout", "type: 'Dropout' dropout_param { dropout_ratio: 0.4 }").Bottom(img);
  c.Add("Dropout", "type: 'Dropout' dropout_param { dropout_ratio: 0.4 }").Bottom(img).InPlace();
  // weighted
  c.Add("Convolution", "type: 'Convolution' convolution_param { num_output: 4 kernel_size: 3 "
        "pad: 1" + w + "}").Bottom(img);
  c.Add("Convolution", "type: 'Convolution' convolution_param { num_output: 4 kernel_size: 3 "
        "group: 1 stride: 2" + w + "}").Fixed(img);
  c.Add("Deconvolution", "type: 'Deconvolution' convolution_param { num_output: 2 "
        "kernel_size: 2 stride: 2" + w + "}").Bottom(img);
  c.Add("InnerProduct", "type: 'InnerProduct' inner_product_param { num_output: 4" + w + "}")
      .Bottom(img);
  // frozen weights (lr_mult 0), the bias learning or not: the input is not read
  const std::string frozen = " param { lr_mult: 0 } param { lr_mult: 0 } ";
  c.Add("Convolution", "type: 'Convolution' convolution_param { num_output: 4 kernel_size: 3 "
        "pad: 1" + w + "} param { lr_mult: 0 } param { lr_mult: 1 }").Bottom(img);
  c.Add("Deconvolution", "type: 'Deconvolution' convolution_param { num_output: 2 "
        "kernel_size: 2 stride: 2" + w + "}" + frozen).Bottom(img);
  c.Add("InnerProduct", "type: 'InnerProduct' inner_product_param { num_output: 4" + w + "}" +
        frozen).Bottom(img);
  c.Add("Embed", "type: 'Embed' embed_param { input_dim: 5 num_output: 3" + w + "}")
      .Label(S(2, 4), 5);
  c.Add("Scale", "type: 'Scale' scale_param { bias_term: true filler { type: 'gaussian' } }")
      .Bottom(img);
  c.Add("Scale", "type: 'Scale' scale_param { bias_term: true filler { type: 'gaussian' } }")
      .Bottom(img).InPlace();
  c.Add("Scale", "type: 'Scale'").Bottom(img).Bottom(S(3));
  c.Add("Bias", "type: 'Bias' bias_param { filler { type: 'gaussian' } }").Bottom(img);
  c.Add("Bias", "type: 'Bias'").Bottom(img).Bottom(S(3));
  c.Add("BatchNorm", "type: 'BatchNorm'").Bottom(img);
  c.Add("BatchNorm", "type: 'BatchNorm'").Bottom(img).InPlace();
  c.Add("LRN", "type: 'LRN' lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 }").Bottom(img);
  c.Add("LRN", "type: 'LRN' lrn_param { local_size: 3 alpha: 0.5 norm_region: WITHIN_CHANNEL }")
      .Bottom(img);
  // pooling
  c.Add("Pooling", "type: 'Pooling' pooling_param { pool: MAX kernel_size: 3 stride: 2 }")
      .Bottom(img);
  c.Add("Pooling", "type: 'Pooling' pooling_param { pool: MAX kernel_size: 2 stride: 1 }", 2)
      .Bottom(img);
  c.Add("Pooling", "type: 'Pooling' pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }")
      .Bottom(img);
  c.Add("Pooling", "type: 'Pooling' pooling_param { pool: AVE global_pooling: true }")
      .Bottom(img);
  c.Add("SPP", "type: 'SPP' spp_param { pyramid_height: 2 pool: MAX }").Bottom(S(2, 3, 6, 6));
  c.Add("SPP", "type: 'SPP' spp_param { pyramid_height: 1 pool: AVE }").Bottom(S(2, 3, 6, 6));
  // element-wise, reductions
  c.Add("Eltwise", "type: 'Eltwise' eltwise_param { operation: SUM coeff: 1 coeff: -0.5 }")
      .Bottom(img).Bottom(img);
  c.Add("Eltwise", "type: 'Eltwise' eltwise_param { operation: PROD }").Bottom(img).Bottom(img);
  c.Add("Eltwise", "type: 'Eltwise' eltwise_param { operation: PROD stable_prod_grad: false }")
      .Bottom(img).Bottom(img).Bottom(img);
  c.Add("Eltwise", "type: 'Eltwise' eltwise_param { operation: MAX }").Bottom(img).Bottom(img);
  c.Add("Reduction", "type: 'Reduction' reduction_param { operation: SUM axis: 1 }").Bottom(img);
  c.Add("Reduction", "type: 'Reduction' reduction_param { operation: MEAN }").Bottom(img);
  c.Add("Reduction", "type: 'Reduction' reduction_param { operation: ASUM }").Bottom(img);
  c.Add("Reduction", "type: 'Reduction' reduction_param { operation: SUMSQ axis: 1 }")
      .Bottom(img);
  // shapes and routing
  c.Add("Split", "type: 'Split'", 3).Bottom(img);
  c.Add("Flatten", "type: 'Flatten'").Bottom(img);
  c.Add("Reshape", "type: 'Reshape' reshape_param { shape { dim: 0 dim: -1 } }").Bottom(img);
  c.Add("Concat", "type: 'Concat'").Bottom(img).Bottom(S(2, 2, 5, 5));
  c.Add("Concat", "type: 'Concat'").Bottom(img);
  c.Add("Slice", "type: 'Slice' slice_param { slice_point: 1 }", 2).Bottom(img);
  c.Add("Slice", "type: 'Slice'").Bottom(img);
  c.Add("Crop", "type: 'Crop' crop_param { axis: 2 offset: 1 }").Bottom(S(2, 3, 6, 6))
      .Fixed(S(2, 3, 4, 4));
  c.Add("Tile", "type: 'Tile' tile_param { axis: 1 tiles: 2 }").Bottom(img);
  c.Add("Filter", "type: 'Filter'").Bottom(S(6, 3)).Label(S(6, 1), 2);
  c.Add("BatchReindex", "type: 'BatchReindex'").Bottom(S(3, 2, 2, 2)).Label(S(4), 3);
  c.Add("Im2col", "type: 'Im2col' convolution_param { kernel_size: 2 }").Bottom(img);
  c.Add("Silence", "type: 'Silence'", 0).Bottom(img).Bottom(vec);
  // losses
  c.Add("SoftmaxWithLoss", "type: 'SoftmaxWithLoss'").Bottom(vec).Label(S(2), 3);
  c.Add("SoftmaxWithLoss", "type: 'SoftmaxWithLoss' loss_param { ignore_label: 1 "
        "normalization: VALID }").Bottom(S(2, 3, 2, 2)).Label(S(2, 1, 2, 2), 3);
  // (SoftmaxWithLoss with its softmax as a second top cannot be set up on its own: its inner
  // Softmax gets both loss weights. InfogainLoss below covers that row's second top.)
  c.Add("SoftmaxWithLoss", "type: 'SoftmaxWithLoss' loss_param { normalization: NONE }")
      .Bottom(vec).Label(S(2), 3);
  c.Add("InfogainLoss", "type: 'InfogainLoss'").Bottom(vec).Label(S(2), 3).Fixed(S(3, 3), true);
  c.Add("InfogainLoss", "type: 'InfogainLoss' loss_weight: 1 loss_weight: 0 "
        "loss_param { ignore_label: 0 }", 2)
      .Bottom(vec).Label(S(2), 3).Fixed(S(3, 3), true);
  c.Add("SigmoidCrossEntropyLoss", "type: 'SigmoidCrossEntropyLoss'").Bottom(vec)
      .Fixed(vec, true);
  c.Add("SigmoidCrossEntropyLoss", "type: 'SigmoidCrossEntropyLoss' loss_param { "
        "ignore_label: 1 normalization: BATCH_SIZE }").Bottom(vec).Label(vec, 2);
  c.Add("EuclideanLoss", "type: 'EuclideanLoss'").Bottom(vec).Bottom(vec);
  c.Add("HingeLoss", "type: 'HingeLoss'").Bottom(vec).Label(S(2), 3);
  c.Add("HingeLoss", "type: 'HingeLoss' hinge_loss_param { norm: L2 }").Bottom(vec)
      .Label(S(2), 3);
  c.Add("MultinomialLogisticLoss", "type: 'MultinomialLogisticLoss'").Positive(vec)
      .Label(S(2), 3);
  c.Add("ContrastiveLoss", "type: 'ContrastiveLoss' contrastive_loss_param { margin: 2 }")
      .Bottom(S(4, 3, 1, 1)).Bottom(S(4, 3, 1, 1)).Label(S(4, 1, 1, 1), 2);
  c.Add("ContrastiveLoss", "type: 'ContrastiveLoss' contrastive_loss_param { margin: 2 "
        "legacy_version: true }").Bottom(S(4, 3, 1, 1)).Bottom(S(4, 3, 1, 1))
      .Label(S(4, 1, 1, 1), 2);
  return c;
}

#ifdef USE_CUDNN
shared_ptr<Layer<float> > MakeCuDNNPooling(const LayerParameter& p) {
  return shared_ptr<Layer<float> >(new CuDNNPoolingLayer<float>(p));
}

// The cuDNN engines' configurations (run on a GPU: their CPU mode is the CAFFE engines' code).
Configs CuDNNConfigs() {
  const std::vector<int> img = S(2, 3, 5, 5);
  const std::string w(kW);
  Configs c;
  c.Add("Convolution", "type: 'Convolution' convolution_param { num_output: 4 kernel_size: 3 "
        "pad: 1" + w + "}").Bottom(img).CuDNN();
  c.Add("Convolution", "type: 'Convolution' convolution_param { num_output: 6 kernel_size: 3 "
        "group: 3 stride: 2" + w + "}").Bottom(img).CuDNN();
  c.Add("Convolution", "type: 'Convolution' convolution_param { num_output: 4 kernel_size: 3"
        + w + "}").Fixed(img).CuDNN();
  c.Add("Convolution", "type: 'Convolution' convolution_param { num_output: 4 kernel_size: 3 "
        "pad: 1" + w + "} param { lr_mult: 0 } param { lr_mult: 0 }").Bottom(img).CuDNN();
  c.Add("Deconvolution", "type: 'Deconvolution' convolution_param { num_output: 2 "
        "kernel_size: 2 stride: 2" + w + "}").Bottom(img).CuDNN();
  c.Add("ReLU", "type: 'ReLU'").Bottom(img).CuDNN();
  c.Add("ReLU", "type: 'ReLU'").Bottom(img).InPlace().CuDNN();
  c.Add("ReLU", "type: 'ReLU' relu_param { negative_slope: 0.1 }").Bottom(img).CuDNN();
  c.Add("ReLU", "type: 'ReLU' relu_param { negative_slope: 0.1 }").Bottom(img).InPlace().CuDNN();
  c.Add("Sigmoid", "type: 'Sigmoid'").Bottom(img).CuDNN();
  c.Add("Sigmoid", "type: 'Sigmoid'").Bottom(img).InPlace().CuDNN();
  c.Add("TanH", "type: 'TanH'").Bottom(img).CuDNN();
  c.Add("TanH", "type: 'TanH'").Bottom(img).InPlace().CuDNN();
  c.Add("Softmax", "type: 'Softmax'").Bottom(img).CuDNN();
  c.Add("Pooling", "type: 'Pooling' pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }")
      .Bottom(img).CuDNN();
  c.Add("Pooling", "type: 'Pooling' pooling_param { pool: AVE global_pooling: true }")
      .Bottom(img).CuDNN();
  c.Add("Pooling", "type: 'Pooling' pooling_param { pool: MAX kernel_size: 3 stride: 2 }")
      .Bottom(img).CuDNN().Make(&MakeCuDNNPooling);
  c.Add("LRN", "type: 'LRN' lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 }").Bottom(img)
      .CuDNN();
  c.Add("LRN", "type: 'LRN' lrn_param { local_size: 3 alpha: 0.5 norm_region: WITHIN_CHANNEL }")
      .Bottom(S(2, 3, 6, 6)).CuDNN();
  return c;
}
#endif

// The engine of the types that have several: CAFFE, or cuDNN where the configuration asks (in a
// cuDNN build DEFAULT means cuDNN for most of them, and the CAFFE rows are to be checked).
void SetEngine(LayerParameter* lp, bool cudnn) {
  const std::string& t = lp->type();
  if (t == "Convolution" || t == "Deconvolution") {
    lp->mutable_convolution_param()->set_engine(cudnn ? ConvolutionParameter_Engine_CUDNN
                                                      : ConvolutionParameter_Engine_CAFFE);
  } else if (t == "ReLU") {
    lp->mutable_relu_param()->set_engine(cudnn ? ReLUParameter_Engine_CUDNN
                                               : ReLUParameter_Engine_CAFFE);
  } else if (t == "Sigmoid") {
    lp->mutable_sigmoid_param()->set_engine(cudnn ? SigmoidParameter_Engine_CUDNN
                                                  : SigmoidParameter_Engine_CAFFE);
  } else if (t == "TanH") {
    lp->mutable_tanh_param()->set_engine(cudnn ? TanHParameter_Engine_CUDNN
                                               : TanHParameter_Engine_CAFFE);
  } else if (t == "Softmax" || t == "SoftmaxWithLoss" || t == "InfogainLoss") {
    lp->mutable_softmax_param()->set_engine(cudnn ? SoftmaxParameter_Engine_CUDNN
                                                  : SoftmaxParameter_Engine_CAFFE);
  } else if (t == "Pooling") {
    lp->mutable_pooling_param()->set_engine(cudnn ? PoolingParameter_Engine_CUDNN
                                                  : PoolingParameter_Engine_CAFFE);
  } else if (t == "LRN") {
    lp->mutable_lrn_param()->set_engine(cudnn ? LRNParameter_Engine_CUDNN
                                              : LRNParameter_Engine_CAFFE);
  }
}

// Registered types that are not run here, and why; the store treats those without a row as
// reading everything.
std::map<std::string, std::string> Unchecked() {
  std::map<std::string, std::string> u;
  const char* sources[] = {"Data", "DummyData", "Input", "MemoryData", "HDF5Data", "ImageData",
                           "WindowData", "Parameter"};
  for (int i = 0; i < 8; ++i) u[sources[i]] = "no bottoms: nothing of theirs to poison";
  u["Accuracy"] = u["ArgMax"] = u["Threshold"] =
      "no Backward (Net never runs it: the layer does not contribute to a loss)";
  u["HDF5Output"] = "writes a file; its Backward does nothing";
  u["LSTM"] = u["RNN"] = u["LSTMUnit"] = "no row: reads everything";
  u["Python"] = "no row: reads everything";
  return u;
}

struct Outcome {
  std::vector<std::vector<char> > tops;   // the tops' data after Forward
  std::vector<std::vector<char> > diffs;  // bottom diffs that propagate, then parameter diffs
  std::string error;                      // a read of freed memory
  std::string cls;                        // the C++ class the configuration built
};

enum Poison { CLEAN, NAN_FILL, FREED };

float Uniform(unsigned* state, float lo, float hi) {
  *state = *state * 1664525u + 1013904223u;
  return lo + (hi - lo) * ((*state >> 8) / 16777216.f);
}

// Values set just above or just below zero before Backward (the sign check): every third value
// of top[index] (else bottom[index]) becomes `value`.
struct Nudge {
  bool top;
  int index;
  float value;
};

// Builds, runs Forward, poisons what the facts call unread (or nudges), runs Backward.
Outcome RunConfig(const FactConfig& c, Poison poison, CometLayerFacts* facts_out,
                  const Nudge* nudge = NULL) {
  LayerParameter lp;
  CHECK(google::protobuf::TextFormat::ParseFromString(c.param, &lp)) << c.param;
  lp.set_name(c.name);
  lp.set_phase(TRAIN);
  SetEngine(&lp, c.cudnn);
  std::vector<shared_ptr<Blob<float> > > own;
  std::vector<Blob<float>*> bottom, top;
  unsigned state = 1701;
  for (int k = 0; k < c.shapes.size(); ++k) {
    own.push_back(shared_ptr<Blob<float> >(new Blob<float>(c.shapes[k])));
    Blob<float>* b = own.back().get();
    float* d = b->mutable_cpu_data();
    for (int i = 0; i < b->count(); ++i) {
      if (c.int_range[k] > 0) d[i] = static_cast<int>(Uniform(&state, 0, c.int_range[k]));
      else if (c.positive[k]) d[i] = Uniform(&state, 0.2f, 1.2f);
      else d[i] = Uniform(&state, -1.5f, 1.5f);
    }
    bottom.push_back(b);
  }
  for (int k = 0; k < c.tops; ++k) {
    if (k == 0 && c.in_place) {
      top.push_back(bottom[0]);
    } else {
      own.push_back(shared_ptr<Blob<float> >(new Blob<float>()));
      top.push_back(own.back().get());
    }
  }
  Caffe::set_random_seed(1701);
  shared_ptr<Layer<float> > layer = c.make ? c.make(lp) : LayerRegistry<float>::CreateLayer(lp);
  layer->SetUp(bottom, top);
  for (int p = 0; p < lp.param_size() && p < layer->blobs().size(); ++p)  // as Net sets it
    layer->set_param_propagate_down(p, lp.param(p).lr_mult() != 0);
  // A row that says fills_whole: its own tops start as NaN, not zeros (as memory the store
  // freed does), and must come out as in a clean run.
  const bool fills = CometFactsRegistry<float>::Of(*layer, bottom, top).fills_whole;
  // (Memory a top shares with a bottom, in place or as a view, is the bottom's: not poisoned.)
  std::set<const SyncedMemory*> bottom_data;
  for (int k = 0; k < bottom.size(); ++k) bottom_data.insert(bottom[k]->data().get());
  for (int k = 0; k < top.size() && fills && poison == NAN_FILL; ++k) {
    if (bottom_data.count(top[k]->data().get())) continue;
    caffe_set(top[k]->count(), std::numeric_limits<float>::quiet_NaN(), top[k]->mutable_cpu_data());
  }
  Caffe::set_random_seed(2024);
  layer->Forward(bottom, top);
  Outcome out;
  for (int k = 0; k < top.size(); ++k) {
    const char* d = reinterpret_cast<const char*>(top[k]->cpu_data());
    out.tops.push_back(std::vector<char>(d, d + top[k]->count() * sizeof(float)));
  }
  for (int k = 0; k < top.size(); ++k) {
    float* d = top[k]->mutable_cpu_diff();
    for (int i = 0; i < top[k]->count(); ++i) d[i] = Uniform(&state, -1, 1);
  }
  for (int p = 0; p < layer->blobs().size(); ++p)
    caffe_set(layer->blobs()[p]->count(), 0.f, layer->blobs()[p]->mutable_cpu_diff());
  const CometLayerFacts f = CometFactsRegistry<float>::Of(*layer, bottom, top);
  if (facts_out) *facts_out = f;

  // What Backward may use of each distinct blob: the strongest read of any of its places.
  std::map<Blob<float>*, CometRead> read;
  for (int k = 0; k < bottom.size(); ++k) read[bottom[k]] = f.read_bottom(k);
  for (int k = 0; k < top.size(); ++k) {
    std::map<Blob<float>*, CometRead>::iterator it = read.find(top[k]);
    if (it == read.end()) read[top[k]] = f.read_top(k);
    else it->second = std::max(it->second, f.read_top(k));
  }
  // Memory shared between blobs (Split's tops are its bottom) is poisoned only if no place reads it.
  std::map<const SyncedMemory*, CometRead> by_mem;
  for (std::map<Blob<float>*, CometRead>::iterator it = read.begin(); it != read.end(); ++it) {
    const SyncedMemory* m = it->first->data().get();
    by_mem[m] = std::max(by_mem.count(m) ? by_mem[m] : COMET_READS_NOTHING, it->second);
  }
  std::set<const SyncedMemory*> done;
  if (poison != CLEAN) {
    for (std::map<Blob<float>*, CometRead>::iterator it = read.begin(); it != read.end(); ++it) {
      Blob<float>* b = it->first;
      SyncedMemory* m = b->data().get();
      if (!done.insert(m).second || b->count() == 0) continue;
      const CometRead r = by_mem[m];
      if (r == COMET_READS_SIGN) {
        float* d = b->mutable_cpu_data();
        for (int i = 0; i < b->count(); ++i) d[i] = d[i] > 0 ? 1.f : 0.f;
      } else if (r == COMET_READS_NOTHING && poison == NAN_FILL) {
        caffe_set(b->count(), std::numeric_limits<float>::quiet_NaN(), b->mutable_cpu_data());
      } else if (r == COMET_READS_NOTHING && poison == FREED) {
        CometMarkReleased(m, "data of a blob the row calls unread");
      }
    }
  }
  // ... and the bottom diffs it propagates to, unless a top shares one (in place).
  for (int k = 0; k < bottom.size() && fills && poison == NAN_FILL; ++k) {
    bool shared = !c.propagate[k];
    for (int t = 0; t < top.size(); ++t) shared = shared || top[t]->diff() == bottom[k]->diff();
    if (shared) continue;
    caffe_set(bottom[k]->count(), std::numeric_limits<float>::quiet_NaN(),
              bottom[k]->mutable_cpu_diff());
  }
  if (nudge) {
    Blob<float>* b = nudge->top ? top[nudge->index] : bottom[nudge->index];
    float* d = b->mutable_cpu_data();
    for (int i = 0; i < b->count(); i += 3) d[i] = nudge->value;
  }
  out.cls = typeid(*layer).name();
  CometSetReadContext("the Backward of " + c.name + " under test");
  try {
    layer->Backward(top, c.propagate, bottom);
    for (int k = 0; k < bottom.size(); ++k) {
      if (!c.propagate[k]) continue;
      const char* d = reinterpret_cast<const char*>(bottom[k]->cpu_diff());
      out.diffs.push_back(std::vector<char>(d, d + bottom[k]->count() * sizeof(float)));
    }
    for (int p = 0; p < layer->blobs().size(); ++p) {
      const char* d = reinterpret_cast<const char*>(layer->blobs()[p]->cpu_diff());
      out.diffs.push_back(std::vector<char>(d, d + layer->blobs()[p]->count() * sizeof(float)));
    }
  } catch (const std::runtime_error& e) {
    out.error = e.what();
  }
  return out;
}

std::string Describe(const FactConfig& c, const CometLayerFacts& f) {
  std::ostringstream os;
  os << c.name << " {" << c.param << "}" << (c.in_place ? " in place" : "") << ": row bottom [";
  for (int k = 0; k < f.bottom.size(); ++k) os << (k ? " " : "") << f.read_bottom(k);
  os << "] top [";
  for (int k = 0; k < f.top.size(); ++k) os << (k ? " " : "") << f.read_top(k);
  os << "] (0 nothing, 1 sign, 2 values)" << (f.fills_whole ? ", fills_whole" : "");
  return os.str();
}

class CometFactsTest : public ::testing::Test {
 protected:
  virtual void SetUp() {
    Caffe::set_mode(Caffe::CPU);
    CometSetFatalThrows(true);  // a read of freed memory is an exception the test reports
  }
  virtual void TearDown() { CometSetFatalThrows(false); }
};

}  // namespace

// The largest |a - b| over the floats of two diffs, and whether b is NaN or Inf where a is finite.
float MaxAbsDiff(const std::vector<char>& a, const std::vector<char>& b, bool* not_finite) {
  const float* x = reinterpret_cast<const float*>(&a[0]);
  const float* y = reinterpret_cast<const float*>(&b[0]);
  float m = 0;
  for (size_t i = 0; i < a.size() / sizeof(float); ++i) {
    if (std::isfinite(x[i]) && !std::isfinite(y[i])) *not_finite = true;
    m = std::max(m, std::fabs(x[i] - y[i]));
  }
  return m;
}

// Runs every configuration clean, NaN-poisoned and freed; returns how many were checked. The
// diffs must be bit-identical, except where two clean runs already differ (cuDNN's algorithms
// that sum with atomics): then a poisoned run must stay finite and within 4x the clean runs'
// own spread, which a NaN or a read value replaced by 1/0 does not. A configuration marked
// CuDNN() must have built a cuDNN class, every other one a CAFFE engine's.
int CheckRows(const Configs& configs, const char* where) {
  int checked = 0;
  for (int i = 0; i < configs.list().size(); ++i) {
    const FactConfig& c = configs.list()[i];
    CometLayerFacts facts;
    const Outcome clean = RunConfig(c, CLEAN, &facts);
    EXPECT_TRUE(clean.error.empty()) << where << ": " << Describe(c, facts) << ": " << clean.error;
    if (!clean.error.empty()) continue;
    EXPECT_TRUE(facts.known) << where << ": " << c.name << " (" << clean.cls
                             << ") has no row, yet is configured here";
    EXPECT_EQ(c.cudnn, clean.cls.find("CuDNN") != std::string::npos)
        << where << ": " << Describe(c, facts) << " built " << clean.cls;
    const Outcome again = RunConfig(c, CLEAN, NULL);
    const bool exact = again.diffs == clean.diffs;
    std::vector<float> spread(clean.diffs.size(), 0.f);
    for (int d = 0; d < clean.diffs.size() && !exact; ++d) {
      bool nf = false;
      spread[d] = MaxAbsDiff(clean.diffs[d], again.diffs[d], &nf);
      EXPECT_FALSE(nf) << where << ": " << Describe(c, facts) << ": two clean runs, diff " << d;
    }
    const Poison poisons[] = {NAN_FILL, FREED};
    for (int p = 0; p < 2; ++p) {
      const Outcome got = RunConfig(c, poisons[p], NULL);
      const char* how = poisons[p] == NAN_FILL ? "NaN-filled" : "freed";
      EXPECT_TRUE(got.error.empty()) << where << ": " << Describe(c, facts) << ": with unread data "
                                     << how << ", Backward touched it: " << got.error;
      if (!got.error.empty()) continue;
      EXPECT_EQ(clean.diffs.size(), got.diffs.size());
      if (clean.diffs.size() != got.diffs.size()) continue;
      for (int t = 0; t < clean.tops.size(); ++t) {
        bool nf = false;
        MaxAbsDiff(clean.tops[t], got.tops[t], &nf);
        EXPECT_TRUE(exact ? clean.tops[t] == got.tops[t] : !nf)
            << where << ": " << Describe(c, facts) << ": with " << how << " memory, top " << t
            << " after Forward differs from a clean run" << (facts.fills_whole ? " (the row says "
            "fills_whole: Forward must write all of its tops)" : "");
      }
      for (int d = 0; d < clean.diffs.size(); ++d) {
        if (exact) {
          EXPECT_TRUE(clean.diffs[d] == got.diffs[d])
              << where << ": " << Describe(c, facts) << ": with unread data " << how << ", diff "
              << d << " (bottom diffs that propagate, then parameter diffs) changed: the row is wrong";
          continue;
        }
        bool nf = false;
        const float off = MaxAbsDiff(clean.diffs[d], got.diffs[d], &nf);
        EXPECT_TRUE(!nf && off <= 4 * spread[d])
            << where << ": " << Describe(c, facts) << ": with unread data " << how << ", diff " << d
            << " moved by " << off << (nf ? " (not finite)" : "") << " where two clean runs differ by "
            << spread[d] << ": the row is wrong";
      }
    }
    ++checked;
  }
  return checked;
}

TEST_F(CometFactsTest, EveryRowHoldsForItsLayer) {
  EXPECT_GT(CheckRows(AllConfigs(), "CPU"), 80);
}

// Sigmoid, TanH, ELU, Exp and Softmax read their output's values, which may be lossy under the
// derivative rule (the reads themselves are proven with the other rows).
TEST_F(CometFactsTest, SigmoidTanHELUExpAndSoftmaxNameTheirDerivative) {
  Blob<float> x(S(2, 3, 5, 5)), y;
  std::vector<Blob<float>*> bottom(1, &x), top(1, &y);
  LayerParameter lp;
  const CometLayerFacts sig = CometFactsRegistry<float>::Of(SigmoidLayer<float>(lp), bottom, top);
  const CometLayerFacts tanh = CometFactsRegistry<float>::Of(TanHLayer<float>(lp), bottom, top);
  const CometLayerFacts soft = CometFactsRegistry<float>::Of(SoftmaxLayer<float>(lp), bottom, top);
  EXPECT_EQ(sig.derivative, CometLayerFacts::SIGMOID_OF_OUTPUT);
  EXPECT_EQ(tanh.derivative, CometLayerFacts::TANH_OF_OUTPUT);
  EXPECT_EQ(soft.derivative, CometLayerFacts::SOFTMAX_OF_OUTPUT);
  const CometLayerFacts exp = CometFactsRegistry<float>::Of(ExpLayer<float>(lp), bottom, top);
  EXPECT_EQ(exp.derivative, CometLayerFacts::EXP_OF_OUTPUT);
  EXPECT_TRUE(sig.lossy_input && tanh.lossy_input && soft.lossy_input && exp.lossy_input);
  EXPECT_EQ(soft.read_top(0), COMET_READS_VALUE);
  EXPECT_EQ(soft.read_bottom(0), COMET_READS_NOTHING);
  EXPECT_FALSE(sig.adaptive || tanh.adaptive);  // no weights: their own rule
  EXPECT_EQ(sig.read_top(0), COMET_READS_VALUE);
  EXPECT_EQ(sig.read_bottom(0), COMET_READS_NOTHING);
  const CometLayerFacts elu = CometFactsRegistry<float>::Of(ELULayer<float>(lp), bottom, top);
  EXPECT_EQ(elu.derivative, CometLayerFacts::ELU_OF_OUTPUT);
  EXPECT_TRUE(elu.lossy_input);
  // where y > 0 (exactly where x > 0 with alpha >= 0; patch 0042), dx = dy: y's signs exact
  EXPECT_EQ(elu.read_bottom(0), COMET_READS_NOTHING);
  EXPECT_EQ(elu.read_top(0), COMET_READS_VALUE);
  EXPECT_TRUE(elu.exact_sign);
  lp.mutable_elu_param()->set_alpha(-0.5);  // x > 0 no longer follows from y: x's sign is read
  const CometLayerFacts neg = CometFactsRegistry<float>::Of(ELULayer<float>(lp), bottom, top);
  EXPECT_EQ(neg.read_bottom(0), COMET_READS_SIGN);
  EXPECT_EQ(neg.read_top(0), COMET_READS_VALUE);
}

// The largest change of any diff between two runs whose blob (top or bottom `index`) has every
// third value at +d and at -d: about 2 d times Backward's slope where it is continuous in that
// sign, the size of the jump where it branches on it.
float SignJump(const FactConfig& c, bool top, int index, float d = 1e-5f) {
  const Nudge up = {top, index, d}, down = {top, index, -d};
  const Outcome a = RunConfig(c, CLEAN, NULL, &up), b = RunConfig(c, CLEAN, NULL, &down);
  CHECK(a.error.empty() && b.error.empty() && a.diffs.size() == b.diffs.size()) << c.name;
  float m = 0;
  for (size_t k = 0; k < a.diffs.size(); ++k) {
    bool not_finite = false;
    m = std::max(m, MaxAbsDiff(a.diffs[k], b.diffs[k], &not_finite));
    if (not_finite) return std::numeric_limits<float>::infinity();
  }
  return m;
}

// What the store may keep lossy (a bottom the row reads as values with lossy_input, an output the
// derivative rule reads) changes sign within any bound where it is near 0. A Backward that
// branches on that sign (PReLU: dx = dy or a dy; ELU unless alpha is 1) needs its row to say
// exact_sign, so that the store keeps the signs beside the stream; every row without it must be
// continuous there. The check can fail: PReLU's and ELU's jumps show.
TEST_F(CometFactsTest, ARowWithoutExactSignIsContinuousInTheSignsOfItsLossyReads) {
  const Configs configs = AllConfigs();
  int checked = 0;
  for (int i = 0; i < configs.list().size(); ++i) {
    const FactConfig& c = configs.list()[i];
    CometLayerFacts f;
    if (!RunConfig(c, CLEAN, &f).error.empty() || f.exact_sign) continue;
    for (int k = 0; k < c.shapes.size(); ++k) {
      if (!f.lossy_input || f.read_bottom(k) != COMET_READS_VALUE || c.int_range[k] > 0) continue;
      EXPECT_LT(SignJump(c, false, k), 0.01f) << Describe(c, f) << ": bottom " << k
                                              << " near 0 (no exact_sign in the row)";
      ++checked;
    }
    for (int t = 0; t < c.tops && f.derivative != CometLayerFacts::NO_DERIVATIVE; ++t) {
      if (f.read_top(t) != COMET_READS_VALUE) continue;
      EXPECT_LT(SignJump(c, true, t), 0.01f) << Describe(c, f) << ": top " << t
                                             << " near 0 (no exact_sign in the row)";
      ++checked;
    }
  }
  EXPECT_GT(checked, 15);  // 18: convolutions, inner products, Scale, LRN, the derivative rule's
  Configs branch;
  branch.Add("PReLU", "type: 'PReLU' prelu_param { filler { type: 'constant' value: 0.3 } }")
      .Bottom(S(2, 3, 5, 5));
  branch.Add("ELU", "type: 'ELU' elu_param { alpha: 0.5 }").Bottom(S(2, 3, 5, 5));
  const bool tops[] = {false, true};  // PReLU reads its input, ELU its output
  for (int i = 0; i < 2; ++i) {
    const FactConfig& c = branch.list()[i];
    CometLayerFacts f;
    ASSERT_TRUE(RunConfig(c, CLEAN, &f).error.empty());
    EXPECT_TRUE(f.exact_sign) << c.name;
    EXPECT_GT(SignJump(c, tops[i], 0), 0.05f) << c.name << ": the check sees the branch";
  }
}

// LRN reads its input's values, lossy under LRN's rule, in both regions. Within a channel its
// backward reads its internal outputs (computed again from the input) and never its own output,
// on the CPU and the GPU alike (the read is proven with the other rows).
TEST_F(CometFactsTest, LRNWithinAChannelRecomputesItsInternalsAndReadsNoOutput) {
  Blob<float> x(S(2, 3, 5, 5)), y;
  std::vector<Blob<float>*> bottom(1, &x), top(1, &y);
  LayerParameter lp;
  lp.mutable_lrn_param()->set_norm_region(LRNParameter_NormRegion_WITHIN_CHANNEL);
  LRNLayer<float> within(lp);
  within.SetUp(bottom, top);
  const CometLayerFacts f = CometFactsRegistry<float>::Of(within, bottom, top);
  EXPECT_EQ(f.private_buffer, CometLayerFacts::LRN_WITHIN);
  EXPECT_TRUE(f.lossy_input);
  EXPECT_FALSE(f.adaptive);  // no weights: LRN's own rule
  EXPECT_EQ(f.read_bottom(0), COMET_READS_VALUE);
  EXPECT_EQ(f.read_top(0), COMET_READS_NOTHING);
  for (int p = 0; p < 3; ++p) {
    ASSERT_TRUE(CometLayerAccess<float>::lrn_recomputed(&within, p) != NULL) << p;
    EXPECT_EQ(CometLayerAccess<float>::lrn_recomputed(&within, p)->count(), x.count()) << p;
  }
  EXPECT_TRUE(CometLayerAccess<float>::lrn_recomputed(&within, 3) == NULL);
  EXPECT_EQ(CometLayerAccess<float>::lrn_internal_diffs(&within).size(), 5);
  LRNLayer<float> across((LayerParameter()));
  across.SetUp(bottom, top);
  EXPECT_EQ(CometFactsRegistry<float>::Of(across, bottom, top).private_buffer,
            CometLayerFacts::LRN_SCALE);
  EXPECT_TRUE(CometLayerAccess<float>::lrn_internal_diffs(&across).empty());
}

#ifndef CPU_ONLY
// The same rows with the layers' Backward_gpu (the rows promise both).
TEST_F(CometFactsTest, EveryRowHoldsOnTheGPU) {
  Caffe::set_mode(Caffe::GPU);
  EXPECT_GT(CheckRows(AllConfigs(), "GPU"), 80);
}
#endif

#ifdef USE_CUDNN
// The cuDNN engines' rows, with cuDNN's Backward: upstream's CuDNN* classes (the layer factory's
// choice for DEFAULT in this build) each have a row of their own.
TEST_F(CometFactsTest, EveryCuDNNRowHoldsOnTheGPU) {
  Caffe::set_mode(Caffe::GPU);
  EXPECT_EQ(CheckRows(CuDNNConfigs(), "GPU, cuDNN"), CuDNNConfigs().list().size());
}

// Without a GPU: a cuDNN layer instance gets its class's row, not its CAFFE parent's (ReLU's
// sign mask, max pooling's argmax and LRN's scale_ are facts of the parents' Backward only).
TEST_F(CometFactsTest, CuDNNClassesHaveRowsOfTheirOwn) {
  Blob<float> x(S(2, 3, 5, 5)), y;
  std::vector<Blob<float>*> bottom(1, &x), top(1, &y);
  LayerParameter lp;
  lp.set_type("ReLU");
  const CometLayerFacts relu = CometFactsRegistry<float>::Of(ReLULayer<float>(lp), bottom, top);
  const CometLayerFacts cudnn_relu =
      CometFactsRegistry<float>::Of(CuDNNReLULayer<float>(lp), bottom, top);
  EXPECT_TRUE(cudnn_relu.known);
  EXPECT_EQ(relu.read_bottom(0), COMET_READS_SIGN);
  EXPECT_TRUE(relu.relu_from_mask);
  EXPECT_EQ(cudnn_relu.read_bottom(0), COMET_READS_VALUE);
  EXPECT_EQ(cudnn_relu.read_top(0), COMET_READS_VALUE);
  EXPECT_FALSE(cudnn_relu.relu_from_mask);
  lp.mutable_relu_param()->set_negative_slope(0.1f);  // upstream's cuDNN ReLU falls back to Caffe's
  EXPECT_TRUE(CometFactsRegistry<float>::Of(CuDNNReLULayer<float>(lp), bottom, top).relu_from_mask);

  LayerParameter pp;
  pp.set_type("Pooling");
  pp.mutable_pooling_param()->set_pool(PoolingParameter_PoolMethod_MAX);
  pp.mutable_pooling_param()->set_kernel_size(2);
  const CometLayerFacts pool = CometFactsRegistry<float>::Of(PoolingLayer<float>(pp), bottom, top);
  const CometLayerFacts cudnn_pool =
      CometFactsRegistry<float>::Of(CuDNNPoolingLayer<float>(pp), bottom, top);
  EXPECT_EQ(pool.private_buffer, CometLayerFacts::MAX_ARGMAX);
  EXPECT_EQ(cudnn_pool.private_buffer, CometLayerFacts::NO_PRIVATE);
  EXPECT_EQ(cudnn_pool.read_bottom(0), COMET_READS_VALUE);
  EXPECT_EQ(cudnn_pool.read_top(0), COMET_READS_VALUE);

  LayerParameter np;
  np.set_type("LRN");
  const CometLayerFacts lrn = CometFactsRegistry<float>::Of(LRNLayer<float>(np), bottom, top);
  const CometLayerFacts cudnn_lrn =
      CometFactsRegistry<float>::Of(CuDNNLRNLayer<float>(np), bottom, top);
  EXPECT_EQ(lrn.private_buffer, CometLayerFacts::LRN_SCALE);
  EXPECT_TRUE(lrn.lossy_input);
  EXPECT_EQ(cudnn_lrn.private_buffer, CometLayerFacts::NO_PRIVATE);
  EXPECT_FALSE(cudnn_lrn.lossy_input);  // the LRN bound rule is derived for Caffe's scale_ form

  LayerParameter cp;
  cp.set_type("Convolution");
  const CometLayerFacts conv =
      CometFactsRegistry<float>::Of(CuDNNConvolutionLayer<float>(cp), bottom, top);
  EXPECT_TRUE(conv.known && conv.lossy_input && conv.adaptive);
  EXPECT_EQ(conv.read_bottom(0), COMET_READS_VALUE);
  EXPECT_EQ(conv.read_top(0), COMET_READS_NOTHING);
}
#endif

TEST_F(CometFactsTest, EveryRegisteredTypeIsCheckedOrListed) {
  const Configs configs = AllConfigs();
  std::set<std::string> configured;
  for (int i = 0; i < configs.list().size(); ++i) configured.insert(configs.list()[i].name);
  const std::map<std::string, std::string> unchecked = Unchecked();
  const std::vector<std::string> types = LayerRegistry<float>::LayerTypeList();
  for (int i = 0; i < types.size(); ++i) {
    EXPECT_TRUE(configured.count(types[i]) || unchecked.count(types[i]))
        << "layer type " << types[i] << " is registered but neither checked by "
        << "test_comet_facts.cpp nor listed there with a reason: add a configuration (and a "
        << "row in comet/layer_facts.cpp if its Backward reads less than everything)";
  }
  // Rows only for types that exist, and none for a type we say has none.
  const std::vector<std::string> rows = CometFactsRegistry<float>::KnownTypes();
  for (int i = 0; i < rows.size(); ++i) {
    EXPECT_TRUE(configured.count(rows[i]) || unchecked.count(rows[i])) << rows[i];
    if (unchecked.count(rows[i])) {
      EXPECT_EQ(unchecked.find(rows[i])->second.find("no row"), std::string::npos) << rows[i];
    }
  }
}

// The checker itself can fail: a row that calls a read input unread is caught.
TEST_F(CometFactsTest, TheCheckerCatchesAWrongRow) {
  Configs c;
  c.Add("Power", "type: 'Power' power_param { power: 3 }").Bottom(S(2, 3, 4, 4));
  const FactConfig& cfg = c.list()[0];
  CometLayerFacts facts;
  const Outcome clean = RunConfig(cfg, CLEAN, &facts);
  ASSERT_EQ(facts.read_bottom(0), COMET_READS_VALUE);
  // A row that calls power 3's input unread: the NaN run must differ from the clean one.
  LayerParameter lp;
  CHECK(google::protobuf::TextFormat::ParseFromString(cfg.param, &lp));
  Blob<float> x(S(2, 3, 4, 4)), y;
  std::vector<Blob<float>*> bottom(1, &x), top(1, &y);
  caffe_set(x.count(), 0.7f, x.mutable_cpu_data());
  shared_ptr<Layer<float> > layer = LayerRegistry<float>::CreateLayer(lp);
  layer->SetUp(bottom, top);
  layer->Forward(bottom, top);
  caffe_set(y.count(), 1.f, y.mutable_cpu_diff());
  caffe_set(x.count(), std::numeric_limits<float>::quiet_NaN(), x.mutable_cpu_data());
  layer->Backward(top, std::vector<bool>(1, true), bottom);
  EXPECT_TRUE(std::isnan(x.cpu_diff()[0])) << "poisoning an input that is read shows";
  // and freeing it is an exception naming it
  CometMarkReleased(x.data().get(), "data of blob 'x'");
  bool threw = false;
  try {
    layer->Backward(top, std::vector<bool>(1, true), bottom);
  } catch (const std::runtime_error& e) {
    threw = std::string(e.what()).find("data of blob 'x' was freed") != std::string::npos;
  }
  EXPECT_TRUE(threw);
  EXPECT_FALSE(clean.diffs.empty());
}

// An engine's subclass does not inherit its parent's row: facts are keyed by the C++ class.
template <typename Dtype>
class ReLUSubclassForTest : public ReLULayer<Dtype> {
 public:
  explicit ReLUSubclassForTest(const LayerParameter& p) : ReLULayer<Dtype>(p) {}
};

TEST_F(CometFactsTest, ASubclassReadsEverything) {
  LayerParameter lp;
  lp.set_type("ReLU");
  ReLUSubclassForTest<float> sub(lp);
  ReLULayer<float> relu(lp);
  Blob<float> x(S(2, 3)), y;
  std::vector<Blob<float>*> bottom(1, &x), top(1, &y);
  EXPECT_TRUE(CometFactsRegistry<float>::Knows(relu));
  EXPECT_FALSE(CometFactsRegistry<float>::Knows(sub));
  const CometLayerFacts f = CometFactsRegistry<float>::Of(sub, bottom, top);
  EXPECT_FALSE(f.known);
  EXPECT_EQ(f.read_bottom(0), COMET_READS_VALUE);
  EXPECT_EQ(f.read_top(0), COMET_READS_VALUE);
  EXPECT_FALSE(f.relu_from_mask);
  EXPECT_FALSE(f.fills_whole);  // nor the promise to write all of its top and bottom diff
  EXPECT_EQ(CometFactsRegistry<float>::Of(relu, bottom, top).read_bottom(0), COMET_READS_SIGN);
  EXPECT_TRUE(CometFactsRegistry<float>::Of(relu, bottom, top).fills_whole);
}

}  // namespace caffe
