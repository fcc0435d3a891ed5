#ifndef CAFFE_COMET_NET_CALLBACKS_HPP_
#define CAFFE_COMET_NET_CALLBACKS_HPP_

// COMET-Caffe: per-layer callbacks on a net that may outlive whoever registered them. Net keeps
// raw pointers to its callbacks and upstream has no way to remove one, while a train net can
// outlive its solver (pycaffe: `net = solver.net; del solver`), and with it the activation store
// and the resume counter that registered callbacks on it: the net's next Forward called freed
// objects and crashed, COMET on or off. When such an owner goes, it makes its callbacks inert or
// self-sufficient and hands them over here; they are freed once the net is gone too.

#include <vector>

#include "caffe/common.hpp"
#include "caffe/net.hpp"

namespace caffe {

template <typename Dtype>
class CometNetCallbacks {
 public:
  typedef typename Net<Dtype>::Callback Callback;
  // Keeps `callbacks`, registered on `net`, until the net is gone (its first layer expired).
  static void Outlive(const Net<Dtype>& net, const std::vector<shared_ptr<Callback> >& callbacks);
  // Nets, still alive, that hold callbacks handed over (tests); those of nets gone are freed first.
  static size_t NetsHolding();
};

}  // namespace caffe

#endif  // CAFFE_COMET_NET_CALLBACKS_HPP_
