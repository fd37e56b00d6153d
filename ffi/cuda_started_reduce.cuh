// Started group-reduces of the native collectives (magi_jax/sharding/native/,
// group_reduce_start): their start and done handlers and FFI symbols. Part of the one
// translation unit cuda_group_collectives.cu, which defines the state they use (the lane,
// cuda_state.cuh).
//
// A reduce can be split in two calls so that XLA runs other kernels between them: the start
// queues, on a high-priority side stream forked from XLA's, copies of the rows to send
// (contiguous runs of the receive table, known on the host and passed as an attribute) straight
// into the owners' staging by a kernel of a few blocks (CopyKernel: they take their SMs first
// and leave the rest to the kernel XLA runs next, e.g. the dQ kernel), then raises a 32-bit
// flag per slot on the owner with a stream memory write (a system-scope fence comes first). The
// staging is planar (each array's rows in a block of their own), so that every run of every
// array is one contiguous copy. The done call makes XLA's stream wait for the side stream (the
// start's inputs stay in use until then: the done call takes them too) and runs the reduce
// kernel's receive blocks, which wait for the slot flags and sum as a synchronous reduce does.
//
// Started reduces have their own lane: staging, flags, acknowledgements and epochs of their
// own, so the synchronous collectives that XLA may place between a start and its done never
// wait for, or overwrite, anything of it. Within the lane, calls are serial. A done kernel
// ends only when every PE has acknowledged its epoch (its last block waits), so a start queued
// after the previous done on XLA's stream writes the peers' staging at once; a start queued
// while another started reduce is in flight first waits (on the side stream, with a stream
// memory wait) for every PE's acknowledgement of it. Done calls must come in the order of
// their starts.

#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <nvshmem.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "cuda_group_kernels.cuh"
#include "cuda_host.cuh"
#include "cuda_plan.cuh"
#include "cuda_state.cuh"
#include "ffi_attrs.h"

namespace ffi = xla::ffi;

namespace {

// Start of a started reduce: recv, where, then the arrays y_0.. (the synchronous reduce's
// inputs); writes nothing to its token, which only orders the done call after it.
ffi::Error StartExecute(cudaStream_t stream, CollectiveState* st, ffi::Buffer<ffi::S32> recv,
                        ffi::Buffer<ffi::S32> where, ffi::RemainingArgs args,
                        ffi::Result<ffi::Buffer<ffi::S32>> token) {
  (void)where;
  (void)token;
  if (lane.stage == nullptr || !g.all_mapped) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
        "magi_jax native group_reduce_start: started reduces need their own staging "
        "(magi_jax.native.initialize(started_bytes > 0)) and every PE load/store reachable");
  }
  const int64_t B = static_cast<int64_t>(recv.element_count());
  const size_t n = args.size();
  if (n < 1 || n > static_cast<size_t>(kMaxLeaves)) {
    return ffi::Error::InvalidArgument("magi_jax native group_reduce_start: 1 to " +
                                       std::to_string(kMaxLeaves) + " arrays");
  }
  Pending pend{st->call_id, 0, 0, {}};
  int64_t bytes[kMaxLeaves], off[kMaxLeaves + 1] = {0};
  for (size_t l = 0; l < n; ++l) {
    auto y = args.get<ffi::AnyBuffer>(l);
    if (y.has_error()) return y.error();
    if (auto e = CheckReduceDtype(y->element_type()); !e.success()) return e;
    bytes[l] = RowBytes(*y);
    const int64_t own = Rows(*y) - B;  // the owner's own rows come first with prefix
    if (own < 0 || (!st->prefix && own != 0)) {
      return ffi::Error::InvalidArgument(
          "magi_jax native group_reduce_start: array " + std::to_string(l) + " has " +
          std::to_string(Rows(*y)) + " rows for " + std::to_string(B) + " buffer rows");
    }
    pend.src[l] = static_cast<const char*>(y->untyped_data()) + own * bytes[l];
    off[l + 1] = off[l] + bytes[l];
  }
  const int64_t row_bytes = off[n];
  const size_t need = static_cast<size_t>(st->n) * st->slot_len * row_bytes;
  if (need > lane.stage_bytes) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
        "magi_jax native group_reduce_start: the reduce stages " + std::to_string(need) +
        " bytes but only " + std::to_string(lane.stage_bytes) + " were reserved for started "
        "reduces (magi_jax.native.initialize(started_bytes=...))");
  }
  if (lane.pending.size() >= static_cast<size_t>(kMaxPending)) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
        "magi_jax native: more than " + std::to_string(kMaxPending) +
        " started reduces without their done calls");
  }
  const uint32_t epoch = ++lane.epoch;
  pend.epoch = epoch;
  pend.event = static_cast<int>(epoch % (kMaxPending + 1));
  cudaEventRecord(lane.fork, stream);  // the rows to send are ready
  cudaStreamWaitEvent(lane.side, lane.fork, 0);
  // Every PE has summed the previous started reduce out of its staging: its done kernel,
  // queued before the fork, ended after every PE's acknowledgement, unless it is still to come.
  for (int q = 0; q < g.npes && epoch > 1 && !lane.pending.empty(); ++q) {
    if (lane.wait32(lane.side, reinterpret_cast<CUdeviceptr>(lane.acks + q), epoch - 1,
                    CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
      return ffi::Error::Internal("magi_jax native group_reduce_start: cuStreamWaitValue32");
    }
  }
  const int64_t S = st->slot_len;
  bool used[kMaxSlots] = {};
  CopyList copies{};
  for (size_t i = 0; i + 2 < st->runs.size(); i += 3) {
    const int64_t b0 = st->runs[i], e0 = st->runs[i + 1], len = st->runs[i + 2];
    const int64_t j = e0 / S;
    if (b0 < 0 || e0 < 0 || len < 1 || b0 + len > B || j >= st->n || (e0 + len - 1) / S != j) {
      return ffi::Error::InvalidArgument(
          "magi_jax native group_reduce_start: run (" + std::to_string(b0) + ", " +
          std::to_string(e0) + ", " + std::to_string(len) + ") is outside the tables");
    }
    const int peer = ((g.me - st->shifts[j]) % st->cp + st->cp) % st->cp;
    char* base = static_cast<char*>(nvshmem_ptr(lane.stage, peer));
    for (size_t l = 0; l < n; ++l) {  // planar staging: leaf l's block starts at n*S*off[l]
      if (copies.n == kCopySegments) {  // a full list goes now; the next one follows it
        CopyKernel<<<kCopyBlocks, kCopyThreads, 0, lane.side>>>(copies);
        copies.n = 0;
      }
      copies.dst[copies.n] = base + st->n * S * off[l] + e0 * bytes[l];
      copies.src[copies.n] = pend.src[l] + b0 * bytes[l];
      copies.bytes[copies.n++] = len * bytes[l];
    }
    used[j] = true;
  }
  if (copies.n > 0) CopyKernel<<<kCopyBlocks, kCopyThreads, 0, lane.side>>>(copies);
  for (int j = 0; j < st->n; ++j) {
    if (!used[j]) continue;
    const int peer = ((g.me - st->shifts[j]) % st->cp + st->cp) % st->cp;
    void* flag = nvshmem_ptr(lane.flags + j, peer);
    if (lane.write32(lane.side, reinterpret_cast<CUdeviceptr>(flag), epoch,
                     CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
      return ffi::Error::Internal("magi_jax native group_reduce_start: cuStreamWriteValue32");
    }
  }
  cudaEventRecord(lane.sent[pend.event], lane.side);
  lane.pending.push_back(pend);
  return LaunchError("group_reduce_start");
}

// Done of a started reduce: the start's token, then the synchronous reduce's arguments.
ffi::Error DoneExecute(cudaStream_t stream, CollectiveState* st, ffi::Buffer<ffi::S32> token,
                       ffi::Buffer<ffi::S32> send, ffi::Buffer<ffi::S32> recv,
                       ffi::Buffer<ffi::S32> where, ffi::Buffer<ffi::S32> inv,
                       ffi::Buffer<ffi::S32> rinv, ffi::RemainingArgs args,
                       ffi::RemainingRets rets) {
  (void)token;
  (void)send;
  auto leaves = GetLeaves("group_reduce_done", args, rets, /*reduce=*/true, *st,
                          static_cast<int64_t>(recv.element_count()));
  if (leaves.has_error()) return leaves.error();
  const Leaves& L = *leaves;
  const ffi::DataType dt = args.get<ffi::AnyBuffer>(0)->element_type();
  if (auto e = CheckReduceDtype(dt); !e.success()) return e;
  if (lane.pending.empty() || lane.pending.front().call_id != st->call_id) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
        "magi_jax native group_reduce_done: no started reduce of this call site is the oldest "
        "one in flight (the done calls must come in the order of their starts)");
  }
  const Pending pend = lane.pending.front();
  lane.pending.pop_front();
  for (int l = 0; l < L.n; ++l) {
    if (L.src[l] != pend.src[l]) {
      return ffi::Error::Internal(
          "magi_jax native group_reduce_done: array " + std::to_string(l) + " is not the "
          "buffer its start is sending (XLA placed a copy between the two calls)");
    }
  }
  cudaStreamWaitEvent(stream, lane.sent[pend.event], 0);  // our copies are done
  Plan P{};
  P.me = g.me;
  P.cp = st->cp;
  P.n = st->n;
  P.mode = kPush;
  P.S = st->slot_len;
  P.R = std::max<int64_t>(1, st->slot_len);
  P.row_bytes = L.off[L.n];
  for (int j = 0; j < st->n; ++j) {
    P.recv_from[j] = ((g.me + st->shifts[j]) % st->cp + st->cp) % st->cp;
    P.send_to[j] = ((g.me - st->shifts[j]) % st->cp + st->cp) % st->cp;
    P.widths[j] = st->widths[j];
  }
  for (int j = 0; j <= st->n; ++j) P.chunk_base[j] = st->chunk_base[j];
  P.send_blocks = 0;
  P.src_rows = static_cast<int64_t>(recv.element_count());
  P.epoch = pend.epoch;
  P.timeout_ns = st->timeout_ns;
  P.stage = lane.stage;
  P.done = lane.done;
  P.slot_flags = lane.flags;
  P.slot_acks = lane.acks;
  return LaunchReduce(stream, *st, P, L, dt, rinv, inv, where, rets);
}

// A start keeps this PE's runs of `runs` (triples; PE q's are [run_offsets[q],
// run_offsets[q + 1])): every process compiles the same program, so the attribute holds all.
ffi::ErrorOr<std::unique_ptr<CollectiveState>> InstantiateStart(
    int64_t cp, ffi::Span<const int64_t> shifts, int64_t call_id, int64_t timeout_ms,
    ffi::Span<const int64_t> widths, int64_t slot_len, int64_t rows_per_chunk,
    int64_t send_blocks, int64_t recv_blocks, int64_t mode, bool double_buffer, bool prefix,
    ffi::Span<const int64_t> runs, ffi::Span<const int64_t> run_offsets) {
  auto st = Instantiate(cp, shifts, call_id, timeout_ms, widths, slot_len, rows_per_chunk,
                        send_blocks, recv_blocks, mode, double_buffer, prefix);
  if (!st.has_value()) return st;
  if (run_offsets.size() != static_cast<size_t>(cp + 1) ||
      run_offsets[cp] != static_cast<int64_t>(runs.size())) {
    return ffi::Error::InvalidArgument(
        "magi_jax native group_reduce_start: run_offsets must hold cp + 1 offsets into runs");
  }
  (*st)->runs.assign(runs.begin() + run_offsets[g.me], runs.begin() + run_offsets[g.me + 1]);
  return st;
}

}  // namespace

// Attributes: ffi_attrs.h.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceStartCudaInstantiate, InstantiateStart,
                              ffi::Ffi::BindInstantiate() MAGI_CUDA_START_ATTRS);

// Started reduce: recv, where, then the arrays y_0.. (RemainingArgs); a token output.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceStartCudaExecute, StartExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::State<CollectiveState>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// Its done call: the token, then the arguments of the reduce above (same attributes).
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceDoneCudaInstantiate, InstantiateReduce,
                              ffi::Ffi::BindInstantiate() MAGI_CUDA_REDUCE_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceDoneCudaExecute, DoneExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::State<CollectiveState>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
