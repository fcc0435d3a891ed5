// fuzz_driver.cpp - deterministic mutation fuzzer for compilers without libFuzzer (g++).
// usage: fuzz_driver SECONDS CORPUS_DIR   -- mutates the corpus files with a fixed-seed RNG
// (bit flips, byte writes, truncation, insertion, splicing, length-field edits, mode-byte
// edits) and calls LLVMFuzzerTestOneInput until the time is up. Build with ASan/UBSan.
#include <dirent.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  if (argc < 3) { fprintf(stderr, "usage: %s SECONDS CORPUS_DIR\n", argv[0]); return 2; }
  double seconds = atof(argv[1]);
  std::vector<std::vector<uint8_t>> corpus;
  if (DIR* d = opendir(argv[2])) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      std::string p = std::string(argv[2]) + "/" + e->d_name;
      FILE* f = fopen(p.c_str(), "rb");
      if (!f) continue;
      std::vector<uint8_t> b;
      int c;
      while ((c = fgetc(f)) != EOF) b.push_back((uint8_t)c);
      fclose(f);
      corpus.push_back(b);
    }
    closedir(d);
  }
  if (corpus.empty()) corpus.push_back({0});
  std::mt19937_64 g(12345);
  auto t0 = std::chrono::steady_clock::now();
  uint64_t runs = 0;
  for (auto& c : corpus) { LLVMFuzzerTestOneInput(c.data(), c.size()); runs++; }
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
    for (int inner = 0; inner < 64; ++inner) {
      std::vector<uint8_t> b = corpus[g() % corpus.size()];
      int nmut = 1 + g() % 4;
      for (int m = 0; m < nmut; ++m) {
        if (b.empty()) b.push_back(0);
        size_t pos = g() % b.size();
        switch (g() % 8) {
          case 0: b[pos] ^= (uint8_t)(1u << (g() % 8)); break;
          case 1: b[pos] = (uint8_t)g(); break;
          case 2: b.resize(g() % (b.size() + 1)); break;
          case 3: b.insert(b.begin() + pos, (uint8_t)g()); break;
          case 4: {  // splice with another seed
            const auto& o = corpus[g() % corpus.size()];
            if (!o.empty()) { size_t q = g() % o.size(); b.insert(b.begin() + pos, o.begin() + q, o.end()); }
            break;
          }
          case 5: {  // edit a 64-bit length field of the header (offsets 1 + 16..95)
            size_t off = 1 + 16 + 8 * (g() % 10);
            if (off + 8 <= b.size()) for (int k = 0; k < 8; ++k) b[off + k] = (uint8_t)(g() >> (8 * (g() % 2)));
            break;
          }
          case 6: b[0] ^= 2; break;   // toggle the target's prefix-read mode
          default: b[0] |= 1; break;  // ask the target to fix checksums
        }
      }
      LLVMFuzzerTestOneInput(b.data(), b.size());
      runs++;
    }
  }
  printf("fuzz_driver: %llu runs in %.0f s over %zu seeds, no crash\n", (unsigned long long)runs, seconds, corpus.size());
  return 0;
}
