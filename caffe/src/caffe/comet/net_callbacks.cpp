// COMET-Caffe: callbacks that outlive their owner (include/caffe/comet/net_callbacks.hpp).
#include <list>
#include <vector>

#include "boost/thread/mutex.hpp"
#include "boost/weak_ptr.hpp"
#include "caffe/comet/net_callbacks.hpp"

namespace caffe {

namespace {

template <typename Dtype>
struct Kept {
  const Net<Dtype>* net;                   // compared only while `alive` has not expired
  boost::weak_ptr<Layer<Dtype> > alive;    // the net's first layer: it goes with the net
  std::vector<shared_ptr<typename Net<Dtype>::Callback> > callbacks;
};

template <typename Dtype>
struct Registry {
  boost::mutex mutex;
  std::list<Kept<Dtype> > nets;

  void FreeGone() {  // under the mutex
    for (typename std::list<Kept<Dtype> >::iterator it = nets.begin(); it != nets.end();) {
      if (it->alive.expired()) it = nets.erase(it);
      else ++it;
    }
  }
};

template <typename Dtype>
Registry<Dtype>& TheRegistry() {
  static Registry<Dtype>* registry = new Registry<Dtype>();  // never destroyed: nets die at exit
  return *registry;
}

}  // namespace

template <typename Dtype>
void CometNetCallbacks<Dtype>::Outlive(const Net<Dtype>& net,
                                       const std::vector<shared_ptr<Callback> >& callbacks) {
  Registry<Dtype>& r = TheRegistry<Dtype>();
  boost::mutex::scoped_lock lock(r.mutex);
  r.FreeGone();
  if (net.layers().empty() || callbacks.empty()) return;  // nothing calls them
  for (typename std::list<Kept<Dtype> >::iterator it = r.nets.begin(); it != r.nets.end(); ++it) {
    if (it->net == &net && !it->alive.expired()) {
      it->callbacks.insert(it->callbacks.end(), callbacks.begin(), callbacks.end());
      return;
    }
  }
  Kept<Dtype> k;
  k.net = &net;
  k.alive = net.layers()[0];
  k.callbacks = callbacks;
  r.nets.push_back(k);
}

template <typename Dtype>
size_t CometNetCallbacks<Dtype>::NetsHolding() {
  Registry<Dtype>& r = TheRegistry<Dtype>();
  boost::mutex::scoped_lock lock(r.mutex);
  r.FreeGone();
  return r.nets.size();
}

INSTANTIATE_CLASS(CometNetCallbacks);

}  // namespace caffe
