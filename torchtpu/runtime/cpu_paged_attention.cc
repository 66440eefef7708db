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
// (token, query head). Per chunk and KV head its query heads are taken two at a time (each key
// and value row loaded once for both): 8 keys scored at once (a vector of partial sums over D
// per key, one reduction tree), the chunk's exp 8 lanes at a time (Cephes' expf polynomial),
// the value rows accumulated in registers over the chunk. Page indices are clipped into the
// cache and positions past the page table are not read, so malformed metadata never reads
// outside the buffers.
//
// Threads: the groups (split further into single KV heads when there are few groups) are pieces
// that write disjoint rows of the output; a call with enough work (kParallelMin) hands them out,
// largest first, to the calling thread and XLA's intra-op thread pool (the FFI's ThreadPool
// context), each piece computed by the same code in the same order whichever thread runs it, so
// the output is the same bits whatever the number of threads (TORCHTPU_CPU_ATTENTION_THREADS,
// read by cpu_kernels.py, caps it: 1 runs every call on the calling thread).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// a * b + c in one rounding where the instruction set has it (the kernel is built in ISO mode,
// whose default is no contraction); every thread runs the same copy, so the bits still do not
// depend on the split
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

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

// Vectors of 8 floats (GCC vector extensions): one AVX register in the AVX2/AVX-512 copies of
// the code, two SSE registers in the default one; unaligned loads through the aligned(4) types.
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline v8 load8(const uint16_t* p) {
  u32x8 w = __builtin_convertvector(*reinterpret_cast<const u16x8*>(p), u32x8) << 16;
  return reinterpret_cast<v8&>(w);
}
inline void store8(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }

// lanes summed pairwise: the sum of each of x's pairs of lanes, then y's
inline v8 pairs(v8 x, v8 y) {
  return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15);
}

// lane i: the sum of a[i]'s lanes (a fixed tree)
inline v8 hsum8(const v8* a) {
  return pairs(pairs(pairs(a[0], a[1]), pairs(a[2], a[3])),
               pairs(pairs(a[4], a[5]), pairs(a[6], a[7])));
}

// s[h][i] = dot(q[h], k[i]) over D for the n <= 8 key rows k[i] and NQ query rows q[h] (each
// key loaded once for all of them): a vector of partial sums per pair (8 rows in flight),
// reduced together; the D % 8 tail added last, in order. Row (h, i)'s operations do not depend
// on NQ.
template <int NQ, typename T>
inline void dots8(const float* const* q, const T* const* k, int n, int64_t D, float* const* s) {
  const T* kp[8];
  for (int i = 0; i < 8; ++i) kp[i] = k[i < n ? i : 0];
  v8 a[NQ][8];
  for (int h = 0; h < NQ; ++h)
    for (int i = 0; i < 8; ++i) a[h][i] = v8{};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    v8 qv[NQ];
    for (int h = 0; h < NQ; ++h) qv[h] = load8(q[h] + d);
    for (int i = 0; i < 8; ++i) {
      const v8 kv = load8(kp[i] + d);
      for (int h = 0; h < NQ; ++h) a[h][i] += qv[h] * kv;
    }
  }
  for (int h = 0; h < NQ; ++h) {
    const v8 r = hsum8(a[h]);
    for (int i = 0; i < n; ++i) {
      float x = r[i];
      for (int64_t e = d; e < D; ++e) x += q[h][e] * load(kp[i], e);
      s[h][i] = x;
    }
  }
}

// exp of 8 lanes (Cephes' expf: exp(x) = 2^n exp(r), |r| <= ln2/2, a degree-7 polynomial; about
// 1 ulp); below -87 (under FLT_MIN): 0; NaN stays NaN.
inline v8 vexp(v8 x) {
  const v8i tiny = x < -87.0f;
  x = x > 88.0f ? 88.0f : x;
  x = x < -88.0f ? -88.0f : x;
  const v8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  v8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v8 y = p * (r * r) + r + 1.0f;
  v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
  const v8 out = y * reinterpret_cast<v8&>(e);
  return tiny ? v8{} : out;
}

struct Shape {
  int64_t T, Hq, D, P, page, Hkv, S, pps;
};

// One piece of the work: a group of up to kQGroup consecutive tokens of one sequence, for the
// KV heads [h0, h1) (their query heads); the pieces write disjoint rows of the output.
struct Item {
  int64_t t0, ng, seq, pos0, lo, last, h0, h1, cost;
};

// The pieces in the order of the single-threaded walk (the sequence of token t0 by
// searchsorted(cu[1:], t0, side="right"), clipped), each group split into KV-head ranges of
// `hstep` heads; false when there is nothing to do.
inline void plan(const Shape& sh, const int32_t* kv_lens, const int32_t* cu_in, int32_t num_seqs,
                 int32_t window, int64_t hstep, std::vector<Item>& items) {
  const int64_t S = sh.S, Tn = sh.T;
  const int64_t n = std::clamp<int64_t>(num_seqs, 0, S);
  std::vector<int64_t> cu(S + 1);
  for (int64_t s = 0; s <= S; ++s) cu[s] = cu_in[std::min(s, n)];  // rows past n: empty
  const int64_t end = std::min<int64_t>(cu[n], Tn);
  const int64_t cap_pos = sh.pps * sh.page;  // positions the page table can hold
  int64_t seq = 0;
  for (int64_t t0 = 0; t0 < end;) {
    while (seq < S - 1 && cu[seq + 1] <= t0) ++seq;
    if (cu[seq + 1] <= t0) break;  // past every real row (cu not increasing): nothing left
    const int64_t stop = std::min<int64_t>(cu[seq + 1], end);
    const int64_t ng = std::min<int64_t>(kQGroup, stop - t0);
    const int64_t q_len = cu[seq + 1] - cu[seq];
    const int64_t pos0 = static_cast<int64_t>(kv_lens[seq]) - q_len + (t0 - cu[seq]);
    // key range of the group: [lo, last]
    const int64_t last = std::min(pos0 + ng - 1, cap_pos - 1);
    int64_t lo = 0;
    if (window > 0) lo = std::max<int64_t>(0, pos0 - window + 1);
    const int64_t span = std::max<int64_t>(0, last - lo + 1);
    for (int64_t h0 = 0; h0 < sh.Hkv; h0 += hstep) {
      const int64_t h1 = std::min(sh.Hkv, h0 + hstep);
      // keys read times query heads (each read is a dot and an axpy over D), plus a fixed part
      const int64_t cost = (ng * span + 4) * (h1 - h0) * (sh.Hq / sh.Hkv) * sh.D;
      items.push_back(Item{t0, ng, seq, pos0, lo, last, h0, h1, cost});
    }
    t0 += ng;
  }
}

// Per worker: the group's state (online softmax per token and query head).
struct Scratch {
  std::vector<float> qf, m, l, acc;
  explicit Scratch(const Shape& sh)
      : qf(kQGroup * sh.Hq * sh.D), m(kQGroup * sh.Hq), l(kQGroup * sh.Hq),
        acc(kQGroup * sh.Hq * sh.D) {}
};

// One chunk of n <= kChunk keys (rows kr, vr of one KV head) for NQ consecutive query heads of
// it (their q rows, online-softmax state m, l and accumulators D apart): scores, then
// acc = acc * alpha + sum_j p_j v_j; each key row is loaded once for the NQ heads, and every
// head's operations are the same whatever NQ.
template <int NQ, typename T>  // NQ: 1 or 2
inline __attribute__((always_inline)) void heads(const float* qf, const T* const* kr,
                                                 const T* const* vr, int n, int64_t D,
                                                 float scale, float cap, float* m, float* l,
                                                 float* acc) {
  alignas(32) float s[NQ][kChunk];
  alignas(32) float pr[NQ][kChunk];
  const float* qs[NQ];
  float* ss[NQ];
  float alpha[NQ];
  for (int h = 0; h < NQ; ++h) {
    qs[h] = qf + h * D;
    ss[h] = s[h];
  }
  for (int j = 0; j < n; j += 8) {
    float* sj[NQ];
    for (int h = 0; h < NQ; ++h) sj[h] = ss[h] + j;
    dots8<NQ>(qs, kr + j, std::min(8, n - j), D, sj);
  }
  for (int h = 0; h < NQ; ++h) {
    float mx = kNeg;
    if (cap > 0) {
      for (int j = 0; j < n; ++j) {
        const float x = cap * std::tanh(s[h][j] * scale / cap);
        s[h][j] = x;
        mx = std::max(mx, x);
      }
    } else {  // the same, 8 lanes at a time (the lanes past n: kNeg; max is exact)
      v8 vm = v8{} + kNeg;
      for (int j = 0; j < n; j += 8) {
        v8 x = load8(s[h] + j) * scale;
        for (int i = 0; i < 8; ++i)
          if (j + i >= n) x[i] = kNeg;
        store8(s[h] + j, x);
        vm = x > vm ? x : vm;
      }
      for (int i = 0; i < 8; ++i) mx = std::max(mx, vm[i]);
    }
    const float mnew = std::max(m[h], mx);
    alpha[h] = std::exp(m[h] - mnew);
    // p = exp(s - mnew), the chunk's lanes past n zero; their sum by a fixed tree
    v8 psum{};
    for (int j = 0; j < kChunk; j += 8) {
      v8 x = load8(s[h] + j) - mnew;
      for (int i = 0; i < 8; ++i)
        if (j + i >= n) x[i] = kNeg;
      const v8 e = vexp(x);
      store8(pr[h] + j, e);
      psum += e;
    }
    const v8 q4 = pairs(psum, psum);
    const v8 q2 = pairs(q4, q4);
    l[h] = l[h] * alpha[h] + (q2[0] + q2[1]);
    m[h] = mnew;
  }
  // 8 columns at a time over every key of the chunk, each value row loaded once for the NQ heads
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    // (named variables, not an array: kept in registers over the loop)
    v8 o0 = load8(acc + d) * alpha[0], o1{};
    if constexpr (NQ == 2) o1 = load8(acc + D + d) * alpha[1];
    for (int j = 0; j < n; ++j) {
      const v8 v = load8(vr[j] + d);
      o0 += pr[0][j] * v;
      if constexpr (NQ == 2) o1 += pr[NQ - 1][j] * v;
    }
    store8(acc + d, o0);
    if constexpr (NQ == 2) store8(acc + D + d, o1);
  }
  for (; d < D; ++d)
    for (int h = 0; h < NQ; ++h) {
      float o = acc[h * D + d] * alpha[h];
      for (int j = 0; j < n; ++j) o += pr[h][j] * load(vr[j], d);
      acc[h * D + d] = o;
    }
}

// One piece: each (token, query head) row is computed by the same operations in the same order
// whatever the split (the walk over the group's keys, kChunk at a time; per chunk its tokens,
// per token its KV heads, per KV head its query heads), so the result does not depend on it.
template <typename T>
inline __attribute__((always_inline)) void attend_item(const Shape& sh, const T* q, const T* kv,
                                                       const int32_t* pages, float scale,
                                                       int32_t window, float cap, const Item& it,
                                                       Scratch& w, float* out) {
  const int64_t Hq = sh.Hq, D = sh.D, page = sh.page, Hkv = sh.Hkv, pps = sh.pps, P = sh.P;
  const int64_t G = Hq / Hkv, H2 = 2 * Hkv, row = H2 * D;
  const int64_t HG = Hq;
  const int64_t t0 = it.t0, ng = it.ng, pos0 = it.pos0, lo = it.lo, last = it.last;
  const int64_t qh0 = it.h0 * G, qh1 = it.h1 * G;
  float* qf = w.qf.data();
  float* m = w.m.data();
  float* l = w.l.data();
  float* acc = w.acc.data();
  const T* rows[kChunk];
  for (int64_t g = 0; g < ng; ++g)
    for (int64_t i = (g * Hq + qh0) * D; i < (g * Hq + qh1) * D; ++i)
      qf[i] = load(q, t0 * Hq * D + i);
  std::fill(m, m + ng * HG, kNeg);
  std::fill(l, l + ng * HG, 0.0f);
  std::fill(acc, acc + ng * Hq * D, 0.0f);
  const int32_t* prow = pages + it.seq * pps;
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
      const int n = static_cast<int>(b - a + 1);
      for (int64_t h = it.h0; h < it.h1; ++h) {
        const T* kr[kChunk];
        const T* vr[kChunk];
        for (int j = 0; j < n; ++j) {
          kr[j] = rows[a - j0 + j] + 2 * h * D;
          vr[j] = kr[j] + D;
        }
        int64_t gg = 0;
        for (; gg + 2 <= G; gg += 2)
          heads<2>(&qf[(g * Hq + h * G + gg) * D], kr, vr, n, D, scale, cap,
                   &m[g * HG + h * G + gg], &l[g * HG + h * G + gg],
                   &acc[(g * Hq + h * G + gg) * D]);
        for (; gg < G; ++gg)
          heads<1>(&qf[(g * Hq + h * G + gg) * D], kr, vr, n, D, scale, cap,
                   &m[g * HG + h * G + gg], &l[g * HG + h * G + gg],
                   &acc[(g * Hq + h * G + gg) * D]);
      }
    }
  }
  for (int64_t g = 0; g < ng; ++g)
    for (int64_t qh = qh0; qh < qh1; ++qh) {
      const float li = l[g * HG + qh];
      const float inv = li > 0 ? 1.0f / li : 1.0f;
      float* o = out + ((t0 + g) * Hq + qh) * D;
      const float* ac = &acc[(g * Hq + qh) * D];
      for (int64_t d = 0; d < D; ++d) o[d] = ac[d] * inv;
    }
}

// The pieces items[k] for k taken from `next` until none is left; one copy per instruction set,
// picked when the library loads (x86-64-v4: AVX-512; v3: AVX2 and FMA; else the baseline).
struct Args {
  Shape sh;
  const void* q;
  const void* kv;
  const int32_t* pages;
  float scale;
  int32_t window;
  float cap;
  float* out;
  const Item* items;
  int64_t n;
};

template <typename T>
inline __attribute__((always_inline)) int64_t drain(const Args& a, std::atomic<int64_t>& next) {
  Scratch w(a.sh);
  int64_t done = 0;
  for (int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < a.n; ++done)
    attend_item<T>(a.sh, static_cast<const T*>(a.q), static_cast<const T*>(a.kv), a.pages,
                   a.scale, a.window, a.cap, a.items[k], w, a.out);
  return done;
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) int64_t
drain_f32(const Args& a, std::atomic<int64_t>& next) {
  return drain<float>(a, next);
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) int64_t
drain_bf16(const Args& a, std::atomic<int64_t>& next) {
  return drain<uint16_t>(a, next);
}

// At most this many threads a call (0: the pool's), and the calls that used the pool's threads
// the pieces the pool ran (the extern "C" functions below).
std::atomic<int64_t> g_max_threads{0}, g_split_calls{0}, g_pool_pieces{0};

// The state the caller shares with the pool's tasks; a task may start after the call has
// returned (it then finds nothing left and only drops its reference).
struct Job {
  Args a;
  bool bf16;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;
  // counts k finished pieces; whoever finishes the last one wakes the caller
  void finish(int64_t k) {
    if (k && done.fetch_add(k, std::memory_order_acq_rel) + k == a.n) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
  void work() {
    const int64_t k = bf16 ? drain_bf16(a, next) : drain_f32(a, next);
    g_pool_pieces.fetch_add(k, std::memory_order_relaxed);
    finish(k);
  }
};

// Work below this (keys read x query heads x D) runs on the calling thread alone.
constexpr int64_t kParallelMin = 1 << 15;

// XLA's intra-op pool has no way to wait for a task, and a task may run on the calling thread or
// start late (or, on a busy pool, after the call): the caller takes pieces like every task and
// waits only for the pieces another thread has taken (those are running), never for a task to
// start. Small work runs on the calling thread alone.
void attend(const Shape& sh, bool bf16, const void* q, const void* kv, const int32_t* kv_lens,
            const int32_t* pages, const int32_t* cu, int32_t ns, float scale, int32_t window,
            float cap, float* out, ffi::ThreadPool& pool) {
  std::fill(out, out + sh.T * sh.Hq * sh.D, 0.0f);
  std::vector<Item> items;
  plan(sh, kv_lens, cu, ns, window, sh.Hkv, items);
  int64_t total = 0;
  for (const Item& it : items) total += it.cost;
  int64_t workers = total >= kParallelMin ? pool.num_threads() : 1;
  const int64_t cap_threads = g_max_threads.load(std::memory_order_relaxed);
  if (cap_threads > 0) workers = std::min(workers, cap_threads);
  if (workers > 1 && sh.Hkv > 1 && static_cast<int64_t>(items.size()) < 4 * workers) {
    items.clear();  // few groups (a long prefill chunk, one long decode): a piece per KV head
    plan(sh, kv_lens, cu, ns, window, 1, items);
  }
  const int64_t n = static_cast<int64_t>(items.size());
  workers = std::max<int64_t>(1, std::min(workers, n));
  if (workers > 1)  // largest first, so that the last pieces taken are small
    std::stable_sort(items.begin(), items.end(),
                     [](const Item& x, const Item& y) { return x.cost > y.cost; });
  auto job = std::make_shared<Job>();
  job->a = Args{sh, q, kv, pages, scale, window, cap, out, items.data(), n};
  job->bf16 = bf16;
  if (workers > 1) g_split_calls.fetch_add(1, std::memory_order_relaxed);
  for (int64_t i = 1; i < workers; ++i) pool.Schedule([job] { job->work(); });
  const int64_t mine = bf16 ? drain_bf16(job->a, job->next) : drain_f32(job->a, job->next);
  job->finish(mine);
  // the pieces other threads still run: a short spin (they are small, largest first), then sleep
  for (int i = 0; i < 64 && job->done.load(std::memory_order_acquire) < n; ++i)
    std::this_thread::yield();
  if (job->done.load(std::memory_order_acquire) < n) {
    std::unique_lock<std::mutex> lock(job->mu);
    job->cv.wait(lock, [&] { return job->done.load(std::memory_order_acquire) >= n; });
  }
}

#pragma GCC pop_options

ffi::Error PagedAttentionImpl(ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> cu,
                              ffi::Buffer<ffi::S32> num_seqs, float scale, int32_t window,
                              float cap, ffi::ResultBuffer<ffi::F32> out,
                              ffi::ThreadPool pool) {
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
  if (q.element_type() != ffi::F32 && q.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("paged attention: float32 or bfloat16 only");
  attend(sh, q.element_type() == ffi::BF16, q.untyped_data(), kv.untyped_data(),
         kv_lens.typed_data(), pages.typed_data(), cu.typed_data(), ns, scale, window, cap,
         out->typed_data(), pool);
  return ffi::Error::Success();
}

}  // namespace

// Sets the most threads a call may use (0: as many as XLA's intra-op pool has; 1: the calling
// thread alone) and returns the previous value.
extern "C" int64_t torchtpu_cpu_attention_threads(int64_t n) {
  return g_max_threads.exchange(std::max<int64_t>(0, n));
}

// How many calls so far split their work over the pool's threads.
extern "C" int64_t torchtpu_cpu_attention_split_calls() { return g_split_calls.load(); }

// How many pieces so far the pool's tasks ran (the rest ran on the calling threads).
extern "C" int64_t torchtpu_cpu_attention_pool_pieces() { return g_pool_pieces.load(); }

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
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ctx<ffi::ThreadPool>());
