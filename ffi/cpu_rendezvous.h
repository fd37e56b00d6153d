// Rendezvous of the CPU handlers (cpu_group_collectives.cc, the one file that includes
// this): the host devices of one cp group meet in a room keyed by call site, group and
// execution; the last to arrive gets every device's buffers. A watchdog fails the rooms that
// stay incomplete past their timeout.

#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---- rendezvous ------------------------------------------------------------------------
//
// The handlers are asynchronous (they return an ffi::Future): a device that arrives early
// does not hold one of XLA:CPU's threads while it waits, so devices that reach independent
// collectives in different orders cannot starve each other. The LAST device to arrive moves
// the data for the whole group (every input is alive: no device's call has completed yet)
// and then completes every device's future. A watchdog fails the futures of a room that
// stays incomplete longer than its timeout.

using Clock = std::chrono::steady_clock;

struct Member {
  std::vector<const void*> data;   // per leaf: x (cast) or y (reduce)
  std::vector<const void*> acc;    // reduce, per leaf: initial output or nullptr
  std::vector<const void*> own;    // reduce with prefix, per leaf: the owner's rows
  std::vector<void*> out;          // per leaf
  std::vector<int64_t> row_bytes;  // per leaf, of data
  const int32_t* send = nullptr;   // [n, S]
  const int32_t* recv = nullptr;   // [B]
  int64_t rows = 0;                // rows of data (every leaf)
  int64_t out_rows = 0;
  int64_t n = 0, s = 0, b = 0;
  bool prefix = false;             // cast: out = [x; received]; reduce: y = [own; buffer]
  ffi::DataType dtype = ffi::DataType::INVALID;
  ffi::DataType out_dtype = ffi::DataType::INVALID;
  bool present = false;
  ffi::Promise promise;
};

struct Room {
  std::vector<Member> members;
  int arrived = 0;
  Clock::time_point first;
  int64_t timeout_ms = 0;
  std::string op;
};

// A call site (call_id) can run several times in one program (inlined twice, rematerialised,
// in a loop): each device numbers its own executions of a call site, and the n-th execution
// of every device of the group meets the n-th of the others.
using RoomKey = std::tuple<int64_t, int64_t, int64_t>;  // (call_id, cp group, execution)
// Never destroyed: the detached watchdog may still touch them while the process exits.
std::mutex& g_mu = *new std::mutex;
std::map<RoomKey, Room>& g_rooms = *new std::map<RoomKey, Room>;
// (call_id, cp group, rank) -> executions of that call site so far by that device.
std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t>& g_executions =
    *new std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t>;

std::string TimeoutMessage(const Room& room, int64_t cp) {
  return "magi_jax native " + room.op + " (CPU): rendezvous timed out after " +
         std::to_string(room.timeout_ms) + " ms with " + std::to_string(room.arrived) +
         " of " + std::to_string(cp) +
         " devices of the cp group arrived. Every device of the cp axis must run this "
         "collective in this process (call it inside shard_map over the cp axis, with cp "
         "equal to the axis size).";
}

// Completing a promise runs the rest of that device's program on the calling thread, which
// may block there (e.g. in an XLA:CPU collective waiting for the other devices), so every
// promise is completed on a thread of its own, never inline.
void Complete(ffi::Promise p, ffi::Error error) {
  std::thread([p = std::move(p), error = std::move(error)]() mutable {
    if (error.success()) {
      p.SetAvailable();
    } else {
      p.SetError(std::move(error));
    }
  }).detach();
}

void Watchdog() {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::vector<std::pair<std::string, std::vector<ffi::Promise>>> expired;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      auto now = Clock::now();
      for (auto it = g_rooms.begin(); it != g_rooms.end();) {
        Room& room = it->second;
        if (now - room.first > std::chrono::milliseconds(room.timeout_ms)) {
          std::vector<ffi::Promise> ps;
          for (auto& m : room.members)
            if (m.present) ps.push_back(m.promise);
          expired.emplace_back(TimeoutMessage(room, room.members.size()), std::move(ps));
          it = g_rooms.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& [msg, ps] : expired)
      for (auto& p : ps) Complete(p, ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg));
  }
}

// Joins the room of (call_id, group). Returns the whole group when this device is the last
// to arrive (the caller then does the work and completes every promise), else nothing.
std::optional<std::vector<Member>> Arrive(int64_t call_id, int64_t group, int64_t rank,
                                          int64_t cp,
                                          int64_t timeout_ms, const char* op,
                                          Member me, std::string* err) {
  static std::once_flag watchdog;
  std::call_once(watchdog, [] { std::thread(Watchdog).detach(); });
  std::lock_guard<std::mutex> lock(g_mu);
  const RoomKey key{call_id, group, g_executions[{call_id, group, rank}]++};
  Room& room = g_rooms[key];
  if (room.members.empty()) {
    room.members.resize(cp);
    room.first = Clock::now();
    room.timeout_ms = timeout_ms;
    room.op = op;
  }
  if (static_cast<int64_t>(room.members.size()) != cp || room.members[rank].present) {
    *err = "two devices claim rank " + std::to_string(rank) + " of one cp group";
    return std::nullopt;
  }
  me.present = true;
  room.members[rank] = std::move(me);
  if (++room.arrived < cp) return std::nullopt;
  std::vector<Member> all = std::move(room.members);
  g_rooms.erase(key);
  return all;
}

}  // namespace
