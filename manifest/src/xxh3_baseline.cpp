// XXH3 with what every CPU of the target has (SSE2 on x86-64, NEON on aarch64).
#define WSYNC_XXH3_SET xxh3_baseline
#if defined(__x86_64__)
#define WSYNC_XXH3_ISA "sse2"
#elif defined(__aarch64__)
#define WSYNC_XXH3_ISA "neon"
#else
#define WSYNC_XXH3_ISA "scalar"
#endif
#include "xxh3_kernels.inc"
