# setup.py - builds the chorus package: the C11 core as a static library (build_clib, C
# compiler and C flags) linked into one extension module chorus._C with the C++ binding
# (torch.utils.cpp_extension). Install with `pip install --no-build-isolation .`.
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CORE = os.path.join("csrc", "core")


def read_version():
    # The header is the single source of truth for the version.
    with open(os.path.join(ROOT, CORE, "include", "chorus.h")) as f:
        m = re.search(r'#define\s+CHORUS_VERSION_STRING\s+"([^"]+)"', f.read())
    if not m:
        raise RuntimeError("CHORUS_VERSION_STRING not found in csrc/core/include/chorus.h")
    return m.group(1)


def rel_glob(*patterns):
    # Relative, sorted paths: setuptools rejects absolute source paths in some modes, and a
    # stable order keeps rebuilds reproducible.
    out = []
    for p in patterns:
        out.extend(glob.glob(os.path.join(ROOT, p)))
    return sorted(os.path.relpath(p, ROOT) for p in out)


def want_cuda():
    if os.environ.get("FORCE_CUDA", "0") == "1":
        return True
    import torch

    return torch.version.cuda is not None and shutil.which("nvcc") is not None


CORE_SOURCES = rel_glob(f"{CORE}/*.c", f"{CORE}/algo/*.c", f"{CORE}/transport/*.c")
CORE_HEADERS = rel_glob(f"{CORE}/*.h", f"{CORE}/include/*.h", f"{CORE}/algo/*.h",
                        f"{CORE}/transport/*.h")
BINDING_SOURCES = rel_glob("csrc/bindings/*.cpp")
BINDING_HEADERS = rel_glob("csrc/bindings/*.hpp")
# CUDA kernels of the core, built by nvcc inside the extension.
CUDA_SOURCES = rel_glob(f"{CORE}/kernels/*.cu", "csrc/bindings/*.cu")

C_FLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE", "-pthread"]
# -fvisibility=hidden: what pybind11 expects of a module (else GCC 13 warns that the bound
# class is more visible than pybind11's internals). -Wno-unused-parameter: torch's headers.
# -g0: Python's own CFLAGS carry -g, and debug info for torch's headers made each binding file
# take 1.7x as long to compile (init.cpp 98 s -> 58 s on the 2-core machine); the C core keeps
# its -g. CHORUS_DEBUG_INFO=1 keeps -g for the binding too.
CXX_FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden"]
if os.environ.get("CHORUS_DEBUG_INFO", "0") != "1":
    CXX_FLAGS.append("-g0")
# No -std here: cpp_extension picks the standard the installed torch headers need
# (C++20 for torch >= 2.10); the binding itself sticks to C++17.
LINK_FLAGS = ["-pthread"]

# CHORUS_SANITIZE=1: core and binding built with AddressSanitizer + UndefinedBehaviorSanitizer
# (tools/asan_torch.sh builds such a copy into its own directory and runs multi-rank jobs
# with the runtime preloaded). vptr checks are off: they would need RTTI from torch's
# uninstrumented libraries. -O1 inlines differently and then gcc warns about the core's
# deliberate snprintf truncations, so that one warning is off (as in tests/c's asan build).
if os.environ.get("CHORUS_SANITIZE", "0") == "1":
    _SAN = ["-fsanitize=address,undefined", "-fno-sanitize=vptr", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer", "-g"]
    C_FLAGS = [f for f in C_FLAGS if f != "-O3"] + ["-O1", "-Wno-format-truncation"] + _SAN
    CXX_FLAGS = [f for f in CXX_FLAGS if f != "-O2"] + ["-O1"] + _SAN
    LINK_FLAGS = LINK_FLAGS + _SAN


def _build_clib_class():
    from setuptools.command.build_clib import build_clib

    class BuildClib(build_clib):
        # Compiles the core's .c files in parallel (MAX_JOBS) and skips objects newer than
        # their source and every core header; stock build_clib is serial and all-or-nothing.
        def build_libraries(self, libraries):
            from concurrent.futures import ThreadPoolExecutor

            jobs = max(1, int(os.environ.get("MAX_JOBS", os.cpu_count() or 1)))
            for lib_name, info in libraries:
                deps = info.get("obj_deps", {}).get("", [])
                newest_dep = max((os.path.getmtime(d) for d in deps), default=0.0)

                def compile_one(src, info=info, newest_dep=newest_dep):
                    obj = self.compiler.object_filenames([src], output_dir=self.build_temp)[0]
                    if os.path.exists(obj) and os.path.getmtime(obj) >= max(
                        os.path.getmtime(src), newest_dep
                    ):
                        return obj
                    return self.compiler.compile(
                        [src],
                        output_dir=self.build_temp,
                        macros=info.get("macros"),
                        include_dirs=info.get("include_dirs"),
                        extra_postargs=info.get("cflags"),
                        debug=self.debug,
                    )[0]

                with ThreadPoolExecutor(max_workers=jobs) as pool:
                    objects = list(pool.map(compile_one, info["sources"]))
                self.compiler.create_static_lib(
                    objects, lib_name, output_dir=self.build_clib, debug=self.debug
                )

    return BuildClib


def _loaded_libstdcxx():
    """Path of the libstdc++.so.6 this process (which imported torch) has mapped, or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so.6"):
                    return path
    except OSError:
        pass
    return None


def _shared_cxx_runtime(cxx):
    """Link flags that make the extension use the shared libstdc++ that torch loads when the
    C++ compiler only offers a static one (a GCC built into its own prefix, as on the GPU
    image: /opt/gcc's g++ has libstdc++.a alone). A static copy inside chorus._C keeps its own
    locale facet ids; a std::ostream from it then crashed formatting an integer (the first
    TORCH_CHECK message with a number, in the CUDA bad-arguments test). Named ahead of the
    compiler's own -lstdc++, the shared library defines every runtime symbol first."""

    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True,
                               text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    if os.path.isabs(found) and os.path.exists(found):
        return []  # the compiler links the shared runtime itself
    lib = _loaded_libstdcxx()
    if lib is None:
        print(f"chorus setup: warning: {cxx} has no shared libstdc++ and none is loaded here; "
              "the extension gets a private static copy", file=sys.stderr)
        return []
    print(f"chorus setup: {cxx} has no shared libstdc++: linking {lib} (the one torch loads)",
          file=sys.stderr)
    return [f"-L{os.path.dirname(lib)}", f"-l:{os.path.basename(lib)}"]


def _build_ext_class(base):
    class BuildExt(base):
        # `build` runs build_clib before build_ext, but `build_ext --inplace` and editable
        # installs may not: make sure the core library exists before linking it.
        def run(self):
            if self.distribution.has_c_libraries():
                self.run_command("build_clib")
            super().run()

        def build_extension(self, ext):
            ext.extra_link_args = list(ext.extra_link_args or []) + _shared_cxx_runtime(
                self.compiler.compiler_cxx[0])
            super().build_extension(ext)

    return BuildExt


def build():
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    use_cuda = want_cuda()
    include_dirs = [os.path.join(ROOT, CORE, "include"), os.path.join(ROOT, CORE)]
    core_includes = [os.path.join(CORE, "include"), CORE]
    sources = list(BINDING_SOURCES)
    macros = []
    extra = {"cxx": list(CXX_FLAGS)}
    if use_cuda:
        sources += CUDA_SOURCES
        macros.append(("CHORUS_WITH_CUDA", "1"))
        # Hopper machine code plus PTX (a newer GPU compiles it at load); CHORUS_CUDA_ARCH
        # overrides, e.g. "80;90".
        archs = os.environ.get("CHORUS_CUDA_ARCH", "90").replace(",", ";").split(";")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        extra["nvcc"] = ["-O3", "-std=c++17"] + gencode
        ext_cls = CUDAExtension
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME:
            core_includes.append(os.path.join(CUDA_HOME, "include"))
    else:
        ext_cls = CppExtension

    ext = ext_cls(
        name="chorus._C",
        sources=sources,
        include_dirs=include_dirs,
        define_macros=macros,
        extra_compile_args=extra,
        libraries=["m"],
        extra_link_args=LINK_FLAGS,
        depends=BINDING_HEADERS + CORE_HEADERS,
    )

    # The C core goes through build_clib so that it is compiled by the C compiler with C
    # flags only (cpp_extension would hand its C++ flags to .c files). build_ext then
    # links libchorus_core.a into chorus._C. -fPIC comes from Python's CCSHARED.
    core_lib = (
        "chorus_core",
        {
            "sources": CORE_SOURCES,
            "include_dirs": core_includes,
            "cflags": C_FLAGS + (["-DCHORUS_WITH_CUDA=1"] if use_cuda else []),
            "obj_deps": {"": CORE_HEADERS},
        },
    )

    setup(
        name="chorus",
        version=read_version(),
        package_dir={"": "python"},
        packages=["chorus"],
        libraries=[core_lib] if CORE_SOURCES else [],
        ext_modules=[ext],
        cmdclass={"build_clib": _build_clib_class(), "build_ext": _build_ext_class(BuildExtension)},
        zip_safe=False,
    )


if __name__ == "__main__":
    build()
