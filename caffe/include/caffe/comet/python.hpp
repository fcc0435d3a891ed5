#ifndef CAFFE_COMET_PYTHON_HPP_
#define CAFFE_COMET_PYTHON_HPP_

// COMET-Caffe: Solver.comet_stats() for pycaffe. Included only by python/caffe/_caffe.cpp.

#include <boost/python.hpp>

#include "caffe/comet/store.hpp"
#include "caffe/solver.hpp"

namespace caffe {

// In Python a read of memory the store freed raises RuntimeError instead of ending the process;
// log lines keep Caffe's classic prefix, as the tools' do (patch 0016).
static const bool comet_python_init = (CometSetFatalThrows(true), FLAGS_log_year_in_prefix = false,
                                       true);

// The figures of the last display interval: {'iter', 'layers': [{layer, blob, kind, ratio, eb,
// ms, dense_bytes, stored_bytes}], 'bounds': {layer: eb}, 'memory': {'current': {kind: bytes},
// 'peak': {...}, 'at_peak': {...}, 'peak_total': bytes}, 'pool': {reused, allocated, returned,
// cached, in_use, peak_in_use, peak_held} (with memory_pool)}; None when COMET is off.
template <typename Dtype>
boost::python::object CometStatsDict(Solver<Dtype>* solver) {
  namespace bp = boost::python;
  CometStore<Dtype>* store = solver->comet();
  if (!store) return bp::object();
  bp::dict out;
  out["iter"] = store->last_report_iter();
  bp::list layers;
  for (size_t i = 0; i < store->entries().size(); ++i) {
    const typename CometStore<Dtype>::Entry& e = store->entries()[i];
    bp::dict d;
    d["layer"] = e.name;
    d["blob"] = e.blob;
    d["kind"] = std::string(CometStore<Dtype>::ActionName(e.action));
    d["ratio"] = e.last_ratio;
    d["eb"] = e.last_eb;
    d["ms"] = e.last_ms;
    d["encode_ms"] = e.last_encode_ms;
    d["decode_ms"] = e.last_decode_ms;
    d["wait_ms"] = e.last_wait_ms;
    d["dense_bytes"] = e.last_dense;
    d["stored_bytes"] = e.last_stored;
    layers.append(d);
  }
  out["layers"] = layers;
  bp::dict bounds;
  for (size_t b = 0; b < store->bounds().size(); ++b)
    bounds[store->bounds()[b].layer] = store->bound(store->bounds()[b].layer);
  out["bounds"] = bounds;
  const CometMemory& m = store->memory();
  bp::dict current, peak, at_peak;
  for (int k = 0; k < CometMemory::NUM_KINDS; ++k) {
    current[CometMemory::name(k)] = m.current[k];
    peak[CometMemory::name(k)] = m.peak[k];
    at_peak[CometMemory::name(k)] = m.at_peak[k];
  }
  bp::dict memory;
  memory["current"] = current;
  memory["peak"] = peak;
  memory["at_peak"] = at_peak;
  memory["peak_total"] = m.peak_total;
  out["memory"] = memory;
  if (store->param().memory_pool()) {
    const CometPoolStats ps = CometPoolQueryHere();
    bp::dict pool;
    pool["reused"] = ps.hits;
    pool["allocated"] = ps.misses;
    pool["returned"] = ps.evicted;
    pool["cached"] = ps.cached;
    pool["in_use"] = ps.in_use;
    pool["peak_in_use"] = ps.peak_in_use;
    pool["peak_held"] = ps.peak_held;
    out["pool"] = pool;
  }
  return out;
}

}  // namespace caffe

#endif  // CAFFE_COMET_PYTHON_HPP_
