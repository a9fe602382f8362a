// A decode step's projections on the CPU, as one XLA FFI call: y [n, width] = x [n, depth] · w [depth,
// width] for a few rows n (one per sequence), width a multiple of 16.
// Why a kernel: XLA:CPU runs a decode step's few-row dots ([32, 256] · [256, 128 … 1024] at d256)
// well below the core's matmul rate. Here a task takes a range of 16-column strips; for each group of up to 8
// rows and each strip it keeps the group's 8 × 16 sums in registers down the whole depth, so no
// partial sum goes through memory, and the strip's weights come in row after row (a cache line each).
// Rows go in groups of 8, 4, 2, 1 (cpu_common.h's ForGroups); a group's inputs are first copied in
// depth order [depth][R] (CopyByDepth), so one pointer reaches the R inputs of a depth. Groups of
// fewer than 4 rows split each sum into 4 / R chains over alternate depths: one or two rows' chains
// are too few to hide the FMA latency (benchmarks/RESULTS.md has the rates by rows).

#include <algorithm>
#include <cstdint>
#include <memory>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace sao_native;  // Vec, Load, Store, ForGroups, CopyByDepth, ParallelFor: cpu_common.h

constexpr int64_t kStrip = 2 * kLanes;  // columns whose sums a register block holds (one cache line)

// y[r][c0, c0 + 16) = Σ_k x[k][r] · w[k][c0, c0 + 16) for r < R: x by depth, w at column c0 (rows
// `width` apart), y row-major (rows `width` apart).
template <int R>
inline void StripTimesRows(const float* x, const float* w, int64_t depth, int64_t width, float* y) {
  constexpr int kChains = R >= 4 ? 1 : 4 / R;  // depth must be a multiple (checked by the caller)
  Vec a[kChains][R][2] = {};
#pragma GCC unroll 4
  for (int64_t k = 0; k < depth; k += kChains) {
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c) {
      const Vec w0 = Load(w + (k + c) * width), w1 = Load(w + (k + c) * width + kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float xr = x[(k + c) * R + r];
        a[c][r][0] += xr * w0;
        a[c][r][1] += xr * w1;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 1; c < kChains; ++c) a[0][r][0] += a[c][r][0], a[0][r][1] += a[c][r][1];
    Store(a[0][r][0], y + r * width);
    Store(a[0][r][1], y + r * width + kLanes);
  }
}

ffi::Error FewRowsMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                             ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || wd[1] % kStrip != 0 || wd[0] % 4 != 0) {
    return ffi::Error::InvalidArgument(
        "few rows matmul: x [n, depth], w [depth, width], depth a multiple of 4, width of 16");
  }
  const int64_t n = xd[0], depth = xd[1], width = wd[1], strips = width / kStrip;
  const std::unique_ptr<float[]> by_depth(new float[n * depth]);
  CopyByDepth(n, depth, [&](int64_t r) { return x.typed_data() + r * depth; }, by_depth.get());
  // One task per thread: each reads its strips' weights once per group of rows.
  const int64_t tasks = std::min<int64_t>(strips, std::max<int64_t>(1, pool.num_threads()));
  ParallelFor(pool, tasks, [&](int64_t t) {
    const int64_t s0 = strips * t / tasks, s1 = strips * (t + 1) / tasks;
    ForGroups(n, [&](int64_t r0, auto group) {
      constexpr int R = decltype(group)::value;
      for (int64_t c0 = s0 * kStrip; c0 < s1 * kStrip; c0 += kStrip)
        StripTimesRows<R>(by_depth.get() + r0 * depth, w.typed_data() + c0, depth, width,
                          y->typed_data() + r0 * width + c0);
    });
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SaoFewRowsMatmul, FewRowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [n, depth]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [depth, width]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [n, width]
