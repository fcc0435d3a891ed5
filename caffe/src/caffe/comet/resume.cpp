// COMET-Caffe: exact resume (include/caffe/comet/resume.hpp).
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "caffe/comet/curand_state.hpp"
#include "caffe/comet/net_callbacks.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/comet/resume.hpp"
#include "caffe/layers/base_data_layer.hpp"
#include "caffe/util/rng.hpp"

namespace caffe {

namespace {

const char kMagic[] = "comet-resume 1";

}  // namespace

std::string CometFileBeside(const std::string& solverstate, const std::string& extension) {
  std::string base = solverstate;
  const char* suffixes[] = {".solverstate.h5", ".solverstate"};
  for (int i = 0; i < 2; ++i) {
    const std::string s(suffixes[i]);
    if (base.size() > s.size() && base.compare(base.size() - s.size(), s.size(), s) == 0) {
      base = base.substr(0, base.size() - s.size());
      break;
    }
  }
  return base + extension;
}

// Counts the forwards of the train net's data layers (each hands out one batch); once its owner
// is gone (the net outlives the solver), nothing.
template <typename Dtype>
class CometResume<Dtype>::Counter final : public Net<Dtype>::Callback {
 public:
  explicit Counter(CometResume<Dtype>* owner) : owner_(owner) {}
  void Orphaned() { owner_ = NULL; }

 protected:
  virtual void run(int layer) {
    if (owner_ && owner_->is_data_[layer]) ++owner_->batches_[layer];
  }

 private:
  CometResume<Dtype>* owner_;
};

template <typename Dtype>
CometResume<Dtype>::CometResume(Solver<Dtype>* solver)
    : solver_(solver), net_(solver->net().get()), counter_(new Counter(this)) {
  const int L = net_->layers().size();
  is_data_.assign(L, false);
  batches_.assign(L, 0);
  pending_.assign(L, -1);
  for (int i = 0; i < L; ++i) {
    Layer<Dtype>* l = net_->layers()[i].get();
    // Layers that read on from where they are: the prefetching readers and HDF5Data.
    is_data_[i] = net_->bottom_ids(i).empty() &&
                  (dynamic_cast<BasePrefetchingDataLayer<Dtype>*>(l) != NULL ||
                   std::string(l->type()) == "HDF5Data");
  }
  net_->add_before_forward(counter_.get());
  solver_->add_callback(this);
}

template <typename Dtype>
CometResume<Dtype>::~CometResume() {
  counter_->Orphaned();  // the net may live on and call it (net_callbacks.hpp)
  CometNetCallbacks<Dtype>::Outlive(
      *net_, std::vector<shared_ptr<typename Net<Dtype>::Callback> >(1, counter_));
}

template <typename Dtype>
void CometResume<Dtype>::Save(const std::string& filename) const {
  std::ofstream out(filename.c_str());
  out << kMagic << "\n" << "iter " << solver_->iter() << "\n"
      << "seeded " << (solver_->param().random_seed() >= 0 ? 1 : 0) << "\n"
      << "rng " << *caffe_rng() << "\n";
  const CometCurandPosition gpu = CometCurandTell();  // this thread's cuRAND (GPU Dropout)
  out << "curand " << (gpu.seeded ? 1 : 0) << " " << gpu.seed << " " << gpu.drawn << "\n";
  for (int i = 0; i < batches_.size(); ++i) {
    if (is_data_[i]) out << "layer " << i << " " << net_->layer_names()[i] << " " << batches_[i] << "\n";
  }
  out.close();
  if (!out) LOG(WARNING) << "COMET resume: cannot write " << filename;
}

template <typename Dtype>
void CometResume<Dtype>::Load(const std::string& solverstate_filename) {
  const std::string filename = CometFileBeside(solverstate_filename, ".resumestate");
  std::ifstream in(filename.c_str());
  if (!in.good()) {
    LOG(WARNING) << "COMET resume: no " << filename << " beside the snapshot; training goes on "
                 << "from another data position and random stream (as upstream Caffe's would)";
    return;
  }
  std::string line, magic;
  std::getline(in, magic);
  if (magic != kMagic) CometFatal("COMET resume: " + filename + " is not a resume state");
  int iter = -1, seeded = 0;
  std::string rng_state;
  CometCurandPosition gpu = {false, 0, 0};
  bool have_gpu = false;
  std::vector<long long> batches(batches_.size(), 0);
  std::vector<bool> placed(batches_.size(), false);  // layer -> its line was read
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string key;
    ls >> key;
    if (key == "iter") {
      ls >> iter;
    } else if (key == "seeded") {
      ls >> seeded;
    } else if (key == "rng") {
      std::getline(ls, rng_state);
    } else if (key == "curand") {
      int curand_seeded = -1;
      ls >> curand_seeded >> gpu.seed >> gpu.drawn;
      if (!ls || (curand_seeded != 0 && curand_seeded != 1))
        CometFatal("COMET resume: " + filename + " has a corrupt curand line: " + line);
      gpu.seeded = curand_seeded == 1;
      have_gpu = true;
    } else if (key == "layer") {
      int index = -1;
      long long count = -1;
      std::string name;
      ls >> index >> name >> count;
      if (index < 0 || index >= is_data_.size() || !is_data_[index] || count < 0 ||
          net_->layer_names()[index] != name) {
        CometFatal("COMET resume: " + filename + " names data layer '" + name +
                   "', which this net does not have at that place (another net's state?)");
      }
      batches[index] = count;
      placed[index] = true;
    } else if (!key.empty()) {
      CometFatal("COMET resume: " + filename + " has an unknown line: " + line);
    }
  }
  // Save writes a line for every data layer: one missing (a file cut short) would leave that
  // layer at its first batch while the log said the positions were restored.
  for (int i = 0; i < placed.size(); ++i) {
    if (is_data_[i] && !placed[i])
      CometFatal("COMET resume: " + filename + " has no position for data layer '" +
                 net_->layer_names()[i] + "' (cut short, or another net's state?)");
  }
  if (iter != solver_->iter()) {
    std::ostringstream os;
    os << "COMET resume: " << filename << " belongs to iteration " << iter
       << ", the solver state to iteration " << solver_->iter();
    CometFatal(os.str());
  }
  if (!seeded || solver_->param().random_seed() < 0) {
    LOG(WARNING) << "COMET resume: the solver has no random_seed, so data transformations and "
                 << "the layers' starting weights differ from the first run; not exact";
  }
  for (int i = 0; i < batches.size(); ++i) pending_[i] = is_data_[i] ? batches[i] : -1;
  if (Caffe::solver_rank() > 0) {
    // -gpu all: the file is the root solver's. This solver was seeded with random_seed plus its
    // rank; the root's generators would make it draw the root's numbers (Dropout masks,
    // transformations) on every GPU. Its own are not saved: its data positions are restored,
    // its random streams start over, as upstream's would.
    if (Caffe::solver_rank() == 1)
      LOG(WARNING) << "COMET resume: the solvers of the other GPUs keep their own random "
                   << "generators, seeded anew (only the root's are saved); not exact";
    return;
  }
  std::istringstream rs(rng_state);
  rs >> *caffe_rng();
  std::ostringstream check;  // the generator writes back exactly what it read, or it was corrupt
  check << *caffe_rng();
  std::istringstream a(rng_state), b(check.str());
  std::string x, y;
  bool same = true;
  while (same && (a >> x)) same = (b >> y) && x == y;
  if (!same || (b >> y))
    CometFatal("COMET resume: the random generator's state in " + filename + " is corrupt");
  LOG(INFO) << "COMET resume: random generator restored from " << filename
            << "; the data layers catch up when training starts";
  // cuRAND: only where this run draws from it (GPU mode) and the first run's was seeded. A state
  // written before the line existed (or by a CPU run) leaves it as the solver seeded it.
  if (Caffe::mode() == Caffe::GPU && have_gpu) {
    if (gpu.seeded) {
      CometCurandSeek(gpu);
      LOG(INFO) << "COMET resume: cuRAND put back at " << gpu.drawn << " values after seed "
                << gpu.seed;
    } else if (gpu.drawn > 0) {
      LOG(WARNING) << "COMET resume: cuRAND was seeded at random in the first run, so GPU "
                   << "Dropout masks differ from it; not exact";
    }
  }
}

// The first iteration after a restore: each data layer hands out, without the net around it,
// the batches it had handed out when the snapshot was taken (less those drawn since).
template <typename Dtype>
void CometResume<Dtype>::on_start() {
  for (int i = 0; i < pending_.size(); ++i) {
    if (pending_[i] < 0) continue;
    const long long target = pending_[i];
    pending_[i] = -1;
    if (batches_[i] > target) {
      LOG(WARNING) << "COMET resume: data layer " << net_->layer_names()[i] << " has handed out "
                   << batches_[i] - target << " batches more than at the snapshot since the "
                   << "restore; it goes on from there (not exact)";
      continue;
    }
    Layer<Dtype>* l = net_->layers()[i].get();
    for (long long b = batches_[i]; b < target; ++b)
      l->Forward(net_->bottom_vecs()[i], net_->top_vecs()[i]);
    LOG(INFO) << "COMET resume: data layer " << net_->layer_names()[i] << " replayed "
              << target - batches_[i] << " batches; data positions restored";
    batches_[i] = target;
  }
}

INSTANTIATE_CLASS(CometResume);

}  // namespace caffe
