// ProcessGroupChorus.hpp - the torch.distributed backend "chorus": ProcessGroupChorus
// (c10d::Backend), WorkChorus (c10d::Work) and the thread that completes works. A thin layer
// over chorus.h: argument checks, tensor -> (ptr, count, dtype), staging, completion.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "chorus.h"
#include "cuda_support.hpp"

namespace chorus_torch {

class WorkChorus;

// Completes works on threads of its own: the core's completion callbacks run on the core's
// thread, where no copy-back, future callback or Python may run (a DDP comm hook chained with
// .then() may even issue the next collective from there). A future callback may also block
// until another work of the group is done (PowerSGD's hook waits on the future of the
// all_reduce it issued): so one thread is always kept free, and one more is started when the
// last free one takes a work.
class Completer {
 public:
  Completer();
  ~Completer();
  Completer(const Completer&) = delete;
  Completer& operator=(const Completer&) = delete;

  // Queues w for finalize(); takes over one reference to w. Never throws (core's thread).
  // Without notify the thread is not woken for w (a caller blocked in wait() finalizes it
  // and takes it back); it is still handled at the next notify or at shutdown.
  void push(WorkChorus* w, bool notify) noexcept;
  // Removes w from the queue if it is there; true if so (the caller then owns the reference).
  bool take(WorkChorus* w) noexcept;
  // Drains the queue and joins the threads (detaches the calling thread if it is one).
  void shutdown();

 private:
  void run();
  // Starts one more thread; mu_ held. False if none could be started.
  bool spawnLocked() noexcept;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<WorkChorus*> queue_;
  bool stop_ = false;
  bool joined_ = false;
  int idle_ = 0;  // threads waiting for a work
  std::vector<std::thread> threads_;
};

// One torch-level operation: the core requests it issued (or, for endCoalescing, the child
// works it covers), the tensors those requests read and write, and staged outputs to copy
// back. Completion order: copy-back, then completed_/exception_ (wait() returns), then the
// future (its callbacks run), then the parent work is told.
class WorkChorus : public c10d::Work {
 public:
  // profiled: the tensors the profiler's record of the work shows (record_shapes: sizes and
  // dtypes); nullopt when no profiler callback is registered.
  WorkChorus(c10d::OpType type, int rank, const char* profiling_title, const char* op_name,
             std::shared_ptr<Completer> completer, std::vector<at::Tensor> outputs,
             const std::optional<std::vector<at::Tensor>>& profiled = std::nullopt);
  ~WorkChorus() override;

  // ---- building (before arm) ----
  void addRequest(chorus_request_t* req);
  void keepAlive(at::Tensor t) { keep_.push_back(std::move(t)); }
  // After success: dst.copy_(src) (dst is the user's tensor, src a contiguous staging).
  void addCopyBack(at::Tensor dst, at::Tensor src) {
    copy_back_.emplace_back(std::move(dst), std::move(src));
  }
  void addChild(c10::intrusive_ptr<WorkChorus> child) { children_.push_back(std::move(child)); }
  void setAnySource() { any_source_ = true; }
  // Device tensors: the work waits for `event` (recorded on the caller's stream), its
  // device part ends at `end_event` (recorded by the core when that part outlives the
  // requests), both owned by the work from now on; its future names the device. Before arm().
  void setCuda(int device, void* event, void* end_event);
  // The device alone (a coalesced work over device works: its future names the device).
  void setCudaDevice(int device);
  int cudaDevice() const { return cuda_device_; }
  // Registers the completion callbacks; the work finishes once everything it covers has.
  void arm();

  // ---- c10d::Work ----
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override;

  // Runs the completion steps once (whoever gets here first: completer, waiter, poller).
  void finalize() noexcept;
  // Completes the future with the work's outcome (eptr: its error).
  void completeFuture(std::exception_ptr eptr) noexcept;

 private:
  friend class Completer;
  static void onRequestComplete(void* arg, chorus_result_t res);
  // One of the things this work waits for is done; the last one finalizes (or queues the
  // finalize on the completer when it is the core's thread).
  void release(bool on_core_thread) noexcept;
  // Can the core thread finalize this work itself (no future handed out, so no callback can
  // run there; nothing to copy back; no parent; no profiler hook)? Marks it as inline if so.
  bool beginInline() noexcept;
  void endInline() noexcept;
  bool attachParent(const c10::intrusive_ptr<WorkChorus>& parent);
  // Have the requests completed (device work queued, maybe not yet run)? Finalizes if so.
  bool hostCompleted();
  void pollRequests();  // chorus_test on every request: starts any still queued for a waiter
  // finalize(), then wait until completed_ (another thread may be the one finalizing).
  void awaitCompleted();
  // Makes the current stream wait for this work's (or its children's) device part.
  void streamWaitDevice();
  // Has the device part of this work (or of its children) finished?
  bool deviceDone();
  // Waits for every request / child without throwing; false on timeout.
  bool waitDone(std::chrono::steady_clock::time_point deadline, bool has_deadline);

  const char* op_name_;
  std::shared_ptr<Completer> completer_;
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> keep_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back_;
  std::vector<chorus_request_t*> reqs_;
  std::vector<c10::intrusive_ptr<WorkChorus>> children_;
  c10::intrusive_ptr<WorkChorus> parent_;  // guarded by mutex_; set while armed
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<int> pending_{0};
  std::atomic<bool> finalizing_{false};
  std::atomic<int> waiters_{0};  // threads inside wait(): they finalize, the completer needn't
  bool future_taken_ = false;    // guarded by mutex_: getFuture() was called
  bool future_deferred_ = false; // guarded by mutex_: finalized, the future left to getFuture
  bool inline_ = false;          // guarded by mutex_: the core thread is finalizing right now
  bool armed_ = false;
  bool any_source_ = false;
  int cuda_device_ = -1;         // >= 0: the tensors are on this CUDA device
  void* cuda_event_ = nullptr;   // the caller's stream position the work waits for
  void* end_event_ = nullptr;    // the end of the work's device part (see setCuda)
  int source_rank_ = -1;
  uint64_t seq_ = 0;
};

class ProcessGroupChorus : public c10d::Backend {
  struct SplitTag {};  // only split() can name it, so only split() uses that constructor

 public:
  // global_ranks: the job-wide rank of each member (flight records), may be empty.
  ProcessGroupChorus(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     std::chrono::milliseconds timeout, const std::string& name = "",
                     const std::vector<int>& global_ranks = {});
  // A group over a communicator made by chorus_comm_split (public for make_intrusive).
  ProcessGroupChorus(SplitTag, chorus_comm_t* comm, std::chrono::milliseconds timeout,
                     std::shared_ptr<void> bootstrap_ctx);
  ~ProcessGroupChorus() override;

  const std::string getBackendName() const override { return "chorus"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  bool supportsSplitting() const override { return true; }
  // init_process_group(device_id=cuda:N): the core's kernels are loaded on that device now
  // (see chorus_cuda_preload); nothing else is set up before the first device operation.
  void eagerConnectSingleDevice(at::Device device) override {
    if (device.is_cuda() && device.has_index()) chorus_cuda_preload(device.index(), 1);
  }
  bool supportsCoalescing() const override { return true; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void abort() override;
  void shutdown() override;
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // torch hands sparse CUDA tensors here (sparse CPU ones reach allreduce): refused by the
  // same checks, with chorus's message rather than c10d's "does not support".
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // Writes this group's flight record (chorus_trace_dump) into dir ("" : CHORUS_TRACE_DIR);
  // returns the file's path.
  std::string dumpTrace(const std::string& dir, const std::string& reason);
  // chorus_comm_register over the whole storage of a CPU tensor (so every view of it is
  // covered); the handle for deregisterBuffer. Deregistering after the group was shut down
  // does nothing (destroy released every registration).
  uint64_t registerBuffer(const at::Tensor& tensor);
  void deregisterBuffer(uint64_t handle);

 private:

  // profiled: what the profiler shows as the work's inputs (nullptr: outputs).
  c10::intrusive_ptr<WorkChorus> newWork(c10d::OpType type, const char* title,
                                         const char* op_name, std::vector<at::Tensor> outputs,
                                         const std::vector<at::Tensor>* profiled = nullptr);
  // Issues under the lifecycle lock: issue(comm, work) calls chorus_i*; the work is armed
  // even when issue throws, so requests already in flight keep their buffers alive.
  template <typename F>
  c10::intrusive_ptr<c10d::Work> launch(const c10::intrusive_ptr<WorkChorus>& work, F&& issue);
  void closeComm(bool abort_first);

  // The Store bridge behind the bootstrap; declared before comm_ so it outlives it.
  std::shared_ptr<void> bootstrap_ctx_;
  std::mutex mu_;  // guards comm_, closed_, coalescing state against shutdown/abort
  chorus_comm_t* comm_ = nullptr;
  bool closed_ = false;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Completer> completer_;
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<WorkChorus>> coalesced_;
  // Older torch calls split() once per device type that maps to this backend (cpu and cuda
  // share it): the second call with the same group name returns the first result.
  std::string last_split_name_;
  c10::weak_intrusive_ptr<c10d::Backend> last_split_{c10::intrusive_ptr<c10d::Backend>()};
  bool last_split_valid_ = false;
};

// The parameter table of the core, for Python (name, type, default, doc, NCCL fallback,
// value in force and its source).
struct ParamRow {
  std::string name, type, default_value, doc, value, source;
  bool nccl_fallback;
};
std::vector<ParamRow> paramTable();

// Every communicator's flight record of this process (chorus_trace_dump_all): their paths.
std::vector<std::string> dumpAllTraces(const std::string& dir, const std::string& reason);

}  // namespace chorus_torch
