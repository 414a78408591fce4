// The single-process communicator.
#include "trainer/comm.h"

namespace ptk {
namespace {
class LocalCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view backend() const override { return "local"; }
  absl::Status AllReduceSum(float*, int64_t) override { return absl::OkStatus(); }
  absl::Status AllReduceSum(double*, int64_t) override { return absl::OkStatus(); }
  absl::Status ReduceScatterSum(float*, std::span<const int64_t> counts) override {
    return PieceOffsets(counts, 1).status();
  }
  absl::Status AllGather(void*, std::span<const int64_t> bytes) override { return PieceOffsets(bytes, 1).status(); }
  absl::Status Broadcast(void*, int64_t, int) override { return absl::OkStatus(); }
  absl::Status Barrier() override { return absl::OkStatus(); }
};
}  // namespace

std::unique_ptr<Communicator> MakeLocalCommunicator() { return std::make_unique<LocalCommunicator>(); }

}  // namespace ptk
