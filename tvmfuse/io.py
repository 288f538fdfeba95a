"""Inputs and outputs of a compiled model without copies: what ``run()`` and ``bind()`` share.

``CompiledModel`` (tvmfuse.compile) and ``Runner`` (tvmfuse.load of an exported artifact) both take this
class's ``run`` / ``bind``; each provides ``inputs``, ``outputs``, ``device``, ``element_aligned_args`` and
``_main()``.

On a CPU target an input array goes to the kernels as it is (a DLPack view, no copy) when it is
C-contiguous, writeable and its data is aligned as the kernels assume (``arg_alignment``); otherwise it is
copied once into a tensor TVM allocates (64-byte aligned), and ``Binding.copied`` says why.  Outputs come
back as numpy arrays that view the tensors the VM allocated for this call (no copy); each call gets new
ones, so an earlier result is never overwritten.  The VM's pooled allocator hands those tensors out
again once nothing holds them (a loop that drops each result reuses two buffers: no page faults).

Cost per call: ``run()`` checks ordinary numpy feeds against a plan made at the first call (``_Plan``:
dtype and shape compares, contiguity and alignment, one DLPack import per input), about 1 us over the
VM call for one input, 0.4 us more per further input (one thread, CPU time, Zen 5;
``benchmarks/io_overhead.py``, its step-by-step table); a model whose input shapes are all static does it
in one function made once per model, which becomes the model's ``run`` after the first call
(``_Plan.run_static``: the VM's function handle, names, dtypes and shapes bound, no loop for one input,
no method lookup on the way); a model with a symbolic input likewise (``_Plan.run_symbolic``), which
checks ranks, fixed and named dims (``_Plan.shapes_ok``) only when the input shapes differ from those of
the last call that passed them.  Feeds that either cannot take (a wrong name, dtype or shape, a TVM
tensor, an array to copy) and, for a symbolic model, preallocated outputs go through the plan's per-dim
checks (``_Plan.in_place``) or the full ones (``validate_feeds``), which name what is wrong.  Outputs are not
allocated by ``run()``: the VM allocates them from its pool, which gives the same two buffers back call
after call while the caller drops each result (no page faults after the first calls; a caller that keeps
every result gets fresh memory each time, or passes ``outputs=``).  The same array object given
again (the zero-copy loop: refill it in place, call again) reuses its DLPack view, so the plan holds the
last inputs until the next call.  A single fresh output is wrapped in one step.  Every Python step after a
kernel that streams megabytes through the caches runs cold (measured, one thread, CPU time, under load:
``run()``'s own steps 3 us after a tiny kernel, 8-12 us after a 3 MB sweep), hence so few of them.  Alone
at two threads that is 2-4 us per call over the VM call after layernorm [512, 768]'s, resnet_block's and
transformer_block's kernels (0.9 us with warm caches): a fixed cost, 5-8% of layernorm's 45 us call, 2-3%
of the others (``benchmarks/notes/io10.md``, Table 3's rounds in us per call).  So a one-input,
one-output model (``run`` and ``bind().run``) makes the VM call and the result's numpy array in C
(``runtime_native``, built at first use; the Python path when it cannot be built): +0.3 us over the VM call
instead of +0.9-1.2 (one thread, under load, ``benchmarks/notes/io11.md``).

Which alignment: by default (``PipelineOptions.element_aligned_args``) tvmfuse compiles CPU kernels that
assume their tensor arguments aligned to the element size only (4 bytes for float32), as every numpy array
is (numpy's allocator gives 16 bytes; a view such as ``a[1:]`` keeps the element alignment): ordinary numpy
inputs are read in place.  Without it (``element_aligned_args=False``, or an artifact exported before the
option existed) the kernels keep TVM's assumption of 64 bytes (``ALIGNMENT``): TVM binds every buffer
argument with ``storage_alignment = data_alignment`` (64, kAllocAlignment; MakePackedAPI's ArgBinder) and
its LLVM code generator gives each vector load and store ``align 64``, so LLVM may emit aligned moves
(vmovaps) that crash (SIGSEGV, no check in the generated code) on a pointer 4, 16 or 32 bytes past a
64-byte boundary; such a model copies every input not made with ``tvmfuse.empty``.

Copies that remain: an input that is not C-contiguous, is read-only (DLPack cannot mark it so), is not
aligned as above (e.g. a float32 view starting at an odd byte), or goes to a GPU.  An element-aligned
input that starts 16-48 bytes past a cache line is not staged into an aligned buffer: the kernels take
the same time on it as on an aligned one on resnet_block and conv3x3 (within noise), less on layernorm,
and 4-6% more on softmax [512, 3072] (about 50 us), which a copy of its 6 MB (about 600 us) cannot repay
(``benchmarks/align_ab.py``; measured under load, ``benchmarks/notes/io8.md``).
"""
from __future__ import annotations

import logging
import os

import numpy as np

from . import _compat as C
from . import runtime_native
from .errors import InputError, TvmfuseError

# Bytes: the alignment TVM's generated CPU kernels assume of every tensor argument unless compiled with
# ``element_aligned_args`` (see the docstring); ``tvmfuse.empty`` allocates on it.
ALIGNMENT = 64


def empty(shape, dtype="float32") -> np.ndarray:
    """An uninitialised C-contiguous numpy array whose data starts on a 64-byte boundary: given as an
    input to ``run()``/``bind()`` it reaches the kernels without a copy."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def zeros(shape, dtype="float32") -> np.ndarray:
    """``empty`` filled with zeros."""
    a = empty(shape, dtype)
    a.fill(0)
    return a


_LOG = logging.getLogger(__name__)
# "0": the first CPU model compiled or loaded leaves numpy's allocator as it is (see aligned_numpy)
ALIGNED_NUMPY_ENV = "TVMFUSE_ALIGNED_NUMPY"
ALIGNED_HANDLER_NAME = "tvmfuse_aligned_64"     # runtime_native.c's handler, as numpy names it
NUMPY_DEFAULT_HANDLER_NAME = "default_allocator"
_aligned_state: dict = {}                       # "auto": what the automatic switch did (once per process)


def _multiarray():
    core = getattr(np, "_core", None) or np.core
    return core.multiarray


def numpy_allocator() -> str:
    """The name of numpy's data allocator in the calling context (NEP 49): ``"tvmfuse_aligned_64"`` once
    ``aligned_numpy()`` is on, numpy's own is ``"default_allocator"``."""
    return str(_multiarray().get_handler_name())


def aligned_numpy(enable: bool = True) -> bool:
    """Make numpy put the data of every array it allocates from now on at a 64-byte boundary (``enable``),
    or go back to numpy's own allocator; True when tvmfuse's aligned allocator is numpy's now.

    Why: numpy's allocator gives 16-byte alignment, so a large array starts 16 bytes past a cache line and
    the kernels' vector loads straddle lines (softmax 8% and sigmoid_chain 15% slower through ``run()`` than
    on TVM's 64-byte-aligned tensors, benchmarks/README.md Table 3, thirteenth session).  The allocator (NEP 49, in
    ``runtime_native.c``) is malloc/calloc/realloc with 72 bytes more per block, keeps calloc's lazily
    zeroed pages and numpy's huge-page advice for blocks of 4 MiB and more; arrays allocated before the
    switch keep their memory and are freed by the allocator that made them.  numpy keeps its allocator in a
    context variable: this sets it for the calling thread (another thread starts with numpy's own).
    Needs the native extension (``runtime_native``): without it this returns False and changes nothing
    (``runtime_native.reason()`` says why).  tvmfuse turns it on by itself when the first CPU model is
    compiled or loaded, unless ``TVMFUSE_ALIGNED_NUMPY=0`` or another allocator than numpy's own is in use.
    """
    module = runtime_native.load()
    if module is None:
        if enable:
            _LOG.info("tvmfuse: numpy's allocator left as it is, the native extension is unavailable (%s)",
                      runtime_native.reason())
        return False
    hugepage = getattr(_multiarray(), "_get_madvise_hugepage", lambda: True)()
    module.set_aligned_handler(bool(enable), bool(hugepage))
    _aligned_state.setdefault("auto", "decided by aligned_numpy()")
    return numpy_allocator() == ALIGNED_HANDLER_NAME


def _auto_aligned_numpy() -> None:
    """The first CPU model compiled or loaded in this process turns ``aligned_numpy`` on (once), unless
    ``TVMFUSE_ALIGNED_NUMPY=0``, ``aligned_numpy()`` was called already, or numpy's allocator is not
    numpy's own (another library's choice is left alone)."""
    if "auto" in _aligned_state:
        return
    if os.environ.get(ALIGNED_NUMPY_ENV, "1") == "0":
        _aligned_state["auto"] = f"off ({ALIGNED_NUMPY_ENV}=0)"
        return
    current = numpy_allocator()
    if current != NUMPY_DEFAULT_HANDLER_NAME:
        _aligned_state["auto"] = f"left alone: numpy's allocator is {current!r}"
        return
    on = aligned_numpy(True)
    _aligned_state["auto"] = "on" if on else f"unavailable: {runtime_native.reason()}"


def aligned_numpy_status() -> str:
    """What the automatic switch of ``aligned_numpy`` did in this process (``"not yet"`` before the first
    CPU model)."""
    return _aligned_state.get("auto", "not yet")


def arg_alignment(dtype, element_aligned: bool) -> int:
    """Bytes: the alignment a CPU kernel assumes of a tensor argument of ``dtype``: the element size when
    compiled with ``element_aligned_args``, else TVM's ``ALIGNMENT``."""
    return np.dtype(dtype).itemsize if element_aligned else ALIGNMENT


def is_aligned(array: np.ndarray, alignment: int = ALIGNMENT) -> bool:
    return array.ctypes.data % alignment == 0


def no_copy_reason(array: np.ndarray, alignment: int = ALIGNMENT) -> str | None:
    """Why ``array`` cannot be given to kernels that assume ``alignment``-byte aligned arguments as it is
    (None: it can)."""
    if not array.flags.c_contiguous:
        return "not C-contiguous"
    if not array.flags.writeable:
        return "read-only (DLPack cannot signal it)"
    if array.size and not is_aligned(array, alignment):
        return (f"data not {alignment}-byte aligned (address % {alignment} = "
                f"{array.ctypes.data % alignment})")
    return None


def _check(spec, dtype: str, shape: tuple, what: str) -> None:
    if dtype != spec.dtype:
        raise InputError(f"{what} {spec.name!r} has dtype {dtype}, the model expects {spec.dtype}")
    if len(shape) != len(spec.shape) or any(isinstance(d, int) and d != s for d, s in zip(spec.shape, shape)):
        raise InputError(f"{what} {spec.name!r} has shape {list(shape)}, the model expects {list(spec.shape)}")


def _is_tensor(x) -> bool:
    return isinstance(x, C.Tensor)


def _same_device(a, b) -> bool:
    return str(a) == str(b)


def validate_feeds(feeds: dict, inputs: list, upper_bounds: dict | None = None) -> list:
    """Feeds in parameter order (numpy arrays or TVM tensors, not converted), or an InputError naming the
    input and what is wrong with it (a symbolic dim above its bound in ``upper_bounds`` too:
    ``_check_bounds``)."""
    if not isinstance(feeds, dict):
        raise InputError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
    names = [i.name for i in inputs]
    unknown = sorted(set(feeds) - set(names))
    if unknown:
        raise InputError(f"unknown input name(s) {unknown}; the model's inputs are {names}")
    missing = [n for n in names if n not in feeds]
    if missing:
        raise InputError(f"missing input(s) {missing}; the model's inputs are {names}")
    values = []
    for spec in inputs:
        v = feeds[spec.name]
        if _is_tensor(v):
            _check(spec, str(v.dtype), tuple(v.shape), "input")
        else:
            v = np.asarray(v)
            _check(spec, str(v.dtype), v.shape, "input")
        values.append(v)
    sizes = _check_symbolic_dims(values, inputs)
    if upper_bounds:
        _check_bounds(sizes, upper_bounds)
    return values


def _check_bounds(sizes: dict, upper_bounds: dict) -> None:
    """An InputError when a symbolic dim of the feeds (``sizes``: _check_symbolic_dims) is above its bound:
    the model's memory is planned for at most that size (``PipelineOptions.shape_upper_bounds``)."""
    for d, bound in upper_bounds.items():
        if d in sizes and sizes[d][0] > bound:
            size, name, axis = sizes[d]
            raise InputError(f"symbolic dim {d!r} is {size} in input {name!r} (axis {axis}), above the bound "
                             f"{bound} the model was compiled for (shape_upper_bounds: its memory is planned "
                             f"for at most {bound}); recompile with a larger bound")


def _check_symbolic_dims(values: list, inputs: list) -> dict[str, tuple[int, str, int]]:
    """Inputs that share a symbolic dim (``sequence``) must agree on its size; an InputError names it.
    Returns each symbolic dim -> (size, the first input it sizes, its axis there)."""
    seen: dict[str, tuple[int, str, int]] = {}
    for spec, v in zip(inputs, values):
        for axis, (d, n) in enumerate(zip(spec.shape, tuple(v.shape))):
            if not isinstance(d, str) or not d.isidentifier():   # an expression (n + 1) is the VM's to check
                continue
            if d in seen and seen[d][0] != n:
                size, other, other_axis = seen[d]
                raise InputError(f"symbolic dim {d!r} is {size} in input {other!r} (axis {other_axis}) but {n} in "
                                 f"input {spec.name!r} (axis {axis}); inputs that share it must agree")
            seen.setdefault(d, (int(n), spec.name, axis))
    return seen


class Binding:
    """Inputs placed on the model's device once, for many runs (onnxruntime's IOBinding): made by
    ``model.bind(feeds)``.  ``inputs`` are the device tensors (on a CPU target, views of the given arrays
    when they allow it, see ``copied``); ``update(feeds)`` writes new values into them in place;
    ``run(outputs=None)`` runs the model on them."""

    def __init__(self, model, feeds: dict):
        self._model = model
        values = validate_feeds(feeds, model.inputs, model.shape_upper_bounds)
        self.copied: dict[str, str] = {}
        tensors = []
        for spec, v in zip(model.inputs, values):
            t, why = model._to_device(v)
            tensors.append(t)
            if why:
                self.copied[spec.name] = why
        self.inputs: dict = {s.name: t for s, t in zip(model.inputs, tensors)}
        self._args = tensors
        self._ptrs = [t.data_ptr() for t in tensors]     # an output at one of these is an input: copied
        # (the VM function, runtime_native's call_one or None, the function's and the input's handles, the
        # output's numpy type number): made at the first run() of a one-input model, again if _main changed
        self._native = None

    def update(self, feeds: dict) -> None:
        """Copy new values into bound inputs (same shape and dtype), e.g. the next batch."""
        specs = {s.name: s for s in self._model.inputs}
        for name, v in feeds.items():
            if name not in specs:
                raise InputError(f"unknown input name {name!r}; the model's inputs are {list(specs)}")
            a = np.asarray(v) if not _is_tensor(v) else v
            _check(specs[name], str(a.dtype), tuple(a.shape), "input")
            dst = self.inputs[name]
            if _is_tensor(a):
                a.copyto(dst)
            elif not (name not in self.copied and a.ctypes.data == dst.data_ptr()):   # else: already there
                dst.copyfrom(np.ascontiguousarray(a))

    def run(self, outputs: dict | None = None) -> dict[str, np.ndarray]:
        model = self._model
        plan = model.__dict__.get("_plan") or model._io_plan()
        # preallocated outputs: static ones checked by the plan, a model with a symbolic output fully
        if outputs and (plan.symbolic_outputs or not plan.static_outputs_ok(outputs)):
            model._validate_outputs(outputs)
        main = model._main()
        if not outputs and len(self._args) == 1:     # one input, one output: runtime_native's step
            native = self._native
            if native is None or native[0] is not main:
                call_one = _native_call(plan, model, main, "call_one") if _is_tensor(self._args[0]) else None
                native = self._native = (main, call_one, main.__chandle__() if call_one else None,
                                         self._args[0].__chandle__() if call_one else None,
                                         _numpy_typenum_of_output(model) if call_one else None)
            if native[1] is not None:
                out = native[1](native[2], native[3], self._ptrs[0], plan.single, native[4])
                if out is not None:
                    return out
                self._native = (main, None, None, None, None)    # handed back: the Python path from now on
        result = main(*self._args)
        # one fresh output on a CPU, none given: its view at once, as run() (else _finish)
        if (plan.single is not None and plan.on_cpu and not outputs and type(result) is C.Tensor
                and C.strong_ref_count(result) <= 2 and result.data_ptr() not in self._ptrs):
            return {plan.single: np.from_dlpack(result)}
        return model._finish(result, outputs, self._args)


class Executes:
    """``run`` and ``bind`` of a compiled model or a loaded artifact (needs ``inputs``, ``outputs``,
    ``device``, ``element_aligned_args`` and ``_main()``)."""

    inputs: list
    outputs: list
    device: object
    # True: the CPU kernels assume element-size alignment of their arguments (see the module docstring)
    element_aligned_args: bool = False
    # symbolic dim -> the largest size the model's memory plan holds (PipelineOptions.shape_upper_bounds)
    shape_upper_bounds: dict = {}

    def _main(self):
        raise NotImplementedError

    def _on_cpu(self) -> bool:
        return str(self.device).startswith("cpu")

    def _align_numpy(self) -> None:
        """Called by the constructors: a CPU model turns ``aligned_numpy`` on (once per process)."""
        if self._on_cpu():
            _auto_aligned_numpy()

    def _to_device(self, value):
        """(tensor on the model's device, why it was copied or None)."""
        if _is_tensor(value):
            if not _same_device(value.device, self.device):
                raise InputError(f"a tensor on {value.device} was given; the model runs on {self.device}")
            if not value.is_contiguous():
                return C.tensor(value.numpy(), self.device), "tensor not contiguous"
            return value, None
        if not self._on_cpu():
            return C.tensor(np.array(value, order="C", copy=True), self.device), "host to device"
        why = no_copy_reason(value, arg_alignment(value.dtype, self.element_aligned_args))
        if why is None:
            return C.from_dlpack(value), None
        return C.tensor(np.array(value, order="C", copy=True), self.device), why

    def _output_count_error(self, got: int) -> Exception:
        return TvmfuseError(f"the model returned {got} outputs, it declares {len(self.outputs)}")

    def _validate_outputs(self, outputs: dict | None) -> None:
        """Preallocated outputs: known names, arrays or tensors of the output's shape and dtype, writeable."""
        if not outputs:
            return
        specs = {s.name: s for s in self.outputs}
        unknown = sorted(set(outputs) - set(specs))
        if unknown:
            raise InputError(f"unknown output name(s) {unknown}; the model's outputs are {list(specs)}")
        for name, dst in outputs.items():
            if _is_tensor(dst):
                _check(specs[name], str(dst.dtype), tuple(dst.shape), "output")
                continue
            if not isinstance(dst, np.ndarray):
                raise InputError(f"output {name!r}: give a numpy array or a TVM tensor, not {type(dst).__name__}")
            _check(specs[name], str(dst.dtype), dst.shape, "output")
            if not dst.flags.writeable:
                raise InputError(f"output {name!r}: the array given is read-only")

    def _finish(self, result, outputs: dict | None, args: list) -> dict[str, np.ndarray]:
        """The VM's result as {output name: numpy array}: views of the result tensors on a CPU, written
        into ``outputs[name]`` where given."""
        plan = self._io_plan()
        if type(result) is C.Tensor:                  # one output: no tuple to walk
            flat = [(result, 0)]
        else:
            flat = _flatten(result)
        if len(flat) != len(plan.output_names):
            raise self._output_count_error(len(flat))
        given = outputs or {}
        taken = [a.data_ptr() for a in args]
        out = {}
        for spec, name, (t, holders) in zip(self.outputs, plan.output_names, flat):
            if name in given:
                dst = given[name]
                # a symbolic output: its size is known only now (a static one was checked before the call)
                if name in plan.symbolic_outputs and tuple(dst.shape) != tuple(t.shape):
                    raise InputError(f"output {name!r} has shape {list(dst.shape)}, this call's result has "
                                     f"shape {list(t.shape)}")
                if plan.on_cpu and type(dst) is np.ndarray:
                    np.copyto(dst, np.from_dlpack(t))
                    out[name] = dst
                else:
                    out[name] = _write_into(dst, t, spec)
                continue
            if not plan.on_cpu:
                out[name] = t.numpy()
                continue
            # A view only of a tensor nobody else holds: not of the caller's input (Identity returns it),
            # another output's memory, or one of the VM's constants (a constant output: writing into the
            # view would change the model).  A fresh result is held by our wrapper, each tuple it sits in
            # and, for the top-level value, the VM (it keeps its last return value until the next call);
            # a constant also by the executable's constant pool and the VM's registers.
            # (counted before the view is made: the view holds a reference too)
            ptr = t.data_ptr()
            shared = ptr in taken or C.strong_ref_count(t) > 2 + holders
            view = np.from_dlpack(t)
            if shared and view.size:
                view = view.copy()
            taken.append(ptr)
            out[name] = view
        return out

    def run(self, feeds: dict, outputs: dict | None = None) -> dict[str, np.ndarray]:
        """Run on ``feeds`` ({input name: numpy array or TVM tensor}); returns {output name: numpy array}.

        No copies on a CPU target: an input that is C-contiguous, writeable and aligned as the kernels
        assume (any ordinary numpy array, see the module docstring) is read in place (others are copied
        once); outputs view the result tensors of this call.  ``outputs`` ({name: array or TVM tensor of
        the output's shape and dtype}) receives those results instead (one copy each).
        """
        plan = self.__dict__.get("_plan") or self._io_plan()
        fast = plan.run_static or plan.run_symbolic
        if fast is not None:              # the first call (_io_plan made it the model's run)
            return fast(feeds, outputs)
        return self._run_checked(feeds, outputs, plan)

    def _run_checked(self, feeds: dict, outputs: dict | None, plan: "_Plan") -> dict[str, np.ndarray]:
        """``run()`` of every call the fast paths (``_static_run``, ``_symbolic_run``) do not take, and of a
        model without one (a dtype numpy lacks, a GPU): the per-dim checks (``_Plan.in_place``), else the
        full ones, which copy what must be copied and raise the InputError that names what is wrong."""
        placed = plan.in_place(feeds)
        if placed is None:                # not the common case: the full checks (and their clear errors)
            values = validate_feeds(feeds, self.inputs, self.shape_upper_bounds)
            args = [self._to_device(v)[0] for v in values]
            ptrs = None
        else:
            args, ptrs = placed
        if outputs:
            self._validate_outputs(outputs)
        result = self._main()(*args)
        # The common case in as few steps as possible (issue 11: after a kernel that streams megabytes
        # through the caches every Python step afterwards costs several times its cold-cache price): one
        # output, none given, a tensor nobody else holds (our wrapper and the VM's last-result register)
        # that is not an input (an Identity or reshape returns the input's memory).  All else: _finish.
        if (ptrs is not None and plan.single is not None and not outputs and type(result) is C.Tensor
                and C.strong_ref_count(result) <= 2 and result.data_ptr() not in ptrs):
            return {plan.single: np.from_dlpack(result)}
        return self._finish(result, outputs, args)

    def _io_plan(self) -> _Plan:
        """What every call checks, worked out at the first call (the specs, device and alignment of a
        model do not change after it is built).  The model's ``run`` becomes the plan's ``run_static`` or
        ``run_symbolic`` (an instance attribute: later calls reach it without this method's lookups)."""
        plan = self.__dict__.get("_plan")
        if plan is None:
            plan = self.__dict__["_plan"] = _Plan(self)
            fast = plan.run_static or plan.run_symbolic
            if fast is not None:
                self.__dict__["run"] = fast
        return plan

    def _reset_plan(self) -> None:
        """Drop the per-model plan (and the ``run`` made from it): the next call makes them again, e.g.
        after ``_main`` was replaced."""
        self.__dict__.pop("_plan", None)
        self.__dict__.pop("run", None)

    def __copy__(self):
        # a copy makes its own plan: the one cached here binds this object's VM function and _finish
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._reset_plan()
        return new

    def bind(self, feeds: dict) -> Binding:
        """Place ``feeds`` on the device once for many ``Binding.run()`` calls (see ``Binding``)."""
        return Binding(self, feeds)


class _Plan:
    """The per-model part of ``run()``'s checks, computed once (``Executes._io_plan``) so that a call with
    ordinary inputs costs a few dict lookups and comparisons per input (issue 11: ``run()`` within 5% of
    the VM call; the checks per call were 30-40 us before, most of it ``str(array.dtype)``, ``ctypes``
    addresses and building the error-message data every call).

    ``in_place_args(feeds)`` gives the VM's arguments when every feed is a numpy array of the declared
    dtype and shape that the kernels can read in place (CPU, C-contiguous, writeable, aligned as they
    assume), else None: then ``run()`` takes the full path (``validate_feeds`` + ``_to_device``), which
    copies what must be copied and raises the InputError that names what is wrong."""

    __slots__ = ("on_cpu", "checks", "output_names", "fast", "bounds", "single", "last", "path", "run_static",
                 "run_symbolic", "symbolic_outputs", "static_outputs_ok")

    def __init__(self, model: "Executes"):
        self.on_cpu = model._on_cpu()
        self.bounds = tuple(model.shape_upper_bounds.items())
        self.output_names = [s.name for s in model.outputs]
        # preallocated outputs that need no full check (static_outputs_ok(outputs) -> bool)
        self.static_outputs_ok = _static_outputs_check(model)
        # outputs whose shape has a symbolic dim: a preallocated one is compared with the result (_finish)
        self.symbolic_outputs = frozenset(s.name for s in model.outputs
                                          if not all(isinstance(d, int) for d in s.shape))
        # the output's name when the model has exactly one (run()'s shortest path)
        self.single = self.output_names[0] if len(self.output_names) == 1 else None
        # per input: (name, numpy dtype, static shape or None, its symbolic dims (_symbolic_dims), alignment
        # in bytes)
        self.checks = []
        self.fast = self.on_cpu
        for spec in model.inputs:
            dtype = _numpy_dtype(spec.dtype)
            if dtype is None:                       # numpy has no such dtype (bfloat16): the full path
                self.fast = False
                continue
            static = all(isinstance(d, int) for d in spec.shape)
            self.checks.append((spec.name, dtype, tuple(spec.shape) if static else None,
                                None if static else _symbolic_dims(spec.shape),
                                arg_alignment(dtype, model.element_aligned_args)))
        # per input: (the array last given, its DLPack view, its data pointer, its shape, the view's tvm-ffi
        # handle: runtime_native's argument) or None.  The same array object in the next call reuses its
        # view (no DLPack import): its memory cannot have moved (numpy 2 has no writable ``.data``;
        # resizing an exported array is refused) and its shape is compared.  The plan keeps the last
        # inputs alive until the next call, as the VM keeps its last result.  numpy 1.x could reassign
        # ``.data``: no reuse there.
        self.last = [None] * len(self.checks) if _ARRAY_DATA_FIXED else None
        # which path ordinary numpy feeds take: "static" (every input's shape fixed: ``run_static``, made
        # once here), "symbolic" (``in_place``: rank, fixed and named dims, bounds) or "checked" (no
        # numpy dtype or not a CPU: every call gets the full checks)
        static = self.fast and all(c[2] is not None for c in self.checks)
        self.path = "static" if static else "symbolic" if self.fast else "checked"
        self.run_static = _static_run(self, model) if static else None
        self.run_symbolic = _symbolic_run(self, model) if self.path == "symbolic" else None

    def in_place_args(self, feeds) -> list | None:
        placed = self.in_place(feeds)
        return None if placed is None else placed[0]

    def shapes_ok(self, shapes: tuple) -> bool:
        """Whether input shapes (one tuple per input, in order) are what the model takes: static dims
        equal, named dims agreeing across inputs and within their bounds (``in_place``'s shape checks)."""
        sizes: dict = {}
        for (_, _, shape, dims, _), shp in zip(self.checks, shapes):
            if shape is not None:
                if shp != shape:
                    return False
                continue
            ndim, fixed, named = dims
            if len(shp) != ndim:
                return False
            for axis, n in fixed:
                if shp[axis] != n:
                    return False
            for axis, d in named:
                n = shp[axis]
                if sizes.setdefault(d, n) != n:
                    return False
        for d, bound in self.bounds:
            if sizes.get(d, 0) > bound:
                return False
        return True

    def in_place(self, feeds) -> tuple[list, list] | None:
        """(the VM's arguments, their data pointers) when every feed can be read in place, else None."""
        if not self.fast or type(feeds) is not dict or len(feeds) != len(self.checks):
            return None
        args, ptrs = [], []
        sizes: dict = {}
        last = self.last
        for i, (name, dtype, shape, dims, alignment) in enumerate(self.checks):
            v = feeds.get(name)
            if type(v) is not np.ndarray or v.dtype != dtype:
                return None
            if shape is not None:
                if v.shape != shape:
                    return None
            else:                                   # symbolic: rank, static dims, then named dims
                ndim, fixed, named = dims
                shp = v.shape
                if len(shp) != ndim:
                    return None
                for axis, n in fixed:
                    if shp[axis] != n:
                        return None
                for axis, d in named:
                    n = shp[axis]
                    if sizes.setdefault(d, n) != n:
                        return None
            flags = v.flags
            if not (flags.c_contiguous and flags.writeable):
                return None
            seen = last[i] if last is not None else None
            if seen is not None and seen[0] is v and seen[3] == v.shape:
                t, ptr = seen[1], seen[2]
            else:
                t = C.from_dlpack(v)
                ptr = t.data_ptr()
                if ptr % alignment:
                    return None
                if last is not None:
                    last[i] = (v, t, ptr, v.shape, t.__chandle__())
            args.append(t)
            ptrs.append(ptr)
        for d, bound in self.bounds:          # above its bound: the full path names it (InputError)
            if sizes.get(d, 0) > bound:
                return None
        return args, ptrs


def _static_run(plan: _Plan, model: "Executes"):
    """``run(feeds, outputs=None)`` for a model whose inputs all have static shapes, as one function with
    everything per model bound once (the VM's function handle, names, dtypes, shapes, alignments, the
    output checks); ``_io_plan`` makes it the model's ``run`` (CompiledModel and Runner alike).  A feed or
    output that is not the ordinary case goes, before any VM call, to ``Executes._run_checked``, which
    copies what must be copied or raises the InputError.

    Per call: per input a type, shape, dtype and flags compare and, for an array object not given in the
    last call, its DLPack import; the VM call; for one fresh output its numpy view (else ``_finish``).
    (issue 11: the checks loop, its lists and the method calls cost about as much as the VM call of a
    tiny model.)"""
    main = model._main()
    finish = model._finish
    checked = model._run_checked
    specs = tuple((name, dtype, shape, alignment) for name, dtype, shape, _, alignment in plan.checks)
    count = len(specs)
    single = plan.single
    last = plan.last                   # None: numpy 1.x (an array's memory may move), no view reuse
    outputs_ok = plan.static_outputs_ok
    ndarray, tensor_type, from_dlpack = np.ndarray, C.Tensor, C.from_dlpack
    ref_word, numpy_view = C.strong_ref_word, np.from_dlpack     # ref_word(h).value: C.strong_ref_count
    # several inputs, one output: the VM call and the numpy result in C (runtime_native's call_many), as
    # run_native does for one input; [None] once the C step handed a result back (the Python path from then)
    many = [_native_call(plan, model, main, "call_many")] if count > 1 else [None]
    main_handle = main.__chandle__() if many[0] is not None else None
    typenum = _numpy_typenum_of_output(model) if many[0] is not None else None

    def run(feeds, outputs=None):
        if type(feeds) is not dict or len(feeds) != count or (outputs and not outputs_ok(outputs)):
            return checked(feeds, outputs, plan)
        args, ptrs = [None] * count, [0] * count
        call_many = many[0] if not outputs else None
        handles = [0] * count if call_many is not None else None
        i = 0
        for name, dtype, shape, alignment in specs:
            v = feeds.get(name)
            # carray: C-contiguous, writeable and aligned to the dtype (a view at an odd byte is not);
            # numpy's dtype of a native type is one object: ``is`` first, the compare only otherwise
            if (type(v) is not ndarray or v.shape != shape or (v.dtype is not dtype and v.dtype != dtype)
                    or not v.flags.carray):
                return checked(feeds, outputs, plan)
            seen = last[i] if last is not None else None
            if seen is not None and seen[0] is v:       # the same array object: same memory and shape
                t, ptr, handle = seen[1], seen[2], seen[4]
            else:
                t = from_dlpack(v)
                ptr = t.data_ptr()
                if ptr % alignment:
                    return checked(feeds, outputs, plan)
                handle = t.__chandle__()
                if last is not None:
                    last[i] = (v, t, ptr, shape, handle)
            args[i] = t
            ptrs[i] = ptr
            if handles is not None:
                handles[i] = handle
            i += 1
        if call_many is not None:
            out = call_many(main_handle, tuple(handles), tuple(ptrs), single, typenum)
            if out is not None:
                return out
            many[0] = None                             # handed back: the Python path from now on
        result = main(*args)
        # one fresh output, none given: a tensor only our wrapper and the VM's last-result register hold,
        # not an input's memory (see run())
        if (single is not None and not outputs and type(result) is tensor_type
                and ref_word(result.__chandle__()).value <= 2 and result.data_ptr() not in ptrs):
            return {single: numpy_view(result)}
        return finish(result, outputs, args)

    if count != 1 or single is None:
        return _like_run(run)
    (name0, dtype0, shape0, alignment0), = specs
    seen0 = last if last is not None else [None]      # numpy 1.x: nothing is stored, nothing matches

    def run_one(feeds, outputs=None):
        """``run`` for one input and one output (most models): no loop, no lists, no test made per model
        (issue 11: after a kernel that swept the caches each step costs several times its warm price;
        io10: fewer tests per call and the reference count read without a frame).  Preallocated
        ``outputs`` take the general static path."""
        if outputs is not None:                      # preallocated outputs: the loop's path checks them
            return run(feeds, outputs)
        if type(feeds) is not dict or len(feeds) != 1:
            return checked(feeds, outputs, plan)
        v = feeds.get(name0)
        if (type(v) is not ndarray or v.shape != shape0 or (v.dtype is not dtype0 and v.dtype != dtype0)
                or not v.flags.carray):
            return checked(feeds, outputs, plan)
        seen = seen0[0]
        if seen is not None and seen[0] is v:
            t, ptr = seen[1], seen[2]
        else:
            t = from_dlpack(v)
            ptr = t.data_ptr()
            if ptr % alignment0:
                return checked(feeds, outputs, plan)
            if last is not None:
                last[0] = (v, t, ptr, shape0, t.__chandle__())
        result = main(t)
        if type(result) is tensor_type and ref_word(result.__chandle__()).value <= 2 and result.data_ptr() != ptr:
            return {single: numpy_view(result)}
        return finish(result, None, [t])

    call_one = _native_call(plan, model, main, "call_one")
    if call_one is not None:
        return _like_run(_native_run_one(run, run_one, main, call_one, checked, finish, plan, specs[0], last,
                                         seen0, _numpy_typenum_of_output(model)))
    return _like_run(run_one)


def _native_call(plan: "_Plan", model: "Executes", main, which: str):
    """``runtime_native``'s ``call_one`` (``which``; one input) or ``call_many`` (several inputs) when this
    model's one-output run can use it (a CPU, an output dtype it produces, ``main`` a tvm-ffi function, the
    extension built or loaded), else None (the Python path)."""
    inputs_ok = len(plan.checks) == 1 if which == "call_one" else 1 < len(plan.checks) <= runtime_native.MAX_INPUTS
    if (type(main) is not C.FfiFunction or not plan.on_cpu or plan.single is None or not inputs_ok
            or _numpy_typenum_of_output(model) is None):
        return None
    module = runtime_native.load()
    return None if module is None else getattr(module, which)


def _numpy_typenum_of_output(model: "Executes") -> int | None:
    return runtime_native.numpy_typenum(model.outputs[0].dtype) if _numpy_dtype(model.outputs[0].dtype) else None


def _native_run_one(run, run_one, main, call_one, checked, finish, plan: "_Plan", spec, last, seen0,
                    typenum: int):
    """``run`` for one input and one output with the VM call and the result's numpy array made in C
    (``runtime_native``: after a kernel that swept the caches every Python step there runs cold, issue 11).
    The input checks are ``_static_run``'s ``run_one``'s; a result the C step does not take (an error, an
    unexpected kind of result) is made again through tvm-ffi's Python call and ``_finish``, which raise or
    handle it as without the native step; later calls then take the Python path (``run_one``) directly,
    so a result the C step never takes does not cost two VM calls each time."""
    name0, dtype0, shape0, alignment0 = spec
    single = plan.single
    main_handle = main.__chandle__()            # ``main`` (held by this closure) keeps the handle valid
    ndarray, from_dlpack = np.ndarray, C.from_dlpack
    python_only = [False]                      # set once the C step handed a result back

    def run_native(feeds, outputs=None):
        if outputs is not None:                      # preallocated outputs: the loop's path checks them
            return run(feeds, outputs)
        if python_only[0]:
            return run_one(feeds)
        if type(feeds) is not dict or len(feeds) != 1:
            return checked(feeds, outputs, plan)
        v = feeds.get(name0)
        if (type(v) is not ndarray or v.shape != shape0 or (v.dtype is not dtype0 and v.dtype != dtype0)
                or not v.flags.carray):
            return checked(feeds, outputs, plan)
        seen = seen0[0]
        if seen is not None and seen[0] is v:
            t, ptr, handle = seen[1], seen[2], seen[4]
        else:
            t = from_dlpack(v)
            ptr = t.data_ptr()
            if ptr % alignment0:
                return checked(feeds, outputs, plan)
            handle = t.__chandle__()
            if last is not None:
                last[0] = (v, t, ptr, shape0, handle)
        out = call_one(main_handle, handle, ptr, single, typenum)
        if out is not None:
            return out
        python_only[0] = True
        return finish(main(t), None, [t])

    return run_native


def _static_outputs_check(model: "Executes"):
    """``outputs_ok(outputs) -> bool``: whether preallocated outputs need no full check
    (``Executes._validate_outputs``): a dict of writeable numpy arrays, each of a static output's dtype and
    shape.  False sends them to the full check, which names what is wrong."""
    out_checks = {}                    # output name -> (numpy dtype, static shape)
    for spec in model.outputs:
        dtype = _numpy_dtype(spec.dtype)
        if dtype is not None and all(isinstance(d, int) for d in spec.shape):
            out_checks[spec.name] = (dtype, tuple(spec.shape))
    ndarray = np.ndarray

    def outputs_ok(outputs) -> bool:
        if type(outputs) is not dict:
            return False
        for name, dst in outputs.items():
            check = out_checks.get(name)
            if (check is None or type(dst) is not ndarray or dst.dtype != check[0] or dst.shape != check[1]
                    or not dst.flags.writeable):
                return False
        return True

    return outputs_ok


def _symbolic_run(plan: _Plan, model: "Executes"):
    """``run(feeds, outputs=None)`` for a model with a symbolic input (``batch``), bound once per model as
    ``_static_run`` is.  Per call: per input a type, dtype and flags test and its shape; the shape checks
    (``_Plan.shapes_ok``: rank, fixed dims, named dims agreeing across inputs, bounds) only when the shapes
    differ from the last call's that passed them (a loop over one size pays them once); the VM call; for
    one fresh output its numpy view (both in C, ``runtime_native``, where it is built, as for a static
    model; session 13: qwen2 at one token paid 3.7 us more in Python).  Preallocated numpy outputs are
    checked against this call's sizes of the named dims (an output whose dims are numbers or the inputs' named dims; others, and feeds it
    cannot take: a wrong name, dtype or shape, an array to copy) go to ``Executes._run_checked`` before
    any VM call."""
    main = model._main()
    finish = model._finish
    checked = model._run_checked
    specs = tuple((name, dtype, alignment) for name, dtype, _, _, alignment in plan.checks)
    count = len(specs)
    single = plan.single
    last = plan.last                   # None: numpy 1.x (an array's memory may move), no view reuse
    shapes_ok = plan.shapes_ok
    passed = [None]                    # the input shapes of the last call that passed shapes_ok
    ndarray, tensor_type, from_dlpack = np.ndarray, C.Tensor, C.from_dlpack
    ref_word, numpy_view = C.strong_ref_word, np.from_dlpack     # ref_word(h).value: C.strong_ref_count
    # (input index, axis, name) of every named dim of the inputs: the sizes of a call, for its outputs
    named_at = tuple((i, axis, d) for i, (_, _, _, dims, _) in enumerate(plan.checks) if dims is not None
                     for axis, d in dims[2])
    named = {d for _, _, d in named_at}
    # output name -> (numpy dtype, dims: numbers and the inputs' named dims): preallocated outputs checked here
    out_checks = {}
    for spec in model.outputs:
        dtype = _numpy_dtype(spec.dtype)
        if dtype is not None and all(isinstance(d, int) or d in named for d in spec.shape):
            out_checks[spec.name] = (dtype, tuple(spec.shape))

    def outputs_ok(outputs, shapes) -> bool:
        if type(outputs) is not dict:
            return False
        sizes = {d: shapes[i][axis] for i, axis, d in named_at}
        for name, dst in outputs.items():
            check = out_checks.get(name)
            if (check is None or type(dst) is not ndarray or dst.dtype != check[0] or not dst.flags.writeable
                    or dst.shape != tuple(d if type(d) is int else sizes[d] for d in check[1])):
                return False
        return True

    # one output: the VM call and the numpy result in C (runtime_native's call_one / call_many), as for a
    # static model; [None] once the C step handed a result back (the Python path from then on)
    native = [_native_call(plan, model, main, "call_one" if count == 1 else "call_many")]
    main_handle = main.__chandle__() if native[0] is not None else None
    typenum = _numpy_typenum_of_output(model) if native[0] is not None else None

    def run(feeds, outputs=None):
        if type(feeds) is not dict or len(feeds) != count:
            return checked(feeds, outputs, plan)
        args, ptrs, shapes, handles = [None] * count, [0] * count, [None] * count, [0] * count
        i = 0
        for name, dtype, alignment in specs:
            v = feeds.get(name)
            if type(v) is not ndarray or (v.dtype is not dtype and v.dtype != dtype) or not v.flags.carray:
                return checked(feeds, outputs, plan)
            shape = v.shape
            seen = last[i] if last is not None else None
            if seen is not None and seen[0] is v and seen[3] == shape:
                t, ptr, handle = seen[1], seen[2], seen[4]
            else:
                t = from_dlpack(v)
                ptr = t.data_ptr()
                if ptr % alignment:
                    return checked(feeds, outputs, plan)
                handle = t.__chandle__()
                if last is not None:
                    last[i] = (v, t, ptr, shape, handle)
            args[i] = t
            ptrs[i] = ptr
            shapes[i] = shape
            handles[i] = handle
            i += 1
        shapes = tuple(shapes)
        if shapes != passed[0]:
            if not shapes_ok(shapes):
                return checked(feeds, outputs, plan)
            passed[0] = shapes
        if outputs:
            if not outputs_ok(outputs, shapes):
                return checked(feeds, outputs, plan)
            return finish(main(*args), outputs, args)
        call = native[0]
        if call is not None:
            out = (call(main_handle, handles[0], ptrs[0], single, typenum) if count == 1
                   else call(main_handle, tuple(handles), tuple(ptrs), single, typenum))
            if out is not None:
                return out
            native[0] = None                            # handed back: the Python path from now on
        result = main(*args)
        if (single is not None and type(result) is tensor_type and ref_word(result.__chandle__()).value <= 2
                and result.data_ptr() not in ptrs):
            return {single: numpy_view(result)}
        return finish(result, outputs, args)

    if count != 1 or native[0] is None or last is None:
        return _like_run(run)
    (name0, dtype0, _), = specs
    seen0 = last                                      # [the last call's (array, view, ptr, shape, handle)]

    def run_one(feeds, outputs=None):
        """``run`` for one input and one output with the native step, when the array object and its shape
        are the last call's (a loop over one size): one type, dtype and flags test, two shape compares and
        the C call (session 13: the general loop's lists and tuples cost about 1 us per call of qwen2 at
        one token, 8% of its 15 us); anything else takes ``run`` above, which checks and stores."""
        if outputs is not None or type(feeds) is not dict or len(feeds) != 1:
            return run(feeds, outputs)
        v = feeds.get(name0)
        seen = seen0[0]
        if (seen is None or seen[0] is not v or type(v) is not ndarray or seen[3] != v.shape
                or (v.dtype is not dtype0 and v.dtype != dtype0) or not v.flags.carray):
            return run(feeds)
        ok = passed[0]
        call = native[0]
        if ok is None or ok[0] != seen[3] or call is None:
            return run(feeds)
        out = call(main_handle, seen[4], seen[2], single, typenum)
        if out is not None:
            return out
        native[0] = None                                # handed back: the Python path from now on
        return run(feeds)

    return _like_run(run_one)


def _like_run(fn):
    """``fn`` (a model's ``run`` made by ``_static_run`` or ``_symbolic_run``) named and documented as
    ``Executes.run``."""
    fn.__name__, fn.__qualname__, fn.__doc__ = "run", "Executes.run", Executes.run.__doc__
    return fn


# numpy 2 made ``ndarray.data`` read-only: an array object's memory never moves (``_Plan.last``)
_ARRAY_DATA_FIXED = int(np.__version__.split(".")[0]) >= 2


def _numpy_dtype(name: str):
    """numpy's dtype for a model's dtype name, or None where numpy has none (``bfloat16``)."""
    return np.dtype(name) if name in np.sctypeDict else None


def _symbolic_dims(dims: tuple) -> tuple[int, tuple, tuple]:
    """A symbolic input's shape (ints and names) as what ``_Plan.in_place_args`` checks per call: its rank,
    (axis, size) of its static dims and (axis, name) of its named dims (an expression, ``n + 1``, is the
    VM's to check), worked out once instead of per dim per call."""
    fixed = tuple((a, d) for a, d in enumerate(dims) if isinstance(d, int))
    named = tuple((a, d) for a, d in enumerate(dims) if isinstance(d, str) and d.isidentifier())
    return len(dims), fixed, named


def _flatten(value, depth: int = 0) -> list:
    """[(tensor, how many of the result's tuples hold it)] in output order."""
    if _is_tensor(value):
        return [(value, depth)]
    out = []
    for v in value:
        out.extend(_flatten(v, depth + 1))
    return out


def _write_into(dst, t, spec):
    """Copy result tensor ``t`` into the preallocated ``dst`` (checked by ``_validate_outputs``)."""
    if _is_tensor(dst):
        t.copyto(dst)
    elif str(t.device).startswith("cpu"):
        np.copyto(dst, np.from_dlpack(t))
    else:
        np.copyto(dst, t.numpy())
    return dst
