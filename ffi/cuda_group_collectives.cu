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
// The kernels are in cuda_group_kernels.cuh; reduces started in one call and ended in
// another (group_reduce_start) in cuda_started_reduce.cuh; the ctypes bootstrap in
// cuda_bootstrap.cuh. All are included here, one translation unit.

#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cuda_group_kernels.cuh"

namespace ffi = xla::ffi;

namespace {

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
  bool own_apart = false;        // reduce: the own rows are arrays of their own (prefix)
  int64_t timeout_ns = 0;
  int64_t call_id = 0;           // a started reduce's start and done share it
  std::vector<int64_t> runs;     // started reduce: this PE's (b0, e0, len) runs
};
ffi::TypeId CollectiveState::id = XLA_FFI_UNKNOWN_TYPE_ID;
XLA_FFI_TypeInfo g_state_info = ffi::MakeTypeInfo<CollectiveState>();

// ---- host side -------------------------------------------------------------------------

ffi::ErrorOr<std::unique_ptr<CollectiveState>> Instantiate(
    int64_t cp, ffi::Span<const int64_t> shifts, int64_t call_id, int64_t timeout_ms,
    ffi::Span<const int64_t> widths, int64_t slot_len, int64_t rows_per_chunk,
    int64_t send_blocks, int64_t recv_blocks, int64_t mode, bool double_buffer, bool prefix) {
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
  st->timeout_ns = timeout_ms * 1000000;
  st->call_id = call_id;
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
  P.slot_flags = nullptr;
  P.slot_acks = nullptr;
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
// L.src points past them, at the buffer). With `own_apart` a reduce's own rows come first,
// as arrays of their own (args[0, n), then the buffers args[n, 2n) and the initial sums).
// Checks what the kernels rely on.
ffi::ErrorOr<Leaves> GetLeaves(const char* op, ffi::RemainingArgs args, ffi::RemainingRets rets,
                               bool reduce, const CollectiveState& st, int64_t B) {
  const bool accumulate = reduce && st.accumulate;
  const bool apart = reduce && st.own_apart;
  Leaves L{};
  const size_t n = rets.size();
  const size_t inputs = args.size();
  if (n < 1 || n > static_cast<size_t>(kMaxLeaves) ||
      inputs != n * (1 + apart + accumulate)) {
    return ffi::Error::InvalidArgument(
        std::string("magi_jax native ") + op + ": 1 to " + std::to_string(kMaxLeaves) +
        " arrays, one output each" + (apart ? " and their own rows" : "") +
        (accumulate ? " and one initial sum each" : "") + "; got " + std::to_string(inputs) +
        " inputs and " + std::to_string(n) + " outputs");
  }
  L.in_place = apart && !accumulate;
  L.n = static_cast<int>(n);
  L.aligned = true;
  L.off[0] = 0;
  int64_t rows = -1, out_rows = -1;
  ffi::DataType dtype = ffi::DataType::INVALID;
  for (size_t l = 0; l < n; ++l) {
    auto x = args.get<ffi::AnyBuffer>(apart ? n + l : l);
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
    const int64_t want_rows = B + (st.prefix && !apart ? (reduce ? out_rows : rows) : 0);
    if ((reduce ? rows : out_rows) != want_rows) {
      return ffi::Error::InvalidArgument(
          std::string("magi_jax native ") + op + ": array " + std::to_string(l) + " has " +
          std::to_string(reduce ? rows : out_rows) + (reduce ? " input" : " output") +
          " rows, expected " + std::to_string(want_rows));
    }
    const char* data = static_cast<const char*>(x->untyped_data());
    L.local[l] = reduce && st.prefix && !apart ? data : nullptr;
    L.src[l] = L.local[l] ? data + out_rows * bytes : data;
    L.dst[l] = static_cast<char*>((*o)->untyped_data());
    if (apart) {
      auto own = args.get<ffi::AnyBuffer>(l);
      if (own.has_error()) return own.error();
      if (own->element_type() != dtype || Rows(*own) != out_rows || RowBytes(*own) != bytes) {
        return ffi::Error::InvalidArgument(
            std::string("magi_jax native ") + op + ": own rows " + std::to_string(l) +
            " must be the output's rows of array " + std::to_string(l) + "'s dtype and row");
      }
      L.local[l] = static_cast<const char*>(own->untyped_data());
      L.in_place = L.in_place && L.local[l] == L.dst[l];
    }
    L.acc[l] = nullptr;
    if (accumulate) {
      auto a = args.get<ffi::AnyBuffer>(n * (1 + apart) + l);
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

ffi::Error LaunchReduce(cudaStream_t stream, const CollectiveState& st, const Plan& P,
                        const Leaves& L, ffi::DataType dt, const ffi::Buffer<ffi::S32>& rinv,
                        const ffi::Buffer<ffi::S32>& inv, const ffi::Buffer<ffi::S32>& where,
                        ffi::RemainingRets rets);

// The checks of a reduce's inputs shared by the synchronous and the started reduce.
ffi::Error CheckReduceDtype(ffi::DataType dt) {
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16 && dt != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("magi_jax native group_reduce takes bf16, f16, f32");
  }
  return ffi::Error::Success();
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

ffi::Error LaunchReduce(cudaStream_t stream, const CollectiveState& st, const Plan& P,
                        const Leaves& L, ffi::DataType dt, const ffi::Buffer<ffi::S32>& rinv,
                        const ffi::Buffer<ffi::S32>& inv, const ffi::Buffer<ffi::S32>& where,
                        ffi::RemainingRets rets) {
  const int64_t T_rows = Rows(**rets.get<ffi::AnyBuffer>(0));
  const int recv_blocks = RecvBlocks(st, T_rows);
  const int grid = P.send_blocks + recv_blocks;
  const bool narrow = st.out_input_dtype;
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
      .Attr<bool>("prefix")

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupCastCudaInstantiate, Instantiate,
                              MAGI_INSTANTIATE_BINDING);

namespace {
ffi::ErrorOr<std::unique_ptr<CollectiveState>> InstantiateReduce(
    int64_t cp, ffi::Span<const int64_t> shifts, int64_t call_id, int64_t timeout_ms,
    ffi::Span<const int64_t> widths, int64_t slot_len, int64_t rows_per_chunk,
    int64_t send_blocks, int64_t recv_blocks, int64_t mode, bool double_buffer, bool prefix,
    bool accumulate, bool out_input_dtype, bool own_apart) {
  auto st = Instantiate(cp, shifts, call_id, timeout_ms, widths, slot_len, rows_per_chunk,
                        send_blocks, recv_blocks, mode, double_buffer, prefix);
  if (st.has_value()) {
    (*st)->accumulate = accumulate;
    (*st)->out_input_dtype = out_input_dtype;
    (*st)->own_apart = own_apart;
  }
  return st;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceCudaInstantiate, InstantiateReduce,
                              MAGI_INSTANTIATE_BINDING.Attr<bool>("accumulate")
                                  .Attr<bool>("out_input_dtype")
                                  .Attr<bool>("own_apart"));

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

#include "cuda_started_reduce.cuh"
#include "cuda_bootstrap.cuh"
