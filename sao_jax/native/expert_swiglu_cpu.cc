// A decode step's routed experts on the CPU, as one XLA FFI call: for tokens x [tokens, embed], their
// top-k expert ids and weights [tokens, k], and the expert weights packed [experts, 3 · embed · mlp]
// (`native.decode.pack_experts`: per expert G, U [embed, mlp] then D [mlp, embed], each matrix
// stored as [width / 16][depth][16]),
//   y[t] = Σ_j w[t, j] · SwiGLU_{e(t, j)}(x[t]),   SwiGLU_e(x) = (silu(x·G[e]) ⊙ x·U[e])·D[e],
// what `moe.dense_dispatch` gives (dropless; an id outside [0, experts) contributes nothing).
// Why a kernel: a decode step has a few tokens per expert, so it is bound by reading every chosen
// expert's weights; XLA's dispatch (slots, gathers, a batched dot over padded slots, a cond on
// the routing) cost about as much again. Here the assignments are grouped by expert (token order),
// one task per expert with assignments gathers its tokens and reads each weight matrix once: a
// packed 16-column strip's weights for all depths are contiguous, read in memory order with the
// strip's sums in registers down the whole depth, prefetching kStripAhead lines ahead; experts no
// token chose are not read. The sampler packs once per weight version (`rollout.decode`). The
// packed layout beat the weights as stored read in panels of 8 rows, which beat a strip of 16
// columns read down the stored rows (strided reads from DRAM), and all of them beat XLA's batched
// dot over padded slots. The rows' inputs and sums are kept in the group orders below (one pointer
// for a block's 8 rows, not 8). benchmarks/RESULTS.md (the sampler section) has the timings of each
// of these choices. The tasks run over XLA's intra-op pool. silu(z) = z · sigmoid(z), sigmoid from
// `ExpNonPositive` of −|z| (relative error < 2e-7).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace sao_native;  // Vec, Load, Store, ExpNonPositive, ForGroups, CopyByDepth, ParallelFor

constexpr int64_t kStrip = 2 * kLanes;  // columns whose sums a register block holds (one cache line)

inline float Silu(float z) {
  const float e = ExpNonPositive(-std::abs(z));  // exp(−|z|) ∈ (0, 1]
  return z * (z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

struct Shape {
  int64_t experts, embed, mlp;
};

// The rows of a pass go in groups (ForGroups, cpu_common.h). A group of R rows starting at row r0
// keeps its numbers at r0 · cols of a buffer, in one of two orders that let one pointer and constant
// offsets reach all R rows (8 pointers, one per row, spilled to the stack and ran at about half the
// speed):
//   by depth:  [cols][R]           (a matrix product's input: x[r][k] at k · R + r)
//   by strip:  [cols / 16][R][16]  (its output: y[r][c] at (c / 16) · 16R + 16r + c % 16)

// a[r] += Σ_{k < depth} x[k][r] · w[k][0, 16) for r < R, the sums of R rows × 16 columns in registers:
// x by depth, w's rows `stride` floats apart; with kAhead > 0 the row kAhead on is prefetched.
template <int R, int64_t kAhead>
inline void AddProducts(const float* x, const float* w, int64_t depth, int64_t stride, Vec (&a)[R][2]) {
#pragma GCC unroll 8
  for (int64_t k = 0; k < depth; ++k) {
    const Vec w0 = Load(w + k * stride), w1 = Load(w + k * stride + kLanes);
    if (kAhead > 0) __builtin_prefetch(w + (k + kAhead) * stride, 0, 2);  // past the end: a hint, no fault
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xr = x[k * R + r];
      a[r][0] += xr * w0;
      a[r][1] += xr * w1;
    }
  }
}

constexpr int64_t kStripAhead = 128;  // packed weight lines (one a depth) prefetched ahead

// y = x · w for n rows: x [n, depth] by depth, w packed [width / 16][depth][16]; y [n, width] by strip.
void RowsTimesStrips(const float* x, int64_t n, const float* w, int64_t depth, int64_t width, float* y) {
  for (int64_t c0 = 0; c0 < width; c0 += kStrip) {
    ForGroups(n, [&](int64_t r0, auto rows) {
      constexpr int R = decltype(rows)::value;
      Vec a[R][2] = {};  // a packed strip's rows are 16 floats apart, read down the whole depth
      AddProducts<R, kStripAhead>(x + r0 * depth, w + c0 * depth, depth, kStrip, a);
      for (int r = 0; r < R; ++r) {
        Store(a[r][0], y + r0 * width + c0 * R + r * kStrip);
        Store(a[r][1], y + r0 * width + c0 * R + r * kStrip + kLanes);
      }
    });
  }
}

// The three packed matrices of one expert.
struct ExpertWeights {
  const float *gate, *up, *down;
};

// An expert's assignments (rows of x listed in `tokens`, n of them): h = silu(x·G) ⊙ x·U, then
// out = h·D, [n, embed] row after row. scratch: n · (embed + 2 · mlp) floats.
void Expert(const float* x, const int64_t* tokens, int64_t n, const ExpertWeights& weights, const Shape& s,
            float* out, float* scratch) {
  float* rows = scratch;            // [n, embed] by depth: the tokens' rows; later x·G·…·D by strip
  float* g = rows + n * s.embed;    // [n, mlp] by strip; later h by depth
  float* u = g + n * s.mlp;         // [n, mlp] by strip, then h
  CopyByDepth(n, s.embed, [&](int64_t r) { return x + tokens[r] * s.embed; }, rows);
  RowsTimesStrips(rows, n, weights.gate, s.embed, s.mlp, g);
  RowsTimesStrips(rows, n, weights.up, s.embed, s.mlp, u);
  for (int64_t i = 0; i < n * s.mlp; i += kLanes) {
    Vec silu;
    const Vec g_i = Load(g + i);
    for (int64_t lane = 0; lane < kLanes; ++lane) silu[lane] = Silu(g_i[lane]);
    Store(Load(u + i) * silu, u + i);
  }
  ForGroups(n, [&](int64_t r0, auto group) {  // h by strip (u) → by depth (g)
    constexpr int R = decltype(group)::value;
    const float* from = u + r0 * s.mlp;
    float* to = g + r0 * s.mlp;
    for (int64_t c0 = 0; c0 < s.mlp; c0 += kStrip)
      for (int r = 0; r < R; ++r)
        for (int64_t c = 0; c < kStrip; ++c) to[(c0 + c) * R + r] = from[c0 * R + r * kStrip + c];
  });
  RowsTimesStrips(g, n, weights.down, s.mlp, s.embed, rows);
  ForGroups(n, [&](int64_t r0, auto group) {  // by strip → row after row
    constexpr int R = decltype(group)::value;
    const float* from = rows + r0 * s.embed;
    for (int r = 0; r < R; ++r)
      for (int64_t c0 = 0; c0 < s.embed; c0 += kStrip)
        std::memcpy(out + (r0 + r) * s.embed + c0, from + c0 * R + r * kStrip, kStrip * sizeof(float));
  });
}

// x [tokens, embed], expert_ids and weights [tokens, k].
ffi::Error CheckTokens(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::S32>& expert_ids,
                       const ffi::Buffer<ffi::F32>& weights) {
  const auto xd = x.dimensions(), id = expert_ids.dimensions(), wd = weights.dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0] || wd.size() != 2 || wd[0] != id[0] || wd[1] != id[1]) {
    return ffi::Error::InvalidArgument("x [tokens, embed]; expert_ids, weights [tokens, k]");
  }
  return ffi::Error::Success();
}

// y = Σ over each token's experts, expert e's matrices from weights_of(e).
template <typename WeightsOf>
void Routed(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::S32>& expert_ids,
            const ffi::Buffer<ffi::F32>& weights, const Shape& s, const WeightsOf& weights_of,
            ffi::ResultBuffer<ffi::F32>& y) {
  const int64_t tokens = x.dimensions()[0], k = expert_ids.dimensions()[1];
  const int32_t* ids = expert_ids.typed_data();
  const float* w = weights.typed_data();
  // Assignments (t, j) grouped by expert in token order: expert e's are slots first[e] .. first[e + 1];
  // slot_of[t · k + j] is (t, j)'s slot (−1: an id out of range), token_of[slot] its token.
  std::vector<int64_t> first(s.experts + 1, 0), token_of(tokens * k), slot_of(tokens * k, -1);
  for (int64_t a = 0; a < tokens * k; ++a)
    if (ids[a] >= 0 && ids[a] < s.experts) ++first[ids[a] + 1];
  for (int64_t e = 0; e < s.experts; ++e) first[e + 1] += first[e];
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t a = 0; a < tokens * k; ++a) {
    if (ids[a] < 0 || ids[a] >= s.experts) continue;
    slot_of[a] = next[ids[a]]++;
    token_of[slot_of[a]] = a / k;
  }
  const int64_t assigned = first[s.experts];
  const std::unique_ptr<float[]> outs(new float[assigned * s.embed]),  // uninitialized: every row is written
      scratch(new float[assigned * (s.embed + 2 * s.mlp)]);
  ParallelFor(pool, s.experts, [&](int64_t e) {
    const int64_t n = first[e + 1] - first[e];
    if (n == 0) return;
    Expert(x.typed_data(), token_of.data() + first[e], n, weights_of(e), s, outs.get() + first[e] * s.embed,
           scratch.get() + first[e] * (s.embed + 2 * s.mlp));
  });
  float* out = y->typed_data();
  for (int64_t t = 0; t < tokens; ++t) {  // y[t] = Σ_j w[t, j] · out of (t, j), j in order
    float* y_t = out + t * s.embed;
    std::fill(y_t, y_t + s.embed, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t slot = slot_of[t * k + j];
      if (slot < 0) continue;
      const float* o = outs.get() + slot * s.embed;
      for (int64_t c = 0; c < s.embed; c += kLanes) Store(Load(y_t + c) + w[t * k + j] * Load(o + c), y_t + c);
    }
  }
}

ffi::Error RoutedSwigluPackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> expert_ids,
                                  ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::F32> packed,
                                  ffi::ResultBuffer<ffi::F32> y) {
  if (auto error = CheckTokens(x, expert_ids, weights); error.failure()) return error;
  const auto pd = packed.dimensions();
  const int64_t embed = x.dimensions()[1];
  if (pd.size() != 2 || embed % kStrip != 0 || pd[1] % (3 * embed) != 0 || (pd[1] / (3 * embed)) % kStrip != 0) {
    return ffi::Error::InvalidArgument(
        "routed swiglu (packed): packed [experts, 3 · embed · mlp], embed and mlp multiples of 16");
  }
  const Shape s{pd[0], embed, pd[1] / (3 * embed)};
  const int64_t size = s.embed * s.mlp;
  Routed(pool, x, expert_ids, weights, s, [&](int64_t e) {
    const float* base = packed.typed_data() + e * 3 * size;
    return ExpertWeights{base, base + size, base + 2 * size};
  }, y);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SaoExpertSwigluPacked, RoutedSwigluPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [tokens, embed]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // expert ids [tokens, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [tokens, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // packed [experts, 3 · embed · mlp]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [tokens, embed]
