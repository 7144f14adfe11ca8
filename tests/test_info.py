"""python -m chorus.info: runs, and reports each parameter's value with its source: a
CHORUS_ variable, an NCCL_ variable (where the parameter has an NCCL fallback), CHORUS_
winning over NCCL_ when both are set, and the default; the socket transport's interface
choice follows CHORUS_SOCKET_IFNAME (=lo selects loopback alone). One --json run checks the
values; the plain text, rendered from them, must name them."""
import json
import subprocess
import sys

from launch import REPO, base_env


def run_info(*args, env):
    return subprocess.run([sys.executable, "-m", "chorus.info", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_info_reports_parameter_sources_and_transports():
    env = base_env(1, 0)
    for k in list(env):
        if k.startswith(("CHORUS_", "NCCL_")):
            del env[k]
    env.update(CHORUS_SHM_SCRATCH="8M",            # CHORUS_ only
               NCCL_BUFFSIZE="1M",                  # NCCL_ fallback alone
               CHORUS_DEBUG="WARN", NCCL_DEBUG="INFO",  # both: CHORUS_ wins
               CHORUS_SOCKET_IFNAME="=lo")
    res = run_info("--json", env=env)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    params = {p["env"]: p for p in info["params"]}
    assert (params["CHORUS_SHM_SCRATCH"]["value"], params["CHORUS_SHM_SCRATCH"]["source"]) == \
        ("8M", "CHORUS_SHM_SCRATCH")
    assert (params["CHORUS_BUFFSIZE"]["value"], params["CHORUS_BUFFSIZE"]["source"]) == \
        ("1M", "NCCL_BUFFSIZE")
    assert (params["CHORUS_DEBUG"]["value"], params["CHORUS_DEBUG"]["source"]) == \
        ("WARN", "CHORUS_DEBUG")
    assert (params["CHORUS_TUNE_MODEL"]["value"], params["CHORUS_TUNE_MODEL"]["source"]) == \
        ("", "default")
    assert (params["CHORUS_TRACE_BUFFER_SIZE"]["value"],
            params["CHORUS_TRACE_BUFFER_SIZE"]["source"]) == ("2000", "default")
    assert info["transports"]["socket"]["interfaces"] == ["lo"], info["transports"]["socket"]
    assert info["version"]["chorus"] and info["version"]["core"]
    assert isinstance(info["build"]["cuda"], bool) and isinstance(info["build"]["verbs"], bool)
    assert info["topology"]["cpus"] >= 1 and any(n["name"] == "lo" for n in info["topology"]["nics"])
    shm = info["transports"]["shm"]
    assert shm["exists"] and shm["free_bytes"] > 0 and shm["usable"], shm

    # the plain output is rendered from the same dict (one run of the tool is enough)
    from chorus.info import render
    text = render(info)
    assert "CHORUS_BUFFSIZE" in text and "NCCL_BUFFSIZE" in text, text
    assert "transports:" in text and "socket  usable" in text and "-> lo" in text, text


def test_info_lists_rdma_ports_through_the_transports_loader():
    """Over the libibverbs test double (CHORUS_IBVERBS_LIB): each port with its link layer,
    lanes and rate, its LID (InfiniBand) or the GID index the transport would use (RoCE), and
    whether CHORUS_IB_HCA selects it; without a loadable library, the reason."""
    fake_dir = f"{REPO}/tests/fakeverbs"
    res = subprocess.run(["make", "-s", "-C", fake_dir], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    env = base_env(1, 0)
    for k in list(env):
        if k.startswith(("CHORUS_", "NCCL_", "FAKEVERBS_")):
            del env[k]
    env.update(CHORUS_IBVERBS_LIB=f"{fake_dir}/build/libfakeverbs.so",
               FAKEVERBS_DEVICES="fake0,fake1/roce", CHORUS_IB_HCA="^=fake1")
    res = run_info("--json", env=env)
    assert res.returncode == 0, res.stderr
    verbs = json.loads(res.stdout)["transports"]["verbs"]
    ports = {p["name"]: p for p in verbs["libibverbs"]["ports"]}
    assert sorted(ports) == ["fake0", "fake1"], verbs
    ib, roce = ports["fake0"], ports["fake1"]
    assert (ib["link_layer"], ib["width"], ib["rate_gbps"], ib["usable"]) == \
        ("InfiniBand", 4, 200.0, True), ib
    assert ib["lid"] > 0 and ib["gid_index"] == -1, ib
    assert (roce["link_layer"], roce["gid_index"], roce["usable"]) == ("RoCE", 2, False), roce
    assert "IB_HCA" in roce["why"], roce
    assert verbs["usable"] and verbs["compiled"], verbs
    from chorus.info import render
    text = render(json.loads(res.stdout))
    assert "fake0:1 InfiniBand, 4x 50 Gb/s = 200 Gb/s" in text, text

    env["CHORUS_IBVERBS_LIB"] = "/nonexistent/libibverbs.so.1"
    res = run_info("--json", env=env)
    assert res.returncode == 0, res.stderr
    lib = json.loads(res.stdout)["transports"]["verbs"]["libibverbs"]
    assert not lib["loadable"] and "/nonexistent/libibverbs.so.1" in lib["error"], lib
    assert lib["ports"] == [], lib
