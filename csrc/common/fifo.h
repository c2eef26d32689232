// A first-in first-out queue in one growable circular array: after it has grown to the most
// items ever queued at once, pushing and popping allocate nothing (std::deque allocates and frees
// a block every few items as the queue moves through memory).
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace ringcomm {

template <typename T>
class Fifo {
 public:
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  T& front() { return items_[head_]; }
  const T& front() const { return items_[head_]; }

  void push_back(T item) {
    if (size_ == items_.size()) grow();
    items_[(head_ + size_) % items_.size()] = std::move(item);
    ++size_;
  }
  void pop_front() {
    items_[head_] = T{};  // releases what the item holds now, not when its place is reused
    head_ = (head_ + 1) % items_.size();
    --size_;
  }
  void clear() {
    while (!empty()) pop_front();
  }

 private:
  void grow() {
    std::vector<T> bigger(items_.empty() ? 8 : 2 * items_.size());
    for (size_t i = 0; i < size_; ++i) bigger[i] = std::move(items_[(head_ + i) % items_.size()]);
    items_.swap(bigger);
    head_ = 0;
  }
  std::vector<T> items_;
  size_t head_ = 0, size_ = 0;
};

}  // namespace ringcomm
