// A decode step's attention over a KV cache on the CPU, as one XLA FFI call: the chunk's new keys
// and values are written into the cache (in place: the cache arguments alias the results), then
// each query attends the cache, each key and value slot read once, in the cache's own
// [batch, slots, kv_heads, head_dim] layout.
//
// Write: cache[b, write_slots[b, t]] = new[b, t] for write_slots[b, t] < slots (others dropped),
// rounded to nearest even when the cache is bfloat16 (what XLA's convert does).
// Attend: for query head h of row b, query t, with kv head j = h / (heads / kv_heads) and
// n = num_keys[b, t]:
//   s_i = q · k_i / sqrt(head_dim)                        for cache slots i < n
//   out = Σ_{i<n} exp(s_i − max s) · v_i / Σ_{i<n} exp(s_i − max s)     (0 when n = 0)
// which is `layers.write_cache` then `layers.dot_product_attention` with `allowed` = the first n
// slots.
// Why a kernel: a decode step's einsum attention makes XLA:CPU copy every layer's K and V into
// the layouts its batched dots want, and those dots (two query heads per kv head, one query) run
// far below the memory bandwidth; here one task per (row, query) reads its slots in place, each
// slot's K and V rows whole — the step is then bound by reading the cache once. XLA:CPU also
// scatters into a bfloat16 cache by converting all of it to float32 and back; the write here
// touches only the new slots.
// The tasks are spread over XLA's intra-op thread pool when it has one.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace sao_native;  // Vec, Load, ExpNonPositive, ParallelFor: cpu_common.h
using sao_native::Load;      // an overload set with the bfloat16 Load below

constexpr int64_t kBlock = 64;     // slots per block: its scores stay in L1 between the passes
constexpr int64_t kMaxGroup = 8;   // query heads per kv head
constexpr int64_t kRows = 4;       // slots scored at once (their loads of q are shared)
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxTaskHeads = 8;     // kv heads one task reads together
constexpr int64_t kMaxTaskFloats = 4096; // query heads × head_dim of one task
// Slots ahead of the one being read whose K (or V) lines are prefetched: the hardware prefetchers
// alone leave the reads waiting on memory. Into L2 rather than L1, 32 slots ahead rather than 16
// into L1: L1 tracks fewer misses at once, and the prefetches waited on it (benchmarks/RESULTS.md).
constexpr int64_t kAhead = 32;

template <typename KV>
constexpr KV kZeros[kMaxHeadDim] = {};

inline Vec Load(const uint16_t* p) {  // 8 bfloat16 values, widened
  uint16_t half[kLanes];
  std::memcpy(half, p, sizeof(half));
  uint32_t bits[kLanes];
  for (int64_t u = 0; u < kLanes; ++u) bits[u] = static_cast<uint32_t>(half[u]) << 16;
  Vec v;
  std::memcpy(&v, bits, sizeof(v));
  return v;
}
inline void Store(float x, float* p) { *p = x; }
inline void Store(float x, uint16_t* p) {  // bfloat16 bits, rounded to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *p = static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN stays a (quiet) NaN
    return;
  }
  *p = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
template <typename KV>
inline void Prefetch(const KV* first, int64_t count) {  // the cache lines of count values, into L2
  for (int64_t byte = 0; byte < count * static_cast<int64_t>(sizeof(KV)); byte += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(first) + byte, 0, 2);
}
inline float Sum(Vec v) {
  float total = 0.0f;
  for (int64_t u = 0; u < kLanes; ++u) total += v[u];
  return total;
}

struct Shape {
  int64_t batch, time, heads, kv_heads, head_dim, slots;
};

// One task: query t of row b, kv heads [j0, j0 + task_heads) and their `group` query heads each,
// over slots [0, n), a block of slots at a time with an online softmax (running max m, sum l and
// unnormalized output acc per query head). A task takes all of a row's kv heads when it can: a
// slot's K (and V) row is then read whole, which memory serves about twice as fast as one kv head
// of every slot (benchmarks/RESULTS.md).
template <typename KV, int64_t group>
void AttendTask(const float* q, const KV* k, const KV* v, const int32_t* num_keys, float* out,
                const Shape& s, int64_t task_heads, int64_t task) {
  const int64_t tasks_per_row = s.kv_heads / task_heads;
  const int64_t j0 = (task % tasks_per_row) * task_heads;
  const int64_t bt = task / tasks_per_row;  // b * time + t
  const int64_t b = bt / s.time;
  const int64_t chunks = s.head_dim / kLanes;
  const int64_t heads = task_heads * group;  // query heads j0·group … : adjacent in q
  const int64_t n = std::clamp<int64_t>(num_keys[bt], 0, s.slots);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  const int64_t slot_stride = s.kv_heads * s.head_dim;
  const int64_t row_width = task_heads * s.head_dim;  // the task's contiguous part of a slot
  const KV* k0 = k + (b * s.slots * s.kv_heads + j0) * s.head_dim;
  const KV* v0 = v + (b * s.slots * s.kv_heads + j0) * s.head_dim;
  const float* q0 = q + (bt * s.heads + j0 * group) * s.head_dim;

  Vec query[kMaxTaskFloats / kLanes];  // [head][chunk]
  Vec acc[kMaxTaskFloats / kLanes];
  float m[kMaxTaskHeads * kMaxGroup], l[kMaxTaskHeads * kMaxGroup];
  float p[kMaxTaskHeads * kMaxGroup][kBlock];
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t c = 0; c < chunks; ++c) {
      query[h * chunks + c] = Load(q0 + h * s.head_dim + c * kLanes) * scale;
      acc[h * chunks + c] = Vec{};
    }
    m[h] = -INFINITY;
    l[h] = 0.0f;
  }
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t width = std::min(kBlock, n - start);
    // scores p[h][i] = q_h · k_i, kRows slots at a time, each kv head in turn (past the block's
    // end: a row of zeros); the rows kAhead slots on are prefetched whole
    for (int64_t i = 0; i < width; i += kRows) {
      for (int64_t r = 0; r < kRows; ++r)
        if (start + i + r + kAhead < n) Prefetch(k0 + (start + i + r + kAhead) * slot_stride, row_width);
      for (int64_t j = 0; j < task_heads; ++j) {
        const Vec* query_j = query + j * group * chunks;
        const KV* rows[kRows];
        for (int64_t r = 0; r < kRows; ++r)
          rows[r] = i + r < width ? k0 + (start + i + r) * slot_stride + j * s.head_dim : kZeros<KV>;
        Vec dots[kRows][group] = {};
        for (int64_t c = 0; c < chunks; ++c) {
          for (int64_t r = 0; r < kRows; ++r) {
            const Vec key = Load(rows[r] + c * kLanes);
            for (int64_t g = 0; g < group; ++g) dots[r][g] += query_j[g * chunks + c] * key;
          }
        }
        for (int64_t r = 0; r < kRows; ++r)
          for (int64_t g = 0; g < group; ++g) p[j * group + g][i + r] = Sum(dots[r][g]);
      }
    }
    // p ← exp(p − new max); rescale what came before by exp(old max − new max)
    for (int64_t h = 0; h < heads; ++h) {
      float block_max = m[h];
      for (int64_t i = 0; i < width; ++i) block_max = std::max(block_max, p[h][i]);
      const float rescale = ExpNonPositive(m[h] - block_max);  // 0 on the first block (m = −inf)
      float block_sum = 0.0f;
      for (int64_t i = 0; i < width; ++i) {
        p[h][i] = ExpNonPositive(p[h][i] - block_max);
        block_sum += p[h][i];
      }
      l[h] = l[h] * rescale + block_sum;
      m[h] = block_max;
      for (int64_t c = 0; c < chunks; ++c) acc[h * chunks + c] *= rescale;
    }
    // acc_h += Σ_i p[h][i] · v_i, each slot's row read whole
    for (int64_t i = 0; i < width; ++i) {
      if (start + i + kAhead < n) Prefetch(v0 + (start + i + kAhead) * slot_stride, row_width);
      const KV* row = v0 + (start + i) * slot_stride;
      for (int64_t j = 0; j < task_heads; ++j) {
        for (int64_t c = 0; c < chunks; ++c) {
          const Vec value = Load(row + j * s.head_dim + c * kLanes);
          for (int64_t g = 0; g < group; ++g) acc[(j * group + g) * chunks + c] += p[j * group + g][i] * value;
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inverse = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
    float* out_h = out + (bt * s.heads + j0 * group + h) * s.head_dim;
    for (int64_t c = 0; c < chunks; ++c) {
      const Vec o = acc[h * chunks + c] * inverse;
      std::memcpy(out_h + c * kLanes, &o, sizeof(o));
    }
  }
}

// kv heads a task takes: all of a row's when their query heads fit the task's buffers and there
// are still rows enough to keep every thread busy (a task per kv head otherwise).
int64_t TaskHeads(const Shape& s, int64_t threads) {
  const bool fits = s.kv_heads <= kMaxTaskHeads && s.heads * s.head_dim <= kMaxTaskFloats;
  return fits && s.batch * s.time >= 2 * (threads + 1) ? s.kv_heads : 1;
}


ffi::Error CachedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> new_k,
                               ffi::Buffer<ffi::F32> new_v, ffi::Buffer<ffi::S32> write_slots,
                               ffi::Buffer<ffi::S32> num_keys, ffi::AnyBuffer, ffi::AnyBuffer,
                               ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k,
                               ffi::Result<ffi::AnyBuffer> v) {
  // The cache arguments alias the results k and v: both are read and written through the results.
  const auto qd = q.dimensions();
  const auto kd = k->dimensions();
  if (qd.size() != 4 || kd.size() != 4 || v->dimensions().size() != 4 || new_k.dimensions().size() != 4) {
    return ffi::Error::InvalidArgument(
        "q [batch, time, heads, head_dim], new k and v [batch, time, kv_heads, head_dim], "
        "caches [batch, slots, kv_heads, head_dim]");
  }
  const Shape s{qd[0], qd[1], qd[2], kd[2], qd[3], kd[1]};
  if (kd[0] != s.batch || kd[3] != s.head_dim || s.heads % s.kv_heads != 0 ||
      s.heads / s.kv_heads > kMaxGroup || s.head_dim > kMaxHeadDim || s.head_dim % kLanes != 0) {
    return ffi::Error::InvalidArgument("cached attention: unsupported or mismatched shapes");
  }
  const int64_t per_token = s.kv_heads * s.head_dim;
  if (k->element_type() != v->element_type() ||
      static_cast<int64_t>(num_keys.element_count()) != s.batch * s.time ||
      static_cast<int64_t>(write_slots.element_count()) != s.batch * s.time ||
      static_cast<int64_t>(new_k.element_count()) != s.batch * s.time * per_token ||
      new_v.element_count() != new_k.element_count()) {
    return ffi::Error::InvalidArgument(
        "k and v caches share a dtype; write_slots and num_keys are [batch, time]; new k and v are "
        "[batch, time, kv_heads, head_dim]");
  }
  const int64_t task_heads = TaskHeads(s, pool.num_threads());
  const int64_t tasks = s.batch * s.time * (s.kv_heads / task_heads);
  const auto run = [&](auto kv_type, auto group) {
    using KV = decltype(kv_type);
    KV* keys = reinterpret_cast<KV*>(k->untyped_data());
    KV* values = reinterpret_cast<KV*>(v->untyped_data());
    for (int64_t bt = 0; bt < s.batch * s.time; ++bt) {  // the writes, before any task reads
      const int64_t slot = write_slots.typed_data()[bt];
      if (slot < 0 || slot >= s.slots) continue;
      const int64_t at = ((bt / s.time) * s.slots + slot) * per_token;
      for (int64_t i = 0; i < per_token; ++i) {
        Store(new_k.typed_data()[bt * per_token + i], keys + at + i);
        Store(new_v.typed_data()[bt * per_token + i], values + at + i);
      }
    }
    ParallelFor(pool, tasks, [&](int64_t task) {
      AttendTask<KV, decltype(group)::value>(q.typed_data(), keys, values, num_keys.typed_data(),
                                             out->typed_data(), s, task_heads, task);
    });
  };
  const auto dispatch = [&](auto kv_type) {
    switch (s.heads / s.kv_heads) {
      case 1: return run(kv_type, std::integral_constant<int64_t, 1>{});
      case 2: return run(kv_type, std::integral_constant<int64_t, 2>{});
      case 3: return run(kv_type, std::integral_constant<int64_t, 3>{});
      case 4: return run(kv_type, std::integral_constant<int64_t, 4>{});
      case 5: return run(kv_type, std::integral_constant<int64_t, 5>{});
      case 6: return run(kv_type, std::integral_constant<int64_t, 6>{});
      case 7: return run(kv_type, std::integral_constant<int64_t, 7>{});
      default: return run(kv_type, std::integral_constant<int64_t, 8>{});
    }
  };
  switch (k->element_type()) {
    case ffi::DataType::F32:
      dispatch(float{});
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      dispatch(uint16_t{});  // bfloat16 bits
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("k and v: float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SaoCachedAttention, CachedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // write_slots
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_keys
                                  .Arg<ffi::AnyBuffer>()         // k cache (aliases result 1)
                                  .Arg<ffi::AnyBuffer>()         // v cache (aliases result 2)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::AnyBuffer>()         // k cache
                                  .Ret<ffi::AnyBuffer>());       // v cache
