#ifndef CAFFE_COMET_RESUME_HPP_
#define CAFFE_COMET_RESUME_HPP_

// COMET-Caffe: what an exact resume needs beyond upstream's .solverstate (which keeps the weights,
// the history and the iteration): the main thread's random generator (Dropout masks, DummyData
// fillers), and how many batches each data layer of the train net has handed out. A data layer's
// reader and its transformer's random crops and mirrors follow from the solver's random_seed, so
// replaying that many batches puts them where they were. Written beside each snapshot as
// <prefix>_iter_N.resumestate (text), read back by Solver::Restore (patch 0020): the generator
// at once, the batches when training starts again (batches the caller has drawn since, as
// upstream's solver tests do by hand, count). On a GPU, the position of Caffe's cuRAND generator
// (its seed and the values drawn since: comet/curand_state.hpp) too, which GPU Dropout draws from.

#include <string>
#include <vector>

#include "caffe/net.hpp"
#include "caffe/solver.hpp"

namespace caffe {

// The file with `extension` (".resumestate", ".cometstate") beside a snapshot's solver state
// (<prefix>_iter_N.solverstate or .solverstate.h5).
std::string CometFileBeside(const std::string& solverstate, const std::string& extension);

template <typename Dtype>
class CometResume : public Solver<Dtype>::Callback {
 public:
  explicit CometResume(Solver<Dtype>* solver);
  ~CometResume();
  void Save(const std::string& filename) const;
  // From the .resumestate beside solverstate_filename: replays the data layers and restores the
  // generator. Without the file, says that the run goes on as upstream's would (not exactly).
  void Load(const std::string& solverstate_filename);
  const std::vector<long long>& batches() const { return batches_; }  // per layer, data layers

 protected:
  virtual void on_start();  // replays what Load left to replay
  virtual void on_gradients_ready() {}

 private:
  class Counter;
  Solver<Dtype>* solver_;
  Net<Dtype>* net_;
  std::vector<bool> is_data_;     // layer -> a source layer whose batches move on (Data, ...)
  std::vector<long long> batches_;  // layer -> forwards so far
  std::vector<long long> pending_;  // layer -> where Load wants it, or -1
  shared_ptr<Counter> counter_;  // registered on the net, which may outlive this
};

}  // namespace caffe

#endif  // CAFFE_COMET_RESUME_HPP_
