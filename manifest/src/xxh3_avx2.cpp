// XXH3 with AVX2: compiled with -mavx2, called only where the CPU has it (checksum.cpp).
#define WSYNC_XXH3_SET xxh3_avx2
#define WSYNC_XXH3_ISA "avx2"
#include "xxh3_kernels.inc"
