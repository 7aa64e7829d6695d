// eccl's one-sided window, as torch sees it: a c10d::Window whose operations are those of a
// Python object (eccl.torch_window.HostWindow). torch's Python backend trampoline casts what
// a backend's `new_window` returns to the C++ `c10d::Window`, and torch gives Python no way
// to make one, so this file (compiled against the torch in use, on first use; see
// eccl/torch_window.py) is the only C++ in eccl's Python package. It holds no state of its
// own and makes no decisions: every call takes the GIL and forwards.
#include <chrono>

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Window.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace py = pybind11;

namespace {

// A timeout as the Python side takes it: seconds, or None where torch left it unset.
py::object seconds(std::chrono::milliseconds timeout) {
  if (timeout == c10d::kUnsetTimeout) {
    return py::none();
  }
  return py::float_(static_cast<double>(timeout.count()) / 1000.0);
}

// A Work made in Python, kept alive with its Python object: without it the object would
// go when Python's last reference did, and torch's trampoline would then find no Python
// `wait` to call (torch's own PyProcessGroup::PyWorkHolder, which is private, does this).
class WorkHolder : public c10d::Work {
 public:
  explicit WorkHolder(py::object work)
      : work_(work.cast<c10::intrusive_ptr<c10d::Work>>()), py_(std::move(work)) {}

  ~WorkHolder() override {
    py::gil_scoped_acquire gil;
    work_.reset();
    py_ = py::object();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    return work_->wait(timeout);
  }
  // torch's trampoline for a Python Work passes only wait and get_future on to Python;
  // these ask the Python object itself.
  bool isCompleted() override {
    py::gil_scoped_acquire gil;
    return py_.attr("is_completed")().cast<bool>();
  }
  bool isSuccess() const override {
    py::gil_scoped_acquire gil;
    return py_.attr("is_success")().cast<bool>();
  }
  std::exception_ptr exception() const override {
    py::gil_scoped_acquire gil;
    py::object e = py_.attr("exception")();
    if (e.is_none()) {
      return nullptr;
    }
    return std::make_exception_ptr(std::runtime_error(py::str(e).cast<std::string>()));
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return work_->getFuture();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  py::object py_;
};

c10::intrusive_ptr<c10d::Work> held(py::object work) {
  return c10::make_intrusive<WorkHolder>(std::move(work));
}

class ForwardingWindow : public c10d::Window {
 public:
  explicit ForwardingWindow(py::object impl) : impl_(std::move(impl)) {}

  ~ForwardingWindow() override {
    // The last reference may go from a thread without the GIL (torch's C++ side).
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

  void tensor_register(const at::Tensor& tensor, bool owning) override {
    py::gil_scoped_acquire gil;
    impl_.attr("tensor_register")(tensor, owning);
  }

  void tensor_deregister() override {
    py::gil_scoped_acquire gil;
    impl_.attr("tensor_deregister")();
  }

  c10::intrusive_ptr<c10d::Work> put(
      const at::Tensor& tensor,
      int64_t dstRank,
      int64_t targetOffsetNelems,
      bool asyncOp,
      const c10d::PutOptions& opts) override {
    py::gil_scoped_acquire gil;
    return held(impl_.attr("put")(
        tensor, dstRank, targetOffsetNelems, asyncOp, seconds(opts.timeout)));
  }

  at::Tensor map_remote_tensor(int64_t rank) override {
    py::gil_scoped_acquire gil;
    return impl_.attr("map_remote_tensor")(rank).cast<at::Tensor>();
  }

  c10::intrusive_ptr<c10d::Work> signal(
      int64_t peerRank,
      bool asyncOp,
      const c10d::SignalOptions& opts) override {
    py::gil_scoped_acquire gil;
    return held(impl_.attr("signal")(peerRank, asyncOp, seconds(opts.timeout)));
  }

  c10::intrusive_ptr<c10d::Work> wait_signal(
      int64_t peerRank,
      bool asyncOp,
      const c10d::WaitSignalOptions& opts) override {
    py::gil_scoped_acquire gil;
    return held(impl_.attr("wait_signal")(peerRank, asyncOp, seconds(opts.timeout)));
  }

  c10d::WindowAttr get_attr(int64_t peerRank) override {
    py::gil_scoped_acquire gil;
    // Mapped (one coherent memory) or reached over the link (written when the peer
    // waits for the signal that follows).
    c10d::WindowAttr attr;
    attr.access_type = impl_.attr("get_attr")(peerRank).cast<bool>()
        ? c10d::WindowAccessType::UNIFIED
        : c10d::WindowAccessType::SEPARATE;
    return attr;
  }

  // The Python object behind this window (for eccl's own use and tests).
  py::object impl() const {
    return impl_;
  }

 private:
  py::object impl_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The base class is torch's, registered by torch._C._distributed_c10d (imported first).
  py::class_<ForwardingWindow, c10d::Window, c10::intrusive_ptr<ForwardingWindow>>(
      m, "ForwardingWindow")
      .def(py::init<py::object>())
      .def_property_readonly("impl", &ForwardingWindow::impl);
}
