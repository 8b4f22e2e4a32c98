// Persistent worker pool of the fused batch-1 decode (decode_layer.cpp; contract and measurements:
// sglite/kernels/decode_fused.py). Spliced into a source by sglite.kernels.cpu_build.read_source.
//
// Why not at::parallel_for: sglite's extensions are built without -fopenmp, so at::parallel_for in
// them runs serially. Here the workers are created once per process (pinned to one allowed CPU each
// where sched_setaffinity allows; SGLITE_PIN_THREADS=0 turns pinning off) and wait for work
// spinning for SPIN_US microseconds (SGLITE_POOL_SPIN_US) after their last job, then sleep on a
// condition variable, so the ~150 fork/join points of one decode step (one per matrix) cost a
// cache-line hand-off each and an idle engine costs no CPU. run(n, chunks, f) is one fork/join:
// f(c) for every chunk c, each claimed by one thread (the caller or one of n - 1 workers) from an
// atomic counter, so a worker that has no core (a shared machine) never stalls the step: the caller
// takes its chunk. Exceptions thrown by f on any thread are rethrown on the caller (the first one).
// A second caller while the pool is busy (two engines in one process), a call from inside a job, or
// n <= 1 run every chunk on the calling thread in order. Callers cut the work into chunks that do
// not depend on who runs them, so results never depend on the thread count.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <new>
#include <mutex>
#include <thread>
#include <vector>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

namespace sglite_pool {

// A worker's spin before it sleeps (SGLITE_POOL_SPIN_US overrides). A decode step's gaps are a few
// us; a prefill step's Python between kernels is 50-300 us, so its workers often sleep there. 500 us
// keeps them awake through it (py-spy --native: the futex wake-ups went from 7 % to 1 % of an agent
// turn's forward) but gave no gain beyond noise in A/B runs (changelog 2026-12-07, tenth pass).
constexpr int64_t SPIN_US = 100;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// [b + len * t / n, b + len * (t + 1) / n): thread t's contiguous share of [b, b + len)
inline void split(int64_t b, int64_t len, int t, int n, int64_t& lo, int64_t& hi) {
  lo = b + len * t / n;
  hi = b + len * (t + 1) / n;
}

class Pool {
 public:
  // The process's pool (never destroyed: detached workers live as long as the process).
  static Pool& get() {
    static Pool* p = new Pool();
    return *p;
  }

  // f(c) for every chunk c in [0, chunks), claimed one at a time by the caller and up to n - 1
  // workers; returns when every chunk is done. A worker that wakes late finds nothing left and the
  // caller does its share, so a busy machine (a worker without a core) costs one thread's speed,
  // never a wait for the OS to schedule that worker.
  template <typename F> void run(int n, int64_t chunks, F& f) {
    if (chunks <= 0) return;
    TORCH_CHECK(chunks < (int64_t(1) << 18), "thread pool: at most 2^18 - 1 chunks per job, got ", chunks);
    if (n <= 1 || chunks == 1 || tl_in_job()) return serial(chunks, f);
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock()) return serial(chunks, f);
    if (forked_.exchange(false)) {  // a forked child: the parent's workers do not exist here
      workers_ = 0;
      new (&sleep_mu_) std::mutex();  // a worker may have held it at the fork
      new (&err_mu_) std::mutex();
      sleepers_.store(0);
    }
    ensure(n - 1);
    ctx_ = &f;
    fn_ = [](void* c, int64_t i) { (*static_cast<F*>(c))(i); };
    err_ = nullptr;
    helpers_ = n - 1;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t g = (gen_of(next_.load(std::memory_order_relaxed)) + 1) & GEN_MASK;
    next_.store(g << 36 | (uint64_t)chunks << 18, std::memory_order_seq_cst);  // publishes the job: generation g, chunk 0
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(sleep_mu_);
      cv_.notify_all();
    }
    tl_in_job() = true;  // a nested run() from f runs serially (and never re-locks run_mu_)
    work(g);
    tl_in_job() = false;
    for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
      cpu_relax();
      if (spins > 4096) std::this_thread::yield();  // a worker lost its core mid-chunk
    }
    if (err_) std::rethrow_exception(err_);
  }

 private:
  Pool() {
    pthread_atfork(nullptr, nullptr, [] { Pool::get().forked_.store(true); });
    const char* pin = std::getenv("SGLITE_PIN_THREADS");
    pin_ = !(pin && pin[0] == '0');
    const char* spin = std::getenv("SGLITE_POOL_SPIN_US");
    if (spin && spin[0]) spin_us_ = std::max<int64_t>(0, std::atoll(spin));
  }

  static bool& tl_in_job() {
    static thread_local bool v = false;
    return v;
  }

  template <typename F> static void serial(int64_t chunks, F& f) {
    for (int64_t c = 0; c < chunks; ++c) f(c);
  }

  // Claim and run chunks of job g until none is left (or the job is another one).
  void work(uint64_t g) {
    for (;;) {
      uint64_t v = next_.load(std::memory_order_acquire);
      do {  // generation, chunk count and next chunk are one word: a claim never mixes two jobs
        if (gen_of(v) != g || (v & IDX_MASK) >= ((v >> 18) & IDX_MASK)) return;
      } while (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire));
      try {
        fn_(ctx_, (int64_t)(v & IDX_MASK));
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_mu_);
        if (!err_) err_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void ensure(int nw) {  // at least nw workers (under run_mu_)
    for (; workers_ < nw; ++workers_) {
      const int idx = workers_ + 1;  // 1..: worker idx helps jobs of more than idx threads
      std::thread([this, idx] { loop(idx); }).detach();
    }
  }

  // Pin worker idx to one CPU the process may run on, from the last allowed one down (the caller
  // stays where the OS puts it); no pinning when there are fewer CPUs than threads.
  void pin_self(int idx) {
    if (!pin_) return;
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return;
    std::vector<int> cpus;
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
    if ((int)cpus.size() <= idx) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[cpus.size() - idx], &one);
    pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
  }

  void loop(int idx) {
    pin_self(idx);
    tl_in_job() = true;
    uint64_t seen = gen_of(next_.load(std::memory_order_acquire));
    for (;;) {
      auto t0 = std::chrono::steady_clock::now();
      for (int spins = 1; gen_of(next_.load(std::memory_order_acquire)) == seen; ++spins) {
        cpu_relax();
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us_)) {
          std::unique_lock<std::mutex> lk(sleep_mu_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          cv_.wait(lk, [&] { return gen_of(next_.load(std::memory_order_seq_cst)) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        }
      }
      seen = gen_of(next_.load(std::memory_order_acquire));
      if (idx <= helpers_) work(seen);  // a job of fewer threads than this worker's index: not ours
    }
  }

  std::mutex run_mu_, sleep_mu_, err_mu_;
  std::condition_variable cv_;
  int workers_ = 0;
  static constexpr uint64_t IDX_MASK = (1u << 18) - 1, GEN_MASK = (uint64_t(1) << 28) - 1;
  static uint64_t gen_of(uint64_t v) { return v >> 36; }
  std::atomic<uint64_t> next_{0};  // generation (28 bits) << 36 | chunks (18 bits) << 18 | next unclaimed chunk
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  int64_t spin_us_ = SPIN_US;
  std::atomic<bool> forked_{false};
  std::atomic<int> helpers_{0};
  void* ctx_ = nullptr;
  void (*fn_)(void*, int64_t) = nullptr;
  std::exception_ptr err_;
  bool pin_ = true;
};

// Rows [b, e) in n = min(threads, (e - b) / grain) contiguous chunks, claimed by the pool's
// threads: f(lo, hi) per chunk. Each row is computed by exactly one thread with the same code, so
// the output does not depend on the thread count or on which thread took which chunk.
struct PoolPar {
  int threads;
  template <typename F> void operator()(int64_t b, int64_t e, int64_t grain, const F& f) const {
    const int64_t len = e - b;
    if (len <= 0) return;
    const int n = (int)std::min<int64_t>(threads, std::max<int64_t>(1, len / std::max<int64_t>(grain, 1)));
    auto chunk = [&](int64_t c) {
      int64_t lo, hi;
      split(b, len, (int)c, n, lo, hi);
      if (lo < hi) f(lo, hi);
    };
    Pool::get().run(n, n, chunk);
  }
};

// at::parallel_for's contract -- f(lo, hi) over contiguous shares of [b, e), each at least `grain`
// long where the range allows -- on this pool with torch's intra-op thread count
// (at::get_num_threads(), i.e. torch.set_num_threads). Every kernel of sglite splits its work
// through this: at::parallel_for itself is serial in these builds (no -fopenmp), and a second
// OpenMP runtime beside torch's would oversubscribe the cores.
template <typename F> inline void parallel_for(int64_t b, int64_t e, int64_t grain, const F& f) {
  PoolPar{at::get_num_threads()}(b, e, grain, f);
}

}  // namespace sglite_pool
