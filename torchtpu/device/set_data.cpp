// `tensor.data = other` between CPU and "tpu", as PyTorch does it between CPU and CUDA.
//
// `Tensor.data`'s setter is `VariableHooks::set_data` (torch/csrc/autograd/variable.cpp): it
// refuses tensors whose TensorImpl types are not "compatible", and PyTorch's C++ counts only
// CPU/CUDA/MPS/HIP/XPU/HPU/MTIA as dense backends (`TensorImpl::has_compatible_shallow_copy_type`),
// so CPU <-> PrivateUse1 ("tpu") is refused although both are plain TensorImpls. This does what
// set_data does after that check: drop the cached gradient accumulator (its input metadata names
// the old device), then `shallow_copy_from`: storage, sizes, strides, dtype, device and dispatch
// keys of `other`, keeping the tensor's own autograd meta (requires_grad, grad, hooks) and
// version counter. device/set_data.py checks the rest (dtype, layout, devices) before calling.
//
// Loaded with ctypes by torchtpu/device/native.py (built on first need, cached on disk); the
// arguments are the TensorImpl addresses Python's `Tensor._cdata` gives.

#include <c10/core/TensorImpl.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>

extern "C" int torchtpu_set_data(void* self_impl, void* new_impl) {
  try {
    auto* self = static_cast<c10::TensorImpl*>(self_impl);
    auto* src = static_cast<c10::TensorImpl*>(new_impl);
    if (auto* meta = static_cast<torch::autograd::AutogradMeta*>(self->autograd_meta())) {
      std::lock_guard<std::mutex> lock(meta->mutex_);
      meta->grad_accumulator_.reset();  // the device changes: always out of date
    }
    self->shallow_copy_from(c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(src));
    return 0;
  } catch (...) {
    return -1;
  }
}
