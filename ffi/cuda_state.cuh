// The host state that the parts of the CUDA group collectives share: the process-wide
// NVSHMEM context (g), the lane of started reduces (lane), and each call site's state
// (CollectiveState, FFI instantiate). The objects are declared here and defined once, in
// cuda_group_collectives.cu: the handlers, the started reduces (cuda_started_reduce.cuh)
// and the bootstrap (cuda_bootstrap.cuh) are one translation unit, whose entities have
// internal linkage (anonymous namespace), so a second translation unit that used them
// would fail to link instead of silently getting state of its own.

#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cuda_plan.cuh"

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
extern Context g;

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
// Its type for XLA (registered through the bootstrap's MagiNvStateTypeId / TypeInfo).
extern XLA_FFI_TypeInfo g_state_info;

// ---- the lane of started reduces (cuda_started_reduce.cuh) -----------------------------

constexpr int kMaxPending = 4;

struct Pending {
  int64_t call_id;
  uint32_t epoch;
  int event;                       // index of the side stream's "sent" event
  const char* src[kMaxLeaves];     // the start's inputs (the done call must get the same)
};

struct Lane {
  char* stage = nullptr;           // symmetric
  size_t stage_bytes = 0;
  uint32_t* flags = nullptr;       // symmetric [kMaxSlots]: rows of slot j arrived, = epoch
  uint32_t* acks = nullptr;        // symmetric [npes]: acks[q] = last epoch q has summed
  unsigned int* done = nullptr;    // device counter of finished receive blocks
  uint32_t epoch = 0;              // host: started reduces so far
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t sent[kMaxPending + 1] = {};
  std::deque<Pending> pending;
  // Stream memory operations (driver API, resolved at initialization).
  CUresult (*wait32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*write32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
};
extern Lane lane;

}  // namespace
