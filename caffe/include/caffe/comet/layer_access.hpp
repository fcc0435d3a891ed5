#ifndef CAFFE_COMET_LAYER_ACCESS_HPP_
#define CAFFE_COMET_LAYER_ACCESS_HPP_

// COMET-Caffe: the private buffers of upstream layers that are as large as activations. The
// layers declare this class a friend (patch 0011); nothing else reaches into them.

#include <vector>

#include "caffe/comet/batchnorm_moments.hpp"
#include "caffe/comet/codes.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/comet/pool.hpp"
#include "caffe/layers/base_conv_layer.hpp"
#include "caffe/layers/batch_norm_layer.hpp"
#include "caffe/layers/dropout_layer.hpp"
#include "caffe/layers/lrn_layer.hpp"
#include "caffe/layers/mvn_layer.hpp"
#include "caffe/layers/pooling_layer.hpp"
#include "caffe/layers/prelu_layer.hpp"
#include "caffe/layers/scale_layer.hpp"
#include "caffe/layers/swish_layer.hpp"
#include "caffe/util/math_functions.hpp"

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
  // Dropout's mask (0/1 on the CPU, raw random words on the GPU), else NULL.
  static Blob<unsigned int>* dropout_mask(Layer<Dtype>* layer) {
    DropoutLayer<Dtype>* d = dynamic_cast<DropoutLayer<Dtype>*>(layer);
    return d ? &d->rand_vec_ : NULL;
  }
  // What Dropout's Backward asks of its mask: mask * scale on the CPU (0 or 1), mask >
  // uint_thres_ on the GPU (upstream's Forward_gpu keeps the raw random words).
  static comet_codes::BinaryRule dropout_rule(Layer<Dtype>* layer, bool on_device) {
    DropoutLayer<Dtype>* d = dynamic_cast<DropoutLayer<Dtype>*>(layer);
    CHECK(d) << "not a Dropout layer";
    comet_codes::BinaryRule r = {0u, 1u};
    if (on_device) {
      r.threshold = d->uint_thres_;
      r.one = 0xffffffffu;
    }
    return r;
  }
  // LRN's scale across channels (its backward reads it; a forward recomputes it), else NULL.
  static Blob<Dtype>* lrn_scale(Layer<Dtype>* layer) { return lrn_recomputed(layer, 0); }
  // What LRN's forward computes besides its output and its backward reads (or, the squares, may
  // read), as large as its input: across channels the scale (part 0); within a channel the
  // outputs of its internal layers, the squares (0), their window means (1) and the scale
  // s^-beta (2). NULL past the last part, or for another layer.
  static Blob<Dtype>* lrn_recomputed(Layer<Dtype>* layer, int part) {
    LRNLayer<Dtype>* l = dynamic_cast<LRNLayer<Dtype>*>(layer);
    if (!l) return NULL;
    if (layer->layer_param().lrn_param().norm_region() == LRNParameter_NormRegion_ACROSS_CHANNELS)
      return part == 0 ? &l->scale_ : NULL;
    Blob<Dtype>* within[] = {&l->square_output_, &l->pool_output_, &l->power_output_};
    return part >= 0 && part < 3 ? within[part] : NULL;
  }
  // Swish's sigmoid input (part 0) and output (1), each as large as its input; NULL past the
  // last part, or for another layer.
  static Blob<Dtype>* swish_sigmoid(Layer<Dtype>* layer, int part) {
    SwishLayer<Dtype>* l = dynamic_cast<SwishLayer<Dtype>*>(layer);
    if (!l || part < 0 || part > 1) return NULL;
    return part == 0 ? l->sigmoid_input_.get() : l->sigmoid_output_.get();
  }
  // LRN within a channel: the internal blobs whose diffs its backward writes and reads (its
  // internal layers' gradients, each as large as its input), else empty.
  static std::vector<Blob<Dtype>*> lrn_internal_diffs(Layer<Dtype>* layer) {
    std::vector<Blob<Dtype>*> blobs;
    LRNLayer<Dtype>* l = dynamic_cast<LRNLayer<Dtype>*>(layer);
    if (!l || layer->layer_param().lrn_param().norm_region() !=
                  LRNParameter_NormRegion_WITHIN_CHANNEL) {
      return blobs;
    }
    Blob<Dtype>* internal[] = {&l->product_input_, &l->square_input_, &l->square_output_,
                               &l->pool_output_, &l->power_output_};
    blobs.assign(internal, internal + 5);
    return blobs;
  }
  // BatchNorm's x_norm_ (a copy of its output that its backward reads), else NULL.
  static Blob<Dtype>* bn_x_norm(Layer<Dtype>* layer) {
    BatchNormLayer<Dtype>* bn = dynamic_cast<BatchNormLayer<Dtype>*>(layer);
    return bn ? &bn->x_norm_ : NULL;
  }
  // In-place PReLU's copy of its input (its backward reads it, patch 0035), else NULL.
  static Blob<Dtype>* prelu_copy(Layer<Dtype>* layer) {
    PReLULayer<Dtype>* p = dynamic_cast<PReLULayer<Dtype>*>(layer);
    return p ? &p->bottom_memory_ : NULL;
  }
  // The copy of its input an in-place PReLU or Scale keeps for its parameters' gradient
  // (bottom_memory_, temp_), else NULL.
  static Blob<Dtype>* in_place_input_copy(Layer<Dtype>* layer) {
    if (ScaleLayer<Dtype>* s = dynamic_cast<ScaleLayer<Dtype>*>(layer)) return &s->temp_;
    return prelu_copy(layer);
  }
  // The private buffer a layer's LOSSY (or KEEP) entry stores: BatchNorm's x_norm_, in-place
  // PReLU's copy or in-place Swish's sigmoid input.
  static Blob<Dtype>* lossy_buffer(Layer<Dtype>* layer) {
    Blob<Dtype>* b = bn_x_norm(layer);
    if (!b) b = prelu_copy(layer);
    return b ? b : swish_sigmoid(layer, 0);
  }
  // After BatchNorm's forward: its per-channel standard deviation (variance_ holds it).
  static const Blob<Dtype>* bn_std(Layer<Dtype>* layer) {
    BatchNormLayer<Dtype>* bn = dynamic_cast<BatchNormLayer<Dtype>*>(layer);
    CHECK(bn) << "not a BatchNorm layer";
    return &bn->variance_;
  }
  // BatchNorm's temp_, in-place Scale's temp_ and MVN's temp_ (the buffers the plan's REBUILD
  // frees; MVN's is not rebuilt: both its passes write all of it before reading it), else NULL.
  static Blob<Dtype>* rebuildable(Layer<Dtype>* layer) {
    if (BatchNormLayer<Dtype>* bn = dynamic_cast<BatchNormLayer<Dtype>*>(layer)) return &bn->temp_;
    if (ScaleLayer<Dtype>* s = dynamic_cast<ScaleLayer<Dtype>*>(layer)) return &s->temp_;
    if (MVNLayer<Dtype>* m = dynamic_cast<MVNLayer<Dtype>*>(layer)) return &m->temp_;
    return NULL;
  }
  // Convolution's and Deconvolution's column buffer (one image's im2col), else NULL.
  static Blob<Dtype>* columns(Layer<Dtype>* layer) {
    BaseConvolutionLayer<Dtype>* c = dynamic_cast<BaseConvolutionLayer<Dtype>*>(layer);
    return c ? &c->col_buffer_ : NULL;
  }
  // BatchNorm's Forward leaves its per-channel standard deviation in variance_ and broadcasts it
  // into temp_ with two gemms against vectors of ones; the same gemms rebuild it exactly (every
  // product is x * 1, every sum has one term).
  static void RebuildBatchNormTemp(Layer<Dtype>* layer) {
    BatchNormLayer<Dtype>* bn = dynamic_cast<BatchNormLayer<Dtype>*>(layer);
    CHECK(bn) << "not a BatchNorm layer";
    Blob<Dtype>& t = bn->temp_;
    const int num = t.shape(0), spatial = t.count() / (t.shape(0) * bn->channels_);
    CometFillWhole whole(t.data().get());  // the second gemm (beta 0) writes all of it
    if (Caffe::mode() == Caffe::CPU) {
      caffe_cpu_gemm<Dtype>(CblasNoTrans, CblasNoTrans, num, bn->channels_, 1, 1,
                            bn->batch_sum_multiplier_.cpu_data(), bn->variance_.cpu_data(), 0.,
                            bn->num_by_chans_.mutable_cpu_data());
      caffe_cpu_gemm<Dtype>(CblasNoTrans, CblasNoTrans, bn->channels_ * num, spatial, 1, 1.,
                            bn->num_by_chans_.cpu_data(), bn->spatial_sum_multiplier_.cpu_data(),
                            0., t.mutable_cpu_data());
    } else {
#ifndef CPU_ONLY
      caffe_gpu_gemm<Dtype>(CblasNoTrans, CblasNoTrans, num, bn->channels_, 1, 1,
                            bn->batch_sum_multiplier_.gpu_data(), bn->variance_.gpu_data(), 0.,
                            bn->num_by_chans_.mutable_gpu_data());
      caffe_gpu_gemm<Dtype>(CblasNoTrans, CblasNoTrans, bn->channels_ * num, spatial, 1, 1.,
                            bn->num_by_chans_.gpu_data(), bn->spatial_sum_multiplier_.gpu_data(),
                            0., t.mutable_gpu_data());
#else
      NO_GPU;
#endif
    }
  }
  // BatchNorm with batch statistics computes dx = (dy - mean(dy) - y mean(dy y)) / std per
  // channel: a projection, so each channel of the exact dx sums to 0 over its N x spatial values.
  // From a lossy y (error e) it does not: dx gains -mean(e) mean(dy y) / std in every value, and
  // the layers below multiply that by the mean of their own inputs, which the exact gradient never
  // meets (scripts/fuzz_nets seed 718, inputs of mean 0.39 and spread 0.03: with uniform errors
  // in x_norm_ a Convolution's weight gradient 12-24% off where dx was 3% off, 2-5% once
  // centred; the seed's ADAPTIVE run 29% -> 4.9%). So after that backward the
  // store takes each channel's mean out of dx again, with the gemv and gemms against BatchNorm's
  // vectors of ones that its own passes use; mean_ is scratch after Backward as inside it.
  static void CentreBatchNormInputGradient(Layer<Dtype>* layer, Blob<Dtype>* bottom) {
    BatchNormLayer<Dtype>* bn = dynamic_cast<BatchNormLayer<Dtype>*>(layer);
    CHECK(bn) << "not a BatchNorm layer";
    const int num = bottom->shape(0), channels = bn->channels_;
    const int spatial = bottom->count() / (num * channels);
    const Dtype per_value = Dtype(1) / (static_cast<Dtype>(num) * spatial);
    if (Caffe::mode() == Caffe::CPU) {
      caffe_cpu_gemv<Dtype>(CblasNoTrans, channels * num, spatial, per_value, bottom->cpu_diff(),
                            bn->spatial_sum_multiplier_.cpu_data(), 0.,
                            bn->num_by_chans_.mutable_cpu_data());
      caffe_cpu_gemv<Dtype>(CblasTrans, num, channels, 1., bn->num_by_chans_.cpu_data(),
                            bn->batch_sum_multiplier_.cpu_data(), 0., bn->mean_.mutable_cpu_data());
      caffe_cpu_gemm<Dtype>(CblasNoTrans, CblasNoTrans, num, channels, 1, 1,
                            bn->batch_sum_multiplier_.cpu_data(), bn->mean_.cpu_data(), 0.,
                            bn->num_by_chans_.mutable_cpu_data());
      caffe_cpu_gemm<Dtype>(CblasNoTrans, CblasNoTrans, channels * num, spatial, 1, -1,
                            bn->num_by_chans_.cpu_data(), bn->spatial_sum_multiplier_.cpu_data(),
                            1., bottom->mutable_cpu_diff());
    } else {
#ifndef CPU_ONLY
      caffe_gpu_gemv<Dtype>(CblasNoTrans, channels * num, spatial, per_value, bottom->gpu_diff(),
                            bn->spatial_sum_multiplier_.gpu_data(), 0.,
                            bn->num_by_chans_.mutable_gpu_data());
      caffe_gpu_gemv<Dtype>(CblasTrans, num, channels, 1., bn->num_by_chans_.gpu_data(),
                            bn->batch_sum_multiplier_.gpu_data(), 0., bn->mean_.mutable_gpu_data());
      caffe_gpu_gemm<Dtype>(CblasNoTrans, CblasNoTrans, num, channels, 1, 1,
                            bn->batch_sum_multiplier_.gpu_data(), bn->mean_.gpu_data(), 0.,
                            bn->num_by_chans_.mutable_gpu_data());
      caffe_gpu_gemm<Dtype>(CblasNoTrans, CblasNoTrans, channels * num, spatial, 1, -1,
                            bn->num_by_chans_.gpu_data(), bn->spatial_sum_multiplier_.gpu_data(),
                            1., bottom->mutable_gpu_diff());
#else
      NO_GPU;
#endif
    }
  }
  // Before BatchNorm's backward (batch statistics), on a lossy x_norm_: each channel moved back to
  // the mean and mean square the exact one has (batchnorm_moments.hpp), where that gains, or
  // every channel where x_norm_ has runs of one value (`ties`). variance_ holds std.
  static void MatchBatchNormMoments(Layer<Dtype>* layer, double eb, bool ties) {
    BatchNormLayer<Dtype>* bn = dynamic_cast<BatchNormLayer<Dtype>*>(layer);
    CHECK(bn) << "not a BatchNorm layer";
    CHECK_EQ(sizeof(Dtype), sizeof(float)) << "the store keeps floats only";
    Blob<Dtype>& y = bn->x_norm_;
    const int num = y.shape(0), channels = bn->channels_;
    const int spatial = y.count() / (num * channels);
    const float eps = static_cast<float>(bn->eps_);
    // q <= 1: no channel is worth moving, and x_norm_ is left untouched (comet_bn::worth_moving)
    if (!ties && static_cast<double>(num) * spatial * eb * eb >= 12.) return;
    if (Caffe::mode() == Caffe::CPU) {
      CometMatchBatchNormMoments(num, channels, spatial,
                                 reinterpret_cast<const float*>(bn->variance_.cpu_data()), eps,
                                 eb, ties, reinterpret_cast<float*>(y.mutable_cpu_data()));
    } else {
#ifndef CPU_ONLY
      CometMatchBatchNormMomentsGpu(num, channels, spatial,
                                    reinterpret_cast<const float*>(bn->variance_.gpu_data()), eps,
                                    eb, ties, reinterpret_cast<float*>(y.mutable_gpu_data()));
#else
      NO_GPU;
#endif
    }
  }
  // Before BatchNorm's x_norm_ is encoded, where it holds a ReLU's zeros: each channel less its
  // tie offset, in place (batchnorm_moments.hpp); the offsets, for the payload to add back, and
  // *eb lowered by the roundings' slack. NULL (x_norm_ untouched) where the slack is not small
  // against eb.
  static shared_ptr<CometPayload> ShiftXNormTies(Layer<Dtype>* layer, bool on_device, float* eb) {
    BatchNormLayer<Dtype>* bn = dynamic_cast<BatchNormLayer<Dtype>*>(layer);
    CHECK(bn) << "not a BatchNorm layer";
    CHECK_EQ(sizeof(Dtype), sizeof(float)) << "the store keeps floats only";
    Blob<Dtype>& y = bn->x_norm_;
    const int channels = bn->channels_;
    const size_t inner = y.count() / (static_cast<size_t>(y.shape(0)) * channels);
    const double n = static_cast<double>(y.shape(0)) * inner;
    const double slack = comet_bn::tie_shift_slack(n, *eb);
    if (!(slack < *eb / 4)) return shared_ptr<CometPayload>();
    shared_ptr<CometPayload> o(new CometPayload(CometPayload::OFFSETS, on_device, channels,
                                                bn->layer_param().name() + " x_norm offsets"));
    o->Allocate(channels * sizeof(float));
    float* offsets = static_cast<float*>(o->data());
    if (!on_device) {
      CometTieOffsets(channels, reinterpret_cast<const float*>(bn->mean_.cpu_data()),
                      reinterpret_cast<const float*>(bn->variance_.cpu_data()), n, offsets);
      CometAddChannelOffsets(y.count(), channels, inner, offsets, -1.f,
                             reinterpret_cast<float*>(y.mutable_cpu_data()));
    } else {
#ifndef CPU_ONLY
      CometTieOffsetsGpu(channels, reinterpret_cast<const float*>(bn->mean_.gpu_data()),
                         reinterpret_cast<const float*>(bn->variance_.gpu_data()), n, offsets);
      CometAddChannelOffsetsGpu(y.count(), channels, inner, offsets, -1.f,
                                reinterpret_cast<float*>(y.mutable_gpu_data()));
#else
      NO_GPU;
#endif
    }
    o->inner = inner;
    *eb = static_cast<float>(*eb - slack);
    return o;
  }
  // In-place Scale's copy of its input, taken from the BatchNorm layer that wrote that input.
  static void RebuildScaleCopy(Layer<Dtype>* scale, Layer<Dtype>* batch_norm) {
    ScaleLayer<Dtype>* s = dynamic_cast<ScaleLayer<Dtype>*>(scale);
    BatchNormLayer<Dtype>* bn = dynamic_cast<BatchNormLayer<Dtype>*>(batch_norm);
    CHECK(s && bn) << "not a Scale after a BatchNorm";
    CHECK_EQ(s->temp_.count(), bn->x_norm_.count()) << "Scale's input is not BatchNorm's output";
    CometFillWhole whole(s->temp_.data().get());  // the copy writes all of it
    if (Caffe::mode() == Caffe::CPU) {
      caffe_copy(s->temp_.count(), bn->x_norm_.cpu_data(), s->temp_.mutable_cpu_data());
    } else {
#ifndef CPU_ONLY
      caffe_copy(s->temp_.count(), bn->x_norm_.gpu_data(), s->temp_.mutable_gpu_data());
#else
      NO_GPU;
#endif
    }
  }
};

}  // namespace caffe

#endif  // CAFFE_COMET_LAYER_ACCESS_HPP_
