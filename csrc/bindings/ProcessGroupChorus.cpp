// ProcessGroupChorus.cpp - c10d::Backend "chorus" over the C API in chorus.h: the Store
// bridge, tensor/dtype/op mapping and argument checks, staging of non-contiguous or aliased
// buffers, and WorkChorus completion. No algorithm, transport or socket code lives here.
// Python.h first: it sets feature macros the system headers must see.
#include <Python.h>

#include "ProcessGroupChorus.hpp"

#include <pthread.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <numeric>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace chorus_torch {
namespace {

using c10d::OpType;
using Clock = std::chrono::steady_clock;

// ------------------------------------------------------------------ small helpers

// Releases the GIL (when this thread holds it) around waits that may need Python on another
// thread: joining the completer, which runs future callbacks, and destroying the communicator.
class GilRelease {
 public:
  GilRelease() {
#if PY_VERSION_HEX >= 0x030D0000
    const bool finalizing = Py_IsFinalizing();
#else
    const bool finalizing = _Py_IsFinalizing();
#endif
    if (Py_IsInitialized() && !finalizing && PyGILState_Check()) state_ = PyEval_SaveThread();
  }
  ~GilRelease() {
    if (state_) PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

// Drops one reference taken with reclaim_copy(...).release().
void dropRef(WorkChorus* w) {
  auto ref = c10::intrusive_ptr<WorkChorus>::reclaim(w);
  (void)ref;
}

[[noreturn]] void throwBackend(const std::string& msg) { C10_THROW_ERROR(DistBackendError, msg); }

// chorus_comm_error(NULL) is the text of the last failed creation on this thread.
std::string commError(chorus_comm_t* comm, chorus_result_t res, const char* op) {
  const char* text = chorus_comm_error(comm);
  if (text && *text) return std::string("chorus: ") + op + ": " + text;
  return std::string("chorus: ") + op + " failed: " + chorus_result_string(res);
}

// Empty tensors may have a null data pointer; the core still gets a valid address so that it
// runs the (zero-byte) operation and sequence numbers stay aligned across ranks.
alignas(64) unsigned char g_empty_buffer[64];
void* ptrOf(const at::Tensor& t) {
  void* p = t.numel() > 0 ? t.data_ptr() : nullptr;
  return p ? p : static_cast<void*>(g_empty_buffer);
}

const char* dtypeName(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    default: return c10::toString(st);
  }
}

chorus_dtype_t toDtype(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return CHORUS_FLOAT32;
    case at::kDouble: return CHORUS_FLOAT64;
    case at::kHalf: return CHORUS_FLOAT16;
    case at::kBFloat16: return CHORUS_BFLOAT16;
    case at::kChar: return CHORUS_INT8;
    case at::kByte: return CHORUS_UINT8;
    case at::kShort: return CHORUS_INT16;
    case at::kInt: return CHORUS_INT32;
    case at::kLong: return CHORUS_INT64;
    case at::kBool: return CHORUS_BOOL;
    case at::kFloat8_e4m3fn: return CHORUS_FLOAT8_E4M3;
    case at::kFloat8_e5m2: return CHORUS_FLOAT8_E5M2;
    default:
      TORCH_CHECK(false, "chorus: dtype ", c10::toString(st),
                  " is not supported (supported: float32, float64, float16, bfloat16, int8, "
                  "uint8, int16, int32, int64, bool, float8_e4m3fn, float8_e5m2)");
  }
}

const char* redopName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

chorus_redop_t toRedop(const c10d::ReduceOp& rop, at::ScalarType st) {
  const bool is_float = at::isFloatingType(st);
  const bool is_bool = st == at::kBool;
  const auto kind = rop.op_;
  chorus_redop_t r{CHORUS_SUM, 1.0};
  switch (kind) {
    case c10d::ReduceOp::SUM: r.kind = CHORUS_SUM; break;
    case c10d::ReduceOp::AVG: r.kind = CHORUS_AVG; break;
    case c10d::ReduceOp::PRODUCT: r.kind = CHORUS_PROD; break;
    case c10d::ReduceOp::MIN: r.kind = CHORUS_MIN; break;
    case c10d::ReduceOp::MAX: r.kind = CHORUS_MAX; break;
    case c10d::ReduceOp::BAND: r.kind = CHORUS_BAND; break;
    case c10d::ReduceOp::BOR: r.kind = CHORUS_BOR; break;
    case c10d::ReduceOp::BXOR: r.kind = CHORUS_BXOR; break;
    case c10d::ReduceOp::PREMUL_SUM: {
      r.kind = CHORUS_PREMUL_SUM;
      // PREMUL_SUM's only supplement type; static_cast as ProcessGroupNCCL does (the alias
      // name exists in every torch version we support, PreMulSumSupplement only in newer).
      auto* sup = static_cast<c10d::NCCLPreMulSumSupplement*>(rop.supplement_.get());
      TORCH_CHECK(sup != nullptr, "chorus: PREMUL_SUM needs a factor (make the op with "
                                  "torch.distributed._make_nccl_premul_sum)");
      if (sup->tensor_factor.defined()) {
        TORCH_CHECK(sup->tensor_factor.numel() == 1,
                    "chorus: PREMUL_SUM tensor factor must hold one element");
        // Each rank's own factor, read on the host.
        r.factor = sup->tensor_factor.to(at::kCPU).to(at::kDouble).item<double>();
      } else {
        r.factor = sup->double_factor;
      }
      break;
    }
    default:
      TORCH_CHECK(false, "chorus: reduce op ", static_cast<int>(kind), " is not supported");
  }
  const bool bitwise = kind == c10d::ReduceOp::BAND || kind == c10d::ReduceOp::BOR ||
                       kind == c10d::ReduceOp::BXOR;
  TORCH_CHECK(!(bitwise && is_float), "chorus: ", redopName(kind), " is not defined for ",
              dtypeName(st));
  TORCH_CHECK(!(is_bool && (kind == c10d::ReduceOp::AVG || kind == c10d::ReduceOp::PREMUL_SUM)),
              "chorus: ", redopName(kind), " is not defined for bool");
  return r;
}

// The single device dispatch point: every tensor of an op is checked here.
void checkTensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "chorus: ", op, ": undefined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, "chorus: ", op, ": only dense (strided) tensors are "
              "supported, got layout ", t.layout());
  if (t.is_cuda()) {
    TORCH_CHECK(chorus_cuda_built(), "chorus: ", op, ": got a CUDA tensor, but this build of "
                "chorus has no CUDA support (rebuild where nvcc and a CUDA torch are present, "
                "or with FORCE_CUDA=1)");
  } else {
    TORCH_CHECK(t.device().is_cpu(), "chorus: ", op, ": tensors must be on the CPU or a CUDA "
                "device, got ", t.device());
  }
  (void)toDtype(t.scalar_type());
}

// The device of the op being prepared on this thread, and its CUDA tensors: set by its
// Checker, taken by launch().
thread_local int t_op_cuda_device = -1;
thread_local std::vector<at::Tensor> t_op_tensors;

struct Checker {
  const char* op;
  bool have_device = false;
  at::Device device{at::kCPU};
  // A call whose checks threw never reached launch(): forget what it left.
  explicit Checker(const char* name) : op(name) {
    t_op_tensors.clear();
    t_op_cuda_device = -1;
  }
  void operator()(const at::Tensor& t) {
    checkTensor(t, op);
    if (t.is_cuda()) t_op_tensors.push_back(t);
    if (!have_device) {
      device = t.device();
      have_device = true;
      t_op_cuda_device = device.is_cuda() ? device.index() : -1;
    }
    TORCH_CHECK(t.device() == device, "chorus: ", op, ": all tensors must be on one device, got ",
                device, " and ", t.device());
  }
};

void checkSameDtype(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "chorus: ", op, ": dtype mismatch between ",
              "input (", dtypeName(a.scalar_type()), ") and output (", dtypeName(b.scalar_type()),
              ")");
}

void checkOne(const std::vector<at::Tensor>& v, const char* op, const char* what) {
  TORCH_CHECK(v.size() == 1, "chorus: ", op, " takes exactly one ", what, " tensor per rank, got ",
              v.size());
}

size_t bytesOf(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  // Whole storages for non-contiguous tensors: conservative is fine (it only adds a copy).
  auto lo = [](const at::Tensor& t) {
    return t.is_contiguous() ? static_cast<const char*>(t.data_ptr())
                             : static_cast<const char*>(t.storage().data());
  };
  auto len = [](const at::Tensor& t) {
    return t.is_contiguous() ? bytesOf(t) : t.storage().nbytes();
  };
  const char* a0 = lo(a);
  const char* b0 = lo(b);
  return a0 < b0 + len(b) && b0 < a0 + len(a);
}

// A contiguous tensor with the data of t (t itself when it already is contiguous).
at::Tensor contiguousIn(const at::Tensor& t, WorkChorus& w) {
  at::Tensor c = t.contiguous();
  w.keepAlive(c);
  return c;
}

// A contiguous buffer the core may write for the user's tensor t: t itself, or a staging
// tensor copied back into t after success (holding t's data first when copy_in).
at::Tensor contiguousOut(const at::Tensor& t, WorkChorus& w, bool copy_in) {
  if (t.is_contiguous()) return t;
  at::Tensor s = copy_in ? t.contiguous() : at::empty(t.sizes(), t.options().memory_format(
                                                                     at::MemoryFormat::Contiguous));
  w.keepAlive(s);
  w.addCopyBack(t, s);
  return s;
}

void checkRoot(int root, int size, const char* op) {
  TORCH_CHECK(root >= 0 && root < size, "chorus: ", op, ": invalid root rank ", root,
              " for a group of ", size, " ranks");
}

void checkPeer(int peer, int rank, int size, const char* op) {
  TORCH_CHECK(peer >= 0 && peer < size, "chorus: ", op, ": invalid peer rank ", peer,
              " for a group of ", size, " ranks");
  TORCH_CHECK(peer != rank, "chorus: ", op, ": peer rank ", peer, " is this rank itself");
}

void checkTag(int tag, const char* op) {
  TORCH_CHECK(tag >= 0, "chorus: ", op, ": invalid tag ", tag, " (tags are non-negative)");
}

// Issues one core call's result into the work: throws (with the communicator's error text)
// if the core refused it.
void addOrThrow(chorus_comm_t* comm, WorkChorus& w, chorus_result_t res, chorus_request_t* req,
                const char* op) {
  if (res != CHORUS_SUCCESS) {
    if (req) chorus_request_free(req);
    const std::string msg = commError(comm, res, op);
    if (res == CHORUS_ERR_INVALID || res == CHORUS_ERR_UNSUPPORTED) TORCH_CHECK(false, msg);
    throwBackend(msg);
  }
  w.addRequest(req);
}

// Element count of one row along dim 0 (the unit of all-to-all split sizes).
int64_t rowNumel(const at::Tensor& t) {
  if (t.dim() == 0) return 1;
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

int64_t dim0(const at::Tensor& t) { return t.dim() == 0 ? 1 : t.size(0); }

// Per-peer element counts and displacements from dim-0 split sizes (empty: equal split).
void splitCounts(const std::vector<int64_t>& splits, const at::Tensor& t, int size,
                 const char* what, std::vector<size_t>& counts, std::vector<size_t>& displs) {
  const int64_t rows = dim0(t);
  const int64_t row = rowNumel(t);
  counts.assign(size, 0);
  displs.assign(size, 0);
  if (splits.empty()) {
    TORCH_CHECK(rows % size == 0, "chorus: all_to_all: ", what, " dim 0 (", rows,
                ") does not divide equally across ", size, " ranks");
    for (int p = 0; p < size; ++p) counts[p] = static_cast<size_t>(rows / size * row);
  } else {
    TORCH_CHECK(static_cast<int>(splits.size()) == size, "chorus: all_to_all: ", what,
                " split sizes have ", splits.size(), " entries, expected one per rank (", size,
                ")");
    int64_t sum = 0;
    for (int p = 0; p < size; ++p) {
      TORCH_CHECK(splits[p] >= 0, "chorus: all_to_all: negative ", what, " split size ",
                  splits[p]);
      sum += splits[p];
      counts[p] = static_cast<size_t>(splits[p] * row);
    }
    TORCH_CHECK(sum == rows, "chorus: all_to_all: ", what, " split sizes sum to ", sum,
                " but the tensor's dim 0 is ", rows);
  }
  size_t off = 0;
  for (int p = 0; p < size; ++p) {
    displs[p] = off;
    off += counts[p];
  }
}

// ------------------------------------------------------------------ Store bridge

// chorus_bootstrap_t over a c10d::Store. No exception may reach the C core.
struct StoreBridge {
  c10::intrusive_ptr<c10d::Store> store;
  std::mutex mu;
  std::string last_error;

  void note(const char* what, const char* key, const std::exception& e) {
    std::lock_guard<std::mutex> lk(mu);
    last_error = std::string(what) + "(" + key + "): " + e.what();
  }
  std::string lastError() {
    std::lock_guard<std::mutex> lk(mu);
    return last_error;
  }
};

chorus_result_t bridgeSet(void* ctx, const char* key, const void* val, size_t len) {
  auto* b = static_cast<StoreBridge*>(ctx);
  try {
    const auto* p = static_cast<const uint8_t*>(val);
    b->store->set(key, std::vector<uint8_t>(p, p + len));
    return CHORUS_SUCCESS;
  } catch (const std::exception& e) {
    b->note("store set", key, e);
  } catch (...) {
  }
  return CHORUS_ERR_SYSTEM;
}

chorus_result_t bridgeGet(void* ctx, const char* key, void* buf, size_t cap, size_t* len,
                          int timeout_ms) {
  auto* b = static_cast<StoreBridge*>(ctx);
  const auto start = Clock::now();
  std::chrono::milliseconds timeout(timeout_ms);
  try {
    if (timeout_ms <= 0) timeout = b->store->getTimeout();
    b->store->wait({key}, timeout);
    std::vector<uint8_t> v = b->store->get(key);
    if (len) *len = v.size();
    if (buf && cap) std::memcpy(buf, v.data(), std::min(cap, v.size()));
    return CHORUS_SUCCESS;
  } catch (const std::exception& e) {
    b->note("store get", key, e);
  } catch (...) {
  }
  // Store::wait reports a timeout as an exception like any other failure: tell them apart
  // by the time spent.
  const bool timed_out = Clock::now() - start >= timeout * 9 / 10;
  return timed_out ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_SYSTEM;
}

}  // namespace

// ==================================================================== Completer

Completer::Completer() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!spawnLocked()) throwBackend("chorus: cannot start the completion thread");
}

Completer::~Completer() {
  shutdown();
  for (auto& t : threads_) {
    if (t.joinable()) t.detach();  // destroyed on one of its own threads
  }
}

bool Completer::spawnLocked() noexcept {
  try {
    threads_.emplace_back([this] { run(); });
    pthread_setname_np(threads_.back().native_handle(), "chorus-complete");
    return true;
  } catch (...) {
    return false;  // the threads there are go on; only a blocking callback could stall them
  }
}

void Completer::push(WorkChorus* w, bool notify) noexcept {
  try {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!joined_) {
        queue_.push_back(w);
        // A few unnotified works may wait for the next notify; never more than that.
        if (notify || queue_.size() > 8) cv_.notify_one();
        return;
      }
    }
  } catch (...) {
  }
  // Out of memory or after shutdown (should not happen: the communicator is destroyed, which
  // completes every request, before the completer stops): finish here rather than lose it.
  w->finalize();
  dropRef(w);
}

bool Completer::take(WorkChorus* w) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = queue_.rbegin(); it != queue_.rend(); ++it) {
    if (*it == w) {
      queue_.erase(std::next(it).base());
      return true;
    }
  }
  return false;
}

void Completer::run() {
  for (;;) {
    WorkChorus* w = nullptr;
    {
      std::unique_lock<std::mutex> lk(mu_);
      ++idle_;
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      --idle_;
      if (queue_.empty()) return;
      w = queue_.front();
      queue_.pop_front();
      // This work's future callbacks may block on a later work: keep a thread free for it.
      if (idle_ == 0 && !stop_) spawnLocked();
    }
    // A future callback may drop the last reference to the process group, and with it to
    // this Completer: keep it alive until this loop is done touching it.
    std::shared_ptr<Completer> keep = w->completer_;
    w->finalize();
    dropRef(w);  // the reference arm() took
    bool exit_now;
    {
      std::lock_guard<std::mutex> lk(mu_);
      exit_now = stop_ && queue_.empty();
    }
    if (exit_now) return;  // `keep` may be the last reference: touch nothing after it
  }
}

void Completer::shutdown() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;
    stop_ = true;  // no thread is started from now on
    cv_.notify_all();
    threads.swap(threads_);
  }
  {
    GilRelease nogil;
    for (auto& t : threads) {
      if (t.get_id() == std::this_thread::get_id()) {
        // The last reference to the process group died in a future callback on this thread.
        t.detach();
      } else if (t.joinable()) {
        t.join();
      }
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  joined_ = true;
}

// ==================================================================== WorkChorus

WorkChorus::WorkChorus(OpType type, int rank, const char* profiling_title, const char* op_name,
                       std::shared_ptr<Completer> completer, std::vector<at::Tensor> outputs,
                       const std::optional<std::vector<at::Tensor>>& profiled)
    // c10d::Work opens an asynchronous RecordFunction named profiling_title with `profiled`
    // as its inputs when a profiler listens; finalize() ends it (recordFunctionEndCallback_),
    // so the event spans issue to completion.
    : c10d::Work(rank, type, profiling_title, profiled),
      op_name_(op_name),
      completer_(std::move(completer)),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

WorkChorus::~WorkChorus() {
  for (chorus_request_t* r : reqs_) chorus_request_free(r);
  cuda::destroyEvent(cuda_event_);
  cuda::destroyEvent(end_event_);
}

void WorkChorus::setCudaDevice(int device) {
  cuda_device_ = device;
  // A future of CUDA tensors must name their device (markCompleted checks it).
  future_ = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()),
      std::vector<c10::Device>{c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device))});
}

void WorkChorus::setCuda(int device, void* event, void* end_event) {
  setCudaDevice(device);
  cuda_event_ = event;
  end_event_ = end_event;
}

void WorkChorus::streamWaitDevice() {
  for (auto& child : children_) child->streamWaitDevice();
  if (cuda_device_ >= 0 && end_event_) cuda::streamWaitEvent(cuda_device_, end_event_);
}

bool WorkChorus::deviceDone() {
  for (auto& child : children_) {
    if (!child->deviceDone()) return false;
  }
  return cuda::eventDone(end_event_);
}

void WorkChorus::addRequest(chorus_request_t* req) {
  if (reqs_.empty() && children_.empty()) seq_ = chorus_request_seq(req);
  reqs_.push_back(req);
}

void WorkChorus::onRequestComplete(void* arg, chorus_result_t /*res*/) {
  // Core's thread: only bookkeeping; finalize() runs on the completer.
  static_cast<WorkChorus*>(arg)->release(true);
}

void WorkChorus::release(bool on_core_thread) noexcept {
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (on_core_thread) {
    if (beginInline()) {
      finalize();
      endInline();
      dropRef(this);  // arm()'s reference
      return;
    }
    // hands over arm()'s reference; a thread blocked in wait() finalizes without a wake-up
    completer_->push(this, waiters_.load(std::memory_order_acquire) == 0);
  } else {
    finalize();
    dropRef(this);  // arm()'s reference; the caller still holds its own
  }
}

bool WorkChorus::beginInline() noexcept {
  std::lock_guard<std::mutex> lk(mutex_);
  if (future_taken_ || parent_ || !copy_back_.empty() || recordFunctionEndCallback_) return false;
  inline_ = true;
  return true;
}

void WorkChorus::endInline() noexcept {
  {
    std::lock_guard<std::mutex> lk(mutex_);
    inline_ = false;
  }
  cv_.notify_all();
}

bool WorkChorus::attachParent(const c10::intrusive_ptr<WorkChorus>& parent) {
  std::lock_guard<std::mutex> lk(mutex_);
  if (completed_) return false;
  parent_ = parent;
  return true;
}

void WorkChorus::arm() {
  if (armed_) return;
  armed_ = true;
  if (children_.empty() && !reqs_.empty()) seq_ = chorus_request_seq(reqs_.front());
  if (!children_.empty()) seq_ = children_.front()->seq_;
  // One count per request and child, plus a guard so nothing finishes during registration.
  pending_.store(static_cast<int>(reqs_.size() + children_.size()) + 1);
  c10::intrusive_ptr<WorkChorus>::reclaim_copy(this).release();  // owned by completion
  auto self = c10::intrusive_ptr<WorkChorus>::reclaim_copy(this);
  int done_now = 0;
  for (auto& child : children_) {
    if (!child->attachParent(self)) ++done_now;
  }
  for (chorus_request_t* r : reqs_) {
    if (chorus_request_on_complete(r, &WorkChorus::onRequestComplete, this) != CHORUS_SUCCESS)
      ++done_now;  // no callback will come: finalize() reads its state directly
  }
  if (done_now) pending_.fetch_sub(done_now, std::memory_order_acq_rel);
  release(false);
}

void WorkChorus::finalize() noexcept {
  if (finalizing_.exchange(true)) return;
  std::string err;
  std::exception_ptr eptr;
  try {
    for (chorus_request_t* r : reqs_) {
      int done = 0;
      chorus_result_t res = chorus_test(r, &done);
      if (!done) res = chorus_wait(r, -1);  // defensive: finalize only runs once all are done
      if (res != CHORUS_SUCCESS && err.empty()) {
        const char* text = chorus_request_error(r);
        const bool prefixed = text && std::strncmp(text, "chorus:", 7) == 0;
        err = (text && *text) ? (prefixed ? std::string(text) : std::string("chorus: ") + text)
                              : std::string("chorus: ") + op_name_ + " (seq " +
                                    std::to_string(chorus_request_seq(r)) + ") failed: " +
                                    chorus_result_string(res);
      }
    }
    for (auto& child : children_) {
      child->awaitCompleted();
      if (!eptr && err.empty()) eptr = child->exception();
    }
    if (any_source_ && !reqs_.empty() && err.empty())
      source_rank_ = chorus_request_source(reqs_[0]);
    if (err.empty() && !eptr) {
      if (cuda_device_ >= 0 && end_event_) {
        // The device part may still run (the core queued it and completed the requests):
        // copy-back, the tensors' memory and the future all wait for it on our stream.
        cuda::finishAfter(cuda_device_, end_event_, copy_back_, {&keep_, &outputs_});
      } else {
        for (auto& cb : copy_back_) cb.first.copy_(cb.second);
      }
    }
  } catch (const std::exception& e) {
    if (err.empty()) err = std::string("chorus: ") + op_name_ + ": " + e.what();
  } catch (...) {
    if (err.empty()) err = std::string("chorus: ") + op_name_ + ": unknown error";
  }
  if (!err.empty() && !eptr) {
    try {
      throwBackend(err);
    } catch (...) {
      eptr = std::current_exception();
    }
  }
  keep_.clear();
  copy_back_.clear();
  c10::intrusive_ptr<WorkChorus> parent;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    completed_ = true;
    exception_ = eptr;
    parent = std::move(parent_);
  }
  cv_.notify_all();
  try {
    if (recordFunctionEndCallback_) {
      recordFunctionEndCallback_();
      recordFunctionEndCallback_ = nullptr;
    }
  } catch (...) {
  }
  // A CUDA future records an event on the device when completed: a command in this
  // process's GPU context, which ranks sharing a GPU pay a context switch for. Nobody can
  // wait on a future not handed out yet, so it is completed when getFuture() is called.
  bool now = true;
  if (cuda_device_ >= 0) {
    std::lock_guard<std::mutex> lk(mutex_);
    now = future_taken_;
    future_deferred_ = !now;
  }
  if (now) completeFuture(eptr);
  if (parent) parent->release(false);
}

void WorkChorus::completeFuture(std::exception_ptr eptr) noexcept {
  try {
    if (eptr) {
      future_->setError(eptr);
    } else if (cuda_device_ >= 0 && end_event_) {
      // The future records its events on the current stream: ours, after the device part.
      cuda::onCompletionStream(cuda_device_,
                               [&] { future_->markCompleted(c10::IValue(outputs_)); });
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  } catch (...) {
    // A future callback threw; it cannot be reported anywhere better than the future itself.
  }
}

void WorkChorus::awaitCompleted() {
  finalize();
  {
    std::lock_guard<std::mutex> lk(mutex_);
    if (completed_) return;
  }
  // Another thread is still finalizing, and may need the GIL to drop a tensor (getFuture()).
  GilRelease nogil;
  std::unique_lock<std::mutex> lk(mutex_);
  cv_.wait(lk, [&] { return completed_; });
}

bool WorkChorus::waitDone(Clock::time_point deadline, bool has_deadline) {
  for (auto& child : children_) {
    if (!child->waitDone(deadline, has_deadline)) return false;
  }
  for (chorus_request_t* r : reqs_) {
    int ms = -1;
    if (has_deadline) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      ms = static_cast<int>(std::max<int64_t>(0, left.count()));
    }
    if (chorus_wait(r, ms) == CHORUS_INPROGRESS) return false;
  }
  return true;
}

bool WorkChorus::isCompleted() {
  // As ProcessGroupNCCL: complete once the device work is, not when it is merely queued.
  return hostCompleted() && (cuda_device_ < 0 || deviceDone());
}

bool WorkChorus::hostCompleted() {
  {
    std::lock_guard<std::mutex> lk(mutex_);
    if (completed_) return true;
  }
  // Polling must make progress even if the completer is busy (e.g. inside a user callback).
  for (auto& child : children_) {
    if (!child->hostCompleted()) return false;
  }
  for (chorus_request_t* r : reqs_) {
    int done = 0;
    chorus_test(r, &done);
    if (!done) return false;
  }
  finalize();
  std::lock_guard<std::mutex> lk(mutex_);
  return completed_;
}

bool WorkChorus::isSuccess() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr WorkChorus::exception() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return exception_;
}

int WorkChorus::sourceRank() const {
  std::lock_guard<std::mutex> lk(mutex_);
  TORCH_CHECK(any_source_, "chorus: sourceRank() is only defined for recv from any source");
  TORCH_CHECK(completed_, "chorus: sourceRank() called before the receive completed");
  return source_rank_;
}

std::vector<at::Tensor> WorkChorus::result() { return outputs_; }

void WorkChorus::synchronize() {
  // CPU tensors: the data is in place once the work completed; nothing to order. CUDA: the
  // current stream waits for the work, as ProcessGroupNCCL's synchronize does.
  if (cuda_device_ >= 0) wait();
}

bool WorkChorus::wait(std::chrono::milliseconds timeout) {
  // The host waits until the requests complete: for device work queued by the core (every
  // rank on one GPU) that is when it is queued, not run; then the caller's current stream
  // waits for the device part, as with ProcessGroupNCCL.
  const bool has_deadline = timeout.count() > 0;
  const auto deadline = Clock::now() + timeout;
  bool done;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    done = completed_;
  }
  // Not hostCompleted(): its chorus_test would start a collective the core keeps queued for
  // this thread to run (an oversubscribed host, docs/design.md "Waiters run the collective").
  if (!done) {
    // Wait on the requests directly instead of on the completer: a caller on the completer
    // thread (a future callback that waits on another collective) must not deadlock.
    waiters_.fetch_add(1, std::memory_order_acq_rel);
    if (!waitDone(deadline, has_deadline)) {
      waiters_.fetch_sub(1, std::memory_order_acq_rel);
      throwBackend(std::string("chorus: ") + op_name_ + " (seq " + std::to_string(seq_) +
                   "): Work.wait timed out after " + std::to_string(timeout.count()) + " ms");
    }
    awaitCompleted();
    waiters_.fetch_sub(1, std::memory_order_acq_rel);
    // Finalized here: if the core queued it for the completer unnotified, take it back.
    if (completer_->take(this)) dropRef(this);
  }
  {
    std::lock_guard<std::mutex> lk(mutex_);
    if (exception_) std::rethrow_exception(exception_);
  }
  if (cuda_device_ >= 0) streamWaitDevice();
  return true;
}

void WorkChorus::pollRequests() {
  for (auto& child : children_) child->pollRequests();
  for (chorus_request_t* r : reqs_) {
    int done = 0;
    chorus_test(r, &done);
  }
}

c10::intrusive_ptr<c10::ivalue::Future> WorkChorus::getFuture() {
  // Whoever waits on the future does not call wait(): the core must not keep the
  // collective queued for a waiter (chorus_test starts it).
  pollRequests();
  // From now on callbacks may be attached: the core thread must not be the one completing
  // the future. If it is finalizing right now, let it finish first, without the GIL: dropping
  // the last reference to a tensor whose Python object C++ keeps alive (an input passed as a
  // temporary) takes the GIL on that thread, and Python calls get_future() holding it.
  bool finalizing_inline;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    future_taken_ = true;  // beginInline() refuses from here on
    finalizing_inline = inline_;
  }
  if (finalizing_inline) {
    GilRelease nogil;  // taken back after the lock below is released
    std::unique_lock<std::mutex> lk(mutex_);
    cv_.wait(lk, [&] { return !inline_; });
  }
  std::unique_lock<std::mutex> lk(mutex_);
  const bool late = future_deferred_;  // finalize() left it to us
  future_deferred_ = false;
  std::exception_ptr eptr = exception_;
  lk.unlock();
  if (late) completeFuture(eptr);
  return future_;
}

uint64_t WorkChorus::getSequencenumber() const { return seq_; }

// ==================================================================== ProcessGroupChorus

ProcessGroupChorus::ProcessGroupChorus(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                       int size, std::chrono::milliseconds timeout,
                                       const std::string& name,
                                       const std::vector<int>& global_ranks)
    : c10d::Backend(rank, size), timeout_(timeout) {
  TORCH_CHECK(store, "chorus: a store is required");
  TORCH_CHECK(size > 0, "chorus: group size must be positive, got ", size);
  TORCH_CHECK(rank >= 0 && rank < size, "chorus: rank ", rank, " is out of range for ", size,
              " ranks");
  // The bridge is owned here and shared with split groups (the core splits over the
  // parent's bootstrap), so it lives as long as the last group that may use it.
  auto bridge = std::make_shared<StoreBridge>();
  bridge->store = store;
  bootstrap_ctx_ = bridge;
  chorus_bootstrap_t bs{};
  bs.ctx = bridge.get();
  bs.set = &bridgeSet;
  bs.get = &bridgeGet;
  bs.release = nullptr;
  chorus_comm_options_t opts{};
  opts.timeout_ms = static_cast<int>(std::min<int64_t>(timeout.count(), INT32_MAX));
  opts.name = name.empty() ? nullptr : name.c_str();
  chorus_comm_t* comm = nullptr;
  chorus_result_t res;
  {
    GilRelease nogil;
    res = chorus_comm_create(rank, size, &bs, &opts, &comm);
  }
  if (res != CHORUS_SUCCESS) {
    std::string msg = commError(comm, res, "process group creation");
    const std::string store_err = bridge->lastError();
    if (!store_err.empty()) msg += " (last store error: " + store_err + ")";
    if (comm) chorus_comm_destroy(comm);
    throwBackend(msg);
  }
  // The flight records name job-wide ranks (splits inherit them in the core).
  if (static_cast<int>(global_ranks.size()) == size)
    chorus_comm_set_global_ranks(comm, global_ranks.data(), size);
  comm_ = comm;
  completer_ = std::make_shared<Completer>();
  init();
  // Where the process already has a CUDA context on its current device (torch.cuda.set_device
  // before init_process_group), load the core's kernels now, while the GPU is likely idle:
  // a kernel's first launch waits for the device, and would hold a first collective issued
  // behind a long kernel. Makes no context.
  chorus_cuda_preload(-1, 0);
}

ProcessGroupChorus::ProcessGroupChorus(SplitTag, chorus_comm_t* comm,
                                       std::chrono::milliseconds timeout,
                                       std::shared_ptr<void> bootstrap_ctx)
    : c10d::Backend(chorus_comm_rank(comm), chorus_comm_size(comm)),
      bootstrap_ctx_(std::move(bootstrap_ctx)),
      comm_(comm),
      timeout_(timeout),
      completer_(std::make_shared<Completer>()) {
  init();
  chorus_cuda_preload(-1, 0);  // as the other constructor
}

ProcessGroupChorus::~ProcessGroupChorus() {
  try {
    closeComm(false);
  } catch (...) {
  }
}

void ProcessGroupChorus::closeComm(bool abort_first) {
  GilRelease nogil;
  {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
    if (comm_) {
      if (abort_first) chorus_comm_abort(comm_);
      // Completes (or fails) every queued request, so the completer below drains them all.
      chorus_comm_destroy(comm_);
      comm_ = nullptr;
    }
    coalescing_ = false;
    coalesced_.clear();
  }
  if (completer_) completer_->shutdown();
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupChorus::getBackendOptions() {
  return c10::make_intrusive<Options>("chorus", timeout_);
}

void ProcessGroupChorus::setTimeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lk(mu_);
  timeout_ = timeout;
  if (comm_ && !closed_)
    chorus_comm_set_timeout(comm_, static_cast<int>(std::min<int64_t>(timeout.count(), INT32_MAX)));
}

void ProcessGroupChorus::setSequenceNumberForGroup() {
  // Every rank's communicator starts counting at 0 when it is created (collectively), so the
  // numbers already agree; nothing to exchange.
}

uint64_t ProcessGroupChorus::getSequenceNumberForGroup() {
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(comm_ && !closed_, "chorus: process group was shut down");
  return chorus_comm_seq(comm_);
}

void ProcessGroupChorus::abort() {
  std::lock_guard<std::mutex> lk(mu_);
  closed_ = true;
  // Fails pending and later operations; the communicator is destroyed with the group.
  if (comm_) chorus_comm_abort(comm_);
}

void ProcessGroupChorus::shutdown() { closeComm(false); }

c10::intrusive_ptr<WorkChorus> ProcessGroupChorus::newWork(OpType type, const char* title,
                                                           const char* op_name,
                                                           std::vector<at::Tensor> outputs,
                                                           const std::vector<at::Tensor>* profiled) {
  // Only when a RecordFunction callback (a profiler) is registered: otherwise the copy of
  // the tensor list would be wasted on every call.
  std::optional<std::vector<at::Tensor>> shown;
  if (at::hasCallbacks()) shown = profiled ? *profiled : outputs;
  return c10::make_intrusive<WorkChorus>(type, rank_, title, op_name, completer_,
                                         std::move(outputs), shown);
}

template <typename F>
c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::launch(
    const c10::intrusive_ptr<WorkChorus>& work, F&& issue) {
  const int device = t_op_cuda_device;
  t_op_cuda_device = -1;
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(comm_ && !closed_, "chorus: process group was shut down");
  bool in_scope = false;
  try {
    if (device >= 0) {
      // The user's tensors stay alive until the work is finalized, which then hands them
      // to the caching allocator's stream tracking (finishAfter).
      for (auto& t : t_op_tensors) work->keepAlive(std::move(t));
      t_op_tensors.clear();
      // After every copy the op queued on the caller's stream (staging, contiguous()); no
      // event (nothing to wait for, and no command in this process's GPU context) when
      // that stream has finished everything.
      void* event = cuda::recordCurrentStreamIfBusy(device);
      void* end_event = nullptr;
      try {
        end_event = cuda::createEvent(device);
      } catch (...) {
        cuda::destroyEvent(event);
        throw;
      }
      work->setCuda(device, event, end_event);
      if (chorus_cuda_begin(comm_, device, event, end_event) != CHORUS_SUCCESS)
        TORCH_CHECK(false, "chorus: ", chorus_comm_error(nullptr));
      in_scope = true;
    }
    issue(comm_, *work);
  } catch (...) {
    if (in_scope) chorus_cuda_end(comm_);
    work->arm();
    throw;
  }
  if (in_scope) chorus_cuda_end(comm_);
  work->arm();
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

void ProcessGroupChorus::startCoalescing() {
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(comm_ && !closed_, "chorus: process group was shut down");
  // torch's _coalescing_manager never calls endCoalescing when its body raises: a new batch
  // then starts over. The abandoned batch's ops were issued and complete on their own.
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::endCoalescing() {
  std::vector<c10::intrusive_ptr<WorkChorus>> works;
  {
    std::lock_guard<std::mutex> lk(mu_);
    TORCH_CHECK(coalescing_, "chorus: endCoalescing called without startCoalescing");
    coalescing_ = false;
    works.swap(coalesced_);
  }
  std::vector<at::Tensor> outputs;
  for (auto& w : works) {
    auto r = w->result();
    outputs.insert(outputs.end(), r.begin(), r.end());
  }
  auto work = newWork(OpType::COALESCED, "chorus:coalesced", "coalesced", std::move(outputs));
  for (auto& w : works) work->addChild(w);
  if (!works.empty() && works.front()->cudaDevice() >= 0)
    work->setCudaDevice(works.front()->cudaDevice());
  work->arm();
  return work;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupChorus::split(
    const c10::intrusive_ptr<c10d::Store>& /*store*/, const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  // The core splits over the parent's bootstrap (keys prefixed per split), so the new
  // group's store is not needed.
  const std::string name = opts ? opts->group_name : std::string();
  if (last_split_valid_ && !name.empty() && name == last_split_name_) return last_split_.lock();
  for (int r : ranks) {
    TORCH_CHECK(r >= 0 && r < size_, "chorus: split: rank ", r, " is out of range for ", size_,
                " ranks");
  }
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  const bool member = it != ranks.end();
  // Disjoint groups have distinct smallest ranks: that is the color. The key keeps the
  // order the caller gave.
  const int color = member ? *std::min_element(ranks.begin(), ranks.end()) : CHORUS_SPLIT_NOCOLOR;
  const int key = member ? static_cast<int>(it - ranks.begin()) : 0;
  const auto timeout = opts ? opts->timeout : timeout_;
  chorus_comm_options_t copts{};
  copts.timeout_ms = static_cast<int>(std::min<int64_t>(timeout.count(), INT32_MAX));
  copts.name = name.empty() ? nullptr : name.c_str();
  chorus_comm_t* newcomm = nullptr;
  chorus_result_t res;
  {
    std::lock_guard<std::mutex> lk(mu_);
    TORCH_CHECK(comm_ && !closed_, "chorus: process group was shut down");
    GilRelease nogil;
    res = chorus_comm_split(comm_, color, key, &copts, &newcomm);
    if (res != CHORUS_SUCCESS) throwBackend(commError(comm_, res, "split"));
  }
  c10::intrusive_ptr<c10d::Backend> result;
  if (newcomm) {
    result = c10::make_intrusive<ProcessGroupChorus>(SplitTag{}, newcomm, timeout, bootstrap_ctx_);
    if (opts) result->setGroupUid(opts->group_name);
  }
  last_split_name_ = name;
  last_split_ = c10::weak_intrusive_ptr<c10d::Backend>(result);
  last_split_valid_ = true;
  return result;
}

// ------------------------------------------------------------------ collectives

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  checkOne(tensors, op, "");
  Checker{op}(tensors[0]);
  TORCH_CHECK(opts.rootTensor == 0, "chorus: broadcast: rootTensor must be 0");
  const int root = static_cast<int>(opts.rootRank);
  checkRoot(root, size_, op);
  auto work = newWork(OpType::BROADCAST, "chorus:broadcast", op, tensors);
  at::Tensor buf = contiguousOut(tensors[0], *work, true);
  const auto dt = toDtype(buf.scalar_type());
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    auto res = chorus_ibroadcast(c, ptrOf(buf), buf.numel(), dt, root, &req);
    addOrThrow(c, w, res, req, op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::allreduce_sparse(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  const char* op = "all_reduce";
  checkOne(tensors, op, "");
  Checker{op}(tensors[0]);
  const auto rop = toRedop(opts.reduceOp, tensors[0].scalar_type());
  auto work = newWork(OpType::ALLREDUCE, "chorus:all_reduce", op, tensors);
  at::Tensor buf = contiguousOut(tensors[0], *work, true);
  const auto dt = toDtype(buf.scalar_type());
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    void* p = ptrOf(buf);
    auto res = chorus_iallreduce(c, p, p, buf.numel(), dt, rop, &req);
    addOrThrow(c, w, res, req, op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = "all_reduce_coalesced";
  Checker check{op};
  for (auto& t : tensors) check(t);
  std::vector<chorus_redop_t> rops;
  for (auto& t : tensors) rops.push_back(toRedop(opts.reduceOp, t.scalar_type()));
  auto work = newWork(OpType::ALLREDUCE_COALESCED, "chorus:all_reduce_coalesced", op, tensors);
  std::vector<at::Tensor> bufs;
  for (auto& t : tensors) bufs.push_back(contiguousOut(t, *work, true));
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    for (size_t i = 0; i < bufs.size(); ++i) {
      chorus_request_t* req = nullptr;
      void* p = ptrOf(bufs[i]);
      auto res = chorus_iallreduce(c, p, p, bufs[i].numel(), toDtype(bufs[i].scalar_type()),
                                   rops[i], &req);
      addOrThrow(c, w, res, req, op);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  const char* op = "reduce";
  checkOne(tensors, op, "");
  Checker{op}(tensors[0]);
  TORCH_CHECK(opts.rootTensor == 0, "chorus: reduce: rootTensor must be 0");
  const int root = static_cast<int>(opts.rootRank);
  checkRoot(root, size_, op);
  const auto rop = toRedop(opts.reduceOp, tensors[0].scalar_type());
  auto work = newWork(OpType::REDUCE, "chorus:reduce", op, tensors);
  // Only the root's tensor changes; other ranks just read theirs.
  at::Tensor buf = rank_ == root ? contiguousOut(tensors[0], *work, true)
                                 : contiguousIn(tensors[0], *work);
  const auto dt = toDtype(buf.scalar_type());
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    void* p = ptrOf(buf);
    auto res = chorus_ireduce(c, p, rank_ == root ? p : nullptr, buf.numel(), dt, rop, root, &req);
    addOrThrow(c, w, res, req, op);
  });
}

namespace {

// Checks an all-gather list (one output per rank, uneven sizes allowed) and returns the
// element counts per rank.
std::vector<size_t> gatherListCounts(const std::vector<at::Tensor>& outs, const at::Tensor& in,
                                     int rank, int size, Checker& check, const char* op) {
  TORCH_CHECK(static_cast<int>(outs.size()) == size, "chorus: ", op, ": expected ", size,
              " output tensors (one per rank), got ", outs.size());
  std::vector<size_t> counts(size);
  for (int r = 0; r < size; ++r) {
    check(outs[r]);
    checkSameDtype(in, outs[r], op);
    counts[r] = static_cast<size_t>(outs[r].numel());
  }
  TORCH_CHECK(counts[rank] == static_cast<size_t>(in.numel()), "chorus: ", op,
              ": the output for this rank (", rank, ") holds ", counts[rank],
              " elements but the input holds ", in.numel());
  return counts;
}

// Issues an all-gather(v) of `in` into fresh contiguous staging, with copy-back into outs.
void issueAllgatherList(chorus_comm_t* c, WorkChorus& w, const std::vector<at::Tensor>& outs,
                        const at::Tensor& in_user, const std::vector<size_t>& counts,
                        const char* op) {
  std::vector<size_t> displs(counts.size());
  size_t total = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    displs[r] = total;
    total += counts[r];
  }
  at::Tensor in = contiguousIn(in_user, w);
  at::Tensor flat = at::empty({static_cast<int64_t>(total)}, in.options());
  w.keepAlive(flat);
  for (size_t r = 0; r < counts.size(); ++r) {
    w.addCopyBack(outs[r], flat.narrow(0, static_cast<int64_t>(displs[r]),
                                       static_cast<int64_t>(counts[r]))
                               .view(outs[r].sizes()));
  }
  chorus_request_t* req = nullptr;
  auto res = chorus_iallgatherv(c, ptrOf(in), ptrOf(flat), counts.data(), displs.data(),
                                toDtype(in.scalar_type()), &req);
  addOrThrow(c, w, res, req, op);
}

// One all_gather_into_tensor: checks, aliasing and staging; returns what to issue.
struct GatherBase {
  at::Tensor in, out;
};
GatherBase prepareAllgatherBase(at::Tensor& output, at::Tensor& input, int rank, int size,
                                WorkChorus& w, Checker& check, const char* op) {
  check(output);
  check(input);
  checkSameDtype(input, output, op);
  TORCH_CHECK(output.numel() == static_cast<int64_t>(size) * input.numel(), "chorus: ", op,
              ": output must hold world_size (", size, ") x input (", input.numel(),
              " elements) = ", static_cast<int64_t>(size) * input.numel(), " elements, got ",
              output.numel());
  GatherBase g;
  g.out = contiguousOut(output, w, false);
  if (input.is_contiguous() && overlaps(input, g.out)) {
    // The core accepts the input at this rank's own slot of the output (FSDP2 / DeepSpeed
    // copy-in); any other overlap is staged.
    const char* slot = static_cast<const char*>(g.out.data_ptr()) + rank * bytesOf(input);
    g.in = input.data_ptr() == slot ? input : input.clone();
    w.keepAlive(g.in);
  } else {
    g.in = contiguousIn(input, w);
  }
  return g;
}

struct ScatterBase {
  at::Tensor in, out;
};
ScatterBase prepareReduceScatterBase(at::Tensor& output, at::Tensor& input, int rank, int size,
                                     WorkChorus& w, Checker& check, const char* op) {
  check(output);
  check(input);
  checkSameDtype(input, output, op);
  TORCH_CHECK(input.numel() == static_cast<int64_t>(size) * output.numel(), "chorus: ", op,
              ": input must hold world_size (", size, ") x output (", output.numel(),
              " elements) = ", static_cast<int64_t>(size) * output.numel(), " elements, got ",
              input.numel());
  ScatterBase s;
  s.in = contiguousIn(input, w);
  if (output.is_contiguous() && overlaps(output, s.in)) {
    // The core accepts the output at this rank's own chunk of the input; else stage.
    const char* chunk = static_cast<const char*>(s.in.data_ptr()) + rank * bytesOf(output);
    if (output.data_ptr() == chunk) {
      s.out = output;
    } else {
      s.out = at::empty_like(output, at::MemoryFormat::Contiguous);
      w.keepAlive(s.out);
      w.addCopyBack(output, s.out);
    }
  } else {
    s.out = contiguousOut(output, w, false);
  }
  return s;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& /*opts*/) {
  const char* op = "all_gather";
  checkOne(inputs, op, "input");
  TORCH_CHECK(outputs.size() == 1, "chorus: all_gather takes exactly one output list per rank, "
              "got ", outputs.size());
  Checker check{op};
  check(inputs[0]);
  auto counts = gatherListCounts(outputs[0], inputs[0], rank_, size_, check, op);
  auto work = newWork(OpType::ALLGATHER, "chorus:all_gather", op, outputs[0], &inputs);
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    issueAllgatherList(c, w, outputs[0], inputs[0], counts, op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& /*opts*/) {
  const char* op = "all_gather_coalesced";
  TORCH_CHECK(output_lists.size() == inputs.size(), "chorus: ", op, ": ", inputs.size(),
              " inputs but ", output_lists.size(), " output lists");
  Checker check{op};
  std::vector<std::vector<size_t>> counts;
  std::vector<at::Tensor> flat_outputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check(inputs[i]);
    counts.push_back(gatherListCounts(output_lists[i], inputs[i], rank_, size_, check, op));
    flat_outputs.insert(flat_outputs.end(), output_lists[i].begin(), output_lists[i].end());
  }
  auto work = newWork(OpType::ALLGATHER_COALESCED, "chorus:all_gather_coalesced", op,
                      std::move(flat_outputs), &inputs);
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    for (size_t i = 0; i < inputs.size(); ++i)
      issueAllgatherList(c, w, output_lists[i], inputs[i], counts[i], op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& /*opts*/) {
  const char* op = "all_gather_into_tensor";
  Checker check{op};
  std::vector<at::Tensor> shown{input};
  auto work = newWork(OpType::_ALLGATHER_BASE, "chorus:all_gather_into_tensor", op, {output},
                      &shown);
  GatherBase g = prepareAllgatherBase(output, input, rank_, size_, *work, check, op);
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    auto res = chorus_iallgather(c, ptrOf(g.in), ptrOf(g.out), g.in.numel(),
                                 toDtype(g.in.scalar_type()), &req);
    addOrThrow(c, w, res, req, op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& /*opts*/) {
  const char* op = "all_gather_into_tensor_coalesced";
  TORCH_CHECK(outputs.size() == inputs.size(), "chorus: ", op, ": ", inputs.size(),
              " inputs but ", outputs.size(), " outputs");
  Checker check{op};
  auto work = newWork(OpType::COALESCED, "chorus:all_gather_into_tensor_coalesced", op, outputs,
                      &inputs);
  std::vector<GatherBase> gs;
  for (size_t i = 0; i < inputs.size(); ++i)
    gs.push_back(prepareAllgatherBase(outputs[i], inputs[i], rank_, size_, *work, check, op));
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    for (auto& g : gs) {
      chorus_request_t* req = nullptr;
      auto res = chorus_iallgather(c, ptrOf(g.in), ptrOf(g.out), g.in.numel(),
                                   toDtype(g.in.scalar_type()), &req);
      addOrThrow(c, w, res, req, op);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const char* op = "gather";
  checkOne(inputs, op, "input");
  Checker check{op};
  check(inputs[0]);
  const int root = static_cast<int>(opts.rootRank);
  checkRoot(root, size_, op);
  const int64_t n = inputs[0].numel();
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1, "chorus: gather: the root takes exactly one output list, "
                "got ", outputs.size());
    TORCH_CHECK(static_cast<int>(outputs[0].size()) == size_, "chorus: gather: expected ", size_,
                " output tensors on the root (one per rank), got ", outputs[0].size());
    for (auto& t : outputs[0]) {
      check(t);
      checkSameDtype(inputs[0], t, op);
      TORCH_CHECK(t.numel() == n, "chorus: gather: every output must hold as many elements as "
                  "the input (", n, "), got ", t.numel());
    }
    outs = outputs[0];
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "chorus: gather: only the root (rank ", root, ") takes output tensors");
  }
  auto work = newWork(OpType::GATHER, "chorus:gather", op, outs, &inputs);
  at::Tensor in = contiguousIn(inputs[0], *work);
  at::Tensor flat;
  if (rank_ == root) {
    flat = at::empty({n * size_}, in.options());
    work->keepAlive(flat);
    for (int r = 0; r < size_; ++r)
      work->addCopyBack(outs[r], flat.narrow(0, r * n, n).view(outs[r].sizes()));
  }
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    auto res = chorus_igather(c, ptrOf(in), rank_ == root ? ptrOf(flat) : nullptr, n,
                              toDtype(in.scalar_type()), root, &req);
    addOrThrow(c, w, res, req, op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const char* op = "scatter";
  checkOne(outputs, op, "output");
  Checker check{op};
  check(outputs[0]);
  const int root = static_cast<int>(opts.rootRank);
  checkRoot(root, size_, op);
  const int64_t n = outputs[0].numel();
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1, "chorus: scatter: the root takes exactly one input list, "
                "got ", inputs.size());
    TORCH_CHECK(static_cast<int>(inputs[0].size()) == size_, "chorus: scatter: expected ", size_,
                " input tensors on the root (one per rank), got ", inputs[0].size());
    for (auto& t : inputs[0]) {
      check(t);
      checkSameDtype(t, outputs[0], op);
      TORCH_CHECK(t.numel() == n, "chorus: scatter: every input must hold as many elements as "
                  "the output (", n, "), got ", t.numel());
    }
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "chorus: scatter: only the root (rank ", root, ") takes input tensors");
  }
  auto work = newWork(OpType::SCATTER, "chorus:scatter", op, outputs);
  at::Tensor flat;
  if (rank_ == root) {
    flat = at::empty({n * size_}, outputs[0].options().memory_format(at::MemoryFormat::Contiguous));
    for (int r = 0; r < size_; ++r) flat.narrow(0, r * n, n).copy_(inputs[0][r].reshape({n}));
    work->keepAlive(flat);
  }
  at::Tensor out = contiguousOut(outputs[0], *work, false);
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    auto res = chorus_iscatter(c, rank_ == root ? ptrOf(flat) : nullptr, ptrOf(out), n,
                               toDtype(out.scalar_type()), root, &req);
    addOrThrow(c, w, res, req, op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter";
  checkOne(outputs, op, "output");
  TORCH_CHECK(inputs.size() == 1, "chorus: reduce_scatter takes exactly one input list per "
              "rank, got ", inputs.size());
  Checker check{op};
  check(outputs[0]);
  TORCH_CHECK(static_cast<int>(inputs[0].size()) == size_, "chorus: reduce_scatter: expected ",
              size_, " input tensors (one per rank), got ", inputs[0].size());
  std::vector<size_t> counts(size_);
  size_t total = 0;
  for (int r = 0; r < size_; ++r) {
    check(inputs[0][r]);
    checkSameDtype(inputs[0][r], outputs[0], op);
    counts[r] = static_cast<size_t>(inputs[0][r].numel());
    total += counts[r];
  }
  TORCH_CHECK(counts[rank_] == static_cast<size_t>(outputs[0].numel()), "chorus: reduce_scatter: "
              "the input for this rank (", rank_, ") holds ", counts[rank_],
              " elements but the output holds ", outputs[0].numel());
  const auto rop = toRedop(opts.reduceOp, outputs[0].scalar_type());
  auto work = newWork(OpType::REDUCE_SCATTER, "chorus:reduce_scatter", op, outputs, &inputs[0]);
  at::Tensor flat = at::empty({static_cast<int64_t>(total)},
                              outputs[0].options().memory_format(at::MemoryFormat::Contiguous));
  size_t off = 0;
  for (int r = 0; r < size_; ++r) {
    flat.narrow(0, static_cast<int64_t>(off), static_cast<int64_t>(counts[r]))
        .copy_(inputs[0][r].reshape({-1}));
    off += counts[r];
  }
  work->keepAlive(flat);
  at::Tensor out = contiguousOut(outputs[0], *work, false);
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    auto res = chorus_ireduce_scatterv(c, ptrOf(flat), ptrOf(out), counts.data(),
                                       toDtype(out.scalar_type()), rop, &req);
    addOrThrow(c, w, res, req, op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor";
  Checker check{op};
  check(output);
  const auto rop = toRedop(opts.reduceOp, output.scalar_type());
  std::vector<at::Tensor> shown{input};
  auto work = newWork(OpType::_REDUCE_SCATTER_BASE, "chorus:reduce_scatter_tensor", op, {output},
                      &shown);
  ScatterBase s = prepareReduceScatterBase(output, input, rank_, size_, *work, check, op);
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    auto res = chorus_ireduce_scatter(c, ptrOf(s.in), ptrOf(s.out), s.out.numel(),
                                      toDtype(s.out.scalar_type()), rop, &req);
    addOrThrow(c, w, res, req, op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor_coalesced";
  TORCH_CHECK(outputs.size() == inputs.size(), "chorus: ", op, ": ", inputs.size(),
              " inputs but ", outputs.size(), " outputs");
  Checker check{op};
  std::vector<chorus_redop_t> rops;
  for (auto& o : outputs) {
    check(o);
    rops.push_back(toRedop(opts.reduceOp, o.scalar_type()));
  }
  // OpType::REDUCE_SCATTER_TENSOR_COALESCED is missing from older torch.
  auto work = newWork(OpType::COALESCED, "chorus:reduce_scatter_tensor_coalesced", op, outputs,
                      &inputs);
  std::vector<ScatterBase> ss;
  for (size_t i = 0; i < inputs.size(); ++i)
    ss.push_back(prepareReduceScatterBase(outputs[i], inputs[i], rank_, size_, *work, check, op));
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    for (size_t i = 0; i < ss.size(); ++i) {
      chorus_request_t* req = nullptr;
      auto res = chorus_ireduce_scatter(c, ptrOf(ss[i].in), ptrOf(ss[i].out), ss[i].out.numel(),
                                        toDtype(ss[i].out.scalar_type()), rops[i], &req);
      addOrThrow(c, w, res, req, op);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& /*opts*/) {
  const char* op = "all_to_all_single";
  Checker check{op};
  check(output);
  check(input);
  checkSameDtype(input, output, op);
  std::vector<at::Tensor> shown{input};
  auto work = newWork(OpType::ALLTOALL_BASE, "chorus:all_to_all_single", op, {output}, &shown);
  at::Tensor out = contiguousOut(output, *work, false);
  // In-place (or otherwise overlapping) exchanges read from a copy of the input.
  at::Tensor in = overlaps(input, out) ? input.clone(at::MemoryFormat::Contiguous)
                                       : input.contiguous();
  work->keepAlive(in);
  const auto dt = toDtype(in.scalar_type());
  if (output_split_sizes.empty() && input_split_sizes.empty()) {
    TORCH_CHECK(dim0(in) % size_ == 0, "chorus: all_to_all_single: input dim 0 (", dim0(in),
                ") does not divide equally across ", size_, " ranks");
    TORCH_CHECK(out.numel() == in.numel(), "chorus: all_to_all_single: output holds ",
                out.numel(), " elements, input ", in.numel(), " (must be equal without split "
                "sizes)");
    const size_t count = static_cast<size_t>(in.numel() / size_);
    return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
      chorus_request_t* req = nullptr;
      auto res = chorus_ialltoall(c, ptrOf(in), ptrOf(out), count, dt, &req);
      addOrThrow(c, w, res, req, op);
    });
  }
  TORCH_CHECK(rowNumel(in) == rowNumel(out), "chorus: all_to_all_single: input and output "
              "rows (dims after 0) differ: ", rowNumel(in), " vs ", rowNumel(out), " elements");
  std::vector<size_t> scounts, sdispls, rcounts, rdispls;
  splitCounts(input_split_sizes, in, size_, "input", scounts, sdispls);
  splitCounts(output_split_sizes, out, size_, "output", rcounts, rdispls);
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    auto res = chorus_ialltoallv(c, ptrOf(in), scounts.data(), sdispls.data(), ptrOf(out),
                                 rcounts.data(), rdispls.data(), dt, &req);
    addOrThrow(c, w, res, req, op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions& /*opts*/) {
  const char* op = "all_to_all";
  TORCH_CHECK(static_cast<int>(outputs.size()) == size_ && static_cast<int>(inputs.size()) == size_,
              "chorus: all_to_all: expected ", size_, " input and output tensors (one per rank), "
              "got ", inputs.size(), " and ", outputs.size());
  Checker check{op};
  std::vector<size_t> scounts(size_), sdispls(size_), rcounts(size_), rdispls(size_);
  size_t stotal = 0, rtotal = 0;
  for (int p = 0; p < size_; ++p) {
    check(inputs[p]);
    check(outputs[p]);
    checkSameDtype(inputs[p], outputs[0], op);
    checkSameDtype(inputs[0], outputs[p], op);
    scounts[p] = static_cast<size_t>(inputs[p].numel());
    rcounts[p] = static_cast<size_t>(outputs[p].numel());
    sdispls[p] = stotal;
    rdispls[p] = rtotal;
    stotal += scounts[p];
    rtotal += rcounts[p];
  }
  auto work = newWork(OpType::ALLTOALL, "chorus:all_to_all", op, outputs, &inputs);
  auto opts_c = inputs[0].options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor sflat = at::empty({static_cast<int64_t>(stotal)}, opts_c);
  at::Tensor rflat = at::empty({static_cast<int64_t>(rtotal)}, opts_c);
  for (int p = 0; p < size_; ++p) {
    sflat.narrow(0, static_cast<int64_t>(sdispls[p]), static_cast<int64_t>(scounts[p]))
        .copy_(inputs[p].reshape({-1}));
    work->addCopyBack(outputs[p], rflat.narrow(0, static_cast<int64_t>(rdispls[p]),
                                               static_cast<int64_t>(rcounts[p]))
                                      .view(outputs[p].sizes()));
  }
  work->keepAlive(sflat);
  work->keepAlive(rflat);
  const auto dt = toDtype(sflat.scalar_type());
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    auto res = chorus_ialltoallv(c, ptrOf(sflat), scounts.data(), sdispls.data(), ptrOf(rflat),
                                 rcounts.data(), rdispls.data(), dt, &req);
    addOrThrow(c, w, res, req, op);
  });
}

// ------------------------------------------------------------------ point-to-point

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::send(std::vector<at::Tensor>& tensors,
                                                        int dst_rank, int tag) {
  const char* op = "send";
  checkOne(tensors, op, "");
  Checker{op}(tensors[0]);
  checkPeer(dst_rank, rank_, size_, op);
  checkTag(tag, op);
  auto work = newWork(OpType::SEND, "chorus:send", op, tensors);
  at::Tensor buf = contiguousIn(tensors[0], *work);
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    auto res = chorus_isend(c, ptrOf(buf), buf.numel(), toDtype(buf.scalar_type()), dst_rank, tag,
                            &req);
    addOrThrow(c, w, res, req, op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::recv(std::vector<at::Tensor>& tensors,
                                                        int src_rank, int tag) {
  const char* op = "recv";
  checkOne(tensors, op, "");
  Checker{op}(tensors[0]);
  checkPeer(src_rank, rank_, size_, op);
  checkTag(tag, op);
  auto work = newWork(OpType::RECV, "chorus:recv", op, tensors);
  at::Tensor buf = contiguousOut(tensors[0], *work, false);
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    auto res = chorus_irecv(c, ptrOf(buf), buf.numel(), toDtype(buf.scalar_type()), src_rank, tag,
                            &req);
    addOrThrow(c, w, res, req, op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                 int tag) {
  const char* op = "recv_anysource";
  checkOne(tensors, op, "");
  Checker{op}(tensors[0]);
  TORCH_CHECK(size_ > 1, "chorus: recv from any source needs a group of at least 2 ranks");
  checkTag(tag, op);
  auto work = newWork(OpType::RECVANYSOURCE, "chorus:recv_anysource", op, tensors);
  work->setAnySource();
  at::Tensor buf = contiguousOut(tensors[0], *work, false);
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    auto res = chorus_irecv(c, ptrOf(buf), buf.numel(), toDtype(buf.scalar_type()),
                            CHORUS_ANY_SOURCE, tag, &req);
    addOrThrow(c, w, res, req, op);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::barrier(const c10d::BarrierOptions& /*opts*/) {
  const char* op = "barrier";
  t_op_cuda_device = -1;  // no tensors: a host operation
  t_op_tensors.clear();
  auto work = newWork(OpType::BARRIER, "chorus:barrier", op, {});
  return launch(work, [&](chorus_comm_t* c, WorkChorus& w) {
    chorus_request_t* req = nullptr;
    auto res = chorus_ibarrier(c, &req);
    addOrThrow(c, w, res, req, op);
  });
}

// ------------------------------------------------------------------ flight recorder

std::string ProcessGroupChorus::dumpTrace(const std::string& dir, const std::string& reason) {
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(comm_ && !closed_, "chorus: process group was shut down");
  char path[4096];
  chorus_result_t res = chorus_trace_dump(comm_, dir.c_str(), reason.c_str(), path, sizeof path);
  TORCH_CHECK(res == CHORUS_SUCCESS, "chorus: dump_trace: ", chorus_comm_error(nullptr));
  return path;
}

uint64_t ProcessGroupChorus::registerBuffer(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.defined(), "chorus.register: the tensor is undefined");
  TORCH_CHECK(tensor.device().is_cpu(), "chorus.register: only CPU tensors can be registered "
              "(device tensors cross hosts staged through host memory); got one on ",
              tensor.device());
  TORCH_CHECK(tensor.layout() == c10::kStrided, "chorus.register: only dense tensors can be "
              "registered, got layout ", tensor.layout());
  const c10::Storage& st = tensor.storage();
  TORCH_CHECK(st.data() != nullptr && st.nbytes() > 0,
              "chorus.register: the tensor has no memory (empty storage)");
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(comm_ && !closed_, "chorus: process group was shut down");
  void* handle = nullptr;
  chorus_result_t res = chorus_comm_register(comm_, st.data(), st.nbytes(), &handle);
  TORCH_CHECK(res == CHORUS_SUCCESS, "chorus.register: ", chorus_comm_error(nullptr));
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(handle));
}

void ProcessGroupChorus::deregisterBuffer(uint64_t handle) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!comm_ || closed_) return;
  chorus_result_t res =
      chorus_comm_deregister(comm_, reinterpret_cast<void*>(static_cast<uintptr_t>(handle)));
  TORCH_CHECK(res == CHORUS_SUCCESS, "chorus.register: ", chorus_comm_error(nullptr));
}

std::vector<std::string> dumpAllTraces(const std::string& dir, const std::string& reason) {
  std::vector<char> paths(1 << 16);
  int written = 0;
  chorus_result_t res =
      chorus_trace_dump_all(dir.c_str(), reason.c_str(), paths.data(), paths.size(), &written);
  TORCH_CHECK(res == CHORUS_SUCCESS, "chorus: dump_trace: ", chorus_comm_error(nullptr));
  std::vector<std::string> out;
  const char* p = paths.data();
  while (*p) {
    const char* nl = std::strchr(p, '\n');
    if (!nl) break;
    out.emplace_back(p, nl);
    p = nl + 1;
  }
  return out;
}

// ------------------------------------------------------------------ parameters

std::vector<ParamRow> paramTable() {
  std::vector<ParamRow> rows;
  const int n = chorus_param_count();
  for (int i = 0; i < n; ++i) {
    const chorus_param_info_t* info = chorus_param_get_info(i);
    if (!info) continue;
    ParamRow row;
    row.name = info->name ? info->name : "";
    row.type = info->type ? info->type : "";
    row.default_value = info->default_value ? info->default_value : "";
    row.doc = info->doc ? info->doc : "";
    row.nccl_fallback = info->nccl_fallback != 0;
    char value[4096];
    const char* source = nullptr;
    if (chorus_param_value(row.name.c_str(), value, sizeof value, &source) == 0) {
      row.value = value;
      row.source = source ? source : "";
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace chorus_torch
