// CUDA handlers of the native group collectives over NVSHMEM (magi_jax/native.py).
//
// One process per GPU; rank r of the cp axis is NVSHMEM PE r. Tables of rank r as in
// magi_jax/sharding/collectives.py: send [n, S] (local row or -1), recv [B] (j*S + p or -1).
//
// One kernel per collective, two kinds of blocks:
//  * send blocks walk the chunks of their slots (R consecutive slot positions p of one
//    slot j) and write each real row straight into the peer's symmetric staging buffer at
//    position j*S + p (through the NVLink mapping from nvshmem_ptr; nvshmem puts where the
//    peer is not mapped), then raise that chunk's flag on the peer (NVSHMEM signal, value =
//    this call's epoch).
//  * receive blocks wait for the flags of the rows they need and
//      cast:   copy staging[recv[b]] into out[b] (x's dtype), zeros for padding rows;
//      reduce: sum, in float32 and in slot order, the staged rows of every slot that holds
//              a row t of this rank (inv[t, j] = p) into out[t] (+ acc[t]).
// Direction: a cast sends slot j to r + shift_j; a reduce sends slot j back to r - shift_j.
//
// Reuse of the staging buffer: the last receive block of a call tells every peer "I have
// read my staging for epoch e" (ack, value e); a send block writes to a peer only once that
// peer has acknowledged epoch e - 1. Epochs count the native collectives of this process;
// every process of an SPMD program runs the same sequence, so they agree without talking.
// No host synchronisation anywhere: the host only bumps the epoch and launches the kernel on
// XLA's stream. A wait that exceeds the timeout prints which peer/flag it waited for and
// traps (the JAX program then fails) instead of hanging.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

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

// ---- process-wide NVSHMEM context ------------------------------------------------------

struct Context {
  bool ready = false;
  int me = 0, npes = 0;
  char* stage = nullptr;  // symmetric staging rows
  size_t stage_bytes = 0;
  uint64_t* flags = nullptr;  // symmetric [n_flags]: chunk arrival, value = epoch
  size_t n_flags = 0;
  uint64_t* acks = nullptr;  // symmetric [npes]: acks[q] = last epoch q finished reading
  unsigned int* done = nullptr;  // device counter of finished receive blocks
  uint64_t epoch = 0;            // host: native collectives enqueued so far
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
  int64_t timeout_ns = 0;
};
ffi::TypeId CollectiveState::id = XLA_FFI_UNKNOWN_TYPE_ID;
XLA_FFI_TypeInfo g_state_info = ffi::MakeTypeInfo<CollectiveState>();

// What one kernel launch needs (passed by value).
struct Plan {
  int me, cp, n;
  int64_t S, R, row_bytes;
  int send_to[kMaxSlots];    // PE that slot j's rows are written to
  int recv_from[kMaxSlots];  // PE that slot j's rows come from (for messages)
  int chunk_base[kMaxSlots + 1];
  int widths[kMaxSlots];
  int send_blocks;
  uint64_t epoch;
  int64_t timeout_ns;
  char* stage;
  uint64_t* flags;
  uint64_t* acks;
  unsigned int* done;
};

// ---- device helpers --------------------------------------------------------------------

__device__ __forceinline__ uint64_t NowNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

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

// Copies `bytes` from src to dst with one warp (16-byte accesses when aligned).
__device__ __forceinline__ void WarpCopy(char* dst, const char* src, int64_t bytes, int lane) {
  if ((bytes & 15) == 0 && ((reinterpret_cast<uintptr_t>(dst) |
                             reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    int64_t n = bytes >> 4;
    int64_t i = lane;
    for (; i + 96 < n; i += 128) {  // 4 loads in flight per lane
      int4 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
      d[i] = a; d[i + 32] = b; d[i + 64] = c; d[i + 96] = e;
    }
    for (; i < n; i += 32) d[i] = s[i];
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = src[i];
  }
}

__device__ __forceinline__ void WarpZero(char* dst, int64_t bytes, int lane) {
  if ((bytes & 15) == 0 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    int4 z = make_int4(0, 0, 0, 0);
    for (int64_t i = lane; i < (bytes >> 4); i += 32) reinterpret_cast<int4*>(dst)[i] = z;
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = 0;
  }
}

__device__ __forceinline__ int SlotOfChunk(const Plan& P, int c) {
  int j = 0;
  while (j + 1 < P.n && P.chunk_base[j + 1] <= c) ++j;
  return j;
}

// Send blocks: chunk c of slot j holds positions [c_local*R, min(w_j, (c_local+1)*R)).
// `src_of[j*S + p]` is the local row to send from `data` (-1: nothing).
__device__ void SendChunks(const Plan& P, const char* data, const int32_t* src_of) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ char* remote;
  for (int c = blockIdx.x; c < P.chunk_base[P.n]; c += P.send_blocks) {
    const int j = SlotOfChunk(P, c);
    const int peer = P.send_to[j];
    const int64_t p0 = static_cast<int64_t>(c - P.chunk_base[j]) * P.R;
    const int64_t p1 = min(static_cast<int64_t>(P.widths[j]), p0 + P.R);
    if (threadIdx.x == 0) {
      // The peer must have read its staging for the previous call before we overwrite it.
      WaitAtLeast(P.acks + peer, P.epoch - 1, P.timeout_ns, "acknowledgement", peer, 0);
      remote = static_cast<char*>(nvshmem_ptr(P.stage, peer));
    }
    __syncthreads();
    for (int64_t p = p0 + warp; p < p1; p += kWarps) {
      const int32_t row = src_of[j * P.S + p];
      if (row < 0) continue;
      const int64_t off = (j * P.S + p) * P.row_bytes;
      const char* src = data + row * P.row_bytes;
      if (remote != nullptr) {
        WarpCopy(remote + off, src, P.row_bytes, lane);
      } else {
        nvshmemx_putmem_nbi_warp(P.stage + off, src, P.row_bytes, peer);
      }
    }
    if (remote == nullptr) {
      __syncwarp();
      if (lane == 0) nvshmem_quiet();
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
      nvshmem_fence();
      nvshmemx_signal_op(P.flags + c, P.epoch, NVSHMEM_SIGNAL_SET, peer);
    }
    __syncthreads();
  }
}

// The last receive block to finish tells every peer that this PE's staging is free again.
__device__ void Acknowledge(const Plan& P, int recv_blocks) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned int prev = atomicAdd(P.done, 1u);
    if (prev == static_cast<unsigned int>(recv_blocks - 1)) {
      *P.done = 0;
      __threadfence();
      for (int q = 0; q < P.cp; ++q) {
        nvshmemx_signal_op(P.acks + P.me, P.epoch, NVSHMEM_SIGNAL_SET, q);
      }
    }
  }
}

__device__ void CheckRank(const Plan& P, const int32_t* where) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && where[0] != P.me) {
    printf("magi_jax native: this process is NVSHMEM PE %d but rank %d of the cp axis; "
           "the native transport needs rank r on process r\n", P.me, where[0]);
    __trap();
  }
}

__global__ void __launch_bounds__(kThreads)
CastKernel(Plan P, const char* x, const int32_t* send, const int32_t* recv, const int32_t* where,
           char* out, int64_t B, int recv_blocks) {
  CheckRank(P, where);
  if (blockIdx.x < P.send_blocks) {
    SendChunks(P, x, send);
    return;
  }
  const int rb = blockIdx.x - P.send_blocks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t b = static_cast<int64_t>(rb) * kWarps + warp; b < B;
       b += static_cast<int64_t>(recv_blocks) * kWarps) {
    const int32_t e = recv[b];
    char* dst = out + b * P.row_bytes;
    if (e < 0) {
      WarpZero(dst, P.row_bytes, lane);
      continue;
    }
    const int j = e / P.S;
    const int c = P.chunk_base[j] + static_cast<int>((e % P.S) / P.R);
    if (lane == 0) WaitAtLeast(P.flags + c, P.epoch, P.timeout_ns, "rows of chunk",
                               P.recv_from[j], c);
    __syncwarp();
    __threadfence();
    WarpCopy(dst, P.stage + static_cast<int64_t>(e) * P.row_bytes, P.row_bytes, lane);
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

// out[t] = (acc[t] or 0) + sum_j staged[j*S + inv[t, j]], j ascending (float32).
template <typename T>
__global__ void __launch_bounds__(kThreads)
ReduceKernel(Plan P, const char* y, const int32_t* rinv, const int32_t* inv,
             const int32_t* where, const float* acc, float* out, int64_t T_rows, int64_t F,
             int recv_blocks) {
  CheckRank(P, where);
  if (blockIdx.x < P.send_blocks) {
    SendChunks(P, y, rinv);
    return;
  }
  const int rb = blockIdx.x - P.send_blocks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* staged = reinterpret_cast<const T*>(P.stage);
  for (int64_t t = static_cast<int64_t>(rb) * kWarps + warp; t < T_rows;
       t += static_cast<int64_t>(recv_blocks) * kWarps) {
    const int32_t* my_inv = inv + t * P.n;
    if (lane == 0) {
      for (int j = 0; j < P.n; ++j) {
        const int32_t p = my_inv[j];
        if (p < 0) continue;
        const int c = P.chunk_base[j] + static_cast<int>(p / P.R);
        WaitAtLeast(P.flags + c, P.epoch, P.timeout_ns, "rows of chunk", P.recv_from[j], c);
      }
    }
    __syncwarp();
    __threadfence();
    float* o = out + t * F;
    const float* a = acc ? acc + t * F : nullptr;
    constexpr int V = 16 / sizeof(T);  // elements per 16-byte load
    if (F % V == 0) {
      for (int64_t f = static_cast<int64_t>(lane) * V; f < F; f += 32 * V) {
        float s[V];
#pragma unroll
        for (int k = 0; k < V; ++k) s[k] = a ? a[f + k] : 0.f;
        for (int j = 0; j < P.n; ++j) {
          const int32_t p = my_inv[j];
          if (p < 0) continue;
          int4 raw = *reinterpret_cast<const int4*>(staged + (j * P.S + p) * F + f);
          const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
          for (int k = 0; k < V; ++k) s[k] += ToF32<T>(v[k]);
        }
#pragma unroll
        for (int k = 0; k < V; k += 4) {
          *reinterpret_cast<float4*>(o + f + k) = make_float4(s[k], s[k + 1], s[k + 2], s[k + 3]);
        }
      }
    } else {
      for (int64_t f = lane; f < F; f += 32) {
        float s = a ? a[f] : 0.f;
        for (int j = 0; j < P.n; ++j) {
          const int32_t p = my_inv[j];
          if (p >= 0) s += ToF32<T>(staged[(j * P.S + p) * F + f]);
        }
        o[f] = s;
      }
    }
  }
  Acknowledge(P, recv_blocks);
}

// ---- host side -------------------------------------------------------------------------

ffi::ErrorOr<std::unique_ptr<CollectiveState>> Instantiate(
    int64_t cp, ffi::Span<const int64_t> shifts, int64_t call_id, int64_t timeout_ms,
    ffi::Span<const int64_t> widths, int64_t slot_len, int64_t rows_per_chunk,
    int64_t send_blocks, int64_t recv_blocks) {
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
  auto st = std::make_unique<CollectiveState>();
  st->cp = static_cast<int>(cp);
  st->n = static_cast<int>(shifts.size());
  st->slot_len = slot_len;
  st->rows_per_chunk = rows_per_chunk < 1 ? 1 : rows_per_chunk;
  st->send_blocks = static_cast<int>(send_blocks);
  st->recv_blocks = static_cast<int>(recv_blocks);
  st->timeout_ns = timeout_ms * 1000000;
  st->chunk_base[0] = 0;
  for (int j = 0; j < st->n; ++j) {
    st->shifts[j] = static_cast<int>(shifts[j]);
    st->widths[j] = static_cast<int>(widths[j]);
    st->chunk_base[j + 1] =
        st->chunk_base[j] + static_cast<int>((widths[j] + st->rows_per_chunk - 1) /
                                             st->rows_per_chunk);
  }
  if (static_cast<size_t>(st->chunk_base[st->n]) > g.n_flags) {
    return ffi::Error::InvalidArgument("magi_jax native: more chunks than flags");
  }
  return ffi::ErrorOr<std::unique_ptr<CollectiveState>>(std::move(st));
}

Plan MakePlan(const CollectiveState& st, bool reverse, int64_t row_bytes) {
  Plan P;
  P.me = g.me;
  P.cp = st.cp;
  P.n = st.n;
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
  P.send_blocks = st.send_blocks;
  P.epoch = ++g.epoch;
  P.timeout_ns = st.timeout_ns;
  P.stage = g.stage;
  P.flags = g.flags;
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

ffi::Error CastExecute(cudaStream_t stream, CollectiveState* st, ffi::AnyBuffer x,
                       ffi::Buffer<ffi::S32> send, ffi::Buffer<ffi::S32> recv,
                       ffi::Buffer<ffi::S32> where, ffi::Result<ffi::AnyBuffer> out) {
  const int64_t row_bytes = RowBytes(x);
  if (auto e = CheckStage(*st, row_bytes); !e.success()) return e;
  const int64_t B = static_cast<int64_t>(recv.element_count());
  Plan P = MakePlan(*st, /*reverse=*/false, row_bytes);
  CastKernel<<<st->send_blocks + st->recv_blocks, kThreads, 0, stream>>>(
      P, static_cast<const char*>(x.untyped_data()), send.typed_data(), recv.typed_data(),
      where.typed_data(), static_cast<char*>(out->untyped_data()), B, st->recv_blocks);
  return LaunchError("group_cast");
}

ffi::Error ReduceExecute(cudaStream_t stream, CollectiveState* st, ffi::AnyBuffer y,
                         ffi::Buffer<ffi::S32> send, ffi::Buffer<ffi::S32> recv,
                         ffi::Buffer<ffi::S32> where, ffi::AnyBuffer acc,
                         ffi::Buffer<ffi::S32> inv, ffi::Buffer<ffi::S32> rinv,
                         ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const int64_t row_bytes = RowBytes(y);
  if (auto e = CheckStage(*st, row_bytes); !e.success()) return e;
  auto odims = out->dimensions();
  const int64_t T_rows = odims.size() ? odims[0] : 0;
  const int64_t F = T_rows ? static_cast<int64_t>(out->element_count()) / T_rows : 0;
  const float* acc_ptr = acc.element_count() ? static_cast<const float*>(acc.untyped_data())
                                             : nullptr;
  Plan P = MakePlan(*st, /*reverse=*/true, row_bytes);
  const int grid = st->send_blocks + st->recv_blocks;
  const char* yp = static_cast<const char*>(y.untyped_data());
  switch (y.element_type()) {
    case ffi::DataType::BF16:
      ReduceKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
          P, yp, rinv.typed_data(), inv.typed_data(), where.typed_data(), acc_ptr,
          out->typed_data(), T_rows, F, st->recv_blocks);
      break;
    case ffi::DataType::F16:
      ReduceKernel<__half><<<grid, kThreads, 0, stream>>>(
          P, yp, rinv.typed_data(), inv.typed_data(), where.typed_data(), acc_ptr,
          out->typed_data(), T_rows, F, st->recv_blocks);
      break;
    case ffi::DataType::F32:
      ReduceKernel<float><<<grid, kThreads, 0, stream>>>(
          P, yp, rinv.typed_data(), inv.typed_data(), where.typed_data(), acc_ptr,
          out->typed_data(), T_rows, F, st->recv_blocks);
      break;
    default:
      --g.epoch;  // nothing was launched
      return ffi::Error::InvalidArgument("magi_jax native group_reduce takes bf16, f16, f32");
  }
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
      .Attr<int64_t>("recv_blocks")

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupCastCudaInstantiate, Instantiate,
                              MAGI_INSTANTIATE_BINDING);

namespace {
ffi::ErrorOr<std::unique_ptr<CollectiveState>> InstantiateReduce(
    int64_t cp, ffi::Span<const int64_t> shifts, int64_t call_id, int64_t timeout_ms,
    ffi::Span<const int64_t> widths, int64_t slot_len, int64_t rows_per_chunk,
    int64_t send_blocks, int64_t recv_blocks, bool /*accumulate*/) {
  return Instantiate(cp, shifts, call_id, timeout_ms, widths, slot_len, rows_per_chunk,
                     send_blocks, recv_blocks);
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceCudaInstantiate, InstantiateReduce,
                              MAGI_INSTANTIATE_BINDING.Attr<bool>("accumulate"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupCastCudaExecute, CastExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::State<CollectiveState>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceCudaExecute, ReduceExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::State<CollectiveState>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

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
  cudaDeviceSynchronize();
  nvshmem_barrier_all();
  g.ready = true;
  return 0;
}

int magi_nv_finalize() {
  if (!g.ready) return 0;
  g.ready = false;
  cudaDeviceSynchronize();
  nvshmem_barrier_all();
  nvshmem_free(g.stage);
  nvshmem_free(g.flags);
  nvshmem_free(g.acks);
  cudaFree(g.done);
  nvshmem_finalize();
  return 0;
}

}  // extern "C"
