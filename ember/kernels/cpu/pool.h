// A small thread pool for the CPU kernels' loops, in place of OpenMP's fork-join.
//
// Why: a fork-join region ends when every thread has arrived. Where another process holds a
// core (this workplace's 2-core machines always run something else), a worker that is not
// scheduled holds every region up until it is, and a decode step has ~150 regions: one
// request decoded at 6 tok/s instead of 60. Here the items of a job are taken one at a time
// from a shared counter, by the caller and by whichever workers are running; the caller
// returns once every item is done, and a worker that wakes late finds nothing left.
//
// The counter holds (job generation << 32 | next item). A worker may take item i of job g
// only by moving the counter from (g, i) to (g, i + 1); the job's fields, read before that
// move, are g's, since the caller writes job g + 1 only after every item of g is done.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define EMBER_PAUSE() _mm_pause()
#else
#define EMBER_PAUSE() std::this_thread::yield()
#endif

namespace ember_cpu {

class Pool {
 public:
  using Fn = void (*)(void* ctx, int64_t item);

  static Pool& get() {
    static Pool pool;
    return pool;
  }

  // fn(item) for every item in [0, n), on the caller and up to at::get_num_threads() - 1
  // workers; returns when all are done. Called from one thread at a time (the engine's).
  template <typename F>
  void run(int64_t n, F&& fn) {
    const int helpers = std::min<int64_t>(at::get_num_threads(), n) - 1;
    if (helpers <= 0 || n <= 1) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> one_job(running_);
    ensure_workers(helpers);
    ctx_.store(&fn, std::memory_order_relaxed);
    fn_.store([](void* ctx, int64_t item) { (*static_cast<F*>(ctx))(item); }, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    helpers_.store(helpers, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (counter_.load(std::memory_order_relaxed) >> 32) + 1;
    counter_.store(gen << 32, std::memory_order_release);
    if (sleeping_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    work(gen, -1);
    while (done_.load(std::memory_order_acquire) < n) EMBER_PAUSE();
  }

 private:
  Pool() = default;
  ~Pool() {
    stop_.store(true);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    for (auto& t : workers_) t.join();
  }

  void ensure_workers(int count) {
    while (static_cast<int>(workers_.size()) < count) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { loop(index); });
    }
  }

  // take and run items of job `gen` until none is left; worker `index` joins only jobs that ask for it
  void work(uint64_t gen, int index) {
    uint64_t seen = counter_.load(std::memory_order_acquire);
    while ((seen >> 32) == gen) {
      const Fn fn = fn_.load(std::memory_order_relaxed);
      void* const ctx = ctx_.load(std::memory_order_relaxed);
      const int64_t n = n_.load(std::memory_order_relaxed);
      const int helpers = helpers_.load(std::memory_order_relaxed);
      const int64_t item = static_cast<int64_t>(seen & 0xFFFFFFFFu);
      if (item >= n || index >= helpers) return;
      if (counter_.compare_exchange_weak(seen, seen + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        fn(ctx, item);
        done_.fetch_add(1, std::memory_order_release);
        seen = counter_.load(std::memory_order_acquire);
      }
    }
  }

  void loop(int index) {
    uint64_t last = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      // spin a while for the next job (decode steps call back to back), then sleep
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicroseconds);
      uint64_t gen = counter_.load(std::memory_order_acquire) >> 32;
      while (gen == last && !stop_.load(std::memory_order_relaxed)) {
        for (int i = 0; i < 256 && gen == last; ++i) {  // a pause is ~25 ns on Zen: look after each
          EMBER_PAUSE();
          gen = counter_.load(std::memory_order_acquire) >> 32;
        }
        // every few microseconds let the core go to a thread that is ready (torch's own OpenMP
        // workers between steps: a spinning worker held them off for a scheduler tick, 0.8 ms)
        if (gen == last) std::this_thread::yield();
        if (gen == last && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleeping_.fetch_add(1, std::memory_order_acq_rel);
          wake_.wait(lock, [&] {
            return stop_.load() || (counter_.load(std::memory_order_acquire) >> 32) != last;
          });
          sleeping_.fetch_sub(1, std::memory_order_acq_rel);
          gen = counter_.load(std::memory_order_acquire) >> 32;
        }
      }
      last = gen;
      work(gen, index);
    }
  }

  static constexpr int kSpinMicroseconds = 2000;

  alignas(64) std::atomic<uint64_t> counter_{0};  // each on its own cache line
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64)
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  // the job: written by the caller before it moves the counter to the job's generation
  std::atomic<Fn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> n_{0};
  std::atomic<int> helpers_{0};
  std::vector<std::thread> workers_;
  std::mutex running_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_;
};

// at::parallel_for's contract on the pool: f(b, e) over chunks of [begin, end) of at least
// `grain` items, inline where one chunk covers it. Every kernel of ember's CPU library uses
// this, so that one set of threads serves them all (OpenMP's and the pool's spinning side by
// side on 2 cores slowed both).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t chunks = std::min<int64_t>((n + grain - 1) / std::max<int64_t>(grain, 1), 4 * at::get_num_threads());
  if (chunks <= 1 || at::get_num_threads() <= 1) {
    f(begin, end);
    return;
  }
  const int64_t size = (n + chunks - 1) / chunks;
  Pool::get().run((n + size - 1) / size, [&](int64_t c) { f(begin + c * size, std::min(end, begin + (c + 1) * size)); });
}

}  // namespace ember_cpu
