// CUDA on the CPU, for tests: the CUDA C++ that TVM generates, compiled by g++ with this header forced in
// (tests/cuda_emulator.py). One OS thread per CUDA thread of a block; the block's threads run together
// (__syncthreads is a barrier of all of them), blocks one after another, so __shared__ arrays can be
// function-level statics. Warp shuffles exchange through a per-warp buffer between two barriers of the
// warp's threads. Not a model of timing, memory coalescing or of what happens without a barrier.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) alignas(n)

struct emu_dim3 { unsigned x, y, z; };
inline thread_local emu_dim3 threadIdx, blockIdx;
inline emu_dim3 blockDim, gridDim;
inline thread_local int emu_tid;

struct EmuWarp { std::barrier<>* bar; int lanes; uint64_t vals[32]; };
inline std::barrier<>* emu_block_barrier;
inline std::vector<EmuWarp>* emu_warps;

// Shared memory is a function-level static, zero before the first block: each array registers itself
// where it is declared and is filled with 0xff bytes (NaN floats, -1 integers) after every block, so a
// read of shared memory no thread of the block wrote shows, as it would on a GPU (garbage).
#include <mutex>
#include <utility>
inline std::mutex emu_shared_mu;
inline std::vector<std::pair<void*, size_t>> emu_shared_regions;
inline void emu_shared(void* p, size_t n) {
  std::lock_guard<std::mutex> g(emu_shared_mu);
  for (auto& r : emu_shared_regions) if (r.first == p) return;
  emu_shared_regions.emplace_back(p, n);
}
#define EMU_SHARED(name) emu_shared((void*)&(name), sizeof(name))

// Serialized mode (emu_order +1 / -1, from the launch): one CUDA thread runs at a time, each barrier hands
// the turn to the next runnable thread in ascending / descending thread order. Deterministic, and a read
// of shared memory that a barrier does not separate from another thread's write sees the unwritten value
// in one of the two orders (a race on the GPU).
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
struct EmuSerialBarrier { int count; std::vector<int> waiting; };
struct EmuSched {
  std::mutex mu;
  std::vector<std::condition_variable> cvs;
  std::vector<int> state;   // 0 runnable, 1 at a barrier, 2 done
  int running = -1, order = 0;
  void pick_locked() {
    int n = (int)state.size();
    for (int k = 0; k < n; ++k) {
      int i = order > 0 ? k : n - 1 - k;
      if (state[i] == 0) { running = i; cvs[i].notify_one(); return; }
    }
    running = -1;
    for (int i = 0; i < n; ++i)
      if (state[i] == 1) { std::fprintf(stderr, "cuda emulator: deadlock (thread %d waits at a barrier no runnable thread reaches)\n", i); std::abort(); }
  }
  void wait_turn(std::unique_lock<std::mutex>& lk, int t) { cvs[t].wait(lk, [&] { return running == t; }); }
  void arrive(EmuSerialBarrier& b, int t) {
    std::unique_lock<std::mutex> lk(mu);
    b.waiting.push_back(t);
    state[t] = 1;
    if ((int)b.waiting.size() == b.count) {
      for (int w : b.waiting) state[w] = 0;
      b.waiting.clear();
    }
    pick_locked();
    wait_turn(lk, t);
  }
};
inline EmuSched* emu_sched = nullptr;
inline EmuSerialBarrier* emu_serial_block = nullptr;
inline std::vector<EmuSerialBarrier>* emu_serial_warps = nullptr;

inline void __syncthreads() {
  if (emu_sched) emu_sched->arrive(*emu_serial_block, emu_tid);
  else emu_block_barrier->arrive_and_wait();
}
inline void emu_warp_sync() {
  if (emu_sched) emu_sched->arrive((*emu_serial_warps)[emu_tid / 32], emu_tid);
  else (*emu_warps)[emu_tid / 32].bar->arrive_and_wait();
}
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_sync(); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned __activemask() {
  int lanes = (*emu_warps)[emu_tid / 32].lanes;
  return lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
}

template <class T> T emu_exchange(T v, int src) {
  EmuWarp& w = (*emu_warps)[emu_tid / 32];
  int lane = emu_tid % 32;
  static_assert(sizeof(T) <= 8, "shuffle of a value over 8 bytes");
  std::memcpy(&w.vals[lane], &v, sizeof(T));
  emu_warp_sync();
  T r = v;
  if (src >= 0 && src < w.lanes) std::memcpy(&r, &w.vals[src], sizeof(T));
  emu_warp_sync();
  return r;
}
template <class T> T __shfl_sync(unsigned, T v, int src, int width = 32) {
  int lane = emu_tid % 32, base = lane - lane % width;
  return emu_exchange(v, base + ((src % width) + width) % width);
}
template <class T> T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
  int lane = emu_tid % 32, base = lane - lane % width, src = lane + (int)delta;
  return emu_exchange(v, src < base + width ? src : lane);
}
template <class T> T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
  int lane = emu_tid % 32, base = lane - lane % width, src = lane - (int)delta;
  return emu_exchange(v, src >= base ? src : lane);
}
template <class T> T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
  int lane = emu_tid % 32, base = lane - lane % width, src = lane ^ mask;
  return emu_exchange(v, src < base + width ? src : lane);
}

// CUDA's max / min of floats are fmaxf / fminf (a NaN operand gives the other one)
template <class A, class B> inline auto max(A a, B b) -> decltype(a + b) {
  using R = decltype(a + b);
  if constexpr (std::is_floating_point_v<R>) return std::fmax((R)a, (R)b); else return a > b ? a : b;
}
template <class A, class B> inline auto min(A a, B b) -> decltype(a + b) {
  using R = decltype(a + b);
  if constexpr (std::is_floating_point_v<R>) return std::fmin((R)a, (R)b); else return a < b ? a : b;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
// TVM builds CUDA with nvcc --use_fast_math, where powf is __powf: exp2(y * log2(x)), NaN for x < 0 even at
// integer y (GPT-2's x^3 was NaN on an H200); the emulator computes it the same way
inline float emu_fast_powf(float x, float y) { return std::exp2(y * std::log2(x)); }
#define powf(x, y) emu_fast_powf((x), (y))
using std::isinf;
using std::isnan;
template <class T> T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }

#define EMU_VEC2(T, N) struct alignas(2 * sizeof(T)) N { T x, y; }; \
  inline N make_##N(T x, T y) { return N{x, y}; }
#define EMU_VEC3(T, N) struct N { T x, y, z; }; \
  inline N make_##N(T x, T y, T z) { return N{x, y, z}; }
#define EMU_VEC4(T, N) struct alignas(4 * sizeof(T)) N { T x, y, z, w; }; \
  inline N make_##N(T x, T y, T z, T w) { return N{x, y, z, w}; }
EMU_VEC2(float, float2) EMU_VEC3(float, float3) EMU_VEC4(float, float4)
EMU_VEC2(int, int2) EMU_VEC3(int, int3) EMU_VEC4(int, int4)
EMU_VEC2(unsigned, uint2) EMU_VEC4(unsigned, uint4)
EMU_VEC2(unsigned short, ushort2) EMU_VEC4(unsigned short, ushort4)
EMU_VEC2(unsigned char, uchar2) EMU_VEC4(unsigned char, uchar4)
EMU_VEC2(signed char, char2) EMU_VEC4(signed char, char4)
EMU_VEC2(long long, longlong2) EMU_VEC4(long long, longlong4)
struct uint1 { unsigned x; };

// Run kernel wrapper ``call`` over the grid: blockDim threads, each running every block in turn (a
// barrier of the block's threads after each block, so a block's statics are its shared memory).
extern "C" int emu_launch(void (*call)(void**), void** args, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz, int order) {
  int n = (int)(bx * by * bz);
  std::barrier<> block_bar(n), end_bar(n), poison_bar(n);
  std::vector<EmuWarp> warps((n + 31) / 32);
  std::vector<std::barrier<>*> owned;
  std::vector<EmuSerialBarrier> serial_warps(warps.size());
  EmuSerialBarrier serial_block{n, {}}, serial_end{n, {}}, serial_poison{n, {}};
  EmuSched sched;
  for (size_t w = 0; w < warps.size(); ++w) {
    int lanes = (int)std::min<size_t>(32, n - 32 * w);
    warps[w].lanes = lanes;
    warps[w].bar = new std::barrier<>(lanes);
    owned.push_back(warps[w].bar);
    serial_warps[w].count = lanes;
  }
  blockDim = {bx, by, bz};
  gridDim = {gx, gy, gz};
  emu_block_barrier = &block_bar;
  emu_warps = &warps;
  emu_sched = nullptr;
  if (order != 0) {
    sched.cvs = std::vector<std::condition_variable>(n);
    sched.state.assign(n, 0);
    sched.order = order;
    sched.running = order > 0 ? 0 : n - 1;
    emu_sched = &sched;
    emu_serial_block = &serial_block;
    emu_serial_warps = &serial_warps;
  }
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([=, &end_bar, &poison_bar, &sched, &serial_end, &serial_poison] {
      emu_tid = t;
      threadIdx = {(unsigned)t % bx, ((unsigned)t / bx) % by, (unsigned)t / (bx * by)};
      if (order != 0) {
        std::unique_lock<std::mutex> lk(sched.mu);
        sched.wait_turn(lk, t);
      }
      for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
          for (unsigned x = 0; x < gx; ++x) {
            blockIdx = {x, y, z};
            call(args);
            if (order != 0) sched.arrive(serial_end, t); else end_bar.arrive_and_wait();
            if (t == 0)
              for (auto& r : emu_shared_regions) std::memset(r.first, 0xff, r.second);
            if (order != 0) sched.arrive(serial_poison, t); else poison_bar.arrive_and_wait();
          }
      if (order != 0) {
        std::unique_lock<std::mutex> lk(sched.mu);
        sched.state[t] = 2;
        sched.pick_locked();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (auto* b : owned) delete b;
  emu_sched = nullptr;
  return 0;
}
