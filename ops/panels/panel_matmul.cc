// y[M, N] = x[M, K] @ W for W stored in 16-column panels: panel p holds W[:, 16p:16p+16] as K
// contiguous rows of 16 values (ops/panels/reference.py, pack). XLA:CPU FFI handlers for float32
// and bfloat16 weights (x and y float32; a bf16 weight is widened exactly, the sums run in float32).
//
// Why: with few rows (a decode step, a speculative verify) a matmul is bound by streaming W from
// memory. Each panel streams once, contiguously, and its 16 columns of y stay in registers for
// every k; rows go in groups of 4, so a panel is read from memory once and from L2 for the next
// group. XLA:CPU's GEMM re-reads W through its own blocking and streams it at less than half the
// rate of its one-row mat-vec (docs/speculative.md). Panels are shared out over XLA's intra-op
// thread pool in chunks taken from an atomic counter: the caller works too and only waits for
// chunks another thread has already started, so it cannot wait on a task still queued.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;

// One panel row of 16 weights as two vectors of 8 floats.
inline void PanelRow(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

// bfloat16 is the top half of a float32: widen to 32 bits and shift left by 16 (exact).
inline void PanelRow(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
}

// y[r, 16p:16p+16] = x[r, :] @ panel for R rows; the sum over k runs in order for every row, so a
// row's result does not depend on how many rows share the call.
template <int R, typename W>
inline void PanelRows(const float* x, const W* panel, float* y, int64_t K, int64_t N, int64_t col) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm256_setzero_ps();
    hi[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    __m256 w_lo, w_hi;
    PanelRow(panel + kPanel * k, w_lo, w_hi);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
      lo[r] = _mm256_fmadd_ps(xb, w_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(xb, w_hi, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * N + col, lo[r]);
    _mm256_storeu_ps(y + r * N + col + 8, hi[r]);
  }
}

template <typename W>
void Panels(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const W* panel = w + p * K * kPanel;
    const int64_t col = p * kPanel;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) PanelRows<4>(x + m * K, panel, y + m * N, K, N, col);
    switch (M - m) {
      case 3: PanelRows<3>(x + m * K, panel, y + m * N, K, N, col); break;
      case 2: PanelRows<2>(x + m * K, panel, y + m * N, K, N, col); break;
      case 1: PanelRows<1>(x + m * K, panel, y + m * N, K, N, col); break;
      default: break;
    }
  }
}

template <typename W>
struct Job {
  const float* x;
  const W* w;
  float* y;
  int64_t M, K, N, panels, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      Panels(x, w, y, M, K, N, c * panels / chunks, (c + 1) * panels / chunks);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <ffi::DataType WT>
ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                           ffi::ResultBuffer<ffi::F32> y) {
  using W = ffi::NativeType<WT>;
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("panel_matmul: x and w must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  if (wd[0] != K || N % kPanel != 0) {
    return ffi::Error::InvalidArgument("panel_matmul: expected x [M, K] and panel-packed w [K, N], N % 16 == 0");
  }
  if (M == 0 || N == 0) return ffi::Error::Success();
  auto job = std::make_shared<Job<W>>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->M = M;
  job->K = K;
  job->N = N;
  job->panels = N / kPanel;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  job->chunks = std::min<int64_t>(job->panels, 4 * threads);
  for (int64_t t = 1; t < threads && t < job->chunks; ++t) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

// One handler per weight dtype: x float32 [M, K], w [K, N] in panels, y float32 [M, N].
#define PANEL_MATMUL_HANDLER(name, weight_type)                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, PanelMatmulImpl<weight_type>,                      \
                                ffi::Ffi::Bind()                                         \
                                    .Ctx<ffi::ThreadPool>()                              \
                                    .Arg<ffi::Buffer<ffi::F32>>()                        \
                                    .Arg<ffi::Buffer<weight_type>>()                     \
                                    .Ret<ffi::Buffer<ffi::F32>>())

PANEL_MATMUL_HANDLER(PallasitePanelMatmulF32, ffi::F32);
PANEL_MATMUL_HANDLER(PallasitePanelMatmulBF16, ffi::BF16);
