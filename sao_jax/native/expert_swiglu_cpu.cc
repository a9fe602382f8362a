// The experts' SwiGLU over a capacity buffer on the CPU, as one XLA FFI call, skipping the buffer's
// empty slots:
//   h[e, r] = silu(x[e, r] · G[e]) ⊙ (x[e, r] · U[e]),   y[e, r] = h[e, r] · D[e]   for r < count[e]
//   y[e, r] = 0                                                                       for r ≥ count[e]
// with x [experts, capacity, embed], G and U [experts, embed, mlp], D [experts, mlp, embed]: what
// `moe.swiglu` gives on a buffer whose slots r ≥ count[e] are zero rows.
// Why a kernel: a decode step's dropless capacity buffer (`moe.few_tokens_dispatch`) holds about
// twice as many slots as tokens, and XLA:CPU's batched dot runs them all. Here one task per
// (expert, 8 filled slots) reads the expert's weights once, row after row, adding each row times
// the slots' inputs into sums held in L1 (8 rows × width floats: up to 16 KB for widths ≤ 512,
// which `moe.filled_slots_swiglu` requires; wider, the sums spill from L1 and the batched dot was
// faster). d256 MoE (8 experts, 256 → 512 → 256), 16 slots per expert, ~8 filled, on the 2-core
// CPU: 0.70–0.90 ms a layer against 1.27–1.66 ms for the batched dot; d512 (1024 wide): 4.5 ms
// against 4.1.
// The tasks run over XLA's intra-op pool. silu(z) = z · sigmoid(z), sigmoid from
// `ExpNonPositive` of −|z| (relative error < 2e-7).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace sao_native;  // Vec, Load, ExpNonPositive, ParallelFor: cpu_common.h

constexpr int64_t kRowBlock = 8;  // rows whose sums one pass over the weights updates

inline void Store(Vec v, float* p) { std::memcpy(p, &v, sizeof(v)); }

inline float Silu(float z) {
  const float e = ExpNonPositive(-std::abs(z));  // exp(−|z|) ∈ (0, 1]
  return z * (z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

struct Shape {
  int64_t experts, capacity, embed, mlp;
};

// acc[r][·] = Σ_k rows[r][k] · w[k][·] for r < count (≤ kRowBlock), w [depth, width] read once, row
// after row (contiguous, so the hardware prefetchers keep up); acc, [kRowBlock][width / 8]
// vectors, stays in L1.
void RowsTimesMatrix(const float* const rows[kRowBlock], int64_t count, const float* w, int64_t depth,
                     int64_t width, Vec* acc) {
  const int64_t vectors = width / kLanes;
  std::fill(acc, acc + kRowBlock * vectors, Vec{});
  for (int64_t k = 0; k < depth; ++k) {
    const float* w_k = w + k * width;
    for (int64_t r = 0; r < count; ++r) {
      const float x = rows[r][k];
      Vec* acc_r = acc + r * vectors;
      for (int64_t c = 0; c < vectors; ++c) acc_r[c] += x * Load(w_k + c * kLanes);
    }
  }
}

// Task (expert e, rows [r0, r0 + 8) of its filled slots): h = silu(x·G) ⊙ x·U, then y = h·D.
void ExpertRows(const float* x, const float* gate, const float* up, const float* down, const int32_t* count,
                float* y, const Shape& s, int64_t task, Vec* scratch) {
  const int64_t blocks = (s.capacity + kRowBlock - 1) / kRowBlock;
  const int64_t e = task / blocks, r0 = task % blocks * kRowBlock;
  const int64_t n = std::clamp<int64_t>(count[e], 0, s.capacity);
  float* y_rows = y + (e * s.capacity + r0) * s.embed;
  const int64_t rows = std::clamp<int64_t>(n - r0, 0, std::min(kRowBlock, s.capacity - r0));
  std::fill(y_rows + rows * s.embed, y_rows + std::min(kRowBlock, s.capacity - r0) * s.embed, 0.0f);
  if (rows == 0) return;
  const int64_t mlp_vectors = s.mlp / kLanes;
  Vec* g = scratch;                                // [kRowBlock][mlp / 8]
  Vec* u = g + kRowBlock * mlp_vectors;            // [kRowBlock][mlp / 8], then h
  Vec* out = u + kRowBlock * mlp_vectors;          // [kRowBlock][embed / 8]
  const float* x_rows[kRowBlock];
  for (int64_t r = 0; r < kRowBlock; ++r) x_rows[r] = x + (e * s.capacity + r0 + std::min(r, rows - 1)) * s.embed;
  RowsTimesMatrix(x_rows, rows, gate + e * s.embed * s.mlp, s.embed, s.mlp, g);
  RowsTimesMatrix(x_rows, rows, up + e * s.embed * s.mlp, s.embed, s.mlp, u);
  const float* h_rows[kRowBlock];
  for (int64_t r = 0; r < kRowBlock; ++r) h_rows[r] = reinterpret_cast<const float*>(u + std::min(r, rows - 1) * mlp_vectors);
  for (int64_t i = 0; i < rows * mlp_vectors; ++i) {
    Vec silu;
    for (int64_t lane = 0; lane < kLanes; ++lane) silu[lane] = Silu(g[i][lane]);
    u[i] *= silu;
  }
  RowsTimesMatrix(h_rows, rows, down + e * s.mlp * s.embed, s.mlp, s.embed, out);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < s.embed / kLanes; ++c) Store(out[r * (s.embed / kLanes) + c], y_rows + r * s.embed + c * kLanes);
}

ffi::Error ExpertSwigluImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> count,
                            ffi::Buffer<ffi::F32> gate, ffi::Buffer<ffi::F32> up, ffi::Buffer<ffi::F32> down,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), gd = gate.dimensions();
  if (xd.size() != 3 || gd.size() != 3) {
    return ffi::Error::InvalidArgument("x [experts, capacity, embed]; gate, up [experts, embed, mlp]");
  }
  const Shape s{xd[0], xd[1], xd[2], gd[2]};
  const auto ud = up.dimensions(), dd = down.dimensions();
  if (gd[0] != s.experts || gd[1] != s.embed || ud.size() != 3 || ud[0] != s.experts || ud[1] != s.embed ||
      ud[2] != s.mlp || dd.size() != 3 || dd[0] != s.experts || dd[1] != s.mlp || dd[2] != s.embed ||
      static_cast<int64_t>(count.element_count()) != s.experts || s.embed % kLanes != 0 ||
      s.mlp % kLanes != 0) {
    return ffi::Error::InvalidArgument(
        "expert swiglu: down [experts, mlp, embed], count [experts], embed and mlp multiples of 8");
  }
  if (s.capacity == 0) return ffi::Error::Success();
  const int64_t blocks = (s.capacity + kRowBlock - 1) / kRowBlock;
  const int64_t tasks = s.experts * blocks, scratch_vectors = kRowBlock * (2 * s.mlp + s.embed) / kLanes;
  const auto scratch = std::make_unique<Vec[]>(tasks * scratch_vectors);  // one allocation a call
  ParallelFor(pool, tasks, [&](int64_t task) {
    ExpertRows(x.typed_data(), gate.typed_data(), up.typed_data(), down.typed_data(), count.typed_data(),
               y->typed_data(), s, task, scratch.get() + task * scratch_vectors);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SaoExpertSwiglu, ExpertSwigluImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x slots
                                  .Arg<ffi::Buffer<ffi::S32>>()  // filled slots per expert
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate
                                  .Arg<ffi::Buffer<ffi::F32>>()  // up
                                  .Arg<ffi::Buffer<ffi::F32>>()  // down
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
