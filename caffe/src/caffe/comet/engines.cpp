// COMET-Caffe: Caffe's engines for the layers whose cuDNN Backward reads both input and output
// (include/caffe/comet/engines.hpp says why).
#include <string>
#include <vector>

#include "caffe/comet/engines.hpp"
#include "caffe/common.hpp"

namespace caffe {

namespace {

// Sets Caffe's engine on lp when its type is one of those above and its engine is DEFAULT.
bool GiveCaffesEngine(LayerParameter* lp) {
  const std::string& t = lp->type();
  if (t == "ReLU" && lp->relu_param().engine() == ReLUParameter_Engine_DEFAULT) {
    lp->mutable_relu_param()->set_engine(ReLUParameter_Engine_CAFFE);
  } else if (t == "Sigmoid" && lp->sigmoid_param().engine() == SigmoidParameter_Engine_DEFAULT) {
    lp->mutable_sigmoid_param()->set_engine(SigmoidParameter_Engine_CAFFE);
  } else if (t == "TanH" && lp->tanh_param().engine() == TanHParameter_Engine_DEFAULT) {
    lp->mutable_tanh_param()->set_engine(TanHParameter_Engine_CAFFE);
  } else if (t == "Softmax" && lp->softmax_param().engine() == SoftmaxParameter_Engine_DEFAULT) {
    lp->mutable_softmax_param()->set_engine(SoftmaxParameter_Engine_CAFFE);
  } else if (t == "LRN" && lp->lrn_param().engine() == LRNParameter_Engine_DEFAULT) {
    lp->mutable_lrn_param()->set_engine(LRNParameter_Engine_CAFFE);
  } else if (t == "Pooling" && lp->pooling_param().engine() == PoolingParameter_Engine_DEFAULT &&
             lp->pooling_param().pool() == PoolingParameter_PoolMethod_AVE) {
    lp->mutable_pooling_param()->set_engine(PoolingParameter_Engine_CAFFE);
  } else {
    return false;
  }
  return true;
}

}  // namespace

std::vector<std::string> CometChooseEngines(const SolverParameter& solver, NetParameter* net) {
  std::vector<std::string> changed;
  if (!solver.has_comet() || !solver.comet().enabled() || solver.comet().cudnn_engines())
    return changed;
  for (int i = 0; i < net->layer_size(); ++i) {
    if (GiveCaffesEngine(net->mutable_layer(i))) changed.push_back(net->layer(i).name());
  }
#ifdef USE_CUDNN
  // Without cuDNN, DEFAULT is Caffe's engine already: naming it changes nothing worth a line.
  if (!changed.empty() && Caffe::root_solver()) {
    std::string names;
    for (size_t i = 0; i < changed.size() && i < 8; ++i) names += (i ? ", " : "") + changed[i];
    if (changed.size() > 8) names += ", ...";
    LOG(INFO) << "COMET: " << changed.size() << " layers use Caffe's engine, not cuDNN's (" << names
              << "): cuDNN's backward reads both their input and their output, so the store could "
                 "free neither; comet { cudnn_engines: true } keeps cuDNN's";
  }
#endif
  return changed;
}

}  // namespace caffe
