// commviz's c10d boundary kernel: one boxed kernel in front of each c10d collective and
// point-to-point op at a backend's dispatch key (CPU for gloo, CUDA for NCCL).
//
// Every collective reaches these ops, whoever issues it (torch.distributed, DDP's reducer,
// FSDP, DTensor and functional collectives, compiled code), so recording here sees them all.
// The kernel reads what the record needs straight off the boxed stack (no Python objects are
// made for tensors or the process group), hands plain values to commviz's Python `begin`,
// runs torch's own kernel, then calls `finish`. With recording off it costs one atomic load.
//
// Built on first use by commviz.record.boundary (torch.utils.cpp_extension); a pure-Python
// kernel with the same callbacks is used where no compiler exists.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <Python.h>
#include <frameobject.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// Where an op keeps what the record needs: argument positions, -1 where it has none.
struct OpSpec {
  int code;        // commviz's op code (commviz.record.boundary.OPS index)
  int in_arg;      // tensors sent
  int out_arg;     // tensors received (-1: the same as in_arg)
  int pg_arg;
  int redop_arg;
  int root_arg;    // a group rank: root of broadcast/reduce/gather/scatter, peer of send/recv
  int async_arg;
  int out_split_arg;
  int in_split_arg;
};

std::atomic<bool> g_active{false};
// Slots of commviz's compact record (commviz.metadata R_*) the kernel reads or writes itself
// so that a plain call needs no second Python call: its end time, and the two runtime slots
// that say whether Python must finish it (an open profiler range or capture region).
struct Slots {
  Py_ssize_t seq = -1, t_end = -1, meta = -1, region = -1;
} g_slots;
py::object* g_begin = nullptr;   // leaked on purpose: they must outlive interpreter teardown
py::object* g_finish = nullptr;

struct PgName {
  std::string name;
  py::object py;
};
// Python strings made once; never destroyed (the interpreter may be gone at process exit).
std::mutex g_names_mutex;
auto* g_names = new std::unordered_map<const void*, PgName>();
auto* g_dtype_names = new py::object[static_cast<int>(c10::ScalarType::NumOptions)];

int64_t numel(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().numel();
  if (v.isList()) {  // Tensor[] and Tensor[][]
    int64_t n = 0;
    for (const c10::IValue& inner : v.toListRef()) n += numel(inner);
    return n;
  }
  return 0;
}

const at::Tensor* first_tensor(const c10::IValue& v) {
  if (v.isTensor()) return &v.toTensor();
  if (v.isList()) {
    for (const c10::IValue& inner : v.toListRef()) {
      const at::Tensor* t = first_tensor(inner);
      if (t != nullptr) return t;
    }
  }
  return nullptr;
}

py::object split_list(const c10::IValue& v) {
  if (!v.isIntList()) return py::none();
  return py::cast(v.toIntVector());
}

const py::object& pg_name(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  std::lock_guard<std::mutex> lock(g_names_mutex);
  const std::string& name = pg->getGroupName();
  auto it = g_names->find(pg.get());
  if (it == g_names->end() || it->second.name != name) {
    it = g_names->insert_or_assign(pg.get(), PgName{name, py::str(name)}).first;
  }
  return it->second.py;
}

// The call site: the first Python frame outside torch and commviz (``g_own_dirs``), found by
// walking this thread's frames with a per-code-object verdict cached (code objects are kept).
std::vector<std::string>* g_own_dirs = new std::vector<std::string>();
auto* g_skip = new std::unordered_map<PyObject*, bool>();

bool own_code(PyCodeObject* code) {
  auto it = g_skip->find(reinterpret_cast<PyObject*>(code));
  if (it != g_skip->end()) return it->second;
  bool own = false;
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  if (file == nullptr) {
    PyErr_Clear();
  } else {
    for (const std::string& dir : *g_own_dirs) {
      if (std::strncmp(file, dir.c_str(), dir.size()) == 0) {
        own = true;
        break;
      }
    }
  }
  Py_INCREF(code);
  g_skip->emplace(reinterpret_cast<PyObject*>(code), own);
  return own;
}

// (file, line) of the call site, or (None, None) when no frame is outside torch and commviz
// (DDP's reducer on an autograd thread). Needs the GIL.
std::pair<py::object, py::object> callsite() {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    bool own = own_code(code);
    if (!own) {
      std::pair<py::object, py::object> out{
          py::reinterpret_borrow<py::object>(code->co_filename),
          py::int_(PyFrame_GetLineNumber(frame))};
      Py_DECREF(code);
      Py_DECREF(frame);
      return out;
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  return {py::none(), py::none()};
}

const py::object& dtype_name(c10::ScalarType st) {
  py::object& slot = g_dtype_names[static_cast<int>(st)];
  if (!slot) slot = py::str(c10::toString(st));
  return slot;
}

class Kernel final : public c10::OperatorKernel {
 public:
  Kernel(OpSpec spec, c10::SafeKernelFunction original)
      : spec_(spec), original_(std::move(original)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    if (!g_active.load(std::memory_order_relaxed)) {
      original_.callBoxed(op, ks, stack);
      return;
    }
    const size_t nargs = op.schema().arguments().size();
    const c10::IValue* args = stack->data() + (stack->size() - nargs);
    const c10::IValue& in = args[spec_.in_arg];
    const c10::IValue& out = args[spec_.out_arg < 0 ? spec_.in_arg : spec_.out_arg];
    const at::Tensor* tensor = first_tensor(in);
    if (tensor == nullptr) tensor = first_tensor(out);
    auto pg = args[spec_.pg_arg].toCustomClass<c10d::ProcessGroup>();
    int64_t redop = -1;
    if (spec_.redop_arg >= 0) {
      redop = static_cast<int64_t>(args[spec_.redop_arg].toCustomClass<c10d::ReduceOp>()->op_);
    }
    int64_t root = spec_.root_arg >= 0 ? args[spec_.root_arg].toInt() : -1;
    bool async_op = spec_.async_arg >= 0 && args[spec_.async_arg].toBool();
    bool cuda = tensor != nullptr && tensor->is_cuda();
    int64_t in_n = numel(in);
    int64_t out_n = spec_.out_arg < 0 ? in_n : numel(out);
    c10::ScalarType st = tensor != nullptr ? tensor->scalar_type() : c10::ScalarType::Byte;
    int64_t esize = tensor != nullptr ? static_cast<int64_t>(c10::elementSize(st)) : 0;

    py::object rec;
    {
      py::gil_scoped_acquire gil;
      py::object out_split = spec_.out_split_arg >= 0 ? split_list(args[spec_.out_split_arg])
                                                      : py::none();
      py::object in_split = spec_.in_split_arg >= 0 ? split_list(args[spec_.in_split_arg])
                                                    : py::none();
      try {
        auto [file, line] = callsite();
        rec = (*g_begin)(spec_.code, pg_name(pg), in_n, out_n, dtype_name(st), esize, cuda,
                         root, redop, async_op, in_split, out_split, file, line);
      } catch (py::error_already_set& exc) {  // never break the job's collective
        exc.discard_as_unraisable("commviz: recording a collective");
      }
      if (rec && rec.is_none()) rec = py::object();
      if (rec && PyList_CheckExact(rec.ptr())) {
        // The ring keeps every record alive: as tracked containers they would make the
        // collector's full passes over the whole heap (torch's included) ever more frequent.
        // A record refers to nothing that refers back to it, so it cannot be in a cycle.
        PyObject_GC_UnTrack(rec.ptr());
      }
    }
    if (!rec) {
      original_.callBoxed(op, ks, stack);
      return;
    }
    try {
      original_.callBoxed(op, ks, stack);
      if (!cuda && spec_.async_arg >= 0 && !async_op && !stack->empty() &&
          stack->back().isCustomClass()) {
        // A CPU (gloo) call its caller said is synchronous (async_op=False): the caller waits
        // on the returned Work right away. Waiting here first makes the record's end the
        // collective's end, not its enqueue. (send/recv carry no such flag: isend returns.)
        stack->back().toCustomClass<c10d::Work>()->wait();
      }
    } catch (const std::exception& exc) {
      finish(rec, -1, exc.what());
      throw;
    }
    int64_t backend_seq = -1;
    if (cuda) {  // NCCL numbers its collectives itself (coalesced ones share a number)
      try {
        backend_seq = static_cast<int64_t>(
            pg->getBackend(c10::DeviceType::CUDA)->getSequenceNumberForGroup());
      } catch (const std::exception&) {
        backend_seq = -1;
      }
    }
    const int64_t t_end = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::system_clock::now().time_since_epoch()).count();
    py::gil_scoped_acquire gil;
    PyObject* list = rec.ptr();
    if (PyList_Check(list) && PyList_GET_SIZE(list) > g_slots.region &&
        PyList_GET_ITEM(list, g_slots.meta) == Py_None &&
        PyList_GET_ITEM(list, g_slots.region) == Py_None &&
        (backend_seq < 0 || seq_is(PyList_GET_ITEM(list, g_slots.seq), backend_seq))) {
      // the common case: nothing open, the number was right; just note when the call returned
      PyObject* end = PyLong_FromLongLong(t_end);
      if (end != nullptr) {
        PyList_SetItem(list, g_slots.t_end, end);  // steals the reference
        rec = py::object();
        return;
      }
      PyErr_Clear();
    }
    finish_locked(rec, backend_seq, nullptr);
  }

 private:
  static bool seq_is(PyObject* seq, int64_t value) {
    return seq == Py_None || (PyLong_Check(seq) && PyLong_AsLongLong(seq) == value);
  }

  static void finish(py::object& rec, int64_t backend_seq, const char* error) {
    py::gil_scoped_acquire gil;
    finish_locked(rec, backend_seq, error);
  }

  static void finish_locked(py::object& rec, int64_t backend_seq, const char* error) {
    try {
      (*g_finish)(rec, backend_seq, error == nullptr ? py::object(py::none()) : py::str(error));
    } catch (py::error_already_set& exc) {
      exc.discard_as_unraisable("commviz: finishing a collective's record");
    }
    rec = py::object();
  }


  OpSpec spec_;
  c10::SafeKernelFunction original_;
};

// Registrations live as long as these libraries: dropping them puts torch's kernels back.
std::vector<std::unique_ptr<torch::Library>> g_libraries;

class Silence : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

void install(const std::vector<std::tuple<std::string, OpSpec>>& ops,
             const std::vector<std::string>& keys, py::object begin, py::object finish,
             std::tuple<Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t> slots,
             const std::vector<std::string>& own_dirs) {
  std::tie(g_slots.seq, g_slots.t_end, g_slots.meta, g_slots.region) = slots;
  *g_own_dirs = own_dirs;
  if (g_begin == nullptr) {
    g_begin = new py::object(std::move(begin));
    g_finish = new py::object(std::move(finish));
  } else {
    *g_begin = std::move(begin);
    *g_finish = std::move(finish);
  }
  if (!g_libraries.empty()) return;
  Silence silence;  // torch warns that a kernel is overridden: that is the point here
  c10::WarningUtils::WarningHandlerGuard guard(&silence);
  for (const std::string& key_name : keys) {
    c10::DispatchKey key = c10::parseDispatchKey(key_name);
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "c10d", key, __FILE__,
                                                __LINE__);
    for (const auto& [name, spec] : ops) {
      auto handle = c10::Dispatcher::singleton().findSchema({"c10d::" + name, ""});
      if (!handle.has_value() || !handle->hasKernelForDispatchKey(key)) continue;
      auto original = handle->getComputedKernelForDispatchKey(key);
      lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                                  std::make_unique<Kernel>(spec, std::move(original))));
    }
    g_libraries.push_back(std::move(lib));
  }
}

void uninstall() {
  g_active.store(false);
  Silence silence;
  c10::WarningUtils::WarningHandlerGuard guard(&silence);
  g_libraries.clear();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<OpSpec>(m, "OpSpec")
      .def(py::init<int, int, int, int, int, int, int, int, int>());
  m.def("install", &install, "put the boundary kernel in front of c10d's ops");
  m.def("uninstall", &uninstall, "give torch's own kernels back");
  m.def("set_active", [](bool on) { g_active.store(on); });
  m.def("installed", []() { return !g_libraries.empty(); });
}
