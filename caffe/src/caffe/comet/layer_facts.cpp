// COMET-Caffe: the rows of the layer-facts registry (include/caffe/comet/layer_facts.hpp).
// Each row states what the class's Backward_cpu and Backward_gpu read of its bottoms' and tops'
// data, and which memory it shares; test_comet_facts.cpp checks every row by running the layer
// with everything the row calls unread poisoned (NaN, or freed) and comparing the diffs bit for bit.
#include <map>
#include <set>
#include <string>
#include <vector>

#include "caffe/comet/layer_facts.hpp"
#include "caffe/layers/absval_layer.hpp"
#include "caffe/layers/accuracy_layer.hpp"
#include "caffe/layers/argmax_layer.hpp"
#include "caffe/layers/batch_norm_layer.hpp"
#include "caffe/layers/batch_reindex_layer.hpp"
#include "caffe/layers/bias_layer.hpp"
#include "caffe/layers/bnll_layer.hpp"
#include "caffe/layers/clip_layer.hpp"
#include "caffe/layers/concat_layer.hpp"
#include "caffe/layers/contrastive_loss_layer.hpp"
#include "caffe/layers/conv_layer.hpp"
#include "caffe/layers/crop_layer.hpp"
#include "caffe/layers/data_layer.hpp"
#include "caffe/layers/deconv_layer.hpp"
#include "caffe/layers/dropout_layer.hpp"
#include "caffe/layers/dummy_data_layer.hpp"
#include "caffe/layers/eltwise_layer.hpp"
#include "caffe/layers/elu_layer.hpp"
#include "caffe/layers/embed_layer.hpp"
#include "caffe/layers/euclidean_loss_layer.hpp"
#include "caffe/layers/exp_layer.hpp"
#include "caffe/layers/filter_layer.hpp"
#include "caffe/layers/flatten_layer.hpp"
#include "caffe/layers/hdf5_data_layer.hpp"
#include "caffe/layers/hdf5_output_layer.hpp"
#include "caffe/layers/hinge_loss_layer.hpp"
#include "caffe/layers/im2col_layer.hpp"
#include "caffe/layers/infogain_loss_layer.hpp"
#include "caffe/layers/inner_product_layer.hpp"
#include "caffe/layers/input_layer.hpp"
#include "caffe/layers/log_layer.hpp"
#include "caffe/layers/lrn_layer.hpp"
#include "caffe/layers/memory_data_layer.hpp"
#include "caffe/layers/multinomial_logistic_loss_layer.hpp"
#include "caffe/layers/mvn_layer.hpp"
#include "caffe/layers/parameter_layer.hpp"
#include "caffe/layers/pooling_layer.hpp"
#include "caffe/layers/power_layer.hpp"
#include "caffe/layers/prelu_layer.hpp"
#include "caffe/layers/reduction_layer.hpp"
#include "caffe/layers/relu_layer.hpp"
#include "caffe/layers/reshape_layer.hpp"
#include "caffe/layers/scale_layer.hpp"
#include "caffe/layers/sigmoid_cross_entropy_loss_layer.hpp"
#include "caffe/layers/sigmoid_layer.hpp"
#include "caffe/layers/silence_layer.hpp"
#include "caffe/layers/slice_layer.hpp"
#include "caffe/layers/softmax_layer.hpp"
#include "caffe/layers/softmax_loss_layer.hpp"
#include "caffe/layers/split_layer.hpp"
#include "caffe/layers/spp_layer.hpp"
#include "caffe/layers/swish_layer.hpp"
#include "caffe/layers/tanh_layer.hpp"
#include "caffe/layers/threshold_layer.hpp"
#include "caffe/layers/tile_layer.hpp"
#ifdef USE_OPENCV
#include "caffe/layers/image_data_layer.hpp"
#include "caffe/layers/window_data_layer.hpp"
#endif
#ifdef USE_CUDNN
#include "caffe/layers/cudnn_conv_layer.hpp"
#include "caffe/layers/cudnn_deconv_layer.hpp"
#include "caffe/layers/cudnn_lcn_layer.hpp"
#include "caffe/layers/cudnn_lrn_layer.hpp"
#include "caffe/layers/cudnn_pooling_layer.hpp"
#include "caffe/layers/cudnn_relu_layer.hpp"
#include "caffe/layers/cudnn_sigmoid_layer.hpp"
#include "caffe/layers/cudnn_softmax_layer.hpp"
#include "caffe/layers/cudnn_tanh_layer.hpp"
#endif

namespace caffe {

namespace {

template <typename Dtype>
struct Row {
  std::string type;
  typename CometFactsRegistry<Dtype>::Describe describe;
};

template <typename Dtype>
std::map<std::string, Row<Dtype> >& Rows() {  // keyed by typeid(...).name()
  static std::map<std::string, Row<Dtype> >* rows = new std::map<std::string, Row<Dtype> >();
  return *rows;
}

void All(std::vector<CometRead>* v, CometRead r) { v->assign(v->size(), r); }

// ----------------------------------------------------------------------------------------- rows
// Backward reads nothing of any blob's data (the diffs, and buffers of its own, only).
template <typename Dtype>
void ReadsNothing(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts*) {}

// Backward reads its input's values, never its output (x -> f(x) with f' from x).
template <typename Dtype>
void ReadsBottom(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  All(&f->bottom, COMET_READS_VALUE);
}

// Swish: y' = sigma(beta x) (1 + beta x (1 - sigma(beta x))) from beta x alone (patch 0038),
// lossy under the derivative rule: not in place from its input, and its sigmoid's input and output
// (each as large as x) are not read after the forward; in place from the sigmoid's input, and
// neither the blob nor the sigmoid's output is read.
template <typename Dtype>
void SwishRow(const Layer<Dtype>&, const CometLayerShape& s, CometLayerFacts* f) {
  f->lossy_input = true;
  if (s.in_place) {
    f->derivative = CometLayerFacts::SWISH_OF_SCALED_INPUT;
    f->private_buffer = CometLayerFacts::SWISH_IN_PLACE;
    return;
  }
  All(&f->bottom, COMET_READS_VALUE);
  f->derivative = CometLayerFacts::SWISH_OF_INPUT;
  f->private_buffer = CometLayerFacts::SWISH_SIGMOID;
}

// f' from the output's values, lossy under the derivative rule (`kind`: how f' follows from y).
void FromOutput(CometLayerFacts* f, CometLayerFacts::Derivative kind) {
  All(&f->top, COMET_READS_VALUE);
  f->lossy_input = true;
  f->derivative = kind;
}

template <typename Dtype>
void SigmoidRow(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  FromOutput(f, CometLayerFacts::SIGMOID_OF_OUTPUT);
}

template <typename Dtype>
void TanHRow(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  FromOutput(f, CometLayerFacts::TANH_OF_OUTPUT);
}

template <typename Dtype>
void ExpRow(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  FromOutput(f, CometLayerFacts::EXP_OF_OUTPUT);
}

template <typename Dtype>
void SoftmaxRow(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  FromOutput(f, CometLayerFacts::SOFTMAX_OF_OUTPUT);
}

// ELU: dx = dy where x > 0, dy (alpha + y) elsewhere, from its output's values. With alpha >= 0
// y > 0 exactly where x > 0, and Backward takes the branch from y (patch 0042): the input is not
// read, the output's signs must stay exact. With alpha < 0 it reads the input's sign.
template <typename Dtype>
void ELURow(const Layer<Dtype>& l, const CometLayerShape&, CometLayerFacts* f) {
  FromOutput(f, CometLayerFacts::ELU_OF_OUTPUT);
  if (l.layer_param().elu_param().alpha() >= 0) f->exact_sign = true;
  else All(&f->bottom, COMET_READS_SIGN);
}

template <typename Dtype>
void ReadsBoth(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  All(&f->bottom, COMET_READS_VALUE);
  All(&f->top, COMET_READS_VALUE);
}

// MVN: dx from dy alone for mean subtraction; with normalize_variance from the output too, and
// from its per-group standard deviation (patch 0037: upstream fetched the input for nothing),
// which it broadcasts into temp_, scratch between the passes.
template <typename Dtype>
void MVNRow(const Layer<Dtype>& l, const CometLayerShape&, CometLayerFacts* f) {
  if (l.layer_param().mvn_param().normalize_variance()) All(&f->top, COMET_READS_VALUE);
  f->private_buffer = CometLayerFacts::MVN_TEMP;
}

// Convolution, InnerProduct, Deconvolution: dW = sum x (x) dy reads x (Deconvolution: x against
// its output gradient's columns); dx reads only W and dy. So no input with the weights frozen
// (lr_mult 0: Net leaves param_propagate_down(0) false; patch 0036 for the two convolutions).
template <typename Dtype>
void WeightedLinear(const Layer<Dtype>& l, const CometLayerShape&, CometLayerFacts* f) {
  Layer<Dtype>& layer = const_cast<Layer<Dtype>&>(l);  // param_propagate_down is not const
  if (!layer.blobs().empty() && !layer.param_propagate_down(0)) return;  // set up, and frozen
  All(&f->bottom, COMET_READS_VALUE);
  f->lossy_input = true;
  f->adaptive = true;
}

// Convolution and Deconvolution (Caffe's engine): WeightedLinear, and the column buffer of one
// image that each pass writes whole before reading it (CONV_COLUMNS).
template <typename Dtype>
void ConvolutionRow(const Layer<Dtype>& l, const CometLayerShape& s, CometLayerFacts* f) {
  f->private_buffer = CometLayerFacts::CONV_COLUMNS;
  WeightedLinear(l, s, f);
}

template <typename Dtype>
void ReLURow(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  f->bottom[0] = COMET_READS_SIGN;  // in place: the output, whose sign is the input's
  f->relu_from_mask = true;
}

// AbsVal's gradient needs sign(x) in {-1, 0, 1}, more than one bit: its row is ReadsBottom.

template <typename Dtype>
void PowerRow(const Layer<Dtype>& l, const CometLayerShape&, CometLayerFacts* f) {
  const PowerParameter& p = l.layer_param().power_param();
  if (p.power() * p.scale() == 0 || p.power() == 1) return;  // a constant gradient
  f->bottom[0] = COMET_READS_VALUE;
  if (p.power() != 2) f->top[0] = COMET_READS_VALUE;  // power * y / x, or with a shift
}

// PReLU: dx = dy (x > 0 ? 1 : a) and da = sum over x <= 0 of x dy per channel (one sum with
// channel_shared): the values within a bound under the weight rule, the signs exactly. In place
// it reads its own copy of the input, not the blob (patch 0035).
template <typename Dtype>
void PReLURow(const Layer<Dtype>&, const CometLayerShape& s, CometLayerFacts* f) {
  if (s.in_place) f->private_buffer = CometLayerFacts::PRELU_COPY;
  else f->bottom[0] = COMET_READS_VALUE;
  f->lossy_input = true;
  f->adaptive = true;
  f->exact_sign = true;
}

// Scale reads its input only for its scale's gradient, sum x dy per element of the scale (a
// channel's parameter, or with the scale as a second bottom, SENet's channel attention, one per
// sample and channel): the input lossy under the weight rule; in place, its own copy of it. The
// second bottom, the scale itself, is read for the first bottom's gradient dy * scale: exactly.
template <typename Dtype>
void ScaleRow(const Layer<Dtype>&, const CometLayerShape& s, CometLayerFacts* f) {
  if (!s.in_place) f->bottom[0] = COMET_READS_VALUE;
  else f->private_buffer = CometLayerFacts::SCALE_COPY;
  f->lossy_input = true;
  f->adaptive = true;
  if (s.bottoms > 1) {
    f->bottom[1] = COMET_READS_VALUE;
    f->exact_bottom = 1;
  }
}

// BatchNorm's Backward reads its own x_norm_ (a copy of its output) and temp_.
template <typename Dtype>
void BatchNormRow(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  f->private_buffer = CometLayerFacts::BN_TEMP;
}

// ACROSS_CHANNELS on the CPU computes its output again from its input and scale_ (patch 0027)
// and reads no top; on the GPU it reads it. WITHIN_CHANNEL's backward runs its internal layers'
// backward: the product's (Eltwise PROD, stable_prod_grad) reads its two inputs, the input
// itself and the scale s^-beta, never the output; the power's reads the window means and the
// scale; the square's the input. The bound derivation of docs/comet.md covers both forms (s = k
// + alpha / n sum x^2 over n = local_size values across channels, or local_size^2 within, k = 1).
template <typename Dtype>
void LRNRow(const Layer<Dtype>& l, const CometLayerShape&, CometLayerFacts* f) {
  All(&f->bottom, COMET_READS_VALUE);
  All(&f->top, COMET_READS_VALUE);
  f->lossy_input = true;
  if (l.layer_param().lrn_param().norm_region() == LRNParameter_NormRegion_ACROSS_CHANNELS) {
    f->private_buffer = CometLayerFacts::LRN_SCALE;
    if (Caffe::mode() == Caffe::CPU) All(&f->top, COMET_READS_NOTHING);
  } else {
    f->private_buffer = CometLayerFacts::LRN_WITHIN;
    All(&f->top, COMET_READS_NOTHING);
    f->lrn_from_input = sizeof(Dtype) == sizeof(float);  // lrn_within.hpp: float only
  }
}

template <typename Dtype>
void PoolingRow(const Layer<Dtype>& l, const CometLayerShape& s, CometLayerFacts* f) {
  switch (l.layer_param().pooling_param().pool()) {
    case PoolingParameter_PoolMethod_MAX:
      if (s.tops > 1) f->top[1] = COMET_READS_VALUE;  // the argmax as a top
      else f->private_buffer = CometLayerFacts::MAX_ARGMAX;
      break;
    case PoolingParameter_PoolMethod_AVE:
      break;
    default:  // STOCHASTIC: no CPU Backward to check this against
      All(&f->bottom, COMET_READS_VALUE);
      All(&f->top, COMET_READS_VALUE);
  }
}

template <typename Dtype>
void DropoutRow(const Layer<Dtype>& l, const CometLayerShape&, CometLayerFacts* f) {
  if (l.layer_param().phase() == TRAIN) f->private_buffer = CometLayerFacts::DROPOUT_MASK;
}

// PROD's gradient is the product of the other inputs (or top / x); SUM and MAX read no data
// (MAX keeps its own argmax; patch 0013 keeps SUM and MAX from touching the data at all).
template <typename Dtype>
void EltwiseRow(const Layer<Dtype>& l, const CometLayerShape&, CometLayerFacts* f) {
  const EltwiseParameter& p = l.layer_param().eltwise_param();
  if (p.operation() != EltwiseParameter_EltwiseOp_PROD) return;
  All(&f->bottom, COMET_READS_VALUE);
  if (!p.stable_prod_grad()) All(&f->top, COMET_READS_VALUE);
}

template <typename Dtype>
void ReductionRow(const Layer<Dtype>& l, const CometLayerShape&, CometLayerFacts* f) {
  const ReductionParameter_ReductionOp op = l.layer_param().reduction_param().operation();
  if (op == ReductionParameter_ReductionOp_ASUM || op == ReductionParameter_ReductionOp_SUMSQ)
    f->bottom[0] = COMET_READS_VALUE;
}

// Split: every top is the bottom's data after Forward; the diffs stay apart.
template <typename Dtype>
void SplitRow(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  f->top_data_of.assign(f->top.size(), 0);
}

// Flatten and Reshape: the top is the bottom's data and diff.
template <typename Dtype>
void ViewRow(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  f->top_data_of[0] = 0;
  f->top_diff_of[0] = 0;
}

// Concat of one bottom and Slice into one top are views too.
template <typename Dtype>
void ConcatSliceRow(const Layer<Dtype>& l, const CometLayerShape& s, CometLayerFacts* f) {
  if (s.bottoms == 1 && s.tops == 1) ViewRow<Dtype>(l, s, f);
}

template <typename Dtype>
void BatchReindexRow(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  f->bottom[1] = COMET_READS_VALUE;  // the permutation
}

template <typename Dtype>
void EmbedRow(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  f->bottom[0] = COMET_READS_VALUE;  // the indices
}

// ------------------------------------------------------------------------------------- losses
// The loss's own top holds the loss weight in its diff; the store never touches it.
// SoftmaxWithLoss and InfogainLoss: the gradient comes from their own softmax (prob_) and the
// label; their optional second top is that softmax (it shares prob_'s memory). SoftmaxWithLoss's
// Backward_gpu also takes top[0]->gpu_data() (unused, but the call needs live memory: found by the
// checker on the first GPU run); the loss is one value, so the row says it is read on both devices.
template <typename Dtype>
void SoftmaxLossRow(const Layer<Dtype>&, const CometLayerShape& s, CometLayerFacts* f) {
  f->top[0] = COMET_READS_VALUE;
  f->bottom[1] = COMET_READS_VALUE;
  if (s.bottoms > 2) f->bottom[2] = COMET_READS_VALUE;  // InfogainLoss's matrix as a bottom
  if (s.tops > 1) f->top[1] = COMET_READS_VALUE;
}

// SigmoidCrossEntropyLoss (its own sigmoid and the target) and HingeLoss (the label, and the
// diff it wrote in Forward).
template <typename Dtype>
void LabelLossRow(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  f->bottom[1] = COMET_READS_VALUE;
}

template <typename Dtype>
void ContrastiveLossRow(const Layer<Dtype>&, const CometLayerShape&, CometLayerFacts* f) {
  f->bottom[2] = COMET_READS_VALUE;  // the similarity label; distances are its own
}

// ---------------------------------------------------------------------------------- cuDNN
// The cuDNN engines are subclasses that override Backward_gpu (their CPU mode is the parent's
// code, which reads a subset of what the rows below say). Each cuDNN backward call takes the
// data pointers of both the input and the output (cudnnActivationBackward, cudnnPoolingBackward,
// cudnnSoftmaxBackward (whose caller fetches the input too), cudnnLRNCrossChannelBackward,
// cudnnDivisiveNormalizationBackward), and what cuDNN does with them is not ours to know: both are
// read. cuDNN pooling keeps no argmax and cuDNN LRN no scale_ of Caffe's, so no private buffer.

// ReLU: cuDNN when negative_slope is 0; otherwise upstream falls back to ReLULayer's Backward.
template <typename Dtype>
void CuDNNReLURow(const Layer<Dtype>& l, const CometLayerShape& s, CometLayerFacts* f) {
  if (l.layer_param().relu_param().negative_slope() != 0) ReLURow<Dtype>(l, s, f);
  else ReadsBoth<Dtype>(l, s, f);
}

// The classes whose facts say fills_whole (layer_facts.hpp): the layers that hold most of a
// CNN's activations. Exact classes, not their subclasses (a cuDNN engine writes through cuDNN's
// own calls). test_comet_facts.cpp fills that memory with NaN before Forward and Backward and
// requires the same results.
template <typename Dtype>
bool FillsWhole(const Layer<Dtype>& layer) {
  static const std::set<std::string> classes = {
      typeid(ConvolutionLayer<Dtype>).name(), typeid(InnerProductLayer<Dtype>).name(),
      typeid(ReLULayer<Dtype>).name(),        typeid(PoolingLayer<Dtype>).name(),
      typeid(LRNLayer<Dtype>).name(),         typeid(BatchNormLayer<Dtype>).name(),
      typeid(ScaleLayer<Dtype>).name(),       typeid(EltwiseLayer<Dtype>).name(),
      typeid(ConcatLayer<Dtype>).name(),      typeid(SplitLayer<Dtype>).name(),
      typeid(DropoutLayer<Dtype>).name(),     typeid(SigmoidLayer<Dtype>).name(),
      typeid(TanHLayer<Dtype>).name(),        typeid(SoftmaxLayer<Dtype>).name(),
      typeid(SoftmaxWithLossLayer<Dtype>).name()};
  return classes.count(typeid(layer).name()) > 0;
}

}  // namespace

template <typename Dtype>
void CometFactsRegistry<Dtype>::Add(const std::type_info& cls, const std::string& type,
                                    Describe describe) {
  Row<Dtype> row = {type, describe};
  CHECK(Rows<Dtype>().insert(std::make_pair(std::string(cls.name()), row)).second)
      << "COMET: two fact rows for layer class " << cls.name();
}

template <typename Dtype>
bool CometFactsRegistry<Dtype>::Knows(const Layer<Dtype>& layer) {
  return Rows<Dtype>().count(typeid(layer).name()) > 0;
}

template <typename Dtype>
CometLayerFacts CometFactsRegistry<Dtype>::Of(const Layer<Dtype>& layer,
                                              const std::vector<Blob<Dtype>*>& bottom,
                                              const std::vector<Blob<Dtype>*>& top) {
  CometLayerFacts f;
  f.bottom.assign(bottom.size(), COMET_READS_NOTHING);
  f.top.assign(top.size(), COMET_READS_NOTHING);
  f.top_data_of.assign(top.size(), -1);
  f.top_diff_of.assign(top.size(), -1);
  typename std::map<std::string, Row<Dtype> >::const_iterator it =
      Rows<Dtype>().find(typeid(layer).name());
  if (it == Rows<Dtype>().end()) {
    All(&f.bottom, COMET_READS_VALUE);
    All(&f.top, COMET_READS_VALUE);
    return f;
  }
  CometLayerShape s;
  s.bottoms = bottom.size();
  s.tops = top.size();
  s.in_place = !bottom.empty() && !top.empty() && bottom[0] == top[0];
  f.known = true;
  f.fills_whole = FillsWhole(layer);
  it->second.describe(layer, s, &f);
  return f;
}

template <typename Dtype>
std::vector<std::string> CometFactsRegistry<Dtype>::KnownTypes() {
  std::vector<std::string> types;
  typename std::map<std::string, Row<Dtype> >::const_iterator it;
  for (it = Rows<Dtype>().begin(); it != Rows<Dtype>().end(); ++it)
    types.push_back(it->second.type);
  return types;
}

INSTANTIATE_CLASS(CometFactsRegistry);

// ----------------------------------------------------------------------------- the registry
REGISTER_COMET_FACTS("Convolution", ConvolutionLayer, ConvolutionRow);
REGISTER_COMET_FACTS("InnerProduct", InnerProductLayer, WeightedLinear);
REGISTER_COMET_FACTS("Deconvolution", DeconvolutionLayer, ConvolutionRow);
REGISTER_COMET_FACTS("Embed", EmbedLayer, EmbedRow);
REGISTER_COMET_FACTS("ReLU", ReLULayer, ReLURow);
REGISTER_COMET_FACTS("PReLU", PReLULayer, PReLURow);
REGISTER_COMET_FACTS("AbsVal", AbsValLayer, ReadsBottom);
REGISTER_COMET_FACTS("BNLL", BNLLLayer, ReadsBottom);
REGISTER_COMET_FACTS("Clip", ClipLayer, ReadsBottom);
REGISTER_COMET_FACTS("Log", LogLayer, ReadsBottom);
REGISTER_COMET_FACTS("Power", PowerLayer, PowerRow);
REGISTER_COMET_FACTS("Sigmoid", SigmoidLayer, SigmoidRow);
REGISTER_COMET_FACTS("TanH", TanHLayer, TanHRow);
REGISTER_COMET_FACTS("Exp", ExpLayer, ExpRow);
REGISTER_COMET_FACTS("Softmax", SoftmaxLayer, SoftmaxRow);
REGISTER_COMET_FACTS("Swish", SwishLayer, SwishRow);
REGISTER_COMET_FACTS("ELU", ELULayer, ELURow);
REGISTER_COMET_FACTS("MVN", MVNLayer, MVNRow);
REGISTER_COMET_FACTS("LRN", LRNLayer, LRNRow);
REGISTER_COMET_FACTS("Pooling", PoolingLayer, PoolingRow);
REGISTER_COMET_FACTS("SPP", SPPLayer, ReadsNothing);
REGISTER_COMET_FACTS("Dropout", DropoutLayer, DropoutRow);
REGISTER_COMET_FACTS("BatchNorm", BatchNormLayer, BatchNormRow);
REGISTER_COMET_FACTS("Scale", ScaleLayer, ScaleRow);
REGISTER_COMET_FACTS("Bias", BiasLayer, ReadsNothing);
REGISTER_COMET_FACTS("Eltwise", EltwiseLayer, EltwiseRow);
REGISTER_COMET_FACTS("Reduction", ReductionLayer, ReductionRow);
REGISTER_COMET_FACTS("Split", SplitLayer, SplitRow);
REGISTER_COMET_FACTS("Flatten", FlattenLayer, ViewRow);
REGISTER_COMET_FACTS("Reshape", ReshapeLayer, ViewRow);
REGISTER_COMET_FACTS("Concat", ConcatLayer, ConcatSliceRow);
REGISTER_COMET_FACTS("Slice", SliceLayer, ConcatSliceRow);
REGISTER_COMET_FACTS("Crop", CropLayer, ReadsNothing);
REGISTER_COMET_FACTS("Tile", TileLayer, ReadsNothing);
REGISTER_COMET_FACTS("Filter", FilterLayer, ReadsNothing);  // its own indices
REGISTER_COMET_FACTS("BatchReindex", BatchReindexLayer, BatchReindexRow);
REGISTER_COMET_FACTS("Im2col", Im2colLayer, ReadsNothing);
REGISTER_COMET_FACTS("Silence", SilenceLayer, ReadsNothing);
REGISTER_COMET_FACTS("HDF5Output", HDF5OutputLayer, ReadsNothing);
REGISTER_COMET_FACTS("SoftmaxWithLoss", SoftmaxWithLossLayer, SoftmaxLossRow);
REGISTER_COMET_FACTS("InfogainLoss", InfogainLossLayer, SoftmaxLossRow);
REGISTER_COMET_FACTS("SigmoidCrossEntropyLoss", SigmoidCrossEntropyLossLayer, LabelLossRow);
REGISTER_COMET_FACTS("HingeLoss", HingeLossLayer, LabelLossRow);
REGISTER_COMET_FACTS("MultinomialLogisticLoss", MultinomialLogisticLossLayer, ReadsBottom);
REGISTER_COMET_FACTS("EuclideanLoss", EuclideanLossLayer, ReadsNothing);  // its own diff_
REGISTER_COMET_FACTS("ContrastiveLoss", ContrastiveLossLayer, ContrastiveLossRow);
// No Backward (Net never runs it: they do not contribute to a loss) or no bottoms.
REGISTER_COMET_FACTS("Accuracy", AccuracyLayer, ReadsNothing);
REGISTER_COMET_FACTS("ArgMax", ArgMaxLayer, ReadsNothing);
REGISTER_COMET_FACTS("Threshold", ThresholdLayer, ReadsNothing);
REGISTER_COMET_FACTS("Data", DataLayer, ReadsNothing);
REGISTER_COMET_FACTS("DummyData", DummyDataLayer, ReadsNothing);
REGISTER_COMET_FACTS("Input", InputLayer, ReadsNothing);
REGISTER_COMET_FACTS("MemoryData", MemoryDataLayer, ReadsNothing);
REGISTER_COMET_FACTS("HDF5Data", HDF5DataLayer, ReadsNothing);
REGISTER_COMET_FACTS("Parameter", ParameterLayer, ReadsNothing);
#ifdef USE_OPENCV
REGISTER_COMET_FACTS("ImageData", ImageDataLayer, ReadsNothing);
REGISTER_COMET_FACTS("WindowData", WindowDataLayer, ReadsNothing);
#endif
#ifdef USE_CUDNN
// cudnnConvolutionBackwardFilter reads the input, BackwardData the weights and the output's diff.
REGISTER_COMET_FACTS("Convolution", CuDNNConvolutionLayer, WeightedLinear);
REGISTER_COMET_FACTS("Deconvolution", CuDNNDeconvolutionLayer, ReadsBottom);
REGISTER_COMET_FACTS("ReLU", CuDNNReLULayer, CuDNNReLURow);
REGISTER_COMET_FACTS("Sigmoid", CuDNNSigmoidLayer, ReadsBoth);
REGISTER_COMET_FACTS("TanH", CuDNNTanHLayer, ReadsBoth);
REGISTER_COMET_FACTS("Softmax", CuDNNSoftmaxLayer, ReadsBoth);
REGISTER_COMET_FACTS("Pooling", CuDNNPoolingLayer, ReadsBoth);
REGISTER_COMET_FACTS("LRN", CuDNNLRNLayer, ReadsBoth);  // ACROSS_CHANNELS
REGISTER_COMET_FACTS("LRN", CuDNNLCNLayer, ReadsBoth);  // WITHIN_CHANNEL
#endif
// Without a row, and so reading everything: LSTM, RNN (unrolled nets sharing the bottoms'
// memory), LSTMUnit, Python.

}  // namespace caffe
