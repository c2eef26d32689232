// RC_MULTIVERSION marks a kernel entry point to be compiled twice (AVX2 and baseline x86-64) and
// picked at load time; `flatten` inlines the loops it calls so each clone vectorises them for its
// own instruction set. Elsewhere it only flattens, and so under ThreadSanitizer, whose
// instrumentation of the load-time resolver runs before the sanitizer is set up (a crash when the
// library loads).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define RC_MULTIVERSION __attribute__((target_clones("avx2", "default"), flatten))
#else
#define RC_MULTIVERSION __attribute__((flatten))
#endif
