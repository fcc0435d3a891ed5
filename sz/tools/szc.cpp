// szc - command-line front end: compress / decompress raw float32 files, print statistics.
//   szc compress   -i in.f32 -o out.sz -d N,C,H,W -e EB [--rel] [--no-zstd] [-t T] [--gpu]
//   szc decompress -i in.sz  -o out.f32 [-t T] [--gpu]
//   szc info       -i in.sz
// compress also decodes the stream in memory and prints ratio, max error, PSNR, throughput.
#include "sz/sz.h"
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#ifdef SZC_CUDA
#include <cuda_runtime.h>
#endif

namespace {

[[noreturn]] void die(const std::string& msg) {
  fprintf(stderr, "szc: %s\n", msg.c_str());
  exit(1);
}

const char kUsage[] =
    "usage: szc compress -i IN.f32 -o OUT.sz -d N[,C[,H[,W]]] -e EB [--rel] [--no-zstd] [-t T] [--gpu]\n"
    "       szc decompress -i IN.sz -o OUT.f32 [-t T] [--gpu]\n"
    "       szc info -i IN.sz\n"
    "       szc --help\n";

// A usage error: the usage on stderr, exit 2.
[[noreturn]] void usage() {
  fputs(kUsage, stderr);
  exit(2);
}

// Asked for: the usage and the options on stdout, exit 0.
[[noreturn]] void help() {
  fputs(kUsage, stdout);
  fputs("\n"
        "compress    IN.f32 holds raw little-endian float32 values, N*C*H*W of them (innermost\n"
        "            last); writes the stream, decodes it in memory and prints ratio, max error,\n"
        "            PSNR and throughput (exit 3 if the bound was violated)\n"
        "decompress  writes the stream's values as raw float32\n"
        "info        prints the stream header\n"
        "  -e EB       error bound (> 0): absolute, or a fraction of max - min with --rel\n"
        "  --no-zstd   no lossless stage (the format of device streams)\n"
        "  -t T        CPU threads (0 = all)\n"
        "  --gpu       use the CUDA backend\n"
        "A stream file must hold exactly one stream: an empty file, a truncated one and one\n"
        "with bytes after the stream are errors (exit 1).\n",
        stdout);
  exit(0);
}

std::vector<uint8_t> read_file(const std::string& path) {
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) die("cannot open " + path + ": " + strerror(errno));
  std::vector<uint8_t> b;
  uint8_t tmp[1 << 16];
  size_t r;
  while ((r = fread(tmp, 1, sizeof tmp, f)) > 0) b.insert(b.end(), tmp, tmp + r);
  if (ferror(f)) die("read error on " + path);
  fclose(f);
  return b;
}

void write_file(const std::string& path, const void* p, size_t n) {
  FILE* f = fopen(path.c_str(), "wb");
  if (!f) die("cannot create " + path + ": " + strerror(errno));
  if (n && fwrite(p, 1, n, f) != n) die("write error on " + path);
  if (fclose(f)) die("write error on " + path);
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void check(int st, const char* what) {
  if (st != SZ_OK) die(std::string(what) + ": " + sz_strerror(st));
}

#ifdef SZC_CUDA
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(e));
}
#endif

// The input file; an empty one is named as such (never a valid stream, nor a tensor of
// nonzero dims).
std::vector<uint8_t> read_input(const std::string& path) {
  std::vector<uint8_t> b = read_file(path);
  if (b.empty()) die("empty input: " + path + " has 0 bytes");
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) usage();
  if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) help();
  std::string cmd = argv[1], in, out;
  std::vector<size_t> dims;
  double eb = 0;
  int mode = SZ_EB_ABS, threads = 0;
  bool zstd = true, gpu = false;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    if (a == "-i") in = next();
    else if (a == "-o") out = next();
    else if (a == "-e") {
      std::string v = next();
      char* end;
      eb = strtod(v.c_str(), &end);
      if (*end) die("bad error bound '" + v + "'");
    } else if (a == "-d") {
      std::string v = next();
      size_t pos = 0;
      while (pos <= v.size()) {
        size_t c = v.find(',', pos);
        std::string t = v.substr(pos, c == std::string::npos ? std::string::npos : c - pos);
        char* end;
        unsigned long long d = strtoull(t.c_str(), &end, 10);
        if (t.empty() || *end) die("bad dims '" + v + "'");
        dims.push_back((size_t)d);
        if (c == std::string::npos) break;
        pos = c + 1;
      }
    } else if (a == "-t") threads = atoi(next().c_str());
    else if (a == "--rel") mode = SZ_EB_REL;
    else if (a == "--no-zstd") zstd = false;
    else if (a == "--gpu") gpu = true;
    else if (a == "--help" || a == "-h") help();
    else usage();
  }
  if (in.empty()) usage();
  if (gpu && !sz_has_cuda()) die("this libsz was built without CUDA");
#ifndef SZC_CUDA
  if (gpu) die("szc was built without CUDA");
#endif

  if (cmd != "info" && cmd != "compress" && cmd != "decompress") usage();
  if (cmd == "info") {
    std::vector<uint8_t> s = read_input(in);
    sz_header_info h;
    check(sz_read_header(s.data(), s.size(), &h), "info");
    printf("dims:");
    for (uint32_t i = 0; i < h.ndims; ++i) printf(" %llu", (unsigned long long)h.dims[i]);
    printf("\nelements: %llu\nmode: %s\neb requested: %g\neb absolute: %g\nlossless: %s\n"
           "stream bytes: %llu\nratio: %.3f\n",
           (unsigned long long)h.n_elems, h.mode ? "rel" : "abs", h.eb_requested, h.eb_abs,
           h.lossless ? "zstd" : "none", (unsigned long long)h.stream_size,
           h.stream_size ? 4.0 * h.n_elems / h.stream_size : 0.0);
    return 0;
  }
  if (out.empty()) usage();

  if (cmd == "compress") {
    if (dims.empty() || dims.size() > 4) die("-d takes 1 to 4 dims");
    if (!(eb > 0)) die("-e takes an error bound > 0");
    size_t n = 1;
    for (size_t d : dims) n *= d;
    std::vector<uint8_t> raw = n ? read_input(in) : read_file(in);
    if (raw.size() != 4 * n) die("file has " + std::to_string(raw.size()) + " bytes, dims need " + std::to_string(4 * n));
    std::vector<float> x(n), y(n);
    if (n) memcpy(x.data(), raw.data(), 4 * n);
    std::vector<uint8_t> s(sz_compress_bound(n));
    size_t size = 0;
    double t0, t1, t2;
    if (!gpu) {
      sz_params p;
      sz_params_default(&p, eb, mode);
      if (!zstd) p.lossless = SZ_LOSSLESS_NONE;
      p.nthreads = threads;
      t0 = now();
      check(sz_compress_host_ex(x.data(), dims.data(), (int)dims.size(), &p, s.data(), s.size(), &size), "compress");
      t1 = now();
      check(sz_decompress_host_ex(s.data(), size, y.data(), n, threads), "decompress");
      t2 = now();
    } else {
#ifdef SZC_CUDA
      float *dx, *dy;
      void *ds, *dscr;
      size_t scr = sz_device_scratch_size(n);
      cuda_check(cudaMalloc(&dx, 4 * n + 4), "cudaMalloc");
      cuda_check(cudaMalloc(&dy, 4 * n + 4), "cudaMalloc");
      cuda_check(cudaMalloc(&ds, s.size()), "cudaMalloc");
      cuda_check(cudaMalloc(&dscr, scr ? scr : 1), "cudaMalloc");
      cuda_check(cudaMemcpy(dx, x.data(), 4 * n, cudaMemcpyHostToDevice), "copy");
      check(sz_compress_device(dx, dims.data(), (int)dims.size(), eb, mode, ds, s.size(), &size, dscr, scr, nullptr), "warm-up");
      t0 = now();
      check(sz_compress_device(dx, dims.data(), (int)dims.size(), eb, mode, ds, s.size(), &size, dscr, scr, nullptr), "compress");
      t1 = now();
      check(sz_decompress_device(ds, size, dy, n, dscr, scr, nullptr), "decompress");
      t2 = now();
      cuda_check(cudaMemcpy(s.data(), ds, size, cudaMemcpyDeviceToHost), "copy");
      cuda_check(cudaMemcpy(y.data(), dy, 4 * n, cudaMemcpyDeviceToHost), "copy");
      cudaFree(dx); cudaFree(dy); cudaFree(ds); cudaFree(dscr);
#endif
    }
    write_file(out, s.data(), size);
    sz_header_info h;
    check(sz_read_header(s.data(), size, &h), "header");
    double maxerr = 0, se = 0, lo = INFINITY, hi = -INFINITY;
    size_t nfin = 0;
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(x[i])) continue;
      double e = std::fabs((double)x[i] - y[i]);
      maxerr = e > maxerr ? e : maxerr;
      se += e * e;
      lo = x[i] < lo ? x[i] : lo;
      hi = x[i] > hi ? x[i] : hi;
      nfin++;
    }
    double range = hi - lo, mse = nfin ? se / nfin : 0;
    double psnr = mse > 0 && range > 0 ? 20 * std::log10(range) - 10 * std::log10(mse) : INFINITY;
    printf("elements %zu  bytes %zu -> %zu  ratio %.3f\n", n, 4 * n, size, size ? 4.0 * n / size : 0.0);
    printf("eb_abs %g  max_error %g  psnr %.2f dB  bound %s\n", h.eb_abs, maxerr, psnr,
           maxerr <= h.eb_abs ? "held" : "VIOLATED");
    printf("compress %.3f GB/s  decompress %.3f GB/s (%s)\n", 4e-9 * n / (t1 - t0),
           4e-9 * n / (t2 - t1), gpu ? "gpu" : "cpu");
    return maxerr <= h.eb_abs ? 0 : 3;
  }
  if (cmd == "decompress") {
    std::vector<uint8_t> s = read_input(in);
    sz_header_info h;
    check(sz_read_header(s.data(), s.size(), &h), "decompress");
    std::vector<float> y((size_t)h.n_elems);
    double t0 = now();
    if (!gpu) {
      check(sz_decompress_host_ex(s.data(), s.size(), y.data(), y.size(), threads), "decompress");
    } else {
#ifdef SZC_CUDA
      float* dy;
      void *ds, *dscr;
      size_t scr = sz_device_scratch_size(y.size());
      cuda_check(cudaMalloc(&dy, 4 * y.size() + 4), "cudaMalloc");
      cuda_check(cudaMalloc(&ds, s.size()), "cudaMalloc");
      cuda_check(cudaMalloc(&dscr, scr ? scr : 1), "cudaMalloc");
      cuda_check(cudaMemcpy(ds, s.data(), s.size(), cudaMemcpyHostToDevice), "copy");
      check(sz_decompress_device(ds, s.size(), dy, y.size(), dscr, scr, nullptr), "decompress");
      cuda_check(cudaMemcpy(y.data(), dy, 4 * y.size(), cudaMemcpyDeviceToHost), "copy");
      cudaFree(dy); cudaFree(ds); cudaFree(dscr);
#endif
    }
    double t1 = now();
    write_file(out, y.data(), 4 * y.size());
    printf("elements %zu  decompress %.3f GB/s\n", y.size(), 4e-9 * y.size() / (t1 - t0));
    return 0;
  }
  usage();
}
