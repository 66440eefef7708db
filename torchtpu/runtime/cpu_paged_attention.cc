// Ragged paged attention on the CPU, reading the KV pages in place: an XLA FFI custom call.
//
// The C++ twin of the portable lowering ``ragged_paged_attention_xla`` in
// torchtpu/lowering/paged_attention.py (the reference; same inputs, same masking, same zeros
// for padding tokens). Built on first need and registered on the CPU platform by
// torchtpu/runtime/cpu_kernels.py.
//
// Inputs (the lowering's, integers already int32):
//   q            [T, Hq, D]              float32 or bfloat16
//   kv_pages     [P, page, 2 * Hkv, D]   same dtype as q; keys at even heads, values at odd
//   kv_lens      [S]                     each sequence's length including its new tokens
//   page_indices [S, pps]                each sequence's pages in order
//   cu_q_lens    [S + 1]                 where each sequence's queries start
//   num_seqs     [1]                     how many of the S rows are real
// Attributes: sm_scale (f32), sliding_window (s32, 0: none), soft_cap (f32, 0: none).
// Output: float32 [T, Hq, D].
//
// Each real token attends to positions [max(0, pos - window + 1), pos] of its sequence, pos =
// kv_len - q_len + (index in its sequence). Work is split into groups of up to kQGroup
// consecutive tokens of one sequence (a decode token is a group of one); a group walks its
// sequence's positions once, kChunk at a time (their cache rows, whatever the page size, stay in
// L1 while every head and token of the group reads them), keeping an online softmax per
// (token, query head). Page indices are clipped into the cache and positions past
// the page table are not read, so malformed metadata never reads outside the buffers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNeg = -0.7f * 3.4028234663852886e38f;  // the lowering's mask value
constexpr int kQGroup = 8;
constexpr int kChunk = 16;  // KV positions a step of the walk (their rows of every head in L1)

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
inline float load(const T* p, int64_t i);
template <>
inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <>
inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

// dot(q, k) over D with 8 independent partial sums (vectorizable without reassociation flags)
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int i = 0; i < 8; ++i) s[i] += q[d + i] * load(k, d + i);
  float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; d < D; ++d) r += q[d] * load(k, d);
  return r;
}

template <typename T>
inline void axpy(float* acc, float a, const T* v, int64_t D) {
  for (int64_t d = 0; d < D; ++d) acc[d] += a * load(v, d);
}

struct Shape {
  int64_t T, Hq, D, P, page, Hkv, S, pps;
};

template <typename T>
inline __attribute__((always_inline)) void attend(const Shape& sh, const T* q, const T* kv, const int32_t* kv_lens,
            const int32_t* pages, const int32_t* cu_in, int32_t num_seqs, float scale,
            int32_t window, float cap, float* out) {
  const int64_t Tn = sh.T, Hq = sh.Hq, D = sh.D, page = sh.page, Hkv = sh.Hkv, S = sh.S,
                pps = sh.pps, P = sh.P;
  const int64_t G = Hq / Hkv, H2 = 2 * Hkv, row = H2 * D;
  std::fill(out, out + Tn * Hq * D, 0.0f);
  const int64_t n = std::clamp<int64_t>(num_seqs, 0, S);
  std::vector<int64_t> cu(S + 1);
  for (int64_t s = 0; s <= S; ++s) cu[s] = cu_in[std::min(s, n)];  // rows past n: empty
  const int64_t end = std::min<int64_t>(cu[n], Tn);
  const int64_t cap_pos = pps * page;  // positions the page table can hold
  const int64_t HG = Hq;
  std::vector<float> qf(kQGroup * Hq * D), m(kQGroup * HG), l(kQGroup * HG),
      acc(kQGroup * Hq * D), sc(kQGroup * HG * kChunk);
  const T* rows[kChunk];
  int64_t seq = 0;
  for (int64_t t0 = 0; t0 < end;) {
    // the sequence of token t0: searchsorted(cu[1:], t0, side="right"), clipped
    while (seq < S - 1 && cu[seq + 1] <= t0) ++seq;
    if (cu[seq + 1] <= t0) break;  // past every real row (cu not increasing): nothing left
    const int64_t stop = std::min<int64_t>(cu[seq + 1], end);
    const int64_t ng = std::min<int64_t>(kQGroup, stop - t0);
    const int64_t q_len = cu[seq + 1] - cu[seq];
    const int64_t pos0 = static_cast<int64_t>(kv_lens[seq]) - q_len + (t0 - cu[seq]);
    // key range of the group: [lo, hi]
    const int64_t last = std::min(pos0 + ng - 1, cap_pos - 1);
    int64_t lo = 0;
    if (window > 0) lo = std::max<int64_t>(0, pos0 - window + 1);
    for (int64_t i = 0; i < ng * Hq * D; ++i) qf[i] = load(q, t0 * Hq * D + i);
    std::fill(m.begin(), m.end(), kNeg);
    std::fill(l.begin(), l.end(), 0.0f);
    std::fill(acc.begin(), acc.end(), 0.0f);
    const int32_t* prow = pages + seq * pps;
    for (int64_t j0 = lo; j0 <= last; j0 += kChunk) {
      const int64_t j1 = std::min(last, j0 + kChunk - 1);
      for (int64_t j = j0; j <= j1; ++j) {
        const int64_t pid = std::clamp<int64_t>(prow[j / page], 0, P - 1);
        rows[j - j0] = kv + (pid * page + j % page) * row;
      }
      for (int64_t g = 0; g < ng; ++g) {
        const int64_t pos = pos0 + g;
        const int64_t a = std::max(j0, window > 0 ? pos - window + 1 : int64_t(0));
        const int64_t b = std::min(j1, pos);
        if (a > b) continue;
        for (int64_t h = 0; h < Hkv; ++h) {
          for (int64_t gg = 0; gg < G; ++gg) {
            const int64_t qh = h * G + gg;
            const float* qv = &qf[(g * Hq + qh) * D];
            float* s = &sc[(g * HG + qh) * kChunk];
            float mx = kNeg;
            for (int64_t j = a; j <= b; ++j) {
              float x = dot(qv, rows[j - j0] + 2 * h * D, D) * scale;
              if (cap > 0) x = cap * std::tanh(x / cap);
              s[j - a] = x;
              mx = std::max(mx, x);
            }
            float& mi = m[g * HG + qh];
            const float mnew = std::max(mi, mx);
            const float alpha = std::exp(mi - mnew);
            float* ac = &acc[(g * Hq + qh) * D];
            if (alpha != 1.0f) {
              for (int64_t d = 0; d < D; ++d) ac[d] *= alpha;
            }
            float sum = 0.0f;
            for (int64_t j = a; j <= b; ++j) {
              const float p = std::exp(s[j - a] - mnew);
              sum += p;
              axpy(ac, p, rows[j - j0] + (2 * h + 1) * D, D);
            }
            l[g * HG + qh] = l[g * HG + qh] * alpha + sum;
            mi = mnew;
          }
        }
      }
    }
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t qh = 0; qh < Hq; ++qh) {
        const float li = l[g * HG + qh];
        const float inv = li > 0 ? 1.0f / li : 1.0f;
        float* o = out + ((t0 + g) * Hq + qh) * D;
        const float* ac = &acc[(g * Hq + qh) * D];
        for (int64_t d = 0; d < D; ++d) o[d] = ac[d] * inv;
      }
    t0 += ng;
  }
}

// one copy per instruction set, picked when the library loads (AVX+FMA where the CPU has them)
__attribute__((target_clones("fma", "default"))) void attend_f32(
    const Shape& sh, const float* q, const float* kv, const int32_t* kv_lens,
    const int32_t* pages, const int32_t* cu, int32_t ns, float scale, int32_t window, float cap,
    float* out) {
  attend<float>(sh, q, kv, kv_lens, pages, cu, ns, scale, window, cap, out);
}

__attribute__((target_clones("fma", "default"))) void attend_bf16(
    const Shape& sh, const uint16_t* q, const uint16_t* kv, const int32_t* kv_lens,
    const int32_t* pages, const int32_t* cu, int32_t ns, float scale, int32_t window, float cap,
    float* out) {
  attend<uint16_t>(sh, q, kv, kv_lens, pages, cu, ns, scale, window, cap, out);
}

ffi::Error PagedAttentionImpl(ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> cu,
                              ffi::Buffer<ffi::S32> num_seqs, float scale, int32_t window,
                              float cap, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = kv.dimensions();
  auto pd = pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("paged attention: bad ranks");
  Shape sh{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2] / 2, pd[0], pd[1]};
  if (kd[2] % 2 || kd[3] != sh.D || sh.Hkv == 0 || sh.Hq % sh.Hkv ||
      kv_lens.dimensions()[0] != sh.S || cu.dimensions()[0] != sh.S + 1 || sh.P == 0 ||
      sh.page == 0 || q.element_type() != kv.element_type())
    return ffi::Error::InvalidArgument("paged attention: shapes do not fit");
  const int32_t ns = num_seqs.typed_data()[0];
  if (sh.S == 0 || sh.pps == 0) {
    std::fill(out->typed_data(), out->typed_data() + sh.T * sh.Hq * sh.D, 0.0f);
    return ffi::Error::Success();
  }
  if (q.element_type() == ffi::F32) {
    attend_f32(sh, reinterpret_cast<const float*>(q.untyped_data()),
                  reinterpret_cast<const float*>(kv.untyped_data()), kv_lens.typed_data(),
                  pages.typed_data(), cu.typed_data(), ns, scale, window, cap,
                  out->typed_data());
  } else if (q.element_type() == ffi::BF16) {
    attend_bf16(sh, reinterpret_cast<const uint16_t*>(q.untyped_data()),
                     reinterpret_cast<const uint16_t*>(kv.untyped_data()), kv_lens.typed_data(),
                     pages.typed_data(), cu.typed_data(), ns, scale, window, cap,
                     out->typed_data());
  } else {
    return ffi::Error::InvalidArgument("paged attention: float32 or bfloat16 only");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchtpuCpuPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
