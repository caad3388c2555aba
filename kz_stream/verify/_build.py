"""CUDA builds for ``load_inline`` candidates: parallel CPU compiles ahead of the GPU stage,
a content-addressed cache, and a faster translation unit than ``load_inline`` builds.

``load_inline`` compiles two translation units, a pybind ``main.cpp`` (all of
``torch/extension.h``) and ``cuda.cu`` (usually ``torch/extension.h`` again), each parsing
the torch headers two or three times (host preprocess, ``cudafe++``, ``cicc``, host
``gcc``). The fast layout builds one ``.cu`` instead:

- the user's functions are registered with ``TORCH_LIBRARY`` (``torch/library.h``, far
  lighter than pybind and ``torch/extension.h``), through generated wrappers that widen
  ``int``/``float`` parameters to the ``int64_t``/``double`` an operator schema needs;
  the worker hands the candidate an object whose attributes call ``torch.ops``;
- ``torch/extension.h`` becomes ``torch/types.h`` when the source uses no pybind;
- the torch headers and the host-only functions are hidden from the device pass
  (``#ifndef __CUDA_ARCH__``), so ``cicc`` parses the kernels only. Template kernels,
  which the hidden host code would instantiate, are instantiated by a generated reference
  to each instance the host code names (``scalar_t`` of AT_DISPATCH_FLOATING_TYPES
  expanded); not done when an instance cannot be named so, or device code names torch.

Any step that does not apply falls back to the next layout, and a failed fast build is
retried as the plain ``load_inline`` layout, whose errors are the ones reported.
"""


from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path
from typing import Literal, cast

from kz_stream._cpus import usable_cpus
from kz_stream.verify import _lifeline as lifeline
from kz_stream.verify._extract import InlineCall
from kz_stream.verify._messages import BuildManifest
from kz_stream.verify._rewrite import (
    hide_host_code,
    signatures,
    wrapper,
)
from kz_stream.verify._sandbox import kill_group
from kz_stream.verify._types import VERIFIER_VERSION

__all__ = ["BuildResult", "Builder", "Toolchain"]

Layout = Literal["fast", "single", "load_inline"]

_STUB_HEADER = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"
_LOG_TAIL = 6000



@dataclass(frozen=True)
class Toolchain:
    """Compiler, headers and flags for building against the installed torch."""

    nvcc: str
    nvcc_version: str
    cxx: str
    torch_version: str
    include_dirs: tuple[str, ...]
    lib_dirs: tuple[str, ...]
    arch: str  # e.g. "90"
    std: str
    cxx11_abi: bool
    has_cuda_torch: bool

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    @staticmethod
    @cache
    def detect(arch: str | None = None) -> Toolchain:
        """Finds nvcc and the torch headers; ``arch`` defaults to the visible GPU's, or 90."""
        import inspect

        import torch
        import torch.utils.cpp_extension as cpp_ext

        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        cuda_home = (os.environ.get("CUDA_HOME") or cpp_ext.CUDA_HOME
                     or ("/usr/local/cuda" if os.path.isdir("/usr/local/cuda/include") else None)
                     or str(Path(os.path.realpath(nvcc)).parent.parent))
        try:
            ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.strip().splitlines()[-1]
        except (OSError, subprocess.SubprocessError, IndexError):
            ver = "unknown"
        has_cuda = bool(torch.version.cuda)
        incs = list(cpp_ext.include_paths("cuda" if has_cuda and cpp_ext.CUDA_HOME else "cpu"))
        cuda_inc = os.path.join(cuda_home, "include")
        if cuda_inc not in incs:
            incs.append(cuda_inc)
        py_inc = sysconfig.get_path("include", scheme="posix_prefix")
        if py_inc:
            incs.append(py_inc)
        libs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
        for sub in ("lib64", "lib"):
            d = os.path.join(cuda_home, sub)
            if os.path.isdir(d):
                libs.append(d)
                break
        if arch is None:
            arch = "90"
            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                arch = f"{major}{minor}"
        src = inspect.getsource(cpp_ext._write_ninja_file_to_build_library)
        std = "c++20" if "-std=c++20" in src else "c++17"
        return Toolchain(
            nvcc=nvcc, nvcc_version=ver, cxx=os.environ.get("CXX", "g++"),
            torch_version=torch.__version__, include_dirs=tuple(incs), lib_dirs=tuple(libs),
            arch=arch, std=std, cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
            has_cuda_torch=has_cuda,
        )


# ---- building ----------------------------------------------------------------------------


@dataclass
class BuildResult:
    """One ``load_inline`` call built (or compile-checked)."""

    ok: bool
    call: InlineCall
    layout: Layout | None = None
    path: str | None = None  # shared library (None when only compile-checked)
    namespace: str | None = None  # TORCH_LIBRARY namespace for the "fast"/"single" layouts
    functions: tuple[str, ...] = ()
    log: str = ""
    seconds: float = 0.0
    cache_hit: bool = False
    attempts: list[str] = field(default_factory=list)

    def manifest(self) -> BuildManifest:
        """What a worker needs to hand the candidate this build instead of compiling."""
        return {"key": self.call.key, "name": self.call.name, "layout": self.layout,
                "path": self.path, "namespace": self.namespace,
                "functions": list(self.functions), "mod_name": self.call.module_name}


@dataclass
class _SharedBuild:
    """A build in flight and how many callers wait for it."""

    task: asyncio.Task[BuildResult]
    waiters: int = 0


class Builder:
    """Builds ``load_inline`` calls with at most ``jobs`` compilers at once.

    ``link=False`` only compiles (the CPU-only compile check). The cache directory is
    content-addressed: the key hashes the translation unit, flags and toolchain.
    """

    def __init__(self, cache_dir: str | os.PathLike[str] | None = None, *, jobs: int | None = None,
                 toolchain: Toolchain | None = None, link: bool = True,
                 timeout_s: float = 600.0, fast: bool = True) -> None:
        self.cache_dir = Path(cache_dir or os.path.join(tempfile.gettempdir(), "kz-build-cache"))
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.toolchain = toolchain or Toolchain.detect()
        self.link = link
        self.timeout_s = timeout_s
        self.fast = fast
        self._sem = asyncio.Semaphore(jobs or usable_cpus())
        self._inflight: dict[str, _SharedBuild] = {}
        stub = self.cache_dir / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "cuda_cmake_macros.h").write_text(_STUB_HEADER)
        self._stub_dir = str(self.cache_dir / "stub")

    # -- flags

    def _common(self, name: str) -> list[str]:
        tc = self.toolchain
        flags = [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                 f"-D_GLIBCXX_USE_CXX11_ABI={int(tc.cxx11_abi)}"]
        if not tc.has_cuda_torch:
            flags += ["-I", self._stub_dir]  # the CPU wheel lacks this generated header
        for d in tc.include_dirs:
            flags += ["-isystem", d]
        return flags

    def _nvcc_flags(self, call: InlineCall, name: str) -> list[str]:
        tc = self.toolchain
        flags = self._common(name) + [f"-I{os.path.abspath(p)}" for p in call.extra_include_paths]
        flags += ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                  "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
                  "--expt-relaxed-constexpr",
                  f"-gencode=arch=compute_{tc.arch},code=sm_{tc.arch}",
                  "--compiler-options", "-fPIC"]
        if self.fast:
            # Host code only launches kernels: skip optimising the torch headers' inline
            # code (a user's own -O flag, later on the line, still wins).
            flags += ["-Xcompiler", "-O0"]
        flags += [f for f in call.extra_cuda_cflags if f.strip()]
        if not any(f.startswith("-std=") for f in flags):
            flags.append(f"-std={tc.std}")
        return flags

    def _cxx_flags(self, call: InlineCall, name: str) -> list[str]:
        flags = self._common(name) + [f"-I{os.path.abspath(p)}" for p in call.extra_include_paths]
        flags += ["-fPIC", f"-std={self.toolchain.std}", "-O2"]
        return flags + [f for f in call.extra_cflags if f.strip()]

    def _ld_flags(self, call: InlineCall, python: bool) -> list[str]:
        flags = ["-shared"]
        for d in self.toolchain.lib_dirs:
            flags += [f"-L{d}", f"-Wl,-rpath,{d}"]
        flags += ["-lc10", "-ltorch_cpu", "-ltorch"]
        if self.toolchain.has_cuda_torch:
            flags += ["-lc10_cuda", "-ltorch_cuda"]
        if python:
            flags.append("-ltorch_python")
        flags.append("-lcudart")
        return flags + [f for f in call.extra_ldflags if f.strip()]

    # -- translation units

    def _fast_unit(self, call: InlineCall, hide: bool) -> tuple[str, str, tuple[int, int]] | None:
        """(source, namespace, first and last line of the user's code) of the single-TU
        layout, or None if it does not apply."""
        user = "\n".join(call.cuda_sources)
        if not call.functions or re.search(r"\b(pybind11|PYBIND11_\w+|py::)", user):
            return None
        sigs = signatures(call)
        if sigs is None:
            return None
        wrappers = []
        for fn, (ret, params) in sigs.items():
            w = wrapper(fn, ret, params)
            if w is None:
                return None
            wrappers.append(w)
        user = re.sub(r"#\s*include\s*<torch/extension\.h>", "#include <torch/types.h>", user)
        # Declarations from cpp_sources may be needed if the cuda source lacks them.
        decls = "\n".join(s for s in call.cpp_sources
                          if not re.search(r"PYBIND11|py::", s))
        decls = re.sub(r"#\s*include\s*<torch/extension\.h>", "#include <torch/types.h>", decls)
        if hide:
            hidden = hide_host_code(user)
            if hidden is None:
                return None
            user = hidden
        body_key = hashlib.sha256((user + decls + "".join(wrappers)).encode()).hexdigest()
        ns = f"kz_{body_key[:16]}"
        reg = "\n".join(f'  m.def("{fn}", &__kz_wrap_{fn});' for fn in sigs)
        guard_open, guard_close = ("#ifndef __CUDA_ARCH__\n", "#endif\n") if hide else ("", "")
        prologue = (f"{guard_open}#include <torch/types.h>\n{guard_close}"
                    "#include <cuda.h>\n#include <cuda_runtime.h>\n")
        first = prologue.count("\n") + 1
        span = (first, first + user.count("\n"))
        text = (
            f"{prologue}{user}\n{guard_open}{decls}\n#include <torch/library.h>\n"
            + "\n".join(wrappers)
            + f"\nTORCH_LIBRARY({ns}, m) {{\n{reg}\n}}\n{guard_close}"
        )
        return text, ns, span

    def _inline_units(self, call: InlineCall) -> tuple[str, str]:
        """The ``main.cpp`` and ``cuda.cu`` that ``load_inline`` itself would write."""
        cpp = ["#include <torch/extension.h>", *call.cpp_sources]
        if call.functions:
            cpp.append("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {")
            cpp += [f'm.def("{f}", torch::wrap_pybind_function({f}), "{f}");'
                    for f in call.functions]
            cpp.append("}")
        cu = ["#include <torch/types.h>", "#include <cuda.h>", "#include <cuda_runtime.h>",
              *call.cuda_sources]
        return "\n".join(cpp), "\n".join(cu)

    # -- running the compilers

    async def _run(self, cmd: list[str], cwd: str) -> tuple[bool, str]:
        async with self._sem:
            # The wrapper kills the compiler's group (nvcc's cicc and ptxas, ninja's jobs)
            # when ``keep``, held by this process alone, closes: at the latest when it exits.
            watch, keep = os.pipe()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *lifeline.wrap(cmd, watch), cwd=cwd, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                    pass_fds=(watch,))
            except BaseException:
                os.close(keep)
                raise
            finally:
                os.close(watch)
            lifeline.track(proc.pid)
            try:
                out, _ = await asyncio.wait_for(proc.communicate(), self.timeout_s)
            except TimeoutError:
                kill_group(proc.pid)
                await proc.wait()
                return False, f"compiler timed out after {self.timeout_s:g} s: {shlex.join(cmd)}"
            except asyncio.CancelledError:
                kill_group(proc.pid)  # no one waits for this build: leave no compiler behind
                await proc.wait()
                raise
            finally:
                os.close(keep)
                lifeline.untrack(proc.pid)
        text = out.decode(errors="replace")
        return proc.returncode == 0, text

    async def build(self, call: InlineCall) -> BuildResult:
        """Builds (or compile-checks) one call; identical calls in flight share one build."""
        key = hashlib.sha256(
            f"{call.key}{self.toolchain.fingerprint}{self.link}{self.fast}{VERIFIER_VERSION}"
            .encode()).hexdigest()
        shared = self._inflight.get(key)
        if shared is None:
            # A task of its own, not the first caller's: one caller cancelled (its consumer
            # shutting down) must not cancel the build the others wait for.
            shared = self._inflight[key] = _SharedBuild(
                asyncio.ensure_future(self._build(call, key)))
            shared.task.add_done_callback(partial(self._build_done, key))
        shared.waiters += 1
        try:
            return await asyncio.shield(shared.task)
        finally:
            shared.waiters -= 1
            if not shared.waiters:
                shared.task.cancel()  # no one waits for it any more (no-op once done)

    def _build_done(self, key: str, task: asyncio.Task[BuildResult]) -> None:
        self._inflight.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: a build's error reaches its callers, not the log

    async def _build(self, call: InlineCall, key: str) -> BuildResult:
        started = time.monotonic()
        entry = self.cache_dir / key
        done = entry / "result.txt"
        if done.exists():
            c_layout, c_ns, c_path = [*done.read_text().split("\n"), "", "", ""][:3]
            return BuildResult(True, call, cast(Layout, c_layout), c_path or None,
                               c_ns or None, call.functions, "", time.monotonic() - started, True)
        work = Path(tempfile.mkdtemp(prefix="kzb-", dir=self.cache_dir))
        attempts: list[str] = []
        log = ""
        try:
            plans: list[tuple[Layout, bool]] = []
            if self.fast:
                plans += [("fast", True), ("single", False)]
            plans.append(("load_inline", False))
            for layout, hide in plans:
                if layout == "load_inline":
                    ok, log, path, ns = await self._build_inline(call, work)
                else:
                    unit = self._fast_unit(call, hide)
                    if unit is None:
                        continue
                    text, ns_name, span = unit
                    ok, log, path, ns = await self._build_single(call, work, text, ns_name)
                attempts.append(f"{layout}:{'ok' if ok else 'failed'}")
                if ok:
                    entry.mkdir(exist_ok=True)
                    final = None
                    if path is not None:
                        final = str(entry / os.path.basename(path))
                        shutil.move(path, final)
                    tmp = done.with_suffix(f".tmp-{os.getpid()}")
                    tmp.write_text(f"{layout}\n{ns or ''}\n{final or ''}")
                    os.replace(tmp, done)  # another builder sharing the cache reads it whole
                    return BuildResult(True, call, layout, final, ns, call.functions, log,
                                       time.monotonic() - started, False, attempts)
                if layout == "single" and _errors_within(log, span):
                    break  # the user's own code fails to compile: skip the slow retry
            return BuildResult(False, call, None, None, None, call.functions,
                               log[-_LOG_TAIL:], time.monotonic() - started, False, attempts)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def _build_single(self, call: InlineCall, work: Path, text: str, ns: str
                            ) -> tuple[bool, str, str | None, str | None]:
        cu = work / f"{ns}.cu"
        cu.write_text(text)
        obj = work / f"{ns}.o"
        ok, log = await self._run([self.toolchain.nvcc, *self._nvcc_flags(call, ns), "-c",
                                   str(cu), "-o", str(obj)], str(work))
        if not ok or not self.link:
            return ok, log, None, ns
        so = work / f"{ns}.so"
        ok, log2 = await self._run([self.toolchain.cxx, str(obj), *self._ld_flags(call, False),
                                    "-o", str(so)], str(work))
        return ok, log + log2, str(so), ns

    async def _build_inline(self, call: InlineCall, work: Path
                            ) -> tuple[bool, str, str | None, str | None]:
        name = call.module_name
        main_src, cu_src = self._inline_units(call)
        (work / "main.cpp").write_text(main_src)
        jobs = [self._run([self.toolchain.cxx, *self._cxx_flags(call, name), "-c", "main.cpp",
                           "-o", "main.o"], str(work))]
        objs = ["main.o"]
        if call.cuda_sources:
            (work / "cuda.cu").write_text(cu_src)
            jobs.append(self._run([self.toolchain.nvcc, *self._nvcc_flags(call, name), "-c",
                                   "cuda.cu", "-o", "cuda.cuda.o"], str(work)))
            objs.append("cuda.cuda.o")
        results = await asyncio.gather(*jobs)
        log = "".join(r[1] for r in results)
        if not all(r[0] for r in results) or not self.link:
            return all(r[0] for r in results), log, None, None
        so = work / f"{name}.so"
        ok, log2 = await self._run([self.toolchain.cxx, *objs, *self._ld_flags(call, True),
                                    "-o", str(so)], str(work))
        return ok, log + log2, str(so), None


_ERROR_LINE = re.compile(r"\((\d+)\): (?:catastrophic )?error")


def _errors_within(log: str, span: tuple[int, int]) -> bool:
    """Whether every compiler error in ``log`` points at a line of the user's code."""
    lines = [int(m.group(1)) for m in _ERROR_LINE.finditer(log)]
    return bool(lines) and all(span[0] <= n <= span[1] for n in lines)

