#ifndef CAFFE_COMET_CURAND_STATE_HPP_
#define CAFFE_COMET_CURAND_STATE_HPP_

// COMET-Caffe: where Caffe's cuRAND generator stands, so that an exact resume can put it back.
//
// cuRAND's host generator (Caffe::curand_generator(), one per thread) has no state to save. What can
// be saved is its seed and how many values were drawn since the seed was set; cuRAND's absolute
// offset (curandSetGeneratorOffset: "the first random number generated will be the offset-th in the
// sequence") then puts a re-seeded generator where it was. Patch 0030 reports every seed
// (Caffe::set_random_seed; Caffe::SetDevice re-seeds at random) and every draw (the caffe_gpu_rng_*
// functions). The resume state (resume.cpp) keeps the position beside each snapshot. On a GPU,
// Dropout draws its masks from this generator; the CPU's generator is kept there already.

namespace caffe {

struct CometCurandPosition {
  bool seeded;                // false: seeded at random (no random_seed), so not reproducible
  unsigned long long seed;    // the seed Caffe::set_random_seed gave
  unsigned long long drawn;   // 32-bit values drawn since (a double counts two)
};

// The hooks (patch 0030), for the calling thread's generator.
void CometCurandSeeded(unsigned int seed);
void CometCurandSeededAtRandom();
void CometCurandDrew(unsigned long long values);

// The calling thread's position, and putting its generator there (seed, then the absolute offset).
// CPU_ONLY builds have no generator: Seek does nothing there.
CometCurandPosition CometCurandTell();
void CometCurandSeek(const CometCurandPosition& position);

}  // namespace caffe

#endif  // CAFFE_COMET_CURAND_STATE_HPP_
