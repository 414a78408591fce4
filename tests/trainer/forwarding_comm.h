// A communicator that passes every host call on to another one (`inner`), for tests that wrap a real
// communicator to count, record or stage some of its calls: a wrapper overrides only those.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "trainer/comm.h"

namespace ptk::testing {

class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(Communicator* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view backend() const override { return inner_->backend(); }
  absl::Status AllReduceSum(float* data, int64_t n) override { return inner_->AllReduceSum(data, n); }
  absl::Status AllReduceSum(double* data, int64_t n) override { return inner_->AllReduceSum(data, n); }
  absl::Status ReduceScatterSum(float* data, std::span<const int64_t> counts) override {
    return inner_->ReduceScatterSum(data, counts);
  }
  absl::Status AllGather(void* data, std::span<const int64_t> bytes) override { return inner_->AllGather(data, bytes); }
  absl::Status Broadcast(void* data, int64_t bytes, int root) override { return inner_->Broadcast(data, bytes, root); }
  absl::Status Barrier() override { return inner_->Barrier(); }
  absl::Status SendRecv(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes,
                        int src) override {
    return inner_->SendRecv(send, send_bytes, dst, recv, recv_bytes, src);
  }
  absl::Status BatchSendRecv(std::span<const P2pMessage> messages) override { return inner_->BatchSendRecv(messages); }

 protected:
  Communicator* inner() const { return inner_; }

 private:
  Communicator* inner_;
};

}  // namespace ptk::testing
