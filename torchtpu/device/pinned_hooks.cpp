// PrivateUse1 hooks with a pinned host allocator, for device "tpu".
//
// PyTorch code that stages host data for an accelerator asks the accelerator's hooks for a
// pinned allocator (`at::globalContext().getPinnedMemoryAllocator(PrivateUse1)`), e.g. DDP's
// Reducer for its used-parameter map under find_unused_parameters / static_graph. Hooks
// registered from Python (torch._C._acc.PrivateUse1Hooks) cannot provide one. PJRT stages host
// buffers itself, so "pinned" memory here is ordinary CPU memory; the allocator remembers its
// live blocks so that `isPinnedPtr` (hence `Tensor.is_pinned()`) is true exactly for them.
//
// PyTorch lets the PrivateUse1 hooks be registered only once, and torchtpu registers its
// Python hooks at import. The registered object is torch's trampoline `torch::acc::PythonHooks`
// (torch/csrc/acc/Module.cpp): `final`, no data members beyond the interface's (none), owned
// by a Python object that is never freed. `torchtpu_install_pinned_hooks` turns that object
// into a `TpuHooks` in place by storing TpuHooks' vtable pointer into it (one aligned pointer
// store, so a concurrent virtual call sees either the old or the new table). It refuses any
// other registered type. The three methods the Python hooks answered are re-implemented with
// the same constant answers.
//
// Loaded with ctypes by torchtpu/device/native.py (built on first need, cached on disk).

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <typeinfo>

namespace {

// Live blocks handed out by PinnedAllocator: start address -> size (0-byte blocks excluded).
std::mutex& blocks_mutex() {
  static auto* m = new std::mutex();  // leaked: deleters may run during process exit
  return *m;
}
std::map<std::uintptr_t, std::size_t>& blocks() {
  static auto* b = new std::map<std::uintptr_t, std::size_t>();
  return *b;
}

void delete_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(blocks_mutex());
    blocks().erase(reinterpret_cast<std::uintptr_t>(ptr));
  }
  c10::free_cpu(ptr);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(std::size_t n) override {
    void* ptr = n == 0 ? nullptr : c10::alloc_cpu(n);
    if (ptr != nullptr) {
      std::lock_guard<std::mutex> lock(blocks_mutex());
      blocks()[reinterpret_cast<std::uintptr_t>(ptr)] = n;
    }
    return {ptr, ptr, &delete_pinned, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &delete_pinned;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

bool in_pinned_block(const void* data) {
  const auto p = reinterpret_cast<std::uintptr_t>(data);
  std::lock_guard<std::mutex> lock(blocks_mutex());
  auto it = blocks().upper_bound(p);  // first block starting after p
  if (it == blocks().begin()) {
    return false;
  }
  --it;
  return p < it->first + it->second;
}

struct TpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override {
    return true;
  }
  bool isPinnedPtr(const void* data) const override {
    return in_pinned_block(data);
  }
  at::Allocator* getPinnedMemoryAllocator() const override {
    static auto* alloc = new PinnedAllocator();
    return alloc;
  }
};

static_assert(
    sizeof(TpuHooks) == sizeof(at::PrivateUse1HooksInterface),
    "TpuHooks must add no data members: it re-types an existing hooks object in place");

// The mangled name of torch's Python-hooks trampoline (torch::acc::PythonHooks).
constexpr const char* kPythonHooksType = "N5torch3acc11PythonHooksE";

}  // namespace

// 1: registered a new TpuHooks (no hooks were registered yet); 2: re-typed torch's Python
// hooks in place; 0: TpuHooks already active; -1: other hooks are registered (left alone).
extern "C" int torchtpu_install_pinned_hooks() {
  static std::mutex install_mutex;
  std::lock_guard<std::mutex> lock(install_mutex);
  if (!at::isPrivateUse1HooksRegistered()) {
    at::RegisterPrivateUse1HooksInterface(new TpuHooks());
    return 1;
  }
  auto& current =
      const_cast<at::PrivateUse1HooksInterface&>(at::detail::getPrivateUse1Hooks());
  if (typeid(current) == typeid(TpuHooks)) {
    return 0;
  }
  if (std::strcmp(typeid(current).name(), kPythonHooksType) != 0) {
    return -1;
  }
  static const TpuHooks prototype;
  void* vptr = nullptr;
  std::memcpy(&vptr, static_cast<const void*>(&prototype), sizeof(void*));
  __atomic_store_n(reinterpret_cast<void**>(&current), vptr, __ATOMIC_SEQ_CST);
  return 2;
}

// The registered hooks' dynamic type name, for error messages.
extern "C" const char* torchtpu_registered_hooks_type() {
  if (!at::isPrivateUse1HooksRegistered()) {
    return "";
  }
  return typeid(at::detail::getPrivateUse1Hooks()).name();
}
