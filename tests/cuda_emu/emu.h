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

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { (*emu_warps)[emu_tid / 32].bar->arrive_and_wait(); }
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
  w.bar->arrive_and_wait();
  T r = v;
  if (src >= 0 && src < w.lanes) std::memcpy(&r, &w.vals[src], sizeof(T));
  w.bar->arrive_and_wait();
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

template <class A, class B> inline auto max(A a, B b) -> decltype(a + b) { return a > b ? a : b; }
template <class A, class B> inline auto min(A a, B b) -> decltype(a + b) { return a < b ? a : b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
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
                          unsigned bx, unsigned by, unsigned bz) {
  int n = (int)(bx * by * bz);
  std::barrier<> block_bar(n), end_bar(n), poison_bar(n);
  std::vector<EmuWarp> warps((n + 31) / 32);
  std::vector<std::barrier<>*> owned;
  for (size_t w = 0; w < warps.size(); ++w) {
    int lanes = (int)std::min<size_t>(32, n - 32 * w);
    warps[w].lanes = lanes;
    warps[w].bar = new std::barrier<>(lanes);
    owned.push_back(warps[w].bar);
  }
  blockDim = {bx, by, bz};
  gridDim = {gx, gy, gz};
  emu_block_barrier = &block_bar;
  emu_warps = &warps;
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([=, &end_bar, &poison_bar] {
      emu_tid = t;
      threadIdx = {(unsigned)t % bx, ((unsigned)t / bx) % by, (unsigned)t / (bx * by)};
      for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
          for (unsigned x = 0; x < gx; ++x) {
            blockIdx = {x, y, z};
            call(args);
            end_bar.arrive_and_wait();
            if (t == 0)
              for (auto& r : emu_shared_regions) std::memset(r.first, 0xff, r.second);
            poison_bar.arrive_and_wait();
          }
    });
  }
  for (auto& th : threads) th.join();
  for (auto* b : owned) delete b;
  return 0;
}
