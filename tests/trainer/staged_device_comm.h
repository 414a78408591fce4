// A host communicator (gloo ranks as threads sharing one GPU) offered as one with device-memory
// collectives and point-to-point messages, for the gpu tests: NCCL cannot put two ranks on one
// GPU. Each device call (point-to-point ones too, batched or not) drains `stream`, copies the buffer to the host, runs
// the host communicator's call and copies the result back before it returns: the CUDA model's code path is the one it
// takes over NCCL, only the transport differs. StagedGroup: a subgroup of the world ranks and its collectives so
// staged.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "tests/trainer/forwarding_comm.h"
#include "trainer/comm.h"

namespace ptk::testing {

class StagedDeviceCollectives final : public ForwardingCommunicator {
 public:
  explicit StagedDeviceCollectives(Communicator* host) : ForwardingCommunicator(host) {}
  std::string_view backend() const override { return "gloo, device collectives staged through the host"; }
  bool device_collectives() const override { return true; }
  absl::Status AllReduceSumDevice(float* data, int64_t n, void* stream) override {
    device_all_reduces_.push_back(n);
    std::vector<float> h(static_cast<size_t>(n));
    PTK_RETURN_IF_ERROR(Out(h.data(), data, h.size() * sizeof(float), stream));
    PTK_RETURN_IF_ERROR(inner()->AllReduceSum(h.data(), n));
    return In(data, h.data(), h.size() * sizeof(float), stream);
  }
  absl::Status AllGatherDevice(void* data, std::span<const int64_t> bytes, void* stream) override {
    int64_t total = 0;
    for (int64_t b : bytes) total += b;
    std::vector<char> h(static_cast<size_t>(total));
    PTK_RETURN_IF_ERROR(Out(h.data(), data, h.size(), stream));
    PTK_RETURN_IF_ERROR(inner()->AllGather(h.data(), bytes));
    return In(data, h.data(), h.size(), stream);
  }
  absl::Status ReduceScatterSumDevice(float* data, std::span<const int64_t> counts, void* stream) override {
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    std::vector<float> h(static_cast<size_t>(total));
    PTK_RETURN_IF_ERROR(Out(h.data(), data, h.size() * sizeof(float), stream));
    PTK_RETURN_IF_ERROR(inner()->ReduceScatterSum(h.data(), counts));
    return In(data, h.data(), h.size() * sizeof(float), stream);
  }
  absl::Status SendRecvDevice(const void* send, int64_t send_bytes, int dst, void* recv, int64_t recv_bytes, int src,
                              void* stream) override {
    std::vector<char> out(dst >= 0 ? static_cast<size_t>(send_bytes) : 0);
    std::vector<char> in(src >= 0 ? static_cast<size_t>(recv_bytes) : 0);
    if (!out.empty()) PTK_RETURN_IF_ERROR(Out(out.data(), send, out.size(), stream));
    PTK_RETURN_IF_ERROR(inner()->SendRecv(out.data(), static_cast<int64_t>(out.size()), dst, in.data(),
                                          static_cast<int64_t>(in.size()), src));
    if (!in.empty()) PTK_RETURN_IF_ERROR(In(recv, in.data(), in.size(), stream));
    ++device_messages_;
    return absl::OkStatus();
  }
  // Each device message through a host copy of its own, then the host communicator's batch.
  absl::Status BatchSendRecvDevice(std::span<const P2pMessage> messages, void* stream) override {
    std::vector<std::vector<char>> host(messages.size());
    std::vector<P2pMessage> staged(messages.begin(), messages.end());
    for (size_t i = 0; i < messages.size(); ++i) {
      const P2pMessage& m = messages[i];
      if (m.peer < 0) continue;
      host[i].resize(static_cast<size_t>(m.bytes));
      if (m.send) {
        PTK_RETURN_IF_ERROR(Out(host[i].data(), m.send, host[i].size(), stream));
        staged[i].send = host[i].data();
      } else {
        staged[i].recv = host[i].data();
      }
    }
    PTK_RETURN_IF_ERROR(inner()->BatchSendRecv(staged));
    for (size_t i = 0; i < messages.size(); ++i)
      if (messages[i].peer >= 0 && messages[i].recv)
        PTK_RETURN_IF_ERROR(In(messages[i].recv, host[i].data(), host[i].size(), stream));
    ++device_messages_;
    return absl::OkStatus();
  }
  // SendRecvDevice and BatchSendRecvDevice calls so far (a test checks that the device path ran).
  int device_messages() const { return device_messages_; }
  // The lengths of the AllReduceSumDevice calls so far, in call order (a test counts them).
  const std::vector<int64_t>& device_all_reduces() const { return device_all_reduces_; }

 private:
  static absl::Status Check(cudaError_t e) {
    return e == cudaSuccess ? absl::OkStatus() : absl::InternalError(cudaGetErrorString(e));
  }
  static absl::Status Out(void* host, const void* device, size_t bytes, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    PTK_RETURN_IF_ERROR(Check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, s)));
    return Check(cudaStreamSynchronize(s));
  }
  static absl::Status In(void* device, const void* host, size_t bytes, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    PTK_RETURN_IF_ERROR(Check(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, s)));
    return Check(cudaStreamSynchronize(s));
  }
  int device_messages_ = 0;
  std::vector<int64_t> device_all_reduces_;
};

// A subgroup of the world (`host`) and its device collectives staged through the host (`device`).
struct StagedGroup {
  std::unique_ptr<Communicator> host;
  std::unique_ptr<StagedDeviceCollectives> device;
};
// World ranks `members` as the group `name` (every member calls it), into *out.
inline void MakeStagedGroup(Communicator* world, const std::vector<int>& members, const std::string& name,
                            StagedGroup* out) {
  auto g = world->Subgroup(members, name);
  ASSERT_TRUE(g.ok()) << g.status();
  out->host = std::move(*g);
  out->device = std::make_unique<StagedDeviceCollectives>(out->host.get());
}

}  // namespace ptk::testing
