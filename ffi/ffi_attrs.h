// The FFI attributes of the native group collectives, each list written once for the CPU
// handlers (cpu_group_collectives.cc) and the CUDA ones (cuda_group_collectives.cu and its
// parts). The Python side passes them by name; XLA hands them to a handler as parameters in
// the order of its binding, so every handler's parameters follow the order of these lists.
// Each macro continues a binding: `ffi::Ffi::Bind()...MAGI_CPU_CAST_ATTRS` or
// `ffi::Ffi::BindInstantiate() MAGI_CUDA_CAST_ATTRS`.

#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

// Every collective: the cp axis, each slot's shift, the call site, the timeout.
#define MAGI_GROUP_ATTRS                                 \
  .Attr<int64_t>("cp")                                   \
      .Attr<::xla::ffi::Span<const int64_t>>("shifts")   \
      .Attr<int64_t>("call_id")                          \
      .Attr<int64_t>("timeout_ms")

// The CUDA handlers' slot layout and tuning (their instantiation), between the above and
// `prefix`.
#define MAGI_CUDA_TUNING_ATTRS                           \
  .Attr<::xla::ffi::Span<const int64_t>>("widths")       \
      .Attr<int64_t>("slot_len")                         \
      .Attr<int64_t>("rows_per_chunk")                   \
      .Attr<int64_t>("send_blocks")                      \
      .Attr<int64_t>("recv_blocks")                      \
      .Attr<int64_t>("mode")                             \
      .Attr<bool>("double_buffer")

// A reduce's options after `prefix`; a started reduce's done call takes the same.
#define MAGI_REDUCE_OPTION_ATTRS                         \
  .Attr<bool>("accumulate")                              \
      .Attr<bool>("out_input_dtype")                     \
      .Attr<bool>("own_apart")

// A started reduce's runs of the receive table: triples (b0, e0, len), PE q's at
// [run_offsets[q], run_offsets[q + 1]).
#define MAGI_RUNS_ATTRS                                  \
  .Attr<::xla::ffi::Span<const int64_t>>("runs")         \
      .Attr<::xla::ffi::Span<const int64_t>>("run_offsets")

// CPU: cast; reduce and its done call; the start of a started reduce.
#define MAGI_CPU_CAST_ATTRS MAGI_GROUP_ATTRS.Attr<bool>("prefix")
#define MAGI_CPU_REDUCE_ATTRS MAGI_CPU_CAST_ATTRS MAGI_REDUCE_OPTION_ATTRS
#define MAGI_CPU_START_ATTRS .Attr<int64_t>("cp").Attr<int64_t>("slot_len") MAGI_RUNS_ATTRS

// CUDA (instantiation): cast; reduce and its done call; the start of a started reduce.
#define MAGI_CUDA_CAST_ATTRS MAGI_GROUP_ATTRS MAGI_CUDA_TUNING_ATTRS.Attr<bool>("prefix")
#define MAGI_CUDA_REDUCE_ATTRS MAGI_CUDA_CAST_ATTRS MAGI_REDUCE_OPTION_ATTRS
#define MAGI_CUDA_START_ATTRS MAGI_CUDA_CAST_ATTRS MAGI_RUNS_ATTRS
