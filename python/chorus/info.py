"""python -m chorus.info [--json]: what this Chorus build can do here. Version and build
features (CUDA, verbs), the transports usable on this machine (shared memory, sockets on
the interfaces CHORUS_SOCKET_IFNAME selects, InfiniBand verbs), the topology (CPUs, NUMA
nodes, GPUs and their peer access, network interfaces, InfiniBand devices) and every
parameter in force with its source (CHORUS_ variable, NCCL_ variable, or the default).

Detection only reads /sys, /proc and /dev/shm, and asks libibverbs (CHORUS_IBVERBS_LIB,
through the verbs transport's own loader) for its devices and ports: link layer, lanes and
rate, the LID or the GID the transport would use, and whether CHORUS_IB_HCA selects each.
It opens no connection and needs no process group."""
import argparse
import glob
import json
import os
import socket
import sys


def _read(path, default=None):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _cpulist_len(text):
    n = 0
    for part in (text or "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


# ------------------------------------------------------------------ interface selection
def ifname_matches(spec, name):
    """CHORUS_SOCKET_IFNAME's syntax (the socket transport's rule): comma list of name
    prefixes; leading ^ selects the names not listed; leading = (after any ^) compares whole
    names. Empty selects every name."""
    spec = (spec or "").strip()
    exclude = spec.startswith("^")
    if exclude:
        spec = spec[1:]
    exact = spec.startswith("=")
    if exact:
        spec = spec[1:]
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        return True
    hit = any(name == s if exact else name.startswith(s) for s in items)
    return not hit if exclude else hit


def _ipv4_of(name):
    try:
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name.encode()[:15]))
            return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def nics():
    out = []
    for path in sorted(glob.glob("/sys/class/net/*")):
        name = os.path.basename(path)
        speed = _read(f"{path}/speed")  # EINVAL on links that are down or virtual
        try:
            speed = int(speed) if speed is not None and int(speed) > 0 else None
        except ValueError:
            speed = None
        out.append(dict(
            name=name, state=_read(f"{path}/operstate", "unknown"),
            speed_mbps=speed, mtu=int(_read(f"{path}/mtu", "0") or 0),
            loopback=name == "lo" or _read(f"{path}/type") == "772",
            virtual=not os.path.exists(f"{path}/device"), ipv4=_ipv4_of(name)))
    return out


# ------------------------------------------------------------------ InfiniBand
def ib_devices_sysfs():
    out = []
    for path in sorted(glob.glob("/sys/class/infiniband/*")):
        ports = []
        for p in sorted(glob.glob(f"{path}/ports/*")):
            ports.append(dict(port=int(os.path.basename(p)), state=_read(f"{p}/state"),
                              rate=_read(f"{p}/rate"), link_layer=_read(f"{p}/link_layer")))
        out.append(dict(name=os.path.basename(path), node_type=_read(f"{path}/node_type"),
                        ports=ports))
    return out


def verbs_library(params):
    """Whether libibverbs (CHORUS_IBVERBS_LIB) loads here, and its ports as the verbs
    transport sees them (link layer, lanes and rate, LID or the GID it would use, whether
    CHORUS_IB_HCA selects them)."""
    from . import _C
    got = _C.verbs_nics()
    return dict(loadable=got["loadable"], library=params["IBVERBS_LIB"]["value"],
                error=got["error"], devices=sorted({n["name"] for n in got["nics"]}),
                ports=got["nics"])


# ------------------------------------------------------------------ topology
def numa_nodes():
    out = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*"),
                       key=lambda p: int(p.rsplit("node", 1)[1])):
        cpus = _read(f"{path}/cpulist", "")
        mem_kb = None
        for line in (_read(f"{path}/meminfo", "") or "").splitlines():
            if "MemTotal:" in line:
                mem_kb = int(line.split()[-2])
        out.append(dict(node=int(path.rsplit("node", 1)[1]), cpus=cpus,
                        ncpus=_cpulist_len(cpus), mem_gib=round(mem_kb / 2**20, 1) if mem_kb else None))
    return out


def gpus():
    try:
        import torch
    except ImportError:
        return dict(available=False, reason="torch is not importable", devices=[])
    if not torch.cuda.is_available():
        why = "torch is a CPU build" if torch.version.cuda is None else "no CUDA device visible"
        return dict(available=False, reason=why, devices=[])
    n = torch.cuda.device_count()
    devices = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        peers = [j for j in range(n) if j != i and torch.cuda.can_device_access_peer(i, j)]
        devices.append(dict(index=i, name=p.name, mem_gib=round(p.total_memory / 2**30, 1),
                            capability=f"{p.major}.{p.minor}", peer_access=peers,
                            pci_bus_id=getattr(p, "pci_bus_id", None)))
    return dict(available=True, reason=None, devices=devices)


# ------------------------------------------------------------------ transports
def shm_status(params):
    path = "/dev/shm"
    disabled = params.get("SHM_DISABLE", {}).get("value") in ("1", "true", "yes", "on")
    st = dict(path=path, exists=os.path.isdir(path), writable=os.access(path, os.W_OK),
              free_bytes=None, disabled_by_param=disabled)
    if st["exists"]:
        v = os.statvfs(path)
        st["free_bytes"] = v.f_bavail * v.f_frsize
    st["usable"] = st["exists"] and st["writable"] and not disabled and bool(st["free_bytes"])
    return st


def socket_status(params, nic_list):
    spec = params.get("SOCKET_IFNAME", {}).get("value", "")
    up = [n for n in nic_list if n["state"] in ("up", "unknown") and n["ipv4"]]
    if spec:
        chosen = [n["name"] for n in up if ifname_matches(spec, n["name"])]
    else:  # the transport's default: the first interface that is up and not loopback
        chosen = [n["name"] for n in up if not n["loopback"]][:1]
    return dict(ifname=spec, interfaces=chosen, usable=bool(chosen),
                note=None if chosen else "no interface matches: only same-host ranks over shm "
                "(or loopback with CHORUS_SOCKET_IFNAME==lo) can connect")


def collect():
    from . import _C, __version__
    import torch
    params = {p["name"]: p for p in _C.params()}
    nic_list = nics()
    verbs_compiled = bool(_C.verbs_built())
    lib = verbs_library(params)
    ib = ib_devices_sysfs()
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return dict(
        version=dict(chorus=__version__, core=_C.version(), torch=torch.__version__,
                     python=sys.version.split()[0]),
        build=dict(cuda=bool(_C.cuda_built()), verbs=verbs_compiled),
        transports=dict(
            shm=shm_status(params),
            socket=socket_status(params, nic_list),
            verbs=dict(compiled=verbs_compiled, libibverbs=lib, sysfs_devices=[d["name"] for d in ib],
                       usable=verbs_compiled and any(p["usable"] for p in lib["ports"]))),
        topology=dict(host=socket.gethostname(), cpus=os.cpu_count(), cpus_usable=affinity,
                      numa=numa_nodes(), gpus=gpus(), nics=nic_list, infiniband=ib),
        params=[dict(env=p["env"], value=p["value"], source=p["source"] or "default",
                     default=p["default"], nccl_env=p["nccl_env"]) for p in params.values()],
    )


def _gib(n):
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def render(info):
    v, b, t, topo = info["version"], info["build"], info["transports"], info["topology"]
    out = [f"chorus {v['chorus']} (core {v['core']}), torch {v['torch']}, python {v['python']}",
           f"build: CUDA {'yes' if b['cuda'] else 'no'}, verbs {'yes' if b['verbs'] else 'no'}",
           "", "transports:"]
    s = t["shm"]
    out.append(f"  shm     {'usable' if s['usable'] else 'NOT usable'}: {s['path']} "
               f"{'writable' if s['writable'] else 'not writable'}, {_gib(s['free_bytes'])} free"
               + (" (disabled by CHORUS_SHM_DISABLE)" if s["disabled_by_param"] else ""))
    k = t["socket"]
    out.append(f"  socket  {'usable' if k['usable'] else 'NOT usable'}: "
               f"CHORUS_SOCKET_IFNAME={k['ifname'] or '(empty: first non-loopback up)'} -> "
               f"{', '.join(k['interfaces']) or 'none'}")
    vb = t["verbs"]
    lib = vb["libibverbs"]
    out.append(f"  verbs   {'usable' if vb['usable'] else 'NOT usable'}: transport "
               f"{'compiled' if vb['compiled'] else 'not in this build'}; libibverbs "
               + (f"loadable ({lib['library']}), devices: {', '.join(lib['devices']) or 'none'}"
                  if lib["loadable"] else f"not loadable ({lib['error']})"))
    for p in lib["ports"]:
        rate = (f"{p['width']}x {p['lane_gbps']:g} Gb/s = {p['rate_gbps']:g} Gb/s"
                if p["rate_gbps"] else "rate unknown")
        addr = (f"GID index {p['gid_index']}" if p["link_layer"] == "RoCE" else f"LID {p['lid']}")
        out.append(f"          {p['name']}:{p['port']} {p['link_layer']}, {rate}, {addr}: "
                   + ("usable" if p["usable"] else f"not used ({p['why']})"))
    out += ["", f"topology: host {topo['host']}, {topo['cpus']} CPUs ({topo['cpus_usable']} usable "
            f"by this process)"]
    for n in topo["numa"]:
        out.append(f"  NUMA node {n['node']}: CPUs {n['cpus']} ({n['ncpus']}), {n['mem_gib']} GiB")
    g = topo["gpus"]
    if not g["available"]:
        out.append(f"  GPUs: none ({g['reason']})")
    for d in g["devices"]:
        out.append(f"  GPU {d['index']}: {d['name']} {d['mem_gib']} GiB, sm {d['capability']}, "
                   f"peer access to {d['peer_access'] or 'none'}")
    for n in topo["nics"]:
        speed = f"{n['speed_mbps']} Mb/s" if n["speed_mbps"] else "speed n/a"
        out.append(f"  NIC {n['name']}: {n['state']}, {speed}, mtu {n['mtu']}, "
                   f"{n['ipv4'] or 'no IPv4'}{' (loopback)' if n['loopback'] else ''}"
                   f"{' (virtual)' if n['virtual'] and not n['loopback'] else ''}")
    if not topo["infiniband"]:
        out.append("  InfiniBand: no device in /sys/class/infiniband")
    for d in topo["infiniband"]:
        ports = "; ".join(f"port {p['port']} {p['state']} {p['rate']} {p['link_layer']}"
                          for p in d["ports"])
        out.append(f"  IB {d['name']}: {ports}")
    out += ["", "parameters (value in force, source):"]
    width = max(len(p["env"]) for p in info["params"])
    for p in info["params"]:
        out.append(f"  {p['env']:<{width}}  {p['value']!r:<14} {p['source']}")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m chorus.info", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=1) if args.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
