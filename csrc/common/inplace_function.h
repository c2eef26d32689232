// A callable kept inside the object, never on the heap: for the small, trivially copyable
// lambdas posted with every message (std::function allocates once captures pass 16 bytes).
#pragma once

#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

namespace ringcomm {

template <typename Signature>
class InplaceFunction;

template <typename R, typename... Args>
class InplaceFunction<R(Args...)> {
 public:
  static constexpr size_t kCapacity = 40;

  InplaceFunction() = default;
  InplaceFunction(std::nullptr_t) {}
  template <typename F,
            typename = std::enable_if_t<!std::is_same<std::decay_t<F>, InplaceFunction>::value>>
  InplaceFunction(F fn) {
    static_assert(sizeof(F) <= kCapacity && alignof(F) <= alignof(std::max_align_t),
                  "captures too large for an InplaceFunction");
    static_assert(std::is_trivially_copyable<F>::value && std::is_trivially_destructible<F>::value,
                  "an InplaceFunction holds only trivially copyable captures");
    new (storage_) F(fn);
    call_ = [](const void* f, Args... args) -> R {
      return (*static_cast<const F*>(f))(std::forward<Args>(args)...);
    };
  }

  R operator()(Args... args) const { return call_(storage_, std::forward<Args>(args)...); }
  explicit operator bool() const { return call_ != nullptr; }

 private:
  alignas(std::max_align_t) unsigned char storage_[kCapacity];
  R (*call_)(const void*, Args...) = nullptr;
};

}  // namespace ringcomm
