// C++ consumer of <sz/sz.hpp>.
#include <sz/sz.hpp>
#include <cmath>
#include <cstdio>
int main() {
  std::vector<float> x(1000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = i % 4 ? 0.0f : (float)i;
  auto s = sz::compress(x.data(), {10, 100}, 1e-2, sz::Mode::Rel);
  auto y = sz::decompress(s);
  auto h = sz::read_header(s.data(), s.size());
  for (size_t i = 0; i < x.size(); ++i)
    if (std::fabs((double)x[i] - y[i]) > h.eb_abs) { std::printf("bound violated\n"); return 1; }
  std::printf("consumer_cpp ok (%zu bytes)\n", s.size());
  return 0;
}
