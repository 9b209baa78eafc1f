// commviz's c10d boundary kernel: one kernel for each c10d collective and point-to-point op at
// the BackendSelect dispatch key, the last one before the backend's kernel (CPU for gloo, CUDA
// for NCCL); it redispatches to that kernel, so torch's own kernels stay registered as they are.
//
// Every collective reaches these ops, whoever issues it (torch.distributed, DDP's reducer,
// FSDP, DTensor and functional collectives, compiled code), so recording here sees them all.
// Calls arrive two ways. A call from torch.distributed's functions, DDP or FSDP first runs
// torch's Autograd fallback (c10d's ops have no autograd kernel), which boxes its arguments;
// a call made inside another op (functional collectives, compiled code) or in inference mode
// skips autograd and arrives unboxed. The kernel has both entries, each taking the call as it
// came (`Typed`: the op's own C++ signature and a boxed entry of its own), so with recording
// off no arguments are converted: an atomic load and a redispatch. Recording, it reads what
// the record needs straight off the boxed arguments (no Python objects are made for tensors
// or the process group) and walks to the call site. An op whose C++ signature is not the one
// in `signatures()` (another torch) gets a boxed-only kernel (`Boxed`); it works the same but
// converts unboxed calls even when off.
//
// A call is recorded here without running Python, whether or not a profiler runs (the profiler's
// own `c10d::<op>` event is the call in its trace: the match step pairs the two after the job
// by thread and time): what its call site repeats (op, group, sizes, dtype, root or peer,
// reduction, site, origin, thread) is a *shape*, registered once through commviz's Python
// `shape`; each call then only adds a fixed 48-byte entry (shape, numbers, times, ordinal) to a
// ring in memory and to this generation's calls file beside the journal (a shared file mapping:
// the page cache outlives a SIGKILLed process). A point-to-point call is numbered here too
// (Flight Recorder's p2p number per group, commviz's per pair of ranks). A collective inside an
// annotate_collective block is not recorded on its own: it takes its group's number and gives it
// to the block (`Claim.claim`). A synchronous call under CUDA graph capture is recorded the
// same way, and as it returns the kernel reads its stream's capture frontier (the driver's
// cuStreamGetCaptureInfo, from the libcuda torch loaded); Python places those calls in their
// graph in one go (`take_captured`) when the capture ends. Other calls (split sizes, per-call
// origins, asynchronous or point-to-point work under capture) go through Python's `begin` /
// `finish`, which build the full record.
//
// Built on first use by commviz.record.boundary (torch.utils.cpp_extension).

#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/boxing/impl/make_boxed_from_unboxed_functor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <c10/util/FunctionRef.h>
#include <Python.h>
#include <frameobject.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <torch/csrc/utils/pybind.h>
#if PY_VERSION_HEX >= 0x030B0000
#include <torch/csrc/dynamo/cpython_includes.h>
#endif

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
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
// so that a call Python began needs no second Python call: its end time, and the two runtime
// slots that say whether Python must finish it (an open profiler range or capture region).
struct Slots {
  Py_ssize_t seq = -1, t_end = -1, meta = -1, region = -1;
} g_slots;

// commviz's Python side (commviz.record.calls), leaked on purpose: it must outlive
// interpreter teardown.
struct Python {
  py::object begin, finish;   // build / finish a full record
  py::object shape;           // register a call site's shape: (index, GroupInfo, slots, src,
                              // dst) | ...
  py::object microbatch;      // a 1F1B p2p call's micro-batch (origins.pipelining), or -1
  py::object scoped;          // a call in a calls.SCOPE block: (GroupInfo, slots) | None
  py::object failed;          // a natively recorded call raised: (ordinal, error)
  py::object hooks;           // commviz.record.capturing: its installed(), looked up per
                              // captured call (a test or benchmark may replace it)
  py::object coalescing;      // torch's _world.pg_coalesce_state: group -> open block's ops
  py::object seq_cell_attr, installed_attr, claim_attr, pg_attr;
};
Python* g_py = nullptr;

// The GIL, taken with CPython's own calls (pybind11's acquire adds bookkeeping of its own, a
// few hundred instructions a call).
struct Gil {
  PyGILState_STATE state = PyGILState_Ensure();
  Gil() = default;
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;
  ~Gil() { PyGILState_Release(state); }
};


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

// Split sizes: an int list as given, or a tensor list's numels (the list all_to_all's splits,
// as the profiler records them).
py::object split_list(const c10::IValue& v) {
  if (v.isTensorList()) {
    std::vector<int64_t> sizes;
    for (const at::Tensor& t : v.toTensorVector()) sizes.push_back(t.numel());
    return py::cast(sizes);
  }
  if (!v.isIntList()) return py::none();
  return py::cast(v.toIntVector());
}

const py::object& pg_name(c10d::ProcessGroup& pg) {
  std::lock_guard<std::mutex> lock(g_names_mutex);
  const std::string& name = pg.getGroupName();
  auto it = g_names->find(&pg);
  if (it == g_names->end() || it->second.name != name) {
    it = g_names->insert_or_assign(&pg, PgName{name, py::str(name)}).first;
  }
  return it->second.py;
}

// The call site: the first Python frame outside torch and commviz (``g_own_dirs``), found by
// walking this thread's frames with a per-code-object verdict cached (code objects are kept).
// A torch function or dispatch mode's hook (``__torch_function__``, ``__torch_dispatch__``,
// calls.MODE_HOOKS) is never one: the call was made where the code it intercepted made it.
std::vector<std::string>* g_own_dirs = new std::vector<std::string>();
auto* g_skip = new std::unordered_map<PyObject*, bool>();

bool mode_hook(PyCodeObject* code) {
  const char* name = PyUnicode_AsUTF8(code->co_name);
  if (name == nullptr) {
    PyErr_Clear();
    return false;
  }
  return std::strcmp(name, "__torch_function__") == 0 ||
         std::strcmp(name, "__torch_dispatch__") == 0;
}

bool own_code(PyCodeObject* code) {
  auto it = g_skip->find(reinterpret_cast<PyObject*>(code));
  if (it != g_skip->end()) return it->second;
  bool own = mode_hook(code);
  const char* file = own ? nullptr : PyUnicode_AsUTF8(code->co_filename);
  if (file == nullptr) {
    if (!own) PyErr_Clear();
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

// The call site: its code object (kept alive by g_skip, so the pointer stays its own) and
// line; code is null when no frame is outside torch and commviz (DDP's reducer on an autograd
// thread). Needs the GIL.
struct Site {
  PyCodeObject* code = nullptr;
  int line = 0;

  py::object file() const {
    return code == nullptr ? py::object(py::none())
                           : py::reinterpret_borrow<py::object>(code->co_filename);
  }
  py::object line_obj() const {
    return code == nullptr ? py::object(py::none()) : py::object(py::int_(line));
  }
};

#if PY_VERSION_HEX >= 0x030B0000
// Python 3.11 on: the interpreter's own frames (_PyInterpreterFrame, through torch's
// cpython_includes.h, as TorchDynamo reads them), walked without making a frame object for
// each (PyEval_GetFrame and PyFrame_GetBack do, and the frames are new on every call).
//
// What this thread's call sites were found to be, kept per thread so that a call can find its
// site without the GIL (`seen_site`): each code object's verdict (own_code) and each line per
// (code object, instruction offset) — Python finds a line by scanning its code object's line
// table, which costs more than all the rest of a natively recorded call.
struct LineKey {
  PyCodeObject* code;  // kept alive by g_skip
  int offset;
  bool operator==(const LineKey& o) const { return code == o.code && offset == o.offset; }
};
struct LineKeyHash {
  size_t operator()(const LineKey& k) const {
    return (reinterpret_cast<uintptr_t>(k.code) >> 4) ^ (static_cast<size_t>(k.offset) * 7);
  }
};
// A map in front of which a few recent keys sit in a direct-mapped table: a call's handful of
// frames are found there in a few instructions rather than through a hash table each.
template <class K, class V, class Hash>
class Seen {
 public:
  const V* find(const K& key) {
    Slot& slot = front_[Hash()(key) % FRONT];
    if (slot.used && slot.key == key) return &slot.value;
    auto it = all_.find(key);
    if (it == all_.end()) return nullptr;
    slot = Slot{it->first, it->second, true};
    return &it->second;
  }
  const V* add(const K& key, V value) { return &all_.insert_or_assign(key, value).first->second; }

 private:
  static constexpr size_t FRONT = 64;
  struct Slot {
    K key{};
    V value{};
    bool used = false;
  };
  Slot front_[FRONT];
  std::unordered_map<K, V, Hash> all_;
};
struct CodeHash {
  size_t operator()(PyCodeObject* code) const { return reinterpret_cast<uintptr_t>(code) >> 4; }
};
struct SeenSites {
  Seen<PyCodeObject*, bool, CodeHash> own;
  Seen<LineKey, int, LineKeyHash> lines;
};
thread_local SeenSites t_sites;

_PyInterpreterFrame* top_frame(PyThreadState* tstate) {
#if PY_VERSION_HEX >= 0x030D0000
  return tstate->current_frame;
#else
  return tstate->cframe->current_frame;
#endif
}

// The next frame out that has begun running (the frames PyFrame_GetBack would give; 3.12's
// own test leaves out its C entry frames, which 3.13 on counts as incomplete).
_PyInterpreterFrame* complete(_PyInterpreterFrame* frame) {
  while (frame != nullptr && (_PyFrame_IsIncomplete(frame)
#if PY_VERSION_HEX >= 0x030C0000 && PY_VERSION_HEX < 0x030D0000
                              || frame->owner == FRAME_OWNED_BY_CSTACK
#endif
                              )) {
    frame = frame->previous;
  }
  return frame;
}

// The call site in the frames of `tstate`, this thread's. Filling (the GIL held), what the
// thread has not seen yet is looked up and kept; not filling (no GIL: the thread's frames stay
// as they are while it is in this call, and only it touches `t_sites`), false where a frame or
// line was not seen yet.
bool find_site(PyThreadState* tstate, bool filling, Site* site) {
  for (_PyInterpreterFrame* frame = complete(top_frame(tstate)); frame != nullptr;
       frame = complete(frame->previous)) {
    PyCodeObject* code = F_CODE(frame);
    const bool* own = t_sites.own.find(code);
    if (own == nullptr) {
      if (!filling) return false;
      own = t_sites.own.add(code, own_code(code));
    }
    if (*own) continue;
    const LineKey key{code, _PyInterpreterFrame_LASTI(frame)};
    const int* line = t_sites.lines.find(key);
    if (line == nullptr) {
      if (!filling) return false;
      line = t_sites.lines.add(
          key, PyCode_Addr2Line(code, key.offset * static_cast<int>(sizeof(_Py_CODEUNIT))));
    }
    *site = Site{code, *line};
    return true;
  }
  *site = Site{};
  return true;
}

Site callsite() {  // needs the GIL
  Site site;
  find_site(PyThreadState_Get(), true, &site);
  return site;
}

// The call site without the GIL, where this thread has seen all of it before; false otherwise.
bool seen_site(Site* site) {
  PyThreadState* tstate = PyGILState_GetThisThreadState();
  return tstate != nullptr && find_site(tstate, false, site);
}
#else
Site callsite() {  // needs the GIL
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    bool own = own_code(code);
    Py_DECREF(code);                              // g_skip keeps it
    if (!own) {
      Site site{code, PyFrame_GetLineNumber(frame)};
      Py_DECREF(frame);
      return site;
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  return {};
}

bool seen_site(Site*) { return false; }  // (no fast path before Python 3.11)
#endif

// -- origins: the framework unit a call serves, as torch names it ---------------------------
// torch's frameworks open profiler ranges around their communication whether or not a
// profiler runs (torch.profiler.record_function: FSDP2's "FSDP::all_gather (layers.0)",
// pipelining's "PP:0F1" and "Forward 1", "DistributedDataParallel.forward"). Python's
// record_function enters and exits a range through two ops (profiler::_record_function_enter_new
// and _record_function_exit), which take no tensors and so pass the BackendSelect key: commviz
// puts a kernel there too (`RangeEnter`, `RangeExit`), which keeps, per thread, the chain of
// open ranges whose names start with one of the origin resolvers' prefixes, interned as an
// id. A call's origin is then one thread-local read, and its shape is per (call site, origin).
// No RecordFunction callback is added: with one on USER_SCOPE, c10d's Work would build its own
// profiling range on every collective.
struct OriginNode {
  int32_t parent;
  std::string name;
  int64_t entered = 0;  // times the range was opened (DDP's forwards number its buckets)
};
std::mutex g_origin_mutex;
auto* g_origin_nodes = new std::vector<OriginNode>{{-1, std::string()}};  // 0: no range open
auto* g_origin_ids = new std::map<std::pair<int32_t, std::string>, int32_t>();
auto* g_origin_prefixes = new std::vector<std::string>();  // set before the kernels go in
thread_local int32_t t_origin = 0;

// A range of the chain open on this thread: its handle (the _RecordFunction the enter op
// returned), the origin before it, and whether its exit calls Python (`g_exit_watch`).
struct OpenRange {
  const void* handle;
  int32_t prev;
  bool watched;
};
thread_local std::vector<OpenRange> t_open;

// One range name whose exits call a Python function (commviz.record.ddp_buckets reads DDP's
// buckets when a DDP forward ends, where nothing holds the reducer's mutex); an error in the
// function stops the calls.
struct ExitWatch {
  std::string name;
  py::object callback;
};
ExitWatch* g_exit_watch = nullptr;
std::atomic<bool> g_exit_armed{false};

void watch_exit(const std::string& name, py::object callback) {
  if (g_exit_watch == nullptr) g_exit_watch = new ExitWatch();  // outlives the interpreter
  g_exit_watch->name = name;
  g_exit_watch->callback = std::move(callback);
  g_exit_armed.store(true);
}

void call_exit_watch() {
  Gil gil;
  try {
    g_exit_watch->callback();
  } catch (const std::exception&) {
    g_exit_armed.store(false);
    PyErr_Clear();
  }
}

bool followed(const std::string& name) {
  for (const std::string& prefix : *g_origin_prefixes) {
    if (name.compare(0, prefix.size(), prefix) == 0) return true;
  }
  return false;
}

// The id of range `name` opened inside this thread's current chain.
int32_t open_range(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_origin_mutex);
  auto [it, fresh] = g_origin_ids->try_emplace({t_origin, name},
                                               static_cast<int32_t>(g_origin_nodes->size()));
  if (fresh) g_origin_nodes->push_back({t_origin, name});
  ++(*g_origin_nodes)[it->second].entered;
  return it->second;
}

// Recording on or off (off: the kernels only redispatch, and ranges opened then are not seen).
void set_active(bool on) { g_active.store(on); }

// The open ranges an origin id stands for, outermost first.
std::vector<std::string> origin_path(int32_t id) {
  std::lock_guard<std::mutex> lock(g_origin_mutex);
  std::vector<std::string> names;
  while (id > 0 && id < static_cast<int32_t>(g_origin_nodes->size())) {
    names.push_back((*g_origin_nodes)[id].name);
    id = (*g_origin_nodes)[id].parent;
  }
  std::reverse(names.begin(), names.end());
  return names;
}

// How often ranges named `name` were opened, on any thread.
int64_t origin_count(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_origin_mutex);
  int64_t n = 0;
  for (const OriginNode& node : *g_origin_nodes) {
    if (node.name == name) n += node.entered;
  }
  return n;
}

const py::object& dtype_name(c10::ScalarType st) {
  py::object& slot = g_dtype_names[static_cast<int>(st)];
  if (!slot) slot = py::str(c10::toString(st));
  return slot;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// -- natively recorded calls ---------------------------------------------------------------

// One call recorded without Python. The same 48 bytes go to the ring and to the calls file
// (commviz.record.journal.NATIVE_CALL reads them): the ordinal is written last and a fresh file
// reads zero, so an entry torn by a SIGKILL reads as absent.
struct Call {
  int32_t shape;
  int32_t flags;    // FAILED: the call raised (its text went to the journal via `failed`);
                    // CAPTURED: it ran under CUDA graph capture
  int64_t seq;      // a collective's group number, a p2p call's Flight Recorder number; -1: none
  int64_t pair;     // a p2p call's number between its two ranks (commviz.p2p_seq); -1: none
  int64_t t_begin;
  int64_t t_end;    // RUNNING until the call returns
  int64_t ordinal;
};
static_assert(sizeof(Call) == 48, "the calls file's entry is 48 bytes");
constexpr int64_t RUNNING = -1;
constexpr int32_t FAILED = 1;
constexpr int32_t CAPTURED = 2;
constexpr char CALLS_MAGIC[16] = {'c', 'o', 'm', 'm', 'v', 'i', 'z', '.', 'c',
                                  'a', 'l', 'l', 's', '.', '2', '\n'};
constexpr size_t CHUNK = 64 << 10;      // first reservation; doubles up to MAX_STEP
constexpr size_t MAX_STEP = 16 << 20;

// A calls file: mapped, grown in reserved steps (posix_fallocate: a full disk is an error
// here, not a SIGBUS later).
struct Segment {
  uint64_t id = 0;
  std::string path;
  int fd = -1;
  char* map = nullptr;
  size_t size = 0;
  size_t pos = sizeof(CALLS_MAGIC);

  int reserve(size_t need) {  // 0 or an errno
    if (pos + need <= size) return 0;
    size_t grown = std::max(size + std::min(std::max(size, CHUNK), MAX_STEP), pos + need);
    int rc = posix_fallocate(fd, 0, static_cast<off_t>(grown));
    if (rc != 0) return rc;
    void* m = map == nullptr ? mmap(nullptr, grown, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                             : mremap(map, size, grown, MREMAP_MAYMOVE);
    if (m == MAP_FAILED) return errno;
    map = static_cast<char*>(m);
    size = grown;
    return 0;
  }

  void close() {
    if (map != nullptr) munmap(map, size);
    if (fd >= 0) ::close(fd);
    map = nullptr;
    fd = -1;
  }
};

// Where a call's entry lives, to write its end.
struct Where {
  int64_t ordinal = 0;
  int32_t shape = -1;
  int64_t t_begin = 0;
  uint64_t ring_pos = 0;
  uint64_t segment = 0;  // 0: not in a file
  size_t offset = 0;
};

// The ring of natively recorded calls, the ordinal counter shared with Python's records, and
// the calls files. All under one mutex: the end of a call is written without the GIL.
class Native {
 public:
  Where add(int32_t shape, int64_t seq, int64_t pair, int64_t t_begin) {
    std::lock_guard<std::mutex> lock(mu_);
    Where w;
    w.ordinal = ++ordinal_;
    w.shape = shape;
    w.t_begin = t_begin;
    Call call{shape, 0, seq, pair, t_begin, RUNNING, w.ordinal};
    if (!ring_.empty()) {
      w.ring_pos = pushed_++;
      ring_[w.ring_pos % ring_.size()] = call;
    }
    if (current_ != nullptr) {
      int rc = current_->reserve(sizeof(Call));
      if (rc != 0) {
        fail(rc);
      } else {
        char* at = current_->map + current_->pos;
        std::memcpy(at, &call, offsetof(Call, ordinal));
        std::atomic_thread_fence(std::memory_order_release);
        std::memcpy(at + offsetof(Call, ordinal), &call.ordinal, sizeof(int64_t));
        w.segment = current_->id;
        w.offset = current_->pos;
        current_->pos += sizeof(Call);
      }
    }
    return w;
  }

  void end(const Where& w, int64_t seq, int64_t t_end, int32_t flags) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ring_.empty() && pushed_ - w.ring_pos <= ring_.size()) {
      Call& call = ring_[w.ring_pos % ring_.size()];
      if (call.ordinal == w.ordinal) {
        call.seq = seq;
        call.t_end = t_end;
        call.flags = flags;
      }
    }
    if (w.segment == 0) return;
    for (Segment& seg : segments_) {
      if (seg.id == w.segment && seg.map != nullptr) {
        Call* call = reinterpret_cast<Call*>(seg.map + w.offset);
        call->seq = seq;
        call->t_end = t_end;
        call->flags = flags;
        return;
      }
    }
  }

  int64_t next_ordinal() {
    std::lock_guard<std::mutex> lock(mu_);
    return ++ordinal_;
  }
  int64_t last_ordinal() {
    std::lock_guard<std::mutex> lock(mu_);
    return ordinal_;
  }
  void set_ordinal(int64_t value) {
    std::lock_guard<std::mutex> lock(mu_);
    ordinal_ = value;
  }

  // Keep the last `capacity` calls (the recorder's ring size).
  void resize(size_t capacity) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Call> kept = ordered();
    if (kept.size() > capacity) kept.erase(kept.begin(), kept.end() - capacity);
    ring_.assign(capacity, Call{});
    pushed_ = 0;
    for (const Call& call : kept) ring_[pushed_++ % capacity] = call;
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    std::fill(ring_.begin(), ring_.end(), Call{});
    pushed_ = 0;
    ordinal_ = 0;
    captured_.clear();
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::min<uint64_t>(pushed_, ring_.size());
  }

  py::bytes entries() {
    std::vector<Call> calls;
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls = ordered();
    }
    return py::bytes(reinterpret_cast<const char*>(calls.data()), calls.size() * sizeof(Call));
  }

  // Start writing calls to `path` (a new generation); 0 or an errno.
  int open(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    retire();
    Segment seg;
    seg.id = ++segment_ids_;
    seg.path = path;
    seg.fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (seg.fd < 0) return errno;
    int rc = seg.reserve(CHUNK);
    if (rc != 0) {
      seg.close();
      ::unlink(path.c_str());
      return rc;
    }
    std::memcpy(seg.map, CALLS_MAGIC, sizeof(CALLS_MAGIC));
    segments_.push_back(seg);
    current_ = &segments_.back();
    error_.clear();
    return 0;
  }

  // Stop writing to the current file; calls still running finish in it.
  void close() {
    std::lock_guard<std::mutex> lock(mu_);
    retire();
  }

  // Unmap every file no longer written (Python removes or keeps the files).
  void drop() {
    std::lock_guard<std::mutex> lock(mu_);
    for (Segment& seg : segments_) {
      if (&seg != current_) seg.close();
    }
    segments_.remove_if([](const Segment& s) { return s.fd < 0; });
  }

  std::string error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

  // A captured call, as it returned: its entry and what its stream's capture was then.
  struct Captured {
    Call call;
    uint64_t capture_id;  // 0: the capture had ended (or broke) by the time the call returned
    uintptr_t graph, stream;
    std::vector<uintptr_t> frontier;
  };

  void captured(Captured&& note) {
    std::lock_guard<std::mutex> lock(mu_);
    captured_.push_back(std::move(note));
  }

  // Whether a call captured in capture `id` waits to be taken: the capture hooks ask as the
  // capture ends (its graph is read only if it holds collectives), and take the calls later.
  bool has_captured(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = captured_.rbegin(); it != captured_.rend(); ++it) {
      if (it->capture_id == id) return true;
    }
    return false;
  }

  // The nodes the captured calls not taken yet saw their streams wait on in graph `graph`:
  // nearly always kernel nodes (a synchronous collective's stream waits on its kernel), so
  // `read_graph` reads them without asking their type first.
  std::vector<uintptr_t> frontiers_in(uintptr_t graph) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uintptr_t> out;
    for (const Captured& n : captured_) {
      if (n.graph == graph) out.insert(out.end(), n.frontier.begin(), n.frontier.end());
    }
    return out;
  }

  // The captured calls since the last take, oldest first, for Python to place in their graph:
  // (shape, flags, seq, t_begin, t_end, ordinal, capture id, graph, stream, frontier).
  py::list take_captured() {
    std::vector<Captured> notes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      notes.swap(captured_);
    }
    py::list out;
    for (const Captured& n : notes) {
      py::list frontier;
      for (uintptr_t node : n.frontier) frontier.append(py::int_(node));
      const Call& c = n.call;
      out.append(py::make_tuple(c.shape, c.flags, c.seq, c.t_begin, c.t_end, c.ordinal,
                                n.capture_id, n.graph, n.stream, frontier));
    }
    return out;
  }

 private:
  std::vector<Call> ordered() const {  // oldest first; mu_ held
    std::vector<Call> out;
    size_t n = std::min<uint64_t>(pushed_, ring_.size());
    out.reserve(n);
    for (uint64_t i = pushed_ - n; i < pushed_; ++i) out.push_back(ring_[i % ring_.size()]);
    return out;
  }

  void retire() { current_ = nullptr; }

  void fail(int rc) {  // the disk is full: keep the ring, stop the file, say why (once)
    error_ = current_->path + ": " + std::strerror(rc);
    retire();
  }

  std::mutex mu_;
  std::vector<Call> ring_;
  uint64_t pushed_ = 0;
  int64_t ordinal_ = 0;
  std::list<Segment> segments_;  // a list: `current_` and the others stay where they are
  Segment* current_ = nullptr;
  uint64_t segment_ids_ = 0;
  std::string error_;
  std::vector<Captured> captured_;
};

Native* g_native = new Native();

// -- shapes: what a call site repeats --------------------------------------------------------

// The calling thread as the OS names it (the profiler's trace names threads so): the match
// step finds the call's `c10d::<op>` event on this thread.
thread_local int32_t t_tid = 0;

int32_t thread_id() {
  if (t_tid == 0) t_tid = static_cast<int32_t>(syscall(SYS_gettid));
  return t_tid;
}

struct ShapeKey {
  const void* pg;
  PyCodeObject* code;
  int line;
  int op;
  int64_t in_n, out_n, root, redop;
  int dtype;
  bool async_op, cuda;
  int32_t origin;
  int32_t tid;
  int32_t microbatch;  // a 1F1B p2p call's micro-batch (-1: none asked)

  bool operator==(const ShapeKey& o) const {
    return pg == o.pg && code == o.code && line == o.line && origin == o.origin && op == o.op &&
           in_n == o.in_n && out_n == o.out_n && root == o.root && redop == o.redop &&
           dtype == o.dtype && async_op == o.async_op && cuda == o.cuda && tid == o.tid &&
           microbatch == o.microbatch;
  }
};

struct ShapeKeyHash {
  size_t operator()(const ShapeKey& k) const {
    size_t h = std::hash<const void*>()(k.pg);
    auto mix = [&h](size_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    mix(std::hash<const void*>()(k.code));
    mix(static_cast<size_t>(k.line));
    mix(static_cast<size_t>(k.origin));
    mix(static_cast<size_t>(k.op));
    mix(static_cast<size_t>(k.in_n));
    mix(static_cast<size_t>(k.out_n));
    mix(static_cast<size_t>(k.root) * 31 + static_cast<size_t>(k.redop));
    mix(static_cast<size_t>(k.dtype) * 4 + k.async_op * 2 + k.cuda);
    mix(static_cast<size_t>(k.tid) * 131 + static_cast<size_t>(k.microbatch));
    return h;
  }
};

// A group's point-to-point numbering, as ProcessGroupNCCL counts `seqP2P_` and Flight Recorder
// writes it (`p2p_seq_id`): one per p2p op outside a coalescing block, one per block
// (batch_isend_irecv on a backend that coalesces: its ops share it); and commviz's own per
// (source, destination) pair, which a send and its receive on the peer share. Both for every
// p2p call the kernel records, natively or through Python (`take_p2p`).
struct P2P {
  int64_t fr = 0;
  py::object block;  // the coalescing block that took the last number (held: its id stays its own)
  std::map<std::pair<int64_t, int64_t>, int64_t> pairs;
};
// By group name; never erased (a group's numbering lasts the process). The map is touched
// with the GIL; a group's numbers under g_p2p_mutex too (the fast path takes them without it).
auto* g_p2p = new std::unordered_map<std::string, P2P>();
std::mutex g_p2p_mutex;

int64_t take_pair(P2P& state, int64_t src, int64_t dst) {  // g_p2p_mutex held
  return src >= 0 && dst >= 0 ? ++state.pairs[{src, dst}] : -1;
}

// `block`: the op list torch keeps for the group's open _coalescing_manager (borrowed), or
// null. Needs the GIL.
std::pair<int64_t, int64_t> take_p2p(P2P& state, PyObject* block, int64_t src, int64_t dst) {
  std::lock_guard<std::mutex> lock(g_p2p_mutex);
  if (block == nullptr || block != state.block.ptr()) ++state.fr;
  state.block = block == nullptr ? py::object() : py::reinterpret_borrow<py::object>(block);
  return {state.fr, take_pair(state, src, dst)};
}

// take_p2p without the GIL, for a call outside any coalescing block after one outside a block
// too; false where Python's objects are involved (the GIL path takes the numbers then).
bool take_p2p_unblocked(P2P& state, int64_t src, int64_t dst, std::pair<int64_t, int64_t>* got) {
  // (torch's dict of open blocks, its size read without the GIL: blocks are opened and closed
  // by the thread that issues their calls, and this is that thread)
  PyObject* open = g_py->coalescing.ptr();
  if (open == nullptr || !PyDict_CheckExact(open) || PyDict_GET_SIZE(open) != 0) return false;
  std::lock_guard<std::mutex> lock(g_p2p_mutex);
  if (state.block) return false;
  *got = {++state.fr, take_pair(state, src, dst)};
  return true;
}

// The group's open coalescing block (torch's own state, read, never changed). Needs the GIL.
PyObject* coalescing_block(PyObject* pg) {
  if (pg == nullptr || pg == Py_None || !g_py->coalescing) return nullptr;
  PyObject* block = PyDict_GetItemWithError(g_py->coalescing.ptr(), pg);  // borrowed
  if (block == nullptr) PyErr_Clear();
  return block;
}

// A group's last sequence number, in its GroupInfo's `seq_cell` (a one-element int64 array,
// never resized), which Python and the kernel both number from in place (`take_seq`).
struct SeqCell {
  py::object owner;        // the array, kept alive
  int64_t* last = nullptr;
  explicit operator bool() const { return last != nullptr; }
};

SeqCell seq_cell(const py::object& info) {
  py::object cell = info.attr(g_py->seq_cell_attr);
  py::buffer_info view = py::buffer(cell).request(true);
  if (view.itemsize != sizeof(int64_t) || view.size != 1) {
    throw std::runtime_error("commviz: GroupInfo.seq_cell is not one int64");
  }
  return SeqCell{cell, static_cast<int64_t*>(view.ptr)};
}

// What Python said of a shape: record natively (its index, group and sequence slots; for a
// p2p call its ranks and group numbering), never record (a group this rank is not in,
// commviz's side group), ask for the micro-batch first (a 1F1B schedule's p2p call: the
// shape is per micro-batch), or always ask `begin` (origins that change per call).
enum class Verdict { NATIVE, SKIP, MICROBATCH, PYTHON };

struct Shape {
  Verdict verdict = Verdict::PYTHON;
  int32_t index = -1;
  SeqCell seq;       // its group's numbering (GroupInfo.seq_cell)
  int64_t slots = 1;
  std::string pg_name;  // a pointer reused by a later group is not the same group
  P2P* p2p = nullptr;   // a p2p shape's group numbering
  py::object pg;        // its torch ProcessGroup (the coalescing state's key)
  int64_t src = -1, dst = -1;  // its global ranks (-1: a receive from any source)
};

// Changed with the GIL and g_shapes_mutex held; read with either (the fast path: the mutex).
auto* g_shapes = new std::unordered_map<ShapeKey, Shape, ShapeKeyHash>();
std::mutex g_shapes_mutex;

void clear_shapes() {  // needs the GIL; the shapes' Python objects go outside the mutex
  std::unordered_map<ShapeKey, Shape, ShapeKeyHash> old;
  std::lock_guard<std::mutex> lock(g_shapes_mutex);
  old.swap(*g_shapes);
}

// The calls.SCOPE blocks open on this thread (calls.SCOPE sets them): how many, and the
// innermost one's Claim (None: an `unrecorded` block). The Claim is kept alive by the stack.
thread_local int64_t t_scope_depth = 0;
thread_local PyObject* t_scope_top = nullptr;
// What commviz.record.capturing.capture_possible() says (capturing.changed sets it).
std::atomic<bool> g_capture_possible{false};

// How a call is recorded: natively as a plain call, natively under capture (its frontier is
// read as it returns), by Python's `begin` / `finish`, or not on its own (inside a block).
enum class Mode { PLAIN, CAPTURE_POSSIBLE, CAPTURED, PYTHON, SCOPED };

// PLAIN, or CAPTURE_POSSIBLE for a CUDA call while a capture may be running; SCOPED inside an
// annotate_collective or unrecorded block.
Mode call_mode(bool cuda) {
  if (t_scope_depth > 0) return Mode::SCOPED;
  if (!cuda) return Mode::PLAIN;
  return g_capture_possible.load(std::memory_order_relaxed) ? Mode::CAPTURE_POSSIBLE
                                                             : Mode::PLAIN;
}

// -- CUDA graph capture: the driver's view of the call's stream ------------------------------

// cuStreamGetCaptureInfo (CUDA >= 12.3 drivers: _v3 with edge data; older: _v2), resolved in
// the libcuda.so.1 torch already loaded, so the kernel needs no CUDA headers or libraries.
using InfoV3 = int (*)(void*, int*, unsigned long long*, void**, void* const**, const void**,
                       size_t*);
using InfoV2 = int (*)(void*, int*, unsigned long long*, void**, void* const**, size_t*);
std::atomic<void*> g_info_fn{nullptr};
std::atomic<bool> g_info_v3{true};
constexpr int CAPTURE_NONE = 0, CAPTURE_ACTIVE = 1;  // CUstreamCaptureStatus

bool find_capture_info() {
  if (g_info_fn.load() != nullptr) return true;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return false;
  void* fn = dlsym(lib, "cuStreamGetCaptureInfo_v3");
  bool v3 = fn != nullptr;
  if (!v3) fn = dlsym(lib, "cuStreamGetCaptureInfo_v2");
  if (fn == nullptr) return false;
  g_info_v3.store(v3);
  g_info_fn.store(fn);
  return true;
}

struct CaptureInfo {
  int status = -1;  // -1: could not ask
  unsigned long long id = 0;
  void* graph = nullptr;
  void* const* deps = nullptr;
  size_t n = 0;
};

CaptureInfo capture_info(void* stream) {
  CaptureInfo info;
  void* fn = g_info_fn.load();
  if (fn == nullptr) return info;
  const void* edges = nullptr;
  int rc = g_info_v3.load()
               ? reinterpret_cast<InfoV3>(fn)(stream, &info.status, &info.id, &info.graph,
                                              &info.deps, &edges, &info.n)
               : reinterpret_cast<InfoV2>(fn)(stream, &info.status, &info.id, &info.graph,
                                              &info.deps, &info.n);
  if (rc != 0) info.status = -1;
  return info;
}

// The current stream of `tensor`'s device, as the driver's handle (torch's current stream is
// the one a collective joins back into, so the one whose frontier a capture moves).
void* current_stream(const at::Tensor& tensor) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
      ->getStream(tensor.device())
      .native_handle();
}

// While a capture may be running. A synchronous call once the capture hooks are in (they place
// the call in its graph at capture end) is CAPTURED: whether its stream really captures is read
// as it returns, together with the frontier (`note_captured`), so it costs one driver query,
// not a second one before the call. Any other call is PLAIN if its stream is not capturing,
// else PYTHON (asynchronous work the stream does not wait for is walked by Python; a capture
// without the hooks; no driver entry point). Needs the GIL.
Mode capture_mode(const at::Tensor& tensor, bool async_op, void** stream) {
  if (!find_capture_info()) return Mode::PYTHON;
  try {
    *stream = current_stream(tensor);
  } catch (const std::exception&) {
    return Mode::PYTHON;
  }
  if (!async_op) {
    py::object installed = g_py->hooks.attr(g_py->installed_attr)();
    if (PyObject_IsTrue(installed.ptr())) return Mode::CAPTURED;
  }
  return capture_info(*stream).status == CAPTURE_NONE ? Mode::PLAIN : Mode::PYTHON;
}

// -- CUDA graph capture: the whole graph, read once as its capture ends ----------------------
//
// The capture hooks read a graph before torch ends its capture (the graph is gone after
// that): its nodes, its edges, and each kernel node's function name, launch dims and toolsId
// (commviz.capture.bindings.read). Through Python that is several driver calls and a few
// microseconds a node, paid while the user waits for the capture; here it is one call for the
// whole graph. The entry points are resolved in the libcuda.so.1 torch loaded, like
// cuStreamGetCaptureInfo above.
struct GraphDriver {
  // CUDA_KERNEL_NODE_PARAMS_v2, as the driver lays it out
  struct KernelParams {
    void* func;
    unsigned int dims[6];  // grid x, y, z, block x, y, z
    unsigned int shared_mem;
    void** kernel_params;
    void** extra;
    void* kern;
    void* ctx;
  };
  using Listing = int (*)(void*, void**, size_t*);
  using EdgesV2 = int (*)(void*, void**, void**, void*, size_t*);
  using EdgesV1 = int (*)(void*, void**, void**, size_t*);
  using NodeType = int (*)(void*, int*);
  using Params = int (*)(void*, KernelParams*);
  using Name = int (*)(const char**, void*);
  using ToolsId = int (*)(void*, unsigned long long*);

  Listing nodes = nullptr;
  EdgesV2 edges_v2 = nullptr;
  EdgesV1 edges_v1 = nullptr;
  NodeType type = nullptr;
  Params params = nullptr;
  Name func_name = nullptr, kernel_name = nullptr;
  ToolsId tools = nullptr;  // CUDA >= 13.1 drivers

  static constexpr int KERNEL = 0;  // CU_GRAPH_NODE_TYPE_KERNEL

  bool ok() const {
    return nodes != nullptr && (edges_v2 != nullptr || edges_v1 != nullptr) &&
           type != nullptr && params != nullptr && func_name != nullptr;
  }
};

// The driver's graph entry points, looked up again until torch has loaded libcuda. Needs the GIL.
const GraphDriver& graph_driver() {
  static GraphDriver driver;
  if (driver.ok()) return driver;
  driver = [] {
    GraphDriver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) return d;
    auto find = [lib](const char* name) { return dlsym(lib, name); };
    d.nodes = reinterpret_cast<GraphDriver::Listing>(find("cuGraphGetNodes"));
    d.edges_v2 = reinterpret_cast<GraphDriver::EdgesV2>(find("cuGraphGetEdges_v2"));
    if (d.edges_v2 == nullptr) {
      d.edges_v1 = reinterpret_cast<GraphDriver::EdgesV1>(find("cuGraphGetEdges"));
    }
    d.type = reinterpret_cast<GraphDriver::NodeType>(find("cuGraphNodeGetType"));
    d.params = reinterpret_cast<GraphDriver::Params>(find("cuGraphKernelNodeGetParams_v2"));
    d.func_name = reinterpret_cast<GraphDriver::Name>(find("cuFuncGetName"));
    d.kernel_name = reinterpret_cast<GraphDriver::Name>(find("cuKernelGetName"));
    d.tools = reinterpret_cast<GraphDriver::ToolsId>(find("cuGraphNodeGetToolsId"));
    return d;
  }();
  return driver;
}

template <typename T>
py::bytes as_bytes(const std::vector<T>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// The graph `graph` (a CUgraph, live: under capture or kept): (nodes, edge sources, edge
// targets, kernels, names, params, tools) where nodes are the handles in the driver's listing
// order (u64), edge i runs from sources[i] to targets[i] (u64), kernels are the positions of
// the kernel nodes in that listing (u32), names the distinct function names (mangled), params
// seven u32 per kernel (its name's index, then grid and block dims) and tools each kernel's
// toolsId (u64; None where the driver has none). None where the driver cannot be asked.
py::object read_graph(uintptr_t graph_handle) {
  if (graph_handle == 0) return py::none();
  const GraphDriver& d = graph_driver();
  if (!d.ok()) return py::none();
  void* graph = reinterpret_cast<void*>(graph_handle);
  const std::vector<uintptr_t> frontiers = g_native->frontiers_in(graph_handle);
  const std::unordered_set<uintptr_t> likely(frontiers.begin(), frontiers.end());
  std::vector<void*> nodes, sources, targets;
  std::vector<uint32_t> kernels, params;
  std::vector<uint64_t> tools;
  std::vector<std::string> names;
  bool with_tools = d.tools != nullptr;
  bool read = [&]() {
    py::gil_scoped_release nogil;
    size_t n = 0;
    if (d.nodes(graph, nullptr, &n) != 0) return false;
    nodes.resize(n);
    if (n > 0 && d.nodes(graph, nodes.data(), &n) != 0) return false;
    nodes.resize(n);
    size_t m = 0;
    int rc = d.edges_v2 != nullptr ? d.edges_v2(graph, nullptr, nullptr, nullptr, &m)
                                   : d.edges_v1(graph, nullptr, nullptr, &m);
    if (rc != 0) return false;
    sources.resize(m);
    targets.resize(m);
    if (m > 0) {
      std::vector<uint64_t> edge_data(m);  // CUgraphEdgeData: 8 bytes an edge
      rc = d.edges_v2 != nullptr
               ? d.edges_v2(graph, sources.data(), targets.data(), edge_data.data(), &m)
               : d.edges_v1(graph, sources.data(), targets.data(), &m);
      if (rc != 0) return false;
      sources.resize(m);
      targets.resize(m);
    }
    std::unordered_map<void*, uint32_t> name_index;  // function -> its index in `names`
    kernels.reserve(n);
    params.reserve(7 * n);
    for (size_t i = 0; i < nodes.size(); ++i) {
      // (reading a kernel's parameters off another kind of node fails, and failing is the
      // driver's slow path: the type is asked first, but for the likely kernels)
      int type = GraphDriver::KERNEL;
      GraphDriver::KernelParams p{};
      if (!likely.count(reinterpret_cast<uintptr_t>(nodes[i])) &&
          d.type(nodes[i], &type) != 0) {
        continue;
      }
      if (type != GraphDriver::KERNEL || d.params(nodes[i], &p) != 0) continue;
      void* function = p.func != nullptr ? p.func : p.kern;
      auto it = name_index.find(function);
      if (it == name_index.end()) {
        const char* name = nullptr;
        int err = p.func != nullptr ? d.func_name(&name, p.func)
                  : d.kernel_name != nullptr ? d.kernel_name(&name, p.kern)
                                             : -1;
        if (err != 0 || name == nullptr) continue;  // unnamed: not listed as a kernel
        it = name_index.emplace(function, static_cast<uint32_t>(names.size())).first;
        names.emplace_back(name);
      }
      kernels.push_back(static_cast<uint32_t>(i));
      params.push_back(it->second);
      params.insert(params.end(), p.dims, p.dims + 6);
      if (with_tools) {
        unsigned long long id = 0;
        if (d.tools(nodes[i], &id) != 0) {
          with_tools = false;  // not supported by this driver: none at all
        } else {
          tools.push_back(id);
        }
      }
    }
    return true;
  }();
  if (!read) return py::none();
  py::list py_names;
  for (const std::string& name : names) {
    py_names.append(py::reinterpret_steal<py::object>(
        PyUnicode_DecodeUTF8(name.data(), static_cast<Py_ssize_t>(name.size()), "replace")));
  }
  return py::make_tuple(as_bytes(nodes), as_bytes(sources), as_bytes(targets),
                        as_bytes(kernels), py_names, as_bytes(params),
                        with_tools ? py::object(as_bytes(tools)) : py::none());
}

// The group's next number (GroupInfo.take_seq): `slots` numbers from its last. Atomic, as a
// call on the fast path takes it without the GIL; Python takes its numbers from the same cell
// with the GIL (two threads numbering one group at once would race in torch itself).
int64_t take_seq(int64_t* last, int64_t slots) {
  return __atomic_fetch_add(last, slots, __ATOMIC_RELAXED) + 1;
}

// What a call inside a calls.SCOPE block takes (Kernel::scoped): its group and sequence
// numbers; no group for a p2p call. Per (group, op, device), touched with the GIL held only.
struct Scoped {
  SeqCell seq;       // its group's numbering; none for a p2p call
  int64_t slots = 1;
  std::string pg_name;
};
auto* g_scoped = new std::map<std::tuple<const void*, int, bool>, Scoped>();

// The kernels below redispatch with this: the backend's kernel is next.
const c10::DispatchKeySet kBelowBackendSelect(c10::DispatchKeySet::FULL_AFTER,
                                              c10::DispatchKey::BackendSelect);

// The object of a custom-class argument (ProcessGroup, ReduceOp, Work), unchecked: the op's
// schema types it (IValue::toCustomClass would look its class up by name on every call).
template <class T>
T& custom(const c10::IValue& value) {
  const void* held = value.toObjectRef().getSlot(0).internalToPointer();
  return *static_cast<T*>(static_cast<torch::CustomClassHolder*>(const_cast<void*>(held)));
}

// Recording is on and the call goes to gloo's (CPU) or NCCL's (CUDA) kernel, not, say, to a
// Meta kernel under a fake-tensor trace.
bool recording(c10::DispatchKeySet below) {
  if (!g_active.load(std::memory_order_relaxed)) return false;
  const c10::DispatchKey backend = below.highestPriorityTypeId();
  return backend == c10::DispatchKey::CPU || backend == c10::DispatchKey::CUDA;
}

// Records the calls of one op and runs the backend's kernel.
class Kernel {
 public:
  explicit Kernel(OpSpec spec) : spec_(spec) {}

  // Runs torch's kernel for a recorded call and returns the Work it gave (null: none).
  using Run = c10::function_ref<c10d::Work*()>;

  // A call with its arguments boxed on `stack`.
  void boxed(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const c10::DispatchKeySet below = ks & kBelowBackendSelect;
    if (!recording(below)) {
      op.redispatchBoxed(below, stack);
      return;
    }
    const size_t nargs = op.schema().arguments().size();
    record(stack->data() + (stack->size() - nargs), [&]() -> c10d::Work* {
      op.redispatchBoxed(below, stack);
      return !stack->empty() && stack->back().isObject()
                 ? &custom<c10d::Work>(stack->back())  // the stack keeps it
                 : nullptr;
    });
  }

  // Records a call whose arguments are `args` (boxed; read before `run` only).
  void record(const c10::IValue* args, Run run) {
    const c10::IValue& in = args[spec_.in_arg];
    const c10::IValue& out = args[spec_.out_arg < 0 ? spec_.in_arg : spec_.out_arg];
    const at::Tensor* tensor = first_tensor(in);
    if (tensor == nullptr) tensor = first_tensor(out);
    c10d::ProcessGroup& pg = custom<c10d::ProcessGroup>(args[spec_.pg_arg]);
    Args call;
    call.redop = -1;
    if (spec_.redop_arg >= 0) {
      call.redop =
          static_cast<int64_t>(custom<c10d::ReduceOp>(args[spec_.redop_arg]).op_);
    }
    call.root = spec_.root_arg >= 0 ? args[spec_.root_arg].toInt() : -1;
    call.async_op = spec_.async_arg >= 0 && args[spec_.async_arg].toBool();
    call.cuda = tensor != nullptr && tensor->is_cuda();
    call.origin = t_origin;
    call.in_n = numel(in);
    call.out_n = spec_.out_arg < 0 ? call.in_n : numel(out);
    call.st = tensor != nullptr ? tensor->scalar_type() : c10::ScalarType::Byte;
    call.esize = tensor != nullptr ? static_cast<int64_t>(c10::elementSize(call.st)) : 0;
    const bool splits = has_split(args, spec_.in_split_arg) || has_split(args, spec_.out_split_arg);

    Verdict verdict = Verdict::PYTHON;
    int64_t* numbering = nullptr;  // the group's (GroupInfo.seq_cell: groups live as the process)
    int64_t seq = -1;
    Where where;
    py::object rec;
    void* stream = nullptr;    // a captured call's stream
    Mode mode = call_mode(call.cuda);
    if (splits || mode != Mode::PLAIN ||
        !without_gil(pg, call, &verdict, &numbering, &seq, &where)) {
      Gil gil;
      try {
        if (mode == Mode::SCOPED) {
          scoped(pg, call);
          verdict = Verdict::SKIP;
        } else {
          Site site = callsite();
          call.tid = thread_id();
          if (splits) mode = Mode::PYTHON;
          if (mode == Mode::CAPTURE_POSSIBLE) mode = capture_mode(*tensor, call.async_op, &stream);
          if (mode != Mode::CAPTURED) stream = nullptr;
          if (mode == Mode::PLAIN || mode == Mode::CAPTURED) {
            const Shape* shape = &shape_of(pg, site, call);
            if (shape->verdict == Verdict::MICROBATCH) {
              call.microbatch = microbatch();
              shape = &shape_of(pg, site, call);
            }
            // p2p work under capture is placed by Python (asynchronous: the stream does not
            // wait for it)
            verdict = shape->p2p != nullptr && mode == Mode::CAPTURED ? Verdict::PYTHON
                                                                     : shape->verdict;
            if (verdict == Verdict::NATIVE) {
              int64_t pair = -1;
              if (shape->p2p != nullptr) {  // (no group number to follow)
                std::tie(seq, pair) = take_p2p(*shape->p2p, coalescing_block(shape->pg.ptr()),
                                               shape->src, shape->dst);
              } else {
                numbering = shape->seq.last;
                seq = take_seq(numbering, shape->slots);
              }
              where = g_native->add(shape->index, seq, pair, now_ns());
            }
          }
          if (verdict == Verdict::PYTHON) rec = begin(args, pg, site, call);
        }
      } catch (py::error_already_set& exc) {  // never break the job's collective
        exc.discard_as_unraisable("commviz: recording a collective");
        verdict = Verdict::SKIP;
      }
    }
    if (verdict == Verdict::NATIVE) {
      run_native(run, pg, call, numbering, seq, where, stream);
    } else if (verdict == Verdict::PYTHON && rec) {
      run_python(run, pg, call, rec);
    } else {
      run();
    }
  }

 private:
  // What the kernel read off the stack.
  struct Args {
    int64_t in_n = 0, out_n = 0, esize = 0, root = -1, redop = -1;
    int32_t origin = 0;  // the framework ranges open on this thread (origin_path)
    int32_t tid = 0;     // the calling thread (thread_id)
    int32_t microbatch = -1;  // -1: not asked; -2: asked, none (Verdict::MICROBATCH)
    c10::ScalarType st = c10::ScalarType::Byte;
    bool async_op = false, cuda = false;
  };

  static bool has_split(const c10::IValue* args, int arg) {
    return arg >= 0 && ((args[arg].isIntList() && !args[arg].toIntList().empty()) ||
                        args[arg].isTensorList());
  }

  ShapeKey key_of(c10d::ProcessGroup& pg, const Site& site, const Args& call) const {
    return ShapeKey{&pg, site.code, site.line, spec_.code, call.in_n, call.out_n, call.root,
                    call.redop, static_cast<int>(call.st), call.async_op, call.cuda,
                    call.origin, call.tid, call.microbatch};
  }

  // A plain call recorded without the GIL, where this thread has seen its call site and its
  // shape before and Python has nothing to add (a group's collective, a point-to-point call
  // outside coalescing blocks, a call not recorded): its verdict (NATIVE or SKIP), numbers and
  // entry. False: the full path, with the GIL.
  bool without_gil(c10d::ProcessGroup& pg, Args& call, Verdict* verdict, int64_t** numbering,
                   int64_t* seq, Where* where) const {
    Site site;
    if (!seen_site(&site)) return false;
    call.tid = thread_id();
    const ShapeKey key = key_of(pg, site, call);
    int32_t index = -1;
    int64_t pair = -1;
    {
      std::lock_guard<std::mutex> lock(g_shapes_mutex);
      auto it = g_shapes->find(key);
      if (it == g_shapes->end() || it->second.pg_name != pg.getGroupName()) return false;
      const Shape& shape = it->second;
      if (shape.verdict == Verdict::SKIP) {
        *verdict = Verdict::SKIP;
        return true;
      }
      if (shape.verdict != Verdict::NATIVE) return false;
      if (shape.p2p != nullptr) {
        std::pair<int64_t, int64_t> got;
        if (!take_p2p_unblocked(*shape.p2p, shape.src, shape.dst, &got)) return false;
        std::tie(*seq, pair) = got;
      } else {
        *numbering = shape.seq.last;
        *seq = take_seq(*numbering, shape.slots);
      }
      index = shape.index;
    }
    *where = g_native->add(index, *seq, pair, now_ns());
    *verdict = Verdict::NATIVE;
    return true;
  }

  // The shape of this call: cached, else registered through Python's `shape`. Needs the GIL.
  const Shape& shape_of(c10d::ProcessGroup& pg, const Site& site, const Args& call) const {
    const ShapeKey key = key_of(pg, site, call);
    const std::string& name = pg.getGroupName();
    auto it = g_shapes->find(key);
    if (it != g_shapes->end() && it->second.pg_name == name) return it->second;
    py::object got = g_py->shape(spec_.code, pg_name(pg), call.in_n, call.out_n,
                                 dtype_name(call.st), call.esize, call.cuda, call.root,
                                 call.redop, call.async_op, site.file(), site.line_obj(),
                                 call.origin, call.tid, call.microbatch);
    Shape shape;
    shape.pg_name = name;
    if (got.is_none()) {
      shape.verdict = Verdict::PYTHON;
    } else if (PyBool_Check(got.ptr())) {
      shape.verdict = Verdict::SKIP;
    } else if (PyUnicode_Check(got.ptr())) {
      shape.verdict = Verdict::MICROBATCH;
    } else {
      auto [index, info, slots, src, dst] =
          got.cast<std::tuple<int32_t, py::object, int64_t, py::object, py::object>>();
      shape.verdict = Verdict::NATIVE;
      shape.index = index;
      shape.slots = slots;
      if (!src.is_none() || !dst.is_none()) {  // a p2p shape: its ranks and group numbering
        shape.src = src.is_none() ? -1 : src.cast<int64_t>();
        shape.dst = dst.is_none() ? -1 : dst.cast<int64_t>();
        shape.p2p = &(*g_p2p)[name];
        shape.pg = info.attr(g_py->pg_attr);
      }
      if (shape.p2p == nullptr) shape.seq = seq_cell(info);
    }
    std::lock_guard<std::mutex> lock(g_shapes_mutex);
    return g_shapes->insert_or_assign(key, std::move(shape)).first->second;
  }

  // This 1F1B p2p call's micro-batch (origins.pipelining.MicroBatches), -2 where it has none.
  // Needs the GIL.
  int32_t microbatch() const {
    py::object got = g_py->microbatch(spec_.code);
    return got.is_none() ? -2 : got.cast<int32_t>();
  }

  // A call inside a calls.SCOPE block is not recorded on its own: a collective takes its
  // group's numbers and gives them to the innermost annotate_collective block, which stands
  // for it (its Claim), or to nothing (an unrecorded block). What a group and op take is asked
  // once (`scoped`).
  // Needs the GIL.
  void scoped(c10d::ProcessGroup& pg, const Args& call) const {
    const std::string& name = pg.getGroupName();
    auto key = std::make_tuple(static_cast<const void*>(&pg), spec_.code, call.cuda);
    auto it = g_scoped->find(key);
    if (it == g_scoped->end() || it->second.pg_name != name) {
      py::object got = g_py->scoped(spec_.code, pg_name(pg), call.cuda);
      Scoped entry;
      entry.pg_name = name;
      if (!got.is_none()) {
        py::object info;
        std::tie(info, entry.slots) = got.cast<std::tuple<py::object, int64_t>>();
        entry.seq = seq_cell(info);
      }
      it = g_scoped->insert_or_assign(key, std::move(entry)).first;
    }
    const Scoped& entry = it->second;
    if (!entry.seq) return;          // a p2p call: blocks number none
    const int64_t seq = take_seq(entry.seq.last, entry.slots);
    if (t_scope_top != nullptr && t_scope_top != Py_None) {
      py::object number = py::reinterpret_steal<py::object>(PyLong_FromLongLong(seq));
      py::object done = py::reinterpret_steal<py::object>(
          PyObject_CallMethodOneArg(t_scope_top, g_py->claim_attr.ptr(), number.ptr()));
      if (!done) throw py::error_already_set();
    }
  }

  py::object begin(const c10::IValue* args, c10d::ProcessGroup& pg, const Site& site,
                   const Args& call) const {
    py::object out_split = spec_.out_split_arg >= 0 ? split_list(args[spec_.out_split_arg])
                                                    : py::none();
    py::object in_split = spec_.in_split_arg >= 0 ? split_list(args[spec_.in_split_arg])
                                                  : py::none();
    py::object rec = g_py->begin(spec_.code, pg_name(pg), call.in_n, call.out_n,
                                 dtype_name(call.st), call.esize, call.cuda, call.root,
                                 call.redop, call.async_op, in_split, out_split, site.file(),
                                 site.line_obj(), call.origin, call.tid);
    if (rec.is_none()) return py::object();
    if (PyList_CheckExact(rec.ptr())) {
      // The ring keeps every record alive: as tracked containers they would make the
      // collector's full passes over the whole heap (torch's included) ever more frequent.
      // A record refers to nothing that refers back to it, so it cannot be in a cycle.
      PyObject_GC_UnTrack(rec.ptr());
    }
    return rec;
  }

  // torch's kernel; for a CPU (gloo) call its caller said is synchronous (async_op=False) the
  // caller waits on the returned Work right away: waiting here first makes the record's end
  // the collective's end, not its enqueue. (send/recv carry no such flag: isend returns.)
  void call_original(Run run, const Args& call) {
    c10d::Work* work = run();
    if (!call.cuda && spec_.async_arg >= 0 && !call.async_op && work != nullptr) work->wait();
  }

  // NCCL numbers its collectives itself (coalesced ones share a number); -1: no number.
  static int64_t backend_seq(c10d::ProcessGroup& pg, const Args& call) {
    if (!call.cuda) return -1;
    try {
      return static_cast<int64_t>(
          pg.getBackend(c10::DeviceType::CUDA)->getSequenceNumberForGroup());
    } catch (const std::exception&) {
      return -1;
    }
  }

  void run_native(Run run,
                  c10d::ProcessGroup& pg, const Args& call, int64_t* numbering, int64_t seq,
                  const Where& where, void* stream) {
    try {
      call_original(run, call);
    } catch (const std::exception& exc) {
      const bool captured = stream != nullptr && capture_info(stream).status > CAPTURE_NONE;
      g_native->end(where, seq, now_ns(), FAILED | (captured ? CAPTURED : 0));
      Gil gil;
      try {
        g_py->failed(where.ordinal, py::str(exc.what()));
      } catch (py::error_already_set& err) {
        err.discard_as_unraisable("commviz: recording a failed collective");
      }
      throw;
    }
    // (a p2p call, no numbering, keeps the number it took: NCCL's is its collectives')
    const int64_t reported = numbering != nullptr ? backend_seq(pg, call) : -1;
    const int64_t t_end = now_ns();
    if (reported > 0 && reported != seq) {
      Gil gil;
      __atomic_store_n(numbering, reported, __ATOMIC_RELAXED);
      seq = reported;
    }
    const int32_t flags = stream != nullptr ? note_captured(where, seq, t_end, stream) : 0;
    g_native->end(where, seq, t_end, flags);
  }

  // Whether a call that may be captured was (CAPTURED, or 0: its stream was not capturing, or
  // the driver could not say), read as it returns, and if so the frontier of its stream then:
  // the collective's last node is what the stream now waits on (Python resolves it against
  // the whole graph later). One driver query.
  static int32_t note_captured(const Where& where, int64_t seq, int64_t t_end, void* stream) {
    const CaptureInfo info = capture_info(stream);
    if (info.status <= CAPTURE_NONE) return 0;
    Native::Captured note{};
    note.call = Call{where.shape, CAPTURED, seq, -1, where.t_begin, t_end, where.ordinal};
    note.stream = reinterpret_cast<uintptr_t>(stream);
    if (info.status == CAPTURE_ACTIVE) {
      note.capture_id = info.id;
      note.graph = reinterpret_cast<uintptr_t>(info.graph);
      note.frontier.reserve(info.n);
      for (size_t i = 0; i < info.n; ++i) {
        note.frontier.push_back(reinterpret_cast<uintptr_t>(info.deps[i]));
      }
    }
    g_native->captured(std::move(note));
    return CAPTURED;
  }

  void run_python(Run run,
                  c10d::ProcessGroup& pg, const Args& call, py::object& rec) {
    try {
      call_original(run, call);
    } catch (const std::exception& exc) {
      Gil gil;
      finish(rec, -1, exc.what());
      throw;
    }
    const int64_t reported = backend_seq(pg, call);
    const int64_t t_end = now_ns();
    Gil gil;
    PyObject* list = rec.ptr();
    if (PyList_Check(list) && PyList_GET_SIZE(list) > g_slots.region &&
        PyList_GET_ITEM(list, g_slots.meta) == Py_None &&
        PyList_GET_ITEM(list, g_slots.region) == Py_None &&
        (reported < 0 || seq_is(PyList_GET_ITEM(list, g_slots.seq), reported))) {
      // nothing open, the number was right: just note when the call returned
      PyObject* end = PyLong_FromLongLong(t_end);
      if (end != nullptr) {
        PyList_SetItem(list, g_slots.t_end, end);  // steals the reference
        rec = py::object();
        return;
      }
      PyErr_Clear();
    }
    finish(rec, reported, nullptr);
  }

  static bool seq_is(PyObject* seq, int64_t value) {
    return seq == Py_None || (PyLong_Check(seq) && PyLong_AsLongLong(seq) == value);
  }

  static void finish(py::object& rec, int64_t reported, const char* error) {  // GIL held
    try {
      g_py->finish(rec, reported, error == nullptr ? py::object(py::none()) : py::str(error));
    } catch (py::error_already_set& exc) {
      exc.discard_as_unraisable("commviz: finishing a collective's record");
    }
    rec = py::object();
  }

  OpSpec spec_;
};

// The Work in what an op returned: the result itself or its tuple's last element.
template <class T>
c10d::Work* work_of(T& result) {
  if constexpr (std::is_same_v<T, c10::intrusive_ptr<c10d::Work>>) {
    return result.get();
  } else {
    return std::get<std::tuple_size_v<T> - 1>(result).get();
  }
}

// The kernel of an op with the C++ signature `Sig`: unboxed calls come to operator(), boxed
// ones to `boxed` (through the specialisation of make_boxed_from_unboxed_functor below).
template <class Sig>
class Typed;

template <class Ret, class... Args>
class Typed<Ret(Args...)> final : public c10::OperatorKernel {
 public:
  Typed(c10::TypedOperatorHandle<Ret(Args...)> op, OpSpec spec) : op_(op), kernel_(spec) {}

  // Recording, the arguments are boxed once to be read; torch's kernel still runs unboxed.
  Ret operator()(c10::DispatchKeySet ks, Args... args) {
    const c10::DispatchKeySet below = ks & kBelowBackendSelect;
    if (C10_LIKELY(!recording(below))) return op_.redispatch(below, std::forward<Args>(args)...);
    const torch::jit::Stack read = c10::impl::boxArgs<Args...>(args...);
    if constexpr (std::is_void_v<Ret>) {
      kernel_.record(read.data(), [&]() -> c10d::Work* {
        op_.redispatch(below, std::forward<Args>(args)...);
        return nullptr;
      });
    } else {
      std::optional<Ret> result;
      kernel_.record(read.data(), [&]() -> c10d::Work* {
        result.emplace(op_.redispatch(below, std::forward<Args>(args)...));
        return work_of(*result);
      });
      return std::move(*result);
    }
  }

  void boxed(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    kernel_.boxed(op, ks, stack);
  }

 private:
  c10::TypedOperatorHandle<Ret(Args...)> op_;
  Kernel kernel_;
};

// The kernel of an op whose C++ signature is not in `signatures()`: boxed only.
class Boxed final : public c10::OperatorKernel {
 public:
  explicit Boxed(OpSpec spec) : kernel_(spec) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    kernel_.boxed(op, ks, stack);
  }

 private:
  Kernel kernel_;
};

// profiler::_record_function_enter_new(str name, str? args): a followed range joins this
// thread's chain once torch has opened it.
class RangeEnter final : public c10::OperatorKernel {
 public:
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const c10::IValue& name = (*stack)[stack->size() - op.schema().arguments().size()];
    const bool follow = g_active.load(std::memory_order_relaxed) && name.isString() &&
                        followed(name.toStringRef());
    const int32_t id = follow ? open_range(name.toStringRef()) : 0;
    const bool watched = follow && g_exit_armed.load(std::memory_order_relaxed) &&
                         name.toStringRef() == g_exit_watch->name;
    op.redispatchBoxed(ks & kBelowBackendSelect, stack);
    if (follow && !stack->empty() && stack->back().isObject()) {
      t_open.push_back({stack->back().internalToPointer(), t_origin, watched});
      t_origin = id;
    }
  }
};

// profiler::_record_function_exit._RecordFunction(node): the chain goes back to what was open
// before `node` (ranges closed out of order, or on another thread, are dropped with it).
class RangeExit final : public c10::OperatorKernel {
 public:
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const c10::IValue& node = stack->back();
    const void* handle = node.isObject() ? node.internalToPointer() : nullptr;
    bool watched = false;
    for (size_t i = t_open.size(); handle != nullptr && i-- > 0;) {
      if (t_open[i].handle == handle) {
        t_origin = t_open[i].prev;
        watched = t_open[i].watched;
        t_open.resize(i);
        break;
      }
    }
    op.redispatchBoxed(ks & kBelowBackendSelect, stack);
    if (watched && g_exit_armed.load(std::memory_order_relaxed)) call_exit_watch();
  }
};

}  // namespace

// A Typed kernel's boxed entry is its own, not the dispatcher's unbox-and-call wrapper.
namespace c10::impl {
template <class Sig, bool AllowDeprecatedTypes>
struct make_boxed_from_unboxed_functor<Typed<Sig>, AllowDeprecatedTypes> final {
  static void call(OperatorKernel* functor, const OperatorHandle& op, DispatchKeySet ks,
                   torch::jit::Stack* stack) {
    static_cast<Typed<Sig>*>(functor)->boxed(op, ks, stack);
  }
};
}  // namespace c10::impl

namespace {

// Registrations live as long as their handles: dropping them unregisters commviz's kernels.
std::vector<c10::RegistrationHandleRAII> g_registrations;

c10::RegistrationHandleRAII register_kernel(const c10::OperatorHandle& op, c10::KernelFunction kernel,
                                            std::optional<c10::impl::CppSignature> signature) {
  return c10::Dispatcher::singleton().registerImpl(op.operator_name(),
                                                   c10::DispatchKey::BackendSelect,
                                                   std::move(kernel), std::move(signature),
                                                   nullptr, "commviz boundary kernel");
}

using Register = c10::RegistrationHandleRAII (*)(const c10::OperatorHandle&, OpSpec);

// Registers a Typed kernel; `typed()` throws first if this torch calls the op with another
// C++ signature.
template <class Sig>
c10::RegistrationHandleRAII register_typed(const c10::OperatorHandle& op, OpSpec spec) {
  auto handle = op.typed<Sig>();
  return register_kernel(op,
                         c10::KernelFunction::makeFromUnboxedFunctor<false, Typed<Sig>>(
                             std::make_unique<Typed<Sig>>(handle, spec)),
                         c10::impl::CppSignature::make<Sig>());
}

// c10d's ops as their C++ callers call them (torch/csrc/distributed/c10d/ProcessGroup.hpp, the
// same in torch 2.11 and 2.13).
const std::unordered_map<std::string, Register>& signatures() {
  using at::Tensor;
  using at::TensorList;
  using Group = const c10::intrusive_ptr<c10d::ProcessGroup>&;
  using Reduce = const c10::intrusive_ptr<c10d::ReduceOp>&;
  using Work = c10::intrusive_ptr<c10d::Work>;
  using Tensors = std::vector<at::Tensor>;
  using Lists = std::vector<std::vector<at::Tensor>>;
  using Ints = std::vector<int64_t>;
  static const auto* table = new std::unordered_map<std::string, Register>{
      {"broadcast_", &register_typed<std::tuple<Tensors, Work>(
                         TensorList, Group, int64_t, int64_t, bool, int64_t)>},
      {"allreduce_", &register_typed<std::tuple<Tensors, Work>(
                         TensorList, Group, Reduce, const std::optional<Tensor>&, bool, int64_t)>},
      {"allreduce_coalesced_", &register_typed<Work(TensorList, Group, Reduce, bool, int64_t)>},
      {"reduce_", &register_typed<Work(TensorList, Group, Reduce, int64_t, int64_t, bool, int64_t)>},
      {"allgather_",
       &register_typed<std::tuple<Lists, Work>(const Lists&, TensorList, Group, bool, int64_t)>},
      {"_allgather_base_",
       &register_typed<std::tuple<Tensor, Work>(Tensor&, Tensor&, Group, bool, int64_t)>},
      {"allgather_coalesced_", &register_typed<Work(const Lists&, const TensorList&, Group, bool)>},
      {"allgather_into_tensor_coalesced_",
       &register_typed<Work(TensorList, TensorList, Group, bool)>},
      {"gather_",
       &register_typed<Work(const Lists&, const TensorList&, Group, int64_t, bool, int64_t)>},
      {"scatter_", &register_typed<std::tuple<Tensors, Work>(
                       const TensorList&, const Lists&, Group, int64_t, bool, int64_t)>},
      {"reduce_scatter_", &register_typed<std::tuple<Tensors, Work>(
                              const TensorList&, const Lists&, Group, Reduce, bool, int64_t)>},
      {"_reduce_scatter_base_", &register_typed<std::tuple<Tensor, Work>(
                                    Tensor&, Tensor&, Group, Reduce, bool, int64_t)>},
      {"reduce_scatter_tensor_coalesced_",
       &register_typed<Work(TensorList, TensorList, Group, Reduce, bool, int64_t)>},
      {"alltoall_base_", &register_typed<Work(Tensor&, Tensor&, Group, Ints, Ints, bool, int64_t)>},
      {"alltoall_", &register_typed<std::tuple<Tensors, Work>(
                        const TensorList&, const TensorList&, Group, bool, int64_t)>},
      {"monitored_barrier_", &register_typed<void(Tensor, Group, const Ints&, int64_t, bool)>},
      {"send", &register_typed<Work(TensorList, Group, int64_t, int64_t)>},
      {"recv_", &register_typed<Work(TensorList, Group, int64_t, int64_t)>},
      {"recv_any_source_", &register_typed<Work(TensorList, Group, int64_t)>},
      {"barrier", &register_typed<Work(Tensor, Group, const Ints&, bool, int64_t)>},
  };
  return *table;
}

// Follows Python's record_function ranges (RangeEnter, RangeExit), unless this torch has no
// such ops or another BackendSelect kernel is there.
void install_range_kernels() {
  auto& dispatcher = c10::Dispatcher::singleton();
  auto enter = dispatcher.findSchema({"profiler::_record_function_enter_new", ""});
  auto exit = dispatcher.findSchema({"profiler::_record_function_exit", "_RecordFunction"});
  if (!enter.has_value() || !exit.has_value() ||
      enter->hasKernelForDispatchKey(c10::DispatchKey::BackendSelect) ||
      exit->hasKernelForDispatchKey(c10::DispatchKey::BackendSelect)) {
    return;
  }
  g_registrations.push_back(register_kernel(
      *enter, c10::KernelFunction::makeFromBoxedFunctor(std::make_unique<RangeEnter>()),
      std::nullopt));
  g_registrations.push_back(register_kernel(
      *exit, c10::KernelFunction::makeFromBoxedFunctor(std::make_unique<RangeExit>()),
      std::nullopt));
}

// Puts commviz's kernel in front of each op; returns the ops that got the boxed-only kernel
// (this torch refused the C++ signature) and those left alone (a BackendSelect kernel is
// already there: commviz's would bypass it).
std::tuple<std::vector<std::string>, std::vector<std::string>> install(
    const std::vector<std::tuple<std::string, OpSpec>>& ops, py::dict python,
    std::tuple<Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t> slots,
    const std::vector<std::string>& own_dirs, const std::vector<std::string>& origin_prefixes) {
  std::tie(g_slots.seq, g_slots.t_end, g_slots.meta, g_slots.region) = slots;
  *g_own_dirs = own_dirs;
  *g_origin_prefixes = origin_prefixes;
  if (g_py == nullptr) g_py = new Python();
  g_py->begin = python["begin"];
  g_py->finish = python["finish"];
  g_py->shape = python["shape"];
  g_py->microbatch = python["microbatch"];
  g_py->scoped = python["scoped"];
  g_py->failed = python["failed"];
  g_py->hooks = python["hooks"];
  g_py->coalescing = python["coalescing"];
  g_py->installed_attr = py::str("installed");
  g_py->seq_cell_attr = py::str("seq_cell");
  g_py->claim_attr = py::str("claim");
  g_py->pg_attr = py::str("pg");
  clear_shapes();
  g_scoped->clear();
  std::vector<std::string> boxed, taken;
  if (!g_registrations.empty()) return {boxed, taken};
  if (!g_origin_prefixes->empty()) install_range_kernels();
  for (const auto& [name, spec] : ops) {
    auto op = c10::Dispatcher::singleton().findSchema({"c10d::" + name, ""});
    if (!op.has_value()) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::BackendSelect)) {
      taken.push_back(name);
      continue;
    }
    auto typed = signatures().find(name);
    if (typed != signatures().end()) {
      try {
        g_registrations.push_back(typed->second(*op, spec));
        continue;
      } catch (const c10::Error&) {  // this torch calls the op with another C++ signature
      }
    }
    g_registrations.push_back(register_kernel(
        *op, c10::KernelFunction::makeFromBoxedFunctor(std::make_unique<Boxed>(spec)),
        std::nullopt));
    boxed.push_back(name);
  }
  return {boxed, taken};
}

void uninstall() {
  set_active(false);
  g_registrations.clear();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<OpSpec>(m, "OpSpec")
      .def(py::init<int, int, int, int, int, int, int, int, int>());
  m.def("install", &install, "put the boundary kernel in front of c10d's ops");
  m.def("uninstall", &uninstall, "give torch's own kernels back");
  m.def("set_active", &set_active, "recording on or off");
  m.def("installed", []() { return !g_registrations.empty(); });
  m.def("origin_path", &origin_path, "the framework ranges an origin id stands for");
  m.def("origin_count", &origin_count, "how often ranges of this name were opened");
  m.def("current_origin", []() { return t_origin; }, "this thread's origin id");
  m.def("set_capture_possible", [](bool possible) { g_capture_possible.store(possible); },
        "whether a stream may be capturing (commviz.record.capturing.changed)");
  m.def("set_scope", [](int64_t depth, py::handle top) {
    t_scope_depth = depth;
    t_scope_top = depth > 0 ? top.ptr() : nullptr;  // the stack keeps it alive
  }, "the calls.SCOPE blocks open on this thread: how many, the innermost one's Claim");
  m.def("take_p2p", [](const std::string& pg_name, int64_t src, int64_t dst, py::handle block) {
    return take_p2p((*g_p2p)[pg_name], block.is_none() ? nullptr : block.ptr(), src, dst);
  }, "a p2p call's numbers: (Flight Recorder's, its pair's); -1 for the pair's if a rank is "
     "unknown");
  m.def("watch_exit", &watch_exit, "call a function when a range of this name exits");
  // the ring of natively recorded calls and the ordinal counter shared with Python's records
  m.def("next_ordinal", []() { return g_native->next_ordinal(); });
  m.def("last_ordinal", []() { return g_native->last_ordinal(); });
  m.def("set_ordinal", [](int64_t value) { g_native->set_ordinal(value); });
  m.def("resize", [](size_t capacity) { g_native->resize(capacity); });
  m.def("clear", []() { g_native->clear(); });
  m.def("size", []() { return g_native->size(); });
  m.def("entries", []() { return g_native->entries(); }, "the ring's calls, oldest first");
  // the calls files (commviz.record.journal drives their generations)
  m.def("calls_open", [](const std::string& path) { return g_native->open(path); },
        "write calls to a new file from now on; 0 or an errno");
  m.def("calls_close", []() {
    // atomically under the GIL: later calls register their shapes again, in the next file
    g_native->close();
    clear_shapes();
  }, "stop writing calls to the current file");
  m.def("calls_drop", []() { g_native->drop(); }, "unmap the files no longer written");
  m.def("calls_error", []() { return g_native->error(); }, "why the file stopped, or ''");
  m.def("take_captured", []() { return g_native->take_captured(); },
        "the calls recorded under capture since the last take, for Python to place");
  // CUDA graph capture: what the capture hooks ask as a capture ends
  m.def("has_captured", [](uint64_t id) { return g_native->has_captured(id); },
        "whether calls captured in this capture wait to be taken");
  m.def("read_graph", &read_graph, "a live graph's nodes, edges and kernels, in one call");
}
