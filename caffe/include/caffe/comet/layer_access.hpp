#ifndef CAFFE_COMET_LAYER_ACCESS_HPP_
#define CAFFE_COMET_LAYER_ACCESS_HPP_

// COMET-Caffe: the private buffers of upstream layers that are as large as activations. The
// layers declare this class a friend (patch 0011); nothing else reaches into them.

#include "caffe/comet/codes.hpp"
#include "caffe/layers/dropout_layer.hpp"
#include "caffe/layers/lrn_layer.hpp"
#include "caffe/layers/pooling_layer.hpp"

namespace caffe {

template <typename Dtype>
class CometLayerAccess {
 public:
  // Max pooling's argmax when it is kept inside the layer (one top), else NULL.
  static Blob<int>* argmax(Layer<Dtype>* layer) {
    PoolingLayer<Dtype>* pool = dynamic_cast<PoolingLayer<Dtype>*>(layer);
    if (!pool || layer->layer_param().pooling_param().pool() != PoolingParameter_PoolMethod_MAX ||
        layer->layer_param().top_size() != 1) {
      return NULL;
    }
    return &pool->max_idx_;
  }
  static comet_codes::PoolGeometry geometry(Layer<Dtype>* layer) {
    PoolingLayer<Dtype>* p = dynamic_cast<PoolingLayer<Dtype>*>(layer);
    CHECK(p) << "not a pooling layer";
    comet_codes::PoolGeometry g = {p->height_, p->width_, p->pooled_height_, p->pooled_width_,
                                   p->kernel_h_, p->kernel_w_, p->stride_h_, p->stride_w_,
                                   p->pad_h_, p->pad_w_};
    return g;
  }
  // Dropout's 0/1 mask, else NULL.
  static Blob<unsigned int>* dropout_mask(Layer<Dtype>* layer) {
    DropoutLayer<Dtype>* d = dynamic_cast<DropoutLayer<Dtype>*>(layer);
    return d ? &d->rand_vec_ : NULL;
  }
  // LRN's scale across channels (its backward reads it; a forward recomputes it), else NULL.
  // Within a channel LRN is a chain of internal layers and keeps no such buffer.
  static Blob<Dtype>* lrn_scale(Layer<Dtype>* layer) {
    LRNLayer<Dtype>* l = dynamic_cast<LRNLayer<Dtype>*>(layer);
    if (!l || layer->layer_param().lrn_param().norm_region() !=
                  LRNParameter_NormRegion_ACROSS_CHANNELS) {
      return NULL;
    }
    return &l->scale_;
  }
};

}  // namespace caffe

#endif  // CAFFE_COMET_LAYER_ACCESS_HPP_
