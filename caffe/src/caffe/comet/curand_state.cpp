// COMET-Caffe: the position of Caffe's cuRAND generator (include/caffe/comet/curand_state.hpp).
#include "caffe/comet/curand_state.hpp"
#include "caffe/common.hpp"

namespace caffe {

namespace {
// Caffe keeps one generator per thread (Caffe::Get() is thread-local), so the position is too.
thread_local CometCurandPosition position = {false, 0, 0};
}  // namespace

void CometCurandSeeded(unsigned int seed) {
  position.seeded = true;
  position.seed = seed;
  position.drawn = 0;
}

void CometCurandSeededAtRandom() {
  position.seeded = false;
  position.seed = 0;
  position.drawn = 0;
}

void CometCurandDrew(unsigned long long values) { position.drawn += values; }

CometCurandPosition CometCurandTell() { return position; }

void CometCurandSeek(const CometCurandPosition& p) {
#ifndef CPU_ONLY
  CHECK(p.seeded) << "COMET resume: a generator seeded at random cannot be put back";
  curandGenerator_t gen = Caffe::curand_generator();
  CHECK(gen) << "COMET resume: cuRAND is not available to restore";
  CURAND_CHECK(curandSetPseudoRandomGeneratorSeed(gen, p.seed));
  CURAND_CHECK(curandSetGeneratorOffset(gen, p.drawn));
#endif
  position = p;
}

}  // namespace caffe
