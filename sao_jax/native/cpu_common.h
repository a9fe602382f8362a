// What the CPU kernels of this folder share: 8-float vectors, row groups, a vectorizable exp, and a
// parallel loop over XLA's intra-op thread pool. Included by each kernel's .cc (the build hashes
// this file with the source).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace sao_native {

namespace ffi = xla::ffi;

// Vectors of 8 floats (GCC/Clang vector extensions): one AVX register, two SSE or NEON registers.
typedef float Vec __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(Vec v, float* p) { std::memcpy(p, &v, sizeof(v)); }

// Calls body(r0, std::integral_constant<int, R>) for groups of R = 8, 4, 2, 1 consecutive rows that
// cover rows [0, n) (8s first, then n's remaining binary digits): a kernel's register block for R
// rows is a template, so no row is computed for nothing.
template <typename Body>
inline void ForGroups(int64_t n, const Body& body) {
  int64_t r0 = 0;
  for (; n - r0 >= 8; r0 += 8) body(r0, std::integral_constant<int, 8>{});
  if (n - r0 >= 4) body(r0, std::integral_constant<int, 4>{}), r0 += 4;
  if (n - r0 >= 2) body(r0, std::integral_constant<int, 2>{}), r0 += 2;
  if (n - r0 >= 1) body(r0, std::integral_constant<int, 1>{});
}

// Copies rows row(0) … row(n − 1), `depth` floats each, into `out` by depth, group by group
// (ForGroups): the k-th number of row r0 + r of a group of R rows lands at r0 · depth + k · R + r,
// so one pointer reaches the R inputs of a depth.
template <typename RowPointer>
inline void CopyByDepth(int64_t n, int64_t depth, const RowPointer& row, float* out) {
  ForGroups(n, [&](int64_t r0, auto group) {
    constexpr int R = decltype(group)::value;
    for (int r = 0; r < R; ++r) {
      const float* from = row(r0 + r);
      for (int64_t k = 0; k < depth; ++k) out[r0 * depth + k * R + r] = from[k];
    }
  });
}

// exp(x) for x <= 0 (softmax terms), written out so the compiler can vectorize it without
// -ffast-math: x = n·ln2 + r with |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial (relative
// error < 2e-7 there), times 2^n built in the exponent bits; x < −87 (below float's normal range)
// gives 0.
inline float ExpNonPositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = (clamped * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5·2^23
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// Runs body(0), ..., body(count − 1) on the calling thread and, when it has one, XLA's intra-op
// thread pool. The caller takes tasks too, so the call finishes even if no pool thread ever starts.
// A helper that starts after the caller has closed the work returns without touching the caller's
// stack (`body`): the caller sets `closed`, then waits for `active` to be 0, and a helper raises
// `active` before it reads `closed` (sequentially consistent atomics: one of the two sees the other).
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t count, const Body& body) {
  struct Work {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
    std::atomic<bool> closed{false};
  };
  auto work = std::make_shared<Work>();
  const Body* shared_body = &body;
  auto drain = [](Work& w, int64_t count, const Body& body) {
    for (int64_t i; (i = w.next.fetch_add(1)) < count;) body(i);
  };
  // The caller works too, so num_threads − 1 helpers make as many working threads as the pool has
  // (one a core); one more helper only adds wake-up and contention cost to a small decode step.
  const int64_t helpers = std::max<int64_t>(0, std::min<int64_t>(pool.num_threads(), count) - 1);
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([work, count, shared_body, drain] {
      work->active.fetch_add(1);
      if (!work->closed.load()) drain(*work, count, *shared_body);
      work->active.fetch_sub(1);
    });
  }
  drain(*work, count, body);
  work->closed.store(true);
  while (work->active.load() != 0) std::this_thread::yield();
}

}  // namespace sao_native
