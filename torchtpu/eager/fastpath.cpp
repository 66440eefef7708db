// The Strict executor's cached-program hot path in C++ (eager/fastpath.py has the design).
//
// A `Kernel` object is what torch.library calls for one functional op on PrivateUse1 (in
// place of the Python kernel it wraps). It keys the call's arguments (tensor dtype/sizes/
// strides/offset, Python scalars by their bits, lists, dtypes, devices, the default dtype,
// the matmul precision for ops that read it) and looks the key up in its own table. A hit
// gathers the input storages' jax.Arrays, calls the executable's C++ call, notes the outputs
// in flight and builds the output tensors and storages directly, exactly as buffer.wrap_noted
// does. Anything else runs the Python kernel (eager/executor.py), which installs an entry
// through `install` only for a call it has proven eligible while this thread's pending key
// (set here before calling it) is still its own.
//
// Every Python object is touched with the GIL held (torch.library calls Python kernels with
// it); tables hold entries by shared_ptr, since an executable call may release the GIL.

#include <Python.h>
#include <structmember.h>

#include <atomic>

#include <ATen/Context.h>
#include <ATen/Tensor.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

#include <torch/library.h>

#include <c10/util/SmallVector.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <ctime>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct OutMeta {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
  int64_t nbytes;
  // >= 0: the result is this constant of the entry (None, or a Python scalar such as SDPA's
  // max_q: the key fixes it), not an array
  int konst = -1;
  // non-empty: the output is restrided to this dimension order (registry meta
  // eager_layout_like: t.permute(order).contiguous().permute(inverse), as lowering/attention.py
  // `_like_layout` does)
  std::vector<int64_t> order, inverse;
};

struct Entry {
  PyObject* call = nullptr;             // the executable's call (owned)
  std::vector<int> plan;                // per flat argument: >= 0 a tensor ordinal, < 0 a constant
  std::vector<PyObject*> consts;        // owned
  std::vector<PyObject*> in_dtypes;     // per tensor ordinal: the storage array's dtype (owned)
  std::vector<std::vector<int64_t>> in_shapes;  // ... its shape (a view's differs from the tensor's)
  std::vector<char> in_weak;            // ... its weak_type
  // per tensor ordinal: aval objects already matched against the three above (owned; an
  // aval is immutable, so the same object always matches again)
  mutable std::vector<std::vector<PyObject*>> seen_avals;
  bool tuple_out = false;
  std::vector<OutMeta> outs;
  std::vector<PyObject*> out_consts;    // OutMeta::konst's values (owned)
  // a checked op (registry `check`): the executable returns (results, flag) and the flag goes
  // to this callable (checks.add with the op's name, exception and message bound), as the
  // Python path hands it over in Strict mode (owned; nullptr: no check)
  PyObject* check = nullptr;
  ~Entry() {
    Py_XDECREF(call);
    Py_XDECREF(check);
    for (auto* c : consts) Py_XDECREF(c);
    for (auto* c : out_consts) Py_XDECREF(c);
    for (auto* d : in_dtypes) Py_XDECREF(d);
    for (auto& v : seen_avals)
      for (auto* a : v) Py_XDECREF(a);
  }
};

// One key can meet storage arrays of different shapes (a (1, 64) view of a (1, 1, 64) array
// or of a (1, 64) one): each is its own view spec, so its own program; a key holds up to
// kMaxVariants entries, told apart by their inputs' arrays.
using Variants = std::vector<std::shared_ptr<Entry>>;
using Table = std::unordered_map<std::string, Variants>;
constexpr size_t kMaxEntries = 4096;  // per op: a table past it starts over
constexpr size_t kMaxVariants = 8;
constexpr size_t kSeenAvals = 4;  // per entry input

struct FTable;

struct Kernel {
  PyObject_HEAD
  PyObject* fn;        // the Python kernel
  PyObject* lowering;  // the executor's Lowering (identifies the op at install)
  PyObject* name;      // str: for counters
  int reads_precision;
  Table* table;
  struct FTable* ftable;  // Fused mode's recording entries (see "Fused recording" below)
};

std::vector<Kernel*>& all_kernels() {
  static auto* v = new std::vector<Kernel*>();  // leaked: kernels may outlive module teardown
  return *v;
}

// ---- module state (set once by `setup`) ----
PyObject* g_mode_state = nullptr;  // eager.modes._state (a dict)
PyObject* g_strict = nullptr;      // EagerMode.DEFER_NEVER
PyObject* g_buffer_type = nullptr; // runtime.buffer.Buffer
PyObject* g_next_free = nullptr;   // runtime.buffer._next_free (a one-element list)
PyObject* g_note = nullptr;        // runtime.inflight.note
PyObject* g_array_type = nullptr;  // jax ArrayImpl
PyObject* g_precision = nullptr;   // lowering.registry.matmul_precision
PyObject* g_jax_precision = nullptr;  // jax's default_matmul_precision config state (or null)
PyObject* g_counters = nullptr;    // runtime.metrics.COUNTERS
PyObject* g_empty = nullptr;       // ()
PyObject* g_is_ready = nullptr;    // ArrayImpl.is_ready (called with the array: no method lookup)
PyObject* g_aval_get = nullptr;    // ArrayImpl.aval's getter (the property's fget; or null)
Py_ssize_t g_array_slot = -1;      // the offset of Buffer's `array` slot (-1: set as an attribute)
bool g_enabled = true;
constexpr int64_t kAlign = 512;    // buffer._ALIGN

PyObject *s_value, *s_mode, *s_tpu_buffer, *s_array, *s_dtype, *s_shape, *s_is_ready, *s_weak_type,
    *s_aval;
PyObject *c_hits, *c_cache_hits, *c_misses, *c_uncacheable, *c_bypassed, *c_errors,
    *c_installs, *c_full;

void bump(PyObject* name) {
  if (g_counters == nullptr) return;
  PyObject* v = PyDict_GetItemWithError(g_counters, name);  // borrowed
  long long n = 0;
  if (v != nullptr) {
    n = PyLong_AsLongLong(v);
    if (n == -1 && PyErr_Occurred()) { PyErr_Clear(); return; }
  } else if (PyErr_Occurred()) {
    PyErr_Clear();
    return;
  }
  PyObject* nv = PyLong_FromLongLong(n + 1);
  if (nv == nullptr) { PyErr_Clear(); return; }
  if (PyDict_SetItem(g_counters, name, nv) < 0) PyErr_Clear();
  Py_DECREF(nv);
}

// ---- where a Kernel's time goes (set_timing(True); benchmarks/generate_ops.py prints it) ----
// In the calling thread's CPU time, per outermost Kernel call (a Kernel entered inside another's Python kernel or relayout is
// part of the outer one's time): how many were served in C++ and how long they took, of which
// the executable's call (JAX's C++ call, and with synchronous XLA:CPU dispatch the program's
// execution); how many ran the Python kernel and how long they took.
struct Timing {
  bool on = false;
  long long hits = 0, hit_ns = 0, call_ns = 0, python = 0, python_ns = 0;
};
Timing g_timing;
thread_local int tl_depth = 0;
thread_local long long tl_call_ns = 0;
// the calling thread's CPU time: on a loaded host the wall clock mostly measures the wait for
// a core (with synchronous XLA:CPU dispatch the program runs on this thread, so it counts)
inline long long now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// ---- the thread's pending key: what the Python kernel may install an entry for ----
struct Pending {
  Kernel* kernel = nullptr;
  std::string key;
  int n_tensors = 0;
  bool fused = false;  // a Fused-mode miss: only install_fused may use it (Strict's install not)
};
thread_local Pending* tl_pending = nullptr;

// ---- keys ----
template <typename T>
inline void put(std::string& k, T v) {
  k.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

using Tensors = c10::SmallVector<at::Tensor, 6>;  // an op's input tensors (no heap allocation)

bool key_of(PyObject* x, std::string& k, Tensors& ts, int depth);

// a tpu:0 strided tensor's part of a key (dtype, conj/neg bits, sizes, strides, offset); false
// for any other tensor (the Python path serves it). Shared by both routes' keys (key_tensor:
// the Python argument; key_at_tensor: the IValue), which must stay byte-identical.
inline bool key_tensor_impl(const at::Tensor& t, std::string& k, Tensors& ts) {
  auto* impl = t.unsafeGetTensorImpl();
  const auto& dev = impl->device();
  if (dev.type() != c10::DeviceType::PrivateUse1 || dev.index() != 0) return false;
  if (impl->layout() != c10::kStrided || impl->is_nested() || !impl->has_storage()) return false;
  if (impl->key_set().has(c10::DispatchKey::Python)) return false;
  k.push_back('T');
  put<int8_t>(k, static_cast<int8_t>(impl->dtype().toScalarType()));
  put<int8_t>(k, static_cast<int8_t>(impl->is_conj() | (impl->is_neg() << 1)));
  auto sizes = impl->sizes();
  auto strides = impl->strides();
  put<int32_t>(k, static_cast<int32_t>(sizes.size()));
  for (auto s : sizes) put<int64_t>(k, s);
  for (auto s : strides) put<int64_t>(k, s);
  put<int64_t>(k, impl->storage_offset());
  ts.push_back(t);
  return true;
}

bool key_tensor(PyObject* x, std::string& k, Tensors& ts) {
  const at::Tensor& t = THPVariable_Unpack(x);
  if (!t.defined()) return false;
  return key_tensor_impl(t, k, ts);
}

bool key_of(PyObject* x, std::string& k, Tensors& ts, int depth) {
  PyTypeObject* tp = Py_TYPE(x);
  if (THPVariable_CheckTypeExact(tp)) return key_tensor(x, k, ts);
  if (x == Py_None) { k.push_back('N'); return true; }
  if (tp == &PyBool_Type) { k.push_back(x == Py_True ? 'B' : 'b'); return true; }
  if (tp == &PyLong_Type) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow != 0 || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); return false; }
    k.push_back('i');
    put<int64_t>(k, v);
    return true;
  }
  if (tp == &PyFloat_Type) {
    double v = PyFloat_AS_DOUBLE(x);
    k.push_back('f');
    put<double>(k, v);  // by its bits: nan, -0.0 and 0.0 are distinct keys
    return true;
  }
  if (tp == &PyComplex_Type) {
    k.push_back('c');
    put<double>(k, PyComplex_RealAsDouble(x));
    put<double>(k, PyComplex_ImagAsDouble(x));
    return true;
  }
  if (tp == &PyUnicode_Type) {
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(x, &n);
    if (s == nullptr) { PyErr_Clear(); return false; }
    k.push_back('s');
    put<int64_t>(k, n);
    k.append(s, n);
    return true;
  }
  if (tp == &PyList_Type || tp == &PyTuple_Type) {
    if (depth > 2) return false;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
    k.push_back(tp == &PyList_Type ? 'L' : 'U');
    put<int64_t>(k, n);
    PyObject** items = PySequence_Fast_ITEMS(x);
    for (Py_ssize_t i = 0; i < n; i++)
      if (!key_of(items[i], k, ts, depth + 1)) return false;
    return true;
  }
  if (tp == &THPDtypeType) {
    k.push_back('d');
    put<int8_t>(k, static_cast<int8_t>(reinterpret_cast<THPDtype*>(x)->scalar_type));
    return true;
  }
  if (tp == &THPDeviceType) {
    const auto& d = reinterpret_cast<THPDevice*>(x)->device;
    k.push_back('D');
    put<int8_t>(k, static_cast<int8_t>(d.type()));
    put<int8_t>(k, static_cast<int8_t>(d.index()));
    return true;
  }
  if (tp == &THPMemoryFormatType) {
    k.push_back('m');
    put<int8_t>(k, static_cast<int8_t>(reinterpret_cast<THPMemoryFormat*>(x)->memory_format));
    return true;
  }
  if (tp == &THPLayoutType) {
    k.push_back('l');
    put<int8_t>(k, static_cast<int8_t>(reinterpret_cast<THPLayout*>(x)->layout));
    return true;
  }
  return false;  // anything else (generators, ...): the Python path
}

// the key of a Python call's arguments: their count, each positional argument, then each
// keyword argument as 'k', its name and its value (the order the holder builds them in)
bool key_args(PyObject* args, PyObject* kwargs, std::string& key, Tensors& ts) {
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  put<int32_t>(key, static_cast<int32_t>(n));
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < n; i++) ok = key_of(PyTuple_GET_ITEM(args, i), key, ts, 0);
  if (ok && kwargs != nullptr) {
    Py_ssize_t pos = 0;
    PyObject *kk, *vv;
    while (ok && PyDict_Next(kwargs, &pos, &kk, &vv)) {
      Py_ssize_t len = 0;
      const char* s = PyUnicode_AsUTF8AndSize(kk, &len);
      if (s == nullptr) { PyErr_Clear(); return false; }
      key.push_back('k');
      key.append(s, len + 1);
      ok = key_of(vv, key, ts, 0);
    }
  }
  return ok;
}

// ---- the hit path ----

// An input tensor's storage array and what decides its view spec besides the tensor's own
// metadata (which the key holds): the array's dtype, shape and weak type, all three read from
// its aval (jax's ShapedArray: immutable). A hit reads only the aval: an entry remembers the
// aval objects it was matched with (a program's outputs share one aval object per output), so
// the fields are read and compared only for an aval it has not seen.
struct InArray {
  PyObject* arr = nullptr;    // owned
  PyObject* aval = nullptr;   // owned
  PyObject* dtype = nullptr;  // owned; read from the aval on demand (`fields`)
  c10::SmallVector<int64_t, 6> shape;  // (no heap allocation per call)
  bool weak = false;
  bool have_fields = false;
  InArray() = default;
  InArray(const InArray&) = delete;
  InArray& operator=(const InArray&) = delete;
  InArray(InArray&& o) noexcept
      : arr(o.arr), aval(o.aval), dtype(o.dtype), shape(std::move(o.shape)), weak(o.weak),
        have_fields(o.have_fields) {
    o.arr = o.aval = o.dtype = nullptr;
  }
  ~InArray() {
    Py_XDECREF(arr);
    Py_XDECREF(aval);
    Py_XDECREF(dtype);
  }
  // the aval's dtype, shape and weak type; false (no Python error set) if it has none
  bool fields() {
    if (have_fields) return true;
    dtype = PyObject_GetAttr(aval, s_dtype);
    if (dtype == nullptr) { PyErr_Clear(); return false; }
    PyObject* sh = PyObject_GetAttr(aval, s_shape);
    if (sh == nullptr || !PyTuple_Check(sh)) { PyErr_Clear(); Py_XDECREF(sh); return false; }
    Py_ssize_t n = PyTuple_GET_SIZE(sh);
    shape.resize(n);
    for (Py_ssize_t j = 0; j < n; j++) {
      long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(sh, j));
      if (d == -1 && PyErr_Occurred()) { PyErr_Clear(); Py_DECREF(sh); return false; }
      shape[j] = d;
    }
    Py_DECREF(sh);
    PyObject* w = PyObject_GetAttr(aval, s_weak_type);
    if (w == nullptr) { PyErr_Clear(); return false; }
    weak = w == Py_True;
    Py_DECREF(w);
    have_fields = true;
    return true;
  }
};

// The storage arrays of the input tensors and their avals; false (no Python error set) if one
// has none that is a jax Array (a storage that lost its buffer: the Python path decides).
using InArrays = c10::SmallVector<InArray, 6>;

// An ArrayImpl's (exact type) `aval`: its property's getter called with the array, as the
// property would (no attribute lookup); new reference or nullptr with a Python error set.
inline PyObject* array_aval(PyObject* arr) {
  if (g_aval_get != nullptr) return PyObject_Vectorcall(g_aval_get, &arr, 1, nullptr);
  return PyObject_GetAttr(arr, s_aval);
}

// A tensor's storage's `_tpu_buffer`: a new reference, or nullptr with no Python error set.
PyObject* storage_buffer(const at::Tensor& t) {
  PyObject* st = THPStorage_Wrap(t.storage());
  if (st == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  PyObject* buf = PyObject_GetAttr(st, s_tpu_buffer);
  Py_DECREF(st);
  if (buf == nullptr) PyErr_Clear();
  return buf;
}

bool gather(const Tensors& ts, InArrays& in) {
  in.resize(ts.size());
  for (size_t i = 0; i < ts.size(); i++) {
    InArray& a = in[i];
    PyObject* buf = storage_buffer(ts[i]);
    if (buf == nullptr) return false;
    if (g_array_slot >= 0 && reinterpret_cast<PyObject*>(Py_TYPE(buf)) == g_buffer_type) {
      // a Buffer's `array` slot, read as its member descriptor would (no attribute lookup;
      // an unset slot, or a subclass such as Fused's PendingBuffer, takes the lookup)
      a.arr = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(buf) + g_array_slot);
      Py_XINCREF(a.arr);
    }
    if (a.arr == nullptr) a.arr = PyObject_GetAttr(buf, s_array);
    Py_DECREF(buf);
    if (a.arr == nullptr) { PyErr_Clear(); return false; }
    if (reinterpret_cast<PyObject*>(Py_TYPE(a.arr)) != g_array_type) return false;
    a.aval = array_aval(a.arr);
    if (a.aval == nullptr) { PyErr_Clear(); return false; }
  }
  return true;
}

// Whether entry `e` was made for these arrays (their dtypes, shapes and weak types): an aval
// the entry has seen matches at once; another one's fields are compared (and, equal, the aval
// is remembered: up to kSeenAvals per input, the oldest forgotten first).
bool matches(const Entry& e, InArrays& in) {
  if (e.in_dtypes.size() != in.size()) return false;
  for (size_t i = 0; i < in.size(); i++) {
    auto& seen = e.seen_avals[i];
    if (std::find(seen.begin(), seen.end(), in[i].aval) != seen.end()) continue;
    if (!in[i].fields()) return false;
    const auto& want = e.in_shapes[i];
    if (in[i].weak != (e.in_weak[i] != 0) || in[i].shape.size() != want.size() ||
        !std::equal(want.begin(), want.end(), in[i].shape.begin()))
      return false;
    if (in[i].dtype != e.in_dtypes[i]) {
      int eq = PyObject_RichCompareBool(in[i].dtype, e.in_dtypes[i], Py_EQ);
      if (eq < 0) PyErr_Clear();
      if (eq != 1) return false;
    }
    if (seen.size() >= kSeenAvals) {
      Py_DECREF(seen.front());
      seen.erase(seen.begin());
    }
    Py_INCREF(in[i].aval);
    seen.push_back(in[i].aval);
  }
  return true;
}

// A new tpu tensor whose storage's `_tpu_buffer` is `buf` (borrowed): a Buffer holding an array
// (`wrap`) or the Fused executor's PendingBuffer (buffer.wrap_pending); new reference or
// nullptr with a Python error set.
PyObject* tensor_on(PyObject* buf, const OutMeta& m) {
  PyObject* nf = PyList_GetItem(g_next_free, 0);  // borrowed
  if (nf == nullptr) return nullptr;
  long long addr = PyLong_AsLongLong(nf);
  if (addr == -1 && PyErr_Occurred()) return nullptr;
  PyObject* next = PyLong_FromLongLong(addr + (m.nbytes / kAlign + 1) * kAlign);
  if (next == nullptr) return nullptr;
  if (PyList_SetItem(g_next_free, 0, next) < 0) return nullptr;  // steals `next`
  PyObject* st = nullptr;
  PyObject* res = nullptr;
  try {
    c10::Storage storage(c10::Storage::use_byte_size_t(), m.nbytes,
                         c10::DataPtr(reinterpret_cast<void*>(addr),
                                      c10::Device(c10::DeviceType::PrivateUse1, 0)),
                         /*allocator=*/nullptr, /*resizable=*/false);
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
        caffe2::TypeMeta::fromScalarType(m.dtype));
    impl->set_sizes_and_strides(m.sizes, m.strides);
    at::Tensor t(std::move(impl));
    st = THPStorage_Wrap(storage);
    if (st == nullptr || PyObject_SetAttr(st, s_tpu_buffer, buf) < 0) goto fail;
    res = THPVariable_Wrap(std::move(t));
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
  }
fail:
  Py_XDECREF(st);
  return res;
}

// A new tpu tensor whose storage holds `arr` (buffer.wrap_noted); new reference or nullptr
// with a Python error set.
PyObject* wrap(PyObject* arr, const OutMeta& m) {
  PyObject* buf = reinterpret_cast<PyTypeObject*>(g_buffer_type)
                      ->tp_new(reinterpret_cast<PyTypeObject*>(g_buffer_type), g_empty, nullptr);
  if (buf == nullptr) return nullptr;
  if (g_array_slot >= 0) {  // Buffer.array's slot, written as its member descriptor would
    PyObject** slot = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(buf) + g_array_slot);
    Py_INCREF(arr);
    Py_XSETREF(*slot, arr);
  } else if (PyObject_SetAttr(buf, s_array, arr) < 0) {
    Py_DECREF(buf);
    return nullptr;
  }
  PyObject* res = tensor_on(buf, m);
  Py_DECREF(buf);
  return res;
}

// One result of a hit: its constant, the output tensor on `arr`, or that tensor restrided to
// its order (the permuted copy runs through the dispatcher: `clone`'s own kernel, a fast-path
// hit itself, as `_like_layout`'s `.contiguous()` is in Python); new reference or nullptr
// with a Python error set.
PyObject* restride(PyObject* w, const OutMeta& m);

PyObject* wrap_out(PyObject* arr, const Entry& e, const OutMeta& m) {
  if (m.konst >= 0) {
    PyObject* c = e.out_consts[m.konst];
    Py_INCREF(c);
    return c;
  }
  return restride(wrap(arr, m), m);
}

// Output tensor `w` (a new reference, or nullptr: passed on) restrided to `m`'s order, if it
// has one; steals `w`; new reference or nullptr with a Python error set.
PyObject* restride(PyObject* w, const OutMeta& m) {
  if (w == nullptr || m.order.empty()) return w;
  try {
    at::Tensor t = THPVariable_Unpack(w).permute(m.order).contiguous().permute(m.inverse);
    Py_DECREF(w);
    return THPVariable_Wrap(std::move(t));
  } catch (python_error& err) {
    err.restore();
  } catch (const c10::Error& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what_without_backtrace());
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
  }
  Py_DECREF(w);
  return nullptr;
}

enum HitResult { HIT_OK, HIT_FALLBACK, HIT_ERROR };

HitResult hit(Kernel* self, const Entry& e, InArrays& in, PyObject** result) {
  size_t n = e.plan.size();
  PyObject* small[16];
  std::vector<PyObject*> big;
  PyObject** args = small;
  if (n > 16) { big.resize(n); args = big.data(); }
  for (size_t i = 0; i < n; i++) {
    int p = e.plan[i];
    args[i] = p >= 0 ? in[p].arr : e.consts[-p - 1];  // borrowed: `in` and `e` hold them
  }
  PyObject* call = e.call;
  Py_INCREF(call);
  long long t0 = g_timing.on && tl_depth == 1 ? now_ns() : 0;
  PyObject* out = PyObject_Vectorcall(call, args, n, nullptr);
  if (t0 != 0) tl_call_ns += now_ns() - t0;
  Py_DECREF(call);
  // the call's own references to the storage arrays go now: a write after this op must see
  // only its storage's (donation counts references)
  for (auto& a : in) Py_CLEAR(a.arr);
  if (out == nullptr) {
    // the executable refused the call (or failed): the Python path redoes it and raises
    // what it raises today
    PyErr_Clear();
    bump(c_errors);
    return HIT_FALLBACK;
  }
  if (e.check != nullptr) {  // (results, flag): the flag to the pending checks
    if (!PyTuple_CheckExact(out) || PyTuple_GET_SIZE(out) != 2) {
      Py_DECREF(out);
      bump(c_errors);
      return HIT_FALLBACK;
    }
    PyObject* res_part = PyTuple_GET_ITEM(out, 0);
    PyObject* r = PyObject_CallOneArg(e.check, PyTuple_GET_ITEM(out, 1));
    Py_INCREF(res_part);
    Py_DECREF(out);
    out = res_part;
    if (r == nullptr) { Py_DECREF(out); return HIT_ERROR; }
    Py_DECREF(r);
  }
  size_t n_out = e.outs.size();
  bool shape_ok = e.tuple_out ? (PyTuple_CheckExact(out) && PyTuple_GET_SIZE(out) == (Py_ssize_t)n_out)
                              : reinterpret_cast<PyObject*>(Py_TYPE(out)) == g_array_type;
  for (size_t i = 0; shape_ok && e.tuple_out && i < n_out; i++)  // (a constant's slot: no array)
    shape_ok = (reinterpret_cast<PyObject*>(Py_TYPE(PyTuple_GET_ITEM(out, i))) == g_array_type) ==
               (e.outs[i].konst < 0);
  if (!shape_ok) {
    Py_DECREF(out);
    bump(c_errors);
    return HIT_FALLBACK;
  }
  // inflight.note: an output already computed is not kept (its first check, inlined)
  PyObject* first = e.tuple_out ? PyTuple_GET_ITEM(out, 0) : out;
  PyObject* ready = g_is_ready != nullptr ? PyObject_Vectorcall(g_is_ready, &first, 1, nullptr)
                                          : PyObject_CallMethodNoArgs(first, s_is_ready);
  if (ready == nullptr) PyErr_Clear();
  if (ready != Py_True) {
    PyObject* r = PyObject_CallOneArg(g_note, out);
    if (r == nullptr) { Py_XDECREF(ready); Py_DECREF(out); return HIT_ERROR; }
    Py_DECREF(r);
  }
  Py_XDECREF(ready);
  PyObject* res;
  if (!e.tuple_out) {
    res = wrap_out(out, e, e.outs[0]);
  } else {
    res = PyTuple_New(n_out);
    for (size_t i = 0; res != nullptr && i < n_out; i++) {
      PyObject* w = wrap_out(PyTuple_GET_ITEM(out, i), e, e.outs[i]);
      if (w == nullptr) { Py_CLEAR(res); break; }
      PyTuple_SET_ITEM(res, i, w);
    }
  }
  Py_DECREF(out);
  if (res == nullptr) return HIT_ERROR;
  *result = res;
  return HIT_OK;
}

// ---- Fused recording (eager/fused.py `record`, for a key it recorded before) ----
// In DEFER_AND_FUSE mode an op is recorded, not run: a node (its recording key, traced
// function, argument references, persistent spelling) appended to the pending graph, and
// output tensors whose storages hold PendingBuffers. What `record` derives from the arguments
// (the executor key, each input's view spec and abstract value, the traced function and the
// abstract outputs) is a function of this Kernel's key and of each input's abstract value (a
// pending value's canonical aval, or a computed array's shape and dtype), so an entry made by
// `record` for a call (`install_fused`) replays it: it checks each input's abstract value,
// builds the node's references (a pending input's `ref`, an array or traced scalar as a
// graph input, deduplicated by identity as `_Graph.input_ref` does; a view's offset as a new
// input each time) and makes the outputs. Everything else (a new key, another abstract value,
// a graph task change with the backward cut on, random, mutating, in-place and some layout
// ops: `record` decides what it offers) runs `record` itself.

struct FOut {
  PyObject* aval = nullptr;   // the canonical aval of a pending output (owned), or nullptr
  PyObject* konst = nullptr;  // a constant result (None or a Python scalar; owned)
  OutMeta meta;
};

struct FEntry {
  PyObject *akey = nullptr, *traced = nullptr, *text = nullptr;  // the node's fixed parts (owned)
  // per reference of the node, in order: 'T' a tensor ordinal, 'C' a graph input constant
  // (a traced scalar's value: deduplicated), 'O' a view's offset (appended each time)
  std::vector<char> plan_kind;
  std::vector<int> plan_idx;    // the tensor ordinal, or the index into consts
  std::vector<PyObject*> consts;           // owned
  std::vector<PyObject*> in_avals;         // per tensor ordinal: the canonical aval (owned)
  std::vector<PyObject*> in_dtypes;        // ... its numpy dtype (owned)
  std::vector<std::vector<int64_t>> in_shapes;  // ... its shape
  mutable std::vector<std::vector<PyObject*>> seen;  // jax avals matched per ordinal (owned)
  bool tuple_out = false;
  bool restrided = false;  // some output has an order (restrided once the node is recorded)
  std::vector<FOut> outs;
  // a checked op (registry `check`): the node's last output is its flag, a PendingBuffer of
  // this aval handed to `check` (checks.add with the op's name, exception and message bound),
  // as record does (owned; nullptr: no check)
  PyObject *check_aval = nullptr, *check = nullptr;
  ~FEntry() {
    Py_XDECREF(check_aval);
    Py_XDECREF(check);
    Py_XDECREF(akey);
    Py_XDECREF(traced);
    Py_XDECREF(text);
    for (auto* c : consts) Py_XDECREF(c);
    for (auto* a : in_avals) Py_XDECREF(a);
    for (auto* d : in_dtypes) Py_XDECREF(d);
    for (auto& v : seen)
      for (auto* a : v) Py_XDECREF(a);
    for (auto& o : outs) {
      Py_XDECREF(o.aval);
      Py_XDECREF(o.konst);
    }
  }
};

struct FTable : std::unordered_map<std::string, std::vector<std::shared_ptr<FEntry>>> {};

// set once by setup_fused (fused.install)
PyObject* g_fused = nullptr;       // EagerMode.DEFER_AND_FUSE
// eager/fused.py's globals: `_graph` (a one-element list: the pending _Graph), `MAX_NODES`,
// `CUT_AT_BACKWARD`, `flush`, read at each recording (tests and users may set them)
PyObject* g_fused_globals = nullptr;
PyObject* g_pb_type = nullptr;     // fused.PendingBuffer
PyObject* g_task_fn = nullptr;     // torch._C._current_graph_task_id
Py_ssize_t g_pb_value = -1, g_pb_ref = -1, g_pb_aval = -1;  // PendingBuffer's slot offsets
PyObject *s_nodes, *s_inputs, *s_input_ids, *s_pending, *s_task, *s_i, *s_n, *s_size_limit,
    *s_graph, *s_max_nodes, *s_cut_at_backward, *s_flush;
PyObject *c_recorded, *c_frecords, *c_fmisses, *c_finstalls, *c_ffallbacks;

inline PyObject*& slot_at(PyObject* o, Py_ssize_t off) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off);
}

// One input tensor of a recording hit: its pending reference, or its computed array.
struct FIn {
  PyObject* ref = nullptr;   // owned: the PendingBuffer's ("n", node, output)
  PyObject* arr = nullptr;   // owned: the storage's array
  PyObject* aval = nullptr;  // owned: the PendingBuffer's canonical aval, or the array's aval
  FIn() = default;
  FIn(const FIn&) = delete;
  FIn& operator=(const FIn&) = delete;
  FIn(FIn&& o) noexcept : ref(o.ref), arr(o.arr), aval(o.aval) { o.ref = o.arr = o.aval = nullptr; }
  ~FIn() {
    Py_XDECREF(ref);
    Py_XDECREF(arr);
    Py_XDECREF(aval);
  }
};
using FIns = c10::SmallVector<FIn, 6>;

// What `record` reads of each input: false (no Python error set) where one is neither a
// pending value still to be computed nor a jax Array (`record` decides: it raises for a lost
// value, passes a CPU scalar...).
bool fgather(const Tensors& ts, FIns& in) {
  in.resize(ts.size());
  for (size_t i = 0; i < ts.size(); i++) {
    FIn& a = in[i];
    PyObject* buf = storage_buffer(ts[i]);
    if (buf == nullptr) return false;
    if (reinterpret_cast<PyObject*>(Py_TYPE(buf)) == g_pb_type) {
      PyObject* v = slot_at(buf, g_pb_value);
      if (v == nullptr || v == Py_None) {  // pending: its reference and canonical aval
        PyObject* r = slot_at(buf, g_pb_ref);
        PyObject* av = slot_at(buf, g_pb_aval);
        if (r == nullptr || r == Py_None || av == nullptr) { Py_DECREF(buf); return false; }
        Py_INCREF(r);
        Py_INCREF(av);
        a.ref = r;
        a.aval = av;
        Py_DECREF(buf);
        continue;
      }
      Py_INCREF(v);
      a.arr = v;
    } else {
      a.arr = PyObject_GetAttr(buf, s_array);
      if (a.arr == nullptr) { PyErr_Clear(); Py_DECREF(buf); return false; }
    }
    Py_DECREF(buf);
    if (reinterpret_cast<PyObject*>(Py_TYPE(a.arr)) != g_array_type) return false;
    a.aval = array_aval(a.arr);
    if (a.aval == nullptr) { PyErr_Clear(); return false; }
  }
  return true;
}

// Whether entry `e` was recorded for these inputs' abstract values: a pending input's
// canonical aval is the entry's (identity); a computed array's shape and dtype are the
// entry's (`record` keys it by `_aval(shape, dtype)`, weak type aside).
bool fmatches(const FEntry& e, FIns& in) {
  if (e.in_avals.size() != in.size()) return false;
  for (size_t i = 0; i < in.size(); i++) {
    if (in[i].ref != nullptr) {
      if (in[i].aval != e.in_avals[i]) return false;
      continue;
    }
    auto& seen = e.seen[i];
    if (std::find(seen.begin(), seen.end(), in[i].aval) != seen.end()) continue;
    PyObject* dt = PyObject_GetAttr(in[i].aval, s_dtype);
    if (dt == nullptr) { PyErr_Clear(); return false; }
    int eq = dt == e.in_dtypes[i] ? 1 : PyObject_RichCompareBool(dt, e.in_dtypes[i], Py_EQ);
    Py_DECREF(dt);
    if (eq != 1) { if (eq < 0) PyErr_Clear(); return false; }
    PyObject* sh = PyObject_GetAttr(in[i].aval, s_shape);
    if (sh == nullptr || !PyTuple_Check(sh)) { PyErr_Clear(); Py_XDECREF(sh); return false; }
    const auto& want = e.in_shapes[i];
    bool same = PyTuple_GET_SIZE(sh) == static_cast<Py_ssize_t>(want.size());
    for (size_t j = 0; same && j < want.size(); j++) {
      long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(sh, j));
      if (d == -1 && PyErr_Occurred()) PyErr_Clear();
      same = d == want[j];
    }
    Py_DECREF(sh);
    if (!same) return false;
    if (seen.size() >= kSeenAvals) {
      Py_DECREF(seen.front());
      seen.erase(seen.begin());
    }
    Py_INCREF(in[i].aval);
    seen.push_back(in[i].aval);
  }
  return true;
}

// `_Graph.input_ref`: ("i", index) of `obj` among the graph's inputs, added once per object;
// new reference or nullptr with a Python error set.
PyObject* input_ref(PyObject* inputs, PyObject* ids, PyObject* obj) {
  PyObject* k = PyLong_FromVoidPtr(obj);  // id(obj)
  if (k == nullptr) return nullptr;
  PyObject* idx = PyDict_GetItemWithError(ids, k);  // borrowed
  if (idx != nullptr) {
    Py_INCREF(idx);
  } else {
    if (PyErr_Occurred()) { Py_DECREF(k); return nullptr; }
    idx = PyLong_FromSsize_t(PyList_GET_SIZE(inputs));
    if (idx == nullptr || PyDict_SetItem(ids, k, idx) < 0 || PyList_Append(inputs, obj) < 0) {
      Py_XDECREF(idx);
      Py_DECREF(k);
      return nullptr;
    }
  }
  Py_DECREF(k);
  PyObject* r = PyTuple_Pack(2, s_i, idx);
  Py_DECREF(idx);
  return r;
}

// A new PendingBuffer(ref, aval), as its __init__ sets it; new reference or nullptr.
PyObject* new_pending(PyObject* ref, PyObject* aval) {
  auto* tp = reinterpret_cast<PyTypeObject*>(g_pb_type);
  PyObject* pb = tp->tp_new(tp, g_empty, nullptr);
  if (pb == nullptr) return nullptr;
  Py_INCREF(Py_None);
  Py_XSETREF(slot_at(pb, g_pb_value), Py_None);
  Py_INCREF(ref);
  Py_XSETREF(slot_at(pb, g_pb_ref), ref);
  Py_INCREF(aval);
  Py_XSETREF(slot_at(pb, g_pb_aval), aval);
  return pb;
}

// The pending Fused graph's owner: the thread recording into or cutting it now (0: none),
// and how deep (recording may cut, a cut's Python may record). Recording and cutting touch
// one graph that every thread shares; a thread whose op finds another owner takes the Python
// path, whose fused.record waits (fused_enter, the GIL released) until the owner is done.
// Uncontended, taking it is two integer writes under the GIL.
unsigned long g_fowner = 0;
long g_fdepth = 0;

bool fused_try_enter() {
  unsigned long me = PyThread_get_thread_ident();
  if (g_fowner == me) {
    g_fdepth++;
    return true;
  }
  if (g_fowner != 0) return false;
  g_fowner = me;
  g_fdepth = 1;
  return true;
}

void fused_exit() {
  if (g_fdepth > 0 && g_fowner == PyThread_get_thread_ident() && --g_fdepth == 0) g_fowner = 0;
}

struct FusedHold {
  bool held;
  FusedHold() : held(fused_try_enter()) {}
  ~FusedHold() {
    if (held) fused_exit();
  }
};

PyObject* m_fused_enter(PyObject*, PyObject*) {
  while (!fused_try_enter()) {
    Py_BEGIN_ALLOW_THREADS
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

PyObject* m_fused_exit(PyObject*, PyObject*) {
  fused_exit();
  Py_RETURN_NONE;
}

enum RecordResult { REC_OK, REC_PYTHON, REC_ERROR };

// Record one call by entry `e` into the pending graph (fused.record's steps for a known key).
RecordResult frecord(const FEntry& e, FIns& in, PyObject** result) {
  PyObject* graph = PyDict_GetItemWithError(g_fused_globals, s_graph);  // borrowed
  PyObject* cut = graph == nullptr ? nullptr
                                   : PyDict_GetItemWithError(g_fused_globals, s_cut_at_backward);
  PyObject* max_nodes = cut == nullptr ? nullptr
                                       : PyDict_GetItemWithError(g_fused_globals, s_max_nodes);
  if (max_nodes == nullptr || !PyList_CheckExact(graph) || PyList_GET_SIZE(graph) != 1 ||
      !PyLong_CheckExact(max_nodes)) {
    if (PyErr_Occurred()) return REC_ERROR;
    return REC_PYTHON;
  }
  int cutting = PyObject_IsTrue(cut);
  if (cutting < 0) return REC_ERROR;
  PyObject* g = PyList_GET_ITEM(graph, 0);
  Py_INCREF(g);
  PyObject *nodes = nullptr, *inputs = nullptr, *ids = nullptr, *pending = nullptr,
           *refs = nullptr, *node = nullptr, *res = nullptr;
  RecordResult rc = REC_ERROR;
  Py_ssize_t node_index = 0;
  size_t n = e.plan_kind.size();
  if (cutting) {  // the backward cut: a graph task change is record's to handle
    PyObject* task = PyObject_CallNoArgs(g_task_fn);
    PyObject* gtask = task == nullptr ? nullptr : PyObject_GetAttr(g, s_task);
    int same = gtask == nullptr ? -1 : PyObject_RichCompareBool(task, gtask, Py_EQ);
    Py_XDECREF(task);
    Py_XDECREF(gtask);
    if (same != 1) {
      if (same < 0) goto done;
      rc = REC_PYTHON;
      goto done;
    }
  }
  nodes = PyObject_GetAttr(g, s_nodes);
  inputs = nodes == nullptr ? nullptr : PyObject_GetAttr(g, s_inputs);
  ids = inputs == nullptr ? nullptr : PyObject_GetAttr(g, s_input_ids);
  pending = ids == nullptr ? nullptr : PyObject_GetAttr(g, s_pending);
  if (pending == nullptr) goto done;
  if (!PyList_CheckExact(nodes) || !PyList_CheckExact(inputs) || !PyDict_CheckExact(ids) ||
      !PyList_CheckExact(pending)) {
    rc = REC_PYTHON;  // (a graph being flushed: record decides)
    goto done;
  }
  refs = PyTuple_New(static_cast<Py_ssize_t>(n));
  if (refs == nullptr) goto done;
  for (size_t i = 0; i < n; i++) {
    PyObject* r = nullptr;
    char kind = e.plan_kind[i];
    if (kind == 'T') {
      FIn& a = in[e.plan_idx[i]];
      if (a.ref != nullptr) {
        Py_INCREF(a.ref);
        r = a.ref;
      } else {
        r = input_ref(inputs, ids, a.arr);
      }
    } else if (kind == 'C') {
      r = input_ref(inputs, ids, e.consts[e.plan_idx[i]]);
    } else {  // 'O': a new input each time, as record does
      PyObject* idx = PyLong_FromSsize_t(PyList_GET_SIZE(inputs));
      if (idx != nullptr && PyList_Append(inputs, e.consts[e.plan_idx[i]]) == 0)
        r = PyTuple_Pack(2, s_i, idx);
      Py_XDECREF(idx);
    }
    if (r == nullptr) goto done;
    PyTuple_SET_ITEM(refs, i, r);
  }
  // the inputs' arrays: the graph holds them now (donation at the cut counts references)
  for (auto& a : in) Py_CLEAR(a.arr);
  node_index = PyList_GET_SIZE(nodes);
  node = PyTuple_Pack(4, e.akey, e.traced, refs, e.text);
  if (node == nullptr || PyList_Append(nodes, node) < 0) goto done;
  bump(c_recorded);
  bump(c_frecords);
  {
    size_t n_out = e.outs.size();
    if (e.tuple_out) {
      res = PyTuple_New(static_cast<Py_ssize_t>(n_out));
      if (res == nullptr) goto done;
    }
    for (size_t i = 0; i < n_out; i++) {
      const FOut& o = e.outs[i];
      PyObject* w;
      if (o.aval == nullptr) {
        Py_INCREF(o.konst);
        w = o.konst;
      } else {
        PyObject* ref = Py_BuildValue("(Onn)", s_n, node_index, static_cast<Py_ssize_t>(i));
        PyObject* pb = ref == nullptr ? nullptr : new_pending(ref, o.aval);
        Py_XDECREF(ref);
        if (pb == nullptr || PyList_Append(pending, pb) < 0) {
          Py_XDECREF(pb);
          Py_CLEAR(res);
          goto done;
        }
        w = tensor_on(pb, o.meta);
        Py_DECREF(pb);
      }
      if (w == nullptr) { Py_CLEAR(res); goto done; }
      if (e.tuple_out) PyTuple_SET_ITEM(res, i, w);
      else res = w;
    }
  }
  if (e.check != nullptr) {  // the flag: output n_out of the node, to the pending checks
    PyObject* ref = Py_BuildValue("(Onn)", s_n, node_index,
                                  static_cast<Py_ssize_t>(e.outs.size()));
    PyObject* pb = ref == nullptr ? nullptr : new_pending(ref, e.check_aval);
    Py_XDECREF(ref);
    PyObject* r = pb == nullptr || PyList_Append(pending, pb) < 0
                      ? nullptr : PyObject_CallOneArg(e.check, pb);
    Py_XDECREF(pb);
    if (r == nullptr) { Py_CLEAR(res); goto done; }
    Py_DECREF(r);
  }
  if (node_index + 1 >= PyLong_AsSsize_t(max_nodes)) {
    PyObject* flush = PyDict_GetItemWithError(g_fused_globals, s_flush);  // borrowed
    PyObject* r = flush == nullptr ? nullptr : PyObject_CallOneArg(flush, s_size_limit);
    if (r == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "fused.flush is gone");
      Py_CLEAR(res);
      goto done;
    }
    Py_DECREF(r);
  }
  if (e.restrided) {  // as the Python kernel's eager_layout runs on record's results
    for (size_t i = 0; i < e.outs.size(); i++) {
      if (e.outs[i].meta.order.empty() || e.outs[i].aval == nullptr) continue;
      if (!e.tuple_out) {
        res = restride(res, e.outs[i].meta);
        if (res == nullptr) goto done;
        continue;
      }
      PyObject* was = PyTuple_GET_ITEM(res, i);
      Py_INCREF(was);
      PyObject* w = restride(was, e.outs[i].meta);  // (takes the reference to `was`)
      if (w == nullptr) { Py_CLEAR(res); goto done; }
      PyTuple_SET_ITEM(res, i, w);  // res is new: the tuple's own reference goes
      Py_DECREF(was);
    }
  }
  *result = res;
  rc = REC_OK;
done:
  Py_XDECREF(node);
  Py_XDECREF(refs);
  Py_XDECREF(pending);
  Py_XDECREF(ids);
  Py_XDECREF(inputs);
  Py_XDECREF(nodes);
  Py_DECREF(g);
  return rc;
}

// The recording path of Kernel_serve (the key made): replay an entry, or run `record` with
// this thread's pending key set (it may install one).

PyObject* forward(Kernel* self, PyObject* args, PyObject* kwargs);

// `fwd()`: the Python kernel's call (new reference or nullptr with a Python error set), made
// with this thread's pending key set where no entry serves the call.
template <class Fwd>
PyObject* record_or(Kernel* self, Fwd&& fwd, std::string& key, const Tensors& ts, bool* served) {
  FusedHold hold;  // not held: another thread owns the graph, the Python path waits for it
  auto it = hold.held ? self->ftable->find(key) : self->ftable->end();
  if (it != self->ftable->end()) {
    std::shared_ptr<FEntry> e;  // kept alive while Python code runs (a size-limit flush)
    FIns in;
    try {
      if (fgather(ts, in)) {
        for (auto& v : it->second)
          if (fmatches(*v, in)) { e = v; break; }
      }
    } catch (const std::exception& ex) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, ex.what());
      return nullptr;
    }
    if (e) {
      PyObject* res = nullptr;
      RecordResult r;
      try {
        r = frecord(*e, in, &res);
      } catch (const std::exception& ex) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, ex.what());
        return nullptr;
      }
      if (r == REC_OK) {
        *served = true;
        return res;
      }
      if (r == REC_ERROR) return nullptr;
    } else {
      bump(c_ffallbacks);
    }
  } else {
    bump(c_fmisses);
  }
  Pending pending;
  pending.kernel = self;
  pending.key = std::move(key);
  pending.n_tensors = static_cast<int>(ts.size());
  pending.fused = true;
  Pending* saved = tl_pending;
  tl_pending = &pending;
  PyObject* res = fwd();
  tl_pending = saved;
  return res;
}

PyObject* Kernel_record(Kernel* self, PyObject* args, PyObject* kwargs, std::string& key,
                        const Tensors& ts, bool* served) {
  return record_or(self, [&]() { return forward(self, args, kwargs); }, key, ts, served);
}

// ---- the Kernel type ----

PyObject* forward(Kernel* self, PyObject* args, PyObject* kwargs) {
  return PyObject_Call(self->fn, args, kwargs);
}

// What registry.matmul_precision() decides from, into the key: torch's float32 matmul
// precision (read in C++), and where it is "highest" JAX's default matmul precision as set
// (its config state's value, a C++ read: a finer key than the name the Python function maps
// it to); registry.matmul_precision itself for anything else. False with a Python error set.
bool key_precision(std::string& key) {
  auto tp = at::globalContext().float32MatmulPrecision();
  key.push_back('p');
  put<int8_t>(key, static_cast<int8_t>(tp));
  if (tp != at::Float32MatmulPrecision::HIGHEST) return true;  // "high"/"default" whatever JAX says
  PyObject* v = g_jax_precision != nullptr ? PyObject_GetAttr(g_jax_precision, s_value) : nullptr;
  if (v == nullptr) PyErr_Clear();
  if (v == Py_None) {
    key.push_back('n');
    Py_DECREF(v);
    return true;
  }
  if (v == nullptr || !PyUnicode_CheckExact(v)) {  // the Python function's own answer
    Py_XDECREF(v);
    v = PyObject_CallNoArgs(g_precision);
    if (v == nullptr) return false;
    key.push_back('P');
  } else {
    key.push_back('s');
  }
  Py_ssize_t len = 0;
  const char* s = PyUnicode_AsUTF8AndSize(v, &len);
  if (s == nullptr) { Py_DECREF(v); return false; }
  put<int64_t>(key, len);
  key.append(s, len);
  Py_DECREF(v);
  return true;
}

PyObject* Kernel_serve(Kernel* self, PyObject* args, PyObject* kwargs, bool* served);
thread_local std::string tl_key_spare;  // Kernel_serve's key buffer between calls

// a call's key buffer: this thread's spare one (its capacity kept between calls; a nested call
// finds none and allocates its own), handed back on return unless moved on (a miss)
struct SpareKey {
  std::string key;
  SpareKey() {
    key.swap(tl_key_spare);
    key.clear();
    if (key.capacity() < 128) key.reserve(128);
  }
  ~SpareKey() {
    if (key.capacity() > tl_key_spare.capacity()) tl_key_spare.swap(key);
  }
};

// the timing of one outermost kernel call (set_timing): a hit's time and its executable call's,
// or the Python path's
inline void note_timing(long long t0, bool served) {
  long long dt = now_ns() - t0;
  if (served) {
    g_timing.hits++;
    g_timing.hit_ns += dt;
    g_timing.call_ns += tl_call_ns;
  } else {
    g_timing.python++;
    g_timing.python_ns += dt;
  }
}

PyObject* Kernel_call(PyObject* obj, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<Kernel*>(obj);
  if (!g_timing.on) {
    bool served;
    return Kernel_serve(self, args, kwargs, &served);
  }
  tl_depth++;
  bool served = false;
  long long t0 = tl_depth == 1 ? now_ns() : 0;
  tl_call_ns = tl_depth == 1 ? 0 : tl_call_ns;
  PyObject* res = Kernel_serve(self, args, kwargs, &served);
  if (tl_depth == 1) note_timing(t0, served);
  tl_depth--;
  return res;
}

PyObject* Kernel_serve(Kernel* self, PyObject* args, PyObject* kwargs, bool* served) {
  *served = false;
  if (!g_enabled || g_mode_state == nullptr) return forward(self, args, kwargs);
  PyObject* mode = PyDict_GetItemWithError(g_mode_state, s_mode);  // borrowed
  bool fused = false;
  if (mode != g_strict) {
    if (mode == nullptr) PyErr_Clear();
    if (mode == nullptr || mode != g_fused) {
      bump(c_bypassed);
      return forward(self, args, kwargs);
    }
    fused = true;  // DEFER_AND_FUSE: the op is recorded (Kernel_record)
  }
  SpareKey spare;
  std::string& key = spare.key;
  Tensors ts;
  bool ok = true;
  try {
    ok = key_args(args, kwargs, key, ts);
  } catch (...) {
    PyErr_Clear();
    ok = false;
  }
  // (a factory, no tensor: keyed like any op; the Python path installs its entry only on a
  // one-device platform, where every program is bound to tpu:0, as every output here is)
  if (!ok) {
    bump(c_uncacheable);
    return forward(self, args, kwargs);
  }
  put<int8_t>(key, static_cast<int8_t>(c10::get_default_dtype_as_scalartype()));
  if (self->reads_precision && !key_precision(key)) return nullptr;
  if (fused) return Kernel_record(self, args, kwargs, key, ts, served);
  auto it = self->table->find(key);
  if (it != self->table->end()) {
    std::shared_ptr<Entry> e;  // kept alive while the GIL may be released
    InArrays in;
    try {
      if (gather(ts, in)) {
        for (auto& v : it->second)
          if (matches(*v, in)) { e = v; break; }
      }
    } catch (const std::exception& ex) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, ex.what());
      return nullptr;
    }
    if (e) {
      PyObject* res = nullptr;
      HitResult r;
      try {
        r = hit(self, *e, in, &res);
      } catch (const std::exception& ex) {  // a C++ error never escapes into the interpreter
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, ex.what());
        return nullptr;
      }
      if (r == HIT_OK) {
        *served = true;
        bump(c_hits);
        bump(c_cache_hits);
        return res;
      }
      if (r == HIT_ERROR) return nullptr;
      // the executable refused the arrays: forget the entry, let Python decide again
      auto again = self->table->find(key);  // (the call may have changed the table)
      if (again != self->table->end()) {
        auto& vs = again->second;
        for (size_t i = 0; i < vs.size(); i++)
          if (vs[i] == e) { vs.erase(vs.begin() + i); break; }
        if (vs.empty()) self->table->erase(again);
      }
    } else {
      // no entry for these storage arrays (another shape or dtype behind the same tensor
      // metadata, or none): the Python path runs, and may add one
      bump(c_errors);
    }
  } else {
    bump(c_misses);
  }
  Pending pending;
  pending.kernel = self;
  pending.key = std::move(key);
  pending.n_tensors = static_cast<int>(ts.size());
  Pending* saved = tl_pending;
  tl_pending = &pending;
  PyObject* res = forward(self, args, kwargs);
  tl_pending = saved;
  return res;
}

void Kernel_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<Kernel*>(obj);
  Py_XDECREF(self->fn);
  Py_XDECREF(self->lowering);
  Py_XDECREF(self->name);
  delete self->table;
  delete self->ftable;
  auto& ks = all_kernels();
  for (size_t i = 0; i < ks.size(); i++)
    if (ks[i] == self) { ks.erase(ks.begin() + i); break; }
  Py_TYPE(obj)->tp_free(obj);
}

PyObject* Kernel_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *fn, *lowering, *name;
  int reads_precision = 0;
  if (!PyArg_ParseTuple(args, "OOUp", &fn, &lowering, &name, &reads_precision)) return nullptr;
  auto* self = reinterpret_cast<Kernel*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  Py_INCREF(fn);
  Py_INCREF(lowering);
  Py_INCREF(name);
  self->fn = fn;
  self->lowering = lowering;
  self->name = name;
  self->reads_precision = reads_precision;
  self->table = new Table();
  self->ftable = new FTable();
  all_kernels().push_back(self);
  return reinterpret_cast<PyObject*>(self);
}

PyObject* Kernel_size(PyObject* obj, PyObject*) {
  return PyLong_FromSize_t(reinterpret_cast<Kernel*>(obj)->table->size());
}

PyObject* Kernel_clear(PyObject* obj, PyObject*) {
  reinterpret_cast<Kernel*>(obj)->table->clear();
  reinterpret_cast<Kernel*>(obj)->ftable->clear();
  Py_RETURN_NONE;
}

PyMethodDef Kernel_methods[] = {
    {"size", Kernel_size, METH_NOARGS, "entries in this op's table"},
    {"clear", Kernel_clear, METH_NOARGS, "forget this op's entries"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject KernelType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ---- module functions ----

PyObject* m_setup(PyObject*, PyObject* args) {
  PyObject *mode_state, *strict, *buffer_type, *next_free, *note, *array_type, *precision,
      *counters;
  if (!PyArg_ParseTuple(args, "O!OOO!OOOO!", &PyDict_Type, &mode_state, &strict, &buffer_type,
                        &PyList_Type, &next_free, &note, &array_type, &precision,
                        &PyDict_Type, &counters))
    return nullptr;
  PyObject** slots[] = {&g_mode_state, &g_strict, &g_buffer_type, &g_next_free,
                        &g_note, &g_array_type, &g_precision, &g_counters};
  PyObject* vals[] = {mode_state, strict, buffer_type, next_free, note, array_type, precision,
                      counters};
  for (int i = 0; i < 8; i++) {
    Py_INCREF(vals[i]);
    Py_XSETREF(*slots[i], vals[i]);
  }
  Py_XSETREF(g_is_ready, PyObject_GetAttr(array_type, s_is_ready));
  if (g_is_ready == nullptr) PyErr_Clear();
  // ArrayImpl's `aval` (a property: a data descriptor, so the instance never overrides it)
  Py_CLEAR(g_aval_get);
  PyObject* prop = PyObject_GetAttr(array_type, s_aval);  // the property itself, from the type
  if (prop == nullptr) {
    PyErr_Clear();
  } else {
    if (Py_TYPE(prop) == &PyProperty_Type) {
      PyObject* fget = PyObject_GetAttrString(prop, "fget");
      if (fget == nullptr) PyErr_Clear();
      if (fget == Py_None) Py_CLEAR(fget);
      g_aval_get = fget;
    }
    Py_DECREF(prop);
  }
  // Buffer's `array` (a __slots__ member: an object slot at a fixed offset)
  g_array_slot = -1;
  PyObject* d = PyObject_GetAttr(buffer_type, s_array);
  if (d == nullptr) {
    PyErr_Clear();
  } else {
    if (Py_TYPE(d) == &PyMemberDescr_Type) {
      PyMemberDef* md = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
      if (md->type == T_OBJECT_EX && !(md->flags & READONLY)) g_array_slot = md->offset;
    }
    Py_DECREF(d);
  }
  Py_RETURN_NONE;
}

// set_precision_state(state): JAX's default_matmul_precision config state (its `value` is what
// jax.config.jax_default_matmul_precision reads), or None: registry.matmul_precision decides.
PyObject* m_set_precision_state(PyObject*, PyObject* arg) {
  if (arg == Py_None) {
    Py_CLEAR(g_jax_precision);
  } else {
    Py_INCREF(arg);
    Py_XSETREF(g_jax_precision, arg);
  }
  Py_RETURN_NONE;
}

// a module-level switch set from Python's truth value of ``arg``
PyObject* set_flag(PyObject* arg, bool& flag) {
  int v = PyObject_IsTrue(arg);
  if (v < 0) return nullptr;
  flag = v != 0;
  Py_RETURN_NONE;
}

PyObject* m_set_enabled(PyObject*, PyObject* arg) { return set_flag(arg, g_enabled); }

PyObject* m_enabled(PyObject*, PyObject*) { return PyBool_FromLong(g_enabled); }

// set_timing(flag): start (zeroed) or stop timing Kernel calls; timing(): what was timed.
PyObject* m_set_timing(PyObject*, PyObject* arg) {
  int v = PyObject_IsTrue(arg);
  if (v < 0) return nullptr;
  if (v != 0) g_timing = Timing();  // (stopping keeps what was timed)
  g_timing.on = v != 0;
  Py_RETURN_NONE;
}

PyObject* m_timing(PyObject*, PyObject*) {
  const Timing& t = g_timing;
  return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L}", "hits", t.hits, "hit_ns", t.hit_ns, "call_ns",
                       t.call_ns, "python", t.python, "python_ns", t.python_ns);
}

// The lowering whose call may install an entry now (this thread's pending key), or None.
PyObject* m_pending(PyObject*, PyObject*) {
  if (tl_pending == nullptr || tl_pending->kernel == nullptr) Py_RETURN_NONE;
  PyObject* l = tl_pending->kernel->lowering;
  Py_INCREF(l);
  return l;
}

// An output's restriding order (a tuple of `nd` dimensions) into m.order and m.inverse: 1, 0
// where it is not a permutation of the dimensions, -1 with a Python error set.
int out_order(PyObject* order, Py_ssize_t nd, OutMeta& m) {
  if (PyTuple_GET_SIZE(order) != nd) return 0;
  m.inverse.assign(nd, -1);
  for (Py_ssize_t j = 0; j < nd; j++) {
    long d = PyLong_AsLong(PyTuple_GET_ITEM(order, j));
    if (d == -1 && PyErr_Occurred()) return -1;
    if (d < 0 || d >= nd || m.inverse[d] != -1) return 0;  // not a permutation
    m.order.push_back(d);
    m.inverse[d] = j;
  }
  return 1;
}

// An output's metadata from its (shape tuple, torch dtype): contiguous strides, byte size.
bool out_meta(PyObject* shape, PyObject* dt, OutMeta& m) {
  if (!PyTuple_Check(shape) || Py_TYPE(dt) != &THPDtypeType) {
    PyErr_SetString(PyExc_TypeError, "an output's (shape tuple, torch dtype)");
    return false;
  }
  m.dtype = reinterpret_cast<THPDtype*>(dt)->scalar_type;
  int64_t numel = 1;
  for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(shape); j++) {
    long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, j));
    if (d == -1 && PyErr_Occurred()) return false;
    m.sizes.push_back(d);
    numel *= d;
  }
  m.strides.resize(m.sizes.size());
  int64_t acc = 1;
  for (Py_ssize_t j = static_cast<Py_ssize_t>(m.sizes.size()) - 1; j >= 0; j--) {
    m.strides[j] = acc;
    acc *= m.sizes[j] > 1 ? m.sizes[j] : 1;
  }
  m.nbytes = numel * static_cast<int64_t>(c10::elementSize(m.dtype));
  return true;
}

// install(lowering, call, plan, arrays, tuple_out, outs, check): arrays = [(array dtype,
// shape, weak type)] per tensor ordinal; outs = [(shape, torch dtype)]; check: None, or what a
// checked op's flag is passed to.
PyObject* m_install(PyObject*, PyObject* args) {
  PyObject *lowering, *call, *plan, *in_dtypes, *outs, *check = Py_None;
  int tuple_out = 0;
  if (!PyArg_ParseTuple(args, "OOO!O!pO!|O", &lowering, &call, &PyList_Type, &plan, &PyList_Type,
                        &in_dtypes, &tuple_out, &PyList_Type, &outs, &check))
    return nullptr;
  Pending* p = tl_pending;
  if (p == nullptr || p->kernel == nullptr || p->kernel->lowering != lowering || p->fused)
    Py_RETURN_FALSE;
  Py_ssize_t n_t = PyList_GET_SIZE(in_dtypes);
  if (n_t != p->n_tensors || PyList_GET_SIZE(outs) == 0 ||
      (!tuple_out && PyList_GET_SIZE(outs) != 1))
    Py_RETURN_FALSE;
  auto e = std::make_shared<Entry>();
  Py_INCREF(call);
  e->call = call;
  e->tuple_out = tuple_out != 0;
  if (check != Py_None) {
    Py_INCREF(check);
    e->check = check;
  }
  std::vector<bool> used(n_t, false);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(plan); i++) {
    PyObject* item = PyList_GET_ITEM(plan, i);
    if (PyLong_CheckExact(item)) {
      long v = PyLong_AsLong(item);
      if (v < 0 || v >= n_t) Py_RETURN_FALSE;
      used[v] = true;
      e->plan.push_back(static_cast<int>(v));
    } else if (PyTuple_CheckExact(item) && PyTuple_GET_SIZE(item) == 1) {
      PyObject* c = PyTuple_GET_ITEM(item, 0);
      Py_INCREF(c);
      e->consts.push_back(c);
      e->plan.push_back(-static_cast<int>(e->consts.size()));
    } else {
      Py_RETURN_FALSE;
    }
  }
  for (bool u : used)
    if (!u) Py_RETURN_FALSE;  // every tensor the kernel got is an argument of the program
  for (Py_ssize_t i = 0; i < n_t; i++) {
    PyObject *d, *shape;
    int weak = 0;
    if (!PyArg_ParseTuple(PyList_GET_ITEM(in_dtypes, i), "OO!p", &d, &PyTuple_Type, &shape,
                          &weak))
      return nullptr;
    std::vector<int64_t> dims;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(shape); j++) {
      long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, j));
      if (v == -1 && PyErr_Occurred()) return nullptr;
      dims.push_back(v);
    }
    Py_INCREF(d);
    e->in_dtypes.push_back(d);
    e->in_shapes.push_back(std::move(dims));
    e->in_weak.push_back(static_cast<char>(weak));
  }
  e->seen_avals.resize(n_t);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outs); i++) {
    PyObject* o = PyList_GET_ITEM(outs, i);
    PyObject *shape, *dt, *order = nullptr;
    OutMeta m;
    if (PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 1) {  // (constant,)
      if (i == 0) Py_RETURN_FALSE;  // the first result is an array (inflight.note reads it)
      PyObject* c = PyTuple_GET_ITEM(o, 0);
      Py_INCREF(c);
      e->out_consts.push_back(c);
      m.konst = static_cast<int>(e->out_consts.size()) - 1;
      e->outs.push_back(std::move(m));
      continue;
    }
    if (!PyArg_ParseTuple(o, "O!O!|O!", &PyTuple_Type, &shape, &THPDtypeType, &dt,
                          &PyTuple_Type, &order))
      return nullptr;
    if (order != nullptr) {
      int ok = out_order(order, PyTuple_GET_SIZE(shape), m);
      if (ok <= 0) return ok < 0 ? nullptr : Py_NewRef(Py_False);
    }
    if (!out_meta(shape, dt, m)) return nullptr;
    e->outs.push_back(std::move(m));
  }
  Table& t = *p->kernel->table;
  if (t.size() >= kMaxEntries) {
    t.clear();
    bump(c_full);
  }
  Variants& vs = t[p->key];
  for (size_t i = 0; i < vs.size(); i++) {
    if (vs[i]->in_shapes == e->in_shapes && vs[i]->in_weak == e->in_weak) {
      bool same = true;
      for (size_t j = 0; same && j < e->in_dtypes.size(); j++) {
        int eq = PyObject_RichCompareBool(vs[i]->in_dtypes[j], e->in_dtypes[j], Py_EQ);
        if (eq < 0) { PyErr_Clear(); eq = 0; }
        same = eq == 1;
      }
      if (same) { vs.erase(vs.begin() + i); break; }
    }
  }
  if (vs.size() >= kMaxVariants) vs.erase(vs.begin());
  vs.push_back(std::move(e));
  p->kernel = nullptr;  // consumed: a later call in the same kernel installs nothing
  bump(c_installs);
  Py_RETURN_TRUE;
}

// Drop every entry whose executable call is in `calls` (a set): program_cache dropped them
// to keep the loaded XLA code bounded, and an entry must not keep one alive.
PyObject* m_forget(PyObject*, PyObject* calls) {
  if (!PyAnySet_Check(calls)) {
    PyErr_SetString(PyExc_TypeError, "forget: a set of executable calls");
    return nullptr;
  }
  Py_ssize_t dropped = 0;
  for (Kernel* k : all_kernels()) {
    for (auto it = k->table->begin(); it != k->table->end();) {
      auto& vs = it->second;
      for (size_t i = 0; i < vs.size();) {
        int in = PySet_Contains(calls, vs[i]->call);
        if (in < 0) return nullptr;
        if (in) { vs.erase(vs.begin() + i); dropped++; }
        else i++;
      }
      if (vs.empty()) it = k->table->erase(it);
      else ++it;
    }
  }
  return PyLong_FromSsize_t(dropped);
}

// ---- PyTorch's own CPU kernels of metadata-only ops, for PrivateUse1, without Python ----
// A view of a tpu tensor is PyTorch's metadata kernel run on it (the storage is shared): the
// boxed redispatch to the CPU key that eager/kernels.py does from Python, here in C++ (a view
// op was a Python frame and a re-boxing of its arguments, ~70 of them per token of HF
// generate).

void redispatch_cpu(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

std::unordered_map<std::string, torch::Library*>& libraries() {
  static auto* m = new std::unordered_map<std::string, torch::Library*>();  // never freed:
  return *m;  // a registration lives as long as the process (as the Python bindings do)
}

// the PrivateUse1 IMPL library of namespace ``ns`` (made once, kept for the process)
torch::Library& library_for(const char* ns) {
  auto& libs = libraries();
  auto it = libs.find(ns);
  if (it == libs.end())
    it = libs.emplace(ns, new torch::Library(torch::Library::IMPL, ns,
                                             c10::DispatchKey::PrivateUse1, __FILE__, __LINE__))
             .first;
  return *it->second;
}

// cpu_redispatch(namespace, name): bind `namespace::name` (name with its overload, "view.dtype")
// for PrivateUse1 to the CPU key's kernel.
PyObject* m_cpu_redispatch(PyObject*, PyObject* args) {
  const char *ns, *name;
  if (!PyArg_ParseTuple(args, "ss", &ns, &name)) return nullptr;
  try {
    library_for(ns).impl(name, torch::CppFunction::makeFromBoxedFunction<&redispatch_cpu>());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}


// ---- the boxed kernel: the dispatcher's IValue stack, without PythonKernelHolder ----
// A functional op's PrivateUse1 kernel is registered as this boxed C++ functor (bind_boxed):
// the dispatcher calls it with the IValue stack, where torch.library's PythonKernelHolder
// turned the stack into a Python argument tuple and keyword dict for the Kernel and its
// result back into IValues. It keys the stack itself, with the key `Kernel_serve` makes from
// the Python arguments the holder would have built (parseIValuesToPyArgsKwargs: positional
// arguments up to the last one that is not its default, keyword-only ones that are not their
// default, by name; dtypes, layouts and memory formats by the schema's type); so entries the
// Python executor installs under Kernel_serve's key match here. A Strict hit is served from
// the stack (the output tensors pushed as at::Tensors); anything else converts the stack to
// Python once, as the holder does, and calls the Kernel (Kernel_call: what ran before).

struct Boxed;
PyObject *c_boxed_hits, *c_boxed_records, *c_key_mismatches;
bool g_check_keys = false;  // tests: compare every boxed key with Kernel_serve's

// An argument's kind by its schema type (Optional[T] counts as T), as the holder converts it.
enum ArgKind : int8_t { A_OTHER, A_DTYPE, A_LAYOUT, A_MFORMAT };

bool key_ivalue(const c10::IValue& v, std::string& k, Tensors& ts, int depth);

bool key_at_tensor(const at::Tensor& t, std::string& k, Tensors& ts) {
  if (!t.defined()) { k.push_back('N'); return true; }  // (the holder passes None)
  auto* impl = t.unsafeGetTensorImpl();
  PyObject* obj = impl->pyobj_slot()->load_pyobj();
  if (impl->is_wrapped_number()) {
    // `x * 2.5`: the holder passes the Python scalar (toPyObject: by the tensor's dtype;
    // one with a Python object may carry its own `_wrapped_number`: the Python route)
    if (obj != nullptr || t.device().type() != c10::DeviceType::CPU) return false;
    switch (t.scalar_type()) {
      case c10::ScalarType::Double:
        k.push_back('f');
        put<double>(k, *t.const_data_ptr<double>());
        return true;
      case c10::ScalarType::Long:
        k.push_back('i');
        put<int64_t>(k, *t.const_data_ptr<int64_t>());
        return true;
      case c10::ScalarType::Bool:
        k.push_back(*t.const_data_ptr<bool>() ? 'B' : 'b');
        return true;
      case c10::ScalarType::ComplexDouble: {
        auto c = *t.const_data_ptr<c10::complex<double>>();
        k.push_back('c');
        put<double>(k, c.real());
        put<double>(k, c.imag());
        return true;
      }
      default:
        return false;
    }
  }
  // the holder passes the tensor's own Python object if it has one: Kernel_serve keys only an
  // exact torch.Tensor
  if (obj != nullptr && !THPVariable_CheckTypeExact(Py_TYPE(obj))) return false;
  return key_tensor_impl(t, k, ts);
}

// key_of of what torch::jit::toPyObject(v) returns (schema-unaware: list items).
bool key_ivalue(const c10::IValue& v, std::string& k, Tensors& ts, int depth) {
  if (v.isTensor()) return key_at_tensor(v.toTensor(), k, ts);
  if (v.isNone()) { k.push_back('N'); return true; }
  if (v.isBool()) { k.push_back(v.toBool() ? 'B' : 'b'); return true; }
  if (v.isInt()) { k.push_back('i'); put<int64_t>(k, v.toInt()); return true; }
  if (v.isSymInt()) {
    auto s = v.toSymInt();
    auto m = s.maybe_as_int();
    if (!m.has_value()) return false;  // a symbolic int: a SymInt object in Python
    k.push_back('i');
    put<int64_t>(k, *m);
    return true;
  }
  if (v.isDouble()) { k.push_back('f'); put<double>(k, v.toDouble()); return true; }
  if (v.isComplexDouble()) {
    auto c = v.toComplexDouble();
    k.push_back('c');
    put<double>(k, c.real());
    put<double>(k, c.imag());
    return true;
  }
  if (v.isString()) {
    const auto& s = v.toStringRef();
    k.push_back('s');
    put<int64_t>(k, static_cast<int64_t>(s.size()));
    k.append(s.data(), s.size());
    return true;
  }
  if (v.isDevice()) {
    auto d = v.toDevice();
    k.push_back('D');
    put<int8_t>(k, static_cast<int8_t>(d.type()));
    put<int8_t>(k, static_cast<int8_t>(d.index()));
    return true;
  }
  if (v.isList()) {  // (a Python list)
    if (depth > 2) return false;
    auto list = v.toListRef();
    k.push_back('L');
    put<int64_t>(k, static_cast<int64_t>(list.size()));
    for (const auto& item : list)
      if (!key_ivalue(item, k, ts, depth + 1)) return false;
    return true;
  }
  if (v.isTuple()) {
    if (depth > 2) return false;
    const auto& elems = v.toTupleRef().elements();
    k.push_back('U');
    put<int64_t>(k, static_cast<int64_t>(elems.size()));
    for (const auto& item : elems)
      if (!key_ivalue(item, k, ts, depth + 1)) return false;
    return true;
  }
  return false;  // generators, symbolic floats, ...: the Python path
}

bool key_arg(ArgKind kind, const c10::IValue& v, std::string& k, Tensors& ts) {
  if (v.isNone()) { k.push_back('N'); return true; }
  switch (kind) {
    case A_DTYPE:
      k.push_back('d');
      put<int8_t>(k, static_cast<int8_t>(v.toInt()));
      return true;
    case A_LAYOUT:
      k.push_back('l');
      put<int8_t>(k, static_cast<int8_t>(v.toInt()));
      return true;
    case A_MFORMAT:
      k.push_back('m');
      put<int8_t>(k, static_cast<int8_t>(v.toInt()));
      return true;
    default:
      return key_ivalue(v, k, ts, 0);
  }
}

ArgKind arg_kind(const c10::Argument& arg) {
  auto is = [&](c10::TypeKind kind) {
    const auto& t = arg.real_type();
    if (t->kind() == kind) return true;
    if (auto opt = t->cast<c10::OptionalType>()) return opt->getElementType()->kind() == kind;
    return false;
  };
  if (is(c10::ScalarTypeType::Kind)) return A_DTYPE;
  if (is(c10::LayoutType::Kind)) return A_LAYOUT;
  if (is(c10::MemoryFormatType::Kind)) return A_MFORMAT;
  return A_OTHER;
}

// The split the holder makes (parseIValuesToPyArgsKwargs): positional arguments [0, npos),
// keyword arguments from kw_start on that are not their default.
struct ArgSplit {
  size_t npos = 0, kw_start = 0, n = 0;
};

inline bool is_default(const c10::Argument& a, const c10::IValue& v) {
  const auto& d = a.default_value();
  return d.has_value() && *d == v;
}

ArgSplit split_args(const std::vector<c10::Argument>& schema, const c10::IValue* args, size_t n) {
  ArgSplit s;
  s.n = n;
  size_t kwarg_only_start = n;
  for (; kwarg_only_start > 0; kwarg_only_start--)
    if (!schema[kwarg_only_start - 1].kwarg_only()) break;
  s.npos = kwarg_only_start;
  for (; s.npos > 0; s.npos--)
    if (!is_default(schema[s.npos - 1], args[s.npos - 1])) break;
  s.kw_start = kwarg_only_start;
  return s;
}

// The Python (args, kwargs) the holder would pass; false with a Python error set.
bool to_python(const std::vector<c10::Argument>& schema, const std::vector<ArgKind>& kinds,
               const c10::IValue* args, const ArgSplit& s, PyObject** pargs, PyObject** pkw) {
  auto conv = [&](size_t i) -> PyObject* {
    const c10::IValue& v = args[i];
    if (v.isNone()) Py_RETURN_NONE;
    switch (kinds[i]) {
      case A_DTYPE:
        return Py_NewRef(reinterpret_cast<PyObject*>(
            torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()))));
      case A_LAYOUT:
        return Py_NewRef(reinterpret_cast<PyObject*>(
            torch::getTHPLayout(static_cast<c10::Layout>(v.toInt()))));
      case A_MFORMAT:
        return Py_NewRef(torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(v.toInt())));
      default:
        return torch::jit::toPyObject(v).release().ptr();
    }
  };
  PyObject* tup = PyTuple_New(static_cast<Py_ssize_t>(s.npos));
  if (tup == nullptr) return false;
  for (size_t i = 0; i < s.npos; i++) {
    PyObject* o = conv(i);
    if (o == nullptr) { Py_DECREF(tup); return false; }
    PyTuple_SET_ITEM(tup, i, o);
  }
  PyObject* kw = nullptr;
  for (size_t i = s.kw_start; i < s.n; i++) {
    if (is_default(schema[i], args[i])) continue;
    if (kw == nullptr && (kw = PyDict_New()) == nullptr) { Py_DECREF(tup); return false; }
    PyObject* o = conv(i);
    if (o == nullptr || PyDict_SetItemString(kw, schema[i].name().c_str(), o) < 0) {
      Py_XDECREF(o);
      Py_DECREF(kw);
      Py_DECREF(tup);
      return false;
    }
    Py_DECREF(o);
  }
  *pargs = tup;
  *pkw = kw;
  return true;
}

// Push the Kernel's Python result as the holder does (pushPyOutToStack).
void push_result(const std::vector<c10::Argument>& rets, torch::jit::Stack* stack, PyObject* out) {
  size_t nr = rets.size();
  if (nr == 0) {
    TORCH_CHECK(out == Py_None, "Expected the fast path's kernel to return None");
    return;
  }
  auto one = [&](PyObject* o, const c10::Argument& r) {
    if (THPVariable_CheckExact(o) && r.real_type()->kind() == c10::TypeKind::TensorType) {
      stack->emplace_back(THPVariable_Unpack(o));  // (toIValue's answer, without its checks)
      return;
    }
    stack->emplace_back(torch::jit::toIValue(o, r.real_type()));
  };
  if (nr == 1) {
    one(out, rets[0]);
    return;
  }
  if (PyTuple_CheckExact(out) && PyTuple_GET_SIZE(out) == static_cast<Py_ssize_t>(nr)) {
    for (size_t i = 0; i < nr; i++) one(PyTuple_GET_ITEM(out, i), rets[i]);
    return;
  }
  auto seq = py::reinterpret_borrow<py::sequence>(out);
  for (size_t i = 0; i < seq.size(); i++) one(seq[i].ptr(), rets[i]);
}

struct Boxed final : public c10::OperatorKernel {
  Kernel* kernel;  // owned (never released: the registration lives as long as the process)
  std::vector<ArgKind> kinds;  // per schema argument (set on the first call)
  bool ready = false;
  explicit Boxed(Kernel* k) : kernel(k) { Py_INCREF(reinterpret_cast<PyObject*>(k)); }

  // the Python route: the stack to Python once, the Kernel (what the holder called), back
  void python(const c10::OperatorHandle& op, torch::jit::Stack* stack, const ArgSplit& s) {
    const auto& schema = op.schema().arguments();
    const c10::IValue* args = stack->data() + (stack->size() - s.n);
    PyObject *pargs = nullptr, *pkw = nullptr;
    if (!to_python(schema, kinds, args, s, &pargs, &pkw)) throw python_error();
    torch::jit::drop(*stack, s.n);
    PyObject* out = Kernel_call(reinterpret_cast<PyObject*>(kernel), pargs, pkw);
    Py_DECREF(pargs);
    Py_XDECREF(pkw);
    if (out == nullptr) throw python_error();
    py::object hold = py::reinterpret_steal<py::object>(out);
    push_result(op.schema().returns(), stack, out);
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    py::gil_scoped_acquire gil;
    bool served = false;
    if (!g_timing.on) {
      serve(op, stack, &served);
      return;
    }
    // timed as Kernel_call times (a Kernel_call inside is not outermost)
    tl_depth++;
    long long t0 = tl_depth == 1 ? now_ns() : 0;
    if (tl_depth == 1) tl_call_ns = 0;
    try {
      serve(op, stack, &served);
    } catch (...) {
      tl_depth--;
      throw;
    }
    if (tl_depth == 1) note_timing(t0, served);
    tl_depth--;
  }

  void serve(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool* served) {
    const auto& schema = op.schema().arguments();
    size_t n = schema.size();
    if (!ready) {
      kinds.clear();
      for (const auto& a : schema) kinds.push_back(arg_kind(a));
      ready = true;
    }
    const c10::IValue* args = stack->data() + (stack->size() - n);
    ArgSplit s = split_args(schema, args, n);
    if (!g_enabled || g_mode_state == nullptr) {
      python(op, stack, s);
      return;
    }
    PyObject* mode = PyDict_GetItemWithError(g_mode_state, s_mode);  // borrowed
    bool fused = false;
    if (mode != g_strict) {  // Debug, Fused before setup_fused, or unreadable: the Python route
      if (mode == nullptr) PyErr_Clear();
      if (mode == nullptr || g_fused == nullptr || mode != g_fused) {
        python(op, stack, s);
        return;
      }
      fused = true;  // DEFER_AND_FUSE: recorded (record_or), from the stack
    }
    SpareKey spare;
    std::string& key = spare.key;
    Tensors ts;
    bool ok = true;
    put<int32_t>(key, static_cast<int32_t>(s.npos));
    for (size_t i = 0; ok && i < s.npos; i++) ok = key_arg(kinds[i], args[i], key, ts);
    for (size_t i = s.kw_start; ok && i < n; i++) {
      if (is_default(schema[i], args[i])) continue;
      key.push_back('k');
      const auto& nm = schema[i].name();
      key.append(nm.c_str(), nm.size() + 1);
      ok = key_arg(kinds[i], args[i], key, ts);
    }
    if (!ok) {  // Kernel_serve decides (and counts it uncacheable)
      python(op, stack, s);
      return;
    }
    put<int8_t>(key, static_cast<int8_t>(c10::get_default_dtype_as_scalartype()));
    if (kernel->reads_precision && !key_precision(key)) throw python_error();
    if (g_check_keys) {  // the key Kernel_serve makes from the holder's arguments
      PyObject *pargs = nullptr, *pkw = nullptr;
      if (!to_python(schema, kinds, args, s, &pargs, &pkw)) throw python_error();
      std::string pk;
      Tensors pts;
      bool pok = key_args(pargs, pkw, pk, pts);
      Py_DECREF(pargs);
      Py_XDECREF(pkw);
      if (pok) {
        put<int8_t>(pk, static_cast<int8_t>(c10::get_default_dtype_as_scalartype()));
        if (kernel->reads_precision && !key_precision(pk)) throw python_error();
      }
      if (!pok || pk != key) bump(c_key_mismatches);
    }
    if (fused) {
      bool dropped = false;
      PyObject* res = record_or(kernel, [&]() -> PyObject* {
        PyObject *pargs = nullptr, *pkw = nullptr;  // (as the holder: arguments off the stack)
        if (!to_python(schema, kinds, args, s, &pargs, &pkw)) return nullptr;
        torch::jit::drop(*stack, n);
        dropped = true;
        PyObject* out = forward(kernel, pargs, pkw);
        Py_DECREF(pargs);
        Py_XDECREF(pkw);
        return out;
      }, key, ts, served);
      if (res == nullptr) throw python_error();
      py::object hold = py::reinterpret_steal<py::object>(res);
      ts.clear();
      if (!dropped) torch::jit::drop(*stack, n);
      if (*served) bump(c_boxed_records);
      push_result(op.schema().returns(), stack, res);
      return;
    }
    auto it = kernel->table->find(key);
    if (it == kernel->table->end()) {
      python(op, stack, s);  // a miss: Kernel_serve counts it, may install
      return;
    }
    std::shared_ptr<Entry> e;  // kept alive while the GIL may be released
    InArrays in;
    if (gather(ts, in)) {
      for (auto& v : it->second)
        if (matches(*v, in)) { e = v; break; }
    }
    if (!e) {
      in.clear();
      python(op, stack, s);  // Kernel_serve counts the fallback
      return;
    }
    ts.clear();  // (the stack's own references remain until the drop)
    PyObject* res = nullptr;
    HitResult r = hit(kernel, *e, in, &res);
    if (r == HIT_ERROR) throw python_error();
    if (r == HIT_FALLBACK) {
      auto again = kernel->table->find(key);  // (the call may have changed the table)
      if (again != kernel->table->end()) {
        auto& vs = again->second;
        for (size_t i = 0; i < vs.size(); i++)
          if (vs[i] == e) { vs.erase(vs.begin() + i); break; }
        if (vs.empty()) kernel->table->erase(again);
      }
      python(op, stack, s);
      return;
    }
    bump(c_hits);
    bump(c_cache_hits);
    bump(c_boxed_hits);
    *served = true;
    torch::jit::drop(*stack, n);
    py::object hold = py::reinterpret_steal<py::object>(res);
    push_result(op.schema().returns(), stack, res);
  }
};

// bind_boxed(namespace, name, kernel): register `kernel` (a Kernel) as `namespace::name`'s
// PrivateUse1 kernel, boxed (name with its overload, "add.Tensor").
PyObject* m_bind_boxed(PyObject*, PyObject* args) {
  const char *ns, *name;
  PyObject* k;
  if (!PyArg_ParseTuple(args, "ssO!", &ns, &name, &KernelType, &k)) return nullptr;
  try {
    library_for(ns).impl(name, torch::CppFunction::makeFromBoxedFunctor(
                               std::make_unique<Boxed>(reinterpret_cast<Kernel*>(k))));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* m_set_check_keys(PyObject*, PyObject* arg) { return set_flag(arg, g_check_keys); }


// ---- the device guard, without its Python frame ----
// PyTorch's Python backend registration (torch._C._acc) makes the PrivateUse1 device guard a
// pybind11 object whose type() calls the Python method `type_` (device/registration.py's
// _Guard) and whose getDevice()/exchangeDevice() answer Device(type(), 0): every op with a
// device guard entered Python once (17 times per token of HF generate). This guard answers
// those three in C++ with the same values and hands every other call to the guard it
// replaces, which stays registered behind it (never freed: the registry does not own it).
// A guard's destructor (InlineStreamGuard, DeviceGuard, Event) calls exchangeStream /
// uncheckedSetDevice / destroyEvent while an exception unwinds. PyTorch throws some Python
// errors (a saved-tensor unpack hook's, in backward) with the error still set on the thread;
// the Python guard behind this one then fails its own call into Python and throws from the
// destructor: std::terminate. These calls set the pending error aside while the guard behind
// runs and put it back after, so the first error propagates as PyTorch raises it.
template <class F>
static auto keep_python_error(F&& f) -> decltype(f()) {
  if (!Py_IsInitialized()) return f();
  PyGILState_STATE st = PyGILState_Ensure();
  PyObject *t = nullptr, *v = nullptr, *tb = nullptr;
  PyErr_Fetch(&t, &v, &tb);
  if (t == nullptr) {
    PyGILState_Release(st);
    return f();
  }
  struct Restore {
    PyObject *t, *v, *tb;
    PyGILState_STATE st;
    ~Restore() {
      PyErr_Restore(t, v, tb);
      PyGILState_Release(st);
    }
  } restore{t, v, tb, st};
  return f();
}

// `answer` false (TORCHTPU_FASTPATH=0, the reference): every call goes to the guard behind,
// only with the pending-error protection above, except getDevice().
// getDevice() answers torch.tpu's current device (set_device / torch.tpu.device: set_current)
// in both modes: C++ fills a device without an index from it (`x.to("tpu")`,
// `torch.tensor(..., device="tpu")`), which the Python guard answers with 0 whatever the
// current device is.
static std::atomic<int> g_current_device{0};
// deviceCount(): the devices torch.tpu sees, once the backend exists (set_device_count); the
// Python backend's guard answers 1, so the autograd engine had no ready queue for tpu:1 and
// a backward there failed an internal assert.
static std::atomic<int> g_device_count{0};

struct NativeGuard final : public c10::impl::DeviceGuardImplInterface {
  const c10::impl::DeviceGuardImplInterface* prev;
  bool answer;
  NativeGuard(const c10::impl::DeviceGuardImplInterface* p, bool a) : prev(p), answer(a) {}
  static c10::Device dev() { return c10::Device(c10::DeviceType::PrivateUse1, 0); }
  static c10::Device current() {
    return c10::Device(c10::DeviceType::PrivateUse1,
                       static_cast<c10::DeviceIndex>(g_current_device.load()));
  }
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    if (answer) return current();
    return keep_python_error([&] { return prev->exchangeDevice(d); });
  }
  c10::Device getDevice() const override { return current(); }
  void setDevice(c10::Device d) const override { prev->setDevice(d); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    keep_python_error([&] { prev->uncheckedSetDevice(d); });
  }
  c10::Stream getStream(c10::Device d) const override { return prev->getStream(d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return prev->getDefaultStream(d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool hi) const override {
    return prev->getStreamFromGlobalPool(d, hi);
  }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    return prev->getNewStream(d, priority);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return keep_python_error([&] { return prev->exchangeStream(s); });
  }
  void* getStreamNativeHandle(const c10::Stream s) const override {
    return prev->getStreamNativeHandle(s);
  }
  void destroyEvent(void* e, const c10::DeviceIndex i) const noexcept override {
    keep_python_error([&] { prev->destroyEvent(e, i); });
  }
  void record(void** e, const c10::Stream& s, const c10::DeviceIndex i,
              const c10::EventFlag f) const override {
    prev->record(e, s, i, f);
  }
  void block(void* e, const c10::Stream& s) const override { prev->block(e, s); }
  bool queryEvent(void* e) const override { return prev->queryEvent(e); }
  c10::DeviceIndex deviceCount() const noexcept override {
    const int n = g_device_count.load();
    return n > 0 ? static_cast<c10::DeviceIndex>(n) : prev->deviceCount();
  }
  c10::DeviceCapability getDeviceCapability(c10::Device d) const override {
    return prev->getDeviceCapability(d);
  }
  bool queryStream(const c10::Stream& s) const override { return prev->queryStream(s); }
  void synchronizeStream(const c10::Stream& s) const override { prev->synchronizeStream(s); }
  bool isStreamCapturing(const c10::Stream& s) const override {
    return prev->isStreamCapturing(s);
  }
  void synchronizeEvent(void* e) const override { prev->synchronizeEvent(e); }
  void synchronizeDevice(const c10::DeviceIndex i) const override { prev->synchronizeDevice(i); }
  void recordDataPtrOnStream(const c10::DataPtr& p, const c10::Stream& s) const override {
    prev->recordDataPtrOnStream(p, s);
  }
  double elapsedTime(void* a, void* b, const c10::DeviceIndex i) const override {
    return prev->elapsedTime(a, b, i);
  }
};

// native_guard(): put NativeGuard in front of the registered PrivateUse1 guard, once. True if
// it is (now or already) in front; False where the registered guard does not answer what
// NativeGuard answers (its type, device and exchanged device: then it stays as it is).
PyObject* m_native_guard(PyObject*, PyObject* arg) {
  static NativeGuard* installed = nullptr;
  const int answer = PyObject_IsTrue(arg);
  if (answer < 0) return nullptr;
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(
      c10::DeviceType::PrivateUse1)];
  const auto* cur = slot.load();
  if (installed != nullptr && cur == installed) {
    installed->answer = answer != 0;
    Py_RETURN_TRUE;
  }
  if (cur == nullptr) Py_RETURN_FALSE;
  try {
    if (cur->type() != c10::DeviceType::PrivateUse1 || cur->getDevice() != NativeGuard::dev() ||
        cur->exchangeDevice(NativeGuard::dev()) != NativeGuard::dev())
      Py_RETURN_FALSE;
  } catch (const std::exception& e) {
    PyErr_Clear();
    Py_RETURN_FALSE;
  }
  installed = new NativeGuard(cur, answer != 0);
  slot.store(installed);
  Py_RETURN_TRUE;
}

PyObject* m_set_current(PyObject*, PyObject* arg) {
  const long i = PyLong_AsLong(arg);
  if (i == -1 && PyErr_Occurred()) return nullptr;
  g_current_device.store(static_cast<int>(i));
  Py_RETURN_NONE;
}

PyObject* m_set_device_count(PyObject*, PyObject* arg) {
  const long n = PyLong_AsLong(arg);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  g_device_count.store(static_cast<int>(n));
  Py_RETURN_NONE;
}

PyObject* m_clear(PyObject*, PyObject*) {
  for (Kernel* k : all_kernels()) {
    k->table->clear();
    k->ftable->clear();
  }
  Py_RETURN_NONE;
}

// setup_fused(fused mode, fused.py's globals, PendingBuffer, the graph task function): what
// the recording path reads (fused.install); without it Fused mode runs `record` for every op.
PyObject* m_setup_fused(PyObject*, PyObject* args) {
  PyObject *mode, *globals, *pb_type, *task_fn;
  if (!PyArg_ParseTuple(args, "OO!O!O", &mode, &PyDict_Type, &globals, &PyType_Type, &pb_type,
                        &task_fn))
    return nullptr;
  const char* names[] = {"_value", "ref", "aval"};
  Py_ssize_t offs[3] = {-1, -1, -1};
  for (int i = 0; i < 3; i++) {
    PyObject* d = PyObject_GetAttrString(pb_type, names[i]);
    if (d == nullptr) return nullptr;
    if (Py_TYPE(d) == &PyMemberDescr_Type) {
      PyMemberDef* md = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
      if (md->type == T_OBJECT_EX && !(md->flags & READONLY)) offs[i] = md->offset;
    }
    Py_DECREF(d);
    if (offs[i] < 0) {
      PyErr_Format(PyExc_TypeError, "setup_fused: PendingBuffer.%s is not a slot", names[i]);
      return nullptr;
    }
  }
  g_pb_value = offs[0];
  g_pb_ref = offs[1];
  g_pb_aval = offs[2];
  PyObject** slots[] = {&g_fused, &g_fused_globals, &g_pb_type, &g_task_fn};
  PyObject* vals[] = {mode, globals, pb_type, task_fn};
  for (int i = 0; i < 4; i++) {
    Py_INCREF(vals[i]);
    Py_XSETREF(*slots[i], vals[i]);
  }
  Py_RETURN_NONE;
}


// install_fused(lowering, akey, traced, text, plan, inputs, tuple_out, outs, check=None): the
// node `record` just made for this thread's pending (Fused) key. plan: per reference, a tensor
// ordinal, ("c", value) a deduplicated graph input or ("o", value) a view offset's input;
// inputs: per tensor ordinal (canonical aval, shape, numpy dtype); outs: per result None,
// ("s", value) a constant, or (canonical aval, shape, torch dtype[, order]) a pending output
// (restrided to order); check: None, or (flag aval, what the flag goes to) for a checked op.
PyObject* m_install_fused(PyObject*, PyObject* args) {
  PyObject *lowering, *akey, *traced, *text, *plan, *ins, *outs, *check = Py_None;
  int tuple_out = 0;
  if (!PyArg_ParseTuple(args, "OOOOO!O!pO!|O", &lowering, &akey, &traced, &text, &PyList_Type,
                        &plan, &PyList_Type, &ins, &tuple_out, &PyList_Type, &outs, &check))
    return nullptr;
  if (check != Py_None && (!PyTuple_Check(check) || PyTuple_GET_SIZE(check) != 2))
    Py_RETURN_FALSE;
  Pending* p = tl_pending;
  if (p == nullptr || p->kernel == nullptr || p->kernel->lowering != lowering || !p->fused ||
      g_fused == nullptr)
    Py_RETURN_FALSE;
  Py_ssize_t n_t = PyList_GET_SIZE(ins);
  if (n_t != p->n_tensors || PyList_GET_SIZE(outs) == 0 ||
      (!tuple_out && PyList_GET_SIZE(outs) != 1))
    Py_RETURN_FALSE;
  auto e = std::make_shared<FEntry>();
  if (check != Py_None) {
    e->check_aval = Py_NewRef(PyTuple_GET_ITEM(check, 0));
    e->check = Py_NewRef(PyTuple_GET_ITEM(check, 1));
  }
  PyObject** fixed[] = {&e->akey, &e->traced, &e->text};
  PyObject* fvals[] = {akey, traced, text};
  for (int i = 0; i < 3; i++) {
    Py_INCREF(fvals[i]);
    *fixed[i] = fvals[i];
  }
  e->tuple_out = tuple_out != 0;
  std::vector<bool> used(n_t, false);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(plan); i++) {
    PyObject* item = PyList_GET_ITEM(plan, i);
    if (PyLong_CheckExact(item)) {
      long v = PyLong_AsLong(item);
      if (v < 0 || v >= n_t) Py_RETURN_FALSE;
      used[v] = true;
      e->plan_kind.push_back('T');
      e->plan_idx.push_back(static_cast<int>(v));
      continue;
    }
    const char* tag = nullptr;
    PyObject* c = nullptr;
    if (!PyTuple_CheckExact(item) || !PyArg_ParseTuple(item, "sO", &tag, &c) ||
        (tag[0] != 'c' && tag[0] != 'o')) {
      PyErr_Clear();
      Py_RETURN_FALSE;
    }
    Py_INCREF(c);
    e->consts.push_back(c);
    e->plan_kind.push_back(tag[0] == 'c' ? 'C' : 'O');
    e->plan_idx.push_back(static_cast<int>(e->consts.size()) - 1);
  }
  for (bool u : used)
    if (!u) Py_RETURN_FALSE;  // every tensor the kernel got is referenced by the node
  for (Py_ssize_t i = 0; i < n_t; i++) {
    PyObject *aval, *shape, *dt;
    if (!PyArg_ParseTuple(PyList_GET_ITEM(ins, i), "OO!O", &aval, &PyTuple_Type, &shape, &dt))
      return nullptr;
    std::vector<int64_t> dims;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(shape); j++) {
      long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, j));
      if (v == -1 && PyErr_Occurred()) return nullptr;
      dims.push_back(v);
    }
    Py_INCREF(aval);
    e->in_avals.push_back(aval);
    Py_INCREF(dt);
    e->in_dtypes.push_back(dt);
    e->in_shapes.push_back(std::move(dims));
  }
  e->seen.resize(n_t);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outs); i++) {
    PyObject* o = PyList_GET_ITEM(outs, i);
    FOut fo;
    if (o == Py_None) {
      Py_INCREF(Py_None);
      fo.konst = Py_None;
    } else if (PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 2) {  // ("s", value)
      fo.konst = PyTuple_GET_ITEM(o, 1);
      Py_INCREF(fo.konst);
    } else if (PyTuple_Check(o) && (PyTuple_GET_SIZE(o) == 3 || PyTuple_GET_SIZE(o) == 4)) {
      PyObject* shape = PyTuple_GET_ITEM(o, 1);
      if (!PyTuple_Check(shape)) Py_RETURN_FALSE;
      if (PyTuple_GET_SIZE(o) == 4) {  // restrided like an argument (eager_layout_like)
        PyObject* order = PyTuple_GET_ITEM(o, 3);
        int ok = PyTuple_Check(order) ? out_order(order, PyTuple_GET_SIZE(shape), fo.meta) : 0;
        if (ok <= 0) return ok < 0 ? nullptr : Py_NewRef(Py_False);
        e->restrided = true;
      }
      if (!out_meta(shape, PyTuple_GET_ITEM(o, 2), fo.meta)) return nullptr;
      fo.aval = PyTuple_GET_ITEM(o, 0);
      Py_INCREF(fo.aval);
    } else {
      Py_RETURN_FALSE;
    }
    e->outs.push_back(fo);
    fo.aval = fo.konst = nullptr;  // (owned by the entry's copy now)
  }
  FTable& t = *p->kernel->ftable;
  if (t.size() >= kMaxEntries) {
    t.clear();
    bump(c_full);
  }
  auto& vs = t[p->key];
  for (size_t i = 0; i < vs.size(); i++)
    if (vs[i]->in_avals == e->in_avals) { vs.erase(vs.begin() + i); break; }
  if (vs.size() >= kMaxVariants) vs.erase(vs.begin());
  vs.push_back(std::move(e));
  p->kernel = nullptr;  // consumed
  bump(c_finstalls);
  Py_RETURN_TRUE;
}

PyObject* m_fused_entries(PyObject*, PyObject*) {
  size_t n = 0;
  for (Kernel* k : all_kernels())
    for (auto& kv : *k->ftable) n += kv.second.size();
  return PyLong_FromSize_t(n);
}


PyObject* m_entries(PyObject*, PyObject*) {
  size_t n = 0;
  for (Kernel* k : all_kernels())
    for (auto& kv : *k->table) n += kv.second.size();
  return PyLong_FromSize_t(n);
}

PyMethodDef module_methods[] = {
    {"forget", m_forget, METH_O, "drop the entries of these executable calls"},
    {"clear", m_clear, METH_NOARGS, "drop every entry"},
    {"cpu_redispatch", m_cpu_redispatch, METH_VARARGS,
     "bind an op's PrivateUse1 kernel to its CPU kernel (metadata-only ops)"},
    {"entries", m_entries, METH_NOARGS, "entries in every table"},
    {"native_guard", m_native_guard, METH_O,
     "put a C++ guard in front of the PrivateUse1 device guard (True: it answers type and device)"},
    {"set_current", m_set_current, METH_O,
     "torch.tpu's current device index, what the guard's getDevice() answers"},
    {"set_device_count", m_set_device_count, METH_O,
     "the device count the guard answers (0: the guard behind's)"},
    {"setup", m_setup, METH_VARARGS, "the Python objects the hot path reads"},
    {"bind_boxed", m_bind_boxed, METH_VARARGS,
     "register a Kernel as an op's boxed PrivateUse1 kernel (no PythonKernelHolder)"},
    {"set_check_keys", m_set_check_keys, METH_O,
     "tests: compare each boxed key with the one Kernel_serve makes (eager_fastpath_key_mismatches)"},
    {"set_enabled", m_set_enabled, METH_O, "serve hits (True) or run every call in Python"},
    {"set_precision_state", m_set_precision_state, METH_O,
     "JAX's default_matmul_precision config state, read for ops that read the precision"},
    {"enabled", m_enabled, METH_NOARGS, "whether hits are served"},
    {"set_timing", m_set_timing, METH_O, "time Kernel calls (zeroed) or stop"},
    {"timing", m_timing, METH_NOARGS, "Kernel calls timed: hits, Python kernels, their ns"},
    {"pending", m_pending, METH_NOARGS, "the lowering this thread's pending key belongs to"},
    {"install", m_install, METH_VARARGS, "install an entry for this thread's pending key"},
    {"setup_fused", m_setup_fused, METH_VARARGS, "what Fused mode's recording path reads"},
    {"fused_enter", m_fused_enter, METH_NOARGS,
     "own the pending Fused graph (re-entrant; waits, the GIL released, for another owner)"},
    {"fused_exit", m_fused_exit, METH_NOARGS, "give up one level of owning the Fused graph"},
    {"install_fused", m_install_fused, METH_VARARGS,
     "install a recording entry for this thread's pending (Fused) key"},
    {"fused_entries", m_fused_entries, METH_NOARGS, "recording entries in every table"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "torchtpu_fastpath", nullptr, -1,
                          module_methods};

PyObject* intern(const char* s) { return PyUnicode_InternFromString(s); }

}  // namespace

PyMODINIT_FUNC PyInit_torchtpu_fastpath(void) {
  KernelType.tp_name = "torchtpu_fastpath.Kernel";
  KernelType.tp_basicsize = sizeof(Kernel);
  KernelType.tp_flags = Py_TPFLAGS_DEFAULT;
  KernelType.tp_new = Kernel_new;
  KernelType.tp_dealloc = Kernel_dealloc;
  KernelType.tp_call = Kernel_call;
  KernelType.tp_methods = Kernel_methods;
  KernelType.tp_doc = "A functional op's PrivateUse1 kernel with the Strict fast path";
  if (PyType_Ready(&KernelType) < 0) return nullptr;
  s_value = intern("value");
  s_mode = intern("mode");
  s_tpu_buffer = intern("_tpu_buffer");
  s_array = intern("array");
  s_dtype = intern("dtype");
  s_shape = intern("shape");
  s_is_ready = intern("is_ready");
  s_weak_type = intern("weak_type");
  s_aval = intern("aval");
  c_hits = intern("eager_fastpath_hits");
  c_cache_hits = intern("eager_cache_hits");
  c_misses = intern("eager_fastpath_misses");
  c_uncacheable = intern("eager_fastpath_uncacheable");
  c_bypassed = intern("eager_fastpath_bypassed");
  c_errors = intern("eager_fastpath_fallbacks");
  c_installs = intern("eager_fastpath_installs");
  c_full = intern("eager_fastpath_table_resets");
  c_boxed_hits = intern("eager_fastpath_boxed_hits");
  c_boxed_records = intern("fused_fastpath_boxed_records");
  c_key_mismatches = intern("eager_fastpath_key_mismatches");
  s_nodes = intern("nodes");
  s_inputs = intern("inputs");
  s_input_ids = intern("input_ids");
  s_pending = intern("pending");
  s_task = intern("task");
  s_i = intern("i");
  s_n = intern("n");
  s_size_limit = intern("size_limit");
  s_graph = intern("_graph");
  s_max_nodes = intern("MAX_NODES");
  s_cut_at_backward = intern("CUT_AT_BACKWARD");
  s_flush = intern("flush");
  c_recorded = intern("fused_ops_recorded");
  c_frecords = intern("fused_fastpath_records");
  c_fmisses = intern("fused_fastpath_misses");
  c_finstalls = intern("fused_fastpath_installs");
  c_ffallbacks = intern("fused_fastpath_fallbacks");
  g_empty = PyTuple_New(0);
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  Py_INCREF(&KernelType);
  if (PyModule_AddObject(m, "Kernel", reinterpret_cast<PyObject*>(&KernelType)) < 0) {
    Py_DECREF(&KernelType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
