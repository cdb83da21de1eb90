"""A function compiled once per shape class and kept on disk, so that a restart skips Dynamo.

`torch.compile` traces a function's bytecode again in every process (Dynamo), even when Inductor's cache
then hands back the compiled kernels: for the DiT block ~4 s per shape class, six classes, ~24 s of an
H100 restart (docs/benchmarks.md, fifteenth session). `PrecompiledFunction` compiles each class it meets
with Dynamo's ahead-of-time API (`aot_compile`: one whole graph and the guards that say which inputs it
serves), saves it in a folder, and a later process loads every saved variant and calls the one whose
guards accept the inputs: no tracing at all.

The folder's name must change with anything the saved graphs bake in (the source of the compiled code,
the model's sizes, dtype, torch, Triton, Python, the GPU): `variant_folder` hashes the modules' source,
the keys it is given, the GPU model and the versions.
Variants are loaded and called in the autograd mode their guards were built in, inference mode for
the token2wav engines (a guard checks each tensor's dispatch keys, which differ between inference
tensors and others); the guards
also check the process's global torch state (grad mode, CPU threads, ...), so a process set up otherwise
compiles its own variants beside the others. `seal` ends compiling: a class met later runs the plain
function (uncompiled), logged once, as `torch.compile` does under the service's "eager_on_recompile"
stance.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import platform
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.fx.experimental._config as fx_config

from engines.compilation import device_name
from engines.exclusive import EXCLUSIVE
from engines.files import sweep_aside, write_whole

logger = logging.getLogger(__name__)

SUFFIX = ".aot"
# A variant file still being written aside after this long was left by a writer killed mid-write (a
# compile worker stopped at its deadline, say): swept when a function opens the folder.
ASIDE_MAX_AGE_S = 3600.0


def variant_folder(root: Path, name: str, modules: Iterable[ModuleType], keys: Iterable[str],
                   device: torch.device | None = None) -> Path | None:
    """`root`/`name`-<hash>: one folder per combination of what the compiled code depends on: the source
    of `modules`, `keys` (sizes, dtype), the GPU model of `device`, the versions of torch, Triton and
    Python, and Inductor's settings that change the generated kernels' launches (programmatic dependent
    launch, `TORCHINDUCTOR_ENABLE_PDL`). None (logged) when a module's source is not installed: nothing
    then tells a changed module from the saved one."""
    try:
        sources = [inspect.getsource(module) for module in modules]
    except OSError:
        logger.warning("%s: source not installed; compiled in each process instead", name)
        return None
    target = "any" if device is None else device_name(device)
    stack = (target, torch.__version__, _version_of("triton"), platform.python_version(), _inductor_launch())
    digest = hashlib.sha256("\0".join([*sources, *keys, *stack]).encode()).hexdigest()[:16]
    return root / f"{name}-{digest}"


def _inductor_launch() -> str:
    import torch._inductor.config as inductor_config

    return f"pdl={getattr(inductor_config.triton, 'enable_pdl', False)}"


def _version_of(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def likely_supported() -> bool:
    """`supported`'s first test, without importing Dynamo (seconds of a cold start): for choices made
    before it is imported; `supported` decides."""
    return hasattr(torch.compiler, "load_compiled_function")


def supported() -> bool:
    """Whether this torch has Dynamo's ahead-of-time compile, its loader, and the guard calls used here."""
    if not likely_supported():
        return False
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction
    except ImportError:
        return False
    return all(hasattr(AOTCompiledFunction, name)
               for name in ("guard_check", "disable_guard_check", "serialize"))


def saved_variants(folder: Path) -> list[Path]:
    """The variant files saved in `folder` (none when it does not exist), in a fixed order."""
    return sorted(folder.glob(f"*{SUFFIX}")) if folder.is_dir() else []


def compile_kept(fn: Callable[..., Any], root: Path | None, name: str, modules: Iterable[ModuleType],
                 device: torch.device | None, inference: bool,
                 size_oblivious: bool = False) -> Callable[..., Any]:
    """`fn` through `torch.compile` (dynamic shapes, one graph), kept per shape class in the folder
    `variant_folder(root, name, modules, (), device)` names (`PrecompiledFunction`, with `inference` and
    `size_oblivious` as there); the plain `torch.compile` when `root` is None or this torch cannot keep
    it."""
    jit = torch.compile(fn, dynamic=True, fullgraph=True)
    if root is None or not supported():
        return TracedInProcess(jit)
    keys = ("size-oblivious",) if size_oblivious else ()
    folder = variant_folder(root, name, modules, keys, device)
    return TracedInProcess(jit) if folder is None else PrecompiledFunction(
        fn, folder, jit, inference=inference, size_oblivious=size_oblivious)


def seal_kept(*functions: Callable[..., Any]) -> None:
    """`seal` those of `functions` that `compile_kept` made (`PrecompiledFunction`, `TracedInProcess`)."""
    for function in functions:
        if isinstance(function, PrecompiledFunction | TracedInProcess):
            function.seal()


class TracedInProcess:
    """A `torch.compile`d function whose shape classes are not kept (no folder, or a torch without the
    ahead-of-time API): a call may trace, so calls hold engines/exclusive.py's lock until `seal` (after
    the warm-up, under the service's "eager_on_recompile" stance, nothing traces)."""

    def __init__(self, jit: Callable[..., Any]) -> None:
        self.jit = jit
        self._sealed = False

    def seal(self) -> None:
        self._sealed = True

    def __call__(self, *args: Any) -> Any:
        if self._sealed:
            return self.jit(*args)
        with EXCLUSIVE:
            return self.jit(*args)


class PrecompiledFunction:
    """`fn` (positional arguments only) through per-class ahead-of-time compiled variants kept in
    `folder`. `jit`: `fn` through `torch.compile` with the same settings, which serves instead if an
    ahead-of-time compile fails (today's behaviour, one trace per class in each process). `dynamic`,
    `specialize_float` and `duck_shape` are the compile's settings (as for `torch.compile`, Dynamo's
    `specialize_float`, and the FX shape config's `use_duck_shape`). `size_oblivious`: sizes of 1 are
    not special (the FX shape config's `backed_size_oblivious`): one class serves a row or a step of one
    position and many, for functions whose inputs never broadcast a size-1 axis against a larger one
    (row-wise ones over the last axis). `inference`: the calls come with
    inference tensors (the token2wav engines'), so variants are loaded and called in inference mode;
    False for callers under `torch.no_grad()` with ordinary tensors (the LLM's). Called from one thread at
    a time (each engine's are); the variants' order changes as calls come. `inductor`: Inductor settings
    (`torch._inductor.config` names) the compiles run under; the variants bake them in."""

    def __init__(self, fn: Callable[..., Any], folder: Path, jit: Callable[..., Any], dynamic: bool = True,
                 specialize_float: bool = True, duck_shape: bool = False, inference: bool = True,
                 size_oblivious: bool = False, inductor: Mapping[str, Any] | None = None) -> None:
        self.fn = fn
        self.jit = TracedInProcess(jit)  # what serves where an ahead-of-time compile fails
        self.inference = inference
        self.folder = folder
        self.dynamic = dynamic
        self.specialize_float = specialize_float
        self.duck_shape = duck_shape
        self.size_oblivious = size_oblivious
        self.inductor = dict(inductor or {})
        self.compiled = 0  # variants compiled by this process
        self.superseded = 0  # of those, classes another process saved meanwhile (its variant serves)
        self._sealed = False
        self._missed = False
        self._variants: list[Any] = []
        self._failed = False  # an AOT compile failed: `jit` serves every call from then on
        self._seen: set[str] = set()  # file names looked at (loaded or refused)
        swept = sweep_aside(folder, SUFFIX, ASIDE_MAX_AGE_S)
        if swept:
            logger.info("%s: %d unfinished variant files removed (writers killed mid-write)", folder.name,
                        swept)
        self._load()

    @property
    def variants(self) -> int:
        return len(self._variants)

    @property
    def failed(self) -> bool:
        """An ahead-of-time compile failed: `jit` serves every call, and nothing more is kept."""
        return self._failed

    def seal(self) -> None:
        """Compile nothing more: inputs no variant serves run `fn` itself. Variants other processes saved
        meanwhile (a cold start's compile workers) are loaded first: a class the warm-up's first stage did
        not meet may come later (engines/token2wav/torch_warmup.py)."""
        if not self._failed:
            self._load()
        self._sealed = True
        self.jit.seal()

    def __call__(self, *args: Any) -> Any:
        if self._failed:
            return self.jit(*args)
        with self._mode():
            for index, variant in enumerate(self._variants):
                if variant.guard_check(*args):
                    if index:  # the class just met first: calls come in runs of one class (a solve)
                        self._variants.insert(0, self._variants.pop(index))
                    return variant(*args)
            if self._sealed:
                if not self._missed:
                    self._missed = True
                    logger.warning("%s: inputs of a shape class not compiled before the warm-up ended run "
                                   "uncompiled", self.folder.name)
                return self.fn(*args)
            variant = self._load(args)  # saved meanwhile by another process or device?
            if variant is None:
                if self._variants and logger.isEnabledFor(logging.INFO):  # why none serves them
                    logger.info("%s: a new shape class compiles; the %d variants' first failing guards: %s",
                                self.folder.name, len(self._variants), self._guard_failures(args))
                variant = self._compile(args)
            if variant is not None:
                return variant(*args)
        return self.jit(*args)

    def _compile(self, args: tuple[Any, ...]) -> Any:
        """A new variant for `args`' class, saved; None when the compile failed (then `jit` serves)."""
        try:
            # Tracing replaces nn.Module.__call__ for every thread while it runs (engines/exclusive.py).
            with EXCLUSIVE, self._settings():
                compiled = torch.compile(self.fn, dynamic=self.dynamic, fullgraph=True)
                variant = compiled.aot_compile((args, {}))  # type: ignore[attr-defined]
            variant.disable_guard_check()  # __call__ checks them before calling
        except Exception as exc:  # an API this torch lacks or a graph it cannot export: compile as before
            logger.warning("%s: ahead-of-time compile failed (%s: %s); compiling in each process instead",
                           self.folder.name, type(exc).__name__, exc)
            self._failed = True
            return None
        self.compiled += 1
        found = self._load(args)
        if found is not None:  # another process saved this class while we compiled it: one file of it
            self.superseded += 1
            return found
        self._variants.append(variant)
        path = self.folder / f"{uuid.uuid4().hex}{SUFFIX}"
        self._seen.add(path.name)
        try:
            # `save_compiled_function` without its write, which leaves its file aside on a failure.
            write_whole(path, type(variant).serialize(variant).serialized_data)
        except Exception as exc:  # a full disk, a read-only folder, an artefact that does not pickle
            logger.warning("%s: a compiled variant could not be saved (%s: %s); the next start compiles it "
                           "again", self.folder.name, type(exc).__name__, exc)
        return variant

    def _guard_failures(self, args: tuple[Any, ...]) -> str:
        """Each variant's first failing guard on `args`, as Dynamo words it (its private API: a torch
        without it says so instead)."""
        reasons = []
        for variant in self._variants:
            try:
                f_locals = variant.prepare_f_locals(*args)
                failed = variant._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts
                reasons.append(str(failed[0]) if failed else "none")
            except Exception as exc:
                reasons.append(f"unknown ({type(exc).__name__})")
        return "; ".join(reason[:300] for reason in reasons)

    def _mode(self) -> contextlib.AbstractContextManager[Any]:
        """The autograd mode the variants' guards were built in (see `inference`)."""
        return torch.inference_mode() if self.inference else contextlib.nullcontext()

    @contextlib.contextmanager
    def _settings(self) -> Iterator[None]:
        """The compile's Dynamo, shape and Inductor settings, while inside. `enable_aot_compile`: off by
        default before torch 2.13, and `torch.compile` only gives its result an `aot_compile` when it is
        on."""
        dynamo: dict[str, Any] = {"specialize_float": self.specialize_float}
        if hasattr(torch._dynamo.config, "enable_aot_compile"):
            dynamo["enable_aot_compile"] = True
        shapes: dict[str, Any] = {"use_duck_shape": self.duck_shape}
        if self.size_oblivious:  # only then: a torch without the setting still compiles the others
            shapes["backed_size_oblivious"] = True
        import torch._inductor.config as inductor_config  # imported by then: Dynamo has imported it

        with (torch._dynamo.config.patch(dynamo), fx_config.patch(shapes),  # type: ignore[attr-defined]
              inductor_config.patch(self.inductor)):
            yield

    def _load(self, args: tuple[Any, ...] | None = None) -> Any:
        """Load the variants saved in the folder since the last look (one that does not load is logged and
        left out); return the first new one whose guards accept `args`, if given."""
        found, before = None, len(self._variants)
        for path in saved_variants(self.folder):
            if path.name in self._seen:
                continue
            self._seen.add(path.name)
            try:
                with path.open("rb") as file, self._mode():
                    variant = torch.compiler.load_compiled_function(file)
            except Exception as exc:  # a file from another torch or a torn write: compile that class anew
                logger.warning("%s: %s did not load (%s: %s); its class compiles again", self.folder.name,
                               path.name, type(exc).__name__, exc)
                continue
            variant.disable_guard_check()  # type: ignore[attr-defined]
            self._variants.append(variant)
            if found is None and args is not None and variant.guard_check(*args):  # type: ignore[attr-defined]
                found = variant
        if len(self._variants) > before and args is None:
            logger.info("%s: %d compiled variants loaded", self.folder.name, len(self._variants) - before)
        return found

