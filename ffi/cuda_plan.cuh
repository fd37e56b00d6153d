// What the host side and the kernels of the CUDA group collectives share: the limits, the
// data paths (Mode), the launch descriptors (Plan, Leaves) that a launch passes by value.
// The protocol is described at the top of cuda_group_collectives.cu.

#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kMaxSlots = 64;
constexpr int kMaxLeaves = 4;
enum Mode : int { kPush = 0, kPull = 1 };

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
  // A started reduce's done kernel (its rows came by CopyKernel): one 32-bit flag per
  // slot instead of the chunk flags, and 32-bit acknowledgements; nullptr otherwise. Its
  // staging is planar: leaf l's rows, n*S of them, from byte n*S*off[l] of the region (the
  // sender copies contiguous runs of one leaf).
  const uint32_t* slot_flags;
  uint32_t* slot_acks;
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
  bool in_place;                 // reduce: dst == local, no acc: rows without sends stay
};

__host__ __device__ __forceinline__ bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

}  // namespace
