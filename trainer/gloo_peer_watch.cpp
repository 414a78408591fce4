// PeerWatch: gloo waits woken when their peer's pair fails (see gloo_peer_watch.h for why).
#include "trainer/gloo_peer_watch.h"

#include <exception>
#include <stdexcept>
#include <utility>

#include <fmt/core.h>

namespace ptk::gloo_detail {
namespace {

// The sentinel's wait must never time out: gloo's timeout closes every pair of the context.
constexpr std::chrono::hours kForever{24 * 365 * 10};

}  // namespace

PeerWatch::PeerWatch(std::shared_ptr<gloo::Context> context, uint64_t slot)
    : context_(std::move(context)), slot_(slot), failed_(static_cast<size_t>(context_->size)) {
  thread_ = std::thread([this] { Run(); });
}

PeerWatch::~PeerWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    if (armed_ != nullptr) armed_->abortWaitRecv();  // sticks until the thread waits: it ends at once
  }
  thread_.join();
}

void PeerWatch::Run() {
  for (;;) {
    gloo::transport::UnboundBuffer* sentinel = Arm();
    if (sentinel == nullptr) return;
    try {
      // Nobody sends on the slot: the wait ends when a pair fails (a throw), or when the watch
      // stops (aborted: false).
      if (!sentinel->waitRecv(nullptr, kForever)) return;
    } catch (const std::exception&) {
      // A pair failed: the next sentinel's receives find which.
    }
  }
}

gloo::transport::UnboundBuffer* PeerWatch::Arm() {
  std::unique_ptr<gloo::transport::UnboundBuffer> sentinel = context_->createUnboundBuffer(&byte_, 1);
  std::vector<std::pair<int, std::string>> gone;
  for (int q = 0; q < context_->size; ++q) {
    if (q == context_->rank) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_[static_cast<size_t>(q)].empty()) continue;
    }
    try {
      sentinel->recv(q, slot_, 0, 1);  // throws the pair's error once it failed
    } catch (const std::exception& e) {
      gone.emplace_back(q, *e.what() ? e.what() : "its connection failed");
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [q, error] : gone) {
    failed_[static_cast<size_t>(q)] = error;
    for (auto [it, end] = waiting_.equal_range(q); it != end; ++it) it->second->Abort();
  }
  sentinels_.push_back(std::move(sentinel));
  if (stop_) return nullptr;
  armed_ = sentinels_.back().get();
  return armed_;
}

std::string PeerWatch::Error(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_[static_cast<size_t>(peer)];
}

PeerWatch::Buffer::Buffer(PeerWatch* watch, int peer, void* data, size_t bytes, bool send)
    : watch_(watch), peer_(peer), send_(send), buffer_(watch->context_->createUnboundBuffer(data, bytes)) {
  std::lock_guard<std::mutex> lock(watch_->mu_);
  watch_->waiting_.emplace(peer_, this);
  if (!watch_->failed_[static_cast<size_t>(peer_)].empty()) Abort();
}

PeerWatch::Buffer::~Buffer() {
  std::lock_guard<std::mutex> lock(watch_->mu_);
  for (auto [it, end] = watch_->waiting_.equal_range(peer_); it != end; ++it)
    if (it->second == this) {
      watch_->waiting_.erase(it);
      break;
    }
}

void PeerWatch::Buffer::Post(uint64_t slot) {
  if (send_)
    buffer_->send(peer_, slot);
  else
    buffer_->recv(peer_, slot);
}

void PeerWatch::Buffer::Abort() {
  if (send_)
    buffer_->abortWaitSend();
  else
    buffer_->abortWaitRecv();
}

void PeerWatch::Buffer::Wait(std::chrono::milliseconds timeout) {
  auto wait = [&](std::chrono::milliseconds t) {
    return send_ ? buffer_->waitSend(nullptr, t) : buffer_->waitRecv(nullptr, t);
  };
  if (wait(timeout)) return;
  // Aborted by the watch: the pair failed. gloo counted the operation's completion before the
  // failure if it completed (a peer that exits when done), and a wait then returns it at once;
  // otherwise it never will, and this wait of no time throws.
  try {
    if (wait(std::chrono::milliseconds(0))) return;
  } catch (const std::exception&) {
  }
  throw std::runtime_error(
      fmt::format("{} rank {}: {}", send_ ? "send to" : "receive from", peer_, watch_->Error(peer_)));
}

}  // namespace ptk::gloo_detail
