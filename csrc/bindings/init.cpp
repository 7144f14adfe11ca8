// init.cpp - the Python module chorus._C: binds ProcessGroupChorus onto torch's
// torch._C._distributed_c10d.Backend (intrusive_ptr holder, so c10d accepts the object the
// creator returns), and exposes version(), the core's parameter table and the tuner's plan.
#include <torch/python.h>

#include <chrono>
#include <string>

#include "ProcessGroupChorus.hpp"

namespace py = pybind11;

namespace {

constexpr double kDefaultTimeoutSeconds = 30.0 * 60.0;

// timeout: None, a datetime.timedelta or a number of seconds.
std::chrono::milliseconds toTimeout(const py::object& timeout) {
  double seconds = kDefaultTimeoutSeconds;
  if (!timeout.is_none()) {
    if (py::hasattr(timeout, "total_seconds")) {
      seconds = timeout.attr("total_seconds")().cast<double>();
    } else {
      seconds = timeout.cast<double>();
    }
  }
  TORCH_CHECK(seconds > 0, "chorus: timeout must be positive, got ", seconds, " s");
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Chorus collective-communication library: torch.distributed backend";
  py::object backend = py::module_::import("torch._C._distributed_c10d").attr("Backend");

  using chorus_torch::ProcessGroupChorus;
  py::class_<ProcessGroupChorus, c10::intrusive_ptr<ProcessGroupChorus>>(
      m, "ProcessGroupChorus", backend)
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       const py::object& timeout, const std::string& name,
                       const std::vector<int>& global_ranks) {
             auto ms = toTimeout(timeout);
             // Creation waits on the store for every rank: let other Python threads run.
             py::gil_scoped_release nogil;
             return c10::make_intrusive<ProcessGroupChorus>(store, rank, size, ms, name,
                                                            global_ranks);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout") = py::none(),
           py::arg("name") = std::string(), py::arg("global_ranks") = std::vector<int>(),
           "Creates the group (collective over all ranks). timeout: timedelta or seconds. "
           "global_ranks: the job-wide rank of each member, for the flight records.")
      .def("_dump_trace", &ProcessGroupChorus::dumpTrace, py::arg("dir") = std::string(),
           py::arg("reason") = std::string("api"), py::call_guard<py::gil_scoped_release>(),
           "Writes this group's flight record into dir ('' : CHORUS_TRACE_DIR); returns the "
           "file's path.")
      // split_group() deep-copies `backend.options` when no pg_options are given; None
      // makes the split use getBackendOptions() with the parent's timeout.
      .def_property_readonly("options", [](const ProcessGroupChorus&) { return py::none(); })
      .def("_sequence_number", &ProcessGroupChorus::getSequenceNumberForGroup,
           py::call_guard<py::gil_scoped_release>())
      .def("_register_buffer", &ProcessGroupChorus::registerBuffer, py::arg("tensor"),
           py::call_guard<py::gil_scoped_release>(),
           "chorus_comm_register over the tensor's storage; returns the handle.")
      .def("_deregister_buffer", &ProcessGroupChorus::deregisterBuffer, py::arg("handle"),
           py::call_guard<py::gil_scoped_release>(),
           "chorus_comm_deregister; nothing once the group was shut down.");

  m.def(
      "tune_plan",
      [](const std::string& collective, uint64_t bytes, int nranks, int ranks_per_host, bool shm,
         const py::object& algo, bool unimplemented, int spin) {
        chorus_tune_topology_t topo{nranks, ranks_per_host, shm ? 1 : 0, spin};
        std::string override_text;
        const char* override_ptr = nullptr;  // None: CHORUS_ALGO / NCCL_ALGO as in force
        if (!algo.is_none()) {
          override_text = algo.cast<std::string>();
          override_ptr = override_text.c_str();
        }
        chorus_tune_plan_t plan;
        chorus_result_t res =
            chorus_tune_plan(collective.c_str(), static_cast<size_t>(bytes), &topo, override_ptr,
                             unimplemented ? CHORUS_TUNE_UNIMPLEMENTED : 0u, &plan);
        if (res != CHORUS_SUCCESS) throw py::value_error(chorus_comm_error(nullptr));
        py::dict d;
        d["algo"] = std::string(plan.algo);
        d["predicted_us"] = plan.predicted_us < 0 ? py::none() : py::cast(plan.predicted_us);
        d["forced"] = plan.forced != 0;
        d["fell_back"] = plan.fell_back != 0;
        d["nhosts"] = plan.nhosts;
        d["spin"] = plan.spin != 0;
        py::list cands;
        for (int i = 0; i < plan.ncandidates; i++) {
          py::dict c;
          c["algo"] = std::string(plan.candidates[i].algo);
          c["predicted_us"] = plan.candidates[i].predicted_us < 0
                                  ? py::none()
                                  : py::cast(plan.candidates[i].predicted_us);
          c["implemented"] = plan.candidates[i].implemented != 0;
          cands.append(c);
        }
        d["candidates"] = cands;
        return d;
      },
      py::arg("collective"), py::arg("bytes"), py::arg("nranks"), py::arg("ranks_per_host"),
      py::arg("shm") = true, py::arg("algo") = py::none(), py::arg("unimplemented") = false,
      py::arg("spin") = -1,
      "chorus_tune_plan(): the algorithm a communicator of this shape would choose for one "
      "collective of `bytes` bytes, its predicted time and every candidate, cheapest first. "
      "algo: None reads CHORUS_ALGO as a communicator would, '' ignores it, else an override. "
      "unimplemented: also consider algorithms this build lacks (model only). spin: 1 every "
      "rank's engine spins, 0 not every one, -1 as ranks_per_host ranks on this machine would. "
      "ValueError on bad input.");
  m.def("dump_all_traces", &chorus_torch::dumpAllTraces, py::arg("dir") = std::string(),
        py::arg("reason") = std::string("api"), py::call_guard<py::gil_scoped_release>(),
        "Writes the flight record of every Chorus communicator of this process into dir "
        "('' : CHORUS_TRACE_DIR); returns their paths.");
  m.def(
      "verbs_nics",
      []() {
        std::vector<chorus_nic_info_t> nics(64);
        int n = 0;
        chorus_result_t res;
        {
          py::gil_scoped_release nogil;  // opens every device: may take a moment
          res = chorus_verbs_nics(nics.data(), static_cast<int>(nics.size()), &n);
        }
        py::dict d;
        d["loadable"] = res == CHORUS_SUCCESS;
        d["error"] = res == CHORUS_SUCCESS ? py::none() : py::cast(std::string(chorus_comm_error(nullptr)));
        py::list out;
        for (int i = 0; i < n; i++) {
          const chorus_nic_info_t& x = nics[i];
          py::dict e;
          e["name"] = std::string(x.name);
          e["port"] = x.port;
          e["active"] = x.active != 0;
          e["usable"] = x.usable != 0;
          e["link_layer"] = x.roce ? "RoCE" : "InfiniBand";
          e["width"] = x.width;
          e["lane_gbps"] = x.lane_gbps;
          e["rate_gbps"] = x.width * x.lane_gbps;
          e["lid"] = x.lid;
          e["gid_index"] = x.gid_index;
          e["why"] = std::string(x.why);
          out.append(e);
        }
        d["nics"] = out;
        return d;
      },
      "The RDMA ports libibverbs (CHORUS_IBVERBS_LIB) shows, as the verbs transport sees them: "
      "{loadable, error, nics: [{name, port, active, usable, link_layer, width, lane_gbps, "
      "rate_gbps, lid, gid_index, why}]}.");
  m.def("verbs_built", []() { return true; },
        "True: the verbs transport is part of every build (libibverbs is loaded at run time).");
  m.def("cuda_built", []() { return chorus_cuda_built() != 0; },
        "True if this build carries the CUDA path (kernels, CUDA IPC, stream ordering).");
  m.def("version", []() { return std::string(chorus_version()); },
        "Version of the C core (chorus_version()).");
  m.def(
      "params",
      []() {
        py::list out;
        for (const auto& row : chorus_torch::paramTable()) {
          py::dict d;
          d["name"] = row.name;
          d["env"] = "CHORUS_" + row.name;
          d["nccl_env"] = row.nccl_fallback ? py::cast("NCCL_" + row.name) : py::none();
          d["nccl_fallback"] = row.nccl_fallback;
          d["type"] = row.type;
          d["default"] = row.default_value;
          d["doc"] = row.doc;
          d["value"] = row.value;
          d["source"] = row.source;
          out.append(d);
        }
        return out;
      },
      "The core's parameter table: one dict per parameter (name, env, nccl_env, "
      "nccl_fallback, type, default, doc, value in force and its source).");
}
