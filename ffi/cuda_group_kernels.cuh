// Device side of the native group collectives: the cast and reduce kernels (their launch
// descriptors Plan and Leaves are in cuda_plan.cuh) and a started reduce's copy kernel. The
// protocol they follow (staging regions, chunk flags, acknowledgements, epochs) is described
// at the top of cuda_group_collectives.cu; the host side that launches them is there and in
// cuda_host.cuh and cuda_started_reduce.cuh.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>
#include <cstdio>

#include "cuda_plan.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;       // 16-byte units in flight per thread in a block copy
constexpr int kWarpUnroll = 8;   // 16-byte units in flight per lane in a warp copy
constexpr int kRowsPerWarp = 4;  // at most this many consecutive rows per receiving warp
constexpr int64_t kRegionAlign = 256;

// ---- device helpers --------------------------------------------------------------------

__device__ __forceinline__ uint64_t NowNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Acquire side of a flag: after a flag was seen, later loads see what the writer released
// (at system scope: the writer is another GPU).
__device__ __forceinline__ void AcquireSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ void WaitAtLeast(const uint64_t* p, uint64_t want, int64_t timeout_ns,
                            const char* what, int peer, int index) {
  volatile const uint64_t* v = p;
  if (*v >= want) return;
  uint64_t t0 = NowNs();
  while (*v < want) {
    if (static_cast<int64_t>(NowNs() - t0) > timeout_ns) {
      printf("magi_jax native: timed out after %lld ms waiting for %s %d from PE %d "
             "(have epoch %llu, want %llu): did every process run the same program?\n",
             static_cast<long long>(timeout_ns / 1000000), what, index, peer,
             static_cast<unsigned long long>(*v), static_cast<unsigned long long>(want));
      __trap();
    }
  }
}

// The same for a 32-bit flag (a started reduce's), compared cyclically as the stream memory
// operations that raise it do.
__device__ void WaitAtLeast32(const uint32_t* p, uint32_t want, int64_t timeout_ns,
                              const char* what, int peer, int index) {
  volatile const uint32_t* v = p;
  if (static_cast<int32_t>(*v - want) >= 0) return;
  uint64_t t0 = NowNs();
  while (static_cast<int32_t>(*v - want) < 0) {
    if (static_cast<int64_t>(NowNs() - t0) > timeout_ns) {
      printf("magi_jax native: timed out after %lld ms waiting for the started reduce's %s %d "
             "from PE %d (have epoch %u, want %u): did every process run the same program?\n",
             static_cast<long long>(timeout_ns / 1000000), what, index, peer, *v, want);
      __trap();
    }
  }
}

// Copies `bytes` from src to dst with one warp (16-byte accesses when aligned), up to
// kWarpUnroll loads in flight per lane: a row of up to 4 KiB is one round trip (in pull mode
// the loads cross NVLink). src is staging written by this or another GPU during the kernel:
// loads bypass L1 (ld.global.cg).
__device__ __forceinline__ void WarpCopy(char* dst, const char* src, int64_t bytes, int lane) {
  if ((bytes & 15) == 0 && Aligned16(dst) && Aligned16(src)) {
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    const int64_t n = bytes >> 4;
    for (int64_t i = lane; i < n; i += kWarpUnroll * 32) {
      int4 v[kWarpUnroll];
#pragma unroll
      for (int k = 0; k < kWarpUnroll; ++k) {
        if (i + k * 32 < n) v[k] = __ldcg(s + i + k * 32);
      }
#pragma unroll
      for (int k = 0; k < kWarpUnroll; ++k) {
        if (i + k * 32 < n) d[i + k * 32] = v[k];
      }
    }
  } else {
    volatile const char* s = src;
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = s[i];
  }
}

__device__ __forceinline__ void WarpZero(char* dst, int64_t bytes, int lane) {
  if ((bytes & 15) == 0 && Aligned16(dst)) {
    int4 z = make_int4(0, 0, 0, 0);
    for (int64_t i = lane; i < (bytes >> 4); i += 32) reinterpret_cast<int4*>(dst)[i] = z;
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = 0;
  }
}

// All threads of the block: the rows src_of[pos0 + r] (r < m; -1 = skip) of every leaf,
// side by side, -> staged rows pos0 + r of `dst`, in 16-byte units, kUnroll loads in flight
// per thread. Needs L.aligned and dst 16-byte aligned.
__device__ __forceinline__ void BlockGatherRows(char* dst, const Leaves& L, const int32_t* src_of,
                                                int64_t pos0, int64_t m, int64_t row_bytes) {
  const uint32_t units = static_cast<uint32_t>(row_bytes >> 4);
  const uint32_t total = static_cast<uint32_t>(m) * units;
  for (uint32_t base = threadIdx.x; base < total; base += kUnroll * kThreads) {
    int4 v[kUnroll];
    int64_t off[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint32_t i = base + k * kThreads;
      off[k] = -1;
      v[k] = make_int4(0, 0, 0, 0);
      if (i < total) {
        const uint32_t r = i / units, u = i - r * units;
        const int32_t row = src_of[pos0 + r];
        if (row >= 0) {
          const int64_t at = static_cast<int64_t>(u) * 16;   // byte in the staged row
          int l = 0;
          while (l + 1 < L.n && at >= L.off[l + 1]) ++l;
          v[k] = __ldg(reinterpret_cast<const int4*>(L.src[l] + row * L.bytes[l] + at -
                                                      L.off[l]));
          off[k] = (pos0 + r) * row_bytes + at;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (off[k] >= 0) *reinterpret_cast<int4*>(dst + off[k]) = v[k];
    }
  }
}

// A send table entry past the input traps with a message instead of reading (and sending)
// memory that is not the input's. All threads of the block, entries [pos0, pos0 + m).
__device__ void CheckRows(const Plan& P, const int32_t* src_of, int64_t pos0, int64_t m) {
  for (int64_t r = threadIdx.x; r < m; r += kThreads) {
    const int32_t row = src_of[pos0 + r];
    if (row >= P.src_rows) {
      printf("magi_jax native: send table entry %lld is row %d of an input with %lld rows\n",
             static_cast<long long>(pos0 + r), row, static_cast<long long>(P.src_rows));
      __trap();
    }
  }
}

__device__ __forceinline__ int SlotOfChunk(const Plan& P, int c) {
  int j = 0;
  while (j + 1 < P.n && P.chunk_base[j + 1] <= c) ++j;
  return j;
}

// Send blocks: chunk c of slot j holds positions [c_local*R, min(w_j, (c_local+1)*R)).
// `src_of[j*S + p]` is the local row of the leaves to send (-1: nothing).
__device__ void SendChunks(const Plan& P, const Leaves& L, const int32_t* src_of) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ char* dst_region;  // this chunk's destination region (peer's or own staging)
  bool first = true;
  for (int c = blockIdx.x; c < P.chunk_base[P.n]; c += P.send_blocks) {
    const int j = SlotOfChunk(P, c);
    const int peer = P.send_to[j];
    const int64_t p0 = static_cast<int64_t>(c - P.chunk_base[j]) * P.R;
    const int64_t p1 = min(static_cast<int64_t>(P.widths[j]), p0 + P.R);
    if (threadIdx.x == 0) {
      if (first) {
        // Every PE must have finished reading the staging this call overwrites: in push
        // mode the peer reads its own staging, in pull mode the peers read ours. Waiting
        // for all PEs covers both, and tables whose senders change from call to call.
        for (int q = 0; q < P.cp; ++q) {
          WaitAtLeast(P.acks + q, P.ack_wait, P.timeout_ns, "acknowledgement", q, 0);
        }
      }
      char* base = P.mode == kPull ? P.stage : static_cast<char*>(nvshmem_ptr(P.stage, peer));
      dst_region = base ? base + P.stage_off : nullptr;
    }
    first = false;
    // A chunk with no real row (padding of a slot that is wider on another rank) is neither
    // written nor flagged: every flag raised is then one the receiver waits for within this
    // call, so no flag write of this call can land after the receiver moved on.
    bool any = false;
    for (int64_t p = p0 + threadIdx.x; p < p1 && !any; p += kThreads) {
      any = src_of[j * P.S + p] >= 0;
    }
    // This barrier also publishes dst_region and orders every store below after the wait.
    if (!__syncthreads_or(any)) continue;
    char* dst = dst_region;
    CheckRows(P, src_of, j * P.S + p0, p1 - p0);
    if (dst != nullptr) {
      if (L.aligned && Aligned16(dst)) {
        BlockGatherRows(dst, L, src_of, j * P.S + p0, p1 - p0, P.row_bytes);
      } else {
        for (int64_t p = p0 + warp; p < p1; p += kWarps) {
          const int32_t row = src_of[j * P.S + p];
          if (row < 0) continue;
          for (int l = 0; l < L.n; ++l) {
            char* d = dst + (j * P.S + p) * P.row_bytes + L.off[l];
            const char* s = L.src[l] + row * L.bytes[l];
            for (int64_t i = lane; i < L.bytes[l]; i += 32) d[i] = s[i];
          }
        }
      }
    } else {  // push to a peer without a load/store mapping
      for (int64_t p = p0 + warp; p < p1; p += kWarps) {
        const int32_t row = src_of[j * P.S + p];
        if (row < 0) continue;
        for (int l = 0; l < L.n; ++l) {
          nvshmemx_putmem_nbi_warp(
              P.stage + P.stage_off + (j * P.S + p) * P.row_bytes + L.off[l],
              L.src[l] + row * L.bytes[l], L.bytes[l], peer);
        }
      }
      __syncwarp();
      if (lane == 0) nvshmem_quiet();
    }
    // Release: every thread's stores (to the peer, or to our staging that the peer will
    // read) complete at system scope before the flag is raised.
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
      nvshmem_fence();
      nvshmemx_signal_op(P.flags + c, P.epoch, NVSHMEM_SIGNAL_SET, peer);
    }
    __syncthreads();
  }
}

// Where receive blocks read slot j's staged rows: our own staging (push) or the sender's
// (pull), at this call's region.
__device__ void StagedBases(const Plan& P, const char** base) {
  if (threadIdx.x < P.n) {
    const int j = threadIdx.x;
    const char* b = P.mode == kPull
                        ? static_cast<const char*>(nvshmem_ptr(P.stage, P.recv_from[j]))
                        : P.stage;
    if (b == nullptr) {
      printf("magi_jax native: PE %d is not load/store reachable from PE %d; the pull mode "
             "needs NVLink peers (MAGI_NATIVE_CAST_MODE=push)\n", P.recv_from[j], P.me);
      __trap();
    }
    base[j] = b + P.stage_off;
  }
  __syncthreads();
}

// The last receive block to finish tells every PE that this PE is done reading staging.
__device__ void Acknowledge(const Plan& P, int recv_blocks) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned int prev = atomicAdd(P.done, 1u);
    if (prev == static_cast<unsigned int>(recv_blocks - 1)) {
      *P.done = 0;
      __threadfence_system();
      for (int q = 0; q < P.cp; ++q) {
        if (P.slot_acks != nullptr) {  // every PE is mapped (the started sends needed it)
          volatile uint32_t* a = static_cast<uint32_t*>(nvshmem_ptr(P.slot_acks + P.me, q));
          *a = static_cast<uint32_t>(P.epoch);
        } else {
          nvshmemx_signal_op(P.acks + P.me, P.epoch, NVSHMEM_SIGNAL_SET, q);
        }
      }
      // A started reduce's done ends when every PE has summed its staging: a start queued
      // after it on XLA's stream may then overwrite the peers' staging without waiting.
      for (int q = 0; q < P.cp && P.slot_acks != nullptr; ++q) {
        WaitAtLeast32(P.slot_acks + q, static_cast<uint32_t>(P.epoch), P.timeout_ns,
                      "acknowledgement", q, 0);
      }
    }
  }
}

// Checked by the last block (a receiving one, which waits anyway), off the senders' path.
__device__ void CheckRank(const Plan& P, const int32_t* where) {
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0 && where[0] != P.me) {
    printf("magi_jax native: this process is NVSHMEM PE %d but rank %d of the cp axis; "
           "the native transport needs rank r on process r\n", P.me, where[0]);
    __trap();
  }
}

// The start both kernels share: a send block sends its chunks and is done (false); a
// receive block finds where each slot's staged rows are (true).
__device__ bool ReceiveBlock(const Plan& P, const Leaves& L, const int32_t* src_of,
                             const int32_t* where, const char** staged) {
  CheckRank(P, where);
  if (blockIdx.x < P.send_blocks) {
    SendChunks(P, L, src_of);
    return false;
  }
  StagedBases(P, staged);
  return true;
}

__global__ void __launch_bounds__(kThreads)
CastKernel(Plan P, Leaves L, const int32_t* send, const int32_t* recv, const int32_t* where,
           int64_t prefix_rows, int64_t B, int recv_blocks,
           int rows_per_warp) {
  __shared__ const char* staged[kMaxSlots];
  if (!ReceiveBlock(P, L, send, where, staged)) return;
  const int rb = blockIdx.x - P.send_blocks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Output rows: the input's own rows first (prefix_rows of them; copied while the peers'
  // rows are on their way), then one per receive entry. Each warp takes rows_per_warp
  // consecutive rows at a time: one flag wait and fence per chunk among them instead of one
  // per row.
  const int64_t rows = prefix_rows + B;
  const int64_t stride = static_cast<int64_t>(recv_blocks) * kWarps * rows_per_warp;
  for (int64_t b0 = (static_cast<int64_t>(rb) * kWarps + warp) * rows_per_warp;
       b0 < rows; b0 += stride) {
    int seen = -1;  // chunk whose flag this warp has already acquired
    const int64_t b1 = min(rows, b0 + rows_per_warp);
    for (int64_t b = b0; b < b1; ++b) {
      if (b < prefix_rows) {
        for (int l = 0; l < L.n; ++l) {
          WarpCopy(L.dst[l] + b * L.bytes[l], L.src[l] + b * L.bytes[l], L.bytes[l], lane);
        }
        continue;
      }
      const int32_t e = recv[b - prefix_rows];
      if (e < 0) {
        for (int l = 0; l < L.n; ++l) WarpZero(L.dst[l] + b * L.bytes[l], L.bytes[l], lane);
        continue;
      }
      if (e >= P.n * P.S) {
        printf("magi_jax native: receive table entry %lld is %d, past the %lld slot "
               "positions\n", static_cast<long long>(b - prefix_rows), e,
               static_cast<long long>(P.n * P.S));
        __trap();
      }
      const int j = e / P.S;
      const int c = P.chunk_base[j] + static_cast<int>((e % P.S) / P.R);
      if (c != seen) {
        if (lane == 0) WaitAtLeast(P.flags + c, P.epoch, P.timeout_ns, "rows of chunk",
                                   P.recv_from[j], c);
        __syncwarp();
        AcquireSys();
        seen = c;
      }
      const char* row = staged[j] + static_cast<int64_t>(e) * P.row_bytes;
      for (int l = 0; l < L.n; ++l) {
        WarpCopy(L.dst[l] + b * L.bytes[l], row + L.off[l], L.bytes[l], lane);
      }
    }
  }
  Acknowledge(P, recv_blocks);
}

template <typename T>
__device__ __forceinline__ float ToF32(T v);
template <>
__device__ __forceinline__ float ToF32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float ToF32<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float ToF32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T FromF32(float v);
template <>
__device__ __forceinline__ float FromF32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half FromF32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromF32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// ---- a started reduce's sends ---------------------------------------------------------

// Contiguous copies (a started reduce's runs, into the owners' staging over NVLink) by a
// few blocks: queued on a high-priority stream as the dK/dV kernel ends, they take their
// SMs before the dQ kernel's blocks and leave it the rest. (On 2 H200s the driver's memcpy
// to a peer's mapping, plain or batched with the hint to overlap compute, never ran beside
// the dQ kernel: it waited for dQ's last blocks, or dQ waited for it, as SM copies would.)
constexpr int kCopySegments = 128;
constexpr int kCopyBlocks = 16;
constexpr int kCopyThreads = 1024;
constexpr int kCopyUnroll = 8;

struct CopyList {
  int n;
  char* dst[kCopySegments];
  const char* src[kCopySegments];
  int64_t bytes[kCopySegments];
};

__global__ void __launch_bounds__(kCopyThreads) CopyKernel(CopyList C) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kCopyThreads;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kCopyThreads + threadIdx.x;
  for (int k = 0; k < C.n; ++k) {
    char* dst = C.dst[k];
    const char* src = C.src[k];
    const int64_t bytes = C.bytes[k];
    if ((bytes & 15) == 0 && Aligned16(dst) && Aligned16(src)) {
      const int4* s = reinterpret_cast<const int4*>(src);
      int4* d = reinterpret_cast<int4*>(dst);
      const int64_t units = bytes >> 4;
      for (int64_t i = tid; i < units; i += stride * kCopyUnroll) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          if (i + u * stride < units) v[u] = __ldg(s + i + u * stride);
        }
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          if (i + u * stride < units) d[i + u * stride] = v[u];
        }
      }
    } else {
      for (int64_t i = tid; i < bytes; i += stride) dst[i] = src[i];
    }
  }
  __threadfence_system();  // the flags raised after this kernel find the rows in place
}

// Leaf l's part of staged row e: inside the row (rows of every leaf side by side) or, for a
// started reduce, in the leaf's own block of rows (planar).
template <typename T>
__device__ __forceinline__ const T* StagedRow(const Plan& P, const Leaves& L, const char* base,
                                              int64_t e, int l) {
  if (P.slot_flags != nullptr) {
    return reinterpret_cast<const T*>(base + P.n * P.S * L.off[l] + e * L.bytes[l]);
  }
  return reinterpret_cast<const T*>(base + e * P.row_bytes + L.off[l]);
}

// out_l[t] = (acc_l[t] or 0) + (local_l[t] or 0) + sum_j (leaf l's part of
// staged[j*S + inv[t, j]]), j ascending, summed in float32 and rounded once to OutT (float32,
// or the input's dtype), for every leaf l.
template <typename T, typename OutT>
__global__ void __launch_bounds__(kThreads)
ReduceKernel(Plan P, Leaves L, const int32_t* rinv, const int32_t* inv, const int32_t* where,
             int64_t T_rows, int recv_blocks) {
  __shared__ const char* staged[kMaxSlots];
  if (!ReceiveBlock(P, L, rinv, where, staged)) return;
  const int rb = blockIdx.x - P.send_blocks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t F = P.row_bytes / static_cast<int64_t>(sizeof(T));  // elements of a staged row
  constexpr int V = 16 / sizeof(T);  // elements per 16-byte load
  for (int64_t t = static_cast<int64_t>(rb) * kWarps + warp; t < T_rows;
       t += static_cast<int64_t>(recv_blocks) * kWarps) {
    const int32_t* my_inv = inv + t * P.n;
    bool receives = false;  // (every lane reads the same entries)
    for (int j = 0; j < P.n; ++j) receives = receives || my_inv[j] >= 0;
    if (L.in_place && !receives) continue;  // the row already holds its sum
    if (lane == 0) {
      for (int j = 0; j < P.n; ++j) {
        const int32_t p = my_inv[j];
        if (p < 0) continue;
        if (P.slot_flags != nullptr) {
          WaitAtLeast32(P.slot_flags + j, static_cast<uint32_t>(P.epoch), P.timeout_ns,
                        "rows of slot", P.recv_from[j], j);
          continue;
        }
        const int c = P.chunk_base[j] + static_cast<int>(p / P.R);
        WaitAtLeast(P.flags + c, P.epoch, P.timeout_ns, "rows of chunk", P.recv_from[j], c);
      }
    }
    __syncwarp();
    if (receives) AcquireSys();
    for (int l = 0; l < L.n; ++l) {
      const int64_t Fl = L.bytes[l] / static_cast<int64_t>(sizeof(T));  // leaf l's elements
      const int64_t first = L.off[l] / static_cast<int64_t>(sizeof(T));  // its first in a row
      OutT* o = reinterpret_cast<OutT*>(L.dst[l]) + t * Fl;
      const float* a = L.acc[l] ? L.acc[l] + t * Fl : nullptr;
      const T* own = L.local[l] ? reinterpret_cast<const T*>(L.local[l]) + t * Fl : nullptr;
      if (F % V == 0 && Fl % V == 0 && first % V == 0 && Aligned16(o) &&
          (!a || Aligned16(a)) && (!own || Aligned16(own))) {
        // kUnroll 16-byte loads per slot in flight per lane (in pull mode they cross NVLink).
        for (int64_t f0 = static_cast<int64_t>(lane) * V; f0 < Fl; f0 += 32 * V * kUnroll) {
          float s[kUnroll][V];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t f = f0 + u * 32 * V;
#pragma unroll
            for (int k = 0; k < V; k += 4) {
              const float4 a4 = (a && f < Fl) ? *reinterpret_cast<const float4*>(a + f + k)
                                              : make_float4(0.f, 0.f, 0.f, 0.f);
              s[u][k] = a4.x; s[u][k + 1] = a4.y; s[u][k + 2] = a4.z; s[u][k + 3] = a4.w;
            }
            if (own && f < Fl) {
              const int4 raw = *reinterpret_cast<const int4*>(own + f);
              const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
              for (int k = 0; k < V; ++k) s[u][k] += ToF32<T>(v[k]);
            }
          }
          for (int j = 0; j < P.n; ++j) {
            const int32_t p = my_inv[j];
            if (p < 0) continue;
            const T* row = StagedRow<T>(P, L, staged[j], j * P.S + p, l);
            int4 raw[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              const int64_t f = f0 + u * 32 * V;
              raw[u] = f < Fl ? __ldcg(reinterpret_cast<const int4*>(row + f))
                              : make_int4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              const T* v = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
              for (int k = 0; k < V; ++k) s[u][k] += ToF32<T>(v[k]);
            }
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t f = f0 + u * 32 * V;
            if (f >= Fl) continue;
#pragma unroll
            for (int k = 0; k < V; k += 16 / static_cast<int>(sizeof(OutT))) {
              // One 16-byte store of 16 / sizeof(OutT) rounded sums.
              alignas(16) OutT packed[16 / sizeof(OutT)];
#pragma unroll
              for (int i = 0; i < static_cast<int>(16 / sizeof(OutT)); ++i) {
                packed[i] = FromF32<OutT>(s[u][k + i]);
              }
              *reinterpret_cast<int4*>(o + f + k) = *reinterpret_cast<const int4*>(packed);
            }
          }
        }
      } else {
        for (int64_t f = lane; f < Fl; f += 32) {
          float s = (a ? a[f] : 0.f) + (own ? ToF32<T>(own[f]) : 0.f);
          for (int j = 0; j < P.n; ++j) {
            const int32_t p = my_inv[j];
            if (p < 0) continue;
            const T* row = StagedRow<T>(P, L, staged[j], j * P.S + p, l);
            s += ToF32<T>(row[f]);
          }
          o[f] = FromF32<OutT>(s);
        }
      }
    }
  }
  Acknowledge(P, recv_blocks);
}

}  // namespace
