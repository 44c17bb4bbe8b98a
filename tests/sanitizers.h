// Whether this test is built with AddressSanitizer, under GCC (__SANITIZE_ADDRESS__) or Clang
// (__has_feature): a test that limits the address space cannot run under it.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define ZEROFLAT_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ZEROFLAT_TEST_ASAN 1
#endif
#endif
#ifndef ZEROFLAT_TEST_ASAN
#define ZEROFLAT_TEST_ASAN 0
#endif
