// XXH3 with AVX-512F: compiled with -mavx512f, called only where the CPU has it (checksum.cpp).
#define WSYNC_XXH3_SET xxh3_avx512
#define WSYNC_XXH3_ISA "avx512"
#include "xxh3_kernels.inc"
