// What the host CPU offers the vector kernels (the dtype conversions in common, the devices' copy
// kernels), detected once per process.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define ZEROFLAT_X86 1
#else
#define ZEROFLAT_X86 0
#endif

namespace zeroflat::detail {

struct CpuFeatures {
  bool avx = false;   // the CPU has AVX and the OS saves the YMM state
  bool f16c = false;  // F16C, with AVX usable as above
};

// The features of this CPU (all false off x86), detected on the first call.
inline const CpuFeatures& cpu_features() noexcept {
  static const CpuFeatures features = [] {
    CpuFeatures f;
#if ZEROFLAT_X86
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return f;
    const bool osxsave = (ecx & (1u << 27)) != 0;
    if (!osxsave) return f;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const bool ymm_state = (lo & 0x6u) == 0x6u;
    f.avx = ymm_state && (ecx & (1u << 28)) != 0;
    f.f16c = f.avx && (ecx & (1u << 29)) != 0;
#endif
    return f;
  }();
  return features;
}

}  // namespace zeroflat::detail
