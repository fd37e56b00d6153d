// CPU handlers of the native group collectives (magi_jax/sharding/native/, docs/design.md §3.2).
//
// Same semantics as the CUDA/NVSHMEM handlers and the NumPy models `cast_model` /
// `reduce_model` of magi_jax/sharding/collectives.py, for the host devices of ONE process:
// XLA:CPU runs the programs of the host devices concurrently, so the devices of one cp group
// meet in a "room" (keyed by the call site and the group) and publish their buffers; the
// last to arrive moves the data for all of them (cpu_rendezvous.h). A room that stays
// incomplete for `timeout_ms` fails every waiting device with an error that says so,
// instead of hanging.
//
// Tables of rank r (see collectives.py): send [n, S] (local row or -1), recv [B] (j*S + p or
// -1); slot j of rank r goes to rank (r + shifts[j]) % cp. One call moves the rows of up to
// kMaxLeaves arrays with the same rows (e.g. K and V), each into its own output, as below
// for each of them.
//   cast:   out_r[b] = x_src[send_src[j, p]],  recv_r[b] = j*S + p,  src = r - shifts[j]
//   reduce: out_r[row] = acc_r[row] + sum over j (ascending), dst = r + shifts[j], b
//           (ascending) with recv_dst[b] = j*S + p and send_r[j, p] = row, of y_dst[b]
//           (in float32, float64 for float64 input).
// With `prefix`, a cast's output is x_r's rows followed by the rows above, and a reduce's
// input is the owner's own rows followed by the buffer y: out_r[row] also adds own_r[row].
// With `own_apart` a reduce's own rows come as arrays of their own, before the buffers (an
// output may alias them). With `out_input_dtype` a reduce rounds its sums once to the
// input's dtype.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_rendezvous.h"
#include "ffi_attrs.h"

namespace ffi = xla::ffi;

namespace {

constexpr size_t kMaxLeaves = 4;

int64_t Mod(int64_t a, int64_t m) { return ((a % m) + m) % m; }

// ---- dtype helpers ---------------------------------------------------------------------

float Bf16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float F16ToF32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { e++; man <<= 1; } while (!(man & 0x400u));
      bits = sign | ((127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToBf16(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

uint16_t F32ToF16(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (a < 0x38800000u) {  // below 2^-14: a half subnormal, in units of 2^-24
    float v;
    std::memcpy(&v, &a, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(v * 16777216.0f)));
  }
  uint32_t h = ((((a >> 23) - 112u) << 10) | ((a & 0x7fffffu) >> 13));
  const uint32_t rest = a & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

// Writes `elems` sums to `dst` in `dtype` (one rounding).
template <typename Acc>
void StoreRow(void* dst, const Acc* src, ffi::DataType dtype, int64_t elems) {
  switch (dtype) {
    case ffi::DataType::BF16:
      for (int64_t i = 0; i < elems; ++i) {
        static_cast<uint16_t*>(dst)[i] = F32ToBf16(static_cast<float>(src[i]));
      }
      break;
    case ffi::DataType::F16:
      for (int64_t i = 0; i < elems; ++i) {
        static_cast<uint16_t*>(dst)[i] = F32ToF16(static_cast<float>(src[i]));
      }
      break;
    case ffi::DataType::F32:
      for (int64_t i = 0; i < elems; ++i) static_cast<float*>(dst)[i] = static_cast<float>(src[i]);
      break;
    default:
      for (int64_t i = 0; i < elems; ++i) {
        static_cast<double*>(dst)[i] = static_cast<double>(src[i]);
      }
      break;
  }
}

template <typename Acc>
void AddRow(Acc* dst, const void* src, ffi::DataType dtype, int64_t elems) {
  switch (dtype) {
    case ffi::DataType::BF16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < elems; ++i) dst[i] += static_cast<Acc>(Bf16ToF32(s[i]));
      break;
    }
    case ffi::DataType::F16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < elems; ++i) dst[i] += static_cast<Acc>(F16ToF32(s[i]));
      break;
    }
    case ffi::DataType::F32: {
      auto* s = static_cast<const float*>(src);
      for (int64_t i = 0; i < elems; ++i) dst[i] += static_cast<Acc>(s[i]);
      break;
    }
    case ffi::DataType::F64: {
      auto* s = static_cast<const double*>(src);
      for (int64_t i = 0; i < elems; ++i) dst[i] += static_cast<Acc>(s[i]);
      break;
    }
    default:
      break;
  }
}

struct Where {
  int64_t rank, group;
};

ffi::ErrorOr<Where> ReadWhere(ffi::Buffer<ffi::S32> where, int64_t cp) {
  if (where.element_count() != 2) {
    return ffi::Error::InvalidArgument("where must hold (rank, group)");
  }
  Where w{where.typed_data()[0], where.typed_data()[1]};
  if (w.rank < 0 || w.rank >= cp) {
    return ffi::Error::InvalidArgument("rank " + std::to_string(w.rank) +
                                       " is outside the cp axis of size " +
                                       std::to_string(cp));
  }
  return w;
}

int64_t RowBytes(ffi::AnyBuffer a) {
  auto dims = a.dimensions();
  int64_t per_row = 1;
  for (size_t i = 1; i < dims.size(); ++i) per_row *= dims[i];
  return per_row * static_cast<int64_t>(ffi::ByteWidth(a.element_type()));
}

std::string CheckTables(const std::vector<Member>& m, size_t n_shifts) {
  for (const Member& x : m) {
    if (x.n != m[0].n || x.s != m[0].s || x.row_bytes != m[0].row_bytes ||
        x.dtype != m[0].dtype) {
      return "the devices of one cp group passed tables or rows of different shapes";
    }
  }
  if (static_cast<size_t>(m[0].n) != n_shifts) {
    return "send_index has " + std::to_string(m[0].n) + " slots but shifts has " +
           std::to_string(n_shifts);
  }
  return "";
}

// out_r[b] = x_src[send_src[j, p]] for recv_r[b] = j*S + p, src = r - shifts[j] (every leaf).
std::string CastOne(const std::vector<Member>& m, int64_t rank,
                    ffi::Span<const int64_t> shifts) {
  const int64_t cp = m.size();
  const Member& me = m[rank];
  const int64_t slots = me.n * me.s;
  const int64_t first = me.prefix ? me.rows : 0;  // output rows before the received ones
  for (size_t l = 0; l < me.out.size() && first > 0; ++l) {
    std::memcpy(me.out[l], me.data[l], first * me.row_bytes[l]);
  }
  for (int64_t b = 0; b < me.b; ++b) {
    int32_t e = me.recv[b];
    int32_t row = -1;
    int64_t src = 0;
    if (e >= slots) {
      return "recv_index[" + std::to_string(b) + "] = " + std::to_string(e) +
             " is outside the " + std::to_string(slots) + " received rows";
    }
    if (e >= 0) {
      int64_t j = e / me.s, p = e % me.s;
      src = Mod(rank - shifts[j], cp);
      row = m[src].send[j * me.s + p];
      if (row >= m[src].rows) {
        return "send_index of rank " + std::to_string(src) + " names row " +
               std::to_string(row) + " of " + std::to_string(m[src].rows);
      }
    }
    for (size_t l = 0; l < me.out.size(); ++l) {
      const int64_t rb = me.row_bytes[l];
      char* row_out = static_cast<char*>(me.out[l]) + (first + b) * rb;
      if (row < 0) {
        std::memset(row_out, 0, rb);
      } else {
        std::memcpy(row_out, static_cast<const char*>(m[src].data[l]) + row * rb, rb);
      }
    }
  }
  return "";
}

// out_r[row] = acc_r[row] + sum over j (ascending), dst = r + shifts[j], b (ascending) with
// recv_dst[b] = j*S + p and send_r[j, p] = row, of y_dst[b].
template <typename Acc>
std::string ReduceOne(const std::vector<Member>& m, int64_t rank,
                      ffi::Span<const int64_t> shifts) {
  const int64_t cp = m.size();
  const Member& me = m[rank];
  const int64_t width = static_cast<int64_t>(ffi::ByteWidth(me.dtype));
  for (size_t l = 0; l < me.out.size(); ++l) {
    const int64_t elems = me.row_bytes[l] / width;
    // The sums in Acc: straight in the output, or in a scratch rounded (or copied) into it
    // at the end, when they are narrower or the output is the own rows' buffer.
    const bool narrow = ffi::ByteWidth(me.out_dtype) != sizeof(Acc) ||
                        me.own[l] == me.out[l];
    std::vector<Acc> scratch(narrow ? me.out_rows * elems : 0);
    Acc* out = narrow ? scratch.data() : static_cast<Acc*>(me.out[l]);
    if (me.acc[l]) {
      std::memcpy(out, me.acc[l], me.out_rows * elems * sizeof(Acc));
    } else {
      std::memset(out, 0, me.out_rows * elems * sizeof(Acc));
    }
    if (me.own[l]) {
      for (int64_t row = 0; row < me.out_rows; ++row) {
        AddRow(out + row * elems, static_cast<const char*>(me.own[l]) + row * me.row_bytes[l],
               me.dtype, elems);
      }
    }
    for (int64_t j = 0; j < me.n; ++j) {
      const Member& md = m[Mod(rank + shifts[j], cp)];
      for (int64_t b = 0; b < md.b; ++b) {
        int32_t e = md.recv[b];
        if (e < 0 || e >= me.n * me.s || e / me.s != j) continue;
        int32_t row = me.send[e];
        if (row < 0) continue;
        if (row >= me.out_rows) {
          return "send_index names row " + std::to_string(row) + " of " +
                 std::to_string(me.out_rows);
        }
        AddRow(out + row * elems, static_cast<const char*>(md.data[l]) + b * md.row_bytes[l],
               md.dtype, elems);
      }
    }
    if (narrow) StoreRow(me.out[l], out, me.out_dtype, me.out_rows * elems);
  }
  return "";
}

// Runs `one` for every rank of the group and completes each rank's promise.
template <typename F>
void Finish(std::vector<Member>& m, size_t n_shifts, const char* op, F one) {
  // Every output first, then the promises: a completed device may release its inputs.
  std::string shared = CheckTables(m, n_shifts);
  std::vector<std::string> errs(m.size(), shared);
  for (int64_t r = 0; r < static_cast<int64_t>(m.size()); ++r) {
    if (shared.empty()) errs[r] = one(r);
  }
  for (int64_t r = 0; r < static_cast<int64_t>(m.size()); ++r) {
    const std::string& err = errs[r];
    Complete(m[r].promise, err.empty() ? ffi::Error::Success()
                                       : ffi::Error::InvalidArgument(
                                             std::string("magi_jax native ") + op +
                                             " (CPU): " + err));
  }
}

ffi::Future Failed(ffi::Error error) {
  ffi::Promise p;
  ffi::Future f(p);
  p.SetError(std::move(error));
  return f;
}

// ---- handlers --------------------------------------------------------------------------

// The leaves of a call into `me`: inputs args[0, n), outputs rets[0, n) and, for an
// accumulating reduce, initial sums args[n, 2n). A cast's output l has input l's dtype and
// row size; a reduce's is float32 (float64 for float64 input) rows of input l's elements,
// or rows of its dtype with `out_input_dtype`. With me.prefix, a cast's output has the
// input's rows before the `b` received ones, a reduce's input the output's rows before the
// `b` buffer rows (me.data then points at the buffer, me.own at the owner's rows). With
// `apart` (a reduce) the owner's rows are arrays of their own, args[0, n), before the
// buffers args[n, 2n) and the initial sums.
std::string GetLeaves(ffi::RemainingArgs args, ffi::RemainingRets rets, bool reduce,
                      bool accumulate, bool out_input_dtype, int64_t b, Member& me,
                      bool apart = false) {
  const size_t n = rets.size();
  if (n < 1 || n > kMaxLeaves || args.size() != n * (1 + apart + accumulate)) {
    return "1 to " + std::to_string(kMaxLeaves) + " arrays, one output each" +
           (apart ? " and their own rows" : "") +
           (accumulate ? " and one initial sum each" : "") + "; got " +
           std::to_string(args.size()) + " inputs and " + std::to_string(n) + " outputs";
  }
  for (size_t l = 0; l < n; ++l) {
    auto x = args.get<ffi::AnyBuffer>(apart ? n + l : l);
    auto o = rets.get<ffi::AnyBuffer>(l);
    if (x.has_error() || o.has_error()) return "array " + std::to_string(l) + " is not a buffer";
    const ffi::DataType dt = x->element_type();
    const int64_t rows = x->dimensions().size() == 0 ? 0 : x->dimensions()[0];
    const int64_t out_rows = (*o)->dimensions().size() == 0 ? 0 : (*o)->dimensions()[0];
    const int64_t rb = RowBytes(*x);
    if (l == 0) {
      me.dtype = dt;
      me.rows = rows;
      me.out_rows = out_rows;
    }
    const ffi::DataType want =
        reduce && !out_input_dtype
            ? (dt == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32)
            : dt;
    me.out_dtype = want;
    const int64_t out_rb = reduce ? rb / static_cast<int64_t>(ffi::ByteWidth(dt)) *
                                        static_cast<int64_t>(ffi::ByteWidth(want))
                                  : rb;
    if (rows != me.rows || out_rows != me.out_rows || (reduce && dt != me.dtype) ||
        (*o)->element_type() != want || RowBytes(**o) != out_rb) {
      return "array " + std::to_string(l) +
             (reduce ? " must share the rows and dtype of the others and its output be "
                       "float32 (float64) rows of its elements"
                     : " must share the rows of the others and its output its dtype and row "
                       "size");
    }
    if (!reduce && out_rows != b + (me.prefix ? rows : 0)) {
      return me.prefix ? "the outputs must have the input's rows and one per recv_index entry"
                       : "the outputs must have one row per recv_index entry";
    }
    const bool joined = reduce && me.prefix && !apart;  // y = [own; buffer]
    if (reduce && rows != b + (joined ? out_rows : 0)) {
      return joined ? "y must have the output's rows and then one per recv_index entry"
                    : "y must have one row per recv_index entry";
    }
    const char* data = static_cast<const char*>(x->untyped_data());
    const void* own = joined ? data : nullptr;
    if (apart) {
      auto a = args.get<ffi::AnyBuffer>(l);
      if (a.has_error() || a->element_type() != dt || a->dimensions().size() == 0 ||
          a->dimensions()[0] != out_rows || RowBytes(*a) != rb) {
        return "own rows " + std::to_string(l) + " must be the output's rows of array " +
               std::to_string(l) + "'s dtype and row";
      }
      own = a->untyped_data();
    }
    me.own.push_back(own);
    me.data.push_back(joined ? data + out_rows * rb : data);
    me.out.push_back((*o)->untyped_data());
    me.row_bytes.push_back(rb);
    const void* acc = nullptr;
    if (accumulate) {
      auto a = args.get<ffi::AnyBuffer>(n * (1 + apart) + l);
      const size_t acc_width = me.dtype == ffi::DataType::F64 ? 8 : 4;
      if (a.has_error() ||
          a->size_bytes() != static_cast<size_t>(out_rows * (rb / ffi::ByteWidth(dt))) *
                                 acc_width) {
        return "the initial sums must have the outputs' shapes, in float32 (float64)";
      }
      acc = a->untyped_data();
    }
    me.acc.push_back(acc);
  }
  return "";
}

ffi::Future CastImpl(ffi::Buffer<ffi::S32> send, ffi::Buffer<ffi::S32> recv,
                     ffi::Buffer<ffi::S32> where, ffi::RemainingArgs xs, ffi::RemainingRets outs,
                     int64_t cp, ffi::Span<const int64_t> shifts, int64_t call_id,
                     int64_t timeout_ms, bool prefix) {
  auto w = ReadWhere(where, cp);
  if (w.has_error()) return Failed(w.error());
  auto sdims = send.dimensions();
  if (sdims.size() != 2) return Failed(ffi::Error::InvalidArgument("send_index must be [n, S]"));
  Member me;
  me.send = send.typed_data();
  me.recv = recv.typed_data();
  me.n = sdims[0];
  me.s = sdims[1];
  me.b = static_cast<int64_t>(recv.element_count());
  me.prefix = prefix;
  std::string err = GetLeaves(xs, outs, /*reduce=*/false, /*accumulate=*/false,
                              /*out_input_dtype=*/false, me.b, me);
  if (!err.empty()) {
    return Failed(ffi::Error::InvalidArgument("magi_jax native group_cast (CPU): " + err));
  }
  ffi::Future future(me.promise);
  auto group = Arrive(call_id, w->group, w->rank, cp, timeout_ms, "group_cast",
                      std::move(me), &err);
  if (!err.empty()) return Failed(ffi::Error::InvalidArgument(err));
  if (group) {
    Finish(*group, shifts.size(), "group_cast",
           [&](int64_t r) { return CastOne(*group, r, shifts); });
  }
  return future;
}

ffi::Future ReduceImpl(ffi::Buffer<ffi::S32> send, ffi::Buffer<ffi::S32> recv,
                       ffi::Buffer<ffi::S32> where, ffi::RemainingArgs ys,
                       ffi::RemainingRets outs, int64_t cp, ffi::Span<const int64_t> shifts,
                       int64_t call_id, int64_t timeout_ms, bool prefix, bool accumulate,
                       bool out_input_dtype, bool own_apart) {
  auto w = ReadWhere(where, cp);
  if (w.has_error()) return Failed(w.error());
  auto sdims = send.dimensions();
  if (sdims.size() != 2) return Failed(ffi::Error::InvalidArgument("send_index must be [n, S]"));
  Member me;
  me.send = send.typed_data();
  me.recv = recv.typed_data();
  me.n = sdims[0];
  me.s = sdims[1];
  me.b = static_cast<int64_t>(recv.element_count());
  me.prefix = prefix;
  std::string err =
      GetLeaves(ys, outs, /*reduce=*/true, accumulate, out_input_dtype, me.b, me, own_apart);
  if (err.empty() && me.dtype != ffi::DataType::BF16 && me.dtype != ffi::DataType::F16 &&
      me.dtype != ffi::DataType::F32 && me.dtype != ffi::DataType::F64) {
    err = "takes bf16, f16, f32 or f64";
  }
  if (!err.empty()) {
    return Failed(ffi::Error::InvalidArgument("magi_jax native group_reduce (CPU): " + err));
  }
  const bool wide = me.dtype == ffi::DataType::F64;
  ffi::Future future(me.promise);
  auto group = Arrive(call_id, w->group, w->rank, cp, timeout_ms, "group_reduce",
                      std::move(me), &err);
  if (!err.empty()) return Failed(ffi::Error::InvalidArgument(err));
  if (group) {
    Finish(*group, shifts.size(), "group_reduce", [&](int64_t r) {
      return wide ? ReduceOne<double>(*group, r, shifts) : ReduceOne<float>(*group, r, shifts);
    });
  }
  return future;
}

// A started reduce (magi_jax/sharding/native/, group_reduce_start): on the host devices nothing
// moves until its done call, which is the reduce above with the start's token in front. The
// start checks the runs the CUDA handlers would copy against this rank's receive table: run
// (b0, e0, len) stands for recv[b0 + i] = e0 + i, i < len, within one slot, and the runs cover
// every real entry once, in order.
ffi::Error StartImpl(ffi::Buffer<ffi::S32> recv, ffi::Buffer<ffi::S32> where,
                     ffi::RemainingArgs ys, ffi::Result<ffi::Buffer<ffi::S32>> token, int64_t cp,
                     int64_t slot_len, ffi::Span<const int64_t> runs,
                     ffi::Span<const int64_t> run_offsets) {
  auto w = ReadWhere(where, cp);
  if (w.has_error()) return w.error();
  if (ys.size() < 1 || run_offsets.size() != static_cast<size_t>(cp + 1)) {
    return ffi::Error::InvalidArgument(
        "magi_jax native group_reduce_start (CPU): one run offset per rank and one more, and "
        "at least one array");
  }
  const int32_t* e = recv.typed_data();
  const int64_t B = static_cast<int64_t>(recv.element_count());
  int64_t b = 0;  // entries below b are covered or padding
  for (int64_t i = run_offsets[w->rank]; i < run_offsets[w->rank + 1]; i += 3) {
    const int64_t b0 = runs[i], e0 = runs[i + 1], len = runs[i + 2];
    bool ok = len > 0 && b0 >= b && b0 + len <= B && e0 / slot_len == (e0 + len - 1) / slot_len;
    for (int64_t k = b; ok && k < b0; ++k) ok = e[k] < 0;
    for (int64_t k = 0; ok && k < len; ++k) ok = e[b0 + k] == e0 + k;
    if (!ok) {
      return ffi::Error::InvalidArgument(
          "magi_jax native group_reduce_start (CPU): rank " + std::to_string(w->rank) +
          ": run (" + std::to_string(b0) + ", " + std::to_string(e0) + ", " +
          std::to_string(len) + ") does not match the receive table");
    }
    b = b0 + len;
  }
  for (int64_t k = b; k < B; ++k) {
    if (e[k] >= 0) {
      return ffi::Error::InvalidArgument(
          "magi_jax native group_reduce_start (CPU): rank " + std::to_string(w->rank) +
          ": receive entry " + std::to_string(k) + " is in no run");
    }
  }
  token->typed_data()[0] = 0;
  return ffi::Error::Success();
}

ffi::Future DoneImpl(ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::S32> send,
                     ffi::Buffer<ffi::S32> recv, ffi::Buffer<ffi::S32> where,
                     ffi::RemainingArgs ys, ffi::RemainingRets outs, int64_t cp,
                     ffi::Span<const int64_t> shifts, int64_t call_id, int64_t timeout_ms,
                     bool prefix, bool accumulate, bool out_input_dtype, bool own_apart) {
  (void)token;
  return ReduceImpl(send, recv, where, ys, outs, cp, shifts, call_id, timeout_ms, prefix,
                    accumulate, out_input_dtype, own_apart);
}

}  // namespace

// ---- FFI symbols (attributes: ffi_attrs.h) ---------------------------------------------

// Cast: send, recv, where, then the arrays x_0.. (RemainingArgs); outputs out_0..
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupCastCpu, CastImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  MAGI_CPU_CAST_ATTRS);

// Reduce: send, recv, where, then (own_apart) the own rows own_0.., the arrays y_0.. and
// (accumulate) their initial sums acc_0.. (RemainingArgs); outputs out_0..
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceCpu, ReduceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  MAGI_CPU_REDUCE_ATTRS);

// Started reduce: recv, where, then the arrays y_0.. (RemainingArgs); output a token.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceStartCpu, StartImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  MAGI_CPU_START_ATTRS);

// Its done call: the start's token, then the arguments of MagiGroupReduceCpu.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MagiGroupReduceDoneCpu, DoneImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  MAGI_CPU_REDUCE_ATTRS);
