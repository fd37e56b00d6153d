// CUDA handlers of the native group collectives over NVSHMEM (magi_jax/native.py).
//
// One process per GPU; rank r of the cp axis is NVSHMEM PE r. Tables of rank r as in
// magi_jax/sharding/collectives.py: send [n, S] (local row or -1), recv [B] (j*S + p or -1).
//
// A collective moves the rows of up to kMaxLeaves arrays with one leading row axis (e.g. K
// and V) at once: a staged row is the rows of every leaf side by side, gathered from the
// leaves by the send blocks and split into one output per leaf by the receive blocks, so the
// arrays are never concatenated in memory.
//
// One kernel per collective, two kinds of blocks. The rows of slot j travel through a
// symmetric staging region at position j*S + p, in one of two data paths (`mode`):
//  * push: send blocks store their rows straight into the PEER's staging (16-byte stores
//    through the NVLink mapping from nvshmem_ptr; nvshmem puts where the peer is not mapped);
//    receive blocks copy from their OWN staging into XLA's output.
//  * pull: send blocks gather their rows into their OWN staging (local HBM); receive blocks
//    load from the PEER's staging (nvshmem_ptr, 16-byte loads) straight into XLA's output.
//    Only when every PE is load/store reachable (NVSHMEM_TEAM_SHARED = all PEs).
// Either way the data crosses the link once and is copied once locally; a send block works
// through chunks (R consecutive slot positions of one slot), all its threads copying
// 16-byte units, then raises that chunk's flag on the receiving PE (NVSHMEM signal, value =
// this call's epoch). Receive blocks wait for the flag of each chunk they need and
//      cast:   copy the staged row into out[b] (x's dtype), zeros for padding rows;
//      reduce: sum, in float32 and in slot order, the staged rows of every slot that holds
//              a row t of this rank (inv[t, j] = p) into out[t] (+ acc[t]).
// With `prefix` (a stage whose KV is the local rows followed by the fetched ones) a cast's
// output starts with x's own rows, which the receive blocks copy while the peers' rows are
// on their way, and a reduce's input starts with the owner's own rows, which are added to
// its sums: no concatenation of the local and fetched rows, no slice of the gradient. A
// reduce may round its float32 sums once to the input's dtype (`out_input_dtype`).
// Direction: a cast sends slot j to r + shift_j; a reduce sends slot j back to r - shift_j.
//
// Reuse of staging: the last receive block of a call tells every PE "I have finished
// reading (my own or a peer's) staging for epoch e" (ack, value e). Calls alternate between
// the bottom and the top of the staging buffer when both fit; a call whose region does not
// overlap the previous call's region only waits until every PE acknowledged epoch e - 2
// (the ack round trip of the previous call is then off the critical path), otherwise until
// every PE acknowledged e - 1. Epochs and regions are host state that every process of an
// SPMD program advances identically (same calls, same shapes), so they agree without
// talking. Each region has its own bank of flags. A receiver in call e waits for flag c >= e;
// the only writes of a value >= e to that flag before it finishes call e are call e's own:
// the next call that uses the same bank waits for this receiver's ack of e (the next call in
// the same region does, being not disjoint; the one after waits for e anyway). Senders
// raise flags only for chunks that hold a real row, i.e. ones the receiver waits for, so no
// flag write of an old call can land late over a newer value.
// No host synchronisation anywhere: the host only picks the region, bumps the epoch and
// launches the kernel on XLA's stream. A wait that exceeds the timeout prints which
// peer/flag it waited for and traps (the JAX program then fails) instead of hanging.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxSlots = 64;
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;       // 16-byte units in flight per thread in a block copy
constexpr int kWarpUnroll = 8;   // 16-byte units in flight per lane in a warp copy
constexpr int kRowsPerWarp = 4;  // at most this many consecutive rows per receiving warp
constexpr int64_t kRegionAlign = 256;
constexpr int kMaxLeaves = 4;
enum Mode : int { kPush = 0, kPull = 1 };

// ---- process-wide NVSHMEM context ------------------------------------------------------

struct Context {
  bool ready = false;
  bool all_mapped = false;  // every PE's symmetric memory is load/store reachable
  int me = 0, npes = 0;
  char* stage = nullptr;  // symmetric staging rows
  size_t stage_bytes = 0;
  uint64_t* flags = nullptr;  // symmetric [2][n_flags / 2]: chunk arrival, value = epoch;
  size_t n_flags = 0;         // bank 0 for calls at the bottom of staging, bank 1 at the top
  uint64_t* acks = nullptr;  // symmetric [npes]: acks[q] = last epoch q finished reading
  unsigned int* done = nullptr;  // device counter of finished receive blocks
  uint64_t epoch = 0;            // host: native collectives enqueued so far
  // A side stream for copy-engine copies beside a kernel (forked from and joined back into
  // XLA's stream within one handler call), created on first use.
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  int64_t prev_lo = 0, prev_hi = 0;  // host: staging region [lo, hi) of the previous call
  bool prev_top = true;              // host: the previous call used the top of staging
};
Context g;

// ---- per call site state (FFI instantiate) ---------------------------------------------

struct CollectiveState {
  static ffi::TypeId id;
  int cp = 0, n = 0;
  int64_t rows_per_chunk = 1, slot_len = 1;
  int shifts[kMaxSlots];
  int widths[kMaxSlots];
  int chunk_base[kMaxSlots + 1];
  int send_blocks = 64, recv_blocks = 64;
  int mode = kPush;
  bool double_buffer = true;
  bool accumulate = false;  // reduce: add the initial sums passed after the arrays
  // cast: the output is the input's rows followed by the received ones; reduce: the input
  // is the owner's own rows followed by the buffer, and its own rows are added to the sums.
  bool prefix = false;
  bool out_input_dtype = false;  // reduce: outputs in the input's dtype (else float32)
  bool ce_prefix = false;        // cast with prefix: copy x's rows with the copy engine
  int64_t timeout_ns = 0;
};
ffi::TypeId CollectiveState::id = XLA_FFI_UNKNOWN_TYPE_ID;
XLA_FFI_TypeInfo g_state_info = ffi::MakeTypeInfo<CollectiveState>();

// What one kernel launch needs (passed by value).
struct Plan {
  int me, cp, n, mode;
  int64_t S, R, row_bytes;
  int send_to[kMaxSlots];    // PE that slot j's rows are written to
  int recv_from[kMaxSlots];  // PE that slot j's rows come from
  int chunk_base[kMaxSlots + 1];
  int widths[kMaxSlots];
  int send_blocks;
  int64_t src_rows;  // rows of the input the send table indexes (bounds check)
  uint64_t epoch;
  uint64_t ack_wait;  // every PE must have acknowledged this epoch before we write staging
  int64_t timeout_ns;
  char* stage;        // symmetric base (the same address on every PE)
  int64_t stage_off;  // this call's region inside it
  uint64_t* flags;    // this call's bank of flags (one bank per staging region)
  uint64_t* acks;
  unsigned int* done;
};

// The arrays of one collective (passed by value). A staged row is leaf 0's row, then leaf
// 1's, ...: leaf l at byte off[l] of it, bytes[l] long; off[n] is the staged row's size.
struct Leaves {
  int n;
  const char* src[kMaxLeaves];   // cast: x_l [T, ...]; reduce: the buffer rows y_l [B, ...]
  char* dst[kMaxLeaves];         // cast: out_l [(T +) B, ...]; reduce: out_l [T, ...]
  const float* acc[kMaxLeaves];  // reduce: the sums to add to (accumulate) or nullptr
  const char* local[kMaxLeaves];  // reduce with prefix: the owner's own rows [T, ...]
  int64_t bytes[kMaxLeaves];
  int64_t off[kMaxLeaves + 1];
  bool aligned;                  // every leaf's rows 16-byte sized and aligned
};

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

__host__ __device__ __forceinline__ bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
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
        nvshmemx_signal_op(P.acks + P.me, P.epoch, NVSHMEM_SIGNAL_SET, q);
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

__global__ void __launch_bounds__(kThreads)
CastKernel(Plan P, Leaves L, const int32_t* send, const int32_t* recv, const int32_t* where,
           int64_t prefix_rows, bool copy_prefix, int64_t B, int recv_blocks,
           int rows_per_warp) {
  CheckRank(P, where);
  if (blockIdx.x < P.send_blocks) {
    SendChunks(P, L, send);
    return;
  }
  __shared__ const char* staged[kMaxSlots];
  StagedBases(P, staged);
  const int rb = blockIdx.x - P.send_blocks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Output rows: the input's own rows first (prefix_rows of them; copied here while the
  // peers' rows are on their way when copy_prefix, else by the copy engine beside this
  // kernel), then one per receive entry. Each warp takes rows_per_warp consecutive rows at
  // a time: one flag wait and fence per chunk among them instead of one per row.
  const int64_t rows = prefix_rows + B;
  const int64_t first = copy_prefix ? 0 : prefix_rows;
  const int64_t stride = static_cast<int64_t>(recv_blocks) * kWarps * rows_per_warp;
  for (int64_t b0 = first + (static_cast<int64_t>(rb) * kWarps + warp) * rows_per_warp;
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

// out_l[t] = (acc_l[t] or 0) + (local_l[t] or 0) + sum_j (leaf l's part of
// staged[j*S + inv[t, j]]), j ascending, summed in float32 and rounded once to OutT (float32,
// or the input's dtype), for every leaf l.
template <typename T, typename OutT>
__global__ void __launch_bounds__(kThreads)
ReduceKernel(Plan P, Leaves L, const int32_t* rinv, const int32_t* inv, const int32_t* where,
             int64_t T_rows, int recv_blocks) {
  CheckRank(P, where);
  if (blockIdx.x < P.send_blocks) {
    SendChunks(P, L, rinv);
    return;
  }
  __shared__ const char* staged[kMaxSlots];
  StagedBases(P, staged);
  const int rb = blockIdx.x - P.send_blocks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t F = P.row_bytes / static_cast<int64_t>(sizeof(T));  // elements of a staged row
  constexpr int V = 16 / sizeof(T);  // elements per 16-byte load
  for (int64_t t = static_cast<int64_t>(rb) * kWarps + warp; t < T_rows;
       t += static_cast<int64_t>(recv_blocks) * kWarps) {
    const int32_t* my_inv = inv + t * P.n;
    bool receives = false;  // (every lane reads the same entries)
    for (int j = 0; j < P.n; ++j) receives = receives || my_inv[j] >= 0;
    if (lane == 0) {
      for (int j = 0; j < P.n; ++j) {
        const int32_t p = my_inv[j];
        if (p < 0) continue;
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
            const T* row = reinterpret_cast<const T*>(staged[j]) + (j * P.S + p) * F + first;
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
            const T* row = reinterpret_cast<const T*>(staged[j]) + (j * P.S + p) * F + first;
            s += ToF32<T>(row[f]);
          }
          o[f] = FromF32<OutT>(s);
        }
      }
    }
  }
  Acknowledge(P, recv_blocks);
}

// ---- host side -------------------------------------------------------------------------

ffi::ErrorOr<std::unique_ptr<CollectiveState>> Instantiate(
    int64_t cp, ffi::Span<const int64_t> shifts, int64_t call_id, int64_t timeout_ms,
    ffi::Span<const int64_t> widths, int64_t slot_len, int64_t rows_per_chunk,
    int64_t send_blocks, int64_t recv_blocks, int64_t mode, bool double_buffer, bool prefix,
    bool ce_prefix) {
  if (!g.ready) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
        "magi_jax native: NVSHMEM is not initialized (magi_jax.native.initialize)");
  }
  if (cp != g.npes) {
    return ffi::Error::InvalidArgument(
        "magi_jax native: the cp axis has " + std::to_string(cp) + " ranks but NVSHMEM has " +
        std::to_string(g.npes) + " PEs (one process per GPU, the cp axis over all of them)");
  }
  if (shifts.size() != widths.size() || shifts.size() > kMaxSlots) {
    return ffi::Error::InvalidArgument("magi_jax native: at most 64 slots, one width each");
  }
  if (mode != kPush && mode != kPull) {
    return ffi::Error::InvalidArgument("magi_jax native: mode is 0 (push) or 1 (pull), got " +
                                       std::to_string(mode));
  }
  if (send_blocks < 1 || recv_blocks < 1) {
    return ffi::Error::InvalidArgument("magi_jax native: send_blocks and recv_blocks >= 1");
  }
  // Chunks come from the widths: each must fit in its slot.
  for (size_t j = 0; j < widths.size(); ++j) {
    if (widths[j] < 0 || widths[j] > slot_len) {
      return ffi::Error::InvalidArgument(
          "magi_jax native: slot " + std::to_string(j) + " has width " +
          std::to_string(widths[j]) + " but the slots hold " + std::to_string(slot_len) +
          " positions");
    }
  }
  auto st = std::make_unique<CollectiveState>();
  st->cp = static_cast<int>(cp);
  st->n = static_cast<int>(shifts.size());
  st->slot_len = slot_len;
  st->rows_per_chunk = rows_per_chunk < 1 ? 1 : rows_per_chunk;
  st->send_blocks = static_cast<int>(send_blocks);
  st->recv_blocks = static_cast<int>(recv_blocks);
  // Pull needs a load/store path to every PE; elsewhere the push path (with nvshmem puts
  // where there is no mapping) moves the same rows.
  st->mode = (mode == kPull && g.all_mapped) ? kPull : kPush;
  st->double_buffer = double_buffer;
  st->prefix = prefix;
  st->ce_prefix = ce_prefix;
  st->timeout_ns = timeout_ms * 1000000;
  st->chunk_base[0] = 0;
  for (int j = 0; j < st->n; ++j) {
    st->shifts[j] = static_cast<int>(shifts[j]);
    st->widths[j] = static_cast<int>(widths[j]);
    st->chunk_base[j + 1] =
        st->chunk_base[j] + static_cast<int>((widths[j] + st->rows_per_chunk - 1) /
                                             st->rows_per_chunk);
  }
  if (static_cast<size_t>(st->chunk_base[st->n]) > g.n_flags / 2) {
    return ffi::Error::InvalidArgument("magi_jax native: more chunks than flags");
  }
  return ffi::ErrorOr<std::unique_ptr<CollectiveState>>(std::move(st));
}

int64_t RegionBytes(const CollectiveState& st, int64_t row_bytes) {
  const int64_t need = static_cast<int64_t>(st.n) * st.slot_len * row_bytes;
  return (need + kRegionAlign - 1) / kRegionAlign * kRegionAlign;
}

// Picks this call's staging region and the epoch every PE must have acknowledged before it
// is overwritten; advances the host state (identically on every process).
Plan MakePlan(const CollectiveState& st, bool reverse, int64_t row_bytes, int64_t src_rows) {
  Plan P;
  P.me = g.me;
  P.cp = st.cp;
  P.n = st.n;
  P.mode = st.mode;
  P.S = st.slot_len;
  P.R = st.rows_per_chunk;
  P.row_bytes = row_bytes;
  for (int j = 0; j < st.n; ++j) {
    const int fwd = ((g.me + st.shifts[j]) % st.cp + st.cp) % st.cp;
    const int bwd = ((g.me - st.shifts[j]) % st.cp + st.cp) % st.cp;
    P.send_to[j] = reverse ? bwd : fwd;
    P.recv_from[j] = reverse ? fwd : bwd;
  }
  for (int j = 0; j <= st.n; ++j) P.chunk_base[j] = st.chunk_base[j];
  for (int j = 0; j < st.n; ++j) P.widths[j] = st.widths[j];
  const int chunks = st.chunk_base[st.n];
  P.send_blocks = std::max(1, std::min(st.send_blocks, chunks));
  P.src_rows = src_rows;
  P.epoch = ++g.epoch;
  // Region: alternate bottom / top; if it does not overlap the previous call's region, the
  // previous call's readers may still be busy (wait for e - 2 only), else wait for e - 1.
  const int64_t need = RegionBytes(st, row_bytes);
  const int64_t cap = static_cast<int64_t>(g.stage_bytes) / kRegionAlign * kRegionAlign;
  int64_t lo = 0;
  bool top = false;
  if (st.double_buffer && !g.prev_top && need <= cap) {
    lo = cap - need;
    top = true;
  }
  const bool disjoint = need == 0 || lo >= g.prev_hi || lo + need <= g.prev_lo;
  const uint64_t back = (st.double_buffer && disjoint) ? 2 : 1;
  P.ack_wait = P.epoch > back ? P.epoch - back : 0;
  g.prev_lo = lo;
  g.prev_hi = lo + need;
  g.prev_top = top;
  P.timeout_ns = st.timeout_ns;
  P.stage = g.stage;
  P.stage_off = lo;
  // The two regions have their own flags: a later call in the other region (which may run
  // while this one is still being received) never writes a flag this call waits for.
  P.flags = g.flags + (top ? g.n_flags / 2 : 0);
  P.acks = g.acks;
  P.done = g.done;
  return P;
}

ffi::Error LaunchError(const char* op) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return ffi::Error::Internal(std::string("magi_jax native ") + op + ": " +
                                cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

// A table whose shape differs from the call site's slots would be read out of bounds.
ffi::Error CheckSendTable(const CollectiveState& st, const ffi::Buffer<ffi::S32>& send) {
  auto d = send.dimensions();
  if (d.size() != 2 || d[0] != st.n || d[1] != st.slot_len) {
    return ffi::Error::InvalidArgument(
        "magi_jax native: the send table must be [" + std::to_string(st.n) + ", " +
        std::to_string(st.slot_len) + "] (slots x slot length of the call site)");
  }
  return ffi::Error::Success();
}

ffi::Error CheckStage(const CollectiveState& st, int64_t row_bytes) {
  const size_t need = static_cast<size_t>(st.n) * st.slot_len * row_bytes;
  if (need > g.stage_bytes) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
        "magi_jax native: the collective stages " + std::to_string(need) + " bytes but only " +
        std::to_string(g.stage_bytes) + " were reserved (magi_jax.native.initialize)");
  }
  return ffi::Error::Success();
}

int64_t RowBytes(const ffi::AnyBuffer& a) {
  auto dims = a.dimensions();
  int64_t per_row = 1;
  for (size_t i = 1; i < dims.size(); ++i) per_row *= dims[i];
  return per_row * static_cast<int64_t>(ffi::ByteWidth(a.element_type()));
}

int64_t Rows(const ffi::AnyBuffer& a) {
  auto dims = a.dimensions();
  return dims.size() == 0 ? 0 : dims[0];
}

// Receive blocks: no more than one warp per row needs.
int RecvBlocks(const CollectiveState& st, int64_t rows) {
  const int64_t need = std::max<int64_t>(1, (rows + kWarps - 1) / kWarps);
  return static_cast<int>(std::min<int64_t>(st.recv_blocks, need));
}

// The leaves of a call: inputs args[0, n), outputs rets[0, n) (one per input; a cast keeps
// the input's row bytes, a reduce writes float32 rows of the input's elements, or rows of
// the input's dtype with out_input_dtype), and for an accumulating reduce the initial sums
// args[n, 2n). `B` rows are received (cast) or sent back (reduce); with `prefix` a cast's
// outputs start with the input's rows and a reduce's inputs with the owner's own rows (then
// L.src points past them, at the buffer). Checks what the kernels rely on.
ffi::ErrorOr<Leaves> GetLeaves(const char* op, ffi::RemainingArgs args, ffi::RemainingRets rets,
                               bool reduce, const CollectiveState& st, int64_t B) {
  const bool accumulate = reduce && st.accumulate;
  Leaves L{};
  const size_t n = rets.size();
  const size_t inputs = args.size();
  if (n < 1 || n > static_cast<size_t>(kMaxLeaves) || inputs != n * (accumulate ? 2 : 1)) {
    return ffi::Error::InvalidArgument(
        std::string("magi_jax native ") + op + ": 1 to " + std::to_string(kMaxLeaves) +
        " arrays, one output each" + (accumulate ? " and one initial sum each" : "") +
        "; got " + std::to_string(inputs) + " inputs and " + std::to_string(n) + " outputs");
  }
  L.n = static_cast<int>(n);
  L.aligned = true;
  L.off[0] = 0;
  int64_t rows = -1, out_rows = -1;
  ffi::DataType dtype = ffi::DataType::INVALID;
  for (size_t l = 0; l < n; ++l) {
    auto x = args.get<ffi::AnyBuffer>(l);
    auto o = rets.get<ffi::AnyBuffer>(l);
    if (x.has_error()) return x.error();
    if (o.has_error()) return o.error();
    const int64_t bytes = RowBytes(*x);
    const int64_t elems = bytes / static_cast<int64_t>(ffi::ByteWidth(x->element_type()));
    const ffi::DataType out_type =
        reduce && !st.out_input_dtype ? ffi::DataType::F32 : x->element_type();
    const bool shape_ok =
        (*o)->element_type() == out_type &&
        RowBytes(**o) == elems * static_cast<int64_t>(ffi::ByteWidth(out_type));
    if (rows < 0) {
      rows = Rows(*x);
      out_rows = Rows(**o);
      dtype = x->element_type();
    }
    if (!shape_ok || Rows(*x) != rows || Rows(**o) != out_rows ||
        (reduce && x->element_type() != dtype)) {
      return ffi::Error::InvalidArgument(
          std::string("magi_jax native ") + op + ": array " + std::to_string(l) +
          (reduce ? " must share the rows and dtype of the others and its output be rows of "
                    "its elements (float32, or its dtype with out_input_dtype)"
                  : " must share the rows of the others and its output its dtype and row "
                    "size"));
    }
    // Row counts: a cast writes (x's rows +) B rows; a reduce reads (its output's rows +) B.
    const int64_t want_rows = B + (st.prefix ? (reduce ? out_rows : rows) : 0);
    if ((reduce ? rows : out_rows) != want_rows) {
      return ffi::Error::InvalidArgument(
          std::string("magi_jax native ") + op + ": array " + std::to_string(l) + " has " +
          std::to_string(reduce ? rows : out_rows) + (reduce ? " input" : " output") +
          " rows, expected " + std::to_string(want_rows));
    }
    const char* data = static_cast<const char*>(x->untyped_data());
    L.local[l] = reduce && st.prefix ? data : nullptr;
    L.src[l] = reduce && st.prefix ? data + out_rows * bytes : data;
    L.dst[l] = static_cast<char*>((*o)->untyped_data());
    L.acc[l] = nullptr;
    if (accumulate) {
      auto a = args.get<ffi::AnyBuffer>(n + l);
      if (a.has_error()) return a.error();
      if (a->element_type() != ffi::DataType::F32 ||
          a->size_bytes() != static_cast<size_t>(out_rows * elems * 4)) {
        return ffi::Error::InvalidArgument(std::string("magi_jax native ") + op +
                                           ": the initial sums must have the outputs' shapes "
                                           "(float32)");
      }
      L.acc[l] = static_cast<const float*>(a->untyped_data());
    }
    L.bytes[l] = bytes;
    L.off[l + 1] = L.off[l] + bytes;
    L.aligned = L.aligned && (bytes & 15) == 0 && Aligned16(L.src[l]);
  }
  return L;
}

ffi::Error CastExecute(cudaStream_t stream, CollectiveState* st, ffi::Buffer<ffi::S32> send,
                       ffi::Buffer<ffi::S32> recv, ffi::Buffer<ffi::S32> where,
                       ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const int64_t B = static_cast<int64_t>(recv.element_count());
  auto leaves = GetLeaves("group_cast", args, rets, /*reduce=*/false, *st, B);
  if (leaves.has_error()) return leaves.error();
  const Leaves& L = *leaves;
  const int64_t row_bytes = L.off[L.n];
  if (auto e = CheckStage(*st, row_bytes); !e.success()) return e;
  if (auto e = CheckSendTable(*st, send); !e.success()) return e;
  const int64_t x_rows = Rows(*args.get<ffi::AnyBuffer>(0));
  const int64_t prefix_rows = st->prefix ? x_rows : 0;
  // x's rows by the copy engine on a side stream forked from XLA's, joined back after the
  // kernel is queued: they copy while the kernel moves the peers' rows, with no SM.
  const bool ce = prefix_rows > 0 && st->ce_prefix;
  if (ce) {
    if (g.side == nullptr &&
        (cudaStreamCreateWithFlags(&g.side, cudaStreamNonBlocking) != cudaSuccess ||
         cudaEventCreateWithFlags(&g.fork, cudaEventDisableTiming) != cudaSuccess ||
         cudaEventCreateWithFlags(&g.join, cudaEventDisableTiming) != cudaSuccess)) {
      return LaunchError("group_cast (side stream)");
    }
    cudaEventRecord(g.fork, stream);
    cudaStreamWaitEvent(g.side, g.fork, 0);
    for (int l = 0; l < L.n; ++l) {
      cudaMemcpyAsync(L.dst[l], L.src[l], x_rows * L.bytes[l], cudaMemcpyDeviceToDevice,
                      g.side);
    }
    cudaEventRecord(g.join, g.side);
  }
  const int64_t kernel_rows = (ce ? 0 : prefix_rows) + B;
  const int recv_blocks = RecvBlocks(*st, kernel_rows);
  // Group rows per warp only when every warp has several (small casts: all warps busy).
  const int64_t warps = static_cast<int64_t>(recv_blocks) * kWarps;
  const int rows_per_warp = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(kRowsPerWarp, kernel_rows / warps)));
  Plan P = MakePlan(*st, /*reverse=*/false, row_bytes, x_rows);
  CastKernel<<<P.send_blocks + recv_blocks, kThreads, 0, stream>>>(
      P, L, send.typed_data(), recv.typed_data(), where.typed_data(), prefix_rows, !ce, B,
      recv_blocks, rows_per_warp);
  if (ce) cudaStreamWaitEvent(stream, g.join, 0);
  return LaunchError("group_cast");
}

ffi::Error ReduceExecute(cudaStream_t stream, CollectiveState* st, ffi::Buffer<ffi::S32> send,
                         ffi::Buffer<ffi::S32> recv, ffi::Buffer<ffi::S32> where,
                         ffi::Buffer<ffi::S32> inv, ffi::Buffer<ffi::S32> rinv,
                         ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto leaves = GetLeaves("group_reduce", args, rets, /*reduce=*/true, *st,
                          static_cast<int64_t>(recv.element_count()));
  if (leaves.has_error()) return leaves.error();
  const Leaves& L = *leaves;
  const ffi::DataType dt = args.get<ffi::AnyBuffer>(0)->element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16 && dt != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("magi_jax native group_reduce takes bf16, f16, f32");
  }
  const int64_t row_bytes = L.off[L.n];
  if (auto e = CheckStage(*st, row_bytes); !e.success()) return e;
  if (auto e = CheckSendTable(*st, send); !e.success()) return e;
  const int64_t T_rows = Rows(**rets.get<ffi::AnyBuffer>(0));
  const int recv_blocks = RecvBlocks(*st, T_rows);
  // The send side reads the buffer's rows (L.src) through rinv.
  Plan P = MakePlan(*st, /*reverse=*/true, row_bytes,
                    static_cast<int64_t>(recv.element_count()));
  const int grid = P.send_blocks + recv_blocks;
  const bool narrow = st->out_input_dtype;
#define MAGI_REDUCE(T, OutT)                                                        \
  ReduceKernel<T, OutT><<<grid, kThreads, 0, stream>>>(P, L, rinv.typed_data(),     \
                                                       inv.typed_data(),            \
                                                       where.typed_data(), T_rows,  \
                                                       recv_blocks)
  switch (dt) {
    case ffi::DataType::BF16:
      if (narrow) {
        MAGI_REDUCE(__nv_bfloat16, __nv_bfloat16);
      } else {
        MAGI_REDUCE(__nv_bfloat16, float);
      }
      break;
    case ffi::DataType::F16:
      if (narrow) {
        MAGI_REDUCE(__half, __half);
      } else {
        MAGI_REDUCE(__half, float);
      }
      break;
    default:
      MAGI_REDUCE(float, float);
      break;
  }
#undef MAGI_REDUCE
  return LaunchError("group_reduce");
}

}  // namespace

// ---- FFI symbols -----------------------------------------------------------------------

#define MAGI_INSTANTIATE_BINDING                   \
  ffi::Ffi::BindInstantiate()                      \
      .Attr<int64_t>("cp")                         \
      .Attr<ffi::Span<const int64_t>>("shifts")    \
      .Attr<int64_t>("call_id")                    \
      .Attr<int64_t>("timeout_ms")                 \
      .Attr<ffi::Span<const int64_t>>("widths")    \
      .Attr<int64_t>("slot_len")                   \
      .Attr<int64_t>("rows_per_chunk")             \
      .Attr<int64_t>("send_blocks")                \
      .Attr<int64_t>("recv_blocks")                \
      .Attr<int64_t>("mode")                       \
      .Attr<bool>("double_buffer")                 \
      .Attr<bool>("prefix")                        \
      .Attr<bool>("ce_prefix")

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupCastCudaInstantiate, Instantiate,
                              MAGI_INSTANTIATE_BINDING);

namespace {
ffi::ErrorOr<std::unique_ptr<CollectiveState>> InstantiateReduce(
    int64_t cp, ffi::Span<const int64_t> shifts, int64_t call_id, int64_t timeout_ms,
    ffi::Span<const int64_t> widths, int64_t slot_len, int64_t rows_per_chunk,
    int64_t send_blocks, int64_t recv_blocks, int64_t mode, bool double_buffer, bool prefix,
    bool ce_prefix, bool accumulate, bool out_input_dtype) {
  auto st = Instantiate(cp, shifts, call_id, timeout_ms, widths, slot_len, rows_per_chunk,
                        send_blocks, recv_blocks, mode, double_buffer, prefix, ce_prefix);
  if (st.has_value()) {
    (*st)->accumulate = accumulate;
    (*st)->out_input_dtype = out_input_dtype;
  }
  return st;
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceCudaInstantiate, InstantiateReduce,
                              MAGI_INSTANTIATE_BINDING.Attr<bool>("accumulate")
                                  .Attr<bool>("out_input_dtype"));

// Cast: send, recv, where, then the arrays x_0.. (RemainingArgs); outputs out_0..
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupCastCudaExecute, CastExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::State<CollectiveState>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

// Reduce: send, recv, where, inv, rinv, then the arrays y_0.. and (accumulate) their initial
// sums acc_0.. (RemainingArgs); float32 outputs out_0..
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceCudaExecute, ReduceExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::State<CollectiveState>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

// ---- bootstrap (ctypes, magi_jax/native.py) --------------------------------------------

extern "C" {

void* MagiNvStateTypeId() { return &CollectiveState::id; }
void* MagiNvStateTypeInfo() { return &g_state_info; }

int magi_nv_uid_size() { return static_cast<int>(sizeof(nvshmemx_uniqueid_t)); }

int magi_nv_get_uid(void* out) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  int rc = nvshmemx_get_uniqueid(&id);
  std::memcpy(out, &id, sizeof(id));
  return rc;
}

static int Fail(char* err, int len, const std::string& msg, int rc) {
  std::snprintf(err, len, "%s", msg.c_str());
  return rc;
}

int magi_nv_init(const char* uid, int rank, int npes, size_t stage_bytes, size_t n_flags,
                 char* err, int err_len) {
  if (g.ready) return Fail(err, err_len, "already initialized", 1);
  int dev = 0;
  cudaGetDevice(&dev);
  cudaSetDevice(dev);
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid, sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int rc = nvshmemx_set_attr_uniqueid_args(rank, npes, &id, &attr);
  if (rc) return Fail(err, err_len, "nvshmemx_set_attr_uniqueid_args failed", rc);
  rc = nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  if (rc) return Fail(err, err_len, "nvshmemx_init_attr failed", rc);
  g.me = nvshmem_my_pe();
  g.npes = nvshmem_n_pes();
  if (g.me != rank || g.npes != npes) {
    return Fail(err, err_len, "NVSHMEM PE numbering differs from the JAX process index", 2);
  }
  g.stage_bytes = stage_bytes;
  g.n_flags = n_flags;
  g.stage = static_cast<char*>(nvshmem_malloc(stage_bytes > 0 ? stage_bytes : 16));
  g.flags = static_cast<uint64_t*>(nvshmem_calloc(n_flags, sizeof(uint64_t)));
  g.acks = static_cast<uint64_t*>(nvshmem_calloc(npes, sizeof(uint64_t)));
  if (!g.stage || !g.flags || !g.acks) {
    return Fail(err, err_len,
                "nvshmem_malloc of " + std::to_string(stage_bytes) +
                    " bytes failed: leave GPU memory for it (XLA_PYTHON_CLIENT_MEM_FRACTION) "
                    "and raise NVSHMEM_SYMMETRIC_SIZE",
                3);
  }
  if (cudaMalloc(&g.done, sizeof(unsigned int)) != cudaSuccess ||
      cudaMemset(g.done, 0, sizeof(unsigned int)) != cudaSuccess) {
    return Fail(err, err_len, "cudaMalloc failed", 4);
  }
  // Every PE in NVSHMEM_TEAM_SHARED is reachable with loads and stores (nvshmem_ptr).
  g.all_mapped = nvshmem_team_n_pes(NVSHMEM_TEAM_SHARED) == npes;
  g.epoch = 0;
  g.prev_lo = g.prev_hi = 0;
  g.prev_top = true;
  cudaDeviceSynchronize();
  nvshmem_barrier_all();
  g.ready = true;
  return 0;
}

// 1 when every PE is load/store reachable (the pull mode can run), 0 if not, -1 before init.
int magi_nv_all_mapped() { return g.ready ? (g.all_mapped ? 1 : 0) : -1; }

int magi_nv_finalize() {
  if (!g.ready) return 0;
  g.ready = false;
  cudaDeviceSynchronize();
  nvshmem_barrier_all();
  nvshmem_free(g.stage);
  nvshmem_free(g.flags);
  nvshmem_free(g.acks);
  cudaFree(g.done);
  if (g.side != nullptr) {
    cudaStreamDestroy(g.side);
    cudaEventDestroy(g.fork);
    cudaEventDestroy(g.join);
    g.side = nullptr;
  }
  nvshmem_finalize();
  return 0;
}

}  // extern "C"
