// Bootstrap of the native group collectives (ctypes entry points, magi_jax/sharding/native/):
// NVSHMEM initialisation from a unique id, the symmetric staging, flags and
// acknowledgements, the started reduces' lane, and their release. Part of the one
// translation unit cuda_group_collectives.cu, which defines the process-wide state `g` and
// `lane` that this sets up (cuda_state.cuh).

#pragma once

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "cuda_plan.cuh"
#include "cuda_state.cuh"

// ---- bootstrap (ctypes) ----------------------------------------------------------------

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
                 size_t started_bytes, char* err, int err_len) {
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
  // The lane of started reduces (symmetric allocations: every PE makes the same calls).
  if (started_bytes > 0) {
    lane.stage_bytes = started_bytes;
    lane.stage = static_cast<char*>(nvshmem_malloc(started_bytes));
    lane.flags = static_cast<uint32_t*>(nvshmem_calloc(kMaxSlots, sizeof(uint32_t)));
    lane.acks = static_cast<uint32_t*>(nvshmem_calloc(npes, sizeof(uint32_t)));
    if (!lane.stage || !lane.flags || !lane.acks) {
      return Fail(err, err_len,
                  "nvshmem_malloc of " + std::to_string(started_bytes) +
                      " bytes for started reduces failed: raise NVSHMEM_SYMMETRIC_SIZE or pass "
                      "started_bytes=0",
                  5);
    }
    void* wait = nullptr;
    void* write = nullptr;
    cudaDriverEntryPointQueryResult q1, q2;
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &wait, 12000, cudaEnableDefault,
                                         &q1) != cudaSuccess ||
        cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &write, 12000,
                                         cudaEnableDefault, &q2) != cudaSuccess ||
        wait == nullptr || write == nullptr) {
      return Fail(err, err_len, "the driver has no stream memory operations", 6);
    }
    lane.wait32 = reinterpret_cast<decltype(lane.wait32)>(wait);
    int top = 0;  // the greatest stream priority
    lane.write32 = reinterpret_cast<decltype(lane.write32)>(write);
    if (cudaMalloc(&lane.done, sizeof(unsigned int)) != cudaSuccess ||
        cudaMemset(lane.done, 0, sizeof(unsigned int)) != cudaSuccess ||
        cudaDeviceGetStreamPriorityRange(nullptr, &top) != cudaSuccess ||
        cudaStreamCreateWithPriority(&lane.side, cudaStreamNonBlocking, top) != cudaSuccess ||
        cudaEventCreateWithFlags(&lane.fork, cudaEventDisableTiming) != cudaSuccess) {
      return Fail(err, err_len, "cudaMalloc / stream / event creation failed", 4);
    }
    for (cudaEvent_t& e : lane.sent) {
      if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
        return Fail(err, err_len, "cudaEventCreate failed", 4);
      }
    }
    lane.epoch = 0;
    lane.pending.clear();
  }
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
  if (lane.stage != nullptr) {
    nvshmem_free(lane.stage);
    nvshmem_free(lane.flags);
    nvshmem_free(lane.acks);
    cudaFree(lane.done);
    cudaStreamDestroy(lane.side);
    cudaEventDestroy(lane.fork);
    for (cudaEvent_t& e : lane.sent) cudaEventDestroy(e);
    lane = Lane();
  }
  nvshmem_finalize();
  return 0;
}

}  // extern "C"
