#ifndef CAFFE_COMET_POOL_CODES_HPP_
#define CAFFE_COMET_POOL_CODES_HPP_

// COMET-Caffe: max pooling straight into packed codes (comet { pool_codes }). PoolingLayer's MAX
// forward with one top asks here first (patch "max pooling may leave its argmax to the store");
// an activation store registers the layers whose argmax it keeps as codes and computes their
// forward itself, so that the int32 argmax is never dense. Without a registration (COMET off,
// test nets, a store gone) the layer runs its own forward; the check is one atomic load then.
// Kept free of includes: pooling_layer.cu reads it too.

namespace caffe {

template <typename Dtype> class Blob;
template <typename Dtype> class Layer;

template <typename Dtype>
class CometPoolCodes {
 public:
  class Taker {
   public:
    virtual ~Taker() {}
    // True when it computed layer's forward (top and the argmax's codes).
    virtual bool TakeForward(const Layer<Dtype>* layer, const Blob<Dtype>* bottom,
                             Blob<Dtype>* top, bool on_device) = 0;
  };
  // `taker` computes layer's forward from now on; NULL: the layer computes it again.
  static void Register(const Layer<Dtype>* layer, Taker* taker);
  // PoolingLayer's forward: true when a registered taker did it.
  static bool TakeForward(const Layer<Dtype>* layer, const Blob<Dtype>* bottom, Blob<Dtype>* top,
                          bool on_device);
};

}  // namespace caffe

#endif  // CAFFE_COMET_POOL_CODES_HPP_
