// COMET-Caffe: the registry of max pooling layers whose forward a store computes (pool_codes.hpp).
#include <atomic>  // NOLINT(build/c++11)
#include <map>
#include <mutex>  // NOLINT(build/c++11)

#include "caffe/comet/pool_codes.hpp"

namespace caffe {

namespace {

// Several solvers may train at once (one per GPU), each store with its own layers.
template <typename Dtype>
struct Registry {
  std::mutex lock;
  std::map<const Layer<Dtype>*, typename CometPoolCodes<Dtype>::Taker*> takers;
  std::atomic<int> size{0};  // read without the lock: COMET off pays one load
  static Registry& Get() {
    static Registry* r = new Registry();  // never destroyed: layers may go after static exit
    return *r;
  }
};

}  // namespace

template <typename Dtype>
void CometPoolCodes<Dtype>::Register(const Layer<Dtype>* layer, Taker* taker) {
  Registry<Dtype>& r = Registry<Dtype>::Get();
  std::lock_guard<std::mutex> hold(r.lock);
  if (taker) r.takers[layer] = taker;
  else r.takers.erase(layer);
  r.size = static_cast<int>(r.takers.size());
}

template <typename Dtype>
bool CometPoolCodes<Dtype>::TakeForward(const Layer<Dtype>* layer, const Blob<Dtype>* bottom,
                                        Blob<Dtype>* top, bool on_device) {
  Registry<Dtype>& r = Registry<Dtype>::Get();
  if (r.size.load() == 0) return false;
  Taker* taker = NULL;
  {
    std::lock_guard<std::mutex> hold(r.lock);
    typename std::map<const Layer<Dtype>*, Taker*>::const_iterator it = r.takers.find(layer);
    if (it == r.takers.end()) return false;
    taker = it->second;
  }
  // The store that registered it runs this net's forward on this thread; it unregisters before
  // it goes.
  return taker->TakeForward(layer, bottom, top, on_device);
}

template class CometPoolCodes<float>;
template class CometPoolCodes<double>;

}  // namespace caffe
