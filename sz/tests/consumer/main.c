/* C consumer: the C header compiles as C and the library links. */
#include <sz/sz.h>
#include <stdio.h>
#include <stdlib.h>
int main(void) {
  float x[100], y[100];
  size_t dims[2] = {10, 10}, size = 0;
  for (int i = 0; i < 100; ++i) x[i] = (i % 3) ? (float)i * 0.25f : 0.0f;
  unsigned char* out = malloc(sz_compress_bound(100));
  int st = sz_compress_host(x, dims, 2, 1e-3, SZ_EB_ABS, out, sz_compress_bound(100), &size);
  if (st != SZ_OK) { printf("compress: %s\n", sz_strerror(st)); return 1; }
  st = sz_decompress_host(out, size, y, 100);
  if (st != SZ_OK) { printf("decompress: %s\n", sz_strerror(st)); return 1; }
  for (int i = 0; i < 100; ++i)
    if (y[i] - x[i] > 1e-3f || x[i] - y[i] > 1e-3f) { printf("bound violated at %d\n", i); return 1; }
  free(out);
  printf("consumer_c ok (%zu bytes)\n", size);
  return 0;
}
