// CUDA handlers of the native group collectives over NVSHMEM (magi_jax/sharding/native/).
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
// reduce may round its float32 sums once to the input's dtype (`out_input_dtype`). With
// `own_apart` a reduce's own rows come as arrays of their own; an output XLA aliases to them
// (same dtype, no initial sums) is summed in place, and its rows that receive nothing are
// not touched at all.
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
//
// This file is the one translation unit of the CUDA library: it defines the shared state
// (declared in cuda_state.cuh), the synchronous cast and reduce and their FFI symbols, and
// includes the other parts, each a self-contained header: the launch descriptors
// (cuda_plan.cuh), the kernels (cuda_group_kernels.cuh), the host side shared with the
// started reduces (cuda_host.cuh), reduces started in one call and ended in another
// (group_reduce_start, cuda_started_reduce.cuh) and the ctypes bootstrap
// (cuda_bootstrap.cuh). The FFI attribute lists are in ffi_attrs.h.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "cuda_bootstrap.cuh"
#include "cuda_group_kernels.cuh"
#include "cuda_host.cuh"
#include "cuda_plan.cuh"
#include "cuda_started_reduce.cuh"
#include "cuda_state.cuh"
#include "ffi_attrs.h"

namespace ffi = xla::ffi;

namespace {

// ---- the shared state (cuda_state.cuh), defined once -----------------------------------

Context g;
Lane lane;
ffi::TypeId CollectiveState::id = XLA_FFI_UNKNOWN_TYPE_ID;
XLA_FFI_TypeInfo g_state_info = ffi::MakeTypeInfo<CollectiveState>();

// ---- synchronous cast and reduce -------------------------------------------------------

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
  P.slot_flags = nullptr;
  P.slot_acks = nullptr;
  return P;
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
  const int64_t kernel_rows = prefix_rows + B;
  const int recv_blocks = RecvBlocks(*st, kernel_rows);
  // Group rows per warp only when every warp has several (small casts: all warps busy).
  const int64_t warps = static_cast<int64_t>(recv_blocks) * kWarps;
  const int rows_per_warp = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(kRowsPerWarp, kernel_rows / warps)));
  Plan P = MakePlan(*st, /*reverse=*/false, row_bytes, x_rows);
  CastKernel<<<P.send_blocks + recv_blocks, kThreads, 0, stream>>>(
      P, L, send.typed_data(), recv.typed_data(), where.typed_data(), prefix_rows, B,
      recv_blocks, rows_per_warp);
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
  if (auto e = CheckReduceDtype(dt); !e.success()) return e;
  const int64_t row_bytes = L.off[L.n];
  if (auto e = CheckStage(*st, row_bytes); !e.success()) return e;
  if (auto e = CheckSendTable(*st, send); !e.success()) return e;
  // The send side reads the buffer's rows (L.src) through rinv.
  Plan P = MakePlan(*st, /*reverse=*/true, row_bytes,
                    static_cast<int64_t>(recv.element_count()));
  return LaunchReduce(stream, *st, P, L, dt, rinv, inv, where, rets);
}

}  // namespace

// ---- FFI symbols (attributes: ffi_attrs.h) ---------------------------------------------

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupCastCudaInstantiate, Instantiate,
                              ffi::Ffi::BindInstantiate() MAGI_CUDA_CAST_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceCudaInstantiate, InstantiateReduce,
                              ffi::Ffi::BindInstantiate() MAGI_CUDA_REDUCE_ATTRS);

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

// Reduce: send, recv, where, inv, rinv, then (own_apart) the own rows own_0.., the arrays
// y_0.. and (accumulate) their initial sums acc_0.. (RemainingArgs); outputs out_0..
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
