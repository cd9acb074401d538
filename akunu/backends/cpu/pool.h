// The pool of persistent helper threads that runs every parallel loop of akunu's CPU kernels: kernels.cpp's own,
// and through its `run_on_pool` those of quantized.cpp and _matvec.c.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

namespace akunu {

// Persistent helper threads that share one call's items with the calling thread. The caller works too
// and waits only for items a helper has claimed, never for a helper to wake: on a busy machine a
// descheduled helper costs nothing (an OpenMP region's barrier would wait a whole time slice for it).
class Pool {
 public:
  using Task = void (*)(const void* context, int begin, int end);

  static Pool& get() {
    static Pool* pool = new Pool(std::max(omp_get_max_threads(), 1) - 1);  // never destroyed: helpers outlive exit
    return *pool;
  }

  void run(Task task, const void* context, int items, int share, bool parallel) {
    if (!parallel || helpers_ == 0 || items <= share) return task(context, 0, items);
    std::lock_guard<std::mutex> one_call_at_a_time(calling_);
    task_.store(task);
    context_.store(context);
    items_.store(items);
    share_.store(share);
    done_.store(0);
    const uint64_t generation = (ticket_.load() >> 32) + 1;
    ticket_.store(generation << 32);  // item 0 of a new generation
    if (sleeping_.load()) ticket_.notify_all();
    work(generation);
    while (done_.load() < items) pause();
    ticket_.store((generation << 32) | CLOSED);  // late helpers' claims fail from here on
  }

 private:
  static constexpr uint64_t CLOSED = 0xffffffffu;
  static constexpr auto SPIN = std::chrono::microseconds(200);  // then sleep until the next call

  explicit Pool(int helpers) : helpers_(helpers) {
    for (int i = 0; i < helpers; i++) std::thread([this] { serve(); }).detach();
  }
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  // Claims shares of the current call's items while it is still generation `generation` and has some left.
  void work(uint64_t generation) {
    for (;;) {
      uint64_t ticket = ticket_.load();
      const int items = items_.load(), share = share_.load();
      const uint64_t item = ticket & CLOSED;
      if (ticket >> 32 != generation || item >= uint64_t(items)) return;
      if (!ticket_.compare_exchange_weak(ticket, ticket + share)) continue;
      const int end = std::min<int>(int(item) + share, items);
      task_.load()(context_.load(), int(item), end);
      done_.fetch_add(end - int(item));
    }
  }

  void serve() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t ticket = ticket_.load();
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 0; ticket >> 32 == seen; spins++) {
        pause();
        ticket = ticket_.load();
        if (spins % 256 == 255 && std::chrono::steady_clock::now() - start > SPIN) {
          sleeping_.fetch_add(1);
          ticket_.wait(ticket);
          sleeping_.fetch_sub(1);
          ticket = ticket_.load();
        }
      }
      seen = ticket >> 32;
      work(seen);
    }
  }

  const int helpers_;
  std::mutex calling_;
  std::atomic<uint64_t> ticket_{0};  // generation << 32 | next unclaimed item
  std::atomic<int> done_{0}, sleeping_{0};
  std::atomic<Task> task_{nullptr};
  std::atomic<const void*> context_{nullptr};
  std::atomic<int> items_{0}, share_{1};
};

}  // namespace akunu
