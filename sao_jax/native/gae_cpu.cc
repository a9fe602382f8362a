// Skip-observation GAE on the CPU as one XLA FFI call: a single reverse pass over each row that
// reads rewards, values and the action mask and writes advantages and returns.
//
// The recurrence is the one `sao_jax.advantages.skip_observation_gae` documents. With x_t what the
// action before token t bootstraps from (x_T = 0):
//   action token t:      A_t = r_t − V_t + x_{t+1},  G_t = A_t + V_t,  x_t = γ·V_t + γλ·A_t
//   non-action token t:  A_t = G_t = 0,                                x_t = r_t + x_{t+1}
// Why a kernel: XLA:CPU runs a `lax.scan` step as a loop iteration with a fixed overhead and
// moves the [batch, time] arrays to time-major and back around it; this loop reads each row in
// place. Rows are processed two at a time, interleaved, so the dependent chain of one row (one
// multiply-add or add, then a select, per token) overlaps with the other's. Not more than two: with
// power-of-two row lengths the rows' tokens t share a cache set, and 4 rows × 5 arrays outnumber its
// ways (benchmarks/RESULTS.md has the per-token times).

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 2;

// `Lanes` consecutive rows of length `len` (row-major), starting at the given pointers.
template <typename T, int64_t Lanes>
void GaeRowBlock(const T* rewards, const T* values, const bool* is_action, const T* gamma,
                 const T* lam, int64_t len, T* advantages, T* returns) {
  T bootstrap[Lanes];
  T g[Lanes];
  T gl[Lanes];
  for (int64_t i = 0; i < Lanes; ++i) {
    bootstrap[i] = T(0);
    g[i] = gamma[i];
    gl[i] = gamma[i] * lam[i];
  }
  for (int64_t t = len - 1; t >= 0; --t) {
    for (int64_t i = 0; i < Lanes; ++i) {
      const int64_t k = i * len + t;
      const T r = rewards[k];
      const T v = values[k];
      const T next = bootstrap[i];
      const T advantage = r - v + next;
      const bool act = is_action[k];
      advantages[k] = act ? advantage : T(0);
      returns[k] = act ? advantage + v : T(0);
      // γ·V + γλ·(r − V) does not depend on the carry: only one multiply-add waits for it.
      const T action_carry = g[i] * v + gl[i] * (r - v) + gl[i] * next;
      bootstrap[i] = act ? action_carry : r + next;
    }
  }
}

template <typename T>
void Gae(const T* rewards, const T* values, const bool* is_action, const T* gamma, const T* lam,
         int64_t rows, int64_t len, T* advantages, T* returns) {
  int64_t row = 0;
  for (; row + kLanes <= rows; row += kLanes) {
    const int64_t at = row * len;
    GaeRowBlock<T, kLanes>(rewards + at, values + at, is_action + at, gamma + row, lam + row, len,
                           advantages + at, returns + at);
  }
  for (; row < rows; ++row) {
    const int64_t at = row * len;
    GaeRowBlock<T, 1>(rewards + at, values + at, is_action + at, gamma + row, lam + row, len,
                      advantages + at, returns + at);
  }
}

ffi::Error SkipObservationGaeImpl(ffi::AnyBuffer rewards, ffi::AnyBuffer values,
                                  ffi::Buffer<ffi::PRED> is_action, ffi::AnyBuffer gamma,
                                  ffi::AnyBuffer lam, ffi::Result<ffi::AnyBuffer> advantages,
                                  ffi::Result<ffi::AnyBuffer> returns) {
  const auto dims = rewards.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("rewards must have a time axis");
  const int64_t len = dims.back();
  const int64_t count = static_cast<int64_t>(rewards.element_count());
  const int64_t rows = len == 0 ? 0 : count / len;
  const auto dtype = rewards.element_type();
  if (values.element_type() != dtype || gamma.element_type() != dtype ||
      lam.element_type() != dtype || advantages->element_type() != dtype ||
      returns->element_type() != dtype) {
    return ffi::Error::InvalidArgument("rewards, values, gamma, lam and the results share a dtype");
  }
  if (static_cast<int64_t>(values.element_count()) != count ||
      static_cast<int64_t>(is_action.element_count()) != count ||
      static_cast<int64_t>(gamma.element_count()) != rows ||
      static_cast<int64_t>(lam.element_count()) != rows) {
    return ffi::Error::InvalidArgument(
        "values and the action mask match rewards; gamma and lam hold one value per row");
  }
  switch (dtype) {
    case ffi::DataType::F32:
      Gae(rewards.typed_data<float>(), values.typed_data<float>(), is_action.typed_data(),
          gamma.typed_data<float>(), lam.typed_data<float>(), rows, len,
          advantages->typed_data<float>(), returns->typed_data<float>());
      return ffi::Error::Success();
    case ffi::DataType::F64:
      Gae(rewards.typed_data<double>(), values.typed_data<double>(), is_action.typed_data(),
          gamma.typed_data<double>(), lam.typed_data<double>(), rows, len,
          advantages->typed_data<double>(), returns->typed_data<double>());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("float32 or float64 only");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SaoSkipObservationGae, SkipObservationGaeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
