"""The built extension uses the C++ runtime that torch loads, not a private static copy.

A g++ that ships only libstdc++.a (a GCC built into its own prefix, as on the GPU image) once
linked the runtime into chorus._C: its std::locale then kept facet ids of its own, and the
first TORCH_CHECK message that formatted an integer crashed the process (SIGSEGV in
std::ostream::_M_insert<long>) instead of raising. setup.py now links the shared library
torch has loaded when the compiler offers no shared one (_shared_cxx_runtime); this test
reads the symbols of whichever build is installed, here and in scripts/gpu_check.sh."""
import shutil
import subprocess

import chorus._C

# Defined only inside libstdc++ itself: a build that defines any of them carries a copy.
RUNTIME_SYMBOLS = {
    "_ZNSt6locale7classicEv",          # std::locale::classic()
    "_ZNSo9_M_insertIlEERSoT_",        # std::ostream::_M_insert<long>
    "_ZNSt8ios_base4InitC1Ev",         # std::ios_base::Init::Init()
}


def defined_symbols(path, dynamic):
    args = ["nm", "--defined-only"] + (["-D"] if dynamic else []) + [path]
    res = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return {line.split()[-1] for line in res.stdout.splitlines() if line.strip()}


def test_extension_links_the_shared_cxx_runtime():
    assert shutil.which("nm") and shutil.which("readelf"), "binutils (nm, readelf) are needed"
    so = chorus._C.__file__
    for dynamic in (False, True):
        copied = RUNTIME_SYMBOLS & defined_symbols(so, dynamic)
        assert not copied, f"{so} defines libstdc++'s own symbols {sorted(copied)}: a " \
            "private static copy of the C++ runtime (see setup.py, _shared_cxx_runtime)"
    needed = subprocess.run(["readelf", "-d", so], capture_output=True, text=True,
                            timeout=60).stdout
    assert "[libstdc++.so.6]" in needed, needed
