#ifndef CAFFE_COMET_LAYER_FACTS_HPP_
#define CAFFE_COMET_LAYER_FACTS_HPP_

// COMET-Caffe: what each layer class's Backward reads, in one registry (docs/comet.md#layer-facts).
//
// The activation store may free, mask or compress a blob only when no Backward that runs later
// needs its exact values. Those facts belong to a C++ class, not to a type string: a cuDNN engine
// registers the same type with a different Backward. Rows are registered per class, the way
// REGISTER_LAYER_CLASS fills Caffe's layer registry; a class without a row reads everything (the
// store leaves its blobs dense). test_comet_facts.cpp proves every row against the layer itself.

#include <string>
#include <typeinfo>
#include <vector>

#include "caffe/blob.hpp"
#include "caffe/layer.hpp"

namespace caffe {

// How Backward uses the data (not the diff) of one bottom or top.
enum CometRead {
  COMET_READS_NOTHING = 0,  // never touched: the memory may be freed
  COMET_READS_SIGN = 1,     // only x > 0 is asked: a bit mask restores it exactly
  COMET_READS_VALUE = 2     // the values
};

// What the store needs to know about one layer as built (its parameters and blobs).
struct CometLayerFacts {
  // BN_TEMP: BatchNorm's temp_, its standard deviation broadcast to every element (rebuilt from
  // the per-channel values). SCALE_COPY: in-place Scale's temp_, a copy of its input (rebuilt
  // from the BatchNorm output it was copied from). PRELU_COPY: in-place PReLU's bottom_memory_,
  // a copy of its input (its backward reads it, patch 0035: lossy, with the signs exact).
  // LRN_WITHIN: LRN within a channel, a chain of internal layers whose outputs (the squares,
  // their window mean, the scale s^-beta) are each as large as its input and are computed
  // again, as LRN_SCALE is, from the input by LRN's forward. SWISH_SIGMOID: Swish's sigmoid
  // input and output (each as large as its input), which its backward does not read when it is
  // not in place (patch 0038). SWISH_IN_PLACE: in place, its backward reads the sigmoid's input
  // (beta x, patch 0038), lossy under the derivative rule, and not its output. MVN_TEMP: MVN's temp_, as large as its input, which each of its
  // passes writes whole (a product with a vector of ones, beta 0) before reading it: scratch.
  // CONV_COLUMNS: Convolution's and Deconvolution's col_buffer_ (one image's im2col), scratch the
  // same way (im2col, or a product with beta 0 before col2im): the store gives every layer of the
  // net the same one (CometStore::ShareColumns), as they run one at a time.
  enum Private { NO_PRIVATE = 0, MAX_ARGMAX, DROPOUT_MASK, LRN_SCALE, BN_TEMP, SCALE_COPY,
                 PRELU_COPY, LRN_WITHIN, SWISH_SIGMOID, SWISH_IN_PLACE, MVN_TEMP, CONV_COLUMNS };
  // Backward computes f'(x) from its output y: Sigmoid y (1 - y), TanH 1 - y^2, ELU alpha + y
  // where x <= 0 (1 elsewhere, from x's sign). An error e in y moves it by about e (1 - 2y),
  // -2 y e or e, which the derivative rule of docs/comet.md bounds.
  // Exp: dx = c dy y (c = log(base) scale), so an error e in y moves dx by c dy e. Softmax:
  // dx = y (dy - sum(dy y)) along its axis, moved by e (dy - sum(dy y)) - y sum(dy e).
  // SWISH_OF_INPUT: Swish not in place computes f' from its input x (patch 0038): an error e in
  // x moves it by e f''(x), f''(x) = beta s (1 - s) (2 + beta x (1 - 2 s)), s = sigma(beta x).
  // SWISH_OF_SCALED_INPUT: in place, from the sigmoid's input u = beta x: e in u moves it by
  // e f''(x) / beta.
  enum Derivative { NO_DERIVATIVE = 0, SIGMOID_OF_OUTPUT, TANH_OF_OUTPUT, ELU_OF_OUTPUT,
                    EXP_OF_OUTPUT, SOFTMAX_OF_OUTPUT, SWISH_OF_INPUT, SWISH_OF_SCALED_INPUT };
  CometLayerFacts()
      : known(false), lossy_input(false), adaptive(false), exact_sign(false),
        relu_from_mask(false), lrn_from_input(false), fills_whole(false), exact_bottom(-1),
        private_buffer(NO_PRIVATE),
        derivative(NO_DERIVATIVE) {}

  bool known;                    // false: no row for the class; it reads every bottom and top
  std::vector<CometRead> bottom;  // Backward's use of bottom[k]'s data
  std::vector<CometRead> top;     // Backward's use of top[k]'s data
  // Memory the layer shares between its blobs after Forward (Split) or Backward (Flatten's diff):
  // top k's data (diff) is bottom top_data_of[k]'s (top_diff_of[k]'s), or -1 for its own.
  std::vector<int> top_data_of, top_diff_of;
  // Its value reads of the bottoms (and LRN's, Sigmoid's, TanH's and ELU's of their top)
  // tolerate |x - x'| <= eb; which of them are stored lossy is still the user's choice
  // (compress_type).
  bool lossy_input;
  // Its weight gradient is sum x (x) dy with weights of shape (outputs, ...): the adaptive bound
  // rule of docs/comet.md applies (Convolution, InnerProduct, Deconvolution, PReLU's slope, and
  // Scale: its scale's gradient, a parameter's or with two bottoms the second bottom's).
  bool adaptive;
  // Its lossy value reads also ask x > 0, which must stay exact (PReLU: dx = dy for x > 0, a dy
  // else): the store keeps a sign mask beside the stream, as for ReLU.
  bool exact_sign;
  // ReLU: the store may compute Backward itself from the input's sign mask, bit for bit.
  bool relu_from_mask;
  // LRN within a channel (float): the store computes Backward itself from the input
  // (lrn_within.hpp), and the internal outputs (LRN_WITHIN) are never read after the forward.
  bool lrn_from_input;
  // Forward writes every value of each top it does not share with a bottom, and Backward every
  // value of each bottom diff it propagates to (it assigns them, never adds to what is there),
  // CPU and GPU: when the store has freed that memory, its next allocation needs no zero fill.
  bool fills_whole;
  // A bottom whose values it reads exactly even with lossy_input, or -1 (Scale's second bottom,
  // the scale itself: its error would move the first bottom's gradient directly).
  int exact_bottom;
  Private private_buffer;  // a buffer as large as an activation that the store may hold
  Derivative derivative;

  CometRead read_bottom(int k) const { return known ? bottom[k] : COMET_READS_VALUE; }
  CometRead read_top(int k) const { return known ? top[k] : COMET_READS_VALUE; }
};

// The blobs a layer was set up with, as far as its facts depend on them.
struct CometLayerShape {
  int bottoms, tops;
  bool in_place;  // top[0] is bottom[0]
};

template <typename Dtype>
class CometFactsRegistry {
 public:
  // Fills facts->bottom/top (already sized, all COMET_READS_NOTHING) and the rest.
  typedef void (*Describe)(const Layer<Dtype>& layer, const CometLayerShape& shape,
                           CometLayerFacts* facts);
  static void Add(const std::type_info& cls, const std::string& type, Describe describe);
  // The facts of this layer with these blobs; known == false when its class has no row.
  static CometLayerFacts Of(const Layer<Dtype>& layer, const std::vector<Blob<Dtype>*>& bottom,
                            const std::vector<Blob<Dtype>*>& top);
  // Whether the layer's class has a row.
  static bool Knows(const Layer<Dtype>& layer);
  // Type strings of the classes with a row (a type may have several classes).
  static std::vector<std::string> KnownTypes();
};

template <typename Dtype>
class CometFactsRegisterer {
 public:
  CometFactsRegisterer(const std::type_info& cls, const std::string& type,
                       typename CometFactsRegistry<Dtype>::Describe describe) {
    CometFactsRegistry<Dtype>::Add(cls, type, describe);
  }
};

// Registers the row `describe` (a function template over Dtype) for layer class template `cls`.
#define REGISTER_COMET_FACTS(type, cls, describe)                                      \
  static CometFactsRegisterer<float> g_comet_facts_f_##cls(typeid(cls<float>), type,   \
                                                           &describe<float>);          \
  static CometFactsRegisterer<double> g_comet_facts_d_##cls(typeid(cls<double>), type, \
                                                            &describe<double>)

}  // namespace caffe

#endif  // CAFFE_COMET_LAYER_FACTS_HPP_
