// The "mpidist" torch.distributed backend: a c10d::Backend whose collectives are done by a
// Python object (mpidist.torch.backend.group.Group) over an mpi4py communicator.
//
// Why C++: DDP's reducer and parameter checks call collectives through torch's C++
// dispatcher, which needs a c10d::Backend per device; torch 2.x offers no Python-subclassable
// one. Each override takes the GIL, hands the tensors and options to the Python object, and
// returns a Work that the Python side completes (from its worker thread) by calling `done`.
// The Work's future carries the output tensors, as the reducer's default hook expects.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace mpidist {

// A collective in flight: done(None) completes it, done("message") fails it on wait().
class __attribute__((visibility("hidden"))) MpidistWork : public c10d::Work {
 public:
  MpidistWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : Work(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  void complete(const std::string& error) {
    if (error.empty()) {
      future_->markCompleted(c10::IValue(outputs_));
      finish();
    } else {
      auto exc = std::make_exception_ptr(std::runtime_error(error));
      future_->setError(exc);
      finish(exc);
    }
  }

  std::vector<at::Tensor> result() override {
    return outputs_;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

static std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& l : lists) {
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

class __attribute__((visibility("hidden"))) MpidistBackend : public c10d::Backend {
 public:
  MpidistBackend(int rank, int size, py::object group)
      : Backend(rank, size), group_(std::move(group)) {}

  ~MpidistBackend() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      group_ = py::object();
    } else {
      group_.release();  // the interpreter is gone: leak rather than touch it
    }
  }

  const std::string getBackendName() const override {
    return "mpidist";
  }

  // destroy_process_group: finish queued work, free the group's communicators
  void shutdown() override {
    if (!Py_IsInitialized()) {
      return;  // at exit, after the interpreter: MPI_Finalize frees what is left
    }
    py::gil_scoped_acquire gil;
    try {
      group_.attr("shutdown")();
    } catch (py::error_already_set& e) {
      throw std::runtime_error(e.what());
    }
  }

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    return call(c10d::OpType::BROADCAST, "broadcast", tensors, tensors,
                opts.rootRank, opts.rootTensor);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    return callOp(c10d::OpType::ALLREDUCE, "allreduce", tensors, opts.reduceOp, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override {
    return callOp(c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors,
                  opts.reduceOp, tensors);
  }

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override {
    return callOp(c10d::OpType::REDUCE, "reduce", tensors, opts.reduceOp, tensors,
                  opts.rootRank, opts.rootTensor);
  }

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return call(c10d::OpType::ALLGATHER, "allgather", flatten(outputs), outputs, inputs);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    return call(c10d::OpType::_ALLGATHER_BASE, "allgather_base", {output}, output, input);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return call(c10d::OpType::ALLGATHER_COALESCED, "allgather_coalesced", flatten(outputs),
                outputs, inputs);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return call(c10d::OpType::COALESCED, "allgather_into_tensor_coalesced", outputs, outputs,
                inputs);
  }

  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    return call(c10d::OpType::GATHER, "gather", flatten(outputs), outputs, inputs,
                opts.rootRank);
  }

  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    return call(c10d::OpType::SCATTER, "scatter", outputs, outputs, inputs, opts.rootRank);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    return callOp(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", outputs, opts.reduceOp,
                  outputs, inputs);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    return callOp(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_base", {output},
                  opts.reduceOp, output, input);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    return callOp(c10d::OpType::COALESCED,  // (REDUCE_SCATTER_TENSOR_COALESCED: not in 2.11)
                  "reduce_scatter_tensor_coalesced", outputs, opts.reduceOp, outputs, inputs);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplits,
      std::vector<int64_t>& inputSplits,
      const c10d::AllToAllOptions& opts) override {
    return call(c10d::OpType::ALLTOALL_BASE, "alltoall_base", {output}, output, input,
                outputSplits, inputSplits);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override {
    return call(c10d::OpType::ALLTOALL, "alltoall", outputs, outputs, inputs);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return call(c10d::OpType::BARRIER, "barrier", {});
  }

  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors, int dstRank, int tag) override {
    return call(c10d::OpType::SEND, "send", tensors, tensors, dstRank, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors, int srcRank, int tag) override {
    return call(c10d::OpType::RECV, "recv", tensors, tensors, srcRank, tag);
  }

 private:
  // Hand a call to the Python group: group.<method>(done, *args); returns its Work.
  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> call(
      c10d::OpType type, const char* method, std::vector<at::Tensor> outputs,
      Args&&... args) {
    auto work = c10::make_intrusive<MpidistWork>(rank_, type, std::move(outputs));
    py::gil_scoped_acquire gil;
    try {
      py::cpp_function done([work](py::object error) {
        std::string message = error.is_none() ? std::string() : error.cast<std::string>();
        py::gil_scoped_release nogil;  // completion callbacks run without the GIL
        work->complete(message);
      });
      group_.attr(method)(done, std::forward<Args>(args)...);
    } catch (py::error_already_set& e) {
      throw std::runtime_error(e.what());
    }
    return work;
  }

  // As call(), with the reduction as (name, factor) in front of the other arguments.
  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> callOp(
      c10d::OpType type, const char* method, std::vector<at::Tensor> outputs,
      const c10d::ReduceOp& op, Args&&... args) {
    py::gil_scoped_acquire gil;
    py::object factor = py::none();
    std::string name;
    switch (op.op_) {
      case c10d::ReduceOp::SUM: name = "sum"; break;
      case c10d::ReduceOp::AVG: name = "avg"; break;
      case c10d::ReduceOp::PRODUCT: name = "prod"; break;
      case c10d::ReduceOp::MIN: name = "min"; break;
      case c10d::ReduceOp::MAX: name = "max"; break;
      case c10d::ReduceOp::BAND: name = "band"; break;
      case c10d::ReduceOp::BOR: name = "bor"; break;
      case c10d::ReduceOp::BXOR: name = "bxor"; break;
      case c10d::ReduceOp::PREMUL_SUM: {
        name = "premul_sum";
        // NCCLPreMulSumSupplement: the older name, an alias of PreMulSumSupplement in torch 2.13
        auto* s = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
        TORCH_CHECK(s != nullptr, "mpidist: PREMUL_SUM without its factor");
        factor = s->tensor_factor.defined() ? py::cast(s->tensor_factor)
                                            : py::cast(s->double_factor);
        break;
      }
      default: name = "unknown"; break;
    }
    return call(type, method, std::move(outputs), name, factor, std::forward<Args>(args)...);
  }

  py::object group_;
};

}  // namespace mpidist

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "the mpidist torch.distributed backend (a c10d::Backend forwarding to Python)";
  m.def(
      "create_backend",
      [](int rank, int size, py::object group) -> c10::intrusive_ptr<c10d::Backend> {
        return c10::make_intrusive<mpidist::MpidistBackend>(rank, size, std::move(group));
      },
      "A c10d Backend of `size` ranks whose collectives call group.<name>(done, ...).");
}
