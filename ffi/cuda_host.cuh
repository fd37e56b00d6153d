// The host side that the synchronous collectives (cuda_group_collectives.cu) and the
// started reduces (cuda_started_reduce.cuh) share: a call site's instantiation, the checks
// of a call's arrays, the launch of the reduce kernel. Part of the one translation unit
// cuda_group_collectives.cu, which defines the state it reads (`g`, cuda_state.cuh).

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "cuda_group_kernels.cuh"
#include "cuda_plan.cuh"
#include "cuda_state.cuh"

namespace ffi = xla::ffi;

namespace {

// ---- instantiation (per call site) -----------------------------------------------------

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

// ---- the arrays of a call --------------------------------------------------------------

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

// The checks of a reduce's inputs shared by the synchronous and the started reduce.
ffi::Error CheckReduceDtype(ffi::DataType dt) {
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16 && dt != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("magi_jax native group_reduce takes bf16, f16, f32");
  }
  return ffi::Error::Success();
}

// ---- launch ----------------------------------------------------------------------------

ffi::Error LaunchError(const char* op) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return ffi::Error::Internal(std::string("magi_jax native ") + op + ": " +
                                cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

// Receive blocks: no more than one warp per row needs.
int RecvBlocks(const CollectiveState& st, int64_t rows) {
  const int64_t need = std::max<int64_t>(1, (rows + kWarps - 1) / kWarps);
  return static_cast<int>(std::min<int64_t>(st.recv_blocks, need));
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
